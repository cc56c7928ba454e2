"""A round's timeout follows the link: the method's timeout, or what the measured bandwidth needs, stretched after
rounds that ran into their deadline (a fixed timeout below a slow link's transfer time sends every round twice)."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.collective.codecs import get_codec
from p2ptrain.net.groups import close_group
from p2ptrain.net.transport import Group, JoinRequest
from p2ptrain.phase_timeout import PhaseTimeout
from p2ptrain.sync import RoundRunner


def _runner(base: float = 60.0, codec: str = "fp32") -> RoundRunner:
    return RoundRunner(transport=None, codec=get_codec(codec), join_timeout=10.0, round_timeout=base)  # type: ignore[arg-type]


def test_without_a_measured_link_a_slow_wan_link_is_assumed() -> None:
    r = _runner()
    assert PhaseTimeout.FIRST_RATE == 1.25e6  # 10 Mbit/s
    # 25M fp32 values = 100 MB; 4 members: 2 × 100 MB / 4 over each link = 40 s at 1.25 MB/s; × SLACK 3 = 120 s
    assert r.timeouts.timeout_for([torch.zeros(25_000_000)], 4) == pytest.approx(120.0)
    # a payload that crosses a slow link well within the method's timeout keeps it
    assert r.timeouts.timeout_for([torch.zeros(1_000_000)], 4) == 60.0
    assert r.timeouts.timeout_for([torch.zeros(10)], 1) == 60.0


def test_a_slow_link_stretches_the_timeout_to_its_transfer_time() -> None:
    r = _runner()
    r.stats.bandwidth = 1e6  # bytes/s on the slowest link
    # 25M fp32 values = 100 MB; 4 members: 2 × 100 MB / 4 over each link = 50 s at 1 MB/s; × SLACK 3 = 150 s
    assert r.timeouts.timeout_for([torch.zeros(20_000_000), torch.zeros(5_000_000)], 4) == pytest.approx(150.0)
    # a 4-bit wire needs 7.1× fewer bytes: back under the method's timeout
    e3m0 = _runner(codec="e3m0")
    e3m0.stats.bandwidth = 1e6
    assert e3m0.timeouts.timeout_for([torch.zeros(25_000_000)], 4) == 60.0
    # never more than MAX_STRETCH times the method's timeout
    r.stats.bandwidth = 1e3
    assert r.timeouts.timeout_for([torch.zeros(25_000_000)], 4) == 60.0 * PhaseTimeout.MAX_STRETCH


def test_rounds_that_ran_into_their_deadline_double_it_and_quick_ones_halve_it_back() -> None:
    r = _runner()
    payload = [torch.zeros(1000)]
    r.timeouts.took(50.0, 60.0, late=True)  # failed or partial after most of its timeout
    assert r.timeouts.timeout_for(payload, 4) == 120.0
    r.timeouts.took(100.0, 120.0, late=True)
    assert r.timeouts.timeout_for(payload, 4) == 240.0
    r.timeouts.took(10.0, 240.0, late=True)  # partial early: a member left, not a slow link
    assert r.timeouts.timeout_for(payload, 4) == 240.0
    r.timeouts.took(100.0, 240.0, late=False)  # complete but slow: keep it
    assert r.timeouts.timeout_for(payload, 4) == 240.0
    for want in (120.0, 60.0, 60.0):  # complete well inside the deadline
        r.timeouts.took(1.0, 240.0, late=False)
        assert r.timeouts.timeout_for(payload, 4) == want
    for _ in range(10):
        r.timeouts.took(60.0, 60.0, late=True)
    assert r.timeouts.timeout_for(payload, 4) == 60.0 * PhaseTimeout.MAX_STRETCH


def test_on_a_measured_link_a_phase_that_lost_a_member_does_not_stretch_the_timeout() -> None:
    """Measured, the link sets the timeout (its transfer time × SLACK); a phase that ran into its deadline there
    waited for a member that froze, died or was cut off. Stretching for it held every later round that lost a
    member for up to 8× as long (churn benchmark: 240 s timeouts), and the peers' compute threads with them."""
    r = _runner()
    payload = [torch.zeros(1000)]
    r.stats.bandwidth = 10e6
    for _ in range(3):
        r.timeouts.took(59.0, 60.0, late=True)
    assert r.timeouts.timeout_for(payload, 4) == 60.0 and r.timeout_scale == 1.0
    # a slow link still gets what it needs, from its measured rate
    r.stats.bandwidth = 1e6
    assert r.timeouts.timeout_for([torch.zeros(25_000_000)], 4) == pytest.approx(150.0)


