"""Hierarchical rounds by region (net/hierarchy.py): the same weighted mean as a flat round, one fragment across
regions per region, and a carrier that dies or lies cannot stall or poison its region."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import blake3
import pytest
import torch

from p2ptrain.algo.methods import method_config
from p2ptrain.collective.codecs import get_codec
from p2ptrain.data import Corpus
from p2ptrain.net.hierarchy import _HEADER, cells_of, hierarchical_allreduce, plan_for
from p2ptrain.net.memory import MemorySwarm
from p2ptrain.net.standin import standin_of
from p2ptrain.net.transport import Group, JoinRequest, PeerInfo, ReduceResult, RoundFailed, Transport

from .peers import Spec, applied_agree, memory_transports, run_peers
from .test_transport_contract import libp2p_swarm

WINDOW = 1.0


@asynccontextmanager
async def memory_swarm(n: int, swarm: MemorySwarm | None = None) -> AsyncIterator[list[Transport]]:
    swarm = swarm or MemorySwarm(join_window=WINDOW, ttl=30)
    ts: list[Transport] = [swarm.transport(f"peer{i}") for i in range(n)]
    for t in ts:
        await t.announce(PeerInfo(peer_id=t.peer_id))
    yield ts


SWARMS = [pytest.param(memory_swarm, id="memory"),
          pytest.param(libp2p_swarm, id="libp2p", marks=[pytest.mark.net, pytest.mark.timeout(150)])]
Make = Callable[[int], Any]


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


def _group(members: list[str], regions: list[str], key: str = "h") -> Group:
    order = sorted(range(len(members)), key=lambda i: members[i])
    return Group(key, tuple(members[i] for i in order), min(members), 0, "", None, tuple(regions[i] for i in order))


def test_plan_spreads_the_shards_over_each_regions_members() -> None:
    g = _group(["a1", "a2", "a3", "b1", "b2", "c1"], ["A", "A", "A", "B", "B", "C"])
    plans = {m: plan_for(g, m) for m in g.members}
    assert all(p is not None for p in plans.values())
    p = plans["a2"]
    assert p is not None and p.shards == 3 and p.local.members == ("a1", "a2", "a3")
    # Shard s: member s mod n of every region; each region's members share the shards, one carrier a region.
    assert p.carriers == {0: ("a1", "b1", "c1"), 1: ("a2", "b2", "c1"), 2: ("a3", "b1", "c1")}
    assert [plans[m].carried for m in ("a1", "a2", "a3", "b1", "b2", "c1")] == [(0,), (1,), (2,), (0, 2), (1,),
                                                                              (0, 1, 2)]
    assert plans["b2"].holder == {0: "b1", 1: "b2", 2: "b1"}  # type: ignore[union-attr]
    # Region groups are told apart by key; every member of a region names the same group.
    assert plans["a1"].local == plans["a3"].local != plans["b1"].local  # type: ignore[union-attr]


def test_flat_when_one_region_or_no_region_has_two_members() -> None:
    assert plan_for(_group(["a", "b", "c"], ["X", "X", "X"]), "a") is None
    assert plan_for(_group(["a", "b", "c"], ["X", "Y", "Z"]), "a") is None
    assert plan_for(Group("k", ("a", "b"), "a", 0), "a") is None  # no regions announced
    assert plan_for(_group(["a", "b", "c"], ["X", "X", "Y"]), "zz") is None  # not a member


def test_cells_bound_every_step_and_change_from_round_to_round() -> None:
    """Without regions, 10 members and G = 4 make 3 balanced cells of ≤ 4; every member is in one; each shard
    group has one carrier per cell (3), so no step involves more than 4 peers; another round key, other cells.
    Regions larger than G are split, smaller ones kept whole."""
    members = [f"p{i:02d}" for i in range(10)]
    g = Group("k1", tuple(members), "p00", 0)
    cells = cells_of(g, 4)
    assert sorted(len(c) for _, c in cells) == [3, 3, 4]
    assert sorted(m for _, c in cells for m in c) == members
    plans = {m: plan_for(g, m, 4) for m in members}
    assert all(p is not None and len(p.local.members) <= 4 and all(len(c) == 3 for c in p.carriers.values())
               for p in plans.values())
    assert {c for _, c in cells_of(Group("k2", tuple(members), "p00", 0), 4)} != {c for _, c in cells}
    assert plan_for(g, "p00") is None  # one region, no bound: flat
    assert plan_for(g, "p00", 10) is None  # everyone fits in one cell: flat
    rg = _group(members, ["a"] * 6 + ["b"] * 4)
    assert sorted((r, len(c)) for r, c in cells_of(rg, 4)) == [("a", 3), ("a", 3), ("b", 4)]
    with pytest.raises(ValueError, match="at least 2"):
        plan_for(g, "p00", 1)


def test_group_regions_travel_with_the_group_and_must_match_its_members() -> None:
    g = _group(["b", "a"], ["east", "west"])
    assert g.members == ("a", "b") and g.regions == ("west", "east")
    assert Group.from_wire(g.to_wire()) == g
    with pytest.raises(ValueError, match="regions"):
        Group("k", ("a", "b"), "a", 0, regions=("x",))
    r = JoinRequest(key="k", peer_id="p", weight=1.0, region="eu")
    assert JoinRequest.from_wire(r.to_wire()).region == "eu"


async def _form(ts: list[Transport], regions: list[str], key: str) -> list[Group]:
    return list(await asyncio.gather(*(
        t.form_group(JoinRequest(key=key, peer_id=t.peer_id, weight=1.0, fragment=0, region=r), None, timeout=20)
        for t, r in zip(ts, regions, strict=True))))


async def _hier(t: Transport, g: Group, x: list[torch.Tensor], w: float, codec: str = "fp32",
                timeout: float = 30.0, max_group: int | None = None) -> ReduceResult:
    plan = plan_for(g, t.peer_id, max_group)
    assert plan is not None
    return await hierarchical_allreduce(t, g, plan, 0, x, w, get_codec(codec), timeout=timeout)


@pytest.mark.parametrize("make", SWARMS)
def test_hierarchical_round_is_the_flat_weighted_mean(make: Make) -> None:
    """2 regions × 3 members (and weights that differ): every member ends with the same bytes, equal to the
    float64 weighted mean of all six to fp32 rounding; the group formed by the transport carries the regions."""
    async def go() -> None:
        async with make(6) as ts:
            regions = ["eu", "us", "eu", "us", "eu", "us"]
            groups = await _form(ts, regions, "h1")
            assert all(g.regions for g in groups) and len({g for g in groups}) == 1
            gen = torch.Generator().manual_seed(3)
            xs = [[torch.randn(1000, generator=gen), torch.randn(7, 3, generator=gen)] for _ in ts]
            ws = [1.0, 2.0, 0.5, 3.0, 1.5, 1.0]
            out = await asyncio.gather(*(_hier(t, g, x, w) for t, g, x, w in zip(ts, groups, xs, ws, strict=True)))
            total = sum(ws)
            for k in range(2):
                exp = sum(w * x[k].double() for x, w in zip(xs, ws, strict=True)) / total
                for r in out:
                    assert torch.equal(r.tensors[k], out[0].tensors[k])  # bitwise equal on every member
                    assert r.tensors[k].shape == xs[0][k].shape
                    assert (r.tensors[k].double() - exp).abs().max() < 1e-6
            for r in out:
                assert not r.partial and r.total_weight == pytest.approx(total)

    run(go())


def test_unequal_regions_and_a_lossy_codec_give_every_member_the_same_bytes() -> None:
    async def go() -> None:
        async with memory_swarm(5) as ts:
            regions = ["a", "a", "a", "a", "b"]  # the lone member of b carries all four shards
            groups = await _form(ts, regions, "h2")
            lone, sizes = ts[4], []
            reduce = lone.allreduce

            async def counted(group: Group, *a: Any, **k: Any) -> ReduceResult:
                sizes.append(len(group.members))
                return await reduce(group, *a, **k)

            lone.allreduce = counted  # type: ignore[method-assign]
            gen = torch.Generator().manual_seed(1)
            xs = [[torch.randn(4096, generator=gen)] for _ in ts]
            out = await asyncio.gather(*(_hier(t, g, x, 1.0, "e3m0") for t, g, x in zip(ts, groups, xs, strict=True)))
            exact = sum(x[0] for x in xs) / 5
            for r in out:
                assert torch.equal(r.tensors[0], out[0].tensors[0])
            assert (out[0].tensors[0] - exact).norm() / exact.norm() < 0.5  # quantised twice, but the mean
            # its cell of one is no all-reduce: only the four shards' steps across the cells (2 members each)
            assert sizes == [2, 2, 2, 2], sizes

    run(go())


def test_a_carrier_that_never_offers_its_shard_is_replaced_by_another_regions_carrier() -> None:
    """A carrier whose offers vanish (it crashed after its cross-region step): its region mates fetch the shard
    from the other region's carrier of it and end with the same values as everyone."""
    async def go() -> None:
        async with memory_swarm(4) as ts:
            regions = ["a", "a", "b", "b"]
            groups = await _form(ts, regions, "h3")
            quiet = ts[1]  # carries shard 1 of region a
            quiet.offers.put = lambda name, data, ttl: "0" * 64  # type: ignore[method-assign]
            xs = [[torch.full((10,), float(i))] for i in range(4)]
            out = await asyncio.gather(*(_hier(t, g, x, 1.0, timeout=4.0)
                                         for t, g, x in zip(ts, groups, xs, strict=True)))
            for r in out:
                assert torch.allclose(r.tensors[0], torch.full((10,), 1.5))

    run(go())


