"""Starting a peer on hivemind's libp2p daemon and Kademlia DHT, and how it connects (:class:`SwarmConfig`).

The daemon is started with retries and a growing backoff: unreachable initial peers make the daemon
refuse to start, and a peer that cannot join at all gets a message saying what to check.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..collective.butterfly import MIN_CHUNK
from ..faults import FaultPlan
from .auth import SwarmKey
from .congestion import DEFAULT_CONGESTION
from .guard import GuardConfig
from .identity import Identity, IdentityError
from .state_transfer import DEFAULT_CHUNK, MAX_STATE
from .wire import MAX_FRAME

__all__ = ["SwarmConfig", "SwarmError", "dial", "dialable", "start_p2p"]

log = logging.getLogger(__name__)


class SwarmError(RuntimeError):
    """The swarm cannot be joined (the message says why and what to try)."""


def dialable(peer: str, addrs: list[str]) -> list[str]:
    """``addrs`` as the daemon's connect takes them: without the trailing ``/p2p/<peer>`` that announced and
    initial-peer addresses carry (the daemon fails on it, 'length greater than remaining number of bytes in
    buffer'); a relay's ``/p2p/<relay>/p2p-circuit`` inside an address is kept."""
    suffix = f"/p2p/{peer}"
    return [a[: -len(suffix)] if a.endswith(suffix) else a for a in addrs]


async def dial(p2p: Any, peer: str, addrs: list[str], timeout: float = 5.0) -> None:
    """Connect ``p2p``'s daemon to ``peer`` at ``addrs`` (see :func:`dialable`), within ``timeout``."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    async with asyncio.timeout(timeout):  # (not wait_for: on 3.11 it can swallow a cancellation, see swarm.aclose)
        await p2p._client.connect(PeerID.from_base58(peer), [Multiaddr(a) for a in dialable(peer, addrs)])


@dataclass(kw_only=True)
class SwarmConfig:
    """How a peer connects.

    Attributes:
        run_id: names the run's DHT keys and stream protocols.
        initial_peers: multiaddrs of any live peers or bootstrap nodes (none: start a new swarm).
        host_maddrs: where to listen (loopback by default; ``/ip4/0.0.0.0/tcp/PORT`` for other machines).
        announce_maddrs: addresses others should dial (public IP, explicit port).
        identity_path: a private key file; a stable identity gives a stable address.
        client_mode: a peer behind NAT: dials out only, reached through relays.
        use_relay, use_auto_relay: libp2p circuit relays (passed to the daemon).
        join_window: seconds a leader waits for live peers to join a round.
        ttl: seconds an announcement lives (the heartbeat refreshes it).
        quorum_memory: seconds a peer seen live still counts toward a round's quorum after its announcement
            expired (net/groups.py): a region cut off for less than this waits instead of training a θ of
            its own once its view no longer shows the others. A peer that announced its departure stops
            counting at once, and so does one whose region is still in view (it most likely died: a
            restarted peer with a new id must not count twice). 0: the quorum is of the current view only.
        connect_attempts, connect_backoff: retries when initial peers are unreachable.
        recontact_every: seconds between re-pings of known peers (heals splits).
        forget_after: seconds after which a peer no view showed live is no longer re-pinged nor dialed (its
            addresses are forgotten; a split that lasts longer heals through the initial peers).
        max_message: the largest frame accepted from the network, bytes.
        chunk_values: a part of the all-reduce larger than this many values is streamed in chunks of this
            size, so that encoding, transfer and decoding overlap (at least 1024).
        state_chunk: bytes per reply of a state transfer; max_state: the largest state accepted.
        guard: what this peer accepts from others and how it aggregates (net/guard.py).
        swarm_key: a private swarm's shared key: records and messages are tagged and checked (net/auth.py).
        verify: verified aggregation (net/verify.py): contributions are signed, every member checks every
            part's average and a proven liar is banned. Every peer of a run must agree on it.
        audit_rate: slices of each part (8 Ki values) audited exactly per round, on average (net/audit.py):
            each costs the auditor the slice of the owner's share and the chunk of every other contribution that
            covers it (not the part), and a lie in a fraction f of a part is caught with probability about f per
            audited slice. CenteredClip, not coordinate-wise, audits whole parts at this rate.
        dht_timeout: seconds any one DHT store, lookup or address query may take (TimeoutError after).
        pipeline: an owner averages its part (plain mean, no norm bound) chunk by chunk as the contributions
            stream in, and sends each chunk of the average back at once (net/pipelined.py); False: it
            waits for whole contributions (for comparisons; peers of one run may differ in it).
        muxer: the daemon's stream multiplexer on every connection: ``yamux`` (libp2p's default: per-stream
            flow-control windows) or ``mplex`` (no windows). Every peer of a run must support the other's.
        direct: exchanges that carry a fragment's bytes go over a TCP connection of their own per exchange, keyed
            over libp2p and sealed (AES-GCM, net/direct.py), instead of the libp2p connection both directions
            share; a peer without it, or one that cannot be dialed, is reached over libp2p.
        direct_port: the TCP port the direct path listens on (0: any free port; behind a firewall, fix one and open
            it, or peers fall back to libp2p after a failed dial).
        direct_announce: ``host:port`` others should dial for the direct path (a public address or a relay);
            None: the host of this peer's announced addresses and the port it listens on.
        direct_congestion: the TCP congestion control of the direct path's connections (Linux: one of
            ``/proc/sys/net/ipv4/tcp_available_congestion_control``; default ``cubic``, measured in
            net/congestion.py); None: the system's. One that this host does not offer is logged and left alone.
        faults: fault injection (tests only): broken updates to send, an all-reduce to die in (p2ptrain.faults);
            by default what the environment asks for (nothing, unless a test set its variables).
    """

    run_id: str = "p2ptrain"
    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)
    identity_path: str | None = None
    client_mode: bool = False
    use_relay: bool = True
    use_auto_relay: bool = False
    join_window: float = 2.0
    ttl: float = 8.0
    quorum_memory: float = 120.0
    connect_attempts: int = 5
    connect_backoff: float = 1.0
    recontact_every: float = 10.0
    forget_after: float = 600.0
    max_message: int = MAX_FRAME
    chunk_values: int = 1 << 18
    state_chunk: int = DEFAULT_CHUNK
    max_state: int = MAX_STATE
    guard: GuardConfig = field(default_factory=GuardConfig)
    swarm_key: SwarmKey | None = None
    verify: bool = True
    audit_rate: float = 1.0
    pipeline: bool = True
    muxer: str = "yamux"
    direct: bool = True
    direct_port: int = 0
    direct_announce: str | None = None
    direct_congestion: str | None = DEFAULT_CONGESTION
    dht_timeout: float = 30.0
    faults: FaultPlan = field(default_factory=FaultPlan.from_env)

    def __post_init__(self) -> None:
        if self.muxer not in MUXERS:
            raise ValueError(f"unknown muxer {self.muxer!r}: choose one of {', '.join(MUXERS)}")
        if not 0.0 <= self.quorum_memory:
            raise ValueError(f"quorum_memory must be at least 0, got {self.quorum_memory}")
        if not self.forget_after > 0.0:
            raise ValueError(f"forget_after must be positive, got {self.forget_after}")
        if not 0.0 <= self.audit_rate:
            raise ValueError(f"audit_rate must be at least 0, got {self.audit_rate}")
        if self.chunk_values < MIN_CHUNK:
            raise ValueError(f"chunk_values must be at least {MIN_CHUNK}, got {self.chunk_values}")
        if self.direct_congestion is not None and not re.fullmatch(r"[a-z0-9_]{1,15}", self.direct_congestion):
            raise ValueError(f"direct_congestion must name a TCP congestion control (e.g. cubic), got "
                             f"{self.direct_congestion!r}")
        if not 0 <= self.direct_port < 65536:
            raise ValueError(f"direct_port must be a TCP port (0 for any), got {self.direct_port}")
        if self.direct_announce is not None:
            host, _, port = self.direct_announce.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"direct_announce must be host:port, got {self.direct_announce!r}")

    def direct_listen(self) -> tuple[str, int]:
        """(host, port) the direct path listens on: the first host of ``host_maddrs`` (0.0.0.0 for all), and
        ``direct_port``."""
        for a in self.host_maddrs:
            parts = a.split("/")
            if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
                return parts[2], self.direct_port
        return "127.0.0.1", self.direct_port


