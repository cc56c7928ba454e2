"""Butterfly all-reduce arithmetic: which member owns which part, and the weighted mean of a part.

A group of k members splits the flat vector of n values into k contiguous parts;
member j owns part j. Every member sends part j of its vector to member j
(reduce-scatter), the owner averages the contributions it received (fp32, weights
renormalised over who actually contributed) and sends the encoded average back
to every member (all-gather). Each peer's link carries ``2(k−1)/k·n`` values in
each direction, the same as a ring, in two steps instead of 2(k−1).

A large part travels as a stream of chunks of ``chunk`` values, each encoded on its
own (its payload is the concatenation of the chunks' payloads), so that encoding,
the transfer and decoding overlap instead of following one another.
"""

from __future__ import annotations

__all__ = ["MIN_CHUNK", "chunk_bounds", "part_bounds"]

#: The smallest chunk (values) a part may be streamed in: bounds the number of frames per part.
MIN_CHUNK = 1024


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


def chunk_bounds(numel: int, chunk: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` of the consecutive chunks of ``chunk`` values (the last may be shorter) of ``numel``."""
    if chunk < 1:
        raise ValueError("a chunk holds at least one value")
    return [(a, min(a + chunk, numel)) for a in range(0, numel, chunk)]
