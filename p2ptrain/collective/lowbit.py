"""1- and 2-bit wire codecs, dense and sparse (top-k), meant to be used with error feedback (torch and stdlib only).

All are lossy far beyond the other codecs: they are only useful when each peer keeps what it did not send and
adds it to its next round (:class:`p2ptrain.algo.feedback.ErrorFeedback`, which the outer-loop rules put in
front of them). SparseLoCo (arXiv 2508.15706) sends the top 1–3% of each chunk's entries at 2 bits this way.

Payload layouts (little-endian; ``n`` values; blocks of ``B`` values, the last one possibly shorter):

==============  ===========================================================================  ======================
codec           layout                                                                       bytes
==============  ===========================================================================  ======================
``1bit``        per block of 256: mean |x| bf16; then ``n`` sign bits, 8 per byte            ``2*nb + ceil(n/8)``
``2bit``        per block of 128: absmax bf16; then ``n`` 2-bit codes, 4 per byte            ``2*nb + ceil(n/4)``
``topk2``       per block of 1024 (``K = 10`` slots, ``min(K, L)`` for a last block of       ``4*nb + ceil(l*S/8)
``topk2:0.03``  ``L`` values): (lo, hi) bf16; then the ``S`` slot indices in Elias–Fano form:   + ceil(Σ_b h_b/8)
                their low ``l`` bits, packed; then each block's high bitvector of            + ceil(S/4)``
                ``h_b = k_b + ceil(L_b / 2^l)`` bits; then ``S`` 2-bit codes, 4 per byte
                (3%: ``K = 31``)
==============  ===========================================================================  ======================

Indices (Elias–Fano, per block): with ``l = ⌊log2(1024 / K)⌋`` (6 for 1%, 5 for 3%), a slot's index ``i`` is
sent as its low ``l`` bits and its high part ``i >> l``; a block's high parts, nondecreasing, are one bitvector
in which slot ``j``'s bit ``(i_j >> l) + j`` is set: ``K + 1024 / 2^l`` bits, about 2 bits a slot. With the low
bits that is ``l + 2`` bits an index instead of 10 (7 for 3%: a payload 1.3× smaller; 8.6 for 1%), all of it
encoded and decoded with tensor operations, no loop over the values.

A 2-bit code is ``sign << 1 | level`` (bit 0 the level, bit 1 the sign; the earliest value in the lowest bits
of a byte). ``2bit``'s levels are ``absmax·{1/3, 1}`` (uniform, symmetric); ``topk2``'s are two levels
``{lo, hi}`` fitted to the block's selected magnitudes (:func:`two_levels`); ``1bit`` sends a sign (1: negative)
and one level per block, the mean magnitude. All are *idempotent*: a payload's decoded values encode to the same
payload again (block by block), so error feedback measured on one peer's own round trip is what the owner of a
part receives, provided the part starts on a block boundary of the sender's layout.

Hostile payloads are refused (ValueError): a header that is not finite or has ``lo > hi`` or a negative
scale, a high bitvector without exactly one set bit per slot, an index outside its block, indices of a block that
are not strictly increasing (so duplicates too), nonzero padding bits, a length other than ``encoded_size`` (so an
oversized index set).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from .codec_base import Codec, _blocks, _check_numel, _pad, _read, _read_u8, _to_bytes

__all__ = ["OneBitCodec", "TopK2Codec", "TopK2Codec3", "TwoBitCodec", "pack_bits", "two_levels", "unpack_bits"]

_BF16_MAX = float(torch.finfo(torch.bfloat16).max)


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``values`` (1-D, each in ``[0, 2**bits)``) as a uint8 tensor of ``ceil(len·bits/8)`` bytes, the first
    value in the lowest bits (LSB first, a value's bits in increasing order); padding bits are zero."""
    if 8 % bits == 0:  # whole values per byte: one shift per slot of the byte, summed (the fields are disjoint)
        per = 8 // bits  # in uint8 throughout: 5x faster than int64 for 1-bit signs (4M values: 51 -> 9 ms)
        v = values.to(torch.uint8).reshape(-1)
        v = _pad(v, -(-v.numel() // per) * per, 0).view(-1, per)
        return (v << (torch.arange(per, dtype=torch.uint8) * bits)).sum(dim=1, dtype=torch.uint8)
    v = values.to(torch.int64).reshape(-1)
    shifts = torch.arange(bits, dtype=torch.int64)
    flat = ((v.unsqueeze(1) >> shifts) & 1).reshape(-1)  # (len·bits,) 0/1, LSB first
    flat = _pad(flat, -(-flat.numel() // 8) * 8, 0).view(-1, 8)
    return (flat << torch.arange(8, dtype=torch.int64)).sum(dim=1).to(torch.uint8)


def unpack_bits(data: torch.Tensor, count: int, bits: int) -> tuple[torch.Tensor, bool]:
    """The ``count`` values of ``bits`` bits each packed in ``data`` (uint8) by :func:`pack_bits`, as int64,
    and whether every padding bit after them is zero."""
    if 8 % bits == 0:
        per = 8 // bits
        vals = ((data.to(torch.uint8).unsqueeze(1) >> (torch.arange(per, dtype=torch.uint8) * bits))
                & ((1 << bits) - 1)).reshape(-1)
        return vals[:count].to(torch.int64), not bool(vals[count:].any())
    flat = ((data.to(torch.int64).unsqueeze(1) >> torch.arange(8, dtype=torch.int64)) & 1).reshape(-1)
    used = count * bits
    body = flat[:used].view(count, bits) if count else flat[:0].view(0, bits)
    vals = (body << torch.arange(bits, dtype=torch.int64)).sum(dim=1)
    return vals, not bool(flat[used:].any())


def two_levels(mags: torch.Tensor, rounds: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Two magnitudes ``(lo, hi)`` for each row of ``mags`` (rows, k; float32, >= 0) that code its values with
    little error: Lloyd's iteration (2-means in one dimension: split at the midpoint, each level the mean of its
    side) from the row's smallest and largest value, ``rounds`` times, with ``hi`` kept at least half the row's
    largest, so that no value is off by more than ``hi`` (:meth:`TopK2Codec.error_bound`). A row of equal values
    gives ``lo = hi``. Levels already two (a decoded payload's) are a fixed point: the codec stays idempotent.

    Against the row's smallest and largest (the levels before), the selected values' coding error falls 2.2×
    (Student-t 3) to 4.6× (the micro model's pseudo-gradient) at 15% of a block; the whole round trip's by 23%
    on heavy tails but 0.7% on that pseudo-gradient, whose top 15% hold only a third of its energy
    (``python bench/topk_levels.py``; bench/results/README.md, "The wire's levels, and a 1-bit wire").
    """
    top = mags.amax(dim=1)
    lo, hi = mags.amin(dim=1), top
    k = mags.shape[1]
    for _ in range(rounds):
        up = mags * 2.0 >= (lo + hi).unsqueeze(1)  # (rows, k): the upper side, as the codes are chosen
        n_up = up.sum(dim=1)
        hi = torch.maximum(torch.where(up, mags, 0.0).sum(dim=1) / n_up.clamp(min=1), top * 0.5)
        lo = torch.where(n_up < k, torch.where(up, 0.0, mags).sum(dim=1) / (k - n_up).clamp(min=1), hi)
    return torch.minimum(lo, hi), hi


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32, finite, >= 0) rounded to bfloat16, saturating below inf, back as float32."""
    return x.clamp(max=_BF16_MAX).to(torch.bfloat16).to(torch.float32)


def _scales_and_codes(name: str, buf: memoryview, nb: int, numel: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense low-bit payload's ``nb`` bfloat16 block scales (as float32) and the ``numel`` codes of ``bits`` bits
    after them; ValueError for a negative or non-finite scale, or nonzero padding bits."""
    scale = _read(buf, torch.int16, 0, nb).view(torch.bfloat16).to(torch.float32)
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise ValueError(f"{name}: invalid block scale (negative or non-finite)")
    codes, clean = unpack_bits(_read_u8(buf, 2 * nb, (numel * bits + 7) // 8), numel, bits)
    if not clean:
        raise ValueError(f"{name}: nonzero padding bits")
    return scale, codes


class TwoBitCodec(Codec):
    """Dense 2 bits per value: sign and one magnitude bit, levels ``absmax·{1/3, 1}`` per block of 128.

    The block scale is its absmax rounded to bfloat16 (``s``); ``|x| >= 2s/3`` codes the high level. Error per
    value: ``<= s/3`` (half the step), plus bfloat16's rounding of ``s`` (``<= 2^-8 s``) for the block's largest.
    An all-zero block has ``s = 0`` and decodes to zeros. Decode refuses a negative or non-finite scale.
    """

    name: ClassVar[str] = "2bit"
    error_feedback: ClassVar[bool] = True
    BLOCK: ClassVar[int] = 128

    def encoded_size(self, numel: int) -> int:
        n = _check_numel(numel)
        return 2 * _blocks(n, self.BLOCK) + (n + 3) // 4

    def _encode(self, x: torch.Tensor) -> bytes:
        n, nb = x.numel(), _blocks(x.numel(), self.BLOCK)
        xb = _pad(x, nb * self.BLOCK).view(nb, self.BLOCK)  # zero padding: absmax unchanged
        scale = _bf16(xb.abs().amax(dim=1))  # (nb,) f32 holding bf16 values
        safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(1)
        level = (xb.abs() >= safe * (2.0 / 3.0)).to(torch.uint8)  # (nb, B)
        codes = (level | ((xb < 0).to(torch.uint8) << 1)).reshape(-1)[:n]
        packed = pack_bits(codes, 2)
        return _to_bytes(scale.to(torch.bfloat16).view(torch.int16), packed)

    def _decode(self, buf: memoryview, numel: int) -> torch.Tensor:
        scale, codes = _scales_and_codes(self.name, buf, _blocks(numel, self.BLOCK), numel, 2)
        mag = torch.where((codes & 1).bool(), 1.0, 1.0 / 3.0).to(torch.float32)
        sign = 1.0 - 2.0 * ((codes >> 1) & 1).to(torch.float32)
        per = scale.repeat_interleave(self.BLOCK)[:numel]
        return sign * mag * per

    def error_bound(self, decoded: torch.Tensor) -> torch.Tensor:
        # The block's largest decoded magnitude is its scale s: its absmax always codes the high level.
        n, nb = decoded.numel(), _blocks(decoded.numel(), self.BLOCK)
        s = _pad(decoded, nb * self.BLOCK).view(nb, self.BLOCK).abs().amax(dim=1)
        bound = s * (1.0 / 3.0 + 2.0**-7) + 1e-38
        return bound.repeat_interleave(self.BLOCK)[:n].clone()


class OneBitCodec(Codec):
    """Dense 1 bit per value: its sign, and per block of 256 one magnitude, the mean of the block's ``|x|``.

    The mean absolute value is the level that keeps the most of a block's energy among sign codes (it minimises
    ``‖x − s·sign(x)‖²``): a pseudo-gradient of AdamW steps has values of similar size, and this codec carries
    ~80% of its energy per round at 1.06 bits a value, where ``topk2:0.15`` carries ~35% at 1.03
    (``python bench/topk_levels.py``; bench/results/README.md, "The wire's levels, and a 1-bit wire"). ``s`` is
    rounded to bfloat16; a value's code is 1 when it is negative (0 and +0 code +s). Error per value
    ``||x| − s|``: at most ``(L − 1)·s`` in a block of ``L`` values (one value may hold the whole block's mass),
    which is all a decoded payload tells. A block's mean is over
    its own values (a shorter last block is not padded). Idempotent: ``±s`` has mean magnitude ``s``.
    """

    name: ClassVar[str] = "1bit"
    error_feedback: ClassVar[bool] = True
    BLOCK: ClassVar[int] = 256

    def encoded_size(self, numel: int) -> int:
        n = _check_numel(numel)
        return 2 * _blocks(n, self.BLOCK) + (n + 7) // 8

    def _lengths(self, n: int, nb: int) -> torch.Tensor:
        """(nb,) the length of each block (the last one may be shorter), as float32."""
        lengths = torch.full((nb,), float(self.BLOCK))
        lengths[-1] = float(n - (nb - 1) * self.BLOCK)
        return lengths

    def _encode(self, x: torch.Tensor) -> bytes:
        n, nb = x.numel(), _blocks(x.numel(), self.BLOCK)
        xb = _pad(x, nb * self.BLOCK).view(nb, self.BLOCK)  # zero padding: adds nothing to a block's sum
        scale = _bf16(xb.abs().sum(dim=1) / self._lengths(n, nb))  # (nb,) f32 holding bf16 values
        signs = (x < 0).to(torch.uint8)
        return _to_bytes(scale.to(torch.bfloat16).view(torch.int16), pack_bits(signs, 1))

    def _decode(self, buf: memoryview, numel: int) -> torch.Tensor:
        scale, signs = _scales_and_codes(self.name, buf, _blocks(numel, self.BLOCK), numel, 1)
        per = scale.repeat_interleave(self.BLOCK)[:numel]
        return torch.where(signs.bool(), -per, per)

    def error_bound(self, decoded: torch.Tensor) -> torch.Tensor:
        # |x| <= L·s − (the other values' magnitudes) <= L·s, so ||x| − s| <= (L − 1)·s; s is read back as the
        # block's decoded magnitude (rounded to bfloat16 from the mean: a relative 2^-8 more).
        n, nb = decoded.numel(), _blocks(decoded.numel(), self.BLOCK)
        s = _pad(decoded, nb * self.BLOCK).view(nb, self.BLOCK).abs().amax(dim=1)
        bound = s * (self._lengths(n, nb) - 1.0 + 2.0**-7) * (1.0 + 2.0**-7) + 1e-38
        return bound.repeat_interleave(self.BLOCK)[:n].clone()


class TopK2Codec(Codec):
    """Top-k per block of 1024 values, the k largest magnitudes sent at 2 bits with their indices.

    ``K = round(fraction·1024)`` slots per block (10 for 1%), ``min(K, L)`` for a last block of ``L`` values.
    The selected magnitudes are quantised to two levels ``lo`` and ``hi`` (:func:`two_levels`: the means of the
    two sides of a 2-means split, ``hi`` at least half the largest; each rounded to bfloat16), whichever is
    nearer; the rest of the block decodes to 0. Per value: an entry not selected had ``|x| <= lo`` (``lo`` is at
    least the smallest selected magnitude); a selected one is off by at most ``hi`` (plus bfloat16's rounding).
    Indices are offsets within the block, strictly increasing, in Elias–Fano form (the module docstring). With
    ``K`` selected of 1024 the payload is ``(K·(l + 3) + 1024/2^l + 32)/1024`` bits per value: 0.135 for 1%
    (237× less than fp32; 216× with plain 10-bit indices), 0.305 for 3% (105×; was 81×).
    """

    name: ClassVar[str] = "topk2"
    error_feedback: ClassVar[bool] = True
    BLOCK: ClassVar[int] = 1024
    FRACTION: ClassVar[float] = 0.01

    @classmethod
    def slots(cls) -> int:
        """K, the slots of a full block."""
        return max(1, round(cls.FRACTION * cls.BLOCK))

    @classmethod
    def low_bits(cls) -> int:
        """l = ⌊log2(BLOCK / K)⌋: the bits of an index sent as they are (the rest: the high bitvector)."""
        return (cls.BLOCK // cls.slots()).bit_length() - 1

    def _slot_counts(self, numel: int) -> tuple[int, int, int]:
        """(blocks, slots in total, length of the last block)."""
        nb = _blocks(numel, self.BLOCK)
        last = numel - (nb - 1) * self.BLOCK if nb else 0
        k = self.slots()
        return nb, (nb - 1) * k + min(k, last) if nb else 0, last

    def _high_bits(self, nb: int, last: int) -> tuple[int, int]:
        """(bits of a full block's high bitvector, bits of the last block's), for ``nb`` blocks."""
        k, nl = self.slots(), self.low_bits()
        full = k + (self.BLOCK >> nl)
        return full, (min(k, last) + ((last + (1 << nl) - 1) >> nl)) if nb else 0

    def encoded_size(self, numel: int) -> int:
        nb, s, last = self._slot_counts(_check_numel(numel))
        full, tail = self._high_bits(nb, last)
        high = (nb - 1) * full + tail if nb else 0
        return 4 * nb + (s * self.low_bits() + 7) // 8 + (high + 7) // 8 + (s + 3) // 4

    def _index_bits(self, idx: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The Elias–Fano sections of sorted slot indices ``idx`` (rows, k) of blocks of ``length`` positions: each
        index's low ``l`` bits, and each block's high bitvector (slot j's bit at ``(i_j >> l) + j``)."""
        nl = self.low_bits()
        rows, kk = idx.shape
        bits = torch.zeros(rows, kk + ((length + (1 << nl) - 1) >> nl), dtype=torch.int64)
        bits.scatter_(1, (idx >> nl) + torch.arange(kk, dtype=torch.int64), 1)
        return (idx & ((1 << nl) - 1)).reshape(-1), bits.reshape(-1)

    def _read_indices(self, buf: memoryview, nb: int, s: int, last: int,
                      ncodes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """After ``nb`` block headers: the ``s`` slots' indices (within their block of ``BLOCK`` positions, the last
        of ``last``), the block of each slot, and the ``ncodes`` 2-bit codes that follow. ValueError for nonzero
        padding bits, a high bitvector without one set bit per slot, an index outside its block, or indices of a
        block not strictly increasing."""
        k, nl = self.slots(), self.low_bits()
        pos = 4 * nb
        lb = (s * nl + 7) // 8
        low, clean_l = unpack_bits(_read_u8(buf, pos, lb), s, nl)
        pos += lb
        full_w, tail_w = self._high_bits(nb, last)
        hbits = (nb - 1) * full_w + tail_w if nb else 0
        high, clean_h = unpack_bits(_read_u8(buf, pos, (hbits + 7) // 8), hbits, 1)
        pos += (hbits + 7) // 8
        codes, clean_c = unpack_bits(_read_u8(buf, pos, (ncodes + 3) // 4), ncodes, 2)
        if not (clean_l and clean_h and clean_c):
            raise ValueError(f"{self.name}: nonzero padding bits")
        # Each block's high parts from its bitvector: slot j's set bit at (i_j >> l) + j.
        parts = [(nb - 1, full_w, k), (1, tail_w, min(k, last))] if nb else []
        his_idx, at = [], 0
        for rows, width, kk in parts:
            bits = high[at : at + rows * width].view(rows, width)
            at += rows * width
            if rows and not bool((bits.sum(dim=1) == kk).all()):
                raise ValueError(f"{self.name}: a block's high bitvector does not hold one set bit per slot")
            cols = bits.nonzero()[:, 1].view(rows, kk)
            his_idx.append((cols - torch.arange(kk, dtype=torch.int64)).reshape(-1))
        idx = (torch.cat(his_idx) << nl | low) if nb else low
        # Block of each slot, and the length of that block (the last one may be shorter).
        block = torch.arange(nb, dtype=torch.int64).repeat_interleave(
            torch.tensor([k] * (nb - 1) + [min(k, last)], dtype=torch.int64))
        if bool((idx >= torch.where(block == nb - 1, last, self.BLOCK)).any()):
            raise ValueError(f"{self.name}: index outside its block")
        if bool(((block[1:] == block[:-1]) & (idx[1:] <= idx[:-1])).any()):
            raise ValueError(f"{self.name}: indices of a block not strictly increasing (unsorted or duplicated)")
        return idx, block, codes

    def _encode(self, x: torch.Tensor) -> bytes:
        n = x.numel()
        nb, _, last = self._slot_counts(n)
        k, nl = self.slots(), self.low_bits()
        full = (nb - 1) if last < self.BLOCK else nb
        rows_of: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (indices, values, block length) of each kind
        if full:
            xb = x[: full * self.BLOCK].view(full, self.BLOCK)
            idx = xb.abs().topk(k, dim=1).indices.sort(dim=1).values  # (full, K) int64
            rows_of.append((idx, xb.gather(1, idx), self.BLOCK))
        if full < nb:  # a shorter last block
            tail = x[full * self.BLOCK :]
            idx = tail.abs().topk(min(k, last)).indices.sort().values.unsqueeze(0)
            rows_of.append((idx, tail[idx[0]].unsqueeze(0), last))
        los, his, codes, lows, highs = [], [], [], [], []
        for idx, vals, length in rows_of:
            mags = vals.abs()  # (rows, k) f32
            lo, hi = two_levels(mags)
            lo_b, hi_b = _bf16(lo), _bf16(hi)  # (rows,)
            level = (mags * 2.0 >= (lo_b + hi_b).unsqueeze(1)) & (hi_b > lo_b).unsqueeze(1)
            level |= (lo_b == hi_b).unsqueeze(1) & (hi_b > 0).unsqueeze(1)  # one level: code it as hi
            codes.append((level.to(torch.uint8) | ((vals < 0) & (mags > 0)).to(torch.uint8) << 1).reshape(-1))
            low, high = self._index_bits(idx, length)
            lows.append(low)
            highs.append(high)
            los.append(lo_b)
            his.append(hi_b)
        header = torch.stack([torch.cat(los), torch.cat(his)], dim=1).reshape(-1)  # lo0, hi0, lo1, hi1, ...
        return _to_bytes(header.to(torch.bfloat16).view(torch.int16), pack_bits(torch.cat(lows), nl),
                         pack_bits(torch.cat(highs), 1), pack_bits(torch.cat(codes), 2))

    def _decode(self, buf: memoryview, numel: int) -> torch.Tensor:
        nb, s, last = self._slot_counts(numel)
        header = _read(buf, torch.int16, 0, 2 * nb).view(torch.bfloat16).to(torch.float32).view(nb, 2)
        lo, hi = header[:, 0], header[:, 1]
        if not bool(torch.isfinite(header).all()) or bool((lo < 0).any()) or bool((lo > hi).any()):
            raise ValueError(f"{self.name}: invalid block header (non-finite, negative or lo > hi)")
        idx, block, codes = self._read_indices(buf, nb, s, last, s)
        mag = torch.where((codes & 1).bool(), hi[block], lo[block])
        vals = torch.where(((codes >> 1) & 1).bool(), -mag, mag)
        out = torch.zeros(numel, dtype=torch.float32)
        out[block * self.BLOCK + idx] = vals
        return out

    def error_bound(self, decoded: torch.Tensor) -> torch.Tensor:
        # Not selected: |x| <= lo <= hi; selected: off by <= hi (the largest is at most 2·hi, the rest lie between
        # 0 and it). hi is the block's largest decoded magnitude (lo and hi are bfloat16-rounded: a relative 2^-8).
        n, nb = decoded.numel(), _blocks(decoded.numel(), self.BLOCK)
        top = _pad(decoded, nb * self.BLOCK).view(nb, self.BLOCK).abs().amax(dim=1)
        bound = top * (1.0 + 2.0**-7) + 1e-38
        return bound.repeat_interleave(self.BLOCK)[:n].clone()


class TopK2Codec3(TopK2Codec):
    """:class:`TopK2Codec` with 3% of each block (31 of 1024 values)."""

    name: ClassVar[str] = "topk2:0.03"
    FRACTION: ClassVar[float] = 0.03
