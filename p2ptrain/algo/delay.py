"""Taylor delay compensation (CoCoDC, arXiv 2504.17672; as in DC-ASGD).

When fragment p's average arrives τ' inner steps after it was sent from snapshot
``s``, the peer has moved on to θ_i. The local progress made during the overlap,
``g = s − θ_i`` (what the inner steps subtracted), was computed around ``s``; to
first order, the same steps taken around the new global value θ̃ would have
been ``g + λ·g⊙g⊙(θ̃ − s)`` (the diagonal outer-product approximation of the
Hessian, ``H ≈ λ·g gᵀ``). The local fragment becomes
``θ_i ← θ̃ − (g + λ·g⊙g⊙D)``, ``D = θ̃ − s``, with a constant λ: the correction is
first order in D (it vanishes as the delay's displacement does). The overlap steps
are replayed, never counted twice: they enter the next pseudo-gradient
(``θ̃ − s'``) once. λ = 0 is the delta rule (keep the overlap's progress, rebased on θ̃).

Measured (``bench/compensation.py``: every apply replayed from θ̃ with the same
batches and AdamW state; distance to that ideal fragment, take-θ̃ = 1): the delta rule
lands at 0.22 (τ = 2) and 0.28 (τ = 5); no λ of this term, nor of the variant
preconditioned like AdamW (λ·n·lr·√v̂⊙D), moves that by a thousandth: the error the
delta rule leaves is nearly orthogonal to every first-order correction (cosine
0.04–0.09). The inner steps are AdamW's, whose response to a shifted start is not the
linear one these terms model. An earlier normalisation, ``λ = λ0·‖g‖/‖g⊙g⊙D‖``, made
every correction λ0·‖g‖ long whatever D was (not first order) and landed farther away
(0.29, 0.34). So CoCoDC's default is λ = 0.
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
                      local: Sequence[torch.Tensor], lam: float) -> tuple[list[torch.Tensor], float]:
    """New local values ``θ̃ − (g + λ·g⊙g⊙D)`` per tensor, and the global norm of the corrections.

    ``lam = 0`` gives the plain delta rule ``θ_i + (θ̃ − s)`` (replay local progress on the new global value
    without correction). With no local progress (g = 0), or no displacement (D = 0), there is no correction.
    """
    out, sq = [], 0.0
    for new, s, x in zip(theta_new, snapshot, local, strict=True):
        g = s - x
        if lam == 0.0:
            out.append(new - g)
            continue
        corr = lam * g * g * (new - s)
        sq += float(corr.pow(2).sum())
        out.append(new - g - corr)
    return out, sq**0.5
