"""The simulator's loss of the peers' mean model at the end (``final_mean_loss``): the loss of θ plus what each
peer holds that θ lacks. Where nothing is left unsent (diloco ending on a round) it is θ's loss; with error
feedback it is the mean of the peers' own models, checked against a float64 mean taken by hand."""

from __future__ import annotations

import math

import torch

from p2ptrain.algo.methods import method_config
from p2ptrain.data import Corpus, DataConfig
from p2ptrain.sim.runner import OuterRun, RunSpec, SimConfig, Simulator
from p2ptrain.trainer import TrainerConfig

from ..net.peers import MODEL

STEPS = 16


def _run(corpus: Corpus, name: str, **knobs: object) -> OuterRun:
    sim = Simulator(SimConfig(peers=3, steps=STEPS, step_time=0.1, bandwidth="10gbit", eval_every=10**6), MODEL,
                    TrainerConfig(batch_size=2, warmup_steps=2, total_steps=STEPS), DataConfig(), corpus)
    r = sim.runner(RunSpec(name, method_config(name, timeout=20, **knobs)))
    assert isinstance(r, OuterRun)
    r.run()
    return r


def test_diloco_ending_on_a_round_leaves_nothing_outside_theta(corpus: Corpus) -> None:
    r = _run(corpus, "diloco", H=8, codec="fp32")
    assert math.isfinite(r.res.final_mean_loss)
    assert abs(r.res.final_mean_loss - r.res.final_loss) < 1e-6
    assert r.res.to_dict()["final_mean_val_loss"] == r.res.final_mean_loss


def test_with_error_feedback_it_is_the_mean_of_the_peers_models(corpus: Corpus) -> None:
    r = _run(corpus, "streaming", H=8, P=2, tau=1, codec="topk2:0.03")
    names = list(r.outers[0].outer_params())
    by_peer = [dict(zip(names, tr.snapshot(names), strict=True)) for tr in r.trainers]
    theta = r.outers[0].outer_params()
    assert any(not torch.equal(p[n], theta[n]) for p in by_peer for n in names)  # the peers hold what θ lacks
    mean = {n: (sum(p[n].double() for p in by_peer) / len(by_peer)).float() for n in names}
    assert abs(r.res.final_mean_loss - float(r.trainers[0].evaluate(mean).loss)) < 1e-5
    assert abs(r.res.final_mean_loss - r.res.final_loss) > 1e-6
