"""A sparse 2-bit codec that selects groups of G consecutive values, not single values: ``topk2g4:F``.

topk2 (collective/lowbit.py) spends about 7 of the ~10 bits it sends for a value at 3% on the value's index
(Elias–Fano already: within 0.5 bit of the entropy of a random subset). Indices are the cost that the payload
ratio stands on, so they are shared here by G = 4 neighbours: a block of 1024 values is 256 groups, the K groups
(K = round(F·256)) with the largest sum of magnitudes are sent, every value of a selected group at 2 bits. At F =
0.03 a payload is 0.148 bits a value against topk2:0.03's 0.305 (2.06× fewer), at the price of sending the
neighbours of the values that matter instead of the next values that matter (what error feedback keeps for later).

Layout (little-endian; ``n`` values padded with zeros to whole groups; blocks of 256 groups, the last of ``L``
groups possibly shorter, with ``min(K, L)`` slots): per block (lo, hi) bf16; then every slot's group index in
Elias–Fano form (low ``l = ⌊log2(256 / K)⌋`` bits packed, then each block's high bitvector of ``k_b + ⌈L_b/2^l⌉``
bits, as topk2's); then ``G`` 2-bit codes per slot (``sign << 1 | level``), 4 per byte.

Levels: ``hi`` is the largest selected magnitude (bf16, rounded to nearest), ``lo`` the mean of the nonzero
selected magnitudes under ``hi/2`` (bf16, rounded toward zero, so that ``lo < hi/2``), 0 if there are none; a
selected value decodes to ``±hi`` if its magnitude is at least ``hi/2``, else ``±lo``. (topk2's levels are the
smallest and largest selected magnitude; in a group the smallest is often 0, which left one level.) The codec
is idempotent (a decoded payload encodes to the same values) and refuses hostile payloads as topk2 does, plus a
header with ``lo ≥ hi/2`` and nonzero codes for the padding past ``n``.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from .codec_base import Codec, _blocks, _check_numel, _pad, _read, _read_u8, _to_bytes
from .lowbit import pack_bits, unpack_bits

__all__ = ["TopK2GroupCodec"]


def _bf16_down(x: torch.Tensor) -> torch.Tensor:
    """Non-negative float32 values truncated to bfloat16 (toward zero), as float32."""
    return (x.contiguous().view(torch.int32) & -65536).view(torch.float32)


def _bf16_near(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


class TopK2GroupCodec(Codec):
    """Top-k groups of ``GROUP`` values per block of ``GROUPS`` groups, every value of a selected group at 2 bits
    (the module docstring). ``FRACTION``: the share of groups (so of values) sent."""

    name: ClassVar[str] = "topk2g4:0.03"
    error_feedback: ClassVar[bool] = True
    GROUP: ClassVar[int] = 4
    GROUPS: ClassVar[int] = 256
    FRACTION: ClassVar[float] = 0.03

    @classmethod
    def slots(cls) -> int:
        """K, the groups sent of a full block."""
        return max(1, round(cls.FRACTION * cls.GROUPS))

    @classmethod
    def low_bits(cls) -> int:
        return (cls.GROUPS // cls.slots()).bit_length() - 1

    def _layout(self, numel: int) -> tuple[int, int, int, int]:
        """(groups, blocks, slots in total, groups of the last block)."""
        m = _blocks(numel, self.GROUP)
        nb = _blocks(m, self.GROUPS)
        last = m - (nb - 1) * self.GROUPS if nb else 0
        k = self.slots()
        return m, nb, (nb - 1) * k + min(k, last) if nb else 0, last

    def _high_bits(self, nb: int, last: int) -> tuple[int, int]:
        k, nl = self.slots(), self.low_bits()
        return k + (self.GROUPS >> nl), (min(k, last) + ((last + (1 << nl) - 1) >> nl)) if nb else 0

    def encoded_size(self, numel: int) -> int:
        _, nb, s, last = self._layout(_check_numel(numel))
        full, tail = self._high_bits(nb, last)
        high = (nb - 1) * full + tail if nb else 0
        return 4 * nb + (s * self.low_bits() + 7) // 8 + (high + 7) // 8 + (s * self.GROUP + 3) // 4

    def _encode(self, x: torch.Tensor) -> bytes:
        g, k, nl = self.GROUP, self.slots(), self.low_bits()
        m, nb, _, last = self._layout(x.numel())
        xg = _pad(x, m * g).view(m, g)
        full = nb - 1 if last < self.GROUPS else nb
        kinds: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (group indices, values, block's groups) per row
        if full:
            blk = xg[: full * self.GROUPS].view(full, self.GROUPS, g)
            idx = blk.abs().sum(dim=2).topk(k, dim=1).indices.sort(dim=1).values  # (full, K)
            kinds.append((idx, blk.gather(1, idx.unsqueeze(2).expand(-1, -1, g)), self.GROUPS))
        if full < nb:
            tail = xg[full * self.GROUPS :]
            idx = tail.abs().sum(dim=1).topk(min(k, last)).indices.sort().values
            kinds.append((idx.unsqueeze(0), tail[idx].unsqueeze(0), last))
        los, his, codes, lows, highs = [], [], [], [], []
        for idx, vals, length in kinds:
            mags = vals.abs().flatten(1)  # (rows, kk·G)
            hi = _bf16_near(mags.amax(dim=1))
            upper = mags * 2.0 >= hi.unsqueeze(1)
            under = ~upper & (mags > 0)
            mean = (mags * under).sum(dim=1) / under.sum(dim=1).clamp(min=1)
            lo = torch.minimum(_bf16_down(mean), hi)  # (hi 0: every magnitude is 0, so is the mean)
            level = upper & (hi > 0).unsqueeze(1)
            codes.append((level.to(torch.uint8) | ((vals.flatten(1) < 0) & (mags > 0)).to(torch.uint8) << 1)
                         .reshape(-1))
            lows.append((idx & ((1 << nl) - 1)).reshape(-1))
            rows, kk = idx.shape
            bits = torch.zeros(rows, kk + ((length + (1 << nl) - 1) >> nl), dtype=torch.int64)
            bits.scatter_(1, (idx >> nl) + torch.arange(kk, dtype=torch.int64), 1)
            highs.append(bits.reshape(-1))
            los.append(lo)
            his.append(hi)
        header = torch.stack([torch.cat(los), torch.cat(his)], dim=1).reshape(-1)
        return _to_bytes(header.to(torch.bfloat16).view(torch.int16), pack_bits(torch.cat(lows), nl),
                         pack_bits(torch.cat(highs), 1), pack_bits(torch.cat(codes), 2))

    def _decode(self, buf: memoryview, numel: int) -> torch.Tensor:
        g, k, nl = self.GROUP, self.slots(), self.low_bits()
        m, nb, s, last = self._layout(numel)
        header = _read(buf, torch.int16, 0, 2 * nb).view(torch.bfloat16).to(torch.float32).view(nb, 2)
        lo, hi = header[:, 0], header[:, 1]
        if not bool(torch.isfinite(header).all()) or bool((lo < 0).any()) or bool(((lo * 2 >= hi) & (hi > 0)).any()) \
                or bool(((hi == 0) & (lo != 0)).any()):
            raise ValueError(f"{self.name}: invalid block header (non-finite, negative, or lo not under hi/2)")
        pos = 4 * nb
        lb = (s * nl + 7) // 8
        low, clean_l = unpack_bits(_read_u8(buf, pos, lb), s, nl)
        pos += lb
        full_w, tail_w = self._high_bits(nb, last)
        hbits = (nb - 1) * full_w + tail_w if nb else 0
        high, clean_h = unpack_bits(_read_u8(buf, pos, (hbits + 7) // 8), hbits, 1)
        pos += (hbits + 7) // 8
        codes, clean_c = unpack_bits(_read_u8(buf, pos, (s * g + 3) // 4), s * g, 2)
        if not (clean_l and clean_h and clean_c):
            raise ValueError(f"{self.name}: nonzero padding bits")
        parts = [(nb - 1, full_w, k), (1, tail_w, min(k, last))] if nb else []
        his_idx, at = [], 0
        for rows, width, kk in parts:
            bits = high[at : at + rows * width].view(rows, width)
            at += rows * width
            if rows and not bool((bits.sum(dim=1) == kk).all()):
                raise ValueError(f"{self.name}: a block's high bitvector does not hold one set bit per slot")
            his_idx.append((bits.nonzero()[:, 1].view(rows, kk) - torch.arange(kk, dtype=torch.int64)).reshape(-1))
        idx = (torch.cat(his_idx) << nl | low) if nb else low
        block = torch.arange(nb, dtype=torch.int64).repeat_interleave(
            torch.tensor([k] * (nb - 1) + [min(k, last)], dtype=torch.int64))
        if bool((idx >= torch.where(block == nb - 1, last, self.GROUPS)).any()):
            raise ValueError(f"{self.name}: index outside its block")
        if bool(((block[1:] == block[:-1]) & (idx[1:] <= idx[:-1])).any()):
            raise ValueError(f"{self.name}: indices of a block not strictly increasing (unsorted or duplicated)")
        codes = codes.view(s, g)
        mag = torch.where((codes & 1).bool(), hi[block].unsqueeze(1), lo[block].unsqueeze(1))
        vals = torch.where(((codes >> 1) & 1).bool(), -mag, mag)
        out = torch.zeros(m * g, dtype=torch.float32)
        at_ = ((block * self.GROUPS + idx) * g).unsqueeze(1) + torch.arange(g, dtype=torch.int64)
        out[at_.reshape(-1)] = vals.reshape(-1)
        past = at_.reshape(-1) >= numel
        if bool((codes.reshape(-1)[past] != 0).any()):
            raise ValueError(f"{self.name}: nonzero codes for the padding past the last value")
        return out[:numel].clone()

    def error_bound(self, decoded: torch.Tensor) -> torch.Tensor:
        # Selected: off by at most hi/2. Not selected: |x| is at most its group's sum of magnitudes, at most the
        # smallest selected group's, at most G·hi. hi is the block's largest decoded magnitude (bf16-rounded).
        n, per = decoded.numel(), self.GROUP * self.GROUPS
        nb = _blocks(n, per)
        top = _pad(decoded, nb * per).view(nb, per).abs().amax(dim=1)
        bound = top * self.GROUP * (1.0 + 2.0**-7) + 1e-38
        return bound.repeat_interleave(per)[:n].clone()
