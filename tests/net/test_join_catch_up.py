"""A joiner trains through its warm-up on the state it downloaded at start, without waiting there for the rounds its
source had in flight: it takes the swarm's state again after its warm-up (with its progress), and catches up on
those rounds then, taking inner steps while they are not applied yet. In churn, the wait at start held joiners idle
for up to 42 s before their first inner step."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from p2ptrain.algo.methods import method_config
from p2ptrain.data import Corpus
from p2ptrain.net.memory import MemorySwarm
from p2ptrain.peer.base import PeerBase
from p2ptrain.peer.replica import ReplicaState

from .peers import Spec, memory_transports, run_peers


def test_a_joiner_waits_for_its_sources_rounds_after_its_warmup_not_at_start(
        corpus: Corpus, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    starting = threading.local()
    calls: list[tuple[int, bool]] = []  # (id of the replica, whether inside PeerBase.start)
    trains: list[bool] = []  # whether the catch-up was given an inner step to take while it waits
    start, catch_up = PeerBase.start, ReplicaState.catch_up

    def recorded_start(self: PeerBase) -> None:
        starting.on = True
        try:
            start(self)
        finally:
            starting.on = False

    def recorded_catch_up(self: ReplicaState, *args: Any, **kwargs: Any) -> None:
        calls.append((id(self), getattr(starting, "on", False)))
        trains.append(kwargs.get("idle") is not None)
        catch_up(self, *args, **kwargs)

    monkeypatch.setattr(PeerBase, "start", recorded_start)
    monkeypatch.setattr(ReplicaState, "catch_up", recorded_catch_up)
    caplog.set_level(logging.INFO, logger="p2ptrain.peer.outer")
    # The first two live long enough (0.1 s a step) for the joiner's re-sync after its warm-up to find a source on a
    # loaded machine; whether it then shares rounds with them is test_swarm_libp2p.py's late joiner's to check.
    specs = [Spec(steps=80, delay=0.1)] * 2 + [Spec(steps=20, delay=0.02, start_when=lambda run: all(
        p.applied > 0 for p in run.peers[:2]))]
    run = run_peers(method_config("streaming", H=8, P=2, tau=2, codec="fp32", timeout=10), specs, corpus,
                    memory_transports(MemorySwarm(join_window=10.0, ttl=3.0)), shared_loop=True, clock="steps",
                    warmup=1.0, timeout=240)
    assert not run.errors, run.errors
    joiner = run.peers[2]
    assert joiner.synced_from is not None  # it took the swarm's state at start (and again after its warm-up)
    assert not [c for c in calls if c[1]], calls  # no peer waited for rounds in flight inside its start
    assert any(c == (id(joiner.replica), False) for c in calls), calls  # the joiner did, after its warm-up
    assert trains and all(trains), trains  # keeping its progress, training while the source's rounds end
    assert any("event=catch_up_deferred" in r.getMessage() for r in caplog.records)
    assert run.results[2] is not None and run.results[2].steps >= 20