def test_the_transports_link_meters_count_even_when_no_round_completed() -> None:
    """A send cut off by its timeout still measured the link (net/allreduce.py): the next timeout follows it."""
    from p2ptrain.net.bandwidth import LinkMeter

    class Transport:
        links = LinkMeter()

    r = RoundRunner(transport=Transport(), codec=get_codec("fp32"), join_timeout=10.0,  # type: ignore[arg-type]
                    round_timeout=60.0)
    Transport.links.update("peer", 30_000_000, 30.0)  # 30 MB went through in the 30 s the send had: 1 MB/s
    assert r.stats.bandwidth == 0.0
    assert r.timeouts.timeout_for([torch.zeros(25_000_000)], 4) == pytest.approx(150.0)
    assert r.timeout_scale == pytest.approx(2.5)


def test_once_rounds_complete_quickly_the_timeout_follows_them_down() -> None:
    """A member that froze or died holds a round for about half its timeout: 60 s for rounds that take 2 s
    stalled every peer in it for half a minute at each fault (the churn benchmark)."""
    r = _runner()
    payload = [torch.zeros(1000)]
    r.timeouts.took(2.0, 60.0, late=False)
    r.timeouts.took(1.5, 60.0, late=False)
    assert r.timeouts.timeout_for(payload, 4) == 60.0  # two rounds are not yet a record
    r.timeouts.took(4.0, 60.0, late=False)
    assert r.timeouts.timeout_for(payload, 4) == pytest.approx(PhaseTimeout.QUICK * 4.0)  # 5 × the slowest recent one
    assert r.timeout_scale == 1.0  # the peer's own wait is never cut
    for _ in range(16):
        r.timeouts.took(0.5, 20.0, late=False)
    assert r.timeouts.timeout_for(payload, 4) == PhaseTimeout.QUICK_FLOOR  # never under the floor
    r.timeouts.took(9.0, 10.0, late=True)  # then a member froze: stretched from the quick timeout
    assert r.timeouts.timeout_for(payload, 4) == 2 * PhaseTimeout.QUICK_FLOOR
    r.stats.bandwidth = 1e6  # 1 MB/s: 4 MB need 2 × 4 / 4 / 1 × 3 = 6 s (under the quick base: 10 s, stretched)
    assert r.timeouts.timeout_for([torch.zeros(1_000_000)], 4) == 2 * PhaseTimeout.QUICK_FLOOR
    assert r.timeouts.timeout_for([torch.zeros(10_000_000)], 4) == pytest.approx(2 * 60.0)  # 40 MB: 60 s, stretched
    slow = _runner(base=6.0)  # a method timeout under the floor stays as it is
    for _ in range(4):
        slow.timeouts.took(0.1, 6.0, late=False)
    assert slow.timeouts.timeout_for(payload, 4) == 6.0


class _StretchingRunner:
    """A runner whose timeout scale grows once a round's phase has started (after the peer began to wait)."""

    def __init__(self) -> None:
        self.reads = 0

    @property
    def timeout_scale(self) -> float:
        self.reads += 1
        return 1.0 if self.reads == 1 else 100.0


