"""A direct TCP path for bulk exchanges, keyed over libp2p: one plain TCP connection per exchange, encrypted.

Why: every libp2p stream between two peers shares one connection and the daemon's multiplexer, whose per-stream
windows starve one direction while the other is busy (bench/results/README.md, "All-reduce goodput"); a fragment's
all-reduce sends both ways at once. Here each exchange (one request, its chunk frames, one reply) gets a TCP
connection of its own, opened by the caller: the two directions of a butterfly never share a window, and nothing
passes through the daemon (no copies through its unix socket, no second encryption).

Trust: as on libp2p. A caller first asks the peer over libp2p (authenticated and encrypted by the daemon, and tagged
with the swarm key in a private swarm) for a *session*: an id, a 32-byte secret and the port (:meth:`Direct.issue`).
Each TCP connection then opens with a hello naming the session, the caller and a fresh nonce, under an HMAC of the
secret; both sides derive two AES-128-GCM keys from the secret and the nonce, one per direction, and everything
after the hello travels in sealed records (a 4-byte length, the ciphertext and its tag; the record's sequence number
is its nonce). So only the peer that holds the session's secret can open an exchange or read one, a record that was
changed, dropped, replayed or reordered fails its tag and ends the exchange, and a hello that is replayed is refused
(its nonce was seen). What a peer sends is then checked as on libp2p (the swarm key's tags, the guard).

A peer without a reachable port (behind NAT, or ``direct=False``) answers that it has none and the caller keeps
libp2p; so does a caller whose TCP dial fails (the peer is marked so for a while). Failures after the dial are the
exchange's own (the caller sees RoundFailed, as on libp2p).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .wire import FrameError, read_frame, write_frame

__all__ = ["Direct", "DirectInfo", "Sealed", "derive_keys", "hello_mac", "host_of"]

log = logging.getLogger(__name__)

RECORD = 4 << 20  # plaintext bytes per sealed record at most (a chunk frame of 1 MB fits in one)
_TAG = 16
_LEN = 4
SESSION_SECONDS = 600.0  # a session's lifetime; a caller renews it before it runs out
_HELLO_MAX = 4096
_SESSIONS_PER_PEER = 4  # sessions kept per peer (the oldest goes): asking again and again cannot grow the table
_HELLOS_PER_SESSION = 100_000  # exchanges per session (the nonces seen are kept for replays); then a new one
_HELLO_TIMEOUT = 10.0
_UNREACHABLE_SECONDS = 60.0  # a peer whose direct port could not be dialed is not tried for this long (doubling)
_UNREACHABLE_MAX = 3600.0

#: The daemon's stream callback shape: (info with .peer_id, reader, writer) -> None.
StreamCallback = Callable[[Any, Any, Any], Awaitable[None]]


def hello_mac(secret: bytes, peer: str, sid: str, nonce: bytes, kind: str) -> bytes:
    """The HMAC-SHA256 that proves a hello's sender holds the session's secret (over every field it names)."""
    msg = b"\x00".join([b"p2ptrain-direct-hello-1", peer.encode(), sid.encode(), nonce, kind.encode()])
    return hmac.new(secret, msg, hashlib.sha256).digest()


def derive_keys(secret: bytes, nonce: bytes) -> tuple[bytes, bytes]:
    """(caller→peer key, peer→caller key): 16 bytes each, from the session's secret and the hello's nonce."""
    def one(label: bytes) -> bytes:
        return hmac.new(secret, b"p2ptrain-direct-key-1" + label + nonce, hashlib.sha256).digest()[:16]

    return one(b"c2s"), one(b"s2c")


class Sealed:
    """One direction pair of an exchange over TCP, in sealed records; quacks like the (reader, writer) pair the
    stream protocols use: ``readexactly``, ``write``, ``drain``, ``close``.

    ``write`` buffers; ``drain`` seals what is buffered into records of at most :data:`RECORD` bytes and waits for
    TCP. ``readexactly`` opens records as needed: a record whose tag does not check raises FrameError (changed,
    replayed or reordered: its sequence number is its nonce), a connection that ends mid-record raises
    IncompleteReadError."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key_out: bytes, key_in: bytes,
                 *, max_record: int = RECORD) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._reader, self._writer = reader, writer
        self._out, self._in = AESGCM(key_out), AESGCM(key_in)
        self._seq_out = self._seq_in = 0
        self._pending: list[bytes] = []  # written, not sealed yet
        self._plain, self._pos = b"", 0  # the record being read, and how much of it was read
        self.max_record = max_record
        self.sent = self.received = 0  # bytes on the TCP connection (records)

    # -- reader
    async def readexactly(self, n: int) -> bytes:
        if len(self._plain) - self._pos >= n:  # the common case: a frame's header, then its body, in one record
            out = self._plain[self._pos : self._pos + n]
            self._pos += n
            return out
        parts = [self._plain[self._pos :]]
        have = len(parts[0])
        while have < n:
            record = await self._record()
            take = min(n - have, len(record))
            parts.append(record[:take] if take < len(record) else record)
            have += take
            self._plain, self._pos = record, take
        return b"".join(parts)

    async def _record(self) -> bytes:
        header = await self._reader.readexactly(_LEN)
        size = int.from_bytes(header, "big")
        if not _TAG <= size <= self.max_record + _TAG:
            raise FrameError(f"sealed record of {size} bytes announced")
        body = await self._reader.readexactly(size)
        self.received += _LEN + size
        try:
            plain = self._in.decrypt(self._seq_in.to_bytes(12, "big"), body, None)
        except Exception:  # cryptography's InvalidTag: changed, replayed or out of order
            raise FrameError("sealed record failed its tag") from None
        self._seq_in += 1
        return plain

    # -- writer
    def write(self, data: bytes) -> None:
        self._pending.append(bytes(data))

    async def drain(self) -> None:
        data, self._pending = b"".join(self._pending), []
        view = memoryview(data)
        for at in range(0, len(data), self.max_record):
            sealed = self._out.encrypt(self._seq_out.to_bytes(12, "big"), view[at : at + self.max_record], None)
            self._seq_out += 1
            self._writer.write(len(sealed).to_bytes(_LEN, "big") + sealed)
            self.sent += _LEN + len(sealed)
        await self._writer.drain()

    def close(self) -> None:
        self._writer.close()


