"""CoCoDC's send slots (arXiv 2504.17672): the grid of slots a peer follows, and the decision of a slot's leader.

**The grid.** N sends fit in each window of H inner steps, one every ``h = ⌊H/N⌋`` steps counted from the
window's start (:func:`~p2ptrain.algo.priority.is_send_slot`), so a window's first step is a slot for every N
and N can change there without the peers' grids drifting apart. A :class:`SlotGrid` holds the N in effect and
the changes agreed for later windows; it travels with the outer state (a joiner takes the swarm's grid).

**The leader.** Every member of a slot sends the leader its view (drift scores, fragments in flight, step of
each fragment's last send, and the N its own link could carry); :class:`SlotLeader` picks the fragment the way
:func:`~p2ptrain.algo.priority.choose_merged` does from all views, and at a window's first slot sets N for a
later window: the smallest proposal (the slowest member paces every all-reduce), from the first window start
that every member will have heard of it by. The simulator and the swarm run this same object: a slot's
decision is the same function of the members' views wherever it is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from .priority import choose_merged, is_send_slot

__all__ = ["MAX_SEND_CHANGES", "SlotGrid", "SlotLeader", "SlotView"]

#: Agreed changes of N kept ahead of time (the earliest; more would be a leader's abuse).
MAX_SEND_CHANGES = 8
#: Changes of N that took effect, kept for inspection (the newest).
MAX_SEND_HISTORY = 64


class SlotView(Protocol):
    """One member's view of a slot (a join request carries these fields)."""

    step: int
    scores: list[float] | None
    busy: list[int]
    last_sent: list[int]
    sends: int | None


class SlotGrid:
    """The slots of one peer: N per window of H steps (clamped to [P, H]) and the agreed changes of N."""

    def __init__(self, H: int, P: int, sends_per_window: int | None = None) -> None:
        self.H, self.P = H, P
        self.sends_per_window = None if sends_per_window is None else self.clamp(sends_per_window)
        # N agreed for later windows, as (first step it applies at, N), oldest first
        self.changes: list[tuple[int, int]] = []
        # (first step, N) of each N that took effect here, oldest first (not part of the state: a joiner's
        # history starts where it joined)
        self.history: list[tuple[int, int]] = []

    def clamp(self, n: int) -> int:
        return int(min(self.H, max(self.P, n)))

    def set(self, n: int) -> None:
        """N from now on (e.g. from a configured bandwidth); forgets agreed changes."""
        self.sends_per_window, self.changes = self.clamp(n), []

    def schedule(self, n: int, from_step: int) -> None:
        """N (clamped) from logical step ``from_step`` on, a window start. ValueError for another step: every
        peer of a slot group gets the same change, so their grids stay the same."""
        if from_step % self.H:
            raise ValueError(f"a change of N must start a window (step {from_step}, H = {self.H})")
        changes = dict(self.changes)
        changes[int(from_step)] = self.clamp(n)
        self.changes = sorted(changes.items())[:MAX_SEND_CHANGES]

    def sends_at(self, step: int) -> int:
        """N in effect at ``step`` (P until anything else is set or agreed); changes that took effect are
        folded into ``sends_per_window`` as steps go by."""
        while self.changes and self.changes[0][0] <= step:
            at, self.sends_per_window = self.changes.pop(0)
            if not self.history or self.history[-1][1] != self.sends_per_window:
                self.history = [*self.history, (at, self.sends_per_window)][-MAX_SEND_HISTORY:]
        return self.sends_per_window or self.P

    def is_slot(self, step: int) -> bool:
        return is_send_slot(step, self.H, self.sends_at(step))

    def took_effect(self, step: int) -> int | None:
        """N that was in effect at a past ``step`` by :attr:`history` (None: before the history starts)."""
        n = None
        for at, m in self.history:
            if at > step:
                break
            n = m
        return n

    def state_dict(self) -> dict[str, Any]:
        return {"sends_per_window": self.sends_per_window, "sends_changes": [list(c) for c in self.changes]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        n = state.get("sends_per_window")
        self.sends_per_window = None if n is None else int(n)
        self.changes = [(int(a), int(b)) for a, b in state.get("sends_changes", [])]


class SlotLeader:
    """The decisions this peer makes when it leads a slot. ``lag`` is how many logical steps after a slot
    every member is sure to hold its decision (a group closes within a join window of its first request, a
    member that reached the slot late joins within another); a change of N starts no earlier.

    Negotiations can overlap (a group may take longer to form than the gap between slots), so the members'
    views may predate rounds the leader has just assigned: a fragment assigned at slot s stays busy until
    every member reports it sent since s and no longer in flight (or H steps pass).
    """

    def __init__(self, H: int, lag: int = 1, choice: str = "drift") -> None:
        if H < 1 or lag < 0:
            raise ValueError(f"a slot leader needs H ≥ 1 and lag ≥ 0, got H = {H}, lag = {lag}")
        if choice not in ("drift", "round-robin"):
            raise ValueError(f"choice must be 'drift' or 'round-robin', got {choice!r}")
        self.H, self.lag, self.choice = H, lag, choice
        self._assigned: dict[int, int] = {}  # fragment -> slot it was assigned at

    def decide(self, views: Sequence[SlotView]) -> tuple[int | None, tuple[int, int] | None]:
        """(fragment or None, schedule ``(N, from_step)`` or None) for a slot from its members' views."""
        if not views:
            return None, None
        step = max(v.step for v in views)
        pending = set()
        for f, at in list(self._assigned.items()):
            done = all(f < len(v.last_sent) and v.last_sent[f] >= at and f not in v.busy for v in views)
            if done or step - at > self.H:
                del self._assigned[f]
            else:
                pending.add(f)
        scores: list[list[float] | None] = [v.scores for v in views]
        if self.choice == "round-robin":  # the one sent longest ago: rank by the newest send any member saw
            n = max(len(v.last_sent) for v in views)
            newest = [max((v.last_sent[p] for v in views if p < len(v.last_sent)), default=-1) for p in range(n)]
            scores = [[-float(t) for t in newest]]
        choice = choose_merged(step=step, H=self.H, last_sent=[v.last_sent for v in views],
                               busy=[v.busy for v in views] + [sorted(pending)], scores=scores)
        if choice is not None:
            self._assigned[choice] = step
        proposals = [v.sends for v in views if v.sends is not None]
        if step % self.H or not proposals:
            return choice, None
        return choice, (min(proposals), self.schedule_start(step))

    def schedule_start(self, slot: int) -> int:
        """The first window start after ``slot`` at least ``lag`` steps away (at least one step)."""
        return (slot + max(1, self.lag) + self.H - 1) // self.H * self.H
