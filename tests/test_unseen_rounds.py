"""A peer resumed from a checkpoint does not see the outcome of the rounds it had in flight then, nor of those it
sent after the checkpoint was written. The state it takes says, per fragment, which round its θ was last made by
and whom that round counted (``made``): named there, our Δ of that round is in that θ, and the rebase onto it
keeps only the progress made since (p2ptrain/algo/unseen.py). Checked by hand in float64 on a one-fragment
streaming peer whose inner step is a gradient step on ½‖x − c‖²."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from p2ptrain.algo.fragments import make_fragments
from p2ptrain.algo.methods import OuterLoop, StreamingConfig
from p2ptrain.algo.rounds import Round
from p2ptrain.algo.unseen import Unseen, UnseenRounds
from p2ptrain.driver import OuterDriver
from p2ptrain.peer.replica import ReplicaState

from .algo.test_methods import UNITS, FakePeer
from .test_driver_tokens import Scripted, _steps

CFG = StreamingConfig(H=2, P=1, tau=1, codec="fp32")


class Hangs(Scripted):
    """A collective whose rounds never end (the peer is killed with them in flight)."""

    def launch(self, rnd: Round, request: Any) -> None:
        self.weights.append(rnd.weight)


def _checkpoint(steps_after_send: int, send: bool) -> dict[str, Any]:
    """A peer trains steps 1-2 (round f0.L2 sent at step 2 when ``send``, and never ended) and
    ``steps_after_send`` more steps; what its checkpoint holds then."""
    peer = FakePeer(0)
    outer = OuterLoop(CFG, make_fragments(UNITS, 1))
    outer.init(peer)
    driver = OuterDriver(outer, peer, Hangs())  # type: ignore[arg-type]
    if send:
        _steps(peer, driver, 1, 2)
    else:
        peer.step()
        peer.step()
    for _ in range(steps_after_send):
        peer.step()
    names = outer.fragments[0].names
    return {"outer": outer.state_dict(), "x": {n: peer.x[n].clone() for n in names}, "tokens": peer.tokens_seen,
            "tokens_at_send": list(driver.tokens_at_send), "unseen": driver.unseen_record(),
            "snapshot": [t.clone() for t in driver.in_flight[0].snapshot] if send else None}


def _resume(ckpt: dict[str, Any]) -> tuple[FakePeer, OuterLoop, OuterDriver]:
    peer = FakePeer(0)
    peer.x.update({n: v.clone() for n, v in ckpt["x"].items()})
    peer.tokens_seen = ckpt["tokens"]
    outer = OuterLoop(CFG, make_fragments(UNITS, 1))
    outer.init(peer)
    outer.load_state_dict(ckpt["outer"])
    driver = OuterDriver(outer, peer, Scripted())  # type: ignore[arg-type]
    driver.tokens_at_send = list(ckpt["tokens_at_send"])
    names = outer.fragments[0].names
    driver.resume_unseen(ckpt["unseen"], lambda f: peer.snapshot(names), ckpt["tokens"])
    return peer, outer, driver


def _take(peer: FakePeer, outer: OuterLoop, driver: OuterDriver, made: dict[str, Any], value: float,
          ) -> list[torch.Tensor]:
    """Take a swarm state whose θ is all ``value`` and whose ``made`` is given, as a peer's start does."""
    src = OuterLoop(CFG, make_fragments(UNITS, 1))
    src.init(FakePeer(1))
    majority = [torch.full_like(t, value) for t in outer.theta(0)]
    src.overwrite(0, majority, [torch.zeros_like(t) for t in majority])
    state = src.shared_state()
    state["made"] = made
    held = {}
    for f, u in driver.unseen.counted_in(state["made"], "me").items():
        held[f] = u.delta
        driver.counted(f, u, "src")
    rep = ReplicaState(outer, peer, outer.fragments, threading.Lock(), list)  # type: ignore[arg-type]
    try:
        rep.take(state, keep_progress=True, held=held)
    finally:
        rep.close()
    return majority


def _check(peer: FakePeer, outer: OuterLoop, majority: list[torch.Tensor], x: dict[str, torch.Tensor],
           base: list[torch.Tensor]) -> None:
    """The local model is the majority's θ plus ``x − base`` (float64)."""
    for i, n in enumerate(outer.fragments[0].names):
        want = majority[i].double() + (x[n].double() - base[i].double())
        assert torch.allclose(peer.x[n].double(), want, atol=1e-6), n


