"""The inner loop of one pipeline stage: micro-batches through ``torch.distributed.pipelining``.

A peer of S pipeline stages is S processes (one GPU each, or CPU), joined by a
``torch.distributed`` process group (nccl on GPU, gloo on CPU). Stage r holds the
slice of the model given by the run's :class:`~p2ptrain.stages.StagePlan`, its own
AdamW over its own parameters only (DiLoCoX's dual optimizer policy, arXiv
2506.21263: no process holds the whole model or the whole inner state), and runs
each inner step as a 1F1B (or GPipe) schedule of M micro-batches. The loss is on
the last stage; the loss function divides by M·grad_accum and the schedule does
not rescale, so the gradients are those of the unsplit model's mean loss.

After the backward pass the stages make one small all-reduce of
``[Σ‖g‖², loss, stop]``: gradient clipping uses the global norm (as
``clip_grad_norm_`` on the unsplit model), every stage learns the step's loss, and
a leave request seen by any stage stops all of them after the same step (the
stages are one pipeline and step in lockstep). Every collective has the process
group's timeout, so a crashed stage makes the others fail instead of hang.
"""

from __future__ import annotations

import datetime
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .data import Corpus, DataConfig, TokenStream
from .model import GPT, ModelConfig
from .stages import StageModel, StagePlan
from .trainer import EvalStats, StepStats, Trainer, TrainerConfig

__all__ = ["PipelineConfig", "PipelineTrainer", "StageEnv", "init_stage_group", "make_stage_trainer", "stage_device",
           "stage_env"]


@dataclass(kw_only=True)
class PipelineConfig:
    """How one peer's inner step runs across its pipeline stages.

    Attributes:
        stages: S, pipeline processes of this peer (one device each).
        microbatches: M, micro-batches per batch (the batch size must be a multiple of M);
            0 takes S (1F1B needs M ≥ S).
        schedule: ``1f1b`` (one forward, one backward in steady state: activations of ≤ S
            micro-batches alive) or ``gpipe`` (all forwards, then all backwards).
        timeout: seconds any collective may wait (a dead stage fails the others after it).
    """

    stages: int = 2
    microbatches: int = 0
    schedule: Literal["1f1b", "gpipe"] = "1f1b"
    timeout: float = 300.0

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise ValueError(f"pipeline: the number of stages S must be at least 1, got {self.stages}")
        if self.microbatches == 0:
            self.microbatches = self.stages
        if self.microbatches < 1:
            raise ValueError(f"pipeline: micro-batches M must be at least 1, got {self.microbatches}")
        if self.schedule not in ("1f1b", "gpipe"):
            raise ValueError(f"pipeline: schedule must be '1f1b' or 'gpipe', got {self.schedule!r}")
        if self.schedule == "1f1b" and self.microbatches < self.stages:
            raise ValueError(f"pipeline: 1F1B needs micro-batches M ≥ stages S (M={self.microbatches}, "
                             f"S={self.stages}); raise --micro-batches or use --pipeline-schedule gpipe")
        if self.timeout <= 0:
            raise ValueError("pipeline: timeout must be positive")


@dataclass(frozen=True)
class StageEnv:
    """Where this process sits in its peer's pipeline (read from the launcher's or torchrun's env)."""

    rank: int
    world: int
    local_rank: int
    master_addr: str
    master_port: int


def stage_env() -> StageEnv | None:
    """The pipeline place from ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``
    (set by ``p2ptrain join --pipeline-stages`` or torchrun); None when they are not set."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        port = int(os.environ.get("MASTER_PORT", "29500"))
    except ValueError as e:
        raise ValueError(f"pipeline environment: {e}") from None
    if not 0 <= rank < world:
        raise ValueError(f"pipeline environment: RANK={rank} is not in [0, WORLD_SIZE={world})")
    return StageEnv(rank, world, local, os.environ.get("MASTER_ADDR", "127.0.0.1"), port)


def init_stage_group(env: StageEnv, device: torch.device, timeout: float) -> None:
    """Join the peer's process group: nccl when the stage runs on CUDA, gloo otherwise (every collective
    fails after ``timeout`` seconds instead of waiting for a dead stage forever)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # env:// uses torchrun's own store when torchrun started us, else MASTER_ADDR/MASTER_PORT.
    os.environ.setdefault("MASTER_ADDR", env.master_addr)
    os.environ.setdefault("MASTER_PORT", str(env.master_port))
    dist.init_process_group(backend, init_method="env://", rank=env.rank, world_size=env.world,
                            timeout=datetime.timedelta(seconds=timeout))


