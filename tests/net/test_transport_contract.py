"""One contract, two transports: the in-memory swarm and the real libp2p swarm on 127.0.0.1."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import torch

from p2ptrain.collective.codecs import get_codec
from p2ptrain.net.memory import MemorySwarm, MemoryTransport
from p2ptrain.net.transport import Group, JoinRequest, PeerInfo, RoundFailed, Transport

WINDOW = 1.0


@asynccontextmanager
async def memory_swarm(n: int, join_window: float = WINDOW) -> AsyncIterator[list[Transport]]:
    swarm = MemorySwarm(join_window=join_window, ttl=30)
    ts: list[Transport] = [swarm.transport(f"peer{i}") for i in range(n)]
    for t in ts:
        await t.announce(PeerInfo(peer_id=t.peer_id))
    yield ts


@asynccontextmanager
async def libp2p_swarm(n: int, run: str = "contract", join_window: float = WINDOW) -> AsyncIterator[list[Transport]]:
    """``n`` libp2p peers on 127.0.0.1 that all see each other live; closed afterwards."""
    from p2ptrain.net.swarm import HivemindTransport, SwarmConfig

    ts: list[Any] = []
    try:
        first = await HivemindTransport.create(SwarmConfig(run_id=run, join_window=join_window, ttl=30))
        ts.append(first)
        maddrs = await first.visible_maddrs()
        for _ in range(n - 1):
            ts.append(await HivemindTransport.create(SwarmConfig(run_id=run, initial_peers=maddrs,
                                                                 join_window=join_window, ttl=30)))
        for t in ts:
            await t.announce(PeerInfo(peer_id=t.peer_id))
        for t in ts:  # wait until every peer sees every announcement
            for _ in range(100):
                if len(await t.peers()) == n:
                    break
                await asyncio.sleep(0.1)
        yield ts
    finally:
        await asyncio.gather(*(t.aclose() for t in ts), return_exceptions=True)


SWARMS = [pytest.param(memory_swarm, id="memory"),
          pytest.param(libp2p_swarm, id="libp2p", marks=[pytest.mark.net, pytest.mark.timeout(120)])]
Make = Callable[..., Any]  # (n, join_window=…) -> an async context of n transports


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


async def _round(t: Transport, key: str, tensors: list[torch.Tensor], weight: float, codec: str = "fp32",
                 fp: list[float] | None = None, timeout: float = 8.0) -> Any:
    g = await t.form_group(JoinRequest(key=key, peer_id=t.peer_id, weight=weight, fragment=0), None, timeout=10)
    return g, await t.allreduce(g, 0, tensors, weight, get_codec(codec), timeout=timeout, fingerprint=fp)


@pytest.mark.parametrize("make", SWARMS)
def test_weighted_mean_is_exact_in_fp32(make: Make) -> None:
    async def go() -> None:
        async with make(3) as ts:
            vals = [[torch.arange(10.0) * (i + 1), torch.full((3, 2), float(i))] for i in range(3)]
            weights = [1.0, 2.0, 5.0]
            out = await asyncio.gather(*(_round(t, "w", v, w) for t, v, w in zip(ts, vals, weights, strict=True)))
            exp0 = sum(w * v[0] for v, w in zip(vals, weights, strict=True)) / 8
            exp1 = sum(w * v[1] for v, w in zip(vals, weights, strict=True)) / 8
            for g, r in out:
                assert len(g.members) == 3 and not r.partial and r.total_weight == 8.0
                assert torch.allclose(r.tensors[0], exp0, atol=1e-6) and torch.allclose(r.tensors[1], exp1, atol=1e-6)
                assert torch.equal(r.tensors[0], out[0][1].tensors[0])  # bitwise equal on every member

    run(go())


@pytest.mark.parametrize("make", SWARMS)
@pytest.mark.parametrize("codec", ["e3m0", "uint8"])
def test_quantized_results_are_identical_on_every_member(make: Make, codec: str) -> None:
    async def go() -> None:
        async with make(3) as ts:
            g = torch.Generator().manual_seed(0)
            vals = [[torch.randn(5000, generator=g)] for _ in ts]
            out = await asyncio.gather(*(_round(t, "q", v, 1.0, codec) for t, v in zip(ts, vals, strict=True)))
            ref = out[0][1].tensors[0]
            for _, r in out:
                assert torch.equal(r.tensors[0], ref)
            exact = sum(v[0] for v in vals) / 3
            assert (ref - exact).norm() / exact.norm() < 0.5  # quantized, but an average

    run(go())


@pytest.mark.parametrize("make", SWARMS)
def test_member_that_dies_after_joining_is_dropped(make: Make) -> None:
    async def go() -> None:
        # A window of 3 s, not 1: the three joins must all reach the leader within it, and a suite with a benchmark
        # beside it once had the leader close at 1 s with itself alone ("no quorum: 1 of 3 live peers joined").
        # The group closes as soon as all three joined, so the longer window costs nothing when they are on time.
        async with make(3, join_window=3.0) as ts:
            async def dead(t: Transport) -> Group:  # joins, then never sends its share
                return await t.form_group(JoinRequest(key="d", peer_id=t.peer_id, weight=1.0, fragment=0), None,
                                          timeout=10)

            vals = [[torch.full((100,), float(i))] for i in range(3)]
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            out = await asyncio.gather(_round(ts[0], "d", vals[0], 1.0, timeout=4.0),
                                       _round(ts[1], "d", vals[1], 1.0, timeout=4.0), dead(ts[2]))
            assert loop.time() - t0 < 4.0 + 3.0 + 3
            for _, r in out[:2]:
                assert r.partial and ts[2].peer_id not in r.contributors
                # Parts owned by the dead peer fell back to zero; the rest averages the two live peers.
                assert set(torch.unique(r.tensors[0]).tolist()) <= {0.0, 0.5}
                assert torch.equal(r.tensors[0], out[0][1].tensors[0])

    run(go())


@pytest.mark.parametrize("make", SWARMS)
def test_divergent_member_is_excluded_and_told(make: Make) -> None:
    async def go() -> None:
        async with make(3) as ts:
            prints = [[1.0, 2.0], [1.0, 2.0], [1.0, 2.5]]
            vals = [[torch.full((60,), float(i))] for i in range(3)]
            out = await asyncio.gather(*(_round(t, "f", v, 1.0, fp=p) for t, v, p in zip(ts, vals, prints, strict=True)))
            for i, (_, r) in enumerate(out):
                assert r.divergent == (i == 2)
                assert ts[2].peer_id not in r.contributors
                assert torch.allclose(r.tensors[0], torch.full((60,), 0.5))

    run(go())


@pytest.mark.parametrize("make", SWARMS)
def test_leader_decides_the_fragment_and_late_joiners_are_refused(make: Make) -> None:
    async def go() -> None:
        async with make(3) as ts:
            def decide(reqs: Any) -> int:
                return (max(max(r.scores) for r in reqs) > 5 and 2) or 1  # a deterministic function of all views

            async def join(t: Transport, score: float) -> Group:
                req = JoinRequest(key="s", peer_id=t.peer_id, weight=1.0, fragment=None, scores=[score])
                return await t.form_group(req, decide, timeout=10)

            g = await asyncio.gather(*(join(t, s) for t, s in zip(ts, [1.0, 9.0, 2.0], strict=True)))
            assert {x.fragment for x in g} == {2} and len({x.members for x in g}) == 1
            with pytest.raises(RoundFailed):
                await join(ts[1], 0.0)  # the round "s" is closed

    run(go())


@pytest.mark.parametrize("make", SWARMS)
def test_state_is_served_and_unknown_state_refused(make: Make) -> None:
    async def go() -> None:
        async with make(2) as ts:
            ts[1].serve_state(lambda name: b"theta-bytes" * 1000 if name == "outer" else None)
            assert await ts[0].fetch_state(ts[1].peer_id, "outer", timeout=5) == b"theta-bytes" * 1000
            with pytest.raises(RoundFailed):
                await ts[0].fetch_state(ts[1].peer_id, "nothing", timeout=5)

    run(go())


@pytest.mark.parametrize("make", SWARMS)
def test_a_bequest_is_downloaded_by_the_heir_and_its_answer_returned(make: Make) -> None:
    """A leaver serves its will as a state and asks an heir to take it: the heir downloads exactly those bytes,
    and what it says (taken, or why not) comes back; one that serves no bequests says so; a dead heir is a
    RoundFailed within the timeout."""
    will = bytes(range(256)) * 3000  # 768 kB: more than one chunk of a state download

    async def go() -> None:
        async with make(3) as ts:
            leaver, heir, other = ts
            leaver.serve_state(lambda name: will if name == "bequest" else None)
            got: list[tuple[str, bytes]] = []

            async def take(sender: str, data: bytes) -> str | None:
                got.append((sender, data))
                return None if len(got) == 1 else "fragment 0: norm 9 over 4"

            heir.serve_bequests(take)
            assert await leaver.bequeath(heir.peer_id, "bequest", timeout=20) is None
            assert got == [(leaver.peer_id, will)]
            assert await leaver.bequeath(heir.peer_id, "bequest", timeout=20) == "fragment 0: norm 9 over 4"
            assert await leaver.bequeath(other.peer_id, "bequest", timeout=20) == "no heir here"
            if isinstance(heir, MemoryTransport):
                heir.swarm.kill(heir.peer_id)
            else:
                await heir.aclose()
            with pytest.raises(RoundFailed):
                await asyncio.wait_for(leaver.bequeath(heir.peer_id, "bequest", timeout=3), 30)

    run(go())
