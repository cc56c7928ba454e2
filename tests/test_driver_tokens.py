"""A round's weight is the tokens its Δ summarises: those since the fragment's last round that was not aborted.
An aborted round's progress stays in θ − θ_i and goes into the next round's Δ, so its tokens go with it (they used
to be dropped: a swarm that failed rounds under churn counted far fewer tokens in θ than reached it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from p2ptrain.algo.fragments import make_fragments
from p2ptrain.algo.methods import DiLoCoConfig, OuterLoop, StreamingConfig
from p2ptrain.algo.rounds import Round
from p2ptrain.driver import OuterDriver

from .algo.test_methods import UNITS, FakePeer


class Scripted:
    """A collective whose rounds end as the test says: ``fail`` aborts them, otherwise they arrive alone."""

    def __init__(self) -> None:
        self.fail = False
        self.weights: list[float] = []

    def launch(self, rnd: Round, request: Any) -> None:
        self.weights.append(rnd.weight)
        if self.fail:
            rnd.abort()
        else:
            rnd.receive(list(rnd.payload or []), total_weight=rnd.weight, members=1)

    def arrived(self, rnd: Round) -> bool:
        return rnd.arrived

    def wait(self, rounds: Sequence[Round]) -> bool:
        return True

    def expected_members(self) -> int:
        return 1

    def proposed_sends(self, H: int, P: int, numels: Sequence[int]) -> int | None:
        return None


def _steps(peer: FakePeer, driver: OuterDriver, *steps: int) -> None:
    """Inner steps ``steps`` of ``peer``, each followed by its driver's logical step."""
    for s in steps:
        peer.step()
        assert driver.advance(s)


def test_an_aborted_rounds_tokens_go_into_the_next_round_of_its_fragment() -> None:
    peer = FakePeer(0)
    outer = OuterLoop(DiLoCoConfig(H=2, codec="fp32"), make_fragments(UNITS, 1))
    outer.init(peer)
    net = Scripted()
    driver = OuterDriver(outer, peer, net)  # type: ignore[arg-type]

    def steps(first: int, last: int) -> None:
        for s in range(first, last + 1):
            peer.step()  # 10 tokens a step
            assert driver.advance(s)

    steps(1, 2)  # round 1: steps 1-2
    net.fail = True
    steps(3, 4)  # round 2 (steps 3-4) is aborted
    net.fail = False
    steps(5, 6)  # round 3: its Δ holds steps 3-6
    steps(7, 8)  # round 4: steps 7-8
    assert net.weights == [20, 20, 40, 20]
    assert driver._marks == {}  # nothing kept of rounds that ended


def test_a_divergent_round_without_repair_is_not_applied() -> None:
    """A round that says our θ left the majority's, and whose repair found nobody holding the majority's θ, is not
    applied (applied, it would make a replica known to differ): it ends aborted, our θ stays, and its progress
    and tokens go into the fragment's next round, as an aborted round's do."""
    from p2ptrain.driver import DriverHooks

    class NoRepair(DriverHooks):
        asked = 0

        def repair(self, rnd: Round, taking: Any) -> bool:
            self.asked += 1
            return False

    class Divergent(Scripted):
        divergent = False

        def launch(self, rnd: Round, request: Any) -> None:
            super().launch(rnd, request)
            rnd.divergent = self.divergent

    peer = FakePeer(0)
    outer = OuterLoop(DiLoCoConfig(H=2, codec="fp32"), make_fragments(UNITS, 1))
    outer.init(peer)
    net, hooks = Divergent(), NoRepair()
    driver = OuterDriver(outer, peer, net, hooks=hooks)  # type: ignore[arg-type]
    for s in (1, 2):
        peer.step()
        assert driver.advance(s)
    theta = [t.clone() for t in outer.theta(0)]
    net.divergent = True
    for s in (3, 4):
        peer.step()
        assert driver.advance(s)
    assert hooks.asked == 1 and driver.applied == 1
    assert all(a.equal(b) for a, b in zip(outer.theta(0), theta, strict=True))  # θ untouched
    net.divergent = False
    for s in (5, 6):
        peer.step()
        assert driver.advance(s)
    assert net.weights == [20, 20, 40] and driver.applied == 2 and driver.in_flight == []