MUXERS = ("yamux", "mplex")


def _daemon_class(muxer: str) -> Any:
    """hivemind's P2P, starting its daemon with ``-muxer=muxer`` (P2P.create has no option for it)."""
    from hivemind.p2p import P2P

    if muxer == "yamux":
        return P2P

    class WithMuxer(P2P):  # type: ignore[misc]
        @staticmethod
        def _make_process_args(*args: Any, **kwargs: Any) -> list[str]:
            return [*P2P._make_process_args(*args, **kwargs), f"-muxer={muxer}"]

    return WithMuxer


async def _create_p2p(cfg: SwarmConfig, identity: Identity | None) -> Any:
    """The daemon, with the identity file the user gave or, without one, with ``identity`` (a key drawn here,
    handed over in a private temporary file)."""
    P2P = _daemon_class(cfg.muxer)

    kwargs: dict[str, Any] = dict(
        initial_peers=cfg.initial_peers or None, host_maddrs=cfg.host_maddrs,
        announce_maddrs=cfg.announce_maddrs or None, dht_mode="client" if cfg.client_mode else "server",
        use_relay=cfg.use_relay, use_auto_relay=cfg.use_auto_relay, startup_timeout=30)
    if identity is None:
        # hivemind's check that nobody else runs as this key reads RSA keys only (it fails on an Ed25519 one)
        rsa = bool(_load_identity(str(cfg.identity_path)).public) if cfg.identity_path else False
        return await P2P.create(identity_path=cfg.identity_path, check_if_identity_free=rsa, **kwargs)
    with identity.as_file() as path:
        # A key drawn a moment ago is nobody else's: hivemind's check of that reads RSA keys only.
        return await P2P.create(identity_path=path, check_if_identity_free=False, **kwargs)


