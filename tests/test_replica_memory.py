"""An applied round is freed once it is applied: the replica's log of applied rounds keeps their θ digests,
not the rounds (each holds several copies of its fragment). It used to keep every round of the run alive
through the digest's callback (about 1 MB a round with preset micro: bench/memory_growth.py)."""

from __future__ import annotations

import gc
import threading
import types
import weakref

import torch

from p2ptrain.algo.compress import Identity
from p2ptrain.algo.rounds import Round
from p2ptrain.peer.replica import ReplicaState
from p2ptrain.sync import theta_digest


def test_record_apply_does_not_keep_the_round_alive() -> None:
    theta = [torch.ones(1000)]
    outer = types.SimpleNamespace(theta=lambda f: theta, momentum=lambda f: [torch.zeros(1000)],
                                  round_state=lambda f: {})
    rep = ReplicaState(outer, None, [], threading.Lock(), lambda: [])  # type: ignore[arg-type]
    refs = []
    for i in range(3):
        rnd = Round(0, i, i, i + 1, [torch.zeros(1000)], [torch.zeros(1000)], 1.0, Identity(), name=f"f0.L{i}",
                    result=[torch.zeros(1000)])
        rep.record_apply(rnd)
        refs.append(weakref.ref(rnd))
        del rnd
    digests = [rep.applied_log[f"f0.L{i}"][0].result(timeout=10) for i in range(3)]
    assert digests == [theta_digest(theta)] * 3
    gc.collect()
    assert all(r() is None for r in refs), "an applied round is still alive"
