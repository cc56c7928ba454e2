"""Robust aggregation of peers' contributions (a fragment, or one butterfly part of it).

``mean``: Σ w_i·x_i / Σ w_i, the default (what the papers use).

``trimmed-mean``: per coordinate, the ``b = ⌊trim·n⌋`` smallest and ``b`` largest
values are dropped and the rest averaged with their weights (coordinate-wise trimmed
mean). Tolerates up to ``b`` arbitrary contributions per coordinate.

``centered-clip``: start from the coordinate-wise median ``v₀`` and iterate
``v ← v + Σ_i ŵ_i·(x_i − v)·min(1, τ/‖x_i − v‖)`` with ``ŵ_i = w_i/Σw``: each
contribution pulls the centre by at most τ, so one scaled or random update moves
the result by at most ``ŵ_i·τ`` per iteration whatever its size. τ defaults to the
median distance of the contributions to ``v₀`` (scale-free: no knob to tune per model).

The mean accumulates in float64; the robust rules work in fp32 (float64 in, float64 out for references), on
the inputs' device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["AGGREGATIONS", "aggregate", "centered_clip", "trimmed_mean", "weighted_mean"]

AGGREGATIONS = ("mean", "trimmed-mean", "centered-clip")


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
        acc.add_(x.to(torch.float64), alpha=wi / total)
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


def centered_clip(xs: Sequence[torch.Tensor], ws: Sequence[float], tau: float | None = None,
                  iters: int = 5) -> torch.Tensor:
    w = _check(xs, ws)
    dtype = torch.float64 if xs[0].dtype == torch.float64 else torch.float32
    x = torch.stack([t.to(dtype).reshape(-1) for t in xs])
    wn = (w / w.sum()).to(dtype=dtype, device=x.device)
    v = x.median(dim=0).values if len(xs) > 2 else (x * wn[:, None]).sum(0)
    if tau is None:
        tau = float((x - v).norm(dim=1).median())
    if tau <= 0:
        return v.reshape(xs[0].shape)
    for _ in range(iters):
        d = x - v
        norms = d.norm(dim=1)
        scale = torch.clamp(tau / norms.clamp_min(1e-30), max=1.0)
        v = v + ((wn * scale)[:, None] * d).sum(0)
    return v.reshape(xs[0].shape)


def aggregate(xs: Sequence[torch.Tensor], ws: Sequence[float], how: str = "mean") -> torch.Tensor:
    """Aggregate contributions ``xs`` with weights ``ws`` by ``how`` (one of :data:`AGGREGATIONS`)."""
    if how == "mean":
        return weighted_mean(xs, ws)
    if how == "trimmed-mean":
        return trimmed_mean(xs, ws)
    if how == "centered-clip":
        return centered_clip(xs, ws)
    raise ValueError(f"unknown aggregation {how!r}: choose one of {', '.join(AGGREGATIONS)}")
