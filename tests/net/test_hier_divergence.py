"""A hierarchical round with replicas whose θ differ must not end with members on both sides (churn benchmark,
rounds f2.L897782340, f2.L897782420, f0.L897782440: whole cells "repaired" onto the other side's θ).

The cross-cell vote (step 2) is taken per shard with each *carrier's own* fingerprint, and a shard's carriers
differ from shard to shard. A carrier in its cell's minority (outvoted in step 1) still votes its own θ on behalf
of a cell mean it is not part of, and ties between cells are broken by the smallest carrier id: so a cell is
outvoted on some shards and wins others, and an outvoted cell repairs from the carriers that beat it on *that*
shard, which may hold the swarm's minority θ. Repair is emulated as ReplicaState.repair does it: θ before the
round from the first other peer of ``contributors`` (every peer here has it).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from p2ptrain.collective.codecs import get_codec
from p2ptrain.net.hierarchy import hierarchical_allreduce, plan_for
from p2ptrain.net.memory import MemorySwarm
from p2ptrain.net.transport import Group, JoinRequest, PeerInfo, ReduceResult

X, Y = [1.0, 2.0], [5.0, 7.0]  # two versions of θ (their fingerprints)


def _group(members: list[str], regions: list[str]) -> Group:
    order = sorted(range(len(members)), key=lambda i: members[i])
    return Group("h", tuple(members[i] for i in order), min(members), 0, "", None, tuple(regions[i] for i in order))


async def _round(holds: dict[str, list[float]], regions: dict[str, str]) -> dict[str, ReduceResult]:
    res = await _outcomes(holds, regions, list(holds), timeout=20.0)
    assert all(isinstance(r, ReduceResult) for r in res.values()), res
    return res  # type: ignore[return-value]


async def _outcomes(holds: dict[str, list[float]], regions: dict[str, str], present: list[str],
                    timeout: float) -> dict[str, ReduceResult | BaseException]:
    """Every member of ``present`` runs the round (the others are in the group but never take part)."""
    swarm = MemorySwarm(join_window=0.1, ttl=60)
    ts = {p: swarm.transport(p) for p in holds}
    for t in ts.values():
        await t.announce(PeerInfo(peer_id=t.peer_id))
    g = _group(list(holds), [regions[p] for p in holds])
    return await _run_all(ts, g, holds, present, timeout=timeout)


async def _run_all(ts: dict[str, Any], g: Group, holds: dict[str, list[float]], present: list[str], *,
                   timeout: float) -> dict[str, ReduceResult | BaseException]:
    """The round ``g`` run by every member of ``present``, each on θ ``holds[p]`` with values its index."""
    async def one(p: str) -> ReduceResult:
        plan = plan_for(g, p)
        assert plan is not None
        x = [torch.full((12,), float(sorted(holds).index(p)))]
        return await hierarchical_allreduce(ts[p], g, plan, 0, x, 1.0, get_codec("fp32"), timeout=timeout,
                                            fingerprint=holds[p])

    res = await asyncio.gather(*(one(p) for p in present), return_exceptions=True)
    return dict(zip(present, res, strict=True))


def _repair_source(p: str, holds: dict[str, list[float]], r: ReduceResult, reach: set[str] | None = None) -> str | None:
    """Where ReplicaState.repair takes θ from: the first other contributor it reaches whose θ has the majority's
    fingerprint (``r.agreed``, when the round said it)."""
    return next((q for q in r.contributors if q != p and (reach is None or q in reach)
                 and (r.agreed is None or tuple(holds[q]) == r.agreed)), None)


def _after_repair(holds: dict[str, list[float]], res: dict[str, ReduceResult]) -> dict[str, list[float]]:
    """θ before the round as each member holds it once it applies the round (ReplicaState.repair's choice)."""
    out = {}
    for p, r in res.items():
        src = _repair_source(p, holds, r) if r.divergent else None
        out[p] = holds[src] if src is not None else holds[p]
    return out


def test_a_cells_minority_carrier_does_not_flip_cells() -> None:
    """us: u0 holds Y, u1 u2 hold X (u0 is its cell's minority, like s03g1.1 after its restart); eu all Y; ap
    all X. Five of nine hold X. Shard 0's carriers (a0 X, e0 Y, u0 Y) outvote ap; shards 1, 2 outvote eu. Before
    the fix ap repaired from e0 (Y), eu from a1 (X), u0 from e0 (Y, a crossed contributor sorted before its cell's u1):
    members ended on both sides. Every member must end with the same θ."""
    holds = {"a0": X, "a1": X, "a2": X, "e0": Y, "e1": Y, "e2": Y, "u0": Y, "u1": X, "u2": X}
    regions = {p: {"a": "ap", "e": "eu", "u": "us"}[p[0]] for p in holds}
    res = asyncio.run(_round(holds, regions))
    # every member applies the same average bytes: only θ before the round can differ
    assert len({tuple(r.tensors[0].tolist()) for r in res.values()}) == 1
    final = _after_repair(holds, res)
    sides = {p: "X" if v == X else "Y" for p, v in final.items()}
    assert len(set(sides.values())) == 1, f"members end on both sides: {sides}"


def test_a_tie_between_two_cells_never_swaps_them() -> None:
    """Two cells of three, X against Y, ids interleaved across the cells (us p1 p4 p5, eu p2 p3 p6): shard 0's
    tie goes to p1 (us), shard 1's to p3 (eu). Both cells used to be flagged and each repaired from the other:
    they swapped θ, and stayed two sides. A round must never move members across in both directions."""
    holds = {"p1": X, "p4": X, "p5": X, "p2": Y, "p3": Y, "p6": Y}
    regions = {p: "us" if holds[p] is X else "eu" for p in holds}
    res = asyncio.run(_round(holds, regions))
    final = _after_repair(holds, res)
    x_to_y = [p for p in holds if holds[p] == X and final[p] == Y]
    y_to_x = [p for p in holds if holds[p] == Y and final[p] == X]
    assert not (x_to_y and y_to_x), f"swapped: {x_to_y} took Y while {y_to_x} took X"


def test_a_tie_is_settled_by_the_fingerprints_not_by_who_votes() -> None:
    """majority_fingerprint's tie-break: the version of θ whose fingerprint sorts first, whoever holds it (each
    shard of a hierarchical round is voted by other carriers: a tie settled by the smallest voter's id went one
    way on some shards and the other way on others)."""
    from p2ptrain.net.groups import majority_fingerprint

    assert majority_fingerprint({"a": Y, "b": X}) == {"b"}
    assert majority_fingerprint({"z": Y, "c": X}) == {"c"}
    assert majority_fingerprint({"a": Y, "b": Y, "c": X}) == {"a", "b"}  # a majority still wins
    assert majority_fingerprint({"a": X, "b": Y, "c": X, "d": Y}) == {"a", "c"}


def test_an_outvoted_cell_repairs_only_onto_the_theta_that_won() -> None:
    """Churn benchmark, round f2.L897787900: a cell on X lost the vote across cells to Y; its members could not
    reach the winners, so one took θ from a member of its own cell (X, a contributor too) and applied it flagged
    divergent, as did the member whose repair found nobody. The round now says which θ won (``agreed``, the
    winners' fingerprint): a repair refuses any other, and a member that cannot get it applies nothing."""
    holds = {"a0": Y, "a1": Y, "a2": Y, "e0": Y, "e1": Y, "e2": Y, "u0": X, "u1": X, "u2": X}
    regions = {p: {"a": "ap", "e": "eu", "u": "us"}[p[0]] for p in holds}
    res = asyncio.run(_round(holds, regions))
    assert [p for p, r in res.items() if r.divergent] == ["u0", "u1", "u2"]
    assert all(res[p].agreed == tuple(Y) for p in ("u0", "u1", "u2"))  # what won, as each loser learnt it
    assert all(res[p].agreed == tuple(Y) for p in holds if p[0] != "u")
    cut_off = {"u0", "u1", "u2"}  # the winners time out, as in the benchmark's logs
    for p in ("u0", "u1", "u2"):
        # Its cell's mean is in no shard's average: none of the cell is a contributor (no X source is on offer,
        # and each member's own Δ counts as outvoted: its progress and tokens go into its next round).
        assert not cut_off & set(res[p].contributors), res[p].contributors
        assert _repair_source(p, holds, res[p], reach=cut_off) is None  # cut off from the winners: nothing applied
        assert holds[_repair_source(p, holds, res[p])] == Y  # reaching the winners, it takes Y
    assert all(p in res[p].contributors for p in holds if p not in cut_off)  # the winners' Δ are in the average


@pytest.mark.net
@pytest.mark.timeout(150)
def test_two_regions_on_two_versions_of_theta_settle_on_one_over_libp2p() -> None:
    """Two cells of two on real peers, the cells on two versions of θ. The cross step's vote is a tie in every
    shard: a part heard from both carriers but averaged from one used to be left out (half the group or less),
    so every round failed for good ('no carrier delivered it'). Now the tie goes to the version whose
    fingerprint sorts first on every shard: its cell is not divergent, the other cell is (it repairs), and
    every member ends with the same bytes, averaged from the winning cell."""
    from .test_transport_contract import libp2p_swarm

    async def go() -> None:
        async with libp2p_swarm(4) as ts:
            regions = ["eu", "eu", "us", "us"]
            groups = list(await asyncio.gather(*(
                t.form_group(JoinRequest(key="tie", peer_id=t.peer_id, weight=1.0, fragment=0, region=r), None,
                             timeout=20) for t, r in zip(ts, regions, strict=True))))
            prints = [X, X, Y, Y]

            async def one(i: int) -> ReduceResult:
                plan = plan_for(groups[i], ts[i].peer_id)
                assert plan is not None
                return await hierarchical_allreduce(ts[i], groups[i], plan, 0, [torch.full((20,), float(i))], 1.0,
                                                    get_codec("fp32"), timeout=20.0, fingerprint=prints[i])

            out = await asyncio.gather(*(one(i) for i in range(4)))
            assert [r.divergent for r in out] == [False, False, True, True]
            assert all(r.agreed == tuple(X) for r in out)  # the θ that won, which a repair must take
            assert all(torch.equal(r.tensors[0], torch.full((20,), 0.5)) for r in out)  # eu's mean
            assert all(r.partial for r in out)
            assert all(set(r.contributors[:2]) <= {ts[0].peer_id, ts[1].peer_id} for r in out[2:])  # repair from eu

    asyncio.run(go())


def test_a_tie_across_cells_with_a_cell_cut_off_forks_no_one() -> None:
    """Churn benchmark (churn_trim), round f3.L598554270: eu was cut off mid-round, so every shard's vote across
    cells was us against ap. us (two members on two versions of θ, its tie settled for X) voted X, ap voted Y: a
    tie in every shard that u0 carried, settled for X. With a third cell on the roll, a tie is no strict majority
    of the cells, so nobody was outvoted: ap applied the round onto Y and us onto X, two θ from one round. A cell
    that loses a shard's vote without a strict majority against it must not apply the round (it fails; its
    progress rides on the next round, whose vote settles θ)."""
    holds = {"a0": Y, "a1": Y, "a2": Y, "e0": Y, "e1": Y, "e2": Y, "u0": X, "u1": Y}
    regions = {p: {"a": "ap", "e": "eu", "u": "us"}[p[0]] for p in holds}

    present = [p for p in holds if regions[p] != "eu"]  # eu is cut off: it never takes part
    res = asyncio.run(_outcomes(holds, regions, present, timeout=6.0))
    applied = {p: r for p, r in res.items() if isinstance(r, ReduceResult)}
    assert applied, res  # somebody applies the round
    assert len({tuple(r.tensors[0].tolist()) for r in applied.values()}) == 1
    final = _after_repair(holds, applied)
    sides = {p: "X" if final[p] == X else "Y" for p in applied}
    assert len(set(sides.values())) == 1, f"members apply the round onto two versions of θ: {sides}"


def test_a_cell_whose_carries_all_failed_does_not_apply_the_others_round_onto_another_theta() -> None:
    """Churn benchmark (churn_s33b), round f0.L598565000: every carry of one cell failed, so its members fetched
    every shard from other cells' carriers, whose notes they did not read (their cell cast no vote), and one applied
    the others' average onto a θ two rounds behind theirs: two θ from one round. A shard from another cell now comes
    with its carrier's note of which θ won the shard's vote; a member on another θ repairs onto it first."""
    from p2ptrain.net.transport import RoundFailed

    holds = {"a0": Y, "a1": Y, "e0": Y, "e1": Y, "u0": X, "u1": X}
    regions = {p: {"a": "ap", "e": "eu", "u": "us"}[p[0]] for p in holds}

    async def go() -> dict[str, ReduceResult | BaseException]:
        swarm = MemorySwarm(join_window=0.1, ttl=60)
        ts = {p: swarm.transport(p) for p in holds}
        for t in ts.values():
            await t.announce(PeerInfo(peer_id=t.peer_id))
        for p in ("u0", "u1"):  # us's carries fail (cut off from the other carriers for the cross step only)
            t = ts[p]
            inner = t.allreduce

            async def no_carry(group: Group, *args: object, _inner: object = inner, **kw: object) -> ReduceResult:
                if "#s" in group.key:
                    raise RoundFailed(f"round {group.key}: only 1 of 3 parts")
                return await _inner(group, *args, **kw)  # type: ignore[operator]

            t.allreduce = no_carry  # type: ignore[method-assign]
        g = _group(list(holds), [regions[p] for p in holds])

        res = await _run_all(ts, g, holds, list(holds), timeout=8.0)
        return res

    res = asyncio.run(go())
    applied = {p: r for p, r in res.items() if isinstance(r, ReduceResult)}
    assert {"u0", "u1"} <= set(applied), res  # us fetched every shard from the other cells
    final = _after_repair(holds, applied)
    sides = {p: "X" if final[p] == X else "Y" for p in applied}
    assert set(sides.values()) == {"Y"}, f"members apply the round onto two versions of θ: {sides}"


def test_a_cell_outvoted_in_a_tie_of_two_takes_a_shard_its_carrier_missed_from_the_winner() -> None:
    """Churn benchmark (churn_seed12c), round f1.L598769290: two cells on two versions of θ, eu (X) and ap (Y). ap's
    carrier of shard 1 was frozen, so eu's carrier averaged shard 1 alone; every other shard's vote was a tie of the
    two cells, which X takes on every shard (ap is outvoted: it repairs onto X). ap's members fetched shard 1 from
    eu's carrier, whose θ, voted by one cell of two, is "no majority", and failed the round while eu applied it: the
    round forked θ (then a third version, the cut-off region's, made the next rounds three-way ties). The θ that
    beat ap's on the other shards is the one shard 1 holds: ap repairs onto it and applies, like eu."""
    holds = {"e0": X, "e1": X, "e2": X, "p0": Y, "p1": Y, "p2": Y}
    regions = {p: "eu" if p[0] == "e" else "ap" for p in holds}

    async def go() -> tuple[dict[str, ReduceResult | BaseException], str]:
        swarm = MemorySwarm(join_window=0.1, ttl=60)
        ts = {p: swarm.transport(p) for p in holds}
        for t in ts.values():
            await t.announce(PeerInfo(peer_id=t.peer_id))
        g = _group(list(holds), [regions[p] for p in holds])
        frozen = next(p for p in holds if regions[p] == "ap" and 1 in plan_for(g, p).carried)  # type: ignore[union-attr]
        inner = ts[frozen].allreduce

        async def freezes(group: Group, *args: object, **kw: object) -> ReduceResult:
            res = await inner(group, *args, **kw)  # type: ignore[arg-type]
            if group.key.endswith("#s1"):  # it voted ap's θ on shard 1, then froze: its cell never hears of it
                await asyncio.sleep(10.0)
            return res

        ts[frozen].allreduce = freezes  # type: ignore[method-assign]

        res = await _run_all(ts, g, holds, list(holds), timeout=8.0)
        return res, frozen

    res, frozen = asyncio.run(go())
    applied = {p: r for p, r in res.items() if isinstance(r, ReduceResult)}
    assert set(applied) >= set(holds) - {frozen}, res  # both cells apply it (before: eu alone)
    assert len({tuple(r.tensors[0].tolist()) for r in applied.values()}) == 1
    assert all(applied[p].divergent and applied[p].agreed == tuple(X) for p in applied if p[0] == "p")
    final = _after_repair(holds, applied)
    assert all(final[p] == X for p in applied), f"members apply the round onto two versions of θ: {final}"


def test_cells_whose_carriers_are_outvoted_at_home_still_compare_their_theta_across_cells() -> None:
    """Churn benchmark (churn_s36_apply), round f0.L598576720: ap was cut off, and us and eu held two versions of
    θ for fragment 0 (left by earlier rounds some peers applied and others failed). In each cell most members lost
    the cell's vote (several versions of θ among five), and a carrier that lost it voted no θ across cells: every
    shard's vote had one print or none, nothing compared us's θ with eu's, and both cells applied the same
    average onto their own θ (5 replicas on each side). A carrier now votes its cell's θ (the one its cell's
    members repair onto), whatever its own: here us (X) against eu (Y) on shards 0 and 1, a tie with a third cell
    on the roll, which X takes and eu fails."""
    W, Z, V = [8.0, 8.0], [9.0, 9.0], [6.0, 6.0]
    # us: u0 X, u1 Z, u2 W: X sorts first, so the tie of three goes to X; u1 and u2 lose their cell's vote.
    # eu: e0 Z, e1 Y, e2 V: Y wins; e0 and e2 lose. Shard i is carried by a_i, e_i, u_i: before the change only
    # u0 (shard 0) and e1 (shard 1) voted, each alone on its shard.
    holds = {"a0": X, "a1": X, "a2": X, "e0": Z, "e1": Y, "e2": V, "u0": X, "u1": Z, "u2": W}
    regions = {p: {"a": "ap", "e": "eu", "u": "us"}[p[0]] for p in holds}
    present = [p for p in holds if regions[p] != "ap"]  # ap is cut off: it never takes part
    res = asyncio.run(_outcomes(holds, regions, present, timeout=6.0))
    applied = {p: r for p, r in res.items() if isinstance(r, ReduceResult)}
    assert {"u0", "u1", "u2"} <= set(applied), res  # us, whose θ won, applies
    assert len({tuple(r.tensors[0].tolist()) for r in applied.values()}) == 1
    final = _after_repair(holds, applied)
    assert {p: final[p] for p in applied} == dict.fromkeys(applied, X), \
        f"members apply the round onto several versions of θ: {final}"


def test_a_tie_goes_to_the_version_of_theta_that_took_more_rounds() -> None:
    """Churn benchmark, churn_bequest2, f1.L598627330: eu had been cut off while two rounds of fragment 1 were
    applied by the other 11 peers; then ap was cut off, and eu's cell (stale θ) met us's (the θ those rounds made)
    alone. A tie between two cells, broken by the θ's sums: the stale θ won and us repaired onto it, and both
    rounds were gone. Each print now leads with θ's version (the send step of the last round in it): matching
    ignores it, a tie goes to the higher one, a majority still wins."""
    from p2ptrain.net.groups import VERSION_SCALE, fingerprints_match, majority_fingerprint, versioned

    stale, fresh = versioned(598627210, X), versioned(598627290, Y)
    assert fingerprints_match(versioned(0, X), versioned(598627290, X))  # the version never decides a match
    assert not fingerprints_match(versioned(5, X), versioned(5, Y))
    assert versioned(3, X)[0] == -3 * VERSION_SCALE and versioned(3, X)[1:] == X
    assert majority_fingerprint({"a": versioned(7, X), "b": versioned(7, Y)}) == {"a"}  # same version: the sums
    assert majority_fingerprint({"a": stale, "b": fresh}) == {"b"}  # X sorts first, but Y took more rounds
    assert majority_fingerprint({"a": stale, "b": stale, "c": fresh}) == {"a", "b"}  # a majority still wins
    holds = {"p1": stale, "p4": stale, "p5": stale, "p2": fresh, "p3": fresh, "p6": fresh}
    regions = {p: "eu" if holds[p] is stale else "us" for p in holds}
    res = asyncio.run(_round(holds, regions))
    assert [p for p, r in res.items() if r.divergent] == ["p1", "p4", "p5"]  # the stale cell repairs
    assert all(r.agreed == tuple(fresh) for r in res.values())
    final = _after_repair(holds, res)
    assert all(final[p] == fresh for p in holds)


def test_a_carrier_outvoted_in_its_cell_is_not_named_a_contributor() -> None:
    """Churn benchmark (churn_seed7b), round f2.L598728300: four members outvoted in their own cells (resumed or
    joined onto another θ) carried their cells' shards across, so the crossed results named them: each took its Δ
    as in the average (``rnd.counted``), applied the round as a contributor and dropped its progress and tokens
    (Σ of the appliers' ``own`` was 714,240 tokens against the round's total of 505,344). The mean its cell
    carried holds no Δ of its: it must not be named, so that it keeps its progress for its next round (driver:
    outvoted). Here u0 holds Y in a cell of X and carries shard 0."""
    holds = {"a0": X, "a1": X, "a2": X, "e0": X, "e1": X, "e2": X, "u0": Y, "u1": X, "u2": X}
    regions = {p: {"a": "ap", "e": "eu", "u": "us"}[p[0]] for p in holds}
    res = asyncio.run(_round(holds, regions))
    assert res["u0"].divergent
    assert "u0" not in res["u0"].contributors, res["u0"].contributors
    for p, r in res.items():
        if p[0] == "u":  # (another cell's members name u0 as the carrier of us's mean they met: that mean is in)
            assert "u0" not in r.contributors, (p, r.contributors)
        assert p == "u0" or p in r.contributors, (p, r.contributors)
        # every member's value is its index in sorted(holds): u0's (6) is in no cell's mean
        assert r.total_weight == 8.0
        torch.testing.assert_close(r.tensors[0], torch.full((12,), (0 + 1 + 2 + 3 + 4 + 5 + 7 + 8) / 8))
    assert _repair_source("u0", holds, res["u0"]) in {"u1", "u2"}  # from its own cell's majority first
