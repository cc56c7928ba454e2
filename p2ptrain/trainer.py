"""The inner loop: AdamW steps on one peer's model, evaluation, outer-loop hooks.

Synchronous PyTorch only. The outer loop talks to it through
:meth:`Trainer.snapshot` (copy a fragment's parameters out) and
:meth:`Trainer.apply_outer` (write new values in); only the compute thread calls
either, in program order.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.func import functional_call

from .data import Corpus, DataConfig, TokenStream
from .model import GPT, ModelConfig
from .snapshot import HostSnapshots

__all__ = ["EvalStats", "StepStats", "Trainer", "TrainerConfig", "lr_at", "make_trainer", "pick_device"]


@dataclass(kw_only=True)
class TrainerConfig:
    """Inner optimizer and loop settings (AdamW with warm-up + cosine decay).

    Attributes:
        lr: peak inner learning rate.
        min_lr_ratio: the cosine decays to ``lr * min_lr_ratio`` at ``total_steps``.
        warmup_steps: linear warm-up from ~0 to ``lr``.
        total_steps: length of the cosine schedule (the run's planned inner steps).
        betas, weight_decay, eps: AdamW settings (DiLoCo: (0.9, 0.95), 0.1).
        grad_clip: max global gradient norm; 0 disables clipping.
        grad_accum: micro-batches accumulated per inner step.
        batch_size: sequences per micro-batch.
        device: ``auto`` (cuda when present, else cpu), ``cpu``, ``cuda``, ``cuda:N``.
        eval_batches: batches in the fixed validation set.
        seed: seeds model initialisation (identical on every peer of a run).
        compile: compile every transformer block with ``torch.compile`` (parameter names unchanged).
    """

    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    total_steps: int = 1000
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    eps: float = 1e-8
    grad_clip: float = 1.0
    grad_accum: int = 1
    batch_size: int = 16
    device: str = "auto"
    eval_batches: int = 8
    seed: int = 0
    compile: bool = False

    def __post_init__(self) -> None:
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        if self.lr <= 0:
            raise ValueError(f"trainer: lr must be positive, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"trainer: min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0 or self.total_steps <= 0:
            raise ValueError("trainer: warmup_steps must be >= 0 and total_steps > 0")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"trainer: betas must be in [0, 1), got {self.betas}")
        for name in ("grad_accum", "batch_size", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer: {name} must be at least 1, got {getattr(self, name)}")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ValueError("trainer: grad_clip and weight_decay must be >= 0")


def lr_at(step: int, cfg: TrainerConfig) -> float:
    """Learning rate for inner step ``step`` (0-based): linear warm-up, then cosine."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))


def pick_device(name: str = "auto") -> torch.device:
    """``auto`` picks cuda when available, else cpu; an unavailable cuda is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return dev


@dataclass
class StepStats:
    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens: int
    seconds: float


@dataclass
class EvalStats:
    loss: float

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 50.0))


class Trainer:
    """One peer's model, inner AdamW and data stream.

    ``step()`` = ``forward_backward()`` then ``optimizer_step()``; the split lets a
    data-parallel driver average gradients in between.
    """

    def __init__(self, model: GPT, cfg: TrainerConfig, stream: TokenStream,
                 val_set: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.cfg = cfg
        self.device = pick_device(cfg.device)
        self.model = model.to(self.device)
        self.stream = stream
        self.val_set = list(val_set)
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=self.device.type == "cuda",
        )
        self.params: dict[str, torch.nn.Parameter] = dict(model.named_parameters())
        self.snapshots = HostSnapshots(self.device)
        if cfg.compile:
            blocks = model.blocks.values() if isinstance(model.blocks, torch.nn.ModuleDict) else model.blocks
            for block in blocks:
                block.compile()  # in place: state_dict and parameter names stay as they are
        self.step_count = 0  # inner steps taken
        self.tokens_seen = 0

    # -- inner steps ---------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward_backward(self) -> tuple[float, int]:
        """Accumulate gradients over ``grad_accum`` micro-batches; returns (mean loss, tokens)."""
        total, tokens = 0.0, 0
        for _ in range(self.cfg.grad_accum):
            x, y = self.stream.next_batch()
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with self._autocast():
                loss = self.model.loss(x, y)
            (loss / self.cfg.grad_accum).backward()
            total += loss.item()
            tokens += x.numel()
        return total / self.cfg.grad_accum, tokens

    def optimizer_step(self) -> tuple[float, float]:
        """Clip, set the scheduled lr, step AdamW, clear grads; returns (lr, grad norm)."""
        grad_norm = 0.0
        if self.cfg.grad_clip > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip))
        return self._adamw_step(), grad_norm

    def _adamw_step(self) -> float:
        """Set the scheduled lr, step AdamW on the (clipped) gradients, clear them, count the step; the lr."""
        lr = lr_at(self.step_count, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        return lr

    def step(self) -> StepStats:
        t0 = time.perf_counter()
        self.model.train()
        loss, tokens = self.forward_backward()
        lr, grad_norm = self.optimizer_step()
        self.tokens_seen += tokens
        return StepStats(self.step_count, loss, lr, grad_norm, tokens, time.perf_counter() - t0)

    def gradients(self) -> Iterator[torch.Tensor]:
        """The current gradients (after ``forward_backward``), in parameter order."""
        for p in self.model.parameters():
            if p.grad is not None:
                yield p.grad

    # -- evaluation ----------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, params: dict[str, torch.Tensor] | None = None) -> EvalStats:
        """Mean loss over the fixed validation set, of the live model or of ``params``
        (e.g. the outer parameters θ) given by name."""
        self.model.eval()
        losses = []
        for x, y in self.val_set:
            x, y = x.to(self.device), y.to(self.device)
            with self._autocast():
                if params is None:
                    loss = self.model.loss(x, y)
                else:
                    on_device = {n: t.to(self.device, non_blocking=True) for n, t in params.items()}
                    logits = functional_call(self.model, on_device, (x,))
                    loss = torch.nn.functional.cross_entropy(
                        logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
            losses.append(loss.item())
        return EvalStats(sum(losses) / len(losses))

    # -- outer-loop hooks ----------------------------------------------------------
    @torch.no_grad()
    def snapshot(self, names: Sequence[str]) -> list[torch.Tensor]:
        """fp32 copies of the named parameters, safe to keep while training goes on: on a GPU in pinned
        host memory (copied on a side stream, see :mod:`p2ptrain.snapshot`), on the CPU clones."""
        return self.snapshots.take([self.params[n] for n in names]).wait()

    @torch.no_grad()
    def apply_outer(self, names: Sequence[str], values: Sequence[torch.Tensor]) -> None:
        """Overwrite the named parameters with ``values`` (cast to each parameter's dtype/device)."""
        if len(names) != len(values):
            raise ValueError(f"apply_outer: {len(names)} names but {len(values)} tensors")
        for n, v in zip(names, values, strict=True):
            p = self.params[n]
            if v.shape != p.shape:
                raise ValueError(f"apply_outer: {n} has shape {tuple(p.shape)}, got {tuple(v.shape)}")
            p.copy_(v)

    # -- state ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "model": {n: p.detach() for n, p in self.params.items()},
            "optimizer": self.optimizer.state_dict(),
            "stream": self.stream.state_dict(),
            "step": self.step_count,
            "tokens_seen": self.tokens_seen,
            "trainer_config": {**asdict(self.cfg), "betas": list(self.cfg.betas)},
            "model_config": self.model.cfg.to_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["model_config"] != self.model.cfg.to_dict():
            raise ValueError(
                "checkpoint was written for a different model architecture: "
                f"{state['model_config']} vs {self.model.cfg.to_dict()}"
            )
        missing = set(self.params) ^ set(state["model"])
        if missing:
            raise ValueError(f"checkpoint parameters do not match the model: {sorted(missing)[:5]}")
        self.apply_outer(list(self.params), [state["model"][n] for n in self.params])
        self.optimizer.load_state_dict(state["optimizer"])
        self.stream.load_state_dict(state["stream"])
        self.step_count = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])


def make_trainer(model_cfg: ModelConfig, cfg: TrainerConfig, data_cfg: DataConfig, *,
                 rank: int = 0, world: int = 1, corpus: Corpus | None = None) -> Trainer:
    """Build model (seeded by ``cfg.seed``, identical on every peer), stream and validation set.

    Peer ``rank`` of ``world`` gets its own data stream; ``corpus`` may be passed in
    to share one loaded corpus between virtual peers.
    """
    from .data import load_corpus, validation_batches

    corpus = corpus if corpus is not None else load_corpus(data_cfg)
    if corpus.vocab_size > model_cfg.vocab_size:
        from dataclasses import replace

        model_cfg = replace(model_cfg, vocab_size=corpus.vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = GPT(model_cfg)
    stream = TokenStream(corpus, seq_len=model_cfg.seq_len, batch_size=cfg.batch_size,
                         seed=data_cfg.seed, rank=rank, world=world, split=data_cfg.split)
    val = validation_batches(corpus, seq_len=model_cfg.seq_len, batch_size=cfg.batch_size,
                             num_batches=cfg.eval_batches)
    return Trainer(model, cfg, stream, val)