class Outvoted(Scripted):
    """Rounds arrive with the majority's average ``avg`` and this peer outvoted (``counted`` False) while
    ``outvote`` is set; the hooks' repair takes the majority's θ ``theta`` (momentum zero) as a replica does."""

    def __init__(self, avg: float) -> None:
        super().__init__()
        self.avg, self.outvote, self.counted = avg, False, False

    def launch(self, rnd: Round, request: Any) -> None:
        self.weights.append(rnd.weight)
        if not self.outvote:
            rnd.receive(list(rnd.payload or []), total_weight=rnd.weight, members=1)
            return
        rnd.receive([torch.full_like(t, self.avg) for t in rnd.payload or []], total_weight=3 * rnd.weight,
                    members=2)
        rnd.divergent, rnd.counted = True, self.counted


def _repairing(held_round: str, trains: int = 0) -> tuple[FakePeer, OuterLoop, list[torch.Tensor],
                                                         dict[str, dict[str, torch.Tensor]], Any]:
    """A DiLoCo peer on one fragment and hooks whose repair takes the majority's θ (0.5, momentum zero) as a
    replica does, recording the local model and θ^(p) it replaced (``seen``), and saying that θ was last made by
    ``held_round`` counting us ("" for no such word). ``trains``: inner steps the repair takes while it fetches
    (as a replica's does, beside its fetch: peer/overlap.py)."""
    from p2ptrain.driver import DriverHooks

    peer = FakePeer(0)
    outer = OuterLoop(DiLoCoConfig(H=2, codec="fp32"), make_fragments(UNITS, 1))
    outer.init(peer)
    names = outer.fragments[0].names
    majority = [torch.full_like(t, 0.5) for t in outer.theta(0)]
    seen: dict[str, dict[str, torch.Tensor]] = {}

    class Repair(DriverHooks):
        def repair(self, rnd: Round, taking: Any) -> bool:
            for _ in range(trains):
                peer.step()
            taking()  # (the driver reads our progress here, before the majority's θ replaces it)
            seen["local"] = {n: peer.x[n].clone() for n in names}
            seen["theta"] = dict(zip(names, outer.theta(0), strict=True))
            outer.overwrite(0, majority, [torch.zeros_like(t) for t in majority])
            peer.apply_outer(names, majority)  # what a replica's repair does to the local model
            rnd.held_round = held_round  # (what a replica's repair reads from the θ it took)
            return True

    return peer, outer, majority, seen, Repair()


def _outvoted_run(counted: bool) -> tuple[FakePeer, OuterLoop, Outvoted, dict[str, torch.Tensor],
                                          dict[str, torch.Tensor], list[torch.Tensor]]:
    """DiLoCo (τ = 0) on one fragment: round 1 alone, round 2 outvoted; returns the peer, its outer loop, the
    collective, the local model and θ^(p) just before round 2 was applied, and the majority's θ it repaired to."""
    peer, outer, majority, seen, hooks = _repairing("")
    net = Outvoted(avg=0.25)
    net.counted = counted
    driver = OuterDriver(outer, peer, net, hooks=hooks)  # type: ignore[arg-type]
    for s in (1, 2):
        peer.step()
        assert driver.advance(s)
    net.outvote = True
    _steps(peer, driver, 3, 4)
    net.outvote = False
    _steps(peer, driver, 5, 6)
    return peer, outer, net, seen["local"], seen["theta"], majority


def test_an_outvoted_peer_keeps_its_progress_and_its_tokens() -> None:
    """Outvoted (our θ left the majority's, so our Δ is in no average), the repaired peer steps the majority's θ
    with the round's average and keeps everything it trained since its own θ, rebased on the new θ; the round's
    tokens go into the fragment's next round with that progress (a repair used to drop both)."""
    eta, mu = 0.7, 0.9  # DiLoCo's defaults
    peer, outer, net, local, theta, majority = _outvoted_run(counted=False)
    assert net.weights == [20, 20, 40]  # round 3 carries round 2's tokens: its progress was kept
    # By hand, in float64: θ after round 2 = θ_maj − η·(A + μ·(μ·0 + A)); the local model after it stands at
    # θ + (local − θ_mine). Round 3 (steps 5-6, alone) then moves both again: compare the state after round 2
    # through round 3's Δ, which is θ_after2 − local at send = −(local − θ_mine) − (steps 5-6's progress).
    names = outer.fragments[0].names
    for i, n in enumerate(names):
        after2 = majority[i].double() - eta * (0.25 + mu * 0.25)
        kept = local[n].double() - theta[n].double()
        x = after2 + kept
        for _ in range(2):  # steps 5 and 6 from there
            x = x - 0.1 * (x - peer.c[n].double())
        delta = after2 - x  # round 3's Δ (alone: its own average)
        m = mu * (mu * 0.0 + 0.25) + delta  # momentum after round 2 was μ·0 + A
        want = after2 - eta * (delta + mu * m)
        assert torch.allclose(outer.theta(0)[i].double(), want, atol=1e-5), n
        assert torch.allclose(peer.x[n].double(), want, atol=1e-5), n  # DiLoCo restarts the local model at θ


