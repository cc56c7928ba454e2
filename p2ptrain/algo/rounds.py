"""A fragment round's record and the plan of one inner step (pure data: no clock, no threads, no network).

A round is one all-reduce of one fragment's pseudo-gradient, from send to apply:
SNAPSHOT → AVERAGING → ARRIVED → APPLIED, or ABORTED. The driver feeds each phase's averaged payload to
:meth:`Round.receive` until it returns None (arrived), or calls :meth:`Round.abort`. Whoever waits for a
round (a thread, a virtual clock) keeps its own means of waiting: the record only says where it is.

A compressor whose first payload is costly (a lossy codec's round trip behind error feedback: a fragment of a
1B model is seconds of CPU) is begun by whoever first needs the payload (:meth:`Round.prepare`: a worker thread
of the round's runner), not by the compute thread at the send. The one lock here orders that with an abort
from another thread; it is never held while the compressor computes.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .compress import Compressor

__all__ = ["Action", "ApplyReport", "Round", "RoundState", "StepPlan"]


class RoundState(enum.Enum):
    """A fragment round's life: SNAPSHOT → AVERAGING → ARRIVED → APPLIED, or ABORTED."""

    SNAPSHOT = "snapshot"
    AVERAGING = "averaging"
    ARRIVED = "arrived"
    APPLIED = "applied"
    ABORTED = "aborted"


class Action(enum.Enum):
    """What a step plan asks the driver to do: start a fragment's round, or apply an arrived one."""

    SEND = "send"
    APPLY = "apply"


@dataclass(eq=False)
class Round:
    """One all-reduce of one fragment's pseudo-gradient, from send to apply.

    ``seq`` numbers the rounds of a fragment (identical on every peer); ``due`` is the inner step at which
    the method applies it; ``snapshot`` the local fragment at send time and ``delta`` = θ^(p) − snapshot.
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
    agreed: tuple[float, ...] | None = None  # the fingerprint of the majority's θ^(p) (what a repair must take)
    contributors: tuple[str, ...] = ()
    counted: bool = True  # this peer's own Δ is in the arrived average (False: outvoted, its θ diverged)
    # [lo, hi) ranges of the flattened fragment whose average does not hold this peer's Δ (net ReduceResult.missing)
    missing: tuple[tuple[int, int], ...] = ()
    theta: list[torch.Tensor] = field(default_factory=list)  # θ^(p) at send time (never written in place)
    based_on: int = 0  # θ^(p)'s version at send time (OuterLoop.version: the send step of the last round in it)
    began: bool = False  # its group formed: others may average our Δ even where this peer then fails the round
    # a repair's: the key of the last round in the majority's θ it took, where that round's contributors name this
    # peer (our Δ of that round is in that θ, even if we saw the round fail)
    held_round: str = ""
    # the compressor's begin, not yet run (see the module docstring); prepare() runs it once
    pending: Callable[[], list[torch.Tensor]] | None = field(default=None, repr=False)
    _preparing: bool = field(default=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def key(self) -> str:
        """Names the round: the driver's name for it, else fragment and sequence number."""
        return self.name or f"f{self.fragment}.r{self.seq}"

    @property
    def live(self) -> bool:
        """Sent and not yet applied or aborted."""
        return self.state in (RoundState.AVERAGING, RoundState.ARRIVED)

    @property
    def arrived(self) -> bool:
        return self.state is RoundState.ARRIVED

    @property
    def finished(self) -> bool:
        """Nothing more will arrive: ARRIVED, APPLIED or ABORTED."""
        return self.state in (RoundState.ARRIVED, RoundState.APPLIED, RoundState.ABORTED)

    def prepare(self) -> list[torch.Tensor] | None:
        """The first phase's payload, begun here if it was deferred (once: later calls return it, or None once
        the round is aborted). An abort while the compressor computes is honoured when it ends: the begin is
        undone and None returned."""
        with self._lock:
            begin, self.pending = self.pending, None
            if begin is None:
                return self.payload
            self._preparing = True
        try:
            payload = begin()
        except BaseException:
            with self._lock:
                self._preparing = False
            raise
        with self._lock:  # (the payload is set under it: an abort right after sees a begun round and undoes it)
            self._preparing = False
            if self.state is not RoundState.ABORTED:
                self.payload = payload
                return payload
        self.compressor.abort()
        return None

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
        else:
            self.payload = nxt
        return nxt

    def abort(self) -> None:
        """Give up on this round: nothing is applied; the lost progress stays in θ − θ_i."""
        with self._lock:
            if self.state in (RoundState.APPLIED, RoundState.ABORTED):
                return
            if self.pending is not None:
                self.pending = None  # never begun: nothing of it to undo
            elif not self._preparing:  # (while preparing, prepare() undoes the begin when it ends)
                self.compressor.abort()
            self.state = RoundState.ABORTED
            self.payload = None


@dataclass
class StepPlan:
    """What to do after an inner step: first wait for ``wait``, then run ``actions`` in order, then plan the
    same step again until a plan is empty (a blocking round is sent, waited for and applied within one step)."""

    wait: list[Round] = field(default_factory=list)
    actions: list[tuple[Action, int | Round]] = field(default_factory=list)  # (SEND, fragment) / (APPLY, Round)


@dataclass
class ApplyReport:
    fragment: int
    seq: int
    delay: int  # inner steps between send and apply (the actual staleness)
    correction_norm: float
    members: int
