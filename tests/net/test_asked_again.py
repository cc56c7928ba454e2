"""A probe or a read whose stream the peer's side closed before a byte of the reply is asked once more on a new
stream (net/streams.py ``ASKED_AGAIN_KINDS``); a request that may change something at the peer is not.

Why: a hello to a live round leader failed so in 2 of 9 rounds of bench/link.py with 8 peers, 1 MB ("stream closed
mid-frame", nothing read): the joiner skipped the leader and failed its round, and the leader waited out its join
window for it. The streams here are loopback TCP connections in place of the daemon's (the same reader and writer),
served by the peer's own stream callback; the peer drops the first streams unread, as it does a blocked sender's
(the daemon's streams then end; a TCP connection closed with its request unread is reset: both are asked again)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from p2ptrain.net.guard import Guard
from p2ptrain.net.streams import ASKED_AGAIN_KINDS, DIRECT_KINDS, Streams
from p2ptrain.net.swarm import SwarmConfig
from p2ptrain.net.transport import Dropped, RoundFailed
from p2ptrain.net.wire import StreamClosed, read_frame

PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"  # (a well-formed peer id: the caller parses it)


async def _call(kind: str, drops: int, ends: bool = True) -> tuple[dict[str, Any] | Exception, int]:
    """``kind`` asked of a peer whose first ``drops`` streams are closed unread (``ends``: the stream ends, as the
    daemon's do; else the unread request resets it): (the reply or the error, the streams the peer saw)."""
    cfg = SwarmConfig(run_id="again")
    seen = [0]

    def blocked(sender: str) -> bool:  # the peer's side: drop the first streams unread
        seen[0] += 1
        return seen[0] <= drops

    async def handler(sender: str, msg: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True, "kind": kind}

    peer = Streams(cfg, SimpleNamespace(peer_id=PEER), Guard(cfg.guard), blocked, lambda p: [])
    serve = peer.on_stream(kind, handler)
    served: list[asyncio.Task[None]] = []

    async def on(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if ends:  # the request read off the socket first: closed, the stream then ends (no reset)
            head = await r.readexactly(4)
            body = await r.readexactly(int.from_bytes(head, "big"))
            r = asyncio.StreamReader()
            r.feed_data(head + body)
            r.feed_eof()
        served.append(asyncio.create_task(serve(SimpleNamespace(peer_id="me"), r, w)))

    server = await asyncio.start_server(on, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    async def open_stream(peer_id: Any, proto: str) -> tuple[Any, asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return None, reader, writer

    async def addresses(peer: str) -> list[str]:
        return []  # (none to dial again: a failed dial is not retried here)

    caller = Streams(cfg, SimpleNamespace(peer_id="me", call_binary_stream_handler=open_stream), Guard(cfg.guard),
                     lambda p: False, addresses)
    try:
        got: dict[str, Any] | Exception = (await caller.call(PEER, kind, {"key": "k"}, timeout=5.0))[0]
    except RoundFailed as e:
        got = e
    finally:
        server.close()
        await server.wait_closed()
        await asyncio.gather(*served)
    return got, seen[0]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("ends", [True, False], ids=["ended", "reset"])
@pytest.mark.parametrize("kind", sorted(ASKED_AGAIN_KINDS))
def test_a_probe_closed_before_its_reply_is_asked_once_more(kind: str, ends: bool) -> None:
    got, streams = asyncio.run(_call(kind, drops=1, ends=ends))
    assert got == {"ok": True, "kind": kind} and streams == 2


@pytest.mark.timeout(30)
def test_asked_once_more_only() -> None:
    got, streams = asyncio.run(_call("hello", drops=5))
    # (Dropped: the peer's side took the stream and closed it; form_group then joins that leader all the same)
    assert isinstance(got, Dropped) and "closed mid-frame" in str(got) and streams == 2


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["join", "lead", "part", "check"])
def test_a_request_that_may_change_the_peer_is_not_asked_again(kind: str) -> None:
    """A join, a part or a claim the peer may have taken before its stream closed is not sent twice by this layer
    (form_group asks a join again itself, with its ticket)."""
    assert kind not in ASKED_AGAIN_KINDS
    got, streams = asyncio.run(_call(kind, drops=1))
    assert isinstance(got, RoundFailed) and streams == 1


def test_the_kinds_asked_again_over_libp2p_change_nothing() -> None:
    """Only reads and probes (a direct path's exchanges have their own rule for a connection closed before its
    reply: net/streams.py ``not_begun``)."""
    assert {"hello", "direct", "getpart", "state", "evidence"} == ASKED_AGAIN_KINDS
    assert not ASKED_AGAIN_KINDS & {"part", "result", "check", "verdict", "join", "lead", "bequest"}
    assert "hello" not in DIRECT_KINDS


@pytest.mark.timeout(30)
def test_a_stream_closed_before_a_frame_is_told_apart_from_one_closed_inside_it() -> None:
    async def read(data: bytes) -> StreamClosed:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        with pytest.raises(StreamClosed) as e:
            await read_frame(reader, timeout=1.0)
        return e.value

    assert asyncio.run(read(b"")).empty
    assert not asyncio.run(read(b"\x00\x00")).empty  # inside the length
    assert not asyncio.run(read(b"\x00\x00\x00\x08abc")).empty  # inside the message