def test_a_carrier_whose_carry_failed_sends_its_cell_to_another_carrier_at_once() -> None:
    """A carrier that cannot offer its shard (here its offers fail; in the churn benchmark its round failed before
    it began, frozen through its join) declines it once its round ended, and its region mate fetches the shard
    from the other region's carrier then, not after waiting out its own carrier (at least 5 s after the witness
    answered, up to 3/4 of the round: failed rounds took 67 s median in the churn benchmark and held the
    compute thread meanwhile)."""
    async def go() -> None:
        async with memory_swarm(4) as ts:
            regions = ["a", "a", "b", "b"]
            groups = await _form(ts, regions, "hc")
            broken = ts[1]  # carries shard 1 of region a
            put = broken.offers.put

            def failing_put(name: str, data: bytes, **kw: Any) -> str:
                if name.startswith("hier/hc/0/s1"):
                    raise OSError("no room to offer it")
                return put(name, data, **kw)

            broken.offers.put = failing_put  # type: ignore[method-assign]
            fetch = broken.fetch_state

            async def slow_fetch(peer: str, name: str, **kw: Any) -> bytes:  # its own round lasts (its shards late)
                await asyncio.sleep(30.0)
                return await fetch(peer, name, **kw)

            broken.fetch_state = slow_fetch  # type: ignore[method-assign]
            xs = [[torch.full((10,), float(i))] for i in range(4)]
            t0 = asyncio.get_running_loop().time()
            mine = asyncio.ensure_future(_hier(broken, groups[1], xs[1], 1.0, timeout=60.0))
            try:
                out = await asyncio.gather(*(_hier(t, g, x, 1.0, timeout=60.0)
                                             for t, g, x in zip(ts, groups, xs, strict=True) if t is not broken))
            finally:
                mine.cancel()
                await asyncio.gather(mine, return_exceptions=True)
            # declined as its carry failed, not when its round ends: not the ≥ 5 s its mate waited for it before
            assert asyncio.get_running_loop().time() - t0 < 4.0
            for r in out:
                assert torch.allclose(r.tensors[0], torch.full((10,), 1.5))

    run(go())


