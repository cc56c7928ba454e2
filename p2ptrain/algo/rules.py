"""What differs between the outer-loop methods, as one strategy object per method, chosen once from its config.

:class:`~p2ptrain.algo.outer_loop.OuterLoop` does the parts every method shares (per-fragment θ and
momentum, rounds, the outer Nesterov step, state); a :class:`Rules` says the rest:

=========  =========  =============  ==========================  ===================================
rules      τ          sends          merge on apply              other
=========  =========  =============  ==========================  ===================================
diloco     0          every H        θ_i ← θ
streaming  τ          o_p = p·⌊H/P⌋  α-merge; behind error       error feedback: the buffer, not
                                     feedback: the delta rule    θ_i, keeps what was not sent
eager      k·H        every H        θ_i ← θ                     restarts; eager: Δ̃_i (per-peer θ)
cocodc     τ          slots (N)      Taylor compensation         negotiated; applies first; late ok
dilocox    H          every H        naive/eager: θ_i ← θ;       low-rank compressor; delta applies
                                     delta: keep local progress  first; naive/eager restart
=========  =========  =============  ==========================  ===================================
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..collective.butterfly import parts_roundtrip, wire_roundtrip
from ..collective.codecs import get_codec
from .compress import Compressor, Identity, LowRank
from .configs import (
    CoCoDCConfig,
    DDPConfig,
    DiLoCoConfig,
    DiLoCoXConfig,
    EagerConfig,
    MethodConfig,
    StreamingConfig,
)
from .delay import taylor_compensate
from .feedback import ErrorFeedback
from .outer import alpha_merge
from .schedule import streaming_sends

__all__ = ["CoCoDCRules", "DiLoCoXRules", "EagerRules", "Rules", "StreamingRules", "rules_for"]


class Rules:
    """DiLoCo's rules (arXiv 2311.08105), the base every other method changes a part of.

    Attributes:
        tau: inner steps between a fragment's send and its apply.
        apply_first: at a step where both fall, applies precede sends. The rules that keep local progress
            (Taylor, delta) need the new θ before the next snapshot; the rules that restart from θ need the
            fresh snapshot (and eager its fresh Δ_i) before the apply.
        restarts_each_round: every round restarts the local model from θ^(i) at send time (local progress
            leaves with the snapshot and must not be counted again in the next round).
        eager: the peer's own fresh Δ_i stands in for its share of the stale average (Δ̃_i); θ is per peer.
        late_ok: a round past its due step is applied when it arrives instead of stalling.
        negotiated: the swarm agrees on which fragment a slot sends (CoCoDC's adaptive choice).
        choice: how a negotiated slot picks among free fragments (``drift`` or ``round-robin``); None otherwise.
        links_set_n: a negotiated method whose sends per window N follow the members' links (not fixed).
        keeps_unsent: the share of the error-feedback buffer that an apply moves into the local fragment (the
            peer trains on with it; it re-enters the next Δ_i from there, so the buffer gives it up).
        sent_merge: with the whole buffer handed over (``keeps_unsent`` 1), the share the local fragment keeps of
            the distance from the new θ^(p) to where the sent part alone would have put the peer (0: none).
    """

    apply_first = False
    choice: str | None = None
    links_set_n = False
    restarts_each_round = False
    eager = False
    late_ok = False
    negotiated = False
    keeps_unsent = 0.0
    sent_merge = 0.0

    def __init__(self, cfg: MethodConfig) -> None:
        self.cfg = cfg

    @property
    def tau(self) -> int:
        return 0

    def fixed_sends(self, step: int) -> list[int]:
        """Fragments a fixed schedule sends after inner step ``step`` (> 0)."""
        return [0] if step > 0 and step % self.cfg.H == 0 else []

    def merge(self, theta: Sequence[torch.Tensor], snapshot: Sequence[torch.Tensor],
              local: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], float]:
        """The local fragment's new values after an apply (θ^(p) just stepped; ``snapshot`` at send time,
        ``local`` now), and the norm of any delay correction."""
        return [t.clone() for t in theta], 0.0

    def compressor(self, index: int, seed: int) -> Compressor:
        """Identity, or error feedback in front of a codec that needs it (``2bit``, ``topk2``)."""
        codec = get_codec(self.cfg.codec)
        if not codec.error_feedback:
            return Identity()
        return ErrorFeedback(lambda flat, members: parts_roundtrip(codec, flat, members), self.cfg.ef_decay)


class StreamingRules(Rules):
    """Streaming DiLoCo (arXiv 2501.18512): fragment p at offset p·⌊H/P⌋, overlap τ, α-merge."""

    cfg: StreamingConfig

    @property
    def tau(self) -> int:
        return self.cfg.tau

    def fixed_sends(self, step: int) -> list[int]:
        return streaming_sends(step, self.cfg.H, self.cfg.P)

    def merge(self, theta: Sequence[torch.Tensor], snapshot: Sequence[torch.Tensor],
              local: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], float]:
        """α-merge; behind error feedback, the delta rule (and :attr:`keeps_unsent` of the buffer goes back
        to the local fragment, OuterLoop.finish).

        Why: the α-merge keeps α of the local fragment's distance to θ, and that distance holds the part of
        Δ_i the wire did not carry, which the error-feedback buffer also keeps and sends later: counted twice,
        a coordinate's unsent progress grows by 1/(1−α) (2× at α = 0.5) before it is sent. The delta rule keeps
        the overlap's progress (made after the snapshot, in no Δ yet) and leaves the unsent rest to the buffer,
        as SparseLoCo's restart from θ does for τ = 0; α of what the buffer holds then moves from the buffer to
        the local fragment, so a peer keeps training with α of its unsent progress, counted once
        (tests/algo/test_feedback_merge.py)."""
        if get_codec(self.cfg.codec).error_feedback:
            return taylor_compensate(theta, snapshot, local, 0.0)[0], 0.0
        return alpha_merge(local, theta, self.cfg.alpha), 0.0

    @property
    def keeps_unsent(self) -> float:  # type: ignore[override]
        return self.cfg.alpha if get_codec(self.cfg.codec).error_feedback else 0.0

    @property
    def sent_merge(self) -> float:  # type: ignore[override]
        return self.cfg.sent_merge if self.keeps_unsent == 1 else 0.0

    @property
    def late_ok(self) -> bool:  # type: ignore[override]
        return self.cfg.late == "apply"


class CoCoDCRules(StreamingRules):
    """CoCoDC (arXiv 2504.17672): slots negotiated by the swarm, Taylor delay compensation, late applies."""

    cfg: CoCoDCConfig
    apply_first = True
    negotiated = True
    keeps_unsent = 0.0  # the delta rule, with or without error feedback (no α): so no sent_merge either

    @property
    def late_ok(self) -> bool:  # type: ignore[override]
        return self.cfg.late == "compensate"

    @property
    def choice(self) -> str:  # type: ignore[override]
        return self.cfg.choice

    @property
    def links_set_n(self) -> bool:  # type: ignore[override]
        return self.cfg.sends_per_window is None

    def fixed_sends(self, step: int) -> list[int]:
        return []  # every send is a slot's negotiated choice

    def merge(self, theta: Sequence[torch.Tensor], snapshot: Sequence[torch.Tensor],
              local: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], float]:
        return taylor_compensate(theta, snapshot, local, self.cfg.lambda0)


class EagerRules(Rules):
    """Eager updates (arXiv 2502.12996): k whole rounds of overlap, restarting from θ^(i) every round."""

    cfg: EagerConfig
    restarts_each_round = True

    def __init__(self, cfg: EagerConfig) -> None:
        super().__init__(cfg)
        self.eager = cfg.variant == "eager"

    @property
    def tau(self) -> int:
        return self.cfg.overlap_rounds * self.cfg.H


class DiLoCoXRules(Rules):
    """DiLoCoX (arXiv 2506.21263): one round of delay, low-rank + quantised pseudo-gradients, a start rule."""

    cfg: DiLoCoXConfig

    def __init__(self, cfg: DiLoCoXConfig) -> None:
        super().__init__(cfg)
        self.apply_first = cfg.start_rule == "delta"
        self.restarts_each_round = cfg.start_rule != "delta"
        self.eager = cfg.start_rule == "eager"

    @property
    def tau(self) -> int:
        return self.cfg.H

    def merge(self, theta: Sequence[torch.Tensor], snapshot: Sequence[torch.Tensor],
              local: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], float]:
        if self.cfg.start_rule == "delta":  # keep the overlap's progress, rebased on the new θ
            new, _ = taylor_compensate(theta, snapshot, local, 0.0)
            return new, 0.0
        return super().merge(theta, snapshot, local)

    def compressor(self, index: int, seed: int) -> Compressor:
        c = self.cfg
        codec = get_codec(c.codec)

        def wire(t: torch.Tensor) -> torch.Tensor:  # what the receivers see of a factor (error feedback counts it)
            return wire_roundtrip(codec, t.reshape(-1).float().cpu()).view(t.shape)

        return LowRank(rank=c.rank, rank_min=c.rank_min, rank_max=c.rank_max, energy=c.energy,
                       error_feedback=c.error_feedback, seed=seed * 1000 + index, wire=wire)


_RULES: dict[type[MethodConfig], type[Rules]] = {
    DiLoCoConfig: Rules, StreamingConfig: StreamingRules, CoCoDCConfig: CoCoDCRules, EagerConfig: EagerRules,
    DiLoCoXConfig: DiLoCoXRules,
}


def rules_for(cfg: MethodConfig) -> Rules:
    """The rules of ``cfg``'s method. ValueError for ddp (it has no outer loop) and unknown configs."""
    if isinstance(cfg, DDPConfig):
        raise ValueError("ddp has no outer loop: gradients are all-reduced every inner step")
    try:
        return _RULES[type(cfg)](cfg)  # type: ignore[arg-type]
    except KeyError:
        raise ValueError(f"no outer-loop rules for {type(cfg).__name__}") from None
