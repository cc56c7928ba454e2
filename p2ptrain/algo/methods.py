"""The outer-loop methods behind one interface.

Every method is a per-peer :class:`OuterLoop` configured by its own config
dataclass. It holds the peer's outer parameters θ^(p) and Nesterov momentum per
fragment (never one optimizer over all fragments: a fragment that is not syncing
must not move), decides at each inner step which rounds to start and to apply,
and does the math of both ends of a round. It never touches the network or a
clock: a driver (the simulator, or the swarm runtime) moves the pseudo-gradients
and calls back.

A driver's loop, after every inner step ``t``::

    while True:
        plan = outer.plan(t, in_flight, scores)   # scores only if outer.needs_scores(t)
        if plan.wait: wait for those rounds (a stall); continue
        if not plan.actions: break
        for action in plan.actions:               # ordered sends / applies
            "send":  rnd = outer.start(p, t, params, weight); all-reduce its phases in the background
            "apply": outer.finish(rnd, t, params)

Methods (symbols as in the papers):

=========  ====  ======  ===================  =======================================
method     P     τ       merge on apply       outer update
=========  ====  ======  ===================  =======================================
diloco     1     0       θ_i ← θ              Nesterov(Δ)
streaming  P     τ<H     α-merge              Nesterov(Δ) per fragment
eager      1     k·H     θ_i ← θ^(i)          Nesterov(Δ̃_i) (eager) or Nesterov(Δ(t−k)) (naive)
cocodc     P     τ       Taylor compensation  Nesterov(Δ) per fragment, adaptive choice of p
dilocox    1     H       naive/eager/delta    Nesterov on low-rank + quantized Δ(t−1)
=========  ====  ======  ===================  =======================================
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal, Protocol

import torch

from ..collective.codecs import CODECS
from .compress import Compressor, Identity, LowRank
from .delay import taylor_compensate
from .fragments import Fragment
from .outer import alpha_merge, eager_estimate, nesterov_step, pseudo_gradient
from .priority import choose_fragment, drift_score, is_send_slot
from .schedule import streaming_sends

__all__ = [
    "METHODS",
    "ApplyReport",
    "CoCoDCConfig",
    "DDPConfig",
    "DiLoCoConfig",
    "DiLoCoXConfig",
    "EagerConfig",
    "LocalParams",
    "MethodConfig",
    "OuterLoop",
    "Round",
    "RoundState",
    "StepPlan",
    "StreamingConfig",
    "method_config",
]

#: CoCoDC on a swarm: agreed changes of N kept ahead of time (the earliest; more would be a leader's abuse).
MAX_SEND_CHANGES = 8


class LocalParams(Protocol):
    """What the outer loop needs of a peer's live model (``p2ptrain.trainer.Trainer`` has it)."""

    def snapshot(self, names: Sequence[str]) -> list[torch.Tensor]: ...

    def apply_outer(self, names: Sequence[str], values: Sequence[torch.Tensor]) -> None: ...