def test_the_peers_wait_follows_a_timeout_the_runner_stretches_while_it_waits() -> None:
    import threading
    import time

    from p2ptrain.peer.collective import SwarmCollective

    runner = _StretchingRunner()
    c = SwarmCollective(None, runner, peer_id="a", codec=get_codec("fp32"), join_timeout=1.0,  # type: ignore[arg-type]
                        wait_limit=0.3, step_seconds=lambda: None)
    c.RECHECK = 0.05
    done = threading.Event()
    timer = threading.Timer(0.6, done.set)  # the round ends after the first limit (0.3 s), inside the stretched one
    timer.start()
    try:
        assert c._wait_one(done, time.perf_counter()) == "ended"
    finally:
        timer.cancel()
    assert runner.reads > 1
    # without a stretch the wait gives up at its limit
    c.runner = _runner()
    t0 = time.perf_counter()
    assert c._wait_one(threading.Event(), t0) == "limit"
    assert 0.3 <= time.perf_counter() - t0 < 5.0


class _FakeRound:
    def __init__(self, key: str) -> None:
        self.key, self.aborted = key, False

    def abort(self) -> None:
        self.aborted = True


def test_a_round_cut_short_by_the_leaves_drain_limit_is_abandoned_not_stuck() -> None:
    """A leaving peer's drain deadline that comes before a round's own wait limit abandons the round (counted
    apart); a round that outlives its own limit during the drain is stuck, as at any other time."""
    import threading
    import time

    from p2ptrain.peer.collective import SwarmCollective

    c = SwarmCollective(None, _runner(), peer_id="a", codec=get_codec("fp32"), join_timeout=1.0,  # type: ignore[arg-type]
                        wait_limit=5.0, step_seconds=lambda: None)
    c.RECHECK = 0.05
    cut = _FakeRound("f0.L1")
    c._done[cut] = threading.Event()  # type: ignore[index]
    c.deadline = time.perf_counter() + 0.2  # the drain ends long before the round's 5 s
    t0 = time.perf_counter()
    assert c.wait([cut])  # type: ignore[list-item]
    assert time.perf_counter() - t0 < 3.0
    assert cut.aborted and (c.abandoned, c.stuck) == (1, 0)
    c.wait_limit = 0.2  # now the round's own limit comes first, inside the drain's
    late = _FakeRound("f1.L2")
    c._done[late] = threading.Event()  # type: ignore[index]
    c.deadline = time.perf_counter() + 10.0
    assert c.wait([late])  # type: ignore[list-item]
    assert late.aborted and (c.abandoned, c.stuck) == (1, 1)
    done = _FakeRound("f2.L3")  # a round that ended is neither
    ev = c._done[done] = threading.Event()  # type: ignore[index]
    ev.set()
    assert c.wait([done]) and not done.aborted and (c.abandoned, c.stuck) == (1, 1)  # type: ignore[list-item]


def _with_record(seconds: list[float], rate: float = 0.0) -> RoundRunner:
    r = _runner()
    for s in seconds:
        r.timeouts.took(s, 60.0, late=False)
    r.stats.bandwidth = rate
    return r


def test_a_peer_proposes_its_budget_and_rate_only_once_it_has_a_word_of_its_own() -> None:
    fresh = _runner()
    assert fresh.timeouts.terms() == (None, None)  # the method's timeout and FIRST_RATE: nothing to add
    quick = _with_record([2.0, 3.0, 2.5], rate=4e6)
    assert quick.timeouts.terms() == (pytest.approx(PhaseTimeout.QUICK * 3.0), 4e6)
    stretched = _runner()
    stretched.timeouts.took(50.0, 60.0, late=True)  # no link measured: the link may be slower than assumed
    assert stretched.timeouts.terms() == (120.0, PhaseTimeout.FIRST_RATE / 2)
    # what a proposal gives is what the peer's own view gives
    for r in (fresh, quick, stretched):
        budget, rate = r.timeouts.terms()
        group = Group("k", ("a", "b"), "a", 0, budget=budget, rate=rate)
        for payload in ([torch.zeros(1000)], [torch.zeros(25_000_000)]):
            assert r.timeouts.timeout_for(payload, 4, group) == pytest.approx(r.timeouts.timeout_for(payload, 4))


