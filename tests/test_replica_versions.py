"""θ before a round stays available to a divergent member for as long as the round is in flight or among the
newest applied of its fragment, however many rounds of that fragment fail meanwhile (a swarm without a quorum
fails one every step: a member that applied late once found the others' ``before:KEY`` pruned and applied a θ it
knew was divergent)."""

from __future__ import annotations

import threading
import time
import types

import torch

from p2ptrain.algo.compress import Identity
from p2ptrain.algo.rounds import Round, RoundState
from p2ptrain.checkpoint import state_from_bytes
from p2ptrain.peer.replica import ReplicaState, one_at_a_time


def _round(i: int, theta: list[torch.Tensor]) -> Round:
    return Round(0, i, i, i + 1, [torch.zeros(3)], [torch.zeros(3)], 1.0, Identity(), name=f"f0.L{i}",
                 state=RoundState.AVERAGING, theta=theta)


def test_before_of_an_applied_round_outlives_failed_rounds() -> None:
    theta = [torch.zeros(3)]
    outer = types.SimpleNamespace(theta=lambda f: theta, momentum=lambda f: [torch.zeros(3)],
                                  round_state=lambda f: {})
    flying: list[Round] = []
    rep = ReplicaState(outer, None, [], threading.Lock(), lambda: flying, keep=2)  # type: ignore[arg-type]
    try:
        first = _round(0, [torch.full((3,), 7.0)])
        flying.append(first)
        rep.record_send(first)
        first.state = RoundState.APPLIED
        flying.remove(first)
        rep.record_apply(first)
        for i in range(1, 12):  # eleven rounds of the same fragment sent and failed
            rnd = _round(i, [torch.full((3,), float(i))])
            flying.append(rnd)
            rep.record_send(rnd)
            assert rep.provide(f"before:f0.L{i}") is not None  # in flight: served
            rnd.abort()
            flying.remove(rnd)
        raw = rep.provide("before:f0.L0")
        assert raw is not None, "θ before the applied round was pruned by failed rounds"
        assert torch.equal(state_from_bytes(raw, "before")["theta"][0], torch.full((3,), 7.0))
        assert rep.provide("before:f0.L5") is None  # a failed round's θ is dropped
        for i in (20, 21):  # two newer applied rounds of the fragment: the first is now out of the keep window
            rnd = _round(i, [torch.zeros(3)])
            flying.append(rnd)
            rep.record_send(rnd)
            rnd.state = RoundState.APPLIED
            flying.remove(rnd)
            rep.record_apply(rnd)
        assert rep.provide("before:f0.L0") is None
        assert rep.provide("before:f0.L20") is not None and rep.provide("before:f0.L21") is not None
        assert len(rep.before) == 2
    finally:
        rep.close()


def test_a_repair_takes_only_the_theta_the_majority_holds() -> None:
    """A divergent member asks the round's contributors for θ before the round; a contributor may itself be on
    another θ (its cell lost the vote across regions) or lie. Only a θ whose fingerprint is the round's
    ``agreed`` is taken; none: no repair (the driver then does not apply the round)."""
    from p2ptrain.checkpoint import state_to_bytes
    from p2ptrain.net.groups import versioned
    from p2ptrain.sync import fingerprint

    good, bad, mine = [torch.arange(6.0)], [torch.arange(6.0) + 1], [torch.zeros(6)]
    taken: list[list[torch.Tensor]] = []
    outer = types.SimpleNamespace(theta=lambda f: mine, momentum=lambda f: [torch.zeros(6)], round_state=lambda f: {},
                                  overwrite=lambda f, th, mo, version: taken.append([*th, version]))
    params = types.SimpleNamespace(apply_outer=lambda names, theta: None)
    frags = [types.SimpleNamespace(names=["w"], index=0)]
    rep = ReplicaState(outer, params, frags, threading.Lock(), list)  # type: ignore[arg-type]
    served = {"lier": bad, "honest": good}
    asked: list[str] = []

    def fetch(peer: str, name: str) -> bytes:
        asked.append(peer)
        return state_to_bytes({"theta": served[peer], "momentum": [torch.zeros(6)], "version": 40})

    try:
        rnd = _round(3, mine)
        # (prints lead with θ's version, which never decides a match: net/groups.py versioned)
        agreed = tuple(versioned(40, fingerprint(good)))
        rnd.contributors, rnd.divergent, rnd.agreed = ("lier", "me", "honest"), True, agreed
        assert rep.repair(rnd, "me", one_at_a_time(fetch))
        assert asked == ["lier", "honest"] and len(taken) == 1 and torch.equal(taken[0][0], good[0])
        assert taken[0][1] == 40  # the version of the θ taken, with it
        rnd.contributors = ("lier", "me")
        assert not rep.repair(rnd, "me", one_at_a_time(fetch)) and len(taken) == 1  # nobody holds the majority's θ: none taken
        rnd.agreed = None  # a round without fingerprints (none was sent): the first that answers, as before
        assert rep.repair(rnd, "me", one_at_a_time(fetch)) and torch.equal(taken[-1][0], bad[0])
    finally:
        rep.close()


