"""CoCoDC's adaptive transmission (arXiv 2504.17672): how often to send, and what.

N fragment sends fit in each window of H inner steps, one every ``h = ⌊H/N⌋``
steps counted from the window's start (so a window's first step is a slot for
every N, and N can change there without the peers' slot grids drifting apart), N following the measured link: ``N = max(P, ⌊H·t_step / t_send⌋)`` (capped
at H) with ``t_send = fragment bytes / bandwidth + latency`` — the number of
sends that the link can carry while the peer computes. Which fragment:

1. a fragment not sent for ≥ H steps (staleness guard; the stalest first);
2. else one never sent (lowest index first);
3. else the largest drift per parameter per step, ``R_p = ‖θ^(p) − θ_i^(p)‖₁ /
   (steps since p's last send · numel_p)``, **summed over peers** so every peer picks
   the same fragment.

Fragments still in flight are never picked. Ties break by lowest index, so the
choice is a deterministic function of (step, last sends, in-flight set, summed
scores) and identical on every peer that agrees on those.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

import torch

__all__ = ["choose_fragment", "choose_merged", "drift_score", "is_send_slot", "send_interval", "sends_per_window"]


def sends_per_window(*, H: int, P: int, step_time: float, fragment_bytes: float, bandwidth: float,
                     latency: float = 0.0) -> int:
    """N = clamp(⌊H·t_step / t_send⌋, P, H); bandwidth in bytes/s, times in seconds."""
    if H < P:
        raise ValueError(f"H ({H}) must be at least P ({P})")
    if bandwidth <= 0 or step_time <= 0:
        return P
    t_send = fragment_bytes / bandwidth + latency
    if t_send <= 0:
        return H
    return int(min(H, max(P, math.floor(H * step_time / t_send))))


def send_interval(H: int, N: int) -> int:
    """h = ⌊H/N⌋ ≥ 1: inner steps between two sends."""
    if N < 1:
        raise ValueError(f"N must be positive, got {N}")
    return max(1, H // N)


def is_send_slot(step: int, H: int, N: int) -> bool:
    """Whether inner step ``step`` (> 0) is one of a window's N send slots: ``r = step mod H`` with
    ``r mod h = 0`` and ``r / h < N`` for ``h = ⌊H/N⌋``. Step 0 (nothing trained yet) never is."""
    if step <= 0:
        return False
    h = send_interval(H, N)
    r = step % H
    return r % h == 0 and r // h < N


@torch.no_grad()
def drift_score(theta: Sequence[torch.Tensor], local: Sequence[torch.Tensor], steps_since: int) -> float:
    """``‖θ − θ_i‖₁ / (steps since last send · numel)`` over a fragment's tensors."""
    numel = sum(t.numel() for t in theta)
    l1 = sum(float((a - b).abs().sum()) for a, b in zip(theta, local, strict=True))
    return l1 / (max(1, steps_since) * max(1, numel))


def choose_fragment(*, step: int, H: int, last_sent: Sequence[int | None], in_flight: Collection[int],
                    scores: Sequence[float] | None) -> int | None:
    """The fragment to send after inner step ``step``, or None when every fragment is in flight.

    ``last_sent[p]`` is the step of p's last send (None: never), ``scores[p]`` the drift
    summed over peers (only needed when rule 3 decides).
    """
    free = [p for p in range(len(last_sent)) if p not in in_flight]
    if not free:
        return None
    stale = [p for p in free if last_sent[p] is not None and step - last_sent[p] >= H]  # type: ignore[operator]
    if stale:
        return min(stale, key=lambda p: (last_sent[p], p))
    never = [p for p in free if last_sent[p] is None]
    if never:
        return never[0]
    if scores is None:
        raise ValueError("drift scores are needed to choose among fragments that were all sent")
    return max(free, key=lambda p: (scores[p], -p))


def choose_merged(*, step: int, H: int, last_sent: Sequence[Sequence[int]], busy: Sequence[Collection[int]],
                  scores: Sequence[Sequence[float] | None]) -> int | None:
    """:func:`choose_fragment` from several peers' views (what a round's leader does): the newest
    send per fragment (−1 = never), the union of fragments in flight, the sum of drift scores."""
    if not last_sent:
        return None
    n = max(len(v) for v in last_sent)
    merged: list[int | None] = []
    for p in range(n):
        seen = [v[p] for v in last_sent if p < len(v) and v[p] >= 0]
        merged.append(max(seen) if seen else None)
    flying = set().union(*[set(b) for b in busy]) if busy else set()
    given = [s for s in scores if s is not None and len(s) == n]
    summed = [sum(col) for col in zip(*given, strict=True)] if given else None
    if summed is None:  # no scores at all: among free fragments all sent, fall back to the lowest index (a
        summed = [0.0] * n  # fragment never sent may still be in flight, so "all sent" is about the free ones)
    return choose_fragment(step=step, H=H, last_sent=merged, in_flight=flying, scores=summed)
