"""A round's weight is the tokens its Δ summarises: those since the fragment's last round that was not aborted.
An aborted round's progress stays in θ − θ_i and goes into the next round's Δ, so its tokens go with it (they used
to be dropped: a swarm that failed rounds under churn counted far fewer tokens in θ than reached it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from p2ptrain.algo.fragments import make_fragments
from p2ptrain.algo.methods import DiLoCoConfig, OuterLoop
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

        def repair(self, rnd: Round) -> bool:
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
