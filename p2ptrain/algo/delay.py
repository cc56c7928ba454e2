"""Taylor delay compensation (CoCoDC, arXiv 2504.17672; as in DC-ASGD).

When fragment p's average arrives τ' inner steps after it was sent from snapshot
``s``, the peer has moved on to θ_i. The local progress made during the overlap,
``g = s − θ_i`` (what the inner steps subtracted), was computed around ``s``; to
first order, the same steps taken around the new global value θ̃ would have
been ``g + λ·g⊙g⊙(θ̃ − s)`` (the diagonal outer-product approximation of the
Hessian, ``H ≈ λ·g gᵀ``). The local fragment becomes
``θ_i ← θ̃ − (g + λ·g⊙g⊙D)``, ``D = θ̃ − s``, ``λ = λ0·‖g‖/(‖u‖+ε)`` per tensor with
``u = g⊙g⊙D``: the correction is λ0 times the size of the local progress. The
overlap steps are replayed, never counted twice: they enter the next
pseudo-gradient (``θ̃ − s'``) once.

Note the normalisation: ``‖λ·u‖ = λ0·‖g‖·‖u‖/(‖u‖+ε)``, so the correction has size
λ0·‖g‖ whenever u is not (numerically) zero — D steers its direction, not its size.
It vanishes only when g or D is exactly zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["taylor_compensate", "taylor_progress"]


@torch.no_grad()
def taylor_progress(g: torch.Tensor, d: torch.Tensor, lam: float) -> torch.Tensor:
    """First-order estimate of progress ``g`` (taken around ``w'``) had it been taken around
    ``w = w' + d``: ``g + λ·g⊙g⊙d``."""
    return g + lam * g * g * d


@torch.no_grad()
def taylor_compensate(theta_new: Sequence[torch.Tensor], snapshot: Sequence[torch.Tensor],
                      local: Sequence[torch.Tensor], lambda0: float,
                      eps: float = 1e-12) -> tuple[list[torch.Tensor], float]:
    """New local values ``θ̃ − (g + λ·u)`` per tensor, and the global norm of the corrections λ·u.

    ``lambda0 = 0`` gives the plain delta rule ``θ_i + (θ̃ − s)`` (replay local progress
    on the new global value without correction). With no local progress (g = 0) the
    result is exactly θ̃.
    """
    out, sq = [], 0.0
    for new, s, x in zip(theta_new, snapshot, local, strict=True):
        g = s - x
        d = new - s
        if lambda0 == 0.0:
            out.append(new - g)
            continue
        u = g * g * d
        lam = lambda0 * float(g.norm()) / (float(u.norm()) + eps)
        corr = lam * u
        sq += float(corr.pow(2).sum())
        out.append(new - g - corr)
    return out, sq**0.5
