"""Pure group-formation rules shared by every transport (no I/O)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from .transport import Decide, Decision, Group, JoinRequest, RoundFailed, StateMismatch

__all__ = ["agreed_fragment", "alone_check", "close_group", "fingerprints_match", "leader_of",
           "majority_fingerprint", "members_by_signature", "membership_check"]


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


def close_group(key: str, requests: Mapping[str, JoinRequest], leader: str, decide: Decide | None) -> Group:
    """The group a leader closes from the requests it holds: the members of the most common signature,
    the fragment they proposed, else the one ``decide`` picks (with the schedule it may set)."""
    members = tuple(members_by_signature(requests))
    reqs = [requests[m] for m in members]
    decision = Decision(agreed_fragment(reqs))
    if decision.fragment is None and decide is not None and reqs:
        d = decide(reqs)
        decision = d if isinstance(d, Decision) else Decision(d)
    return Group(key, members, leader, decision.fragment, reqs[0].signature if reqs else "", decision.schedule)


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


def members_by_signature(requests: Mapping[str, JoinRequest]) -> list[str]:
    """The joined (non-abstaining) peers whose signature is the most common one (ties: the signature
    of the smallest peer id). Peers with another signature would send payloads of other shapes."""
    live = {p: r for p, r in requests.items() if not r.abstain}
    if not live:
        return []
    counts = Counter(r.signature for r in live.values())
    best = max(counts.values())
    sig = next(live[p].signature for p in sorted(live) if counts[live[p].signature] == best)
    return sorted(p for p, r in live.items() if r.signature == sig)


def membership_check(group: Group, request: JoinRequest) -> None:
    """RoundFailed for a joiner left out of the group; StateMismatch if it was left out for its signature."""
    if request.peer_id in group.members or request.abstain:
        return
    if group.signature and request.signature != group.signature:
        raise StateMismatch(f"round {group.key}: our round state differs from the group's; resync")
    raise RoundFailed(f"round {group.key}: not a member of the group")
