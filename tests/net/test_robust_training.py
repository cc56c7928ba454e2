"""Training through faults on the in-memory swarm: a peer sending scaled updates (centered clip holds,
the plain mean does not), and a partition of two regions that heals."""

from __future__ import annotations

import math
import threading
import time

import pytest

from p2ptrain.algo.methods import method_config
from p2ptrain.data import Corpus
from p2ptrain.net.guard import GuardConfig
from p2ptrain.net.memory import MemorySwarm

from .peers import Spec, SwarmRun, libp2p_transports, memory_transports, run_peers

METHOD = method_config("diloco", H=8, outer_lr=0.7, outer_momentum=0.5, codec="fp32", timeout=10)


def _run(corpus: Corpus, peers: int, aggregation: str, attacker: bool) -> tuple[SwarmRun, float]:
    swarm = MemorySwarm(join_window=0.5, ttl=3.0, guard=GuardConfig(aggregation=aggregation))
    if attacker:
        swarm.corrupt[f"peer{peers - 1}"] = "scale"  # ×100 every round
    run = run_peers(METHOD, [Spec(steps=64, delay=0.02)] * peers, corpus, memory_transports(swarm),
                    shared_loop=True)
    assert not run.errors, run.errors
    honest = run.results[0]
    assert honest is not None and honest.rounds_complete >= 4
    return run, run.peers[0].trainer.evaluate(honest.outer_params).loss


def _rounds_with_the_attacker(run: SwarmRun) -> int:
    """Rounds the first (honest) peer applied with the last peer's Δ in the average."""
    mark = run.peers[-1].peer_id[-4:]  # (the history keeps the contributors' last 4 characters)
    return sum(mark in contributors for _, contributors, _ in run.peers[0].history)


def _run_with_the_attacker(corpus: Corpus, aggregation: str) -> float:
    """θ's loss of a 5-peer run whose last peer scales its Δ, from a run whose rounds held it: on a loaded
    machine a late peer can miss every round of a short run, and a run without it tests nothing (one more run,
    not a weaker bound)."""
    for _ in range(2):
        run, loss = _run(corpus, 5, aggregation, attacker=True)
        if _rounds_with_the_attacker(run):
            break
    assert _rounds_with_the_attacker(run) >= 1, f"the attacker's Δ was in none of the {aggregation} rounds"
    return loss


def test_centered_clip_holds_one_scaled_peer_of_five_where_the_mean_does_not(corpus: Corpus) -> None:
    _, honest = _run(corpus, 4, "mean", attacker=False)
    clipped = _run_with_the_attacker(corpus, "centered-clip")
    plain = _run_with_the_attacker(corpus, "mean")
    assert clipped <= 1.05 * honest, (honest, clipped)
    assert not plain <= 1.05 * honest, (honest, plain)  # also when the mean turned θ into NaN
    assert math.isfinite(clipped)


