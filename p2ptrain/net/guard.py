"""What a peer accepts from others: checks on every received update, strikes and bans, and the
(optionally robust) aggregation of a part.

Shared by both transports. A contribution is refused, with a log line naming the peer and the
reason, when its weight is not a positive finite number, a value is not finite, or its norm is
more than ``norm_bound`` times the median norm of the round's contributions (the receiver's own
among them; the median rather than the receiver's own alone, because a peer that has just joined
has a near-zero pseudo-gradient and would refuse every honest one). Sizes are checked by the
transports before anything is decoded: a payload that does not match its own announced size is a
strike, a well-formed part of another size than expected is dropped without one (honest members
whose views of a round differ send those). A peer refused ``ban_after`` times is banned for the run:
its messages are dropped unread and it is left out of the groups this peer leads.

With a robust aggregation, a part with fewer than three accepted contributions is not aggregated
at all (the round is partial or fails, and the progress stays for the next one): two
contributions have no majority, and a robust rule would side with one of them.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..collective.aggregate import AGGREGATIONS, aggregate, clip_radius
from ..collective.codec_base import all_finite

__all__ = ["Aggregated", "Guard", "GuardConfig"]

log = logging.getLogger(__name__)


@dataclass
class GuardConfig:
    """aggregation: mean | trimmed-mean | centered-clip; norm_bound: None (the default) turns the norm
    check off: honest pseudo-gradients can differ tens of times in norm (CoCoDC: a peer that has not
    sent a fragment for a while carries more steps of drift; a peer that has just joined carries
    almost none), so a bound is for swarms that expect hostile peers, with a robust aggregation."""

    aggregation: str = "mean"
    norm_bound: float | None = None
    ban_after: int = 3

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {self.aggregation!r}: choose one of {', '.join(AGGREGATIONS)}")
        if self.norm_bound is not None and not self.norm_bound > 1.0:
            raise ValueError("norm_bound must be above 1 (or None for no bound)")
        if self.ban_after < 1:
            raise ValueError("ban_after must be at least 1")


class Aggregated(NamedTuple):
    """A part's aggregate: its values, the total weight and the members of the contributions used, and
    CenteredClip's radius τ (0 for the other rules), which a member needs to check it."""

    values: torch.Tensor
    total: float
    used: list[str]
    tau: float = 0.0


class Guard:
    def __init__(self, cfg: GuardConfig | None = None) -> None:
        self.cfg = cfg or GuardConfig()
        self.strikes: Counter[str] = Counter()
        self.banned: set[str] = set()

    def strike(self, peer: str, reason: str) -> None:
        """Refuse something ``peer`` sent; ban it after ``ban_after`` refusals."""
        self.strikes[peer] += 1
        log.warning("event=rejected peer=%s reason=%s strikes=%d", peer, reason, self.strikes[peer])
        if self.strikes[peer] >= self.cfg.ban_after and peer not in self.banned:
            self.banned.add(peer)
            log.warning("event=banned peer=%s strikes=%d", peer, self.strikes[peer])

    def ban(self, peer: str, reason: str) -> None:
        """Ban ``peer`` at once: it was proven to lie (net/verify.py)."""
        if peer not in self.banned:
            self.banned.add(peer)
            self.strikes[peer] += 1
            log.warning("event=banned peer=%s reason=%s", peer, reason)

    def is_banned(self, peer: str) -> bool:
        return peer in self.banned

    @staticmethod
    def bad_weight(weight: object) -> str | None:
        if not isinstance(weight, (int, float)) or isinstance(weight, bool):
            return "weight is not a number"
        if not math.isfinite(weight) or weight <= 0:
            return f"weight {weight!r} is not a positive finite number"
        return None

    @staticmethod
    def bad_values(x: torch.Tensor) -> str | None:
        return None if all_finite(x) else "non-finite values"

    def aggregate(self, contribs: Mapping[str, tuple[torch.Tensor, float]], me: str | None = None) -> Aggregated:
        """Check every contribution and aggregate the accepted ones (see :class:`Aggregated`).
        ``me`` (the receiver's own contribution) is never refused. ValueError if none is accepted."""
        ok: dict[str, tuple[torch.Tensor, float]] = {}
        for peer in sorted(contribs):
            x, w = contribs[peer]
            if peer != me and self.is_banned(peer):
                continue
            reason = self.bad_weight(w) or self.bad_values(x)
            if reason is not None:
                if peer != me:
                    self.strike(peer, reason)
                continue
            ok[peer] = (x, float(w))
        if self.cfg.norm_bound is not None and len(ok) > 2:
            norms = {p: float(x.float().norm()) for p, (x, _) in ok.items()}
            ref = sorted(norms.values())[len(norms) // 2]
            if ref > 0:
                for p in [p for p, n in norms.items() if p != me and n > self.cfg.norm_bound * ref]:
                    self.strike(p, f"norm {norms[p]:.3g} is over {self.cfg.norm_bound:g}× the round's median {ref:.3g}")
                    del ok[p]
        if not ok:
            raise ValueError("no contribution was accepted")
        if self.cfg.aggregation != "mean" and len(ok) < 3:
            # Two contributions have no majority: any "robust" rule would side with one of them.
            raise ValueError(f"{self.cfg.aggregation} needs at least 3 contributions, got {len(ok)}")
        use = sorted(ok)
        xs, ws = [ok[p][0] for p in use], [ok[p][1] for p in use]
        tau = clip_radius(xs, ws) if self.cfg.aggregation == "centered-clip" else 0.0
        out = aggregate(xs, ws, self.cfg.aggregation, tau=tau if tau > 0 else None)
        return Aggregated(out.float(), float(sum(ws)), use, tau)
