"""Pure group-formation rules shared by every transport (no I/O)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from .transport import Group, JoinRequest, RoundFailed

__all__ = ["agreed_fragment", "alone_check", "fingerprints_match", "leader_of", "majority_fingerprint"]


def leader_of(live: Sequence[str]) -> str:
    """The round leader: the smallest live peer id (every peer computes the same from the same view)."""
    if not live:
        raise ValueError("no live peers")
    return min(live)


def agreed_fragment(requests: Sequence[JoinRequest]) -> int | None:
    """The fragment a fixed schedule sends: what the members proposed (the most common, ties to the
    smallest), or None if none proposed one."""
    proposed = [r.fragment for r in requests if r.fragment is not None]
    if not proposed:
        return None
    counts = Counter(proposed)
    best = max(counts.values())
    return min(f for f, c in counts.items() if c == best)


def fingerprints_match(a: Sequence[float], b: Sequence[float], rtol: float = 1e-5) -> bool:
    """Chunk sums of two copies of θ agree within ``rtol`` of their magnitude (robust to last-bit
    differences between devices, not to real divergence)."""
    if len(a) != len(b):
        return False
    return all(abs(x - y) <= rtol * (abs(x) + abs(y) + 1e-12) + 1e-9 for x, y in zip(a, b, strict=True))


def majority_fingerprint(prints: Mapping[str, Sequence[float]]) -> set[str]:
    """The peers whose fingerprint agrees with the largest agreeing set (ties: the set holding the
    smallest peer id). Peers outside it hold a divergent θ and must not contribute."""
    peers = sorted(prints)
    best: set[str] = set()
    for p in peers:
        same = {q for q in peers if fingerprints_match(prints[p], prints[q])}
        if len(same) > len(best):
            best = same
    return best


def alone_check(group: Group, me: str, live: Sequence[str]) -> None:
    """A group of one while other peers are alive means the others met elsewhere (or we could not
    reach them): averaging with ourselves would move our θ away from theirs. Raise RoundFailed; the
    progress stays in θ − θ_i and goes into the next round."""
    if group.members == (me,) and set(live) - {me}:
        raise RoundFailed(f"round {group.key}: alone in the group while {len(set(live) - {me})} other peers are live")