def test_a_silent_carrier_is_given_up_once_another_cells_carrier_has_offered(monkeypatch: pytest.MonkeyPatch) -> None:
    """Our cell's carrier gives no answer at all (frozen or cut off after the cross step) while another cell's carrier
    offers the shard after a long cross step (2 s here): the member fetches it from there once its carrier has been
    silent for SILENT s, not after three times the time it took the witness to answer (6 s more here; churn: members
    waited until 3/4 of the round and then had too little time left to fetch from another cell)."""
    import p2ptrain.net.hierarchy as hier
    from p2ptrain.net.transport import Answered

    monkeypatch.setattr(hier, "SILENT", 1.0)
    group = _group(["a1", "a2", "b1", "b2", "c1", "c2"], ["a", "a", "b", "b", "c", "c"], key="hs")
    plan = plan_for(group, "a2")
    assert plan is not None
    s = next(s for s in range(plan.shards) if plan.holder[s] != "a2")
    offer = _HEADER.pack(3.0, 3) + get_codec("fp32").encode(torch.ones(4))

    class Fake:
        peer_id = "a2"

        def __init__(self) -> None:
            self.t0 = asyncio.get_running_loop().time()

        async def fetch_state(self, peer: str, name: str, *, timeout: float, progress: Any = None) -> bytes:
            if peer == plan.holder[s]:  # silent: the request hangs
                await asyncio.sleep(timeout)
                raise TimeoutError
            if asyncio.get_running_loop().time() - self.t0 < 2.0:
                raise Answered("not yet")
            return blake3.blake3(offer).hexdigest().encode() if name.endswith("#sha") else offer

    async def go() -> tuple[bytes, int, str, float]:
        fake = Fake()
        now = time.monotonic()
        got = await hier._shard_bytes(fake, plan, group, 0, s, "a2", now + 60.0, now + 50.0)  # type: ignore[arg-type]
        return (*got, asyncio.get_running_loop().time() - fake.t0)

    data, _, source, took = run(go())
    assert data == offer and source.startswith("o:")  # another cell's carrier, named
    assert took < 6.0  # 2 s for the offer, the carrier silent since the start; not 2 + 3 × 2 s, then the fetch


def test_a_carrier_frozen_through_the_cross_step_costs_its_shard_a_cell_not_the_round() -> None:
    """3 regions × 2; a carrier of region c stops answering once its cell's step is done (a SIGSTOP, a peer that
    left mid-round, after its cell's step). Its shard's other carriers end their cross step partial within its budget and offer the
    shard early enough for every member of a and b (and c's other member, from another region's carrier) to fetch
    it before the round's deadline: all five end with the same bytes. (The cross step used to take the round's
    whole remaining time: the others' carriers offered the shard at the deadline, and every member failed.)"""
    async def go() -> None:
        async with memory_swarm(6) as ts:
            regions = ["a", "a", "b", "b", "c", "c"]
            groups = await _form(ts, regions, "hf")
            frozen = ts[5]
            step = frozen.allreduce

            async def freeze_across(group: Group, *args: Any, **kw: Any) -> ReduceResult:
                if "#s" in group.key:  # a shard's cross step: never answers
                    await asyncio.sleep(3600)
                return await step(group, *args, **kw)

            frozen.allreduce = freeze_across  # type: ignore[method-assign]
            xs = [[torch.full((12,), float(i))] for i in range(6)]
            calls = [_hier(t, g, x, 1.0, timeout=6.0) for t, g, x in zip(ts, groups, xs, strict=True)]
            calls[5] = asyncio.wait_for(calls[5], 9.0)  # (its own round never ends: it is frozen)
            out = (await asyncio.gather(*calls, return_exceptions=True))[:5]
            assert not any(isinstance(r, BaseException) for r in out), out
            assert all(torch.equal(r.tensors[0], out[0].tensors[0]) for r in out)  # type: ignore[union-attr]
            assert all(r.partial for r in out)  # type: ignore[union-attr]
            # Region c's mean never reached the frozen carrier's shard (values 6-11): its other member knows that
            # its Δ there is in no average (its method keeps that progress); a's and b's means are in every shard.
            assert [r.missing for r in out] == [(), (), (), (), ((6, 12),)]  # type: ignore[union-attr]

    run(go())


