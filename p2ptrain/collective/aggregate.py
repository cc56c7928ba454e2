"""Robust aggregation of peers' contributions (a fragment, or one butterfly part of it).

``mean``: Σ w_i·x_i / Σ w_i, the default (what the papers use).

``trimmed-mean``: per coordinate, the ``b = ⌊trim·n⌋`` smallest and ``b`` largest
values are dropped and the rest averaged with their weights (coordinate-wise trimmed
mean). Tolerates up to ``b`` arbitrary contributions per coordinate.

``centered-clip``: start from the coordinate-wise median ``v₀`` and iterate
``v ← v + Σ_i ŵ_i·(x_i − v)·min(1, τ/‖x_i − v‖)`` with ``ŵ_i = w_i/Σw``: each
contribution pulls the centre by at most τ, so one scaled or random update moves
the result by at most ``ŵ_i·τ`` per iteration whatever its size. τ defaults to the
median distance of the contributions to ``v₀`` (scale-free: no knob to tune per model,
:func:`clip_radius`). It iterates to the fixed point (the pulls cancel: a step below
:data:`CLIP_TOL` · τ, or ``iters`` steps), so that a member can check an owner's result
by BTARD's test that the clipped pulls sum to zero there (collective/sketch.py).

The mean accumulates in float64; the robust rules work in fp32 (float64 in, float64 out for references), on
the inputs' device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["AGGREGATIONS", "CLIP_TOL", "aggregate", "centered_clip", "clip_radius", "trimmed_mean", "weighted_mean"]

AGGREGATIONS = ("mean", "trimmed-mean", "centered-clip")
#: CenteredClip stops once a step is below this fraction of τ.
CLIP_TOL = 1e-4


def _check(xs: Sequence[torch.Tensor], ws: Sequence[float]) -> torch.Tensor:
    if not xs:
        raise ValueError("nothing to aggregate")
    if len(xs) != len(ws):
        raise ValueError(f"{len(xs)} contributions but {len(ws)} weights")
    if any(not w > 0 for w in ws):  # also catches NaN
        raise ValueError("weights must be positive")
    shape = xs[0].shape
    if any(x.shape != shape for x in xs):
        raise ValueError("contributions differ in shape")
    return torch.tensor([float(w) for w in ws], dtype=torch.float64)


def weighted_mean(xs: Sequence[torch.Tensor], ws: Sequence[float]) -> torch.Tensor:
    """Σ w_i·x_i / Σ w_i, accumulated in float64 and returned in the inputs' dtype: the result hardly depends
    on the order of the contributions (a part's owner sums them in its members' order, the simulator in its
    peers'), so every collective rounds to the same float32 values."""
    w = _check(xs, ws)
    acc = torch.zeros_like(xs[0], dtype=torch.float64)
    total = float(w.sum())
    for x, wi in zip(xs, w.tolist(), strict=True):
        # (added as it is: the sum is taken in float64 all the same, without a float64 copy of each contribution,
        # which for a whole part of a large fragment was a fresh mapping faulted in page by page: 10x slower here)
        acc.add_(x, alpha=wi / total)
    return acc if xs[0].dtype == torch.float64 else acc.to(xs[0].dtype if xs[0].is_floating_point() else torch.float32)


def trimmed_mean(xs: Sequence[torch.Tensor], ws: Sequence[float], trim: float = 0.2) -> torch.Tensor:
    if not 0.0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5), got {trim}")
    w = _check(xs, ws)
    n = len(xs)
    b = int(trim * n)
    if b == 0:
        return weighted_mean(xs, ws)
    dtype = torch.float64 if xs[0].dtype == torch.float64 else torch.float32
    x = torch.stack([t.to(dtype).reshape(-1) for t in xs])  # n × d
    values, order = x.sort(dim=0)
    weights = w.to(dtype=dtype, device=x.device)[order][b : n - b]  # weight of each kept value
    kept = values[b : n - b]
    return ((kept * weights).sum(0) / weights.sum(0)).reshape(xs[0].shape)


def _stack(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    dtype = torch.float64 if xs[0].dtype == torch.float64 else torch.float32
    return torch.stack([t.to(dtype).reshape(-1) for t in xs])


def _start(x: torch.Tensor, wn: torch.Tensor) -> torch.Tensor:
    return x.median(dim=0).values if x.shape[0] > 2 else (x * wn[:, None]).sum(0)


def clip_radius(xs: Sequence[torch.Tensor], ws: Sequence[float]) -> float:
    """CenteredClip's default τ: the median distance of the contributions to their coordinate-wise median."""
    w = _check(xs, ws)
    x = _stack(xs)
    v = _start(x, (w / w.sum()).to(dtype=x.dtype, device=x.device))
    return float((x - v).norm(dim=1).median())


def centered_clip(xs: Sequence[torch.Tensor], ws: Sequence[float], tau: float | None = None,
                  iters: int = 100) -> torch.Tensor:
    w = _check(xs, ws)
    x = _stack(xs)
    wn = (w / w.sum()).to(dtype=x.dtype, device=x.device)
    v = _start(x, wn)
    if tau is None:
        tau = clip_radius(xs, ws)
    if tau <= 0:
        return v.reshape(xs[0].shape)
    for _ in range(iters):
        d = x - v
        norms = d.norm(dim=1)
        scale = torch.clamp(tau / norms.clamp_min(1e-30), max=1.0)
        step = ((wn * scale)[:, None] * d).sum(0)
        v = v + step
        if float(step.norm()) <= CLIP_TOL * tau:
            break
    return v.reshape(xs[0].shape)


def aggregate(xs: Sequence[torch.Tensor], ws: Sequence[float], how: str = "mean", *,
              tau: float | None = None) -> torch.Tensor:
    """Aggregate contributions ``xs`` with weights ``ws`` by ``how`` (one of :data:`AGGREGATIONS`; ``tau``:
    CenteredClip's radius, by default :func:`clip_radius`)."""
    if how == "mean":
        return weighted_mean(xs, ws)
    if how == "trimmed-mean":
        return trimmed_mean(xs, ws)
    if how == "centered-clip":
        return centered_clip(xs, ws, tau)
    raise ValueError(f"unknown aggregation {how!r}: choose one of {', '.join(AGGREGATIONS)}")
