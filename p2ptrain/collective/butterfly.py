"""Butterfly all-reduce arithmetic: which member owns which part, and what every member ends with.

A group of k members (sorted by id) splits the flat vector of n values into k
contiguous parts; member j owns part j. Every member sends part j of its vector to
member j (reduce-scatter), the owner aggregates the contributions it received
(weights renormalised over who actually contributed) and sends the encoded
average back to every member (all-gather). Each peer's link carries
``2(k−1)/k·n`` values in each direction, the same as a ring, in two steps
instead of 2(k−1).

A large part travels as a stream of chunks of ``chunk`` values, each encoded on its
own (its payload is the concatenation of the chunks' payloads), so that encoding,
the transfer and decoding overlap instead of following one another.

:func:`butterfly_mean` computes, in one process, exactly what every member of a
real butterfly ends with: the owner's own slice as it is, the others' slices as the
codec delivers them (chunk by chunk), the aggregate, and the aggregate as the codec
delivers it back. The simulator and the in-memory swarm use it, so that all three
collectives produce the same bytes from the same inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .aggregate import aggregate
from .codecs import Codec

__all__ = ["CHUNK_VALUES", "MIN_CHUNK", "butterfly_mean", "chunk_bounds", "part_bounds", "parts_roundtrip",
           "ring_factor", "stream_chunk", "wire_roundtrip"]

#: The smallest chunk (values) a part may be streamed in: bounds the number of frames per part.
MIN_CHUNK = 1024
#: Values per streamed chunk by default (a part larger than this is streamed).
CHUNK_VALUES = 1 << 18
#: A part is cut into at least this many chunks when it is large enough (:func:`stream_chunk`).
PIECES = 16
#: The smallest chunk :func:`stream_chunk` picks (16 Ki values, 64 KB in fp32): below it a part goes whole.
SMALL_CHUNK = 1 << 14


def stream_chunk(part: int, most: int = CHUNK_VALUES) -> int:
    """Values per chunk for parts of up to ``part`` values: at most ``most``, and small enough that a part is cut
    into :data:`PIECES` chunks (whose transfer, averaging and sending back overlap: a 1 MB fragment between two
    peers went in one piece each way, its phases one after the other), but not below :data:`SMALL_CHUNK`;
    a multiple of 1024, the largest block of any codec, so that cutting a part into chunks changes no block."""
    want = -(-part // PIECES)
    want = -(-want // 1024) * 1024
    return max(min(SMALL_CHUNK, most), min(most, want))


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


def ring_factor(members: int) -> float:
    """Fraction of the vector an all-reduce moves through each peer's link, each way: 2(M−1)/M."""
    return 2.0 * (members - 1) / members if members > 1 else 0.0


def wire_roundtrip(codec: Codec, flat: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """``decode(encode(x))`` of a 1-D fp32 tensor: what a receiver sees of it. With ``chunk`` and more values
    than that, chunk by chunk, as a streamed part travels."""
    if codec.name == "fp32":
        return flat.float().clone()
    if chunk is None or flat.numel() <= chunk:
        return codec.decode(codec.encode(flat), flat.numel())
    out = torch.empty(flat.numel(), dtype=torch.float32)
    for a, b in chunk_bounds(flat.numel(), chunk):
        out[a:b] = codec.decode(codec.encode(flat[a:b]), b - a)
    return out


def parts_roundtrip(codec: Codec, flat: torch.Tensor, members: int, chunk: int = CHUNK_VALUES) -> torch.Tensor:
    """What the owners receive of one member's whole vector ``flat`` (1-D fp32) in a butterfly of ``members``:
    each part through the codec on its own, streamed in ``chunk``-value chunks (the owner's own part, sent to
    no one, is taken the same way: with an idempotent codec that is what it holds)."""
    out = torch.empty(flat.numel(), dtype=torch.float32)
    for lo, hi in part_bounds(flat.numel(), members):
        if hi > lo:
            out[lo:hi] = wire_roundtrip(codec, flat[lo:hi].float(), chunk)
    return out


def butterfly_mean(flats: Sequence[torch.Tensor], weights: Sequence[float], codec: Codec, *,
                   chunk: int = CHUNK_VALUES, how: str = "mean") -> torch.Tensor:
    """What every member of a butterfly all-reduce of ``flats`` (1-D fp32, one per member in the group's
    sorted order) ends with: per part j, member j's own slice, the others' slices through the codec, their
    ``how`` aggregate with ``weights``, and that aggregate through the codec (every member, the owner included,
    uses the decoded payload, so lossy codecs agree everywhere)."""
    if not flats or len(flats) != len(weights):
        raise ValueError("one contribution and one weight per member are needed")
    n = flats[0].numel()
    if any(f.numel() != n for f in flats):
        raise ValueError("members' contributions differ in size")
    out = torch.empty(n, dtype=torch.float32)
    for j, (lo, hi) in enumerate(part_bounds(n, len(flats))):
        if hi == lo:
            continue
        xs = [f[lo:hi].float() if i == j else wire_roundtrip(codec, f[lo:hi].float(), chunk)
              for i, f in enumerate(flats)]
        out[lo:hi] = wire_roundtrip(codec, aggregate(xs, weights, how).float(), chunk)
    return out
