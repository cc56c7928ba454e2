from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from p2ptrain.checkpoint import read_checkpoint, write_checkpoint
from p2ptrain.data import Corpus, DataConfig
from p2ptrain.model import ModelConfig
from p2ptrain.trainer import TrainerConfig, lr_at, make_trainer

SMALL = ModelConfig(d_model=32, n_layers=2, n_heads=2, seq_len=32)


def test_lr_schedule_hand_computed() -> None:
    cfg = TrainerConfig(lr=1.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.25)
    assert lr_at(3, cfg) == pytest.approx(1.0)
    assert lr_at(4, cfg) == pytest.approx(1.0)  # cosine starts at the peak
    assert lr_at(9, cfg) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(14, cfg) == pytest.approx(0.1) and lr_at(100, cfg) == pytest.approx(0.1)


def test_bad_trainer_config() -> None:
    with pytest.raises(ValueError, match="lr"):
        TrainerConfig(lr=0)
    with pytest.raises(ValueError, match="grad_accum"):
        TrainerConfig(grad_accum=0)


def test_training_lowers_loss(corpus: Corpus) -> None:
    tr = make_trainer(SMALL, TrainerConfig(lr=3e-3, warmup_steps=5, total_steps=40, batch_size=8), DataConfig(),
                      corpus=corpus)
    before = tr.evaluate().loss
    for _ in range(40):
        tr.step()
    assert tr.evaluate().loss < before - 1.0


def test_resume_gives_identical_state(tmp_path: Path, corpus: Corpus) -> None:
    cfg = TrainerConfig(lr=3e-3, warmup_steps=2, total_steps=8, batch_size=4, grad_accum=2)
    ref = make_trainer(SMALL, cfg, DataConfig(), corpus=corpus)
    for _ in range(6):
        ref.step()

    a = make_trainer(SMALL, cfg, DataConfig(), corpus=corpus)
    for _ in range(3):
        a.step()
    write_checkpoint(tmp_path / "c.safetensors", a.state_dict())
    b = make_trainer(SMALL, cfg, DataConfig(), corpus=corpus)
    b.load_state_dict(read_checkpoint(tmp_path / "c.safetensors"))
    assert b.step_count == 3 and b.tokens_seen == a.tokens_seen
    for _ in range(3):
        b.step()
    for n, p in ref.model.named_parameters():
        assert torch.equal(p, dict(b.model.named_parameters())[n]), n
    sa, sb = ref.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    for k in sa:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa[k][key], sb[k][key])


def test_resume_rejects_other_architecture(tmp_path: Path, corpus: Corpus) -> None:
    a = make_trainer(SMALL, TrainerConfig(batch_size=2), DataConfig(), corpus=corpus)
    other = ModelConfig(d_model=32, n_layers=3, n_heads=2, seq_len=32)
    b = make_trainer(other, TrainerConfig(batch_size=2), DataConfig(), corpus=corpus)
    with pytest.raises(ValueError, match="different model architecture"):
        b.load_state_dict(a.state_dict())


def test_snapshot_and_apply_outer(corpus: Corpus) -> None:
    tr = make_trainer(SMALL, TrainerConfig(batch_size=2), DataConfig(), corpus=corpus)
    names = ["blocks.0.attn.qkv.weight", "norm.weight"]
    snap = tr.snapshot(names)
    tr.step()
    assert not torch.equal(snap[0], tr.params[names[0]])  # a copy, not a view
    tr.apply_outer(names, snap)
    assert torch.equal(tr.params[names[0]], snap[0])
    with pytest.raises(ValueError, match="shape"):
        tr.apply_outer(names, [snap[1], snap[0]])


def test_evaluate_outer_params_matches_live(corpus: Corpus) -> None:
    tr = make_trainer(SMALL, TrainerConfig(batch_size=2, eval_batches=2), DataConfig(), corpus=corpus)
    live = tr.evaluate().loss
    params = {n: p.detach().clone() for n, p in tr.params.items()}
    assert tr.evaluate(params).loss == pytest.approx(live, rel=1e-6)
    params["norm.weight"].mul_(0.0)
    assert tr.evaluate(params).loss != pytest.approx(live, rel=1e-3)
