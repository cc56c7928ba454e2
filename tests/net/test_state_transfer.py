"""Chunked, hash-verified state transfer: pure checks of both sides, then real libp2p peers where the
source dies mid-transfer and the download still ends correct from another."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import blake3
import pytest

from p2ptrain.net.state_transfer import StateServer, fetch_chunked
from p2ptrain.net.transport import Declined, RoundFailed

BLOB = os.urandom(300_000)


def _server(blob: bytes = BLOB, chunk: int = 64 * 1024) -> StateServer:
    srv = StateServer(chunk=chunk)
    srv.provider = lambda name: blob if name == "outer" else None
    return srv


def test_download_assembles_the_chunks_and_reports_progress() -> None:
    srv, seen = _server(), []
    out = asyncio.run(fetch_chunked(srv.handle, "outer", progress=lambda d, t: seen.append((d, t))))
    assert out == BLOB
    assert [d for d, _ in seen] == [min(len(BLOB), 65536 * k) for k in range(1, 6)]  # 5 chunks of 64 KiB
    assert {t for _, t in seen} == {len(BLOB)}


def test_a_name_of_a_round_that_ended_without_it_is_declined_not_unknown() -> None:
    srv = _server()
    srv.offers.end("hier/k/", ttl=60)
    with pytest.raises(Declined):
        asyncio.run(fetch_chunked(srv.handle, "hier/k/0/s1"))
    with pytest.raises(RoundFailed) as e:  # not ended: "unknown", which a poller asks again
        asyncio.run(fetch_chunked(srv.handle, "hier/j/0/s1"))
    assert not isinstance(e.value, Declined)
    assert asyncio.run(fetch_chunked(srv.handle, "outer")) == BLOB


def test_a_transfer_stays_consistent_while_the_state_changes() -> None:
    state = {"now": BLOB}
    srv = StateServer(chunk=100_000)
    srv.provider = lambda name: state["now"]
    calls = 0

    async def call(msg: dict[str, Any]) -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls == 2:
            state["now"] = os.urandom(len(BLOB))  # the swarm applied a round mid-transfer
        return await srv.handle(msg)

    assert asyncio.run(fetch_chunked(call, "outer")) == BLOB  # the snapshot the transfer started with


@pytest.mark.parametrize("lie", ["flip", "size", "offset", "short", "huge", "error", "garbage"])
def test_a_lying_source_is_rejected(lie: str) -> None:
    srv = _server()

    async def call(msg: dict[str, Any]) -> dict[str, Any]:
        reply = dict(await srv.handle(msg))
        if lie == "flip" and msg.get("offset") == 65536:
            reply["chunk"] = bytes([reply["chunk"][0] ^ 1]) + reply["chunk"][1:]
        elif lie == "size" and "digest" not in msg:
            reply["size"] = len(BLOB) - 10
        elif lie == "offset" and msg.get("offset"):
            reply["offset"] = 0
        elif lie == "short" and msg.get("offset"):
            reply["chunk"] = b""
        elif lie == "huge":
            reply["size"] = 1 << 60  # must be refused before any allocation
        elif lie == "error":
            reply = {"error": "no state here"}
        elif lie == "garbage":
            reply = {"chunk": 5}
        return reply

    with pytest.raises(RoundFailed):
        asyncio.run(fetch_chunked(call, "outer", max_bytes=1 << 30))


def test_the_server_answers_bad_requests_with_an_error() -> None:
    srv = _server()
    for msg in ({}, {"name": 3}, {"name": "outer", "offset": -1}, {"name": "outer", "offset": "x"},
                {"name": "outer", "digest": "0" * 64, "offset": 0}, {"name": "nothing"}):
        assert "error" in asyncio.run(srv.handle(msg)), msg
    first = asyncio.run(srv.handle({"name": "outer"}))
    assert first["digest"] == blake3.blake3(BLOB).hexdigest() and first["size"] == len(BLOB)
    assert "error" in asyncio.run(srv.handle({"name": "outer", "digest": first["digest"], "offset": len(BLOB) + 1}))


@pytest.mark.net
@pytest.mark.timeout(120)
def test_source_dies_mid_transfer_and_the_download_ends_correct_from_another() -> None:
    from p2ptrain.net.swarm import HivemindTransport, SwarmConfig

    blob = os.urandom(2_000_000)

    async def main() -> None:
        cfg = SwarmConfig(run_id="state-xfer", state_chunk=100_000)
        a = await HivemindTransport.create(cfg)
        initial = await a.visible_maddrs()
        b = await HivemindTransport.create(SwarmConfig(run_id="state-xfer", initial_peers=initial, state_chunk=100_000))
        c = await HivemindTransport.create(SwarmConfig(run_id="state-xfer", initial_peers=initial))
        try:
            for t in (a, b):
                t.serve_state(lambda name: blob if name == "outer" else None)
            killed: list[asyncio.Task[None]] = []

            def progress(done: int, total: int) -> None:
                if done >= 500_000 and not killed:  # a's fifth chunk is here: a dies now
                    killed.append(asyncio.ensure_future(a.aclose()))

            async def slow_progress_fetch() -> tuple[str, bytes]:
                return await c.download_state([a.peer_id, b.peer_id], "outer", timeout=5.0, progress=progress)

            source, got = await asyncio.wait_for(slow_progress_fetch(), 90)
            assert killed, "the first source was never killed"
            assert source == b.peer_id
            assert got == blob
        finally:
            for t in (b, c, a):
                await t.aclose()

    asyncio.run(main())
