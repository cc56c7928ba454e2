"""The owner's pipelined mean (net/pipelined.py): chunk by chunk as the contributions arrive, the same values as
the whole-part path, and a member that dies mid-stream leaves a partial but exact round."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from typing import Any

import pytest
import torch

from p2ptrain.collective.aggregate import weighted_mean
from p2ptrain.collective.codecs import get_codec
from p2ptrain.faults import FaultPlan
from p2ptrain.net.chunks import Progress
from p2ptrain.net.mailbox import Mailbox
from p2ptrain.net.pipelined import PipelinedMean, Source, Unpipelined, whole
from p2ptrain.net.transport import JoinRequest, PeerInfo

pytestmark = [pytest.mark.timeout(180)]


async def _until(cond: Any, timeout: float = 20.0) -> None:
    """Wait until ``cond()`` holds (the producer's chunks are computed in worker threads: on a loaded machine
    that takes a while), failing after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.01)


def test_each_chunk_is_averaged_once_its_values_are_in_and_the_last_once_all_are_filed() -> None:
    async def go() -> None:
        box, filed = Mailbox(), {"a": 1}  # the owner files its own share first
        g = torch.Generator().manual_seed(0)
        xs = {m: torch.randn(10, generator=g) for m in ("a", "b", "c")}
        ws = {"a": 1.0, "b": 3.0, "c": 0.5}
        arriving = {m: Progress(10, box.poke) for m in ("b", "c")}
        sources = [Source("a", whole(xs["a"]), ws["a"])] + [Source(m, arriving[m], ws[m]) for m in ("c", "b")]
        mean = PipelinedMean(get_codec("fp32"), 10, 4, sources, box, filed, deadline=time.monotonic()
                             + 60)
        task = asyncio.create_task(mean.produce())

        def arrive(m: str, upto: int) -> None:
            arriving[m].values[:upto] = xs[m][:upto]
            arriving[m].ready = upto
            box.poke()

        arrive("b", 4)
        await asyncio.sleep(0.05)
        assert mean.payloads == []  # c has nothing yet
        arrive("c", 8)
        await _until(lambda: len(mean.payloads) >= 1)
        await asyncio.sleep(0.05)
        assert len(mean.payloads) == 1  # [0, 4): everyone's in; [4, 8): b's are not
        arrive("b", 10)
        arrive("c", 10)
        await _until(lambda: len(mean.payloads) >= 2)
        await asyncio.sleep(0.05)
        assert len(mean.payloads) == 2  # the last chunk waits for the contributions to be whole and filed
        filed.update({"b": 1, "c": 1})
        box.poke()
        await asyncio.wait_for(task, 5)
        want = weighted_mean([xs[m] for m in sorted(xs)], [ws[m] for m in sorted(xs)])
        assert torch.equal(mean.decoded, want)  # bitwise the whole part's mean (same sums, same order)
        ref = sum(ws[m] * xs[m].double() for m in xs) / sum(ws.values())
        assert float((mean.decoded.double() - ref).abs().max()) < 1e-6

    asyncio.run(go())


@pytest.mark.parametrize("breaks", ["failed", "late"])
def test_a_contribution_that_breaks_off_or_is_late_stops_the_pipeline(breaks: str) -> None:
    async def go() -> None:
        box = Mailbox()
        p = Progress(8, box.poke)
        mean = PipelinedMean(get_codec("fp32"), 8, 4, [Source("a", whole(torch.ones(8)), 1.0), Source("b", p, 1.0)],
                             box, {}, deadline=time.monotonic() + (0.3 if breaks == "late" else 60))
        task = asyncio.create_task(mean.produce())
        p.values[:4], p.ready = 1.0, 4
        box.poke()
        await _until(lambda: len(mean.payloads) >= 1)
        if breaks == "failed":
            p.failed = True
            box.poke()
        with pytest.raises(Unpipelined):
            await asyncio.wait_for(task, 5)
        assert len(mean.payloads) == 1  # never the last chunk: no member can hold a whole average

        chunks = mean.chunks()
        assert await chunks.__anext__() == mean.payloads[0]
        with pytest.raises(Exception, match="encoding our part failed"):
            await chunks.__anext__()

    asyncio.run(go())


async def _swarm(n: int, plans: list[FaultPlan], pipeline: bool, wait: bool = True) -> list[Any]:
    from p2ptrain.net.swarm import HivemindTransport, SwarmConfig

    ts: list[Any] = []
    try:
        for i in range(n):
            initial = await ts[0].visible_maddrs() if ts else []
            ts.append(await HivemindTransport.create(SwarmConfig(
                run_id=f"pipe-{os.getpid()}", initial_peers=initial, join_window=2.0, ttl=30, chunk_values=1024,
                pipeline=pipeline, faults=plans[i])))
        for t in ts:
            await t.announce(PeerInfo(peer_id=t.peer_id))
        for t in ts:
            for _ in range(200 if wait else 0):
                if len(await t.peers()) >= n:
                    break
                await asyncio.sleep(0.1)
        return ts
    except BaseException:
        await asyncio.gather(*(t.aclose() for t in ts), return_exceptions=True)
        raise