def test_a_replica_behind_its_sources_rounds_serves_no_outer_state_until_it_applies_them() -> None:
    """A joiner in its warm-up holds θ without the rounds its source had in flight (peer/outer.py defers that
    catch-up): its ``outer`` state would not name them as pending, so it serves none until every such fragment has
    applied a round of its own (or caught up)."""
    theta = [torch.zeros(3)]
    outer = types.SimpleNamespace(theta=lambda f: theta, momentum=lambda f: [torch.zeros(3)],
                                  round_state=lambda f: {}, initialized=True,
                                  shared_state=lambda: {"theta": [theta, theta]})
    frags = [types.SimpleNamespace(index=0), types.SimpleNamespace(index=1)]
    flying: list[Round] = []
    rep = ReplicaState(outer, None, frags, threading.Lock(), lambda: flying, keep=2)  # type: ignore[arg-type]
    try:
        assert rep.provide("outer") is not None
        rep.behind = {0, 1}
        assert rep.provide("outer") is None
        rnd = _round(3, theta)
        rep.record_send(rnd)
        rnd.state = RoundState.APPLIED
        rep.record_apply(rnd)  # fragment 0 applied a round: fragment 1 is still behind
        assert rep.behind == {1} and rep.provide("outer") is None
        rep.catch_up("src", [], False, lambda peer, name: b"", deadline=0.0, poll=0.0)
        assert not rep.behind and rep.provide("outer") is not None
    finally:
        rep.close()


def test_a_catch_up_that_keeps_progress_trains_between_its_asks() -> None:
    """While the source has not applied its round yet, a peer that keeps its progress runs ``idle`` (an inner step)
    instead of sleeping; that progress is rebased onto θ after the round. Without ``keep_progress`` (θ is taken
    as it is) it only waits."""
    from p2ptrain.checkpoint import state_to_bytes
    from p2ptrain.net.transport import RoundFailed as NotYet

    names = ["w"]
    local = {"w": torch.full((3,), 1.5)}  # θ 1.0 plus progress 0.5
    theta = [torch.full((3,), 1.0)]
    outer = types.SimpleNamespace(theta=lambda f: list(theta), momentum=lambda f: [torch.zeros(3)],
                                  round_state=lambda f: {}, take_round_state=lambda f, st: None)

    def overwrite(f: int, th: list[torch.Tensor], mom: list[torch.Tensor]) -> None:
        theta[0] = th[0].clone()

    outer.overwrite = overwrite
    params = types.SimpleNamespace(snapshot=lambda ns: [local[n].clone() for n in ns],
                                   apply_outer=lambda ns, vals: local.update(zip(ns, vals, strict=True)))
    frags = [types.SimpleNamespace(index=0, names=names)]
    asks: list[str] = []

    def fetch(peer: str, name: str) -> bytes:
        asks.append(name)
        if len(asks) < 3:
            raise NotYet("not applied yet")
        return state_to_bytes({"theta": [torch.full((3,), 4.0)], "momentum": [torch.zeros(3)]})

    steps: list[int] = []

    def idle() -> None:  # an inner step: 0.25 more progress
        steps.append(1)
        local["w"] = local["w"] + 0.25

    rep = ReplicaState(outer, params, frags, threading.Lock(), lambda: [], keep=2)  # type: ignore[arg-type]
    try:
        rep.catch_up("src", [[0, "f0.L8"]], True, fetch, deadline=1e18, poll=10.0, idle=idle)
        assert asks == ["after:f0.L8"] * 3 and len(steps) == 2  # two asks too early: two steps, no 10 s sleeps
        assert torch.equal(theta[0], torch.full((3,), 4.0))
        assert torch.equal(local["w"], torch.full((3,), 4.0 + 0.5 + 0.5))  # θ after the round, plus all progress
        asks.clear()
        steps.clear()
        rep.catch_up("src", [[0, "f0.L9"]], False, fetch, deadline=1e18, poll=0.0, idle=idle)
        assert len(asks) == 3 and not steps  # θ taken as it is: no progress to keep, so no steps
    finally:
        rep.close()


