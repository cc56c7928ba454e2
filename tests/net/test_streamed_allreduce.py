"""Parts streamed in chunks (encode, transfer and decode overlap): exact results, keys checked, lies refused."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from p2ptrain.collective.butterfly import chunk_bounds
from p2ptrain.collective.codecs import get_codec
from p2ptrain.net.auth import SwarmKey
from p2ptrain.net.claims import sign_contribution
from p2ptrain.net.pieces import payload_sha
from p2ptrain.net.transport import JoinRequest, RoundFailed

from .peers import announce_and_wait

pytestmark = [pytest.mark.net, pytest.mark.timeout(120)]

SECRET = b"streamed-chunks-test-secret-0123456789"


def test_chunk_bounds() -> None:
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(8, 4) == [(0, 4), (4, 8)]
    assert chunk_bounds(0, 4) == []
    with pytest.raises(ValueError):
        chunk_bounds(5, 0)


async def _swarm(n: int, key: SwarmKey | None, chunk: int = 1024) -> list[Any]:
    from p2ptrain.net.swarm import HivemindTransport, SwarmConfig

    ts: list[Any] = []
    try:
        ts.append(await HivemindTransport.create(SwarmConfig(run_id="stream", join_window=2.0, swarm_key=key,
                                                             chunk_values=chunk)))
        maddrs = await ts[0].visible_maddrs()
        for _ in range(n - 1):
            ts.append(await HivemindTransport.create(SwarmConfig(run_id="stream", initial_peers=maddrs,
                                                                 join_window=2.0, swarm_key=key, chunk_values=chunk)))
        await announce_and_wait(ts, n)
        return ts
    except BaseException:
        await asyncio.gather(*(t.aclose() for t in ts), return_exceptions=True)
        raise


@pytest.mark.parametrize("codec_name,keyed", [("fp32", False), ("e3m0", True)])
def test_streamed_allreduce_is_exact_and_identical(codec_name: str, keyed: bool) -> None:
    n = 10_007  # parts of ~3336 values: four chunks of 1024, the last one short

    async def go() -> None:
        ts = await _swarm(3, SwarmKey(SECRET) if keyed else None)
        try:
            gen = torch.Generator().manual_seed(1)
            xs = [torch.randn(n, generator=gen) for _ in ts]
            codec = get_codec(codec_name)

            async def one(t: Any, x: torch.Tensor) -> Any:
                g = await t.form_group(JoinRequest(key="r", peer_id=t.peer_id, weight=1.0, fragment=0), None,
                                       timeout=20)
                return await t.allreduce(g, 0, [x[:4000].view(40, 100), x[4000:]], 1.0, codec, timeout=20)

            res = await asyncio.gather(*(one(t, x) for t, x in zip(ts, xs, strict=True)))
            flat = [torch.cat([p.reshape(-1) for p in r.tensors]) for r in res]
            for r in res:
                assert not r.partial and len(r.contributors) == 3
                assert r.tensors[0].shape == (40, 100)
            for f in flat[1:]:
                assert torch.equal(f, flat[0])  # every member holds the same decoded values
            ref = torch.stack([x.double() for x in xs]).mean(0)
            if codec_name == "fp32":
                assert float((flat[0].double() - ref).abs().max()) < 1e-6
                # each peer sent 2 of 3 parts of its vector and its averaged part twice: 4 × n/3 × 4 bytes
                assert abs(res[0].bytes_sent - 4 * 4 * n / 3) <= 16
            else:  # 4-bit: the error is bounded by the block scale, not by chunking
                assert float((flat[0].double() - ref).abs().max()) < 1.0
                err_chunked = float((flat[0].double() - ref).abs().mean())
                assert err_chunked < 0.2
        finally:
            await asyncio.gather(*(t.aclose() for t in ts), return_exceptions=True)

    asyncio.run(go())


def test_a_streamed_part_that_lies_about_its_chunks_is_refused() -> None:
    async def go() -> None:
        a, b = await _swarm(2, SwarmKey(SECRET))
        try:
            codec = get_codec("fp32")
            msg = {"key": "x", "phase": 0, "part": 0, "weight": 1.0, "fp": None, "codec": "fp32", "numel": 3000,
                   "chunk": 1024, "chunks": 3}

            def chunks(sizes: list[int]) -> Any:
                async def gen() -> Any:
                    for s in sizes:
                        yield codec.encode(torch.ones(s))
                return gen

            a.guard.cfg.ban_after = 10  # refusals are counted here, not banned: the honest stream must get through

            async def refused(header: dict[str, Any], sizes: list[int]) -> bool:
                """The receiver stops reading at the first bad chunk and replies with an error; the sender,
                still writing, sees that reply or (when the stream is torn down first) a failed round."""
                try:
                    reply, _ = await b._call(a.peer_id, "part", header, timeout=5, chunks=chunks(sizes))
                except RoundFailed:
                    return True
                return "error" in reply

            # a chunk shorter than announced: refused and a strike (two if the sender retried on a reset stream)
            assert await refused(msg, [1024, 1000, 952])
            first = a.guard.strikes[b.peer_id]
            assert first >= 1
            # a chunk size below the minimum: refused
            assert await refused({**msg, "chunk": 1, "chunks": 3000}, [1] * 3)
            assert a.guard.strikes[b.peer_id] > first
            assert ("x", 0) not in a._mail or b.peer_id not in a._mail[("x", 0)].contribs
            # the honest stream is accepted, once signed by its sender (the signature follows the chunks)
            honest = [codec.encode(torch.ones(s)) for s in (1024, 1024, 952)]
            sig, _ = sign_contribution(b.identity, a.cfg.run_id, "x", 0, 0, 1.0, 3000, "fp32", 1024,
                                     payload_sha(honest, 3000, codec, 1024))
            unsigned, _ = await b._call(a.peer_id, "part", msg, timeout=5, chunks=chunks([1024, 1024, 952]))
            assert "error" in unsigned
            reply, _ = await b._call(a.peer_id, "part", {**msg, "trailer": True}, timeout=5,
                                     chunks=chunks([1024, 1024, 952]),
                                     trailer=lambda: {"sig": sig, "pk": b.identity.public})
            assert reply == {"ok": True}
            assert torch.equal(a._mail[("x", 0)].contribs[b.peer_id][1], torch.ones(3000))
        finally:
            await asyncio.gather(a.aclose(), b.aclose(), return_exceptions=True)

    asyncio.run(go())


def test_chunks_without_the_swarm_key_are_refused() -> None:
    async def go() -> None:
        from p2ptrain.net.swarm import HivemindTransport

        a, b = await _swarm(2, SwarmKey(SECRET))
        try:
            msg = {"key": "y", "phase": 0, "part": 0, "weight": 1.0, "fp": None, "codec": "fp32", "numel": 2048,
                   "chunk": 1024, "chunks": 2}

            async def unsealed_chunks() -> Any:  # a peer that tags the header but not its chunks
                yield get_codec("fp32").encode(torch.ones(1024))
                yield get_codec("fp32").encode(torch.ones(1024))

            key, b.cfg.swarm_key = b.cfg.swarm_key, None
            seal_header = key.seal(msg, b.peer_id, "part", "stream")
            with pytest.raises(RoundFailed):
                await HivemindTransport._call(b, a.peer_id, "part", seal_header, timeout=3, chunks=unsealed_chunks)
            assert a.guard.strikes[b.peer_id] >= 1
            assert ("y", 0) not in a._mail or b.peer_id not in a._mail[("y", 0)].contribs
        finally:
            await asyncio.gather(a.aclose(), b.aclose(), return_exceptions=True)

    asyncio.run(go())


def test_every_member_forgets_a_finished_rounds_contributions_and_then_its_mailbox() -> None:
    """A long run must not keep every round's tensors: when a member's all-reduce returns, the
    contributions it received are dropped at once, and every member (not only a round's leader)
    collects the mailbox a while later (the soak's memory grew ~2 MB per round before)."""

    async def go() -> None:
        ts = await _swarm(3, None)
        try:
            codec = get_codec("fp32")

            async def one(t: Any, key: str) -> Any:
                g = await t.form_group(JoinRequest(key=key, peer_id=t.peer_id, weight=1.0, fragment=0), None,
                                       timeout=20)
                return await t.allreduce(g, 0, [torch.ones(3000)], 1.0, codec, timeout=20)

            for key in ("r1", "r2"):
                await asyncio.gather(*(one(t, key) for t in ts))
            for t in ts:
                boxes = {k: m for k, m in t._mail.items() if k[0] in ("r1", "r2")}
                assert set(boxes) == {("r1", 0), ("r2", 0)}
                assert all(m.finished is not None and not m.contribs for m in boxes.values())
                # Our averaged part can still be fetched, unless every member said it holds every part (a verified
                # round's verdicts: then nobody asks, and the results went at once)
                assert all(not m.results if m.everyone_holds_all() else m.results for m in boxes.values())
                t._gc(after_finish=0.0)
                assert not any(k[0] in ("r1", "r2") for k in t._mail), t.peer_id
        finally:
            await asyncio.gather(*(t.aclose() for t in ts), return_exceptions=True)

    asyncio.run(go())
