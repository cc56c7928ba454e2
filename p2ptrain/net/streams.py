"""Our request/response protocols on the libp2p daemon's streams (and, for the bulk kinds, on direct TCP).

Every call opens a fresh stream to one peer under ``/p2ptrain/<run>/<kind>/1``, writes one message
(a msgpack frame, net/wire.py), optionally followed by chunk frames (a streamed part, net/chunks.py),
and reads one reply. In a private swarm every frame, chunks and replies included, carries a tag of the
swarm key bound to its sender, protocol and run (net/auth.py); an untagged one is refused with a
strike. Every read and write is bounded in size and time; a failed call raises RoundFailed.

The kinds of a round (:data:`DIRECT_KINDS`: parts, results, relays, evidence, state, and verification's claims and
verdicts) go over the direct path when the peer has one (net/direct.py: TCP connections of their own, kept between
exchanges, keyed over libp2p, sealed), with the same frames and checks; a peer without one is called over libp2p.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from .auth import MAC_FIELD
from .chunks import Refused
from .daemon import dial
from .direct import Direct
from .guard import Guard
from .sealed import Sealed
from .traffic import Traffic
from .transport import Dropped, RoundFailed, Unreachable
from .wire import SCHEMA_ERRORS, FrameError, StreamClosed, read_frame, write_frame

if TYPE_CHECKING:
    from .daemon import SwarmConfig

__all__ = ["ASKED_AGAIN_KINDS", "DIRECT_KINDS", "ChunkSource", "Handler", "Streams", "Trailer"]

log = logging.getLogger(__name__)

#: Answers one message from a peer: handler(sender, message) -> reply.
Handler = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]
#: Makes the payloads that follow a message as chunk frames (called again if the call is retried).
ChunkSource = Callable[[], AsyncGenerator[bytes, None]]
#: Makes the frame that follows the chunks (e.g. a signature over them), once they are all written.
Trailer = Callable[[], dict[str, Any]]

_READ_TIMEOUT = 30.0  # seconds a handler waits for each frame of a message
#: The most a handler waits for each chunk frame of a streamed message whose sender says it may take longer (``wait``:
#: the caller's own timeout for the exchange). A pipelined result's chunks leave as its contributions arrive (net/
#: pipelined.py): a carrier whose cross-region partner started late sent its result's header at once and its chunks
#: more than _READ_TIMEOUT later; the partner's handler gave up on the stream, the carrier sent the rest into the
#: dead connection, and the partner pulled the result again (bench/utilization.py, diloco at 20 Mbit/s: 26 MB twice).
MAX_FRAME_WAIT = 900.0
#: What goes over the direct path when there is one: the exchanges that carry a fragment's bytes, and the claims and
#: verdicts of a verified round. Those two are small, but each member sends them to every other member: over libp2p
#: every one was a stream through two daemons (8 members, 1 MB on 127.0.0.1: 0.18 s of the daemons' CPU a round,
#: a fifth of the round's CPU, none now; the round 0.62 s → 0.43–0.50 s).
DIRECT_KINDS = frozenset({"part", "result", "getpart", "evidence", "state", "check", "verdict"})
#: The kinds that change nothing at the peer (probes and reads): over libp2p, one whose stream the peer's side closed
#: before a byte of the reply (or reset) is asked once more on a new stream. A hello to a live round leader failed so ("stream
#: closed mid-frame", nothing read) in 2 of 9 rounds of bench/link.py with 8 peers, 1 MB: the joiner skipped the
#: leader and failed its round in a group of its own, and the leader waited out its join window for it.
ASKED_AGAIN_KINDS = frozenset({"hello", "direct", "getpart", "state", "evidence"})
#: A reply's field that says the peer keeps the direct connection for the caller's next exchange.
KEEP = "_keep"


async def _when_flushed(conn: Sealed, sent: Callable[[], None], timeout: float) -> None:
    """Call ``sent`` once everything written on ``conn`` has left this host (within ``timeout``)."""
    if await conn.flushed(timeout):
        sent()


def frame_wait(wait: Any) -> float:
    """Seconds a handler waits for each chunk frame of a message whose sender said ``wait`` (its own timeout):
    at least :data:`_READ_TIMEOUT`, at most :data:`MAX_FRAME_WAIT`."""
    if isinstance(wait, (int, float)) and not isinstance(wait, bool) and math.isfinite(wait):
        return min(max(_READ_TIMEOUT, float(wait)), MAX_FRAME_WAIT)
    return _READ_TIMEOUT


class Streams:
    """The stream protocols of one peer.

    ``blocked(peer)``: fault injection, a peer this one cannot reach (its messages are dropped unread);
    ``addresses(peer)``: the multiaddrs a peer announced, to dial it again when a dial failed;
    ``direct``: the direct path (net/direct.py), if this peer uses one.
    """

    def __init__(self, cfg: SwarmConfig, p2p: Any, guard: Guard, blocked: Callable[[str], bool],
                 addresses: Callable[[str], Awaitable[list[str]]], direct: Direct | None = None) -> None:
        self.cfg, self.p2p, self.guard = cfg, p2p, guard
        self.peer_id = str(p2p.peer_id)
        self.blocked, self.addresses, self.direct = blocked, addresses, direct
        self.traffic = Traffic()  # bytes of our messages by kind, both ends of every exchange (net/traffic.py)

    def proto(self, kind: str) -> str:
        return f"/p2ptrain/{self.cfg.run_id}/{kind}/1"

    async def serve(self, kind: str, handler: Handler) -> None:
        """Answer every ``kind`` message with ``handler`` (over the direct path too, for the bulk kinds)."""
        callback = self.on_stream(kind, handler)
        await self.p2p.add_binary_stream_handler(self.proto(kind), callback)
        if self.direct is not None and kind in DIRECT_KINDS:
            self.direct.handle(kind, callback)

    async def serve_direct(self) -> None:
        """Hand out sessions of the direct path (asked for over libp2p: only the asking peer learns its secret),
        or say there is none here."""
        async def issue(sender: str, msg: dict[str, Any]) -> dict[str, Any]:
            return {} if self.direct is None else self.direct.issue(sender)  # {}: none here, use libp2p

        await self.serve("direct", issue)

    async def ask_direct(self, peer: str) -> dict[str, Any]:
        """A session of ``peer``'s direct path (``{}`` if it has none); RoundFailed if the request fails."""
        reply, _ = await self.call(peer, "direct", {}, timeout=10.0)
        return reply

    def on_stream(self, kind: str, handler: Handler) -> Any:
        """The daemon's callback for one incoming stream of ``kind``: read, check, answer, close. A message
        from a banned or blocked peer is dropped unread; a malformed one is a strike against its sender."""

        async def on_stream(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sender = str(info.peer_id)
            frames: AsyncGenerator[bytes, None] | None = None
            ended: list[str] = []  # the parts of the request read to their end (the chunk frames, the trailer)
            need = 0
            try:
                if self.guard.is_banned(sender) or self.blocked(sender):
                    return  # dropped unread
                msg, got = await read_frame(reader, timeout=_READ_TIMEOUT, max_size=self.cfg.max_message)
                self.traffic.received(kind, got)
                key = self.cfg.swarm_key
                if key is not None:
                    if not key.verify(msg, sender, kind, self.cfg.run_id):
                        self.guard.strike(sender, f"{kind} message without a valid swarm-key tag")
                        return
                    msg = {k: v for k, v in msg.items() if k != MAC_FIELD}
                msg = {k: v for k, v in msg.items() if not (isinstance(k, str) and k.startswith("_"))}
                wait = frame_wait(msg.pop("wait", None))
                if kind in ("part", "result") and "chunks" in msg:
                    frames = msg["_frames"] = self.chunk_frames(reader, sender, kind, int(msg["chunks"]), ended, wait)
                    need = 1
                    if msg.get("trailer"):
                        msg["_trailer"] = lambda: self.trailer_frame(reader, sender, kind, ended, wait)
                        need = 2
                msg.pop("trailer", None)
                reply = await handler(sender, msg)
                # The whole request read: once the reply is written, the connection can carry the caller's next
                # exchange, and the reply says so (else the caller would send it on a connection we close).
                keep = len(ended) == need and isinstance(writer, Sealed) and writer.may_keep
                if keep:
                    reply = {**reply, KEEP: True}
                if key is not None:
                    reply = key.seal(reply, self.peer_id, kind + "/reply", self.cfg.run_id)
                self.traffic.sent(kind, await write_frame(writer, reply, timeout=_READ_TIMEOUT))
                if keep:
                    writer.done()
            except (FrameError, TimeoutError, ConnectionError, asyncio.IncompleteReadError) as e:
                log.info("event=bad_message kind=%s peer=%s reason=%s", kind, sender, e)
            except SCHEMA_ERRORS as e:  # a message that does not fit its schema
                self.guard.strike(sender, f"malformed {kind} message ({type(e).__name__}: {e})")
            finally:
                if frames is not None:
                    await frames.aclose()
                writer.close()

        return on_stream

    async def chunk_frames(self, reader: asyncio.StreamReader, sender: str, kind: str, count: int,
                           ended: list[str] | None = None, wait: float = _READ_TIMEOUT
                           ) -> AsyncGenerator[bytes, None]:
        """The payloads of the ``count`` chunk frames that follow a streamed message's header (each read is
        bounded in size and by ``wait`` seconds; each frame is checked against the swarm key). Refused for a frame
        without a payload, FrameError for one without a valid tag. ``ended`` gets ``"chunks"`` once all were read."""
        key = self.cfg.swarm_key
        for i in range(count):
            frame, got = await read_frame(reader, timeout=wait, max_size=self.cfg.max_message)
            self.traffic.received(kind, got)
            if key is not None and not key.verify(frame, sender, kind + "/chunk", self.cfg.run_id, str(i)):
                self.guard.strike(sender, f"{kind} chunk without a valid swarm-key tag")
                raise FrameError("chunk without a valid swarm-key tag")
            data = frame.get("data")
            if not isinstance(data, bytes):
                raise Refused(f"chunk {i} carries no payload")
            if ended is not None and i == count - 1:
                ended.append("chunks")  # every frame is off the wire (the consumer may not ask past the last)
            yield data
        if count == 0 and ended is not None:
            ended.append("chunks")

    async def trailer_frame(self, reader: asyncio.StreamReader, sender: str, kind: str,
                            ended: list[str] | None = None, wait: float = _READ_TIMEOUT) -> dict[str, Any]:
        """The frame that follows a streamed message's chunks (bounded in size and by ``wait`` seconds; checked
        against the swarm key: FrameError without a valid tag). ``ended`` gets ``"trailer"`` once it was read and
        checked."""
        frame, got = await read_frame(reader, timeout=wait, max_size=64 * 1024)
        self.traffic.received(kind, got)
        key = self.cfg.swarm_key
        if key is not None:
            if not key.verify(frame, sender, kind + "/trailer", self.cfg.run_id):
                self.guard.strike(sender, f"{kind} trailer without a valid swarm-key tag")
                raise FrameError("trailer without a valid swarm-key tag")
            frame = {k: v for k, v in frame.items() if k != MAC_FIELD}
        if ended is not None:
            ended.append("trailer")
        return frame

    async def call(self, peer: str, kind: str, msg: dict[str, Any], *, timeout: float,
                   chunks: ChunkSource | None = None, trailer: Trailer | None = None,
                   sent: Callable[[], None] | None = None) -> tuple[dict[str, Any], float]:
        """One request/response on a fresh stream, within ``timeout`` seconds; returns (reply, seconds).
        With ``chunks``, the payloads it yields follow the message as frames of their own (the message says
        how many in ``chunks``), then the frame ``trailer`` makes, if any (the message says ``trailer``). ``sent`` is
        called once the whole request has left this host (over the direct path: its socket's send queue holds none of
        it unsent; never over libp2p, whose daemon's socket we cannot see), which can be long before the reply
        arrives: the reply travels behind whatever the peer is sending us. A failed
        dial is retried once after dialing the peer's announced addresses, and a probe or read
        (:data:`ASKED_AGAIN_KINDS`) whose libp2p stream closed before its reply once on a new stream; RoundFailed if
        the call fails, times out or the reply is not tagged with the swarm key."""
        from hivemind.p2p import PeerID

        if self.blocked(peer):
            raise Unreachable(f"{kind} to {peer[-8:]}: unreachable (partitioned)")
        t0 = time.monotonic()

        direct = [False]  # this attempt went over the direct path (a libp2p redial cannot help it)
        used: list[Sealed | None] = [None]  # the direct connection of this attempt
        reuse = [True]

        async def _go() -> dict[str, Any]:
            sealed = None
            if self.direct is not None and kind in DIRECT_KINDS:
                sealed = await self.direct.open(peer, kind, timeout, reuse=reuse[0])
                direct[0], used[0] = sealed is not None, sealed
            if sealed is not None:
                reader: Any = sealed
                writer: Any = sealed
            else:
                _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer),
                                                                              self.proto(kind))
            key = self.cfg.swarm_key
            count = self.traffic
            head = msg if chunks is None else {**msg, "wait": round(timeout, 1)}  # its chunks may come this late
            flusher: asyncio.Future[None] | None = None
            try:
                count.sent(kind, await write_frame(
                    writer, head if key is None else key.seal(head, self.peer_id, kind, self.cfg.run_id),
                    timeout=timeout))
                if chunks is not None:
                    async with aclosing(chunks()) as payloads:
                        i = 0
                        async for data in payloads:
                            frame = {"data": data}
                            if key is not None:
                                frame = key.seal(frame, self.peer_id, kind + "/chunk", self.cfg.run_id, str(i))
                            count.sent(kind, await write_frame(writer, frame, timeout=timeout))
                            i += 1
                    if trailer is not None:
                        last = trailer()
                        if key is not None:
                            last = key.seal(last, self.peer_id, kind + "/trailer", self.cfg.run_id)
                        count.sent(kind, await write_frame(writer, last, timeout=timeout))
                if sent is not None and sealed is not None:
                    flusher = asyncio.ensure_future(_when_flushed(sealed, sent, timeout))
                reply, got = await read_frame(reader, timeout=timeout, max_size=self.cfg.max_message)
                count.received(kind, got)
                if key is not None:
                    if not key.verify(reply, peer, kind + "/reply", self.cfg.run_id):
                        raise FrameError("reply without a valid swarm-key tag")
                    reply = {k: v for k, v in reply.items() if k != MAC_FIELD}
                if reply.pop(KEEP, False) is True and sealed is not None:
                    sealed.done()  # the whole reply read, the peer keeps it: it can carry our next exchange
                return reply
            finally:
                if flusher is not None:  # (ours: cancelled and awaited here, whatever ended the exchange)
                    flusher.cancel()
                    await asyncio.wait([flusher])
                writer.close()
                if sealed is not None and self.direct is not None:
                    self.direct.release(peer, sealed)

        def not_begun(e: BaseException, c: Sealed) -> bool:
            """The exchange did not begin at the peer: it closed the connection before it replied at all, and the
            attempt went on a connection kept from an earlier exchange (the peer restarted, or kept it for less long
            than we did), or on a new one with a session from an earlier exchange (the peer restarted on the same
            ``--direct-port`` and refused the hello of a session it no longer knows: churn benchmark, a hierarchical
            carrier's part to a peer restarted 15 s before failed so, "stream closed mid-frame", and the shard with
            it). Once more on a new connection, with a new session in the second case. (A peer that answered
            without reading the whole request, a refusal, and reset the connection before its answer arrived is
            asked again too: it refuses again.) Each case can happen once per call: a retry reuses nothing."""
            return not isinstance(e, TimeoutError) and not c.replied() and (
                c.reused or (c.old_session and not renewed[0]))

        renewed = [False]
        redialed = asked_again = False
        while True:
            try:
                async with asyncio.timeout(max(0.05, timeout - (time.monotonic() - t0))):  # (no task of its own)
                    reply = await _go()
                return reply, time.monotonic() - t0
            except Exception as e:  # the daemon reports failed dials with its own error types
                if (c := used[0]) is not None and not_begun(e, c):
                    if not c.reused:  # the session is the peer's previous life's: ask for a new one
                        renewed[0] = True
                        self._forget(peer, True)
                    reuse[0] = False
                    continue
                if (not direct[0] and not asked_again and kind in ASKED_AGAIN_KINDS
                        and ((isinstance(e, StreamClosed) and e.empty) or isinstance(e, ConnectionResetError))):
                    asked_again = True
                    log.info("event=asked_again kind=%s peer=%s reason=closed before its reply", kind, peer[-8:])
                    continue
                self._forget(peer, direct[0])
                if not direct[0] and isinstance(e, StreamClosed) and e.empty:
                    raise Dropped(f"{kind} to {peer[-8:]}: {type(e).__name__}: {e}") from None
                if isinstance(e, (TimeoutError, FrameError, asyncio.IncompleteReadError)):
                    raise RoundFailed(f"{kind} to {peer[-8:]}: {type(e).__name__}: {e}") from None
                if redialed or direct[0] or not await self.redial(peer):
                    raise Unreachable(f"{kind} to {peer[-8:]}: {type(e).__name__}: {e}") from None
                redialed = True

    def _forget(self, peer: str, direct: bool) -> None:
        if direct and self.direct is not None:  # a new session next time (the peer may have restarted)
            self.direct.forget(peer)

    async def redial(self, peer: str) -> bool:
        """A dial failed: connect again with the addresses the peer announced (the daemon's peer store
        may not have them yet, or its dial backoff is still on). True if that worked."""
        addrs = await self.addresses(peer)
        if not addrs:
            return False
        try:
            await dial(self.p2p, peer, addrs)
            return True
        except Exception as e:  # still unreachable
            log.debug("event=redial_failed peer=%s reason=%s", peer[-8:], e)
            return False
