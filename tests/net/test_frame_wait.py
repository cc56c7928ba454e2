"""A streamed message's chunk frames may come as late as their sender said (``wait``, its own timeout), not only
within the handler's fixed per-frame bound: a pipelined result's chunks leave as its contributions arrive, and over
a slow link the gaps between them were longer than that bound (net/streams.py ``MAX_FRAME_WAIT``)."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace
from typing import Any

import pytest

from p2ptrain.net import streams as streams_mod
from p2ptrain.net.guard import Guard
from p2ptrain.net.streams import MAX_FRAME_WAIT, Streams, frame_wait
from p2ptrain.net.swarm import SwarmConfig
from p2ptrain.net.wire import read_frame, write_frame


async def _exchange(wait: float | None, gap: float, n: int = 3) -> tuple[list[bytes], dict[str, Any] | None]:
    """A handler of streamed ``part`` messages on one end of a loopback TCP pair; the other end sends a header and
    ``n`` chunk frames ``gap`` seconds apart. Returns the chunks the handler got and the reply (None: none)."""
    got: list[bytes] = []

    async def handler(sender: str, msg: dict[str, Any]) -> dict[str, Any]:
        assert "wait" not in msg  # the exchange's, not the message's: a stored result must not carry it
        async for data in msg["_frames"]:
            got.append(data)
        return {"ok": True}

    cfg = SwarmConfig(run_id="fw")
    streams = Streams(cfg, SimpleNamespace(peer_id="me"), Guard(cfg.guard), lambda p: False, lambda p: [])
    callback = streams.on_stream("part", handler)
    accepted: asyncio.Queue[tuple[Any, Any]] = asyncio.Queue()

    async def on(r: Any, w: Any) -> None:
        await accepted.put((r, w))

    server = await asyncio.start_server(on, "127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    sr, sw = await asyncio.wait_for(accepted.get(), 5)
    serving = asyncio.create_task(callback(SimpleNamespace(peer_id="them"), sr, sw))
    reply = None
    try:
        head: dict[str, Any] = {"key": "r", "chunks": n} | ({} if wait is None else {"wait": wait})
        await write_frame(writer, head, timeout=5)
        for i in range(n):
            await asyncio.sleep(gap)
            try:
                await write_frame(writer, {"data": bytes([i]) * 8}, timeout=5)
            except ConnectionError:  # the handler gave up and closed the stream
                break
        try:
            reply, _ = await read_frame(reader, timeout=10)
        except Exception:  # the handler gave up and closed the stream
            reply = None
        await asyncio.wait_for(serving, 10)
    finally:
        writer.close()
        server.close()
    return got, reply


@pytest.mark.timeout(60)
def test_chunks_come_as_late_as_the_sender_said(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streams_mod, "_READ_TIMEOUT", 0.3)
    got, reply = asyncio.run(_exchange(wait=5.0, gap=0.8))
    assert got == [bytes([i]) * 8 for i in range(3)] and reply == {"ok": True}
    # without a word from the sender the fixed bound holds: the handler gives up after the first gap
    got, reply = asyncio.run(_exchange(wait=None, gap=0.8))
    assert got == [] and reply is None


def test_the_wait_a_sender_asks_for_is_bounded() -> None:
    base = streams_mod._READ_TIMEOUT
    assert frame_wait(None) == frame_wait("60") == frame_wait(True) == frame_wait(math.nan) == base
    assert frame_wait(1.0) == base  # never less than the fixed bound
    assert frame_wait(120) == 120.0
    assert frame_wait(1e12) == MAX_FRAME_WAIT and frame_wait(math.inf) == base