def test_steps_a_repair_trains_while_it_fetches_are_kept_with_the_rest_of_the_progress() -> None:
    """The inner steps a repair takes while the majority's θ is on its way (peer/overlap.py) are progress like
    the steps before it: kept on the new θ with the rest (read when θ comes, not when the round did), and their
    tokens go into the fragment's next round."""
    eta, mu = 0.7, 0.9
    peer, outer, majority, seen, hooks = _repairing("", trains=2)
    net = Outvoted(avg=0.25)
    driver = OuterDriver(outer, peer, net, hooks=hooks)  # type: ignore[arg-type]
    _steps(peer, driver, 1, 2)
    net.outvote = True
    peer.step()
    peer.step()
    at_round = {n: peer.x[n].clone() for n in outer.fragments[0].names}
    assert driver.advance(4)  # outvoted: the repair trains 2 steps, then takes the majority's θ
    net.outvote = False
    names = outer.fragments[0].names
    for i, n in enumerate(names):
        assert not torch.equal(seen["local"][n], at_round[n])  # (the repair's steps moved the local model)
        after2 = majority[i].double() - eta * (0.25 + mu * 0.25)  # θ after round 2, as in the test above
        kept = seen["local"][n].double() - seen["theta"][n].double()  # everything since θ_mine, the 2 steps too
        assert torch.allclose(peer.x[n].double(), after2 + kept, atol=1e-6), n
    _steps(peer, driver, 5, 6)
    assert net.weights == [20, 20, 60]  # round 3: round 2's 20 tokens, the repair's 20 and its own 20


def test_an_outvoted_round_that_still_counted_us_drops_the_progress_it_holds() -> None:
    """A divergent round whose average did hold our Δ (counted in most of its parts) is applied as before: the
    progress it averaged is not kept a second time, and its tokens are not given back."""
    net = _outvoted_run(counted=True)[2]
    assert net.weights == [20, 20, 20]


def test_the_applied_line_says_this_peers_own_tokens_in_the_average_and_none_when_outvoted() -> None:
    """``own`` on the ``applied`` line: this peer's tokens in the average (what the churn benchmark sums per peer
    to follow trained tokens into θ); 0 for a round whose average holds no Δ of ours (outvoted)."""
    from p2ptrain.algo.compress import Identity
    from p2ptrain.algo.rounds import RoundState
    from p2ptrain.peer.replica import _applied_fields

    def arrived(counted: bool) -> Round:
        rnd = Round(0, 0, 0, 1, [], [torch.zeros(3)], 300.0, Identity(), name="f0.r0")
        rnd.payload = rnd.compressor.begin([torch.zeros(3)])
        rnd.state = RoundState.AVERAGING
        rnd.receive([torch.zeros(3)], total_weight=1200.0, members=4)
        rnd.counted = counted
        return rnd

    assert _applied_fields(arrived(True)) == ("f0.r0", 0, 4, 1200.0, False, 300.0)
    key, _, _, _, _, own = _applied_fields(arrived(False))
    assert (key, own) == ("f0.r0", 0.0)


def test_unsent_names_the_fragments_whose_tokens_no_round_carries() -> None:
    """What a leave flushes: a fragment is unsent once it trained past its last send, or when its round failed
    (the tokens given back); sent and arrived, it is not."""

    peer = FakePeer(0)
    outer = OuterLoop(StreamingConfig(H=4, P=2, tau=0, codec="fp32"), make_fragments(UNITS, 2))
    outer.init(peer)
    net = Scripted()
    driver = OuterDriver(outer, peer, net)  # type: ignore[arg-type]
    assert driver.unsent() == []  # nothing trained yet
    peer.step()
    assert driver.unsent() == [0, 1]
    sent: list[int] = []
    for s in range(1, 5):  # one send of each fragment within H = 4 logical steps, no inner step between
        before = len(driver.stats.history)
        assert driver.advance(s)
        sent += [f for _, kind, f in driver.stats.history[before:] if kind == "send"]
    assert sorted(set(sent)) == [0, 1] and driver.unsent() == []
    peer.step()
    net.fail = True
    for s in range(5, 9):
        assert driver.advance(s)
    assert driver.unsent() == [0, 1]  # both rounds failed: their tokens are given back, still to be sent