async def _all_but(ts: list[Transport], groups: list[Group], xs: list[list[torch.Tensor]], ws: list[float],
                  gone: int, timeout: float) -> list[ReduceResult | BaseException]:
    """Every member's hierarchical round; the outcomes of all but ``gone``, whose own round (frozen or dead: it never
    ends) is cancelled once theirs have ended."""
    calls = [asyncio.create_task(_hier(t, g, x, w, timeout=timeout))
             for t, g, x, w in zip(ts, groups, xs, ws, strict=True)]
    live = await asyncio.gather(*(c for i, c in enumerate(calls) if i != gone), return_exceptions=True)
    calls[gone].cancel()
    await asyncio.gather(calls[gone], return_exceptions=True)
    return live


def _cut_off(ts: list[Transport], i: int) -> None:
    """From now on nobody reaches ``ts[i]`` (libp2p transports), and it reaches nobody: frozen, to the others."""
    for k, t in enumerate(ts):
        t.blocked |= {x.peer_id for j, x in enumerate(ts) if i in (k, j) and k != j}  # type: ignore[attr-defined]


def _assert_whole_mean(live: list[ReduceResult | BaseException], xs: list[list[torch.Tensor]],
                       ws: list[float]) -> None:
    """Every outcome is a result, all the same bytes, the float64 weighted mean of every member's values (to fp32
    rounding), with nothing partial or missing."""
    assert not any(isinstance(r, BaseException) for r in live), live
    exp = sum(w * x[0].double() for x, w in zip(xs, ws, strict=True)) / sum(ws)
    for r in live:
        assert isinstance(r, ReduceResult) and isinstance(live[0], ReduceResult)
        assert torch.equal(r.tensors[0], live[0].tensors[0])
        assert (r.tensors[0].double() - exp).abs().max() < 1e-6
        assert not r.partial and r.missing == ()


