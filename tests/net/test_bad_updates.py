"""Broken or hostile updates, on both transports: each kind is refused with a strike, the honest peers
get exactly the honest-only average, and a repeat offender is banned."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import torch

from p2ptrain.collective.butterfly import part_bounds
from p2ptrain.collective.codecs import get_codec
from p2ptrain.faults import CORRUPTIONS, FaultPlan
from p2ptrain.net.guard import GuardConfig
from p2ptrain.net.memory import MemorySwarm
from p2ptrain.net.transport import JoinRequest, PeerInfo

N = 5  # four honest peers and one that sends broken updates (the last)


@asynccontextmanager
async def memory(corrupt: str, guard: GuardConfig) -> AsyncIterator[list[Any]]:
    swarm = MemorySwarm(join_window=1.0, ttl=30, guard=guard)
    ts = [swarm.transport(f"peer{i}") for i in range(N)]
    swarm.corrupt[ts[-1].peer_id] = corrupt
    for t in ts:
        await t.announce(PeerInfo(peer_id=t.peer_id))
    yield ts


@asynccontextmanager
async def libp2p(corrupt: str, guard: GuardConfig) -> AsyncIterator[list[Any]]:
    from p2ptrain.net.swarm import HivemindTransport, SwarmConfig

    ts: list[Any] = []
    try:
        ts.append(await HivemindTransport.create(SwarmConfig(run_id="bad", join_window=1.0, ttl=30, guard=guard)))
        maddrs = await ts[0].visible_maddrs()
        for i in range(1, N):
            ts.append(await HivemindTransport.create(SwarmConfig(
                run_id="bad", initial_peers=maddrs, join_window=1.0, ttl=30, guard=guard,
                faults=FaultPlan(corrupt=corrupt if i == N - 1 else None))))
        for t in ts:
            await t.announce(PeerInfo(peer_id=t.peer_id))
        for t in ts:
            for _ in range(50):
                if len(await t.peers()) == N:
                    break
                await asyncio.sleep(0.1)
        yield ts
    finally:
        await asyncio.gather(*(t.aclose() for t in ts), return_exceptions=True)


def _update(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.ones(64) + 0.1 * torch.randn(64, generator=g)


async def _rounds(ts: list[Any], rounds: int) -> list[list[Any]]:
    out = []
    for r in range(rounds):
        async def one(i: int, t: Any, r: int = r) -> Any:
            g = await t.form_group(JoinRequest(key=f"r{r}", peer_id=t.peer_id, weight=1.0, fragment=0), None,
                                   timeout=15)
            # 20 s: five daemons on two loaded cores (the suite beside a benchmark) missed 8 s once, and an honest
            # part left out makes the round partial, not the honest mean asserted below; honest rounds end long before
            return await t.allreduce(g, 0, [_update(i)], 1.0, get_codec("fp32"), timeout=20.0)

        out.append(list(await asyncio.gather(*(one(i, t) for i, t in enumerate(ts)), return_exceptions=True)))
    return out


@pytest.mark.parametrize("corrupt", CORRUPTIONS)
@pytest.mark.parametrize("make", [pytest.param(memory, id="memory"),
                                  pytest.param(libp2p, id="libp2p", marks=[pytest.mark.net, pytest.mark.timeout(180)])])
def test_each_kind_of_bad_update_is_refused_and_its_sender_banned(make: Any, corrupt: str) -> None:
    honest = torch.stack([_update(i) for i in range(N - 1)]).mean(0)

    async def go() -> None:
        async with make(corrupt, GuardConfig(ban_after=2, norm_bound=10.0)) as ts:
            results = await _rounds(ts, 3)
            bad = ts[-1].peer_id
            for r, res in enumerate(results):
                for i, x in enumerate(res[: N - 1]):
                    assert not isinstance(x, BaseException), (r, i, x)
                    assert torch.isfinite(x.tensors[0]).all()
                    assert bad not in x.contributors
                    # The honest-only mean, on every part an honest peer owns (a butterfly owner averages
                    # its own part: the bad peer's part holds its own true share, which it never corrupts).
                    keep = torch.ones(64, dtype=torch.bool)
                    if make is libp2p and bad in x.members:
                        lo, hi = part_bounds(64, len(x.members))[x.members.index(bad)]
                        keep[lo:hi] = False
                    assert torch.allclose(x.tensors[0][keep], honest[keep], atol=1e-6), (r, i, x.contributors, x.partial)
            guards = [ts[0].swarm.guard] if make is memory else [t.guard for t in ts[: N - 1]]
            # A well-formed part of another size is dropped, not held against its sender (in memory a
            # truncated update is just that; on the wire its bytes contradict its own header).
            if corrupt != "shape" and not (corrupt == "truncate" and make is memory):
                assert any(bad in g.banned for g in guards), [dict(g.strikes) for g in guards]  # banned
            assert all(set(g.strikes) <= {bad} for g in guards)  # and no honest peer was ever refused

    asyncio.run(go())