class Recording(Scripted):
    """Scripted, keeping each round's Δ."""

    def __init__(self) -> None:
        super().__init__()
        self.deltas: list[list[torch.Tensor]] = []

    def launch(self, rnd: Round, request: Any) -> None:
        self.deltas.append([d.clone() for d in rnd.delta])
        super().launch(rnd, request)


def _heir() -> tuple[FakePeer, OuterLoop, Recording, OuterDriver]:
    peer = FakePeer(0)
    outer = OuterLoop(DiLoCoConfig(H=2, codec="fp32"), make_fragments(UNITS, 1))
    outer.init(peer)
    net = Recording()
    return peer, outer, net, OuterDriver(outer, peer, net)  # type: ignore[arg-type]


def test_an_inherited_bequest_is_in_the_next_round_of_its_fragment_with_its_tokens() -> None:
    """The heir's next Δ of the fragment is the token-weighted mean of its own Δ and the leaver's (−d), sent with
    both weights; its round then averages as one in which the leaver had sent its own (algo/bequest.py)."""
    from p2ptrain.algo.bequest import Bequest

    peer, outer, net, driver = _heir()
    names = outer.fragments[0].names
    g = torch.Generator().manual_seed(7)
    d = [torch.randn(t.shape, generator=g) * 0.1 for t in outer.theta(0)]
    peer.step()
    assert driver.advance(1)
    driver.inherit(Bequest(0, d, 30, "leaver"))
    peer.step()
    theta, x = [t.double() for t in outer.theta(0)], [peer.x[n].double() for n in names]
    assert driver.advance(2)  # the send: 20 tokens of its own, 30 inherited
    assert net.weights == [50] and driver.bequests == {}
    for got, t, xi, di in zip(net.deltas[0], theta, x, d, strict=True):
        want = (20 * (t - xi) + 30 * -di.double()) / 50
        assert torch.allclose(got.double(), want, atol=1e-6)


def test_an_aborted_round_gives_an_inherited_bequests_tokens_back_with_the_heirs_own() -> None:
    from p2ptrain.algo.bequest import Bequest

    peer, outer, net, driver = _heir()
    driver.inherit(Bequest(0, [torch.full_like(t, 0.01) for t in outer.theta(0)], 30, "leaver"))
    net.fail = True
    _steps(peer, driver, 1, 2)
    net.fail = False
    _steps(peer, driver, 3, 4)
    assert net.weights == [50, 70]


def test_a_will_holds_the_unsent_progress_and_what_was_inherited_and_not_sent() -> None:
    """``will``: per fragment with tokens no round carries, x − θ and those tokens; an inherited bequest not sent
    yet is passed on inside it (blended: the same weighted mean an heir of this peer would have sent)."""
    from p2ptrain.algo.bequest import Bequest

    peer, outer, _, driver = _heir()
    _steps(peer, driver, 1, 2, 3)
    names = outer.fragments[0].names
    theta = [t.clone() for t in outer.theta(0)]
    own = [peer.x[n] - t for n, t in zip(names, theta, strict=True)]
    (w,) = driver.will()
    assert w.fragment == 0 and w.tokens == 10
    assert all(torch.allclose(a, b) for a, b in zip(w.displacement, own, strict=True))
    d = [torch.full_like(t, 0.5) for t in theta]
    driver.inherit(Bequest(0, d, 30, "earlier"))
    (w,) = driver.will()
    assert w.tokens == 40 and driver.bequests == {}
    for got, o, di in zip(w.displacement, own, d, strict=True):
        assert torch.allclose(got.double(), (10 * o.double() + 30 * di.double()) / 40, atol=1e-6)


class LeftOut(Scripted):
    """Rounds arrive alone, counted or not, with ``missing`` the values whose average left our Δ out."""

    def __init__(self, missing: tuple[tuple[int, int], ...], counted: bool = True) -> None:
        super().__init__()
        self.missing, self.counted = missing, counted

    def launch(self, rnd: Round, request: Any) -> None:
        super().launch(rnd, request)
        rnd.missing, rnd.counted = self.missing, self.counted