def stage_device(name: str, local_rank: int) -> torch.device:
    """The stage's device: ``auto`` is GPU ``local_rank`` when CUDA is there, else the CPU."""
    if name == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} requested but CUDA is not available")
        if dev.index is None:
            dev = torch.device(f"cuda:{local_rank}")
    return dev


class PipelineTrainer(Trainer):
    """One pipeline stage's model slice, inner AdamW and data stream (a :class:`Trainer` for the outer loop).

    Every stage reads the same data stream (same seed and rank), so they agree on the step's tokens; the
    first stage feeds the token ids, the last computes the loss against the targets. ``step()`` and
    ``evaluate()`` are collectives: every stage of the peer calls them in the same order.
    """

    def __init__(self, model: StageModel, cfg: TrainerConfig, pipe: PipelineConfig, stream: TokenStream,
                 val_set: Sequence[tuple[torch.Tensor, torch.Tensor]], *, rank: int, world: int,
                 device: torch.device) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        if world != pipe.stages:
            raise ValueError(f"pipeline: {world} processes for S={pipe.stages} stages")
        if cfg.batch_size % pipe.microbatches:
            raise ValueError(f"pipeline: the batch size ({cfg.batch_size}) must be a multiple of the "
                             f"micro-batches M ({pipe.microbatches})")
        if not dist.is_initialized():
            raise RuntimeError("pipeline: join the process group first (init_stage_group)")
        super().__init__(model, replace(cfg, device=str(device)), stream, val_set)  # type: ignore[arg-type]
        self.model: StageModel = model  # type: ignore[assignment]
        self.pipe, self.rank, self.world = pipe, rank, world
        self.comm_device = device if device.type == "cuda" else torch.device("cpu")
        self._ce: list[torch.Tensor] = []
        self.stage = PipelineStage(self.model, rank, world, self.device)
        schedule = Schedule1F1B if pipe.schedule == "1f1b" else ScheduleGPipe
        self.schedule = schedule(self.stage, n_microbatches=pipe.microbatches, loss_fn=self._loss_fn,
                                 scale_grads=False)
        self.stop_agreed = False
        self.last_loss = math.nan

    def _loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        self._ce.append(ce.detach())
        return ce / (self.pipe.microbatches * self.cfg.grad_accum)

    def _batch_loss(self) -> float:
        # The last M calls are the batch's micro-batches (the stage's first step also runs the loss once
        # on its shape-inference placeholder).
        if not self.model.is_last:
            return 0.0
        return float(torch.stack(self._ce[-self.pipe.microbatches:]).mean())

    # -- inner steps ---------------------------------------------------------------
    def forward_backward_batch(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One batch through the schedule (forward and backward, gradients accumulated); the last
        stage returns the batch's mean loss, the others 0."""
        self._ce = []
        with self._autocast():
            if self.model.is_first:
                self.schedule.step(x.to(self.device, non_blocking=True))
            elif self.model.is_last:
                self.schedule.step(target=y.to(self.device, non_blocking=True))
            else:
                self.schedule.step()
        return self._batch_loss()

    def forward_backward(self) -> tuple[float, int]:
        total, tokens = 0.0, 0
        for _ in range(self.cfg.grad_accum):
            x, y = self.stream.next_batch()
            total += self.forward_backward_batch(x, y)
            tokens += x.numel()
        return total / self.cfg.grad_accum, tokens

    def optimizer_step(self, loss: float = 0.0, stop: bool = False) -> tuple[float, float]:  # type: ignore[override]
        """Agree on the global gradient norm, the loss and the stop flag; clip, step AdamW, clear grads."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        sq = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum().double() if grads else \
            torch.zeros((), dtype=torch.float64)
        stats = torch.stack([sq.to(self.comm_device), torch.tensor(loss, dtype=torch.float64, device=self.comm_device),
                             torch.tensor(float(stop), dtype=torch.float64, device=self.comm_device)])
        dist.all_reduce(stats)
        norm = math.sqrt(float(stats[0]))
        self.last_loss = float(stats[1])
        self.stop_agreed = float(stats[2]) > 0
        if self.cfg.grad_clip > 0:
            coef = self.cfg.grad_clip / (norm + 1e-6)  # as clip_grad_norm_, over every stage's gradients
            if coef < 1:
                for g in grads:
                    g.mul_(coef)
        return self._adamw_step(), norm

    def step(self, stop: bool = False) -> StepStats:  # type: ignore[override]
        """One inner step of the whole pipeline; ``stop`` asks every stage to leave after it
        (read the agreement from :attr:`stop_agreed`)."""
        t0 = time.perf_counter()
        self.model.train()
        loss, tokens = self.forward_backward()
        lr, norm = self.optimizer_step(loss, stop)
        self.tokens_seen += tokens
        return StepStats(self.step_count, self.last_loss, lr, norm, tokens, time.perf_counter() - t0)

    # -- evaluation ----------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, params: dict[str, torch.Tensor] | None = None) -> EvalStats:
        """Mean validation loss of the live pipeline, or of ``params`` (this stage's slice is taken from
        them; names of other stages are ignored). A collective: every stage calls it."""
        saved = None
        if params is not None:
            mine = [n for n in self.params if n in params]
            saved = self.snapshot(mine)
            self.apply_outer(mine, [params[n] for n in mine])
        try:
            self.model.eval()
            total = 0.0
            for x, y in self.val_set:
                self._ce = []
                with self._autocast():
                    if self.model.is_first:
                        self.schedule.eval(x.to(self.device))
                    elif self.model.is_last:
                        self.schedule.eval(target=y.to(self.device))
                    else:
                        self.schedule.eval()
                total += self._batch_loss()
            out = torch.tensor([total / max(1, len(self.val_set))], dtype=torch.float64, device=self.comm_device)
            dist.all_reduce(out)
            return EvalStats(float(out[0]))
        finally:
            if saved is not None:
                self.apply_outer(mine, saved)


def make_stage_trainer(model_cfg: ModelConfig, cfg: TrainerConfig, data_cfg: DataConfig, pipe: PipelineConfig,
                       plan: StagePlan, env: StageEnv, device: torch.device, *,
                       corpus: Corpus | None = None) -> PipelineTrainer:
    """Stage ``env.rank``'s trainer: the full model is built with the run's seed (so every slice starts
    exactly as in the unsplit model), then only this stage's units are kept and moved to ``device``."""
    from .data import load_corpus, validation_batches

    corpus = corpus if corpus is not None else load_corpus(data_cfg)
    if corpus.vocab_size > model_cfg.vocab_size:
        model_cfg = replace(model_cfg, vocab_size=corpus.vocab_size)
    held = plan.held_by(env.rank, env.world)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        full = GPT(model_cfg)
    model = StageModel(full, plan.units_of(held.groups))
    del full
    stream = TokenStream(corpus, seq_len=model_cfg.seq_len, batch_size=cfg.batch_size,
                         seed=data_cfg.seed, rank=0, world=1, split=data_cfg.split)
    val = validation_batches(corpus, seq_len=model_cfg.seq_len, batch_size=cfg.batch_size,
                             num_batches=cfg.eval_batches)
    return PipelineTrainer(model, cfg, pipe, stream, val, rank=env.rank, world=env.world, device=device)