@pytest.mark.parametrize("named", [True, False])
def test_a_round_in_flight_at_the_checkpoint_counts_only_where_the_state_names_us(named: bool) -> None:
    """In flight at the checkpoint: its tokens go back to the fragment's next round at the resume, and the round
    is held. Named among the contributors of the round last in the state's θ, its progress is in that θ: the rebase
    keeps only the step after its send, and its tokens are counted again. Not named: everything since our θ is kept
    with its tokens (before, the tokens were lost, and a counted Δ was kept a second time)."""
    ckpt = _checkpoint(steps_after_send=1, send=True)
    assert ckpt["tokens_at_send"] == [20] and [r["key"] for r in ckpt["unseen"]["rounds"]] == ["f0.L2"]
    peer, outer, driver = _resume(ckpt)
    assert driver.tokens_at_send == [0] and set(driver.unseen.held) == {0}
    theta_ckpt = list(outer.theta(0))
    majority = _take(peer, outer, driver, {"0": ["f0.L2", ["me", "other"] if named else ["other"]]}, 0.3)
    assert driver.tokens_at_send == [20 if named else 0]
    assert not driver.unseen.held  # either way, the state's word settled it
    _check(peer, outer, majority, ckpt["x"], ckpt["snapshot"] if named else theta_ckpt)


def test_a_round_sent_after_the_checkpoint_that_counted_us_carried_all_the_progress_it_held() -> None:
    """The kill came after a send the checkpoint did not see: the state's θ was last made by a round whose key the
    checkpoint never sent, and it names us. That round's Δ held all the progress the checkpoint holds (and the
    steps after it, lost with the kill): the local model is that θ, and the checkpoint's tokens are counted."""
    ckpt = _checkpoint(steps_after_send=0, send=False)
    assert ckpt["unseen"] == {"rounds": [], "sent": {}}
    peer, outer, driver = _resume(ckpt)
    peer.step()  # a step taken after the resume (its warm-up) stays ours
    x = {n: v.clone() for n, v in peer.x.items()}
    majority = _take(peer, outer, driver, {"0": ["f0.L4", ["me", "other"]]}, 0.3)
    assert driver.tokens_at_send == [20] and not driver.unseen
    for i, n in enumerate(outer.fragments[0].names):  # θ + the resumed step's progress only
        want = majority[i].double() + (x[n].double() - ckpt["x"][n].double())
        assert torch.allclose(peer.x[n].double(), want, atol=1e-6), n


def test_a_known_round_named_in_the_state_leaves_the_checkpoints_progress_ours() -> None:
    """The state's θ was last made by a round the checkpoint already sent and held in its θ (not held: applied
    before the checkpoint): nothing of the checkpoint's progress is in it, all of it is kept."""
    ckpt = _checkpoint(steps_after_send=0, send=False)
    ckpt["unseen"]["sent"] = {"0": ["f0.L0"]}
    peer, outer, driver = _resume(ckpt)
    theta_ckpt = list(outer.theta(0))
    majority = _take(peer, outer, driver, {"0": ["f0.L0", ["me"]]}, 0.3)
    assert driver.tokens_at_send == [0]
    _check(peer, outer, majority, ckpt["x"], theta_ckpt)


def test_a_held_round_then_a_later_one_take_out_each_progress_once() -> None:
    """Bookkeeping alone: a held round named by a first state, then a round sent after the checkpoint named by a
    second; the second takes out what the checkpoint held beyond the first's Δ, so nothing is taken twice."""
    theta = [torch.zeros(2)]
    rounds = UnseenRounds()
    held = Unseen("f0.L2", theta, [torch.tensor([1.0, 2.0])], 20)
    since = Unseen("", theta, [torch.tensor([3.0, 5.0])], 30)
    rounds.resumed([(0, held)], {0: ["f0.L2"]}, {0: since})
    first = rounds.counted_in({"0": ["f0.L2", ["me"]]}, "me")
    assert first == {0: held} and set(rounds.since_checkpoint) == {0}
    assert rounds.counted_in({"0": ["f0.L2", ["me"]]}, "me") == {}  # the same word again: nothing more
    second = rounds.counted_in({"0": ["f0.L4", ["me", "x"]]}, "me")
    assert torch.equal(second[0].delta[0], torch.tensor([2.0, 3.0])) and second[0].after == 30
    assert not rounds
    rounds.resumed([], {}, {0: since})
    assert rounds.counted_in({"0": ["f0.L4", "me"]}, "me") == {} and rounds  # malformed: no word, still held
    assert rounds.counted_in({"0": ["f0.L4", ["other"]]}, "me") == {} and rounds  # not us: nothing taken out
