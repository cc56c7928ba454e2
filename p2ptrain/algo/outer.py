"""Outer-loop primitives shared by every method.

Notation (../ALGORITHMS in the docs): θ outer (global) parameters, θ_i a peer's
local parameters, Δ_i = θ − θ_i the pseudo-gradient (global minus local: an outer
SGD step of lr 1 on the average lands exactly on the peers' average), Δ its
(weighted) mean over peers. All tensors here are fp32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["alpha_merge", "eager_estimate", "nesterov_step", "pseudo_gradient"]


@torch.no_grad()
def pseudo_gradient(theta: Sequence[torch.Tensor], local: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Δ_i = θ − θ_i, per tensor (global minus local; positive where the peer moved down)."""
    return [g - x for g, x in zip(theta, local, strict=True)]


@torch.no_grad()
def nesterov_step(theta: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor], delta: Sequence[torch.Tensor],
                  lr: float, mu: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Outer SGD with Nesterov momentum (as ``torch.optim.SGD(nesterov=True)``): returns new tensors
    ``b' = μ·b + Δ;  θ' = θ − η·(Δ + μ·b')`` and leaves ``theta`` and ``momentum`` untouched, so that a
    reference to an older θ stays that version (the outer state is copy-on-write). ``momentum`` starts at zeros."""
    new_theta, new_momentum = [], []
    for t, b, d in zip(theta, momentum, delta, strict=True):
        b2 = b.mul(mu).add_(d)
        new_momentum.append(b2)
        new_theta.append(t.sub(d + mu * b2, alpha=lr))
    return new_theta, new_momentum


@torch.no_grad()
def alpha_merge(local: Sequence[torch.Tensor], theta: Sequence[torch.Tensor], alpha: float) -> list[torch.Tensor]:
    """Streaming DiLoCo's merge: ``α·θ_i + (1−α)·θ`` (α=0 takes the global value, α=1 keeps local)."""
    return [alpha * x + (1.0 - alpha) * g for x, g in zip(local, theta, strict=True)]


@torch.no_grad()
def eager_estimate(avg_stale: Sequence[torch.Tensor], own_fresh: Sequence[torch.Tensor],
                   own_stale: Sequence[torch.Tensor], share: float) -> list[torch.Tensor]:
    """Eager updates (arXiv 2502.12996): the peer's own fresh pseudo-gradient stands in
    for its share of the average that has not arrived yet:
    ``Δ̃_i(t) = Δ(t−k) + share·(Δ_i(t) − Δ_i(t−k))`` with ``share`` = the peer's weight
    in the average (1/M for equal weights) and k the rounds of overlap."""
    return [a + share * (f - s) for a, f, s in zip(avg_stale, own_fresh, own_stale, strict=True)]
