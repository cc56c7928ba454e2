"""``p2ptrain train``: one peer, local, no network — the baseline every method is compared with."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .checkpoint import CheckpointDir, NonFiniteState
from .data import DataConfig
from .model import ModelConfig
from .trainer import StepStats, Trainer, TrainerConfig, make_trainer

__all__ = ["TrainJob", "TrainSummary", "run_train"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class TrainJob:
    """A local training run.

    Attributes:
        model: architecture (a preset with overrides).
        trainer: inner optimizer settings.
        data: corpus and stream settings.
        steps: total inner steps of the run (a resumed run stops at the same total).
        eval_every: inner steps between validation evaluations (0: only at the end).
        checkpoint_dir: where checkpoints go (None: no checkpoints).
        checkpoint_every: inner steps between checkpoints (the last step always saves).
        keep_checkpoints: how many checkpoints to keep.
        resume: continue from the newest checkpoint in ``checkpoint_dir``.
    """

    model: ModelConfig
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    steps: int = 300
    eval_every: int = 100
    checkpoint_dir: str | None = None
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    resume: bool = False

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")
        if self.eval_every < 0 or self.checkpoint_every < 1:
            raise ValueError("eval_every must be >= 0 and checkpoint_every >= 1")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir")


@dataclass
class TrainSummary:
    start_step: int
    steps: int
    initial_val_loss: float
    final_val_loss: float
    final_train_loss: float
    tokens: int
    seconds: float
    checkpoint: str | None
    evals: list[tuple[int, float]] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def run_train(job: TrainJob, *, on_step: Callable[[StepStats], None] | None = None,
              on_eval: Callable[[int, float], None] | None = None,
              trainer: Trainer | None = None) -> TrainSummary:
    """Train one peer for ``job.steps`` inner steps; checkpoint and evaluate on the way."""
    tr = trainer or make_trainer(job.model, job.trainer, job.data)
    ckpt = CheckpointDir(job.checkpoint_dir, keep=job.keep_checkpoints) if job.checkpoint_dir else None
    if ckpt is not None and (stale := ckpt.remove_temporaries()):  # left by writes that were killed half-way
        log.info("event=checkpoint_temporaries_removed count=%d dir=%s", stale, job.checkpoint_dir)
    if job.resume and ckpt is not None:
        found = ckpt.latest()
        if found is None:
            log.warning("event=resume status=none dir=%s (starting fresh)", job.checkpoint_dir)
        else:
            path, state = found
            tr.load_state_dict(state["trainer"])
            log.info("event=resume path=%s step=%d", path, tr.step_count)
    start = tr.step_count
    initial = tr.evaluate().loss
    evals = [(start, initial)]
    if on_eval:
        on_eval(start, initial)
    last: StepStats | None = None
    saved: Path | None = None
    tokens, t0 = 0, time.perf_counter()
    while tr.step_count < job.steps:
        last = tr.step()
        tokens += last.tokens
        if on_step:
            on_step(last)
        step = tr.step_count
        if job.eval_every and step % job.eval_every == 0 and step < job.steps:
            loss = tr.evaluate().loss
            evals.append((step, loss))
            if on_eval:
                on_eval(step, loss)
        if ckpt is not None and (step % job.checkpoint_every == 0 or step == job.steps):
            try:
                saved = ckpt.save(step, state_of(tr))
            except NonFiniteState as e:  # diverged: keep the good checkpoints, say so, and carry on
                log.error("event=checkpoint_refused step=%d reason=%s", step, e)
    seconds = time.perf_counter() - t0
    final = tr.evaluate().loss
    evals.append((tr.step_count, final))
    if on_eval:
        on_eval(tr.step_count, final)
    return TrainSummary(start, tr.step_count - start, initial, final,
                        last.loss if last else float("nan"), tokens, seconds,
                        str(saved) if saved else None, evals)


def state_of(tr: Trainer) -> dict[str, Any]:
    return {"kind": "train", "trainer": tr.state_dict()}
