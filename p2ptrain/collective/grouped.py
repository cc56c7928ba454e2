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

from .codec_base import _blocks, _check_numel, _pad, _read, _to_bytes
from .lowbit import TopK2Codec, pack_bits

__all__ = ["TopK2GroupCodec"]


def _bf16_down(x: torch.Tensor) -> torch.Tensor:
    """Non-negative float32 values truncated to bfloat16 (toward zero), as float32."""
    return (x.contiguous().view(torch.int32) & -65536).view(torch.float32)


def _bf16_near(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


class TopK2GroupCodec(TopK2Codec):
    """Top-k groups of ``GROUP`` values per block of ``BLOCK`` groups, every value of a selected group at 2 bits
    (the module docstring). ``FRACTION``: the share of groups (so of values) sent. The slots, their indices and
    their checks are topk2's, over the block's groups instead of its values."""

    name: ClassVar[str] = "topk2g4:0.03"
    error_feedback: ClassVar[bool] = True
    GROUP: ClassVar[int] = 4
    BLOCK: ClassVar[int] = 256  # groups a block (1024 values)
    FRACTION: ClassVar[float] = 0.03

    def _layout(self, numel: int) -> tuple[int, int, int, int]:
        """(groups, blocks, slots in total, groups of the last block)."""
        m = _blocks(numel, self.GROUP)
        nb = _blocks(m, self.BLOCK)
        last = m - (nb - 1) * self.BLOCK if nb else 0
        k = self.slots()
        return m, nb, (nb - 1) * k + min(k, last) if nb else 0, last

    def encoded_size(self, numel: int) -> int:
        _, nb, s, last = self._layout(_check_numel(numel))
        full, tail = self._high_bits(nb, last)
        high = (nb - 1) * full + tail if nb else 0
        return 4 * nb + (s * self.low_bits() + 7) // 8 + (high + 7) // 8 + (s * self.GROUP + 3) // 4

    def _encode(self, x: torch.Tensor) -> bytes:
        g, k, nl = self.GROUP, self.slots(), self.low_bits()
        m, nb, _, last = self._layout(x.numel())
        xg = _pad(x, m * g).view(m, g)
        full = nb - 1 if last < self.BLOCK else nb
        kinds: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (group indices, values, block's groups) per row
        if full:
            blk = xg[: full * self.BLOCK].view(full, self.BLOCK, g)
            idx = blk.abs().sum(dim=2).topk(k, dim=1).indices.sort(dim=1).values  # (full, K)
            kinds.append((idx, blk.gather(1, idx.unsqueeze(2).expand(-1, -1, g)), self.BLOCK))
        if full < nb:
            tail = xg[full * self.BLOCK :]
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
            low, high = self._index_bits(idx, length)
            lows.append(low)
            highs.append(high)
            los.append(lo)
            his.append(hi)
        header = torch.stack([torch.cat(los), torch.cat(his)], dim=1).reshape(-1)
        return _to_bytes(header.to(torch.bfloat16).view(torch.int16), pack_bits(torch.cat(lows), nl),
                         pack_bits(torch.cat(highs), 1), pack_bits(torch.cat(codes), 2))

    def _decode(self, buf: memoryview, numel: int) -> torch.Tensor:
        g = self.GROUP
        m, nb, s, last = self._layout(numel)
        header = _read(buf, torch.int16, 0, 2 * nb).view(torch.bfloat16).to(torch.float32).view(nb, 2)
        lo, hi = header[:, 0], header[:, 1]
        if not bool(torch.isfinite(header).all()) or bool((lo < 0).any()) or bool(((lo * 2 >= hi) & (hi > 0)).any()) \
                or bool(((hi == 0) & (lo != 0)).any()):
            raise ValueError(f"{self.name}: invalid block header (non-finite, negative, or lo not under hi/2)")
        idx, block, codes = self._read_indices(buf, nb, s, last, s * g)
        codes = codes.view(s, g)
        mag = torch.where((codes & 1).bool(), hi[block].unsqueeze(1), lo[block].unsqueeze(1))
        vals = torch.where(((codes >> 1) & 1).bool(), -mag, mag)
        out = torch.zeros(m * g, dtype=torch.float32)
        at_ = ((block * self.BLOCK + idx) * g).unsqueeze(1) + torch.arange(g, dtype=torch.int64)
        out[at_.reshape(-1)] = vals.reshape(-1)
        past = at_.reshape(-1) >= numel
        if bool((codes.reshape(-1)[past] != 0).any()):
            raise ValueError(f"{self.name}: nonzero codes for the padding past the last value")
        return out[:numel].clone()

    def error_bound(self, decoded: torch.Tensor) -> torch.Tensor:
        # Selected: off by at most hi/2. Not selected: |x| is at most its group's sum of magnitudes, at most the
        # smallest selected group's, at most G·hi. hi is the block's largest decoded magnitude (bf16-rounded).
        n, per = decoded.numel(), self.GROUP * self.BLOCK
        nb = _blocks(n, per)
        top = _pad(decoded, nb * per).view(nb, per).abs().amax(dim=1)
        bound = top * self.GROUP * (1.0 + 2.0**-7) + 1e-38
        return bound.repeat_interleave(per)[:n].clone()