def _left_out_run(missing: tuple[tuple[int, int], ...], counted: bool = True
                  ) -> tuple[FakePeer, OuterLoop, LeftOut, OuterDriver]:
    """Streaming on one fragment, τ 0, α 0.5: one round (steps 1-2) whose average left ``missing`` out."""

    peer = FakePeer(0)
    outer = OuterLoop(StreamingConfig(H=2, P=1, tau=0, alpha=0.5, codec="fp32"), make_fragments(UNITS, 1))
    outer.init(peer)
    net = LeftOut(missing, counted)
    driver = OuterDriver(outer, peer, net)  # type: ignore[arg-type]
    _steps(peer, driver, 1, 2)
    return peer, outer, net, driver


def test_values_whose_average_left_our_delta_out_keep_their_progress() -> None:
    """Where a round's average did not hold our Δ (a part left us out, a shard our cell's mean never reached), the
    local fragment keeps all of its progress since θ before the round, rebased on the new θ, instead of the α-merge
    that would lose it; everywhere else the round is applied as usual. Checked against the same round with
    nothing left out, and by hand in float64."""
    kept_peer, kept_outer, _, _ = _left_out_run(((20, 30),))
    peer, outer, _, _ = _left_out_run(())
    names = outer.fragments[0].names
    flat = torch.cat([peer.x[n].reshape(-1) for n in names])
    kept = torch.cat([kept_peer.x[n].reshape(-1) for n in names])
    theta = torch.cat([t.reshape(-1) for t in outer.theta(0)])
    assert torch.equal(theta, torch.cat([t.reshape(-1) for t in kept_outer.theta(0)]))  # θ: the same round
    outside = torch.ones_like(flat, dtype=torch.bool)
    outside[20:30] = False
    assert torch.equal(kept[outside], flat[outside])
    # By hand: θ before the round is 0 (the initial model), the local model after two steps of lr 0.1 towards c
    # stands at 0.19·c; kept there, it stands at θ_new + 0.19·c.
    c = torch.cat([peer.c[n].reshape(-1) for n in names]).double()
    assert torch.allclose(kept[20:30].double(), theta[20:30].double() + 0.19 * c[20:30], atol=1e-6)
    assert not torch.allclose(flat[20:30], kept[20:30])  # (the α-merge would have dropped half of it)


def test_a_round_that_counted_none_of_our_delta_gives_its_tokens_to_the_next_round() -> None:
    """Not a contributor (our share in no more than half of the values), not outvoted: every value we are missing
    from keeps its progress, and the round's tokens go into the fragment's next round with it; left out of part
    of the values only, the round still counted us and its tokens are not given back."""
    whole = sum(t.numel() for t in FakePeer(0).x.values())
    peer, _, net, driver = _left_out_run(((0, whole),), counted=False)
    net.missing, net.counted = (), True
    _steps(peer, driver, 3, 4)
    assert net.weights == [20, 40]
    peer, _, net, driver = _left_out_run(((0, 5),), counted=True)
    net.missing = ()
    _steps(peer, driver, 3, 4)
    assert net.weights == [20, 20]


def test_rules_that_restart_from_theta_keep_nothing_and_finish_refuses_to() -> None:
    """Eager's local model restarts from θ each round: where its average left our Δ out there is no progress left
    to keep, so the round applies as if nothing were missing, and asking finish() to keep raises."""
    from p2ptrain.algo.methods import EagerConfig

    def run(missing: tuple[tuple[int, int], ...]) -> tuple[FakePeer, OuterLoop, Round]:
        peer = FakePeer(0)
        outer = OuterLoop(EagerConfig(H=2, codec="fp32"), make_fragments(UNITS, 1))
        outer.init(peer)
        net = LeftOut(missing)
        driver = OuterDriver(outer, peer, net)  # type: ignore[arg-type]
        _steps(peer, driver, 1, 2, 3, 4)
        return peer, outer, Round(0, 0, 0, 1, [], [], 1.0, outer._state[0].compressor)

    (left_out, outer, rnd), (whole, _, _) = run(((0, 5),)), run(())
    assert all(torch.equal(left_out.x[n], whole.x[n]) for n in whole.x)
    assert not outer.can_keep(rnd)
    with pytest.raises(ValueError, match="cannot be kept"):
        outer.finish(rnd, 4, left_out, keep=((0, 5),))


