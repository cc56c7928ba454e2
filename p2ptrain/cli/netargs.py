"""The network arguments of ``join``, ``bootstrap`` and ``status``, checked before anything starts.

Multiaddrs are parsed here (standard library only: the same grammar and protocol table as the parser
hivemind carries, which tests/cli/test_netargs.py runs side by side), so that a typo fails at once with the
flag's name instead of after the daemon's connection retries. A list flag is repeatable, and its
``P2PTRAIN_*`` variable holds its values separated by spaces; commas separate them too
(``P2PTRAIN_INITIAL_PEERS=/ip4/…/p2p/A,/ip4/…/p2p/B``), since no multiaddr holds one.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from pathlib import Path

import base58

__all__ = ["check_identity", "host_maddrs", "initial_peers", "parse_maddr", "split_list"]

#: Protocols that take no value, and those whose value is checked below or only needs to be there.
_BARE = frozenset({"udt", "utp", "quic", "quic-v1", "http", "https", "tls", "ws", "wss", "p2p-websocket-star",
                   "p2p-webrtc-star", "p2p-webrtc-direct", "p2p-circuit"})
_PORTS = frozenset({"tcp", "udp", "dccp", "sctp"})
_DOMAINS = frozenset({"dns", "dns4", "dns6", "dnsaddr"})
_OTHERS = frozenset({"ip4", "ip6", "ip6zone", "p2p", "onion", "onion3"})
#: The transports a listening or announced address needs a port of.
_TRANSPORTS = ("tcp", "udp")
EXAMPLE = "/ip4/203.0.113.10/tcp/31337"


def split_list(values: Iterable[str] | None) -> list[str]:
    """Every value of a list flag, each split on commas and whitespace, empty ones dropped."""
    return [v for value in values or () for v in value.replace(",", " ").split()]


def _peer_id(value: str) -> None:
    """ValueError unless ``value`` is a base58 peer id: a multihash, identity (``12D3KooW…``, a key that is
    its own id) or SHA-256 (``Qm…``, the hash of an RSA key)."""
    try:
        raw = base58.b58decode(value)
    except ValueError:
        raw = b""
    identity = len(raw) >= 2 and raw[0] == 0x00 and raw[1] <= 42 and len(raw) == raw[1] + 2
    sha256 = len(raw) == 34 and raw[:2] == b"\x12\x20"
    if not (identity or sha256):
        raise ValueError(f"{value!r} is not a peer id")


def _value(name: str, value: str) -> None:
    """ValueError unless ``value`` is one of protocol ``name``'s."""
    if name in _PORTS:
        if not value.isdecimal() or int(value) > 65535:
            raise ValueError(f"/{name}/{value}: a port is a number from 0 to 65535")
    elif name == "ip4":
        try:
            ipaddress.IPv4Address(value)
        except ValueError:
            raise ValueError(f"/ip4/{value}: not an IPv4 address") from None
    elif name == "ip6":
        try:
            ipaddress.IPv6Address(value)
        except ValueError:
            raise ValueError(f"/ip6/{value}: not an IPv6 address") from None
    elif name == "p2p":
        _peer_id(value)
    elif name in _DOMAINS and (len(value) > 253 or any(c.isspace() for c in value)):
        raise ValueError(f"/{name}/{value}: not a domain name")


def parse_maddr(text: str) -> list[tuple[str, str | None]]:
    """The (protocol, value) pairs of multiaddr ``text`` (``ipfs`` read as ``p2p``); ValueError saying what is
    wrong with it."""
    if not text.startswith("/"):
        raise ValueError(f"a multiaddr begins with /, like {EXAMPLE}")
    parts = text.rstrip("/").split("/")[1:]
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(parts):
        name = "p2p" if parts[i] == "ipfs" else parts[i]
        i += 1
        if name in _BARE:
            out.append((name, None))
            continue
        if name == "unix":  # a path: the rest of the address
            out.append((name, "/" + "/".join(parts[i:])))
            break
        if name not in _PORTS | _DOMAINS | _OTHERS:
            raise ValueError(f"unknown protocol {name!r}" if name else "an empty protocol (//)")
        if i == len(parts) or not parts[i]:
            raise ValueError(f"/{name} needs a value")
        _value(name, parts[i])
        out.append((name, parts[i]))
        i += 1
    return out


def _checked(flag: str, values: Iterable[str] | None, need: str) -> list[str]:
    """``values`` split (see :func:`split_list`), each parsed and holding what ``need`` asks for: ``peer`` a
    ``/p2p/`` peer id, ``port`` a TCP/UDP port, ``explicit port`` a non-zero one. ValueError naming ``flag``."""
    out = split_list(values)
    for text in out:
        try:
            parts = dict(parse_maddr(text))
        except ValueError as e:
            raise ValueError(f"{flag} {text}: {e}") from None
        if need == "peer" and "p2p" not in parts:
            raise ValueError(f"{flag} {text}: no /p2p/<peer id> in it; copy the whole address a peer or bootstrap "
                             "node prints (it ends with /p2p/12D3KooW… or /p2p/Qm…)")
        if need != "peer" and not any(t in parts for t in _TRANSPORTS):
            raise ValueError(f"{flag} {text}: no /tcp/PORT or /udp/PORT in it, like {EXAMPLE}")
        if need == "explicit port" and any(int(parts[t] or 0) == 0 for t in _TRANSPORTS if t in parts):
            raise ValueError(f"{flag} {text}: port 0 means any free port, which others cannot dial; announce the "
                             f"port you listen on, like {EXAMPLE}")
    return out


def initial_peers(values: Iterable[str] | None, flag: str = "--initial-peers") -> list[str]:
    """``--initial-peers`` (or the recipe's key named ``flag``): parsed, each with its peer id. ValueError naming
    the flag and the address."""
    return _checked(flag, values, "peer")


def host_maddrs(values: Iterable[str] | None, *, announce: bool = False) -> list[str]:
    """``--host-maddrs`` (or ``--announce-maddrs`` with ``announce``: a port others can dial, not 0), parsed.
    ValueError naming the flag and the address."""
    if announce:
        return _checked("--announce-maddrs", values, "explicit port")
    return _checked("--host-maddrs", values, "port")


def check_identity(path: Path | None) -> None:
    """An ``--identity`` file that exists must hold a key p2ptrain can sign with; one that does not is made
    at start (an ed25519 key), so its folder must exist. ValueError naming the file and what is wrong."""
    if path is None:
        return
    if not path.exists():
        if not path.parent.is_dir():
            raise ValueError(f"--identity {path}: the folder {path.parent} does not exist (the key is made there)")
        return
    from ..net.identity import Identity, IdentityError

    try:
        Identity.load(path)
    except IdentityError as e:
        raise ValueError(f"--identity {str(e).removeprefix('identity ')}; pass another file, or a path that does "
                         "not exist yet (one is made there)") from None
