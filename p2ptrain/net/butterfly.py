"""Butterfly all-reduce arithmetic: which member owns which part, and the weighted mean of a part.

A group of k members splits the flat vector of n values into k contiguous parts;
member j owns part j. Every member sends part j of its vector to member j
(reduce-scatter), the owner averages the contributions it received (fp32, weights
renormalised over who actually contributed) and sends the encoded average back
to every member (all-gather). Each peer's link carries ``2(k−1)/k·n`` values in
each direction, the same as a ring, in two steps instead of 2(k−1).
"""

from __future__ import annotations

__all__ = ["part_bounds"]


def part_bounds(numel: int, members: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` of each member's part; sizes differ by at most one value."""
    if members < 1:
        raise ValueError("a group needs at least one member")
    base, extra = divmod(numel, members)
    out, start = [], 0
    for j in range(members):
        end = start + base + (1 if j < extra else 0)
        out.append((start, end))
        start = end
    return out