def _load_identity(path: str) -> Identity:
    try:
        return Identity.load(path)
    except IdentityError as e:
        raise SwarmError(f"{e}: pass another --identity file, or a path that does not exist yet (one is made there)") \
            from None


async def start_p2p(cfg: SwarmConfig) -> tuple[Any, Any, Identity]:
    """Start the libp2p daemon and a DHT node on it, retrying with backoff; (P2P, DHTNode, the identity that
    signs for this peer). SwarmError if every attempt failed (the daemon of a failed attempt is shut down), or
    if the identity file cannot be used."""
    from hivemind.dht.node import DHTNode
    from hivemind.p2p import P2PDaemonError

    path = cfg.identity_path
    drawn = None if path is not None else Identity.generate()
    if path is not None and Path(path).exists():  # noqa: ASYNC240 (a local file, once, at start)
        _load_identity(path)  # a broken file is said as such, not blamed on the initial peers
    elif path is not None:  # made here, an ed25519 key as drawn ones are (the daemon would make an RSA one); the
        Path(path).parent.mkdir(parents=True, exist_ok=True)  # default's folder (a new checkpoint folder) may not
        Identity.generate().save(path)  # exist yet
    delay, last = cfg.connect_backoff, ""
    for attempt in range(1, max(1, cfg.connect_attempts) + 1):
        p2p = None
        try:
            p2p = await _create_p2p(cfg, drawn)
            identity = drawn if drawn is not None else _load_identity(str(path))
            if identity.peer_id != str(p2p.peer_id):
                raise SwarmError(f"the daemon runs as {p2p.peer_id}, not as the identity's {identity.peer_id}")
            node = await DHTNode.create(p2p=p2p, initial_peers=cfg.initial_peers or None,
                                        client_mode=cfg.client_mode, ensure_bootstrap_success=bool(cfg.initial_peers),
                                        wait_timeout=3, bootstrap_timeout=5)
            return p2p, node, identity
        except (TimeoutError, P2PDaemonError, RuntimeError, OSError) as e:
            last = str(e).splitlines()[0] if str(e) else type(e).__name__
            if p2p is not None:
                await p2p.shutdown()
            if attempt < cfg.connect_attempts:
                log.warning("event=connect_retry attempt=%d of=%d in=%.1fs reason=%s", attempt,
                            cfg.connect_attempts, delay, last)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
    raise SwarmError(
        f"could not join the swarm after {cfg.connect_attempts} attempts: {last}. Check that the initial peers "
        f"({', '.join(cfg.initial_peers) or 'none'}) are running and reachable from here (firewall, address, port)."
    )
