"""Bounded groups: split a round's live peers into balanced groups that change from round to round.

A butterfly over every live peer opens k(k−1) streams and waits for the slowest of k. With a maximum
group size G, a round instead splits its k members into ``ceil(k / G)`` groups, each a butterfly of its
own. The split is a pure function of the sorted member list and a seed (the round key), so every peer
computes the same split with no message exchanged; it changes with the seed, so that averages spread
across the whole swarm over successive rounds (the idea of Moshpit SGD: repeated averaging in small,
changing groups converges to the global average).

How: every member is ranked by SHA-256 of ``seed`` and its id (a seeded shuffle that every peer and
every Python process computes alike, unlike ``hash()``), the ranked list is cut into ``ceil(k / G)``
contiguous slices whose sizes differ by at most one, and each slice is sorted.

With groups drawn afresh each round, one round of within-group averaging shrinks the members' variance
around the global mean by about a factor of G in expectation (exactly ``(k − G) / (G (k − 1))`` for
groups of G), so the spread falls geometrically. The swarm's weighted mean is invariant: when each
member's value becomes its group's weighted mean and each member keeps its weight, the weighted sum of
every group, hence of the swarm, is unchanged (in exact arithmetic; float rounding adds ~1 ulp a round).
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Mapping, Sequence

__all__ = ["average_within", "group_of", "num_groups", "split_groups"]


def num_groups(k: int, max_size: int) -> int:
    """How many groups ``k`` members make with at most ``max_size`` each: ``ceil(k / max_size)``."""
    if max_size < 2:
        raise ValueError(f"the maximum group size G must be at least 2, got {max_size}")
    if k < 0:
        raise ValueError(f"the number of members k must be >= 0, got {k}")
    return math.ceil(k / max_size)


def _rank(seed: str, member: str) -> bytes:
    # A NUL between the two keeps ("ab", "c") and ("a", "bc") apart.
    return hashlib.sha256(f"{seed}\x00{member}".encode()).digest()


def split_groups(members: Sequence[str], max_size: int, seed: str) -> list[tuple[str, ...]]:
    """The round's groups: ``ceil(k / max_size)`` tuples of sorted member ids, sizes differing by at most
    one (each ≤ ``max_size``), every member in exactly one; the list is ordered by each group's first
    member. The same for any order of ``members``; a different ``seed`` (the round key) gives a different
    split. No members: no groups.

    ValueError if ``max_size`` < 2, a member id is not a string, or an id appears twice (two peers with
    one id would each compute a different group for it)."""
    if isinstance(max_size, bool) or not isinstance(max_size, int):
        raise ValueError(f"the maximum group size G must be an integer, got {max_size!r}")
    if not isinstance(seed, str):
        raise ValueError(f"the seed (the round key) must be a string, got {type(seed).__name__}")
    if any(not isinstance(m, str) for m in members):
        raise ValueError("member ids must be strings")
    ordered = sorted(members)
    dups = sorted({a for a, b in itertools.pairwise(ordered) if a == b})
    if dups:
        raise ValueError(f"member ids must be unique; repeated: {dups[:5]}")
    g = num_groups(len(ordered), max_size)
    if g == 0:
        return []
    shuffled = sorted(ordered, key=lambda m: (_rank(seed, m), m))
    q, extra = divmod(len(shuffled), g)  # the first `extra` slices take one more member
    groups, start = [], 0
    for i in range(g):
        size = q + (1 if i < extra else 0)
        groups.append(tuple(sorted(shuffled[start : start + size])))
        start += size
    groups.sort(key=lambda grp: grp[0])
    return groups


def group_of(member: str, members: Sequence[str], max_size: int, seed: str) -> tuple[str, ...]:
    """The group ``member`` is in this round (see :func:`split_groups`); ValueError if it is not a member."""
    for grp in split_groups(members, max_size, seed):
        if member in grp:
            return grp
    raise ValueError(f"{member!r} is not one of the round's members")


def average_within(values: Mapping[str, float], groups: Sequence[tuple[str, ...]],
                   weights: Mapping[str, float] | None = None) -> dict[str, float]:
    """One round of averaging on scalars: every member's value becomes its group's weighted mean (equal
    weights by default; sums with ``math.fsum``). What a round of bounded groups does to one coordinate of
    θ, for measuring how fast groups mix (tests, bench/scale_protocol.py). ValueError if a member of a
    group has no value or a group's weights do not sum to a positive number."""
    out = dict(values)
    for grp in groups:
        missing = [m for m in grp if m not in values]
        if missing:
            raise ValueError(f"members without a value: {missing[:5]}")
        w = [1.0 if weights is None else float(weights[m]) for m in grp]
        total = math.fsum(w)
        if not total > 0:
            raise ValueError(f"the weights of group {grp[:3]}... must sum to a positive number, got {total}")
        mean = math.fsum(wi * values[m] for wi, m in zip(w, grp, strict=True)) / total
        for m in grp:
            out[m] = mean
    return out
