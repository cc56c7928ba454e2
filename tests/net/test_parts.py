"""The pure pieces of the butterfly (net/parts.py): what an owner aggregates, which results a member uses,
and how it assembles them."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.collective.codecs import get_codec
from p2ptrain.net.parts import (
    Assembly,
    flatten,
    group_tag,
    result_problem,
    select_contributions,
    unflatten,
    wire_result,
)
from p2ptrain.net.transport import Group, RoundFailed

MEMBERS = ("a", "b", "c")


def test_flatten_and_unflatten_round_trip() -> None:
    ts = [torch.arange(6.0).view(2, 3), torch.ones(4)]
    flat = flatten(ts)
    assert flat.tolist() == [0, 1, 2, 3, 4, 5, 1, 1, 1, 1]
    back = unflatten(flat, ts)
    assert [t.shape for t in back] == [(2, 3), (4,)] and all(torch.equal(x, y) for x, y in zip(back, ts, strict=True))
    lone = torch.ones(3)
    assert flatten([lone]).data_ptr() == lone.data_ptr()  # a lone fp32 tensor is only read, not copied


def test_an_owner_aggregates_members_contributions_to_its_part_of_its_size_from_the_majority() -> None:
    x = torch.ones(4)
    contribs = {
        "a": (1, x, 1.0, [1.0]),
        "b": (1, x, 2.0, [1.0]),
        "c": (1, x, 1.0, [9.0]),  # diverged
        "d": (1, x, 1.0, [1.0]),  # not a member
        "e": (0, x, 1.0, [1.0]),  # not a member either
    }
    sel = select_contributions(contribs, MEMBERS, 1, 4)
    assert sorted(sel.use) == ["a", "b"] and sel.agree == {"a", "b"} and not sel.dropped
    other = select_contributions({**contribs, "b": (1, torch.ones(5), 1.0, [1.0])}, MEMBERS, 1, 4)
    assert other.dropped == {"b": 5} and sorted(other.use) == ["a"]  # another size: dropped, not summed
    assert sorted(select_contributions({"a": (1, x, 1.0, None), "b": (1, x, 1.0, None)}, MEMBERS, 1, 4).use) \
        == ["a", "b"]  # nobody sent a fingerprint: everyone agrees


def test_results_are_used_skipped_or_held_against_their_owner() -> None:
    codec = get_codec("fp32")
    good = {"numel": 4, "codec": "fp32", "data": codec.encode(torch.ones(4)), "contributors": ["a", "b"],
            "agree": ["a", "b"], "total": 2.0, "_from": "b"}
    assert result_problem(good, 1, 4, codec, MEMBERS, "a") is None
    assert result_problem({**good, "_from": "z"}, 1, 4, codec, MEMBERS, "a") == (
        "a result from outside the group is never used", False)
    assert result_problem({**good, "numel": 5}, 1, 4, codec, MEMBERS, "a")[1] is False  # type: ignore[index]
    assert result_problem({**good, "data": b"xx"}, 1, 4, codec, MEMBERS, "a")[1] is True  # type: ignore[index]
    assert result_problem({**good, "total": -1.0}, 1, 4, codec, MEMBERS, "a")[1] is True  # type: ignore[index]
    # An owner's group under the same round key may be another one than ours (a member frozen mid-round and thawed
    # still holds the old group): its result names contributors of its own group. That is a view that differs, not a
    # lie (a frozen peer used to ban an honest owner for it, and never heard from it again): left out, no strike.
    other = {**good, "contributors": ["b", "z"], "group": group_tag(["b", "z"])}
    assert result_problem(other, 1, 4, codec, MEMBERS, "a") == ("an owner whose group differs from ours", False)
    assert result_problem({**good, "group": group_tag(list(reversed(MEMBERS)))}, 1, 4, codec, MEMBERS, "a") is None
    assert result_problem({**good, "group": 7}, 1, 4, codec, MEMBERS, "a")[1] is True  # type: ignore[index]
    relay = wire_result({**good, "chunks": 1, "_pieces": [b"ab", b"cd"]})
    assert relay["data"] == b"abcd" and "chunks" not in relay and "_from" not in relay


def test_assembly_zeroes_what_is_missing_and_says_so() -> None:
    group = Group("k", MEMBERS, "a", 0)
    asm = Assembly(6, MEMBERS, 0, check_agree=True)
    asm.add(0, 0, 2, torch.full((2,), 3.0), {"contributors": ["a", "b", "c"], "agree": ["a", "b", "c"], "total": 3.0})
    asm.add(1, 2, 4, torch.full((2,), 5.0), {"contributors": ["a", "b"], "agree": ["b"], "total": 2.0, "data": b"x" * 8})
    asm.skip()
    res = asm.result(group, 0, [torch.zeros(6)], sent=10, seconds=0.5)
    assert res.tensors[0].tolist() == [3, 3, 5, 5, 0, 0]
    assert res.contributors == ("a", "b") and res.partial and res.divergent and res.total_weight == 3.0
    assert (res.bytes_sent, res.bytes_received) == (10, 8)
    with pytest.raises(RoundFailed):
        Assembly(6, MEMBERS, 0, check_agree=False).result(group, 0, [torch.zeros(6)], sent=0, seconds=0.0)


def test_one_part_that_names_only_its_owner_does_not_empty_the_round() -> None:
    """A hostile (or hasty) owner that averaged only its own share: the round's contributors are the members
    whose share is in most of the values, not the intersection over parts (which that part would empty)."""
    group = Group("k", MEMBERS, "a", 0)
    asm = Assembly(6, MEMBERS, 0, check_agree=False)
    asm.add(0, 0, 2, torch.full((2,), 1.0), {"contributors": ["a", "b"], "agree": [], "total": 2.0})
    asm.add(1, 2, 4, torch.full((2,), 2.0), {"contributors": ["a", "b"], "agree": [], "total": 2.0})
    asm.add(2, 4, 6, torch.full((2,), 3.0), {"contributors": ["c", "stranger"], "agree": [], "total": 1.0})
    res = asm.result(group, 0, [torch.zeros(6)], sent=0, seconds=0.0)
    assert res.contributors == ("a", "b") and res.partial
    assert res.tensors[0].tolist() == [1, 1, 2, 2, 0, 0]  # the part of one member of three is left out


def test_the_result_names_the_values_whose_average_left_this_member_out() -> None:
    """``missing``: the ranges of parts used without our share and of parts left out (zeros: nobody's share),
    merged, whether or not we count as a contributor of the round (our Δ there is in no average: the method keeps
    that progress for the next round)."""
    group = Group("k", MEMBERS, "a", 0)
    asm = Assembly(8, MEMBERS, 1, check_agree=False)  # we are "b"
    asm.add(0, 0, 2, torch.full((2,), 1.0), {"contributors": ["a", "b", "c"], "agree": [], "total": 3.0})
    asm.add(1, 2, 4, torch.full((2,), 2.0), {"contributors": ["a", "c"], "agree": [], "total": 2.0})
    asm.skip()  # part 2 (values 4-5) never came
    asm.add(3, 6, 8, torch.full((2,), 3.0), {"contributors": ["a", "b", "c"], "agree": [], "total": 3.0})
    res = asm.result(group, 0, [torch.zeros(8)], sent=0, seconds=0.0)
    assert "b" in res.contributors and res.missing == ((2, 6),)
    whole = Assembly(4, MEMBERS, 1, check_agree=False)
    whole.add(0, 0, 2, torch.full((2,), 1.0), {"contributors": ["a", "b", "c"], "agree": [], "total": 3.0})
    whole.add(1, 2, 4, torch.full((2,), 1.0), {"contributors": ["a", "b", "c"], "agree": [], "total": 3.0})
    assert whole.result(group, 0, [torch.zeros(4)], sent=0, seconds=0.0).missing == ()


def test_a_group_cut_in_two_mid_round_applies_nothing_on_either_side() -> None:
    """Four members cut 2 + 2 after the group formed: each side's parts hold only its own side's shares. A part
    of half the group or less is left out, so neither side has anything to apply (no fork of θ); cut 3 + 1,
    the three keep their three parts (the same on each of them) and the one has nothing."""
    members = ("a", "b", "c", "d")
    group = Group("k", members, "a", 0)

    def side(me: int, parts: list[int], who: list[str]) -> Assembly:
        asm = Assembly(8, members, me, check_agree=False)
        for j in range(4):
            if j in parts:
                asm.add(j, 2 * j, 2 * j + 2, torch.full((2,), float(j + 1)),
                        {"contributors": who, "agree": [], "total": float(len(who))})
            else:
                asm.skip()
        return asm

    for me, parts, who in ((0, [0, 1], ["a", "b"]), (2, [2, 3], ["c", "d"]), (3, [3], ["d"])):
        asm = side(me, parts, who)
        with pytest.raises(RoundFailed, match="half or less"):
            asm.result(group, 0, [torch.zeros(8)], sent=0, seconds=0.0)
    res = side(0, [0, 1, 2], ["a", "b", "c"]).result(group, 0, [torch.zeros(8)], sent=0, seconds=0.0)
    assert res.partial and res.contributors == ("a", "b", "c")
    assert res.tensors[0].tolist() == [1, 1, 2, 2, 3, 3, 0, 0]


def test_a_part_voted_down_to_half_but_heard_from_more_is_used() -> None:
    """A part averaged from two of four (the other two voted out: their θ diverged, but they were reached) is not
    the side of a cut: heard from more than half, it is used, and the voted-out member learns it diverged. Heard
    from half (the others never reached the owner), it is left out as before; a malformed 'heard' counts for
    nothing beyond the contributors."""
    members = ("a", "b", "c", "d")
    group = Group("k", members, "a", 0)

    def assemble(heard: object) -> Assembly:
        asm = Assembly(8, members, 2, check_agree=True)
        for j in range(4):
            asm.add(j, 2 * j, 2 * j + 2, torch.full((2,), float(j + 1)),
                    {"contributors": ["a", "b"], "agree": ["a", "b"], "heard": heard, "total": 2.0})
        return asm

    res = assemble(["a", "b", "c", "d"]).result(group, 0, [torch.zeros(8)], sent=0, seconds=0.0)
    assert res.divergent and res.tensors[0].tolist() == [1, 1, 2, 2, 3, 3, 4, 4]
    for heard in (["a", "b"], ["a", "b", "x", "y"], "abcd", None):
        with pytest.raises(RoundFailed, match="half or less"):
            assemble(heard).result(group, 0, [torch.zeros(8)], sent=0, seconds=0.0)


def test_a_share_that_missed_one_owner_is_no_vote_against_our_theta() -> None:
    """Our share of part 1 did not reach its owner (late, cut off): part 1's 'agree' lacks us, but its owner never
    heard us, so only our fingerprint against the majority's print says whether our θ diverged. Taken for a vote,
    a hierarchical carrier's late share made its whole cell 'outvoted' while the cell's mean was in the shard's
    other parts (churn_accounts, f2.L598606140): its members applied with their tokens counted again."""
    group = Group("k", MEMBERS, "a", 0)
    theirs = [1.0, 2.0]

    def assemble(ours: list[float] | None, heard: list[str]) -> bool:
        asm = Assembly(6, MEMBERS, 0, check_agree=True, fingerprint=ours)
        asm.add(0, 0, 2, torch.ones(2), {"contributors": ["a", "b", "c"], "agree": ["a", "b", "c"],
                                        "heard": ["a", "b", "c"], "total": 3.0, "print": theirs})
        asm.add(1, 2, 4, torch.ones(2), {"contributors": ["b", "c"], "agree": ["b", "c"], "heard": heard,
                                        "total": 2.0, "print": theirs})
        asm.skip()  # part 2's result never came
        return asm.result(group, 0, [torch.zeros(6)], sent=0, seconds=0.0).divergent

    assert not assemble([1.0, 2.0], ["b", "c"])  # not heard, our θ is the majority's: not divergent
    assert not assemble([1.0 + 1e-9, 2.0], ["b", "c"])  # (fingerprints match within their tolerance)
    assert assemble([1.0, 2.5], ["b", "c"])  # not heard, but our θ is another: divergent
    assert assemble([1.0, 2.0], ["a", "b", "c"])  # heard and left out: a vote against our θ, whatever we hold
    assert assemble(None, ["b", "c"])  # no fingerprint of ours to compare: as before, divergent


def test_every_member_that_uses_the_same_parts_reports_the_same_total() -> None:
    """Parts averaged from different contributors carry different totals. Each member used to report its own
    part's: a hierarchical shard's carriers then put different totals in their offers, and the members refused the
    shard as a carrier's lie (churn benchmark, churn_arena2 f2.L598557860: three carriers, three offers)."""
    group = Group("k", MEMBERS, "a", 0)
    parts = [(0, 0, 2, {"contributors": ["a", "b", "c"], "agree": ["a", "b", "c"], "total": 3.0}),
             (1, 2, 4, {"contributors": ["a", "b"], "agree": ["a", "b"], "total": 2.0}),
             (2, 4, 6, {"contributors": ["b", "c"], "agree": ["b", "c"], "total": 2.5})]
    totals = set()
    for me in range(3):
        asm = Assembly(6, MEMBERS, me, check_agree=False)
        for j, lo, hi, res in parts[me:] + parts[:me]:  # in another order at each member
            asm.add(j, lo, hi, torch.full((2,), float(j)), res)
        totals.add(asm.result(group, 0, [torch.zeros(6)], sent=0, seconds=0.1).total_weight)
    assert totals == {3.0}