def test_a_carrier_that_dies_in_a_round_of_two_cells_is_stood_in_for_by_its_cell(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """2 regions × 3 (a round of two cells: every shard crosses between two carriers); region b's carrier of shard 1
    dies once its cell's step is done. Its stand-in (the next member of b) holds the same cell mean, steps in once
    the carrier has been silent for SILENT s, and a's carrier of the shard, told by its marker, averages the shard
    with it: every live member ends with the same bytes, the whole weighted mean of all six (b's dead carrier's
    values are in its cell's mean), not partial, nothing missing. (Without the stand-in the shard heard one of its
    two carriers, and every member failed the round: "only 1 of 2 parts", then "no carrier delivered it".)"""
    import p2ptrain.net.hierarchy as hier

    monkeypatch.setattr(hier, "SILENT", 1.0)

    async def go() -> None:
        swarm = MemorySwarm(join_window=WINDOW, ttl=30)
        async with memory_swarm(6, swarm) as ts:
            regions = ["a", "b", "a", "b", "a", "b"]
            groups = await _form(ts, regions, "hd")
            dead = _carrier_of(ts, groups[0], "b", 1)
            plan = plan_for(groups[0], ts[dead].peer_id)
            assert plan is not None and standin_of(plan.carriers[1], plan.cell_of, ts[dead].peer_id) is not None
            step = ts[dead].allreduce

            async def die_across(group: Group, *args: Any, **kw: Any) -> ReduceResult:
                if "#s" in group.key:  # its cell's step is done: it dies as its cross step begins
                    swarm.kill(ts[dead].peer_id)
                return await step(group, *args, **kw)

            ts[dead].allreduce = die_across  # type: ignore[method-assign]
            gen = torch.Generator().manual_seed(5)
            xs = [[torch.randn(30, generator=gen)] for _ in ts]
            ws = [1.0, 2.0, 1.5, 0.5, 1.0, 3.0]
            live = await _all_but(ts, groups, xs, ws, dead, timeout=20.0)
            _assert_whole_mean(live, xs, ws)
            assert all(r.total_weight == pytest.approx(sum(ws)) for r in live)  # type: ignore[union-attr]

    run(go())


@pytest.mark.net
@pytest.mark.timeout(150)
def test_a_carrier_frozen_in_a_round_of_two_cells_is_stood_in_for_on_libp2p(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same on real libp2p peers with verified aggregation: region b's carrier of shard 1 freezes (nobody reaches
    it, it reaches nobody) as its cross step begins; its stand-in and a's carrier average the shard, audited as any
    cross step, and the five others end with the same bytes, the whole weighted mean."""
    import p2ptrain.net.hierarchy as hier

    monkeypatch.setattr(hier, "SILENT", 2.0)

    async def go() -> None:
        async with libp2p_swarm(6, run="hstand") as ts:
            regions = ["a", "b", "a", "b", "a", "b"]
            groups = await _form(ts, regions, "hstand")
            frozen = _carrier_of(ts, groups[0], "b", 1)
            step = ts[frozen].allreduce

            async def freeze_across(group: Group, *args: Any, **kw: Any) -> ReduceResult:
                if "#s" in group.key:  # its cell's step is done: from now on it is cut off from everyone
                    _cut_off(ts, frozen)
                return await step(group, *args, **kw)

            ts[frozen].allreduce = freeze_across  # type: ignore[method-assign]
            gen = torch.Generator().manual_seed(7)
            xs = [[torch.randn(3000, generator=gen)] for _ in ts]
            ws = [1.0, 2.0, 1.5, 0.5, 1.0, 3.0]
            _assert_whole_mean(await _all_but(ts, groups, xs, ws, frozen, timeout=40.0), xs, ws)

    run(go())


@pytest.mark.net
@pytest.mark.timeout(150)
def test_a_stand_in_whose_cells_mean_lacks_the_shard_leaves_it_to_the_other_cell(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Region b's carrier of shard 1 is cut off from everyone before step 1: in b's step it owned the part that is
    shard 1 (cells as large as the shards are many), which nobody averaged, so b's mean is zero there. Its stand-in
    does not carry those zeros at b's whole weight (the shard would be a's mean × W_a / (W_a + W_b), applied as if
    b's were in it); it says b has nothing for the shard, and a's carrier offers a's mean alone. Every live member
    ends with the same bytes: shard 1 is a's mean, b's members keep their progress there (``missing``), the other
    shards average a's and b's live members."""
    import p2ptrain.net.hierarchy as hier

    monkeypatch.setattr(hier, "SILENT", 2.0)

    async def go() -> None:
        async with libp2p_swarm(6, run="hlack") as ts:
            regions = ["a", "b", "a", "b", "a", "b"]
            groups = await _form(ts, regions, "hlack")
            gone = _carrier_of(ts, groups[0], "b", 1)
            _cut_off(ts, gone)
            xs = [[torch.full((3000,), float(i + 1))] for i in range(6)]
            live = await _all_but(ts, groups, xs, [1.0] * 6, gone, timeout=20.0)
            assert not any(isinstance(r, BaseException) for r in live), live
            lo, hi = 1000, 2000  # shard 1 of 3000 values in 3 shards
            b_live = [float(i + 1) for i in range(6) if regions[i] == "b" and i != gone]
            across = (3 * 3.0 + 2 * sum(b_live) / 2) / 5  # a: 1, 3, 5 (weight 3); b's live two (weight 2)
            for i, r in zip([i for i in range(6) if i != gone], live, strict=True):
                assert isinstance(r, ReduceResult)
                assert torch.equal(r.tensors[0], live[0].tensors[0])  # type: ignore[union-attr]
                assert torch.allclose(r.tensors[0][lo:hi], torch.full((hi - lo,), 3.0))  # a's mean alone
                assert torch.allclose(r.tensors[0][:lo], torch.full((lo,), across))
                assert r.partial and r.missing == (((lo, hi),) if regions[i] == "b" else ())

    run(go())


def test_a_void_marker_is_taken_only_onto_the_same_theta() -> None:
    """A cell that lacks a shard says so with its θ's print; the other carrier offers its cell's mean alone only onto
    the same θ (on two θ, the round's vote settles which one: taken alone, a cell went on with its own θ while the
    other failed, and the swarm repaired those rounds away)."""
    from p2ptrain.net.standin import VOID, _same_theta, void_marker

    assert void_marker([1.0, 2.0])[:1] == VOID
    assert _same_theta(void_marker([1.0, 2.0]), (1.0, 2.0))
    assert not _same_theta(void_marker([1.0, 2.0]), (1.0, 2.5))
    assert _same_theta(void_marker(None), None)
    assert not _same_theta(void_marker(None), (1.0,)) and not _same_theta(void_marker([1.0]), None)
    assert not _same_theta(VOID + b"garbage", (1.0,))


def test_a_carrier_is_taken_for_silent_sooner_in_a_short_round() -> None:
    """15 % of the round's timeout, between 2 s (a live carrier on a loaded machine answers within ~1 s) and SILENT:
    a round of 15 s takes a carrier silent after 2.25 s, not 10 of the 12.75 s its cross step may take."""
    from p2ptrain.net.hierarchy import SILENT, silence

    assert [silence(t) for t in (5.0, 15.0, 60.0, 600.0)] == pytest.approx([2.0, 2.25, 9.0, SILENT])


def test_a_stand_in_keeps_its_carriers_side_of_the_other_carrier() -> None:
    """The stand-in is the next member of the carrier's cell that sorts on the same side of the other carrier (so
    each part of the shard keeps its owner's side); none when no member of the cell does, or the shard has three
    carriers."""
    cell_of = {m: ("b1", "b3", "b4", "b9") for m in ("b1", "b3", "b4", "b9")} | {"c5": ("c5",)}
    assert standin_of(("b3", "c5"), cell_of, "b3") == "b4"  # b3 < c5: b4 next, and below c5 too
    assert standin_of(("b9", "b0"), cell_of | {"b0": ("b0",)}, "b9") == "b1"  # cyclic: after b9 comes b1 (> b0)
    assert standin_of(("b4", "b2"), cell_of | {"b2": ("b2",)}, "b4") == "b9"  # above b2: b9 (b1 is below)
    assert standin_of(("b1", "b2"), cell_of | {"b2": ("b2",)}, "b1") is None  # nobody else of b is below b2
    assert standin_of(("b1", "b2", "c5"), cell_of, "b1") is None  # three carriers: a silent one makes it partial


@pytest.mark.net
@pytest.mark.timeout(120)
def test_a_stand_in_on_the_carriers_side_gives_its_bytes_with_a_lossy_codec() -> None:
    """Two steps of one shard across two carriers on real libp2p, 4-bit (e3m0) codec: carrier A with cell-mate values
    of B, and A with B's stand-in S (the same values: a cell's mean is the same bytes at every member). With S on
    B's side of A, both steps end with the same bytes; with a member on the other side of A, the parts' owners swap
    and the bytes differ (why the stand-in must keep the side)."""
    async def go() -> None:
        async with libp2p_swarm(5, run="hside") as ts:
            by_id = sorted(ts, key=lambda t: t.peer_id)
            a, (b, same), other = by_id[2], by_id[3:], by_id[0]  # a in the middle: two above it, two below
            gen = torch.Generator().manual_seed(11)
            mine, cell = torch.randn(4000, generator=gen), torch.randn(4000, generator=gen)
            codec = get_codec("e3m0")

            async def pair(key: str, x: Transport) -> list[torch.Tensor]:
                g = Group(key, tuple(sorted([a.peer_id, x.peer_id])), min(a.peer_id, x.peer_id), 0, "", None)
                out = await asyncio.gather(a.allreduce(g, 0, [mine], 2.0, codec, timeout=30.0),
                                           x.allreduce(g, 0, [cell], 3.0, codec, timeout=30.0))
                assert torch.equal(out[0].tensors[0], out[1].tensors[0])
                return [r.tensors[0] for r in out]

            carried, stood, swapped = await pair("side#b", b), await pair("side#s", same), await pair("side#o", other)
            assert torch.equal(carried[0], stood[0])
            assert not torch.equal(carried[0], swapped[0])

    run(go())


def _carrier_of(ts: list[Transport], group: Group, region: str, shard: int) -> int:
    """The index in ``ts`` of ``region``'s carrier of ``shard``."""
    plan = plan_for(group, ts[0].peer_id)
    assert plan is not None
    regions = group.region_of()
    (carrier,) = [m for m in plan.carriers[shard] if regions[m] == region]
    return [t.peer_id for t in ts].index(carrier)


@pytest.mark.net
@pytest.mark.timeout(150)
def test_a_cut_between_two_carriers_result_sends_never_applies_two_averages() -> None:
    """Regions a × 3 and b × 2 on libp2p: a shard crosses between two carriers. The regions are cut from each
    other once a's carrier's result of that shard reached b's (and the other shards are offered), before b's
    came back: b's carrier holds both parts of the shard, a's only its own, and neither side reaches the other's
    digest. Whoever applies, applies one average: a side that finished the shard with the other's part zero while
    the other side finished it whole would be a fork (a rule that counted a's carrier for its cell's 3 of 5
    members did just that)."""
    async def go() -> None:
        async with libp2p_swarm(5, run="hcut") as ts:
            regions = ["a", "a", "a", "b", "b"]
            groups = await _form(ts, regions, "hcut")
            counts = [_carrier_of(ts, groups[0], "b", s) for s in range(3)]
            lone = next(s for s in range(3) if counts.count(counts[s]) == 1)  # b's carrier of this shard only
            ia, ib = _carrier_of(ts, groups[0], "a", lone), _carrier_of(ts, groups[0], "b", lone)
            a, b = ts[ia], ts[ib]
            cut = asyncio.Event()
            a_call, b_call = a._call, b._call  # type: ignore[attr-defined]

            others = [(ts[_carrier_of(ts, groups[0], r, k)], f"hier/hcut/0/s{k}") for k in range(3) if k != lone
                      for r in "ab"]

            async def cut_once_offered() -> None:  # the other shards crossed: only this one is cut mid-step
                for _ in range(100):
                    if all(t.offers.get(name) is not None for t, name in others):
                        break
                    await asyncio.sleep(0.05)
                for i, t in enumerate(ts):
                    t.blocked |= {x.peer_id for j, x in enumerate(ts) if regions[j] != regions[i]}  # type: ignore[attr-defined]
                cut.set()

            async def a_sends(peer: str, kind: str, msg: dict[str, Any], **kw: Any) -> Any:
                reply = await a_call(peer, kind, msg, **kw)
                if kind == "result" and peer == b.peer_id and not cut.is_set():  # b holds a's part now
                    await cut_once_offered()
                return reply

            async def b_sends(peer: str, kind: str, msg: dict[str, Any], **kw: Any) -> Any:
                if kind == "result" and peer == a.peer_id:  # b's part goes once the cut is on: it never arrives
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(cut.wait(), 10.0)
                return await b_call(peer, kind, msg, **kw)

            a._call, b._call = a_sends, b_sends  # type: ignore[attr-defined]
            xs = [[torch.full((12,), float(j))] for j in range(5)]
            out = await asyncio.gather(*(_hier(t, g, x, 1.0, timeout=12.0) for t, g, x in zip(ts, groups, xs,
                                                                                                strict=True)),
                                       return_exceptions=True)
            assert cut.is_set()
            applied = [r.tensors[0] for r in out if isinstance(r, ReduceResult)]
            assert all(not isinstance(r, BaseException) or isinstance(r, RoundFailed) for r in out), out
            assert all(torch.equal(t, applied[0]) for t in applied), [r if isinstance(r, BaseException) else
                                                                      r.tensors[0] for r in out]

    run(go())


def _off_by_one(odd: Transport) -> None:
    """``odd`` ends every shard's cross step with its values + 1 (a carrier whose cross step went otherwise)."""
    step = odd.allreduce

    async def off_by_one(group: Group, *args: Any, **kw: Any) -> ReduceResult:
        res = await step(group, *args, **kw)
        if "#s" in group.key:
            res.tensors = [t + 1.0 for t in res.tensors]
        return res

    odd.allreduce = off_by_one  # type: ignore[method-assign]


def test_a_carrier_whose_shard_differs_from_the_other_regions_carrier_does_not_apply_it() -> None:
    """A carrier ends its shard's cross step with other values than the other region's carrier of it (churn
    benchmark, churn_arena2 f2.L598557860). Every member that fetches the shard refuses it (the digests differ);
    the carriers used to apply their own bytes each, two θ that nobody could see. Now nobody applies the round."""
    async def go() -> None:
        async with memory_swarm(4) as ts:
            regions = ["a", "a", "b", "b"]
            groups = await _form(ts, regions, "hd")
            _off_by_one(ts[1])  # it carries shard 1 of region a
            xs = [[torch.full((10,), float(i))] for i in range(4)]
            out = await asyncio.gather(*(_hier(t, g, x, 1.0, timeout=6.0)
                                         for t, g, x in zip(ts, groups, xs, strict=True)), return_exceptions=True)
            assert all(isinstance(r, RoundFailed) for r in out), out

    run(go())


def test_a_shard_is_not_applied_unchecked_while_the_other_regions_carrier_is_only_late() -> None:
    """As above, but the other region's carriers publish their digests 7 s after their shards' cross step (a busy
    or loaded carrier; their rounds do not end meanwhile). Members and carriers used to wait 5 s (or 3× the fetch)
    for a witness and then apply their region's carry unchecked: a cell applied a shard the other regions did not
    hold and forked (churn benchmark, churn_views f2.L598568460). Now a late witness is waited for, and nobody
    applies the round."""
    async def go() -> None:
        async with memory_swarm(4) as ts:
            regions = ["a", "a", "b", "b"]
            groups = await _form(ts, regions, "hl")
            _off_by_one(ts[1])  # it carries shard 1 of region a
            loop = asyncio.get_running_loop()
            for late in ts[2:]:
                put = late.offers.put

                def later(name: str, data: bytes, *, ttl: float, _put: Any = put, **wanted: Any) -> str:
                    if name.endswith("#sha"):
                        loop.call_later(7.0, lambda: _put(name, data, ttl=ttl, **wanted))
                        return blake3.blake3(data).hexdigest()
                    return _put(name, data, ttl=ttl, **wanted)

                late.offers.put = later  # type: ignore[method-assign]
                late.offers.end = lambda *a, **kw: None  # type: ignore[method-assign]  # (their rounds end late too)
            xs = [[torch.full((10,), float(i))] for i in range(4)]
            out = await asyncio.gather(*(_hier(t, g, x, 1.0, timeout=20.0)
                                         for t, g, x in zip(ts, groups, xs, strict=True)), return_exceptions=True)
            assert isinstance(out[0], RoundFailed) and "disagree" in str(out[0]), out[0]  # odd's region mate
            assert isinstance(out[1], RoundFailed) and "disagree" in str(out[1]), out[1]  # odd itself
            for r in out[2:]:
                assert isinstance(r, RoundFailed), r

    run(go())


@pytest.mark.parametrize("digest", ["honest", "of the lie"])
def test_a_carrier_that_lies_to_its_region_fails_the_round_there_and_poisons_no_one(digest: str) -> None:
    """A carrier serves its region a shard of ×100 values. Told the honest digest, the other region's members
    are unaffected and the liar's region mate refuses; told the lie's digest too, the other region cannot tell
    which carrier lies (two regions) and refuses as well. No member ever ends with the lie."""
    async def go() -> None:
        async with memory_swarm(4) as ts:
            regions = ["a", "a", "b", "b"]
            groups = await _form(ts, regions, "h4")
            liar = ts[1]
            honest_put = liar.offers.put

            def lying_put(name: str, data: bytes, *, ttl: float, **wanted: Any) -> str:
                if name.endswith("#sha"):
                    return honest_put(name, data, ttl=ttl, **wanted)
                head = _HEADER.size
                bad = data[:head] + torch.full(((len(data) - head) // 4,), 100.0).numpy().tobytes()
                lie = honest_put(name, bad, ttl=ttl, **wanted)
                return blake3.blake3(data).hexdigest() if digest == "honest" else lie

            liar.offers.put = lying_put  # type: ignore[method-assign]
            xs = [[torch.full((10,), float(i))] for i in range(4)]
            out = await asyncio.gather(*(_hier(t, g, x, 1.0, timeout=6.0)
                                         for t, g, x in zip(ts, groups, xs, strict=True)), return_exceptions=True)
            assert isinstance(out[0], RoundFailed) and "disagree" in str(out[0])  # the liar's region mate refuses
            for r in out[1:]:
                assert isinstance(r, RoundFailed) or torch.allclose(r.tensors[0], torch.full((10,), 1.5))
            if digest == "honest":
                for r in out[2:]:  # the other region is untouched
                    assert isinstance(r, ReduceResult) and not r.partial

    run(go())


@pytest.mark.parametrize("make", SWARMS)
def test_bounded_cells_end_every_member_with_the_swarms_mean(make: Make) -> None:
    """Seven members of one region, cells of at most 3 (3 cells): every member ends with the same bytes, the
    float64 weighted mean of all seven to fp32 rounding; two rounds with other cells agree with it too."""
    async def go() -> None:
        async with make(7) as ts:
            gen = torch.Generator().manual_seed(5)
            for key in ("b1", "b2"):
                groups = await _form(ts, [""] * 7, key)
                xs = [[torch.randn(3000, generator=gen)] for _ in ts]
                ws = [1.0 + i for i in range(7)]
                out = await asyncio.gather(*(_hier(t, g, x, w, max_group=3)
                                             for t, g, x, w in zip(ts, groups, xs, ws, strict=True)))
                exp = sum(w * x[0].double() for x, w in zip(xs, ws, strict=True)) / sum(ws)
                for r in out:
                    assert torch.equal(r.tensors[0], out[0].tensors[0]) and not r.partial
                    assert (r.tensors[0].double() - exp).abs().max() < 1e-6

    run(go())


@pytest.mark.parametrize("make", SWARMS)
def test_cross_region_bytes_are_about_one_fragment_per_region(make: Make) -> None:
    """What the transport reports sending in the cross-region steps, summed over a region's members: about one
    fragment (R = 2: each carrier sends half of each shard's contribution and half of its result), against
    n = 3 fragments a region in a flat butterfly of the same six peers."""
    async def go() -> None:
        async with make(6) as ts:
            sent: dict[str, list[tuple[str, int]]] = {t.peer_id: [] for t in ts}
            for t in ts:
                inner = t.allreduce

                async def recording(group: Group, *a: Any, _inner: Any = inner, _me: str = t.peer_id,
                                    **kw: Any) -> ReduceResult:
                    r = await _inner(group, *a, **kw)
                    sent[_me].append((group.key, r.bytes_sent))
                    return r

                t.allreduce = recording  # type: ignore[method-assign]
            regions = ["a", "a", "a", "b", "b", "b"]
            groups = await _form(ts, regions, "h5")
            n = 60_000
            xs = [[torch.randn(n)] for _ in ts]
            out = await asyncio.gather(*(_hier(t, g, x, 1.0) for t, g, x in zip(ts, groups, xs, strict=True)))
            assert all(not r.partial for r in out)
            frag = get_codec("fp32").encoded_size(n)
            for region in ("a", "b"):
                cross = sum(b for t, r in zip(ts, regions, strict=True) if r == region
                            for key, b in sent[t.peer_id] if "#s" in key)
                assert 0.95 * frag <= cross <= 1.15 * frag, (region, cross / frag)  # headers and signatures
            # (a flat butterfly of the six: 3 members × 3 foreign owners × a part of F/6, out and back = 3F a region)

    run(go())


@pytest.mark.parametrize("name,knobs", [("diloco", {"H": 8}),
                                        ("streaming", {"H": 8, "P": 2, "tau": 2, "codec": "e3m0"})])
@pytest.mark.parametrize("flat", [False, True])
def test_peers_in_two_regions_reduce_region_by_region_and_agree(name: str, knobs: dict[str, Any], flat: bool,
                                                                corpus: Corpus) -> None:
    """Peers end to end (the driver, the round runner): two regions of two peers reduce hierarchically unless
    told ``flat_rounds``, and every peer holds the same θ after every applied round either way."""
    swarm = MemorySwarm(join_window=10.0, ttl=3.0)
    specs = [Spec(steps=48, delay=0.02, region=r) for r in ("eu", "eu", "us", "us")]
    run = run_peers(method_config(name, timeout=15, **knobs), specs, corpus, memory_transports(swarm),
                    shared_loop=True, clock="steps", warmup=1.0, timeout=240, flat_rounds=flat)
    assert not run.errors, run.errors
    res = [r for r in run.results if r is not None]
    assert all(r.rounds_complete > 0 for r in res), [(r.rounds_complete, r.rounds_failed) for r in res]
    applied_agree(res)
    across = {key for (_, key, _) in swarm.phases if "#s" in key}
    assert bool(across) != flat, sorted(swarm.phases)[:6]


@pytest.mark.parametrize("serve", [True, False], ids=["served", "gone at once"])
def test_a_member_that_fetches_late_gets_its_shard_from_a_carrier_that_left_gracefully(serve: bool) -> None:
    """Every member but one leaves once the round ended for the three (peers at their step budget); the one left
    fetches its shard only then (its digests at once). A leaving carrier serves what its cell still wants first
    (Transport.serve_wanted): the late member ends the round with the mean. Gone at once (the control), nobody is
    left to serve it. (A carrier killed as soon as its own round ends can hold up a member of its cell that had not
    fetched from it yet, which then serves the late one: the three leave together.)"""
    async def go() -> None:
        swarm = MemorySwarm(join_window=WINDOW, ttl=30)
        async with memory_swarm(4, swarm) as ts:
            groups = await _form(ts, ["a", "a", "b", "b"], "late")
            late = ts[0]
            fetch = late.fetch_state
            ended = asyncio.Event()

            async def slow_fetch(peer: str, name: str, **kw: Any) -> bytes:
                if not name.endswith("#sha"):
                    await ended.wait()
                return await fetch(peer, name, **kw)

            late.fetch_state = slow_fetch  # type: ignore[method-assign]

            async def leave() -> list[float]:
                for r in await asyncio.gather(*(_hier(t, g, x, 1.0, timeout=12.0)
                                                for t, g, x in zip(ts[1:], groups[1:], xs[1:], strict=True))):
                    assert isinstance(r, ReduceResult), r
                waited: list[float] = []
                if serve:  # (the late member's fetch waits for ``ended``: serving begins before it)
                    ended.set()
                    waited = list(await asyncio.gather(*(t.serve_wanted(30) for t in ts[1:])))
                for t in ts[1:]:
                    swarm.kill(t.peer_id)
                ended.set()
                return waited

            xs = [[torch.full((10,), float(i))] for i in range(4)]
            out = await asyncio.gather(_hier(late, groups[0], xs[0], 1.0, timeout=12.0), leave(),
                                       return_exceptions=True)
            assert isinstance(out[1], list), out[1]
            if serve:
                assert isinstance(out[0], ReduceResult) and torch.allclose(out[0].tensors[0], torch.full((10,), 1.5))
                assert all(w < 10.0 for w in out[1]), out[1]  # fetched at once, not at the deadline (12 s)
            else:
                assert isinstance(out[0], RoundFailed), out[0]

    run(go())
