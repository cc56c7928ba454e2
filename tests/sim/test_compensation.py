"""The compensation instrument (a short run of what bench/compensation.py runs long)."""

from __future__ import annotations

import pytest

from p2ptrain.algo.methods import method_config
from p2ptrain.data import Corpus, DataConfig
from p2ptrain.sim.compensation import CANDIDATES, probe_run, summarize
from p2ptrain.sim.runner import SimConfig
from p2ptrain.trainer import TrainerConfig

from ..net.peers import MODEL

RULES = {k: CANDIDATES[k] for k in ("take", "alpha", "delta", "taylor-adam-1")}


def _run(corpus: Corpus, peers: int, **knobs: float) -> list:
    method = method_config("cocodc", H=8, P=2, tau=3, lambda0=0.0, sends_per_window=2, late="stall", codec="fp32",
                           **knobs)
    sim = SimConfig(peers=peers, steps=32, step_time=0.1, eval_every=10**6)
    _, probes = probe_run(sim, MODEL, TrainerConfig(batch_size=2, warmup_steps=2, total_steps=32), DataConfig(),
                          corpus, method, RULES)
    return probes


def test_the_replay_is_the_run_itself_when_the_outer_step_lands_on_the_snapshot(corpus: Corpus) -> None:
    """One peer, outer SGD with lr 1 and no momentum: θ̃ = s, so the overlap replayed from θ̃ is the overlap
    that happened (same batches, AdamW state and writes to the other fragment): the delta rule (keep the
    progress) is the ideal, to float32 rounding."""
    probes = _run(corpus, 1, outer_lr=1.0, outer_momentum=0.0)
    assert len(probes) >= 6 and all(p.steps == 3 for p in probes)  # τ = 3, stalling: exactly 3 steps each
    for p in probes:
        assert p.distance["take"] == pytest.approx(1.0)
        assert p.distance["delta"] < 1e-3, p.distance


def test_every_rule_is_measured_against_the_ideal_on_a_swarm(corpus: Corpus) -> None:
    probes = _run(corpus, 2)
    summary = summarize(probes)
    assert set(summary) == set(RULES) and summary["take"]["distance_median"] == pytest.approx(1.0)
    assert summary["delta"]["distance_median"] < summary["take"]["distance_median"]  # progress is worth keeping
    assert all(p.delay_norm > 0 and p.progress_norm > 0 for p in probes)
    assert -1.0 <= summary["taylor-adam-1"]["cosine_median"] <= 1.0