# --------------------------------------------------------------------------- configs
@dataclass(kw_only=True)
class MethodConfig:
    """Fields every outer-loop method shares.

    Attributes:
        H: inner steps per round (for fragments: between two syncs of the same fragment).
        outer_lr: η of the outer Nesterov step.
        outer_momentum: μ of the outer Nesterov step.
        codec: wire format of the pseudo-gradients (fp32, fp16, bf16, uint8, fp8, e3m0).
        timeout: seconds a round may take on a real network before it is aborted.
    """

    name: ClassVar[str] = ""
    H: int = 40
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    codec: str = "fp32"
    timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.H < 1:
            raise ValueError(f"{self.name}: H must be at least 1, got {self.H}")
        if self.outer_lr <= 0:
            raise ValueError(f"{self.name}: outer learning rate η must be positive, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"{self.name}: outer momentum μ must be in [0, 1), got {self.outer_momentum}")
        if self.codec not in CODECS:
            raise ValueError(f"{self.name}: unknown codec {self.codec!r}; choose one of {', '.join(CODECS)}")
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
        alpha: α of the merge ``θ_i ← α·θ_i + (1−α)·θ`` (0 takes the global value).
    """

    name: ClassVar[str] = "streaming"
    P: int = 4
    mode: Literal["strided", "sequential"] = "strided"
    tau: int = 1
    alpha: float = 0.5
    outer_lr: float = 0.4
    codec: str = "e3m0"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.P < 1:
            raise ValueError(f"{self.name}: the number of fragments P must be at least 1, got {self.P}")
        if self.H % self.P:
            raise ValueError(f"{self.name}: H ({self.H}) must be a multiple of the number of fragments P ({self.P})")
        if self.mode not in ("strided", "sequential"):
            raise ValueError(f"{self.name}: mode must be 'strided' or 'sequential', got {self.mode!r}")
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"{self.name}: α must be in [0, 1], got {self.alpha}")
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
        lambda0: λ0 of the compensation (0 = replay local progress uncorrected).
        sends_per_window: N sends per H window (N ≥ P); None derives N from measured bandwidth.
        late: ``compensate``: a result later than τ is applied when it arrives, compensated for
            the actual delay; ``stall``: wait for it at step send + τ.
    """

    name: ClassVar[str] = "cocodc"
    lambda0: float = 0.2
    sends_per_window: int | None = None
    late: Literal["compensate", "stall"] = "compensate"
    alpha: float = 0.0  # unused: the Taylor compensation replaces α-mixing

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lambda0 < 0:
            raise ValueError(f"cocodc: λ0 must be >= 0, got {self.lambda0}")
        if self.sends_per_window is not None and not self.P <= self.sends_per_window <= self.H:
            raise ValueError(
                f"cocodc: sends per window N ({self.sends_per_window}) must satisfy P ≤ N ≤ H ({self.P} ≤ N ≤ {self.H})"
            )
        if self.late not in ("compensate", "stall"):
            raise ValueError(f"cocodc: late must be 'compensate' or 'stall', got {self.late!r}")


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


# --------------------------------------------------------------------------- rounds
class RoundState(enum.Enum):
    """A fragment round's life: SNAPSHOT → AVERAGING → ARRIVED → APPLIED, or ABORTED."""

    SNAPSHOT = "snapshot"
    AVERAGING = "averaging"
    ARRIVED = "arrived"
    APPLIED = "applied"
    ABORTED = "aborted"


@dataclass(eq=False)
class Round:
    """One all-reduce of one fragment's pseudo-gradient, from send to apply.

    ``seq`` numbers the rounds of a fragment (identical on every peer); ``due`` is the inner
    step at which the method applies it. The driver feeds each phase's averaged payload to
    :meth:`receive` until it returns None (arrived), or calls :meth:`abort`.
    """

    fragment: int
    seq: int
    send_step: int
    due: int
    snapshot: list[torch.Tensor]
    delta: list[torch.Tensor]
    weight: float
    compressor: Compressor
    payload: list[torch.Tensor] | None = None
    state: RoundState = RoundState.SNAPSHOT
    share: float = 1.0  # this peer's weight / the round's total weight
    members: int = 1
    result: list[torch.Tensor] | None = None
    phases: int = 0
    name: str = ""  # the swarm's name for the round (default: fragment and sequence number)
    divergent: bool = False  # this peer's θ^(p) disagreed with the round's majority (repair before apply)
    contributors: tuple[str, ...] = ()
    done: threading.Event = field(default_factory=threading.Event)  # set on ARRIVED or ABORTED

    @property
    def key(self) -> str:
        """Names the round: the driver's name for it, else fragment and sequence number."""
        return self.name or f"f{self.fragment}.r{self.seq}"

    def receive(self, averaged: list[torch.Tensor], *, total_weight: float, members: int) -> list[torch.Tensor] | None:
        """Feed one phase's weighted average; returns the next phase's payload or None when arrived."""
        if self.state is not RoundState.AVERAGING:
            raise RuntimeError(f"round {self.key} is {self.state.value}, not averaging")
        self.phases += 1
        nxt = self.compressor.receive(averaged)
        if nxt is None:
            self.result = self.compressor.result()
            self.share = self.weight / total_weight if total_weight > 0 else 1.0
            self.members = members
            self.state = RoundState.ARRIVED
            self.payload = None
            self.done.set()
        else:
            self.payload = nxt
        return nxt

    def abort(self) -> None:
        """Give up on this round: nothing is applied; the lost progress stays in θ − θ_i."""
        if self.state in (RoundState.APPLIED, RoundState.ABORTED):
            return
        self.compressor.abort()
        self.state = RoundState.ABORTED
        self.payload = None
        self.done.set()

    @property
    def arrived(self) -> bool:
        return self.state is RoundState.ARRIVED


@dataclass
class StepPlan:
    """What to do after an inner step: first wait for ``wait``, then run ``actions`` in order,
    then plan the same step again until a plan is empty (a blocking round is sent, waited
    for and applied within one step)."""

    wait: list[Round] = field(default_factory=list)
    actions: list[tuple[str, Any]] = field(default_factory=list)  # ("send", fragment) / ("apply", Round)


@dataclass
class ApplyReport:
    fragment: int
    seq: int
    delay: int  # inner steps between send and apply (the actual staleness)
    correction_norm: float
    members: int


@dataclass
class _FragmentState:
    theta: list[torch.Tensor]
    momentum: list[torch.Tensor]
    compressor: Compressor
    last_send: int | None = None
    seq: int = 0
    own: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # eager: Δ_i of recent rounds by seq


# --------------------------------------------------------------------------- the loop
class OuterLoop:
    """One peer's outer loop for any method except ``ddp`` (see the module docstring)."""

    def __init__(self, cfg: MethodConfig, fragments: Sequence[Fragment], *, num_peers: int = 1,
                 seed: int = 0) -> None:
        if isinstance(cfg, DDPConfig):
            raise ValueError("ddp has no outer loop: gradients are all-reduced every inner step")
        if len(fragments) != cfg.fragments:
            raise ValueError(f"{cfg.name}: config wants P={cfg.fragments} fragments, got {len(fragments)}")
        self.cfg = cfg
        self.fragments = list(fragments)
        self.num_peers = num_peers
        self.seed = seed
        self._state: list[_FragmentState] = []
        self.sends_per_window = cfg.sends_per_window if isinstance(cfg, CoCoDCConfig) else None
        # CoCoDC on a swarm: N agreed for later windows, as (first step it applies at, N), oldest first
        self.sends_changes: list[tuple[int, int]] = []

    # -- set-up -------------------------------------------------------------------
    def init(self, params: LocalParams) -> None:
        """Take θ^(p) from the peer's current parameters (identical on every peer at start)."""
        self._state = []
        for frag in self.fragments:
            theta = params.snapshot(frag.names)
            self._state.append(_FragmentState(theta, [torch.zeros_like(t) for t in theta],
                                              self._new_compressor(frag.index)))

    def _new_compressor(self, index: int) -> Compressor:
        c = self.cfg
        if isinstance(c, DiLoCoXConfig):
            return LowRank(rank=c.rank, rank_min=c.rank_min, rank_max=c.rank_max, energy=c.energy,
                           error_feedback=c.error_feedback, seed=self.seed * 1000 + index)
        return Identity()

    @property
    def initialized(self) -> bool:
        return len(self._state) == len(self.fragments)

    @property
    def tau(self) -> int:
        c = self.cfg
        if isinstance(c, StreamingConfig):
            return c.tau
        if isinstance(c, EagerConfig):
            return c.overlap_rounds * c.H
        if isinstance(c, DiLoCoXConfig):
            return c.H
        return 0

    @property
    def apply_first(self) -> bool:
        """Whether applies precede sends at a step where both fall: the rules that keep local
        progress (Taylor, delta) need the new θ before the next snapshot; the rules that
        restart from θ need the fresh snapshot (and eager its fresh Δ_i) before the apply."""
        c = self.cfg
        return isinstance(c, CoCoDCConfig) or (isinstance(c, DiLoCoXConfig) and c.start_rule == "delta")

    @property
    def restarts_each_round(self) -> bool:
        """Rules that restart every round from θ^(i) (eager, naive, DiLoCoX naive/eager): local
        progress leaves with the snapshot and must not be counted again in the next round."""
        c = self.cfg
        return isinstance(c, EagerConfig) or (isinstance(c, DiLoCoXConfig) and c.start_rule != "delta")

    @property
    def shared_theta(self) -> bool:
        """Whether every peer holds the same θ (all but the eager rules, whose outer state is per peer):
        only then can replicas be compared and repaired."""
        return not self._eager

    @property
    def _eager(self) -> bool:
        c = self.cfg
        return (isinstance(c, EagerConfig) and c.variant == "eager") or (
            isinstance(c, DiLoCoXConfig) and c.start_rule == "eager")

    @property
    def late_ok(self) -> bool:
        """Whether a round past its due step may be applied later instead of stalling."""
        return isinstance(self.cfg, CoCoDCConfig) and self.cfg.late == "compensate"

    def theta(self, fragment: int) -> list[torch.Tensor]:
        """θ^(p): this peer's outer parameters of a fragment (do not modify)."""
        return self._state[fragment].theta

    def signature(self, fragment: int) -> str:
        """The shape of what this peer sends for a fragment (low-rank: its ranks); peers of one round
        must agree on it."""
        ranks = getattr(self._state[fragment].compressor, "ranks", None)
        return ",".join(str(r) for r in ranks()) if callable(ranks) else ""

    def momentum(self, fragment: int) -> list[torch.Tensor]:
        """The outer Nesterov buffer of a fragment (do not modify)."""
        return self._state[fragment].momentum

    @torch.no_grad()
    def overwrite(self, fragment: int, theta: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor]) -> None:
        """Replace a fragment's θ^(p) and momentum (repair from the swarm's majority)."""
        st = self._state[fragment]
        for t, v in zip(st.theta, theta, strict=True):
            t.copy_(v)
        for t, v in zip(st.momentum, momentum, strict=True):
            t.copy_(v)

    def outer_params(self) -> dict[str, torch.Tensor]:
        """All outer parameters θ by name (for evaluation)."""
        return {n: t for frag, st in zip(self.fragments, self._state, strict=True)
                for n, t in zip(frag.names, st.theta, strict=True)}

    def last_send(self, fragment: int) -> int | None:
        return self._state[fragment].last_send

    # -- scheduling ---------------------------------------------------------------
    def set_sends_per_window(self, n: int) -> None:
        """CoCoDC: N from measured bandwidth (see ``priority.sends_per_window``); clamped to [P, H]."""
        self.sends_per_window = self._clamp_sends(n)
        self.sends_changes = []

    def _clamp_sends(self, n: int) -> int:
        return int(min(self.cfg.H, max(self.cfg.fragments, n)))

    def schedule_sends(self, n: int, from_step: int) -> None:
        """CoCoDC on a swarm: N (clamped to [P, H]) from logical step ``from_step`` on, a window start.
        Every peer of a slot group gets the same change, so their slot grids stay the same."""
        if not isinstance(self.cfg, CoCoDCConfig):
            return
        if from_step % self.cfg.H:
            raise ValueError(f"a change of N must start a window (step {from_step}, H = {self.cfg.H})")
        changes = dict(self.sends_changes)
        changes[int(from_step)] = self._clamp_sends(n)
        self.sends_changes = sorted(changes.items())[:MAX_SEND_CHANGES]

    def sends_at(self, step: int) -> int:
        """CoCoDC's N in effect at ``step`` (P until anything else is set or agreed). Changes that took
        effect are folded into ``sends_per_window`` as steps go by."""
        while self.sends_changes and self.sends_changes[0][0] <= step:
            self.sends_per_window = self.sends_changes.pop(0)[1]
        return self.sends_per_window or self.cfg.fragments

    def needs_scores(self, step: int) -> bool:
        """Whether the send decision at ``step`` needs the peers' summed drift scores."""
        if not isinstance(self.cfg, CoCoDCConfig):
            return False
        return is_send_slot(step, self.cfg.H, self.sends_at(step)) and all(
            st.last_send is not None for st in self._state)

    def drift_scores(self, params: LocalParams, step: int) -> list[float]:
        """This peer's ``R_p`` for every fragment (to be summed over peers)."""
        out = []
        for frag, st in zip(self.fragments, self._state, strict=True):
            since = step - st.last_send if st.last_send is not None else step
            out.append(drift_score(st.theta, params.snapshot(frag.names), since))
        return out

    def _sends(self, step: int, in_flight: Sequence[Round], scores: Sequence[float] | None) -> list[int]:
        c = self.cfg
        if step <= 0 or any(st.last_send == step for st in self._state if isinstance(c, CoCoDCConfig)):
            return []  # the driver re-plans within a step: never send twice
        if isinstance(c, CoCoDCConfig):
            if not is_send_slot(step, c.H, self.sends_at(step)):
                return []
            busy = {r.fragment for r in in_flight}
            p = choose_fragment(step=step, H=c.H, last_sent=[st.last_send for st in self._state],
                                in_flight=busy, scores=scores)
            return [] if p is None else [p]
        if isinstance(c, StreamingConfig):
            due = streaming_sends(step, c.H, c.P)
        else:
            due = [0] if step % c.H == 0 else []
        return [p for p in due if self._state[p].last_send != step]

    @property
    def negotiated(self) -> bool:
        """Whether the swarm must agree on which fragment a slot sends (CoCoDC's adaptive choice)."""
        return isinstance(self.cfg, CoCoDCConfig)

    def is_slot(self, step: int) -> bool:
        """CoCoDC: whether ``step`` is a send slot (every h = ⌊H/N⌋ steps from each window's start)."""
        if not isinstance(self.cfg, CoCoDCConfig):
            return False
        return is_send_slot(step, self.cfg.H, self.sends_at(step))

    def busy_fragments(self, in_flight: Sequence[Round]) -> list[int]:
        return sorted({r.fragment for r in in_flight if r.state in (RoundState.AVERAGING, RoundState.ARRIVED)})

    def last_sends(self) -> list[int]:
        """Step of each fragment's last send, −1 for never (for the swarm's negotiation)."""
        return [-1 if st.last_send is None else st.last_send for st in self._state]

    def plan(self, step: int, in_flight: Sequence[Round], scores: Sequence[float] | None = None, *,
             is_arrived: Callable[[Round], bool] | None = None, sends: bool = True) -> StepPlan:
        """What to do after inner step ``step`` given the rounds still in flight (not applied).

        ``is_arrived`` tells whether a round's result is here (default: its state); the
        simulator passes its virtual clock's view. ``sends=False`` leaves the sends to the
        caller (the swarm negotiates CoCoDC's fragment choice).
        """
        arrived = is_arrived or (lambda r: r.arrived)
        live = [r for r in in_flight if r.state in (RoundState.AVERAGING, RoundState.ARRIVED)]
        due = [r for r in live if r.due <= step]
        wait = [r for r in due if not arrived(r) and not self.late_ok]
        if wait:
            return StepPlan(wait=wait)
        applies = [r for r in due if arrived(r)]
        # A late round (compensate) that arrived after its due step is applied at the next step.
        applies.sort(key=lambda r: (r.send_step, r.fragment))
        still = [r for r in live if r not in applies]
        chosen = self._sends(step, still if self.apply_first else live, scores) if sends else []
        apply_actions = [("apply", r) for r in applies]
        send_actions = [("send", p) for p in chosen]
        return StepPlan(actions=apply_actions + send_actions if self.apply_first else send_actions + apply_actions)

    # -- the two ends of a round -------------------------------------------------
    @torch.no_grad()
    def start(self, fragment: int, step: int, params: LocalParams, weight: float = 1.0, *, name: str = "") -> Round:
        """Snapshot fragment p, compute Δ_i = θ^(p) − s_p and the first payload to all-reduce."""
        frag, st = self.fragments[fragment], self._state[fragment]
        snap = params.snapshot(frag.names)
        delta = pseudo_gradient(st.theta, snap)
        rnd = Round(fragment, st.seq, step, step + self.tau, snap, delta, float(weight), st.compressor, name=name)
        rnd.payload = st.compressor.begin(delta)
        rnd.state = RoundState.AVERAGING
        if self._eager and st.seq < self.tau // self.cfg.H:
            # Warm-up of eager: no stale round arrives at the first k boundaries (Δ(t−k) = 0,
            # Δ_i(t−k) = 0), so Δ̃_i = share·Δ_i(t); later rounds subtract exactly this share again.
            nesterov_step(st.theta, st.momentum, [d / self.num_peers for d in delta], self.cfg.outer_lr,
                          self.cfg.outer_momentum)
        if self._eager:
            st.own[st.seq] = delta
            for old in [q for q in st.own if q < st.seq - self.tau // self.cfg.H - 1]:
                del st.own[old]
        st.seq += 1
        st.last_send = step
        if self.restarts_each_round:
            params.apply_outer(frag.names, [t.clone() for t in st.theta])
        return rnd

    @torch.no_grad()
    def finish(self, rnd: Round, step: int, params: LocalParams) -> ApplyReport:
        """Outer step on θ^(p) with the arrived average, then merge into the local fragment."""
        if not rnd.arrived or rnd.result is None:
            raise RuntimeError(f"round {rnd.key} cannot be applied: it is {rnd.state.value}")
        c, frag, st = self.cfg, self.fragments[rnd.fragment], self._state[rnd.fragment]
        avg = rnd.result
        if self._eager:
            # Δ̃_i = Δ(t−k) + share·(Δ_i(t) − Δ_i(t−k)); share = w_i/Σw (1/M for equal weights). Round
            # t−k pairs with round t, started at this same step; at the end of a run no round t exists
            # and Δ_i(t) = 0 (each round's own share was already applied when it started).
            k = self.tau // c.H
            fresh = st.own.get(rnd.seq + k) or [torch.zeros_like(d) for d in rnd.delta]
            avg = eager_estimate(avg, fresh, rnd.delta, rnd.share)
        nesterov_step(st.theta, st.momentum, avg, c.outer_lr, c.outer_momentum)
        correction = 0.0
        if isinstance(c, CoCoDCConfig):
            new, correction = taylor_compensate(st.theta, rnd.snapshot, params.snapshot(frag.names), c.lambda0)
        elif isinstance(c, DiLoCoXConfig) and c.start_rule == "delta":
            new, _ = taylor_compensate(st.theta, rnd.snapshot, params.snapshot(frag.names), 0.0)
        elif isinstance(c, StreamingConfig):
            new = alpha_merge(params.snapshot(frag.names), st.theta, c.alpha)
        else:
            new = [t.clone() for t in st.theta]
        params.apply_outer(frag.names, new)
        rnd.state = RoundState.APPLIED
        return ApplyReport(rnd.fragment, rnd.seq, step - rnd.send_step, correction, rnd.members)

    # -- state ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Per-fragment θ, momentum, counters and compressor state (in-flight rounds are not kept:
        on resume their progress is still in θ − θ_i and enters the next round)."""
        return {
            "method": self.cfg.to_dict(),
            "sends_per_window": self.sends_per_window,
            "sends_changes": [list(c) for c in self.sends_changes],
            "fragments": [
                {"theta": st.theta, "momentum": st.momentum, "last_send": st.last_send, "seq": st.seq,
                 "own": st.own, "compressor": st.compressor.state_dict()}
                for st in self._state
            ],
        }

    def shared_state(self) -> dict[str, Any]:
        """What a joining peer takes from a live one: θ, momentum, counters and the compressor's shared
        part (error feedback and eager's own Δ_i are per peer and left out)."""
        state = self.state_dict()
        for frag in state["fragments"]:
            frag["own"] = {}
            if "error" in frag["compressor"]:
                frag["compressor"] = {**frag["compressor"], "error": []}
        return state

    def round_state(self, fragment: int) -> dict[str, Any]:
        """A fragment's shared round state (its round counter and the compressor's shared part, e.g.
        low-rank ranks and warm-start bases): what a peer catching up on a round takes along with θ."""
        st = self._state[fragment]
        comp = st.compressor.state_dict()
        if "error" in comp:
            comp = {**comp, "error": []}
        return {"seq": st.seq, "compressor": comp}

    def take_round_state(self, fragment: int, state: dict[str, Any]) -> None:
        """Take another peer's :meth:`round_state` of a fragment (ValueError if it does not fit). This
        peer's error feedback is kept where the layout and ranks still match; a round of this fragment
        still in flight here keeps the compressor it started with."""
        st = self._state[fragment]
        new = dict(state["compressor"])
        mine = st.compressor.state_dict()
        if mine.get("error") and mine.get("index") == new.get("index") and mine.get("rank") == new.get("rank"):
            new["error"] = mine["error"]
        comp = self._new_compressor(self.fragments[fragment].index)
        comp.load_state_dict(new)
        st.compressor, st.seq = comp, int(state["seq"])

    def keep_own(self, saved: dict[str, Any]) -> int:
        """After taking a shared state (:meth:`shared_state` of another peer), put back this peer's own
        per-fragment state from ``saved`` (its :meth:`state_dict` from before) where it still fits:
        eager's Δ_i when the fragment's round counter is unchanged, error feedback when the
        compressor's layout and ranks are. Returns the number of fragments that kept something."""
        kept = 0
        for st, old in zip(self._state, saved["fragments"], strict=True):
            took = False
            if old["own"] and int(old["seq"]) == st.seq:
                st.own = {int(k): v for k, v in old["own"].items()}
                took = True
            error = old["compressor"].get("error")
            if error:
                cur = st.compressor.state_dict()
                if cur.get("index") == old["compressor"].get("index") and cur.get("rank") == old["compressor"].get("rank"):
                    try:
                        st.compressor.load_state_dict({**cur, "error": error})
                        took = True
                    except ValueError:
                        pass
            kept += took
        return kept

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["method"]["method"] != self.cfg.name:
            raise ValueError(f"outer state is for method {state['method']['method']!r}, not {self.cfg.name!r}")
        frags = state["fragments"]
        if len(frags) != len(self.fragments):
            raise ValueError(f"outer state has {len(frags)} fragments, this run has {len(self.fragments)}")
        self._state = []
        for frag, s in zip(self.fragments, frags, strict=True):
            comp = self._new_compressor(frag.index)
            comp.load_state_dict(s["compressor"])
            theta = [t.float().clone() for t in s["theta"]]
            if [tuple(t.shape) for t in theta] != frag.shapes:
                raise ValueError(f"outer state of fragment {frag.index} does not match the model's shapes")
            own = {int(k): v for k, v in s["own"].items()}  # checkpoints store keys as text
            self._state.append(_FragmentState(theta, [m.float().clone() for m in s["momentum"]], comp,
                                              s["last_send"], int(s["seq"]), own))
        self.sends_per_window = state.get("sends_per_window")
        self.sends_changes = [(int(a), int(n)) for a, n in state.get("sends_changes", [])]