@dataclass
class DirectInfo:
    """The ``peer_id`` a stream callback reads from its first argument (as the daemon's stream info)."""

    peer_id: str


@dataclass
class _Session:
    secret: bytes
    peer: str
    expires: float  # monotonic
    seen: set[bytes]  # hello nonces used (a replayed hello is refused)


@dataclass
class _Ticket:
    sid: str
    secret: bytes
    host: str
    port: int
    expires: float  # monotonic


class Direct:
    """One peer's direct path: a TCP listener for the exchanges others open (dispatched to the same callbacks as
    the libp2p streams, :meth:`handle`), and the sessions and dials of the exchanges it opens itself.

    Args:
        me: this peer's id; ``host``/``port``: where to listen (port 0: any); ``announce``: ``host:port`` others
            should dial instead (a public address, a relay), if any.
        ask: asks a peer over libp2p for a session: ``ask(peer) -> {"sid", "secret", "port", "host"?}`` or
            ``{}`` if it has no direct port (raises on failure).
        addresses: the multiaddrs a peer announced (where its direct port is, when its answer names no host).
    """

    def __init__(self, me: str, *, host: str, port: int = 0, announce: str | None = None,
                 ask: Callable[[str], Awaitable[dict[str, Any]]],
                 addresses: Callable[[str], Awaitable[list[str]]], listen: bool = True) -> None:
        self.me, self.host, self.port, self.announce, self.listen = me, host, port, announce, listen
        self._ask, self._addresses = ask, addresses
        self._server: asyncio.Server | None = None
        self._callbacks: dict[str, StreamCallback] = {}
        self._sessions: dict[str, _Session] = {}
        self._tickets: dict[str, _Ticket] = {}
        self._unreachable: dict[str, float] = {}  # peer -> monotonic time until which libp2p is used instead
        self._failures: dict[str, int] = {}  # peer -> dials failed in a row
        self._asking: dict[str, asyncio.Future[_Ticket | None]] = {}
        self._exchanges: set[asyncio.Task[None]] = set()  # the server's exchanges in progress (closed on stop)
        self.opened = self.accepted = 0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self.listen:
            self._server = await asyncio.start_server(self._accept, self.host, self.port,
                                                      limit=RECORD + 64 * 1024)
            self.port = self._server.sockets[0].getsockname()[1]

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._exchanges):
            task.cancel()
        if self._exchanges:
            await asyncio.wait(self._exchanges, timeout=5)

    def handle(self, kind: str, callback: StreamCallback) -> None:
        """Answer direct exchanges of ``kind`` with ``callback`` (the libp2p stream callback of the same kind)."""
        self._callbacks[kind] = callback

    # ------------------------------------------------------------------ the peer side
    def issue(self, peer: str) -> dict[str, Any]:
        """A session for ``peer`` (asked over libp2p, so the answer reaches that peer only): what it needs to open
        exchanges here; ``{}`` without a listening port."""
        if self._server is None:
            return {}
        now = time.monotonic()
        for sid in [s for s, v in self._sessions.items() if v.expires < now]:
            del self._sessions[sid]
        mine = [sid for sid, v in self._sessions.items() if v.peer == peer]
        for sid in mine[: max(0, len(mine) - (_SESSIONS_PER_PEER - 1))]:  # a peer asking again and again
            del self._sessions[sid]
        sid, secret = secrets.token_hex(8), secrets.token_bytes(32)
        self._sessions[sid] = _Session(secret, peer, now + SESSION_SECONDS + 30.0, set())
        reply: dict[str, Any] = {"sid": sid, "secret": secret, "port": self.port}
        if self.announce:
            host, _, port = self.announce.rpartition(":")
            reply.update(host=host, port=int(port))
        return reply

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._exchanges.add(task)
        try:
            hello, _ = await read_frame(reader, timeout=_HELLO_TIMEOUT, max_size=_HELLO_MAX)
            sealed, peer, kind = self._admit(hello, reader, writer)
            callback = self._callbacks.get(kind)
            if callback is None:
                raise FrameError(f"no direct protocol {kind!r}")
            self.accepted += 1
            await callback(DirectInfo(peer), sealed, sealed)  # it closes the exchange when it is done
        except (FrameError, TimeoutError, ConnectionError, asyncio.IncompleteReadError, KeyError, TypeError,
                ValueError) as e:
            log.debug("event=direct_refused reason=%s", e)
        finally:
            writer.close()
            if task is not None:
                self._exchanges.discard(task)

    def _admit(self, hello: dict[str, Any], reader: asyncio.StreamReader,
               writer: asyncio.StreamWriter) -> tuple[Sealed, str, str]:
        """Check a hello (its session, sender, nonce and HMAC) and set up the exchange's keys."""
        sid, peer, nonce, kind, mac = (hello["sid"], hello["peer"], hello["nonce"], hello["kind"], hello["mac"])
        if not all(isinstance(v, str) for v in (sid, peer, kind)) or not all(isinstance(v, bytes) for v in (nonce, mac)):
            raise FrameError("malformed hello")
        session = self._sessions.get(sid)
        if session is None or session.expires < time.monotonic():
            raise FrameError("unknown or expired session")
        if session.peer != peer or len(nonce) != 16 or nonce in session.seen or len(session.seen) >= _HELLOS_PER_SESSION:
            raise FrameError("hello for another peer, or replayed")
        if not hmac.compare_digest(mac, hello_mac(session.secret, peer, sid, nonce, kind)):
            raise FrameError("hello with a bad HMAC")
        session.seen.add(nonce)
        to_me, to_them = derive_keys(session.secret, nonce)
        return Sealed(reader, writer, to_them, to_me), peer, kind

    # ------------------------------------------------------------------ the caller side
    def usable(self, peer: str) -> bool:
        """False while ``peer``'s direct port is known to be unreachable (libp2p is used instead)."""
        return self._unreachable.get(peer, 0.0) <= time.monotonic()

    async def open(self, peer: str, kind: str, timeout: float) -> Sealed | None:
        """A new exchange of ``kind`` with ``peer`` (its hello sent), or None when there is no direct path to it
        (no port, dial refused or too slow: libp2p then; the peer is not tried again for a while)."""
        if not self.usable(peer):
            return None
        for fresh in (peer not in self._tickets, True):  # a session kept from before may be of a restarted peer
            ticket = await self._ticket(peer, timeout)
            if ticket is None:
                return None
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(ticket.host, ticket.port, limit=RECORD + 64 * 1024), min(timeout, 3.0))
                break
            except (OSError, TimeoutError) as e:
                if fresh:
                    self._give_up(peer, f"dial {ticket.host}:{ticket.port}: {e}")
                    return None
                self.forget(peer)  # ask for a new session (and port) once before giving up
        nonce = os.urandom(16)
        hello = {"sid": ticket.sid, "peer": self.me, "nonce": nonce, "kind": kind,
                 "mac": hello_mac(ticket.secret, self.me, ticket.sid, nonce, kind)}
        try:
            await write_frame(writer, hello, timeout=timeout)
        except (OSError, TimeoutError) as e:
            writer.close()
            self._give_up(peer, f"hello: {e}")
            return None
        self.opened += 1
        self._failures.pop(peer, None)
        to_them, to_me = derive_keys(ticket.secret, nonce)
        return Sealed(reader, writer, to_them, to_me)

    def forget(self, peer: str) -> None:
        """An exchange with ``peer`` failed over the direct path: ask it for a new session next time (it may have
        restarted under the same identity, and no longer know ours)."""
        self._tickets.pop(peer, None)

    def _give_up(self, peer: str, why: str) -> None:
        n = self._failures[peer] = self._failures.get(peer, 0) + 1
        self._unreachable[peer] = time.monotonic() + min(_UNREACHABLE_MAX, _UNREACHABLE_SECONDS * 2 ** (n - 1))
        self._tickets.pop(peer, None)
        log.info("event=direct_unreachable peer=%s reason=%s", peer[-8:], why)

    async def _ticket(self, peer: str, timeout: float) -> _Ticket | None:
        """A live session with ``peer`` (one libp2p request per peer and lifetime; concurrent callers share it)."""
        held = self._tickets.get(peer)
        if held is not None and held.expires > time.monotonic():
            return held
        pending = self._asking.get(peer)
        if pending is None:
            pending = self._asking[peer] = asyncio.get_running_loop().create_future()
            try:
                pending.set_result(await asyncio.wait_for(self._new_ticket(peer), min(timeout, 10.0)))
            except Exception as e:  # a failed request (an old peer, a slow one): libp2p, asked again later
                self._give_up(peer, f"no session: {type(e).__name__}: {e}")
                pending.set_result(None)
            except BaseException:  # cancelled: the callers sharing it go by libp2p
                pending.set_result(None)
                raise
            finally:
                del self._asking[peer]
        return await asyncio.shield(pending)

    async def _new_ticket(self, peer: str) -> _Ticket | None:
        reply = await self._ask(peer)
        if not reply:
            self._give_up(peer, "it has no direct port")
            return None
        sid, secret, port = reply["sid"], reply["secret"], reply["port"]
        if not (isinstance(sid, str) and isinstance(secret, bytes) and len(secret) == 32 and isinstance(port, int)
                and 0 < port < 65536):
            raise ValueError("malformed session")
        host = reply.get("host")
        if not isinstance(host, str) or not host:
            host = host_of(await self._addresses(peer))
        if host is None:
            self._give_up(peer, "no address to dial")
            return None
        ticket = _Ticket(sid, secret, host, port, time.monotonic() + SESSION_SECONDS)
        self._tickets[peer] = ticket
        return ticket


def host_of(maddrs: list[str]) -> str | None:
    """The first IP address in ``maddrs`` that is not behind a relay (``/ip4/A/tcp/P...`` or ``/ip6/...``)."""
    for a in maddrs:
        if "p2p-circuit" in a:
            continue
        parts = a.split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
            return parts[2]
    return None
