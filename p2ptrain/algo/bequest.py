"""A leaving peer's unsent progress, handed to a peer that stays: what it holds, how it joins the heir's next
contribution, and the bounds an heir holds it to.

A peer that leaves gracefully first sends what it trained in rounds of its own (the leave's flush), but a round
that fails on the way (a cut, a member killed mid-round) gives its tokens back, and the leaver is gone before the
fragment's next round: under churn, peers that left kept 0.72 of their tokens in θ (bench/results/churn_warm).
What is still unsent when it leaves is, per fragment, its *displacement* from θ, ``d = θ_i − θ``, with the tokens
behind it (those since the fragment's last round that was not aborted). It hands these to a peer that stays, its
*heir*, which takes them into its own next contribution of that fragment:

    x_h ← (w_h·x_h + Σ_b w_b·(θ + d_b)) / (w_h + Σ_b w_b),   sent with weight w_h + Σ_b w_b,

taken at that send (θ is the fragment's θ then; ``w_h`` the heir's own tokens since its last round of it). Its
pseudo-gradient θ − x_h is then the weighted mean of the heir's and the leavers' (Σ w·(θ − x) / Σ w), so the
round's average is exactly the one it would have been had every leaver sent its own Δ in it. Kept as a
displacement, a bequest rides over rounds applied meanwhile as a peer's own progress does (``rebase``). The
heir's live model holds the blend from then on: a round that fails gives the tokens back, and the progress stays
in θ − x_h with them, as the heir's own does.

An heir holds what it takes to bounds (:func:`problem`), since a leaver's bytes are the leaver's word: the shapes
of the fragment, finite values, at most ``cap`` tokens, and a norm within ``ratio`` of the heir's own
displacement scaled by the tokens (drift grows at most linearly in the steps taken). The heir's displacement holds
more than the tokens since its last send (under rules that keep the local model, the progress of its rounds in
flight too), so it stands for the work of at least H steps. Within them a lying leaver
moves the heir's contribution no further than a peer of its own could move the round.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Bequest", "blend", "displacement", "problem"]

#: An heir refuses a displacement more than this many times its own, scaled by the tokens behind each.
RATIO = 3.0


@dataclass
class Bequest:
    """One fragment's unsent progress of a leaving peer: its displacement from θ and the tokens behind it."""

    fragment: int
    displacement: list[torch.Tensor]
    tokens: int
    source: str = ""  # the leaver's peer id


@torch.no_grad()
def displacement(local: Sequence[torch.Tensor], theta: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``x − θ`` per tensor, in float32."""
    return [x.float() - t.float() for x, t in zip(local, theta, strict=True)]


@torch.no_grad()
def blend(local: Sequence[torch.Tensor], theta: Sequence[torch.Tensor], own_tokens: float,
          bequests: Sequence[Bequest]) -> list[torch.Tensor]:
    """The heir's local fragment with ``bequests`` taken in: ``(w_h·x + Σ w_b·(θ + d_b)) / (w_h + Σ w_b)``."""
    total = float(own_tokens) + sum(float(b.tokens) for b in bequests)
    if total <= 0:
        raise ValueError("a blend needs tokens behind it")
    out = [x.float() * (float(own_tokens) / total) for x in local]
    for b in bequests:
        share = float(b.tokens) / total
        for o, t, d in zip(out, theta, b.displacement, strict=True):
            o.add_(t.float() + d, alpha=share)
    return out


def _norm(ts: Sequence[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in ts))


def problem(b: Bequest, shapes: Sequence[torch.Size], own: Sequence[torch.Tensor], own_tokens: float,
            cap: float, ratio: float = RATIO) -> str | None:
    """Why an heir whose own displacement on the fragment is ``own``, the work of about ``own_tokens`` tokens,
    refuses ``b``, or None: the fragment's shapes, finite values, ``0 < tokens ≤ cap``, and
    ``‖d_b‖ ≤ ratio·‖own‖·max(1, w_b/own_tokens)``. An heir whose model stands on θ (a rule that restarts each
    round, just after its send) has nothing to hold it to and refuses."""
    if len(b.displacement) != len(shapes) or any(d.shape != s for d, s in zip(b.displacement, shapes, strict=True)):
        return "its tensors are not the fragment's"
    if not (0 < b.tokens <= cap):
        return f"{b.tokens} tokens (at most {cap:.0f})"
    if not all(bool(torch.isfinite(d).all()) for d in b.displacement):
        return "non-finite values"
    mine = _norm(own)
    if own_tokens <= 0 or mine == 0.0:
        return "no progress of our own on the fragment to hold it to"
    bound = ratio * mine * max(1.0, b.tokens / own_tokens)
    if (theirs := _norm(b.displacement)) > bound:
        return f"norm {theirs:.3g} over {bound:.3g}"
    return None