def test_every_member_sizes_a_round_by_its_groups_terms_not_its_own_record() -> None:
    """Each member used its own timeout: one that had just started (the method's 60 s) waited for a shard, and
    applied the round, that the others (5 × their recent phases) had given up on: a θ the majority had to repair
    away. With the group's terms every member's deadlines are the same, whatever its own record."""
    fresh, quick = _runner(), _with_record([2.0, 3.0, 2.5], rate=4e6)
    slow_link, cut_off = _with_record([1.0, 1.0, 1.0], rate=1e6), _with_record([4.0, 4.0, 4.0], rate=1e3)
    runners = [fresh, quick, slow_link, cut_off]
    reqs = {p: r._with_terms(JoinRequest(key="k", peer_id=p, weight=1.0, fragment=0))
            for p, r in zip("abcd", runners, strict=True)}
    group = Group.from_wire(close_group("k", reqs, "a", None).to_wire())  # as the members receive it
    # The median of the proposals (the fresh peer made none): one member whose meter saw its sends cut off by a
    # partition (1 kB/s) does not hold every round of its groups to the bound.
    assert (group.budget, group.rate) == (pytest.approx(15.0), 1e6)
    for payload in ([torch.zeros(1000)], [torch.zeros(10_000_000)]):
        own = {r.timeouts.timeout_for(payload, 4) for r in runners}
        agreed = {r.timeouts.timeout_for(payload, 4, group) for r in runners}
        assert len(own) > 1 and len(agreed) == 1, (own, agreed)
    assert quick.timeouts.timeout_for([torch.zeros(1000)], 4, group) == pytest.approx(15.0)
    assert quick.timeouts.timeout_for([torch.zeros(10_000_000)], 4, group) == pytest.approx(60.0)  # 40 MB at 1 MB/s, × 3 / 2
    assert cut_off.timeouts.timeout_for([torch.zeros(10_000_000)], 4) == 480.0  # its own view: the bound
    # no member proposed: the method's timeout and FIRST_RATE, for everyone
    bare = close_group("k", {p: JoinRequest(key="k", peer_id=p, weight=1.0, fragment=0) for p in "ab"}, "a", None)
    assert (bare.budget, bare.rate) == (None, None)
    assert {r.timeouts.timeout_for([torch.zeros(1000)], 4, bare) for r in runners} == {60.0}


def test_a_leaders_terms_are_held_to_the_bounds_a_member_holds_its_own_to() -> None:
    r = _runner()
    payload = [torch.zeros(1000)]
    assert r.timeouts.timeout_for(payload, 4, Group("k", ("a",), "a", 0, budget=1e9)) == 60.0 * PhaseTimeout.MAX_STRETCH
    assert r.timeouts.timeout_for(payload, 4, Group("k", ("a",), "a", 0, budget=0.01)) == PhaseTimeout.QUICK_FLOOR
    assert r.timeouts.timeout_for([torch.zeros(25_000_000)], 4,
                         Group("k", ("a",), "a", 0, rate=1.0)) == 60.0 * PhaseTimeout.MAX_STRETCH
    # on the wire, anything but a finite positive number is no proposal
    for bad in (-1.0, 0, float("nan"), float("inf"), "15", True, None):
        g = Group.from_wire({**Group("k", ("a",), "a", 0).to_wire(), "budget": bad, "rate": bad})
        j = JoinRequest.from_wire({**JoinRequest(key="k", peer_id="a", weight=1.0).to_wire(), "budget": bad,
                                   "rate": bad})
        assert (g.budget, g.rate, j.budget, j.rate) == (None, None, None, None), bad


def test_a_hierarchical_round_is_sized_by_its_smallest_cell_at_every_member() -> None:
    """Each member sized the phase by its own cell (a cell of 3 and one of 2 had different deadlines, and the
    cross step mixes their carriers)."""
    from p2ptrain.net.hierarchy import plan_for

    members = ("a", "b", "c", "d", "e")
    group = Group("k", members, "a", 0, regions=("us", "us", "us", "eu", "eu"))
    plans = [plan_for(group, m) for m in members]
    assert {len(p.local.members) for p in plans if p is not None} == {2, 3}
    assert {p.smallest for p in plans if p is not None} == {2}
