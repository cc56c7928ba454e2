"""A direct TCP path for bulk exchanges, keyed over libp2p: plain TCP connections, encrypted, kept between exchanges.

Why: every libp2p stream between two peers shares one connection and the daemon's multiplexer, whose per-stream
windows starve one direction while the other is busy (bench/results/README.md, "All-reduce goodput"); a fragment's
all-reduce sends both ways at once. Here each exchange (one request, its chunk frames, one reply) gets a TCP
connection of its own, opened by the caller: the two directions of a butterfly never share a window, and nothing
passes through the daemon (no copies through its unix socket, no second encryption). A connection whose exchange
ended at its boundary is kept (:data:`KEEP_IDLE`) for the caller's next exchange with the same peer: a new one
starts slow (see net/sealed.py for what that cost on the testbed).

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
import hmac
import logging
import math
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .congestion import set_congestion, usable_congestion
from .sealed import RECORD, Sealed, derive_keys, hello_mac
from .wire import FrameError, read_frame, write_frame

__all__ = ["Direct", "DirectInfo", "Sealed", "derive_keys", "hello_mac", "host_of", "usable_congestion"]

log = logging.getLogger(__name__)

SESSION_SECONDS = 600.0  # a session's lifetime; a caller renews it before it runs out
_HELLO_MAX = 4096
_SESSIONS_PER_PEER = 4  # sessions kept per peer (the oldest goes): asking again and again cannot grow the table
_HELLOS_PER_SESSION = 100_000  # exchanges per session (the nonces seen are kept for replays); then a new one
_HELLO_TIMEOUT = 10.0
_UNREACHABLE_SECONDS = 60.0  # a peer whose direct port could not be dialed is not tried for this long (doubling)
_UNREACHABLE_MAX = 3600.0
KEEP_IDLE = 30.0  # seconds a caller keeps an idle connection for its next exchange with the same peer
_SERVE_IDLE = 90.0  # seconds the peer waits for the next exchange on a kept connection (longer: the caller retires it)
_KEEP_PER_PEER = 4  # idle connections kept per peer (concurrent exchanges open more; the extra ones close)
_KEEP_IN_ALL = 256  # idle connections kept in all (the oldest close first)
_SERVE_KEPT_PER_PEER = 8  # connections a peer may keep open to us at once; beyond, each closes after its exchange

#: The daemon's stream callback shape: (info with .peer_id, reader, writer) -> None.
StreamCallback = Callable[[Any, Any, Any], Awaitable[None]]


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
                 addresses: Callable[[str], Awaitable[list[str]]], listen: bool = True,
                 congestion: str | None = None) -> None:
        self.me, self.host, self.port, self.announce, self.listen = me, host, port, announce, listen
        self.congestion = usable_congestion(congestion)
        self._ask, self._addresses = ask, addresses
        self._server: asyncio.Server | None = None
        self._callbacks: dict[str, StreamCallback] = {}
        self._sessions: dict[str, _Session] = {}
        self._tickets: dict[str, _Ticket] = {}
        self._unreachable: dict[str, float] = {}  # peer -> monotonic time until which libp2p is used instead
        self._failures: dict[str, int] = {}  # peer -> dials failed in a row
        self._asking: dict[str, asyncio.Future[_Ticket | None]] = {}
        self._exchanges: dict[asyncio.Task[None], asyncio.StreamWriter] = {}  # the connections served (closed on stop)
        self._idle: dict[str, list[tuple[float, Sealed]]] = {}  # peer -> (idle since, connection), oldest first
        self._served: dict[str, int] = {}  # peer -> connections of its we serve now
        self._closed = False
        self.opened = self.accepted = self.reused = 0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self.listen:
            self._server = await asyncio.start_server(self._accept, self.host, self.port,
                                                      limit=RECORD + 64 * 1024)
            self.port = self._server.sockets[0].getsockname()[1]

    async def aclose(self) -> None:
        self._closed = True
        if self._server is not None:
            self._server.close()
            self._server = None
        for peer in list(self._idle):
            self._drop_idle(peer)
        for writer in self._exchanges.values():  # a kept connection waiting for its next exchange ends at once
            writer.close()
        if self._exchanges:
            await asyncio.wait(list(self._exchanges), timeout=0.5)
        for task in list(self._exchanges):
            task.cancel()
        if self._exchanges:
            await asyncio.wait(list(self._exchanges), timeout=5)

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
        set_congestion(writer, self.congestion)
        task = asyncio.current_task()
        if task is not None:
            self._exchanges[task] = writer
        served: str | None = None
        try:
            hello, _ = await read_frame(reader, timeout=_HELLO_TIMEOUT, max_size=_HELLO_MAX)
            sealed, peer, kind = self._admit(hello, reader, writer)
            served = peer
            self._served[peer] = self._served.get(peer, 0) + 1
            while True:
                callback = self._callbacks.get(kind)
                if callback is None:
                    raise FrameError(f"no direct protocol {kind!r}")
                self.accepted += 1
                sealed.may_keep = (time.monotonic() - sealed.born < SESSION_SECONDS
                                   and self._served[peer] <= _SERVE_KEPT_PER_PEER)
                await callback(DirectInfo(peer), sealed, sealed)  # it ends the exchange when it is done
                if not sealed.kept:
                    break
                try:  # the connection was kept: the caller's next exchange on it, named in a sealed frame
                    nxt, _ = await read_frame(sealed, timeout=_SERVE_IDLE, max_size=_HELLO_MAX)
                except (FrameError, TimeoutError, ConnectionError, asyncio.IncompleteReadError):
                    break  # the caller closed it (or it went quiet)
                kind = nxt.get("kind") if isinstance(nxt, dict) else None
                if not isinstance(kind, str):
                    raise FrameError("malformed next exchange")
        except (FrameError, TimeoutError, ConnectionError, asyncio.IncompleteReadError, KeyError, TypeError,
                ValueError) as e:
            log.debug("event=direct_refused reason=%s", e)
        except asyncio.CancelledError:  # stopped (aclose): the server's own task, awaited by no one, ends quietly
            pass
        finally:
            writer.close()
            if task is not None:
                self._exchanges.pop(task, None)
            if served is not None:
                if (n := self._served.get(served, 1) - 1) > 0:
                    self._served[served] = n
                else:
                    self._served.pop(served, None)

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

    async def open(self, peer: str, kind: str, timeout: float, *, reuse: bool = True) -> Sealed | None:
        """A new exchange of ``kind`` with ``peer`` (on a connection kept from an earlier exchange, or a new one
        with its hello sent), or None when there is no direct path to it (no port, dial refused or too slow:
        libp2p then; the peer is not tried again for a while). End it with ``close`` and :meth:`release`.
        ``reuse=False``: a new connection (a kept one was found closed by the peer when the exchange began)."""
        if not self.usable(peer):
            return None
        while reuse and (kept := self._take(peer)) is not None:
            try:
                await write_frame(kept, {"kind": kind}, timeout=min(timeout, 3.0))
            except (OSError, TimeoutError):
                kept.abort()
                continue
            except BaseException:
                kept.abort()
                raise
            self.reused += 1
            kept.reused, kept.received_before = True, kept.received
            return kept
        for fresh in (peer not in self._tickets, True):  # a session kept from before may be of a restarted peer
            ticket = await self._ticket(peer, timeout)
            if ticket is None:
                return None
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(ticket.host, ticket.port, limit=RECORD + 64 * 1024), min(timeout, 3.0))
                set_congestion(writer, self.congestion)
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
        conn = Sealed(reader, writer, to_them, to_me)
        conn.old_session = not fresh
        return conn

    def release(self, peer: str, conn: Sealed) -> None:
        """An exchange with ``peer`` on ``conn`` was closed: keep the connection for the next one if the exchange
        ended at its boundary (:attr:`Sealed.kept`)."""
        now = time.monotonic()
        if self._closed or not conn.kept or now - conn.born > SESSION_SECONDS:
            conn.abort()
            return
        pool = self._idle.setdefault(peer, [])
        pool.append((now, conn))
        while len(pool) > _KEEP_PER_PEER:
            pool.pop(0)[1].abort()
        # The pools of peers we no longer call (gone, restarted under a new id) close here, not never.
        idle = sorted((since for kept in self._idle.values() for since, c in kept if now - since < KEEP_IDLE
                       and c.open))
        oldest = idle[-_KEEP_IN_ALL] if len(idle) > _KEEP_IN_ALL else -math.inf
        for p in list(self._idle):
            kept = [(since, c) for since, c in self._idle[p] if now - since < KEEP_IDLE and c.open and since >= oldest]
            for _, c in self._idle[p]:
                if all(c is not k for _, k in kept):
                    c.abort()
            if kept:
                self._idle[p] = kept
            else:
                del self._idle[p]

    def _take(self, peer: str) -> Sealed | None:
        """The connection to ``peer`` idle the shortest time, if one is kept and not too old; the stale ones close."""
        pool = self._idle.get(peer, [])
        now = time.monotonic()
        while pool:
            since, conn = pool.pop()
            if conn.open and now - since < KEEP_IDLE and now - conn.born < SESSION_SECONDS:
                return conn
            conn.abort()
        self._idle.pop(peer, None)
        return None

    def _drop_idle(self, peer: str) -> None:
        for _, conn in self._idle.pop(peer, []):
            conn.abort()

    def forget(self, peer: str) -> None:
        """An exchange with ``peer`` failed over the direct path: ask it for a new session next time (it may have
        restarted under the same identity, and no longer know ours), on a new connection."""
        self._tickets.pop(peer, None)
        self._drop_idle(peer)

    def _give_up(self, peer: str, why: str) -> None:
        self._drop_idle(peer)
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