class FailsThenOutvoted(Outvoted):
    """Round 2 fails here after its group formed (``began``: others may still have averaged our Δ); round 3 then
    arrives outvoted (our θ missed round 2's step), and the repair's θ is the majority's, which says whether it
    was last made by round 2 counting us (``held``)."""

    def __init__(self, avg: float) -> None:
        super().__init__(avg)
        self.snapshots: dict[str, list[torch.Tensor]] = {}

    def launch(self, rnd: Round, request: Any) -> None:
        self.snapshots[rnd.key] = [t.clone() for t in rnd.snapshot]
        if self.fail:
            self.weights.append(rnd.weight)
            rnd.began = True
            rnd.abort()
            return
        super().launch(rnd, request)


def _failed_then_outvoted(held: bool) -> tuple[FakePeer, OuterLoop, FailsThenOutvoted, dict[str, torch.Tensor],
                                                dict[str, torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """DiLoCo (τ = 0): round 1 (steps 1-2) alone, round 2 (3-4) fails after its group formed, round 3 (5-6)
    outvoted and repaired onto the majority's θ; returns the peer, its outer loop, the collective, the local model
    and our θ^(p) at round 3's repair, the majority's θ, and the local model after round 3 was applied."""
    peer, outer, majority, seen, hooks = _repairing("f0.L4" if held else "")
    names = outer.fragments[0].names
    net = FailsThenOutvoted(avg=0.25)
    driver = OuterDriver(outer, peer, net, hooks=hooks)  # type: ignore[arg-type]
    _steps(peer, driver, 1, 2)
    net.fail = True
    _steps(peer, driver, 3, 4)
    assert set(driver.unseen.held) == {0} and driver.unseen.held[0].key == "f0.L4"
    net.fail, net.outvote = False, True
    _steps(peer, driver, 5, 6)
    after = [peer.x[n].clone() for n in names]
    assert not driver.unseen  # (held only until the fragment's next round is applied)
    net.outvote = False
    _steps(peer, driver, 7, 8)
    return peer, outer, net, seen["local"], seen["theta"], majority, after


@pytest.mark.parametrize("held", [True, False])
def test_a_failed_round_the_majority_counted_us_in_is_not_averaged_twice(held: bool) -> None:
    """Round 2 failed here, but the majority's θ that round 3's repair took was made by round 2 and names us
    among its contributors (a hierarchical cell whose mean crossed and whose carrier then never delivered the
    result here): round 2's progress is in θ already. The local model keeps only what it trained since round 2's
    send, and round 2's tokens stay counted, so round 4 carries steps 5-8 (before: steps 3-8, round 2's Δ and
    tokens a second time). Without that word of the majority's θ, all the progress since our θ is kept, as for an
    outvoted round."""
    eta, mu = 0.7, 0.9
    _, outer, net, local, theta, majority, after = _failed_then_outvoted(held)
    assert net.weights == [20, 20, 40, 40 if held else 60]
    names = outer.fragments[0].names
    base = dict(zip(names, net.snapshots["f0.L4"], strict=True)) if held else theta
    for i, n in enumerate(names):
        after3 = majority[i].double() - eta * (0.25 + mu * 0.25)  # Nesterov from momentum 0, average 0.25
        want = after3 + (local[n].double() - base[n].double())
        assert torch.allclose(after[i].double(), want, atol=1e-6), n
    if held:  # (round 2's progress: what it put between our θ and its snapshot; not in the local model now)
        gap = [(local[n] - theta[n]) - (local[n] - base[n]) for n in names]
        assert any(g.abs().max() > 1e-3 for g in gap)


def test_a_round_that_failed_before_its_group_formed_is_not_held() -> None:
    """A round that never formed a group (no quorum, nobody to join) is in nobody's average: nothing is kept of
    it but its tokens, given back to the fragment's next round."""
    peer = FakePeer(0)
    outer = OuterLoop(DiLoCoConfig(H=2, codec="fp32"), make_fragments(UNITS, 1))
    outer.init(peer)
    net = Scripted()
    driver = OuterDriver(outer, peer, net)  # type: ignore[arg-type]
    _steps(peer, driver, 1, 2)
    net.fail = True
    _steps(peer, driver, 3, 4)
    assert not driver.unseen and driver.tokens_at_send == [20]

