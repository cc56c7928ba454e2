"""Checking a part owner's average without its data: random-sign sketches of every contribution (pure).

A butterfly part's owner averages the members' contributions and sends the average back; every member must
be able to tell a wrong average from a right one. Following BTARD (Gorbunov et al., "Secure Distributed
Training at Scale", 2022), each contributor sends, after the round, a *sketch* of what it contributed: the
contribution cut into :data:`BUCKETS` contiguous buckets, each summed with random signs drawn from a seed that
is fixed by the owner's result (so the owner cannot know the signs when it chooses its result). Sketches
are linear: for the weighted mean, ``S(result) = Σ ŵ_i S(x_i)`` up to the result codec's rounding, so a
member compares ``S(result)`` with the weighted sum of the contributors' sketches (:func:`mean_residual`).
For CenteredClip the check is BTARD's own: the clipped differences ``clip_τ(x_i − v)`` sum to zero at the
result ``v`` (:func:`clipped`).

A lie ``δ`` in the result shows up as ``S(δ)``, whose squared norm is ``‖δ‖²`` on average over the signs;
the honest residual is the result codec's rounding ``e``, bounded element by element by the codec
(:meth:`p2ptrain.collective.codecs.Codec.error_bound`). The check passes when ``‖residual‖² ≤ κ²·Σ ε²``
(:data:`KAPPA`): any lie more than a few times the codec's own error is caught (with fp32, any lie above
float rounding), a smaller one is not distinguishable from rounding. Sketches and sums are float64.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch

__all__ = ["BUCKETS", "KAPPA", "Key", "add_chunk", "add_chunks", "clipped", "mean_residual", "passes", "seed", "sketch"]

#: Buckets per sketch: 32 float64 values (256 bytes) per contribution, however large the part.
BUCKETS = 32
#: A residual passes up to κ times the codec's error bound (in norm): an honest residual's squared norm is
#: on average at most Σ ε², and this far above it is beyond the reach of chance.
KAPPA = 4.0
#: The eight signs (±1, float32) that each byte of the sign stream stands for, low bit first.
_SIGNS = (1.0 - 2.0 * ((torch.arange(256)[:, None] >> torch.arange(8)) & 1)).to(torch.float32)


def seed(*context: str | int | bytes) -> bytes:
    """A sketch seed bound to its context (run, round, phase, part, the digest of the owner's result)."""
    h = hashlib.sha256(b"p2ptrain-sketch")
    for c in context:
        b = c if isinstance(c, bytes) else str(c).encode()
        h.update(len(b).to_bytes(8, "big") + b)
    return h.digest()


def _signs(bits: torch.Tensor, n: int) -> torch.Tensor:
    """±1 (float32) for the first ``n`` values from the packed sign bits (one bit per value, low bit first)."""
    return _SIGNS.index_select(0, bits.to(torch.int64)).reshape(-1)[:n]


#: Values signed and summed at a time: bounds the memory of a sketch of a large part.
_SLAB = 1 << 22


#: A sketch's key: one seed for the whole vector, or per chunk ``(lo, hi, seed)`` covering it in order (the seed of
#: a chunk of a streamed result is bound to that chunk's bytes, so each chunk can be sketched as it arrives).
Key = bytes | Sequence[tuple[int, int, bytes]]


def sketch(x: torch.Tensor, key: Key, buckets: int = BUCKETS) -> torch.Tensor:
    """The float64 sketch of ``x`` (any shape, read flat) under ``key``: bucket b is Σ_k σ_k x_k over the b-th
    contiguous stretch of ``ceil(n / buckets)`` values, with signs σ from SHAKE-256 of the seed of the chunk the
    value is in (one seed: the whole of ``x``), the first bit for the chunk's first value (the same on every
    machine and torch version)."""
    flat = x.detach().reshape(-1)
    n = flat.numel()
    out = torch.zeros(buckets, dtype=torch.float64)
    for lo, hi, k in ([(0, n, key)] if isinstance(key, bytes) else key):
        if not 0 <= lo <= hi <= n:
            raise ValueError(f"a sketch chunk [{lo}, {hi}) outside {n} values")
        add_chunk(out, flat[lo:hi], k, lo, n)
    return out


def add_chunk(out: torch.Tensor, values: torch.Tensor, key: bytes, offset: int, numel: int) -> None:
    """Add to ``out`` (float64, its buckets over a vector of ``numel`` values) the signed sums of ``values``, the
    vector's values from ``offset`` on, with signs from SHAKE-256 of ``key`` (the chunk's own seed)."""
    add_chunks([(out, values)], key, offset, numel)


def add_chunks(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], key: bytes, offset: int, numel: int) -> None:
    """:func:`add_chunk` of several vectors' values at the same place under the same key (a result's chunk and our
    contribution to it): the sign stream is drawn and expanded once for all of them. Vectorised: the values are
    signed (exact in float32) and summed in float64 a slab of whole buckets at a time, each bucket's sum taken
    straight from the signed values (a part's chunk starts and ends inside buckets: the partial buckets at a slab's
    ends are summed on their own, not padded with zeros into a float64 copy of the slab)."""
    flats = [(out, values.detach().reshape(-1)) for out, values in pairs]
    if not flats:
        return
    m = flats[0][1].numel()
    if any(f.numel() != m for _, f in flats):
        raise ValueError("vectors of different lengths under one sign stream")
    if m == 0:
        return
    buckets = flats[0][0].numel()
    bits = torch.frombuffer(bytearray(hashlib.shake_256(key).digest((m + 7) // 8)), dtype=torch.uint8)
    size = -(-numel // buckets)
    pos = offset
    while pos < offset + m:  # slabs of whole buckets (the first and last may be partial)
        b0 = pos // size
        b1 = min(buckets, b0 + max(1, _SLAB // size))
        hi = min(offset + m, b1 * size)
        lo_i, hi_i = pos - offset, hi - offset
        off = lo_i % 8  # the slab starts inside a byte of sign bits
        signs = _signs(bits[lo_i // 8 : (hi_i + 7) // 8], off + hi_i - lo_i)[off:]
        signs64: torch.Tensor | None = None
        edge = min(hi, -(-pos // size) * size)  # the end of the bucket the slab starts inside (pos if on an edge)
        whole = (hi - edge) // size
        tail = edge + whole * size
        for out, flat in flats:
            chunk = flat[lo_i:hi_i]
            # x·(±1) is exact in float32 (and float64); every sum is taken in float64
            if chunk.dtype == torch.float64:
                signs64 = signs.to(torch.float64) if signs64 is None else signs64
                signed = chunk * signs64
            else:
                signed = chunk.float() * signs
            # (summed from a float64 copy: a float32 tensor's sum(dtype=float64) along a dimension took 3.5× as
            # long, a quarter of a verified round's CPU at 8 × 16 MB; the sums are the same float64 values)
            wide = signed if signed.dtype == torch.float64 else signed.to(torch.float64)
            if edge > pos:
                out[b0] += wide[: edge - pos].sum()
            if whole:
                b = edge // size
                out[b : b + whole] += wide[edge - pos : edge - pos + whole * size].view(whole, size).sum(1)
            if hi > tail:
                out[tail // size] += wide[tail - pos :].sum()
        pos = hi


def mean_residual(result: torch.Tensor, sketches: Sequence[tuple[float, torch.Tensor]]) -> torch.Tensor:
    """``S(result) − Σ w_i S(x_i) / Σ w_i``: what a weighted mean leaves over (``result`` is its sketch)."""
    total = math.fsum(w for w, _ in sketches)
    acc = result.to(torch.float64).clone()
    for w, s in sketches:
        acc -= (w / total) * s.to(torch.float64)
    return acc


def clipped(x: torch.Tensor, v: torch.Tensor, tau: float) -> torch.Tensor:
    """CenteredClip's pull of ``x`` on the centre ``v``: ``(x − v)·min(1, τ/‖x − v‖)`` (float64)."""
    d = x.detach().reshape(-1).to(torch.float64) - v.detach().reshape(-1).to(torch.float64)
    norm = float(d.norm())
    return d if norm <= tau or norm == 0.0 else d * (tau / norm)


def passes(residual: torch.Tensor, bound_sq: float, scale: float) -> bool:
    """Whether a residual sketch is within κ times the codec's error bound (``bound_sq`` = Σ ε²), with room
    for float64 rounding of sums whose terms reach ``scale`` in magnitude."""
    slack = (1e-9 * scale) ** 2 + 1e-30
    return float(residual.pow(2).sum()) <= KAPPA**2 * bound_sq + slack