@pytest.mark.parametrize("kind", ["memory", pytest.param("libp2p", marks=[pytest.mark.net, pytest.mark.timeout(180)])])
def test_a_partition_of_two_regions_reconverges_within_two_rounds_of_healing(corpus: Corpus, kind: str) -> None:
    """A 2 + 2 split waits (no quorum on either side) and the four agree again after healing. Rounds are judged by when every peer sent them, not by their logical step: a peer that fell
    behind the pacing (a loaded machine) sends the rounds of the steps it missed in a burst, later."""
    method = method_config("streaming", H=8, P=2, tau=2, codec="fp32", timeout=3)
    step = 0.03 if kind == "memory" else 0.05
    swarm = MemorySwarm(join_window=0.5, ttl=1.0)
    transports = memory_transports(swarm) if kind == "memory" else libp2p_transports("partition")
    sides = ([0, 1], [2, 3])
    times: dict[str, float] = {}
    box: dict[str, SwarmRun] = {}
    errors: list[BaseException] = []
    sent: list[dict[str, float]] = [{} for _ in range(4)]  # per peer: round key -> unix time it was sent

    def started(run: SwarmRun) -> None:
        box["run"] = run
        for i, p in enumerate(run.peers):
            sent[i] = p.replica.sent_at  # round key -> unix time this peer sent it

    def split(on: bool) -> None:
        if kind == "memory":
            swarm.partition(["peer0", "peer1"], ["peer2", "peer3"]) if on else swarm.heal()
            return
        peers = box["run"].peers
        for mine, other in (sides, sides[::-1]):
            for i in mine:
                blocked = {peers[j].peer_id for j in other} if on else set()
                peers[i].transport.blocked = blocked  # type: ignore[union-attr]

    def sent_by_all(after: float, before: float = math.inf) -> list[str]:
        keys = set.intersection(*(set(s) for s in sent)) & set.intersection(*(set(p.applied_log) for p in
                                                                              box["run"].peers))
        return sorted((k for k in keys if all(after < s[k] < before for s in sent)), key=lambda k: sent[0][k])

    def weather() -> None:
        # Split only once every peer has started and applied a joint round: a partition while peers are
        # still starting (their transports not made yet, or joining) is another test.
        deadline = time.time() + 60
        while time.time() < deadline and not ("run" in box and all(
                p.transport is not None and p.applied_log for p in box["run"].peers)):
            time.sleep(0.1)
        if time.time() >= deadline:
            raise TimeoutError("the peers did not all start and apply a joint round within 60 s")
        time.sleep(1.0)
        split(True)
        times["split"] = time.time()
        time.sleep(5.0)  # rounds in flight at the split end by their timeout (3 s) and the sides go on alone
        split(False)
        times["heal"] = time.time()
        # Train on until every fragment had four rounds sent by all after healing (however fast this
        # machine steps), at most 60 s.
        deadline = time.time() + 60
        while time.time() < deadline:
            frags = [k.split(".")[0] for k in sent_by_all(times["heal"])]
            if all(frags.count(f"f{f}") >= 4 for f in range(method.P)):
                break
            time.sleep(0.2)
        for p in box["run"].peers:
            p.request_stop()

    def weather_or_stop() -> None:
        try:
            weather()
        except BaseException as e:  # a failure here must end the run, not leave the peers training
            errors.append(e)
            for p in box["run"].peers if "run" in box else []:
                p.request_stop()
            raise

    t = threading.Thread(target=weather_or_stop, daemon=True)
    t.start()
    run = run_peers(method, [Spec(steps=100_000, delay=0.02)] * 4, corpus, transports, timeout=120,
                    shared_loop=kind == "memory", step_seconds=step, started=started)
    t.join(30)
    assert not errors and not run.errors, (errors, run.errors)
    logs = [p.applied_log for p in run.peers]
    # While split, rounds were sent but neither side holds more than half the swarm (net/groups.py's quorum): no
    # side applied one of its own, θ did not fork. A round whose group formed before the split may still end, on
    # more than half of the swarm alike (a member whose part was cut off by the split applies none and repairs).
    # Judged by the first send of each round: a round one peer sent after the split may have formed before it, from
    # the others' sends (a peer behind the pacing sends it late), and ended on the majority of its group (CI: 2 of
    # a group of 3 that formed before the split applied it, the fourth peer sent it 0.5 s into the split).
    first: dict[str, float] = {}
    for s in sent:
        for k, t in s.items():
            first[k] = min(t, first.get(k, math.inf))
    tried = {k for k, t in first.items() if times["split"] + 0.5 < t < times["heal"]}
    assert tried, (times, [sorted(s.values())[-3:] for s in sent])
    forked = sorted(k for k in tried if any(k in lg for lg in logs)
                    and not (2 * sum(k in lg for lg in logs) > len(logs)
                             and len({lg[k][0] for lg in logs if k in lg}) == 1))
    assert not forked, (forked, [[lg[k][0][:6] for lg in logs if k in lg] for k in forked])
    # After healing: per fragment, the first two rounds sent by all may still repair; from the third
    # on, every peer holds the same θ of that fragment.
    after = sent_by_all(times["heal"])
    for f in range(method.P):
        rounds = [k for k in after if k.startswith(f"f{f}.")]
        assert len(rounds) >= 3, (f, after)
        for k in rounds[2:]:
            assert len({lg[k][0] for lg in logs}) == 1, (k, [lg[k][0][:6] for lg in logs])