def test_theta_before_a_round_says_which_round_made_it_and_whom_that_round_counted() -> None:
    """A member that saw round R1 fail may be in its average all the same (its cell's mean crossed); it learns so
    when its next round's repair takes θ before R2 from a contributor: that θ names R1 as the round last in it,
    with R1's contributors, but only while it is the very θ R1 made (θ replaced since, by a repair or a state
    taken, it says nothing). The repairing member marks R2 ``held_round`` only if those contributors name it."""
    from p2ptrain.checkpoint import state_to_bytes

    current = [[torch.zeros(3)]]
    outer = types.SimpleNamespace(theta=lambda f: current[0], momentum=lambda f: [torch.zeros(3)],
                                  round_state=lambda f: {}, overwrite=lambda f, th, mo, version: None)
    params = types.SimpleNamespace(apply_outer=lambda names, theta: None)
    frags = [types.SimpleNamespace(names=["w"], index=0)]
    flying: list[Round] = []
    source = ReplicaState(outer, params, frags, threading.Lock(), lambda: flying)  # type: ignore[arg-type]
    taker = ReplicaState(outer, params, frags, threading.Lock(), list)  # type: ignore[arg-type]

    def exchange(r2: Round, me: str) -> str:
        """R2 sent at the source; ``me`` repairs R2 from it: the round ``me`` is told holds its Δ."""
        flying.append(r2)
        source.record_send(r2)
        raw = source.provide(f"before:{r2.key}")
        assert raw is not None
        mine = _round(r2.seq, [torch.ones(3)])
        mine.contributors, mine.divergent = ("src",), True
        assert taker.repair(mine, me, one_at_a_time(lambda peer, name: raw))
        flying.remove(r2)
        return mine.held_round

    try:
        r1 = _round(1, current[0])
        r1.contributors = ("me", "src")
        current[0] = [torch.full((3,), 2.0)]  # R1's outer step made a new θ
        source.record_apply(r1)
        assert exchange(_round(2, current[0]), "me") == "f0.L1"
        assert exchange(_round(3, current[0]), "other") == ""  # R1 did not count "other"
        current[0] = [torch.full((3,), 2.0)]  # the same values, another θ: replaced since R1 (a state taken)
        assert exchange(_round(4, current[0]), "me") == ""
        r2 = _round(5, current[0])
        raw = state_to_bytes({"theta": [torch.ones(3)], "momentum": [torch.zeros(3)], "version": 5,
                              "made": ["f0.L1", "me"]})  # malformed (a string, not a list of peers): ignored
        r2.contributors, r2.divergent = ("src",), True
        assert taker.repair(r2, "me", one_at_a_time(lambda peer, name: raw)) and r2.held_round == ""
    finally:
        source.close()
        taker.close()


def test_a_repair_trains_while_it_fetches_and_reads_the_progress_right_before_it_takes_theta() -> None:
    """With ``idle`` (an inner step), the fetch runs on a thread of its own while this one trains: a source that
    times out (a peer across a region cut) costs no idle time. ``taking`` runs once θ has come, before it is
    taken; no source serving θ: False, nothing taken."""
    from p2ptrain.checkpoint import state_to_bytes

    good, mine = [torch.arange(6.0)], [torch.zeros(6)]
    order: list[str] = []
    outer = types.SimpleNamespace(theta=lambda f: mine, momentum=lambda f: [torch.zeros(6)], round_state=lambda f: {},
                                  overwrite=lambda f, th, mo, version: order.append("overwrite"))
    params = types.SimpleNamespace(apply_outer=lambda names, theta: order.append("apply"))
    frags = [types.SimpleNamespace(names=["w"], index=0)]
    rep = ReplicaState(outer, params, frags, threading.Lock(), list)  # type: ignore[arg-type]
    trainer = threading.current_thread()
    fetched_on: list[threading.Thread] = []

    def fetch(peer: str, name: str) -> bytes:
        fetched_on.append(threading.current_thread())
        time.sleep(0.3)  # a slow source
        if peer == "cut":
            raise TimeoutError("across the cut")
        return state_to_bytes({"theta": good, "momentum": [torch.zeros(6)], "version": 3})

    def idle() -> None:
        assert threading.current_thread() is trainer
        order.append("step")
        time.sleep(0.05)

    try:
        rnd = _round(3, mine)
        rnd.contributors, rnd.divergent = ("cut", "me", "honest"), True
        assert rep.repair(rnd, "me", one_at_a_time(fetch), lambda: order.append("taking"), idle)
        assert fetched_on and all(t is not trainer for t in fetched_on)
        steps = order.index("taking")
        assert steps >= 4 and set(order[:steps]) == {"step"}  # it trained through both fetches (0.6 s)
        assert order[steps:] == ["taking", "overwrite", "apply"]
        order.clear()
        rnd.contributors = ("cut", "me")
        assert not rep.repair(rnd, "me", one_at_a_time(fetch), lambda: order.append("taking"), idle)
        assert "taking" not in order and "overwrite" not in order and "step" in order
    finally:
        rep.close()
