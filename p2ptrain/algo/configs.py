"""Each outer-loop method's config: one keyword-only dataclass per method, validated at construction.

Symbols as in the papers (see ``ALGORITHMS.md``): H inner steps per round, P fragments, τ overlap, α merge,
η outer learning rate, μ outer momentum, N sends per window (CoCoDC), r rank (DiLoCoX).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal

from ..collective.codecs import CODECS, get_codec, is_codec

__all__ = ["METHODS", "CoCoDCConfig", "DDPConfig", "DiLoCoConfig", "DiLoCoXConfig", "EagerConfig", "MethodConfig",
           "StreamingConfig", "method_config"]


@dataclass(kw_only=True)
class MethodConfig:
    """Fields every outer-loop method shares.

    Attributes:
        H: inner steps per round (for fragments: between two syncs of the same fragment).
        outer_lr: η of the outer Nesterov step.
        outer_momentum: μ of the outer Nesterov step.
        codec: wire format of the pseudo-gradients (fp32, fp16, bf16, uint8, fp8, e3m0; 2bit, topk2 and
            topk2:0.03 run behind error feedback, :mod:`p2ptrain.algo.feedback`).
        ef_decay: β of error feedback, ``e ← β·e + Δ_i`` before each send (1: nothing is forgotten; SparseLoCo,
            arXiv 2508.15706, decays it and drops the outer momentum). Only used by the error-feedback codecs.
        timeout: seconds a round may take on a real network before it is aborted.
    """

    name: ClassVar[str] = ""
    H: int = 40
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    codec: str = "fp32"
    ef_decay: float = 1.0
    timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.H < 1:
            raise ValueError(f"{self.name}: H must be at least 1, got {self.H}")
        if self.outer_lr <= 0:
            raise ValueError(f"{self.name}: outer learning rate η must be positive, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"{self.name}: outer momentum μ must be in [0, 1), got {self.outer_momentum}")
        if not is_codec(self.codec):
            raise ValueError(f"{self.name}: unknown codec {self.codec!r}; choose one of {', '.join(CODECS)}")
        if not 0 < self.ef_decay <= 1:
            raise ValueError(f"{self.name}: error-feedback decay β must be in (0, 1], got {self.ef_decay}")
        if self.timeout <= 0:
            raise ValueError(f"{self.name}: timeout must be positive")

    # Defaults a driver derives from the config (overridden by subclasses).
    @property
    def fragments(self) -> int:
        return 1

    @property
    def fragment_mode(self) -> str:
        return "strided"

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.name, **{f.name: getattr(self, f.name) for f in fields(self)}}


@dataclass(kw_only=True)
class DDPConfig(MethodConfig):
    """Data parallel: gradients all-reduced after every inner step (the reference; no outer loop)."""

    name: ClassVar[str] = "ddp"
    H: int = 1


@dataclass(kw_only=True)
class DiLoCoConfig(MethodConfig):
    """DiLoCo (arXiv 2311.08105): H local AdamW steps, blocking all-reduce of Δ, outer Nesterov
    (η=0.7, μ=0.9), every peer restarts from the new θ."""

    name: ClassVar[str] = "diloco"


@dataclass(kw_only=True)
class StreamingConfig(MethodConfig):
    """Streaming DiLoCo (arXiv 2501.18512).

    Attributes:
        P: number of fragments (whole layers); H must be a multiple of P.
        mode: ``strided`` (layer ℓ in fragment ℓ mod P) or ``sequential``.
        tau: τ, inner steps between starting fragment p's all-reduce and applying it;
            0 ≤ τ < H (with τ ≥ H/P several fragments are in flight at once).
        alpha: α of the merge ``θ_i ← α·θ_i + (1−α)·θ`` (0 takes the global value); behind error feedback, the
            share of its unsent progress a peer keeps training with (algo/rules.py). Default: 0.5, and 1 behind
            error feedback (at H 20 with topk2:0.03, θ's loss 1.447 against 1.488 at 0.5 and 1.705 at 0:
            bench/results/compression.md).
        sent_merge: behind error feedback with α 1 (elsewhere it does nothing), the share of the distance from
            the new θ^(p) to where the part the wire carried would have put the peer alone that the local fragment
            keeps: the α-merge on what was sent, which the delta rule otherwise drops (a peer keeps that much of
            its own deviation from the swarm's average, as the α-merge does without error feedback). Default:
            0.25 behind error feedback with α 1, else 0 (topk2:0.03 at H 20: +3.28% → +2.58% against diloco fp32
            on two seeds; topk2:0.15 at H 140, seed 0: 1.185 → 1.172, +3.8% → +2.7%; 0.5 overshoots:
            bench/results/README.md).
        outer_lr: η 0.7, DiLoCo's: at 100 rounds per fragment it ended below the Streaming DiLoCo paper's 0.4 on
            every seed and corpus measured (0.3–0.9% lower loss, bench/results/methods.md); ``--outer-lr 0.4``
            gives the paper's.
        late: a round not in at send + τ: ``stall`` waits for it there (the paper's rule); ``apply`` trains on
            and applies it when it arrives, with the merge of a round on time (its overlap is longer), and does
            not send its fragment again before it is in. Under faults a round can take its timeouts to end, and
            waiting for it stops the peer's compute meanwhile (the churn benchmark: bench/results/README.md).
    """

    name: ClassVar[str] = "streaming"
    #: The values ``late`` may take for this method.
    LATE: ClassVar[tuple[str, ...]] = ("stall", "apply")
    P: int = 4
    mode: Literal["strided", "sequential"] = "strided"
    tau: int = 1
    alpha: float | None = None
    sent_merge: float | None = None
    outer_lr: float = 0.7
    codec: str = "e3m0"
    late: Literal["stall", "apply", "compensate"] = "stall"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.P < 1:
            raise ValueError(f"{self.name}: the number of fragments P must be at least 1, got {self.P}")
        if self.H % self.P:
            raise ValueError(f"{self.name}: H ({self.H}) must be a multiple of the number of fragments P ({self.P})")
        if self.mode not in ("strided", "sequential"):
            raise ValueError(f"{self.name}: mode must be 'strided' or 'sequential', got {self.mode!r}")
        if self.alpha is None:
            self.alpha = 1.0 if get_codec(self.codec).error_feedback else 0.5
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"{self.name}: α must be in [0, 1], got {self.alpha}")
        if self.sent_merge is None:
            self.sent_merge = 0.25 if get_codec(self.codec).error_feedback and self.alpha == 1 else 0.0
        if not 0 <= self.sent_merge < 1:
            raise ValueError(f"{self.name}: sent_merge must be in [0, 1), got {self.sent_merge}")
        if self.late not in self.LATE:
            raise ValueError(f"{self.name}: late must be {' or '.join(repr(v) for v in self.LATE)}, got {self.late!r}")
        self._check_tau()

    def _check_tau(self) -> None:
        if not 0 <= self.tau < self.H:
            raise ValueError(
                f"{self.name}: overlap τ ({self.tau}) must satisfy 0 ≤ τ < H = {self.H} "
                "(a fragment's result is applied before the fragment is sent again)"
            )

    @property
    def fragments(self) -> int:
        return self.P

    @property
    def fragment_mode(self) -> str:
        return self.mode


@dataclass(kw_only=True)
class EagerConfig(MethodConfig):
    """One or two whole outer rounds of overlap (arXiv 2502.12996).

    Attributes:
        variant: ``eager``: Δ̃_i(t) = Δ(t−k) + (Δ_i(t) − Δ_i(t−k))/M (per-peer outer state);
            ``naive``: apply the stale average Δ(t−k) alone.
        overlap_rounds: k, rounds the all-reduce runs in the background (1 or 2).
    """

    name: ClassVar[str] = "eager"
    variant: Literal["eager", "naive"] = "eager"
    overlap_rounds: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.variant not in ("eager", "naive"):
            raise ValueError(f"eager: variant must be 'eager' or 'naive', got {self.variant!r}")
        if self.overlap_rounds not in (1, 2):
            raise ValueError(f"eager: overlap_rounds must be 1 or 2, got {self.overlap_rounds}")


@dataclass(kw_only=True)
class CoCoDCConfig(StreamingConfig):
    """CoCoDC (arXiv 2504.17672): Streaming DiLoCo + Taylor delay compensation + adaptive transmission.

    Attributes:
        lambda0: λ of the Taylor compensation ``g⊙g⊙D`` (0, the default: the delta rule, replay local
            progress uncorrected; measured by ``bench/compensation.py``, no λ lands closer to the ideal, see
            :mod:`p2ptrain.algo.delay`).
        sends_per_window: N sends per H window (N ≥ P); None derives N from measured bandwidth.
        late: ``compensate``: a result later than τ is applied when it arrives, compensated for
            the actual delay; ``stall``: wait for it at step send + τ.
        choice: how a slot picks among the fragments free to send (after the staleness and never-sent rules):
            ``drift``, the largest drift per parameter per step summed over the members (the paper's
            adaptive choice); ``round-robin``, the one sent longest ago (the control it is measured against).
    """

    name: ClassVar[str] = "cocodc"
    LATE: ClassVar[tuple[str, ...]] = ("compensate", "stall")
    # η 0.4, not streaming's 0.7: the delta rule keeps the local progress on top of θ̃ (no α-damping), and the
    # long runs measured cocodc at 0.4; at 0.7 on real peers it ended 17.6% ± 9.5% above streaming.
    outer_lr: float = 0.4
    lambda0: float = 0.0
    sends_per_window: int | None = None
    late: Literal["stall", "apply", "compensate"] = "compensate"
    choice: Literal["drift", "round-robin"] = "drift"
    alpha: float = 0.0  # unused: the Taylor compensation replaces α-mixing

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lambda0 < 0:
            raise ValueError(f"cocodc: λ0 must be >= 0, got {self.lambda0}")
        if self.sends_per_window is not None and not self.P <= self.sends_per_window <= self.H:
            raise ValueError(
                f"cocodc: sends per window N ({self.sends_per_window}) must satisfy P ≤ N ≤ H ({self.P} ≤ N ≤ {self.H})"
            )
        if self.choice not in ("drift", "round-robin"):
            raise ValueError(f"cocodc: choice must be 'drift' or 'round-robin', got {self.choice!r}")


@dataclass(kw_only=True)
class DiLoCoXConfig(MethodConfig):
    """DiLoCoX (arXiv 2506.21263): one-step-delay overlap with low-rank + quantized compression.

    Round t's compressed pseudo-gradient all-reduces during round t+1 and the outer step
    uses Δ(t−1). Attributes:
        start_rule: the next round's start point: ``naive`` (θ after the stale step),
            ``eager`` (own fresh Δ_i stands in for its share), ``delta`` (keep local progress:
            θ_i ← θ_i + (θ − s), the overlap steps replayed on the new θ).
        rank, rank_min, rank_max, energy: the adaptive rank r of the factorisation
            (smallest rank holding ``energy`` of the spectral energy, within bounds).
        error_feedback: keep the untransmitted residual and add it to the next round.
    """

    name: ClassVar[str] = "dilocox"
    start_rule: Literal["naive", "eager", "delta"] = "delta"
    rank: int = 4
    rank_min: int = 1
    rank_max: int = 32
    energy: float = 0.9
    error_feedback: bool = True
    codec: str = "uint8"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.start_rule not in ("naive", "eager", "delta"):
            raise ValueError(f"dilocox: start_rule must be naive, eager or delta, got {self.start_rule!r}")
        if not 1 <= self.rank_min <= self.rank <= self.rank_max:
            raise ValueError("dilocox: ranks must satisfy 1 ≤ rank_min ≤ rank ≤ rank_max")
        if not 0 < self.energy <= 1:
            raise ValueError(f"dilocox: energy must be in (0, 1], got {self.energy}")


METHODS: dict[str, type[MethodConfig]] = {
    c.name: c for c in (DDPConfig, DiLoCoConfig, StreamingConfig, EagerConfig, CoCoDCConfig, DiLoCoXConfig)
}


def method_config(name: str, **knobs: Any) -> MethodConfig:
    """The config of method ``name`` with ``knobs`` set; unknown names/knobs raise ValueError."""
    try:
        cls = METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}") from None
    known = {f.name for f in fields(cls)}
    bad = sorted(set(knobs) - known)
    if bad:
        raise ValueError(f"{name}: unknown setting(s) {', '.join(bad)}; known: {', '.join(sorted(known))}")
    return cls(**knobs)