async def _round(ts: list[Any], xs: list[torch.Tensor], ws: list[float], codec: str, key: str = "r") -> list[Any]:
    async def one(t: Any, x: torch.Tensor, w: float) -> Any:
        g = await t.form_group(JoinRequest(key=key, peer_id=t.peer_id, weight=w, fragment=0), None, timeout=30)
        return await t.allreduce(g, 0, [x], w, get_codec(codec), timeout=30)

    return list(await asyncio.gather(*(one(t, x, w) for t, x, w in zip(ts, xs, ws, strict=True))))


@pytest.mark.net
@pytest.mark.parametrize("codec", ["fp32", "e3m0"])
def test_pipelined_and_whole_part_rounds_give_the_same_values(codec: str) -> None:
    n = 30_011  # parts of ~10k values: ten chunks of 1024, the last one short
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(n, generator=g) for _ in range(3)]
    ws = [1.0, 2.0, 0.5]

    async def go(pipeline: bool) -> list[Any]:
        ts = await _swarm(3, [FaultPlan() for _ in range(3)], pipeline)
        try:
            return await _round(ts, xs, ws, codec)
        finally:
            await asyncio.gather(*(t.aclose() for t in ts), return_exceptions=True)

    piped, plain = asyncio.run(go(True)), asyncio.run(go(False))
    for r in piped:
        assert "headers" in r.timeline  # the pipelined path ran
        assert not r.partial and len(r.contributors) == 3
        assert torch.equal(r.tensors[0], piped[0].tensors[0])
    assert all("headers" not in r.timeline for r in plain)
    # Members' order differs between the two swarms (peer ids), but each part is summed in sorted order both
    # ways, so the values agree to float32 rounding of one float64 sum.
    ref = sum(w * x.double() for w, x in zip(ws, xs, strict=True)) / sum(ws)
    if codec == "fp32":
        assert float((piped[0].tensors[0].double() - ref).abs().max()) < 1e-6
        assert float((plain[0].tensors[0].double() - ref).abs().max()) < 1e-6
    else:
        assert float((piped[0].tensors[0].double() - ref).abs().mean()) < 0.2
        assert float((piped[0].tensors[0] - plain[0].tensors[0]).abs().mean()) < 0.2


_DYING = """
import asyncio, sys, torch
from p2ptrain.collective.codecs import get_codec
from p2ptrain.faults import FaultPlan
from p2ptrain.net.swarm import HivemindTransport, SwarmConfig
from p2ptrain.net.transport import JoinRequest, PeerInfo

async def main():
    t = await HivemindTransport.create(SwarmConfig(run_id=sys.argv[1], initial_peers=sys.argv[2:], join_window=2.0,
                                                   ttl=30, chunk_values=1024, faults=FaultPlan(kill_after_chunks=3)))
    await t.announce(PeerInfo(peer_id=t.peer_id))
    while len(await t.peers()) < 3:
        await asyncio.sleep(0.1)
    g = await t.form_group(JoinRequest(key="r", peer_id=t.peer_id, weight=1.0, fragment=0), None, timeout=30)
    await t.allreduce(g, 0, [torch.full((30_000,), 3.0)], 1.0, get_codec("fp32"), timeout=30)

asyncio.run(main())
"""


@pytest.mark.net
def test_a_member_that_dies_mid_stream_leaves_an_exact_partial_round() -> None:
    """A member (its own process) SIGKILLs itself with 3 chunks of its parts sent: the owners that were averaging
    its stream fall back to whole parts without it, and the survivors end with the same, exact values."""
    n = 30_000
    xs = [torch.full((n,), float(i + 1)) for i in range(2)]

    async def go() -> None:
        ts = await _swarm(2, [FaultPlan(), FaultPlan()], True, wait=False)
        dying = await asyncio.create_subprocess_exec(sys.executable, "-c", _DYING, ts[0].cfg.run_id,
                                                     *await ts[0].visible_maddrs())
        try:
            for t in ts:
                for _ in range(300):
                    if len(await t.peers()) >= 3:
                        break
                    await asyncio.sleep(0.1)
            a, b = await _round(ts, xs, [1.0, 1.0], "fp32")
            assert await asyncio.wait_for(dying.wait(), 30) == -signal.SIGKILL  # it died mid-stream
            assert torch.equal(a.tensors[0], b.tensors[0])
            assert len(a.members) == 3 and a.partial
            assert set(a.contributors) == {ts[0].peer_id, ts[1].peer_id}
            for j, (lo, hi) in enumerate((j * n // 3, (j + 1) * n // 3) for j in range(3)):
                part = a.tensors[0][lo:hi]
                if a.members[j] not in (ts[0].peer_id, ts[1].peer_id):
                    assert bool((part == 0).all())  # nobody could average the dead member's part
                else:
                    assert bool((part == 1.5).all())  # the survivors' mean: nothing of the dead member's
        finally:
            if dying.returncode is None:
                dying.kill()
                await dying.wait()
            await asyncio.gather(*(t.aclose() for t in ts), return_exceptions=True)

    asyncio.run(go())
