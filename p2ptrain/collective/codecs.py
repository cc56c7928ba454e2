"""Wire codecs: one 1-D float tensor to the exact bytes sent over the wire, and back (torch and stdlib only).

They only quantise the *transfer*: a receiver decodes to float32 and every sum or average is taken in float32
(or float64, see :mod:`p2ptrain.collective.aggregate`). Used by every all-reduce: the simulator's, the in-memory
swarm's and the libp2p butterfly's.

Payload layouts (all multi-byte numbers little-endian; ``n`` values, blocks counted with ``ceil``):

=========  ===============================================================  ==============================
codec      layout                                                           bytes
=========  ===============================================================  ==============================
``fp32``   ``n`` float32                                                    ``4n``
``fp16``   ``n`` float16                                                    ``2n``
``bf16``   ``n`` bfloat16 (the int16 bit pattern)                           ``2n``
``uint8``  per block of 1024: (min, max) float32 pairs, then ``n`` uint8    ``n + 8*ceil(n/1024)``
``fp8``    per row of 256: scale float32, then ``n`` float8 e4m3 codes      ``n + 4*ceil(n/256)``
``e3m0``   per block of 64: scale float32, then ``n`` 4-bit codes, 2/byte   ``ceil(n/2) + 4*ceil(n/64)``
=========  ===============================================================  ==============================

The 2-bit codecs (``2bit``, ``topk2``, ``topk2:0.03``), meant to run behind error feedback, are in
:mod:`p2ptrain.collective.lowbit` (``topk2g4:F``, whose groups of 4 values share an index, in
:mod:`p2ptrain.collective.grouped`); the :class:`Codec` contract and the byte helpers in
:mod:`p2ptrain.collective.codec_base`. All are registered in :data:`CODECS` here.

All block headers come first, then the packed values, so both sides vectorise without per-block loops.

Bytes are read and written through ``torch.frombuffer`` (no host array library): the layouts above are
little-endian, so a big-endian host byte-swaps (see :func:`p2ptrain.collective.codec_base._le`).
"""

from __future__ import annotations

import ctypes
from typing import ClassVar

import torch

from .codec_base import (
    _F32_MAX,
    _LITTLE,
    Codec,
    _blocks,
    _check_numel,
    _pad,
    _read,
    _read_f32,
    _read_u8,
    _to_bytes,
    all_finite,
)
from .grouped import TopK2GroupCodec
from .lowbit import OneBitCodec, TopK2Codec, TopK2Codec3, TwoBitCodec

__all__ = [
    "CODECS",
    "BF16Codec",
    "Codec",
    "E3M0Codec",
    "FP8Codec",
    "FP16Codec",
    "FP32Codec",
    "Uint8Codec",
    "get_codec",
    "is_codec",
]


class FP32Codec(Codec):
    """Raw little-endian float32: lossless, 4 bytes per value."""

    name: ClassVar[str] = "fp32"
    value_bytes: ClassVar[int] = 4
    elementwise_bound = True
    computes: ClassVar[bool] = False  # raw bytes: nothing to compute

    def encoded_size(self, numel: int) -> int:
        return 4 * _check_numel(numel)

    def _encode(self, x: torch.Tensor) -> bytes:
        if _LITTLE and x.device.type == "cpu":  # one copy (the generic path makes a bytearray, then bytes of it)
            return x.detach().contiguous().numpy().tobytes()
        return _to_bytes(x)

    def _decode(self, buf: memoryview, numel: int) -> torch.Tensor:
        return _read_f32(buf, 0, numel)

    def decode_into(self, data: bytes, out: torch.Tensor) -> None:
        """The payload's bytes copied straight into ``out`` (one copy, where decode's tensor and a copy of it were
        two: 0.7 ms against 4.2 ms for 16 MB here), then checked finite."""
        n = out.numel()
        buf = memoryview(data).cast("B")
        if len(buf) != 4 * n:
            raise ValueError(f"{self.name}: payload for {n} values must be {4 * n} bytes, got {len(buf)}")
        if n == 0:
            return
        if (not _LITTLE or not isinstance(data, bytes) or out.dtype != torch.float32 or out.device.type != "cpu"
                or not out.is_contiguous()):
            out.copy_(self.decode(data, n))
            return
        ctypes.memmove(out.data_ptr(), data, len(data))  # (the GIL let go, as a torch copy does)
        if not all_finite(out):
            raise ValueError(f"{self.name}: payload decodes to non-finite values")


class FP16Codec(Codec):
    """IEEE half precision, 2 bytes per value: relative error <= 2^-11 within the normal range.

    Finite values beyond +-65504 saturate to +-65504 instead of becoming inf (one outlier must not poison the
    average); magnitudes below 2^-24 flush to zero.
    """

    name: ClassVar[str] = "fp16"
    value_bytes: ClassVar[int] = 2
    elementwise_bound = True
    _MAX: ClassVar[float] = float(torch.finfo(torch.float16).max)

    def encoded_size(self, numel: int) -> int:
        return 2 * _check_numel(numel)

    def _encode(self, x: torch.Tensor) -> bytes:
        return _to_bytes(x.clamp(-self._MAX, self._MAX).to(torch.float16))

    def _decode(self, buf: memoryview, numel: int) -> torch.Tensor:
        return _read(buf, torch.float16, 0, numel).to(torch.float32)

    def error_bound(self, decoded: torch.Tensor) -> torch.Tensor:
        out = decoded.abs() * 2.0**-11 + 2.0**-25
        return out.masked_fill_(decoded.abs() >= self._MAX, float("inf"))


class BF16Codec(Codec):
    """bfloat16 (float32's exponent, 8 significant bits), 2 bytes per value: relative error <= 2^-8.

    Sent as the little-endian int16 bit pattern. Values
    beyond bfloat16's largest finite value (about 3.39e38) saturate instead of rounding to inf.
    """

    name: ClassVar[str] = "bf16"
    value_bytes: ClassVar[int] = 2
    elementwise_bound = True
    _MAX: ClassVar[float] = float(torch.finfo(torch.bfloat16).max)

    def encoded_size(self, numel: int) -> int:
        return 2 * _check_numel(numel)

    def _encode(self, x: torch.Tensor) -> bytes:
        return _to_bytes(x.clamp(-self._MAX, self._MAX).to(torch.bfloat16).view(torch.int16))

    def _decode(self, buf: memoryview, numel: int) -> torch.Tensor:
        return _read(buf, torch.int16, 0, numel).view(torch.bfloat16).to(torch.float32)

    def error_bound(self, decoded: torch.Tensor) -> torch.Tensor:
        out = decoded.abs() * 2.0**-8 + 2.0**-133
        return out.masked_fill_(decoded.abs() >= self._MAX, float("inf"))


class Uint8Codec(Codec):
    """Min-max affine 8-bit quantisation per block of 1024 values.

    Each block stores its min and max (float32) and one uint8 per value, ``q = round((x - min) / step)`` with
    ``step = (max - min) / 255``, so ``|x - decoded| <= step / 2`` plus float32 rounding. Decoding computes
    ``min*(1 - q/255) + max*(q/255)``, which returns min and max exactly and cannot overflow; a constant block
    decodes exactly. Decode raises ValueError for a header with min > max or non-finite bounds.
    """

    name: ClassVar[str] = "uint8"
    BLOCK: ClassVar[int] = 1024

    def encoded_size(self, numel: int) -> int:
        n = _check_numel(numel)
        return n + 8 * _blocks(n, self.BLOCK)

    def _encode(self, x: torch.Tensor) -> bytes:
        n, nb = x.numel(), _blocks(x.numel(), self.BLOCK)
        # Pad with the last value: it already belongs to the last block, so that block's min/max are unchanged.
        xb = _pad(x, nb * self.BLOCK, x[-1:]).view(nb, self.BLOCK)  # (nb, 1024) f32
        lo, hi = xb.amin(dim=1), xb.amax(dim=1)  # (nb,) f32
        # Work on halves so that max - min and x - min stay finite even for bounds near +-float32 max.
        lo_h = (lo * 0.5).unsqueeze(1)  # (nb, 1)
        step_h = (hi * 0.5 - lo * 0.5) / 255.0  # (nb,) half the quantisation step
        step_h = torch.where(step_h > 0, step_h, torch.ones_like(step_h)).unsqueeze(1)  # constant block -> q = 0
        q = ((xb * 0.5 - lo_h) / step_h).round_().clamp_(0, 255).to(torch.uint8)  # (nb, 1024)
        header = torch.stack([lo, hi], dim=1).reshape(-1)  # (2*nb,) f32: min0, max0, min1, max1, ...
        return _to_bytes(header, q.reshape(-1)[:n])

    def _decode(self, buf: memoryview, numel: int) -> torch.Tensor:
        nb = _blocks(numel, self.BLOCK)
        header = _read_f32(buf, 0, 2 * nb).view(nb, 2)
        lo, hi = header[:, :1], header[:, 1:]  # (nb, 1) each
        if not bool(torch.isfinite(header).all()) or bool((lo > hi).any()):
            raise ValueError(f"{self.name}: invalid block header (non-finite bounds or min > max)")
        q = _pad(_read_u8(buf, 8 * nb, numel), nb * self.BLOCK, 0).view(nb, self.BLOCK)
        w = q.to(torch.float32).div_(255.0)  # (nb, 1024) in [0, 1]; w = 1 exactly for q = 255
        # Convex combination min*(1-w) + max*w: exact at both ends and never overflows (unlike min + w*(max-min)).
        out = torch.rsub(w, 1.0).mul_(lo).add_(w.mul_(hi))
        return out.reshape(-1)[:numel]

    def error_bound(self, decoded: torch.Tensor) -> torch.Tensor:
        # A block's min and max decode exactly (codes 0 and 255): the step is read back from them.
        n, nb = decoded.numel(), _blocks(decoded.numel(), self.BLOCK)
        xb = _pad(decoded, nb * self.BLOCK, decoded[-1:]).view(nb, self.BLOCK)
        hi, lo = xb.amax(dim=1), xb.amin(dim=1)
        # Half a step, and float32 rounding of the decode's convex combination (relative to the block's bounds).
        half_step = (hi - lo) / 510.0 + torch.maximum(hi.abs(), lo.abs()) * 2.0**-22
        return half_step.unsqueeze(1).expand(nb, self.BLOCK).reshape(-1)[:n].clone()


class FP8Codec(Codec):
    """float8 e4m3 (``torch.float8_e4m3fn``) with one float32 scale per row of 256 values.

    Following the FP8 formats paper (arXiv 2209.05433), each row is scaled by ``absmax / 448`` (448 is e4m3's
    largest finite value) so the row's largest magnitude lands on the top of the range. Error per value:
    ``<= 2^-4 |x|`` for scaled magnitudes in e4m3's normal range, ``<= scale * 2^-10`` in its subnormal range.
    An all-zero row stores scale 0 and decodes to zeros (no division by zero). Decode raises ValueError for a
    negative or non-finite scale or a NaN code (0x7f, 0xff).
    """

    name: ClassVar[str] = "fp8"
    ROW: ClassVar[int] = 256
    _MAX: ClassVar[float] = float(torch.finfo(torch.float8_e4m3fn).max)  # 448

    def encoded_size(self, numel: int) -> int:
        n = _check_numel(numel)
        return n + 4 * _blocks(n, self.ROW)

    def _encode(self, x: torch.Tensor) -> bytes:
        n, rows = x.numel(), _blocks(x.numel(), self.ROW)
        xr = _pad(x, rows * self.ROW).view(rows, self.ROW)  # zero padding leaves each row's absmax unchanged
        scale = xr.abs().amax(dim=1) / self._MAX  # (rows,) f32
        safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(1)  # zero row -> divide by 1
        # Clamp because x / scale can round a hair above 448, and the cast's out-of-range behaviour (NaN or
        # saturate) has differed between versions.
        v = (xr / safe).clamp_(-self._MAX, self._MAX)
        codes = v.to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1)[:n]
        return _to_bytes(scale, codes)

    def _decode(self, buf: memoryview, numel: int) -> torch.Tensor:
        rows = _blocks(numel, self.ROW)
        scale = _read_f32(buf, 0, rows)
        if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
            raise ValueError(f"{self.name}: invalid row scale (negative or non-finite)")
        codes = _pad(_read_u8(buf, 4 * rows, numel), rows * self.ROW, 0).view(rows, self.ROW)
        out = codes.view(torch.float8_e4m3fn).to(torch.float32) * scale.unsqueeze(1)  # NaN codes -> caught later
        # 448 * (absmax / 448) can round one ulp above absmax; for absmax within an ulp of float32's max that is
        # inf, so saturate (clamp keeps NaN, which decode() then rejects).
        return out.reshape(-1)[:numel].clamp_(-_F32_MAX, _F32_MAX)

    def error_bound(self, decoded: torch.Tensor) -> torch.Tensor:
        # The row's absmax decodes to 448·scale: the scale is read back from it.
        n, rows = decoded.numel(), _blocks(decoded.numel(), self.ROW)
        xr = _pad(decoded, rows * self.ROW).view(rows, self.ROW).abs()
        scale = (xr.amax(dim=1) / self._MAX).unsqueeze(1)
        return (xr * (2.0**-4 / (1 - 2.0**-4) + 2.0**-22) + scale * 2.0**-9).reshape(-1)[:n]


class E3M0Codec(Codec):
    """4-bit floats, sign + 3 exponent bits and no mantissa, with a float32 absmax scale per block of 64.

    Streaming DiLoCo (arXiv 2501.18512) exchanges outer updates as 4-bit floats of this kind. Code ``k`` in
    0..7 is the magnitude 0 (``k = 0``) or ``scale * 2^(k-7)`` (so the largest level is the block's absmax);
    bit 3 is the sign. Values round to the nearest level in the linear domain, ties away from zero: scaled
    magnitudes below 2^-7 (half the smallest level) become 0. Hence ``|x - decoded| <= max(|x| / 3,
    scale * 2^-7)``. Two codes per byte, the earlier value in the low nibble; an odd count pads one zero nibble.
    Decode raises ValueError for a negative or non-finite scale.
    """

    name: ClassVar[str] = "e3m0"
    BLOCK: ClassVar[int] = 64
    # Magnitude of code k (bits 0-2) with its sign (bit 3); code 8 ("negative zero") decodes as +0.
    _LEVELS: ClassVar[torch.Tensor] = torch.tensor(
        [0.0] + [2.0 ** (k - 7) for k in range(1, 8)] + [0.0] + [-(2.0 ** (k - 7)) for k in range(1, 8)],
        dtype=torch.float32,
    )

    def encoded_size(self, numel: int) -> int:
        n = _check_numel(numel)
        return (n + 1) // 2 + 4 * _blocks(n, self.BLOCK)

    def _encode(self, x: torch.Tensor) -> bytes:
        n, nb = x.numel(), _blocks(x.numel(), self.BLOCK)
        xb = _pad(x, nb * self.BLOCK).view(nb, self.BLOCK)  # zero padding: absmax unchanged, codes 0
        scale = xb.abs().amax(dim=1)  # (nb,) f32, stored as is
        safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(1)
        v = xb / safe  # (nb, 64) f32 in [-1, 1]: correctly rounded division never exceeds 1 in magnitude
        # Nearest power of two straight from the float32 bits (pure integer ops, no log2 rounding): for
        # |v| = 1.f * 2^e, adding half a binade to the magnitude bits carries into the exponent field exactly when
        # 1.f >= 1.5, so ((bits + 2^22) >> 23) - 127 is the exponent j of the nearest power of two, and the code
        # is k = j + 7. Magnitudes in [2^-7, 1.5*2^-7) give k = 0 but must round to code 1 (2^-6); they are the
        # magnitudes whose bits >> 22 equal 0xF0 (exponent 120, top mantissa bit clear).
        bits = v.view(torch.int32)  # (nb, 64) int32, v is our own temporary
        negative = bits < 0
        bits.bitwise_and_(0x7FFFFFFF)  # |v| bits
        k = ((bits + (1 << 22)) >> 23).sub_(120).clamp_(0, 7).to(torch.uint8)  # below 1.5*2^-8 -> 0
        k += ((bits >> 22) == 0xF0).to(torch.uint8)
        k |= (negative & (k > 0)).to(torch.uint8) << 3  # sign bit only on nonzero codes
        codes = k.reshape(-1)[: 2 * ((n + 1) // 2)].view(-1, 2)  # padding codes are 0
        packed = codes[:, 0] | (codes[:, 1] << 4)
        return _to_bytes(scale, packed)

    def _decode(self, buf: memoryview, numel: int) -> torch.Tensor:
        nb = _blocks(numel, self.BLOCK)
        scale = _read_f32(buf, 0, nb)
        if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
            raise ValueError(f"{self.name}: invalid block scale (negative or non-finite)")
        packed = _read_u8(buf, 4 * nb, (numel + 1) // 2)
        codes = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)  # (2*ceil(n/2),) uint8
        codes = _pad(codes, nb * self.BLOCK, 0)
        mags = self._LEVELS.index_select(0, codes.to(torch.int32)).view(nb, self.BLOCK)
        return (mags * scale.unsqueeze(1)).reshape(-1)[:numel]  # power-of-two multiples: exact for normal scales

    def error_bound(self, decoded: torch.Tensor) -> torch.Tensor:
        # Level L takes inputs in [0.75 L, 1.5 L] (round to nearest, linear domain), zero those below
        # 2^-7 · scale; the block's absmax decodes to the scale itself.
        n, nb = decoded.numel(), _blocks(decoded.numel(), self.BLOCK)
        xb = _pad(decoded, nb * self.BLOCK).view(nb, self.BLOCK).abs()
        floor = (xb.amax(dim=1) * 2.0**-7).unsqueeze(1)
        return torch.maximum(xb * 0.5, floor).mul_(1 + 2.0**-20).reshape(-1)[:n]


CODECS: dict[str, type[Codec]] = {
    cls.name: cls for cls in (FP32Codec, FP16Codec, BF16Codec, Uint8Codec, FP8Codec, E3M0Codec, TwoBitCodec,
                              OneBitCodec, TopK2Codec, TopK2Codec3, TopK2GroupCodec)
}


_TOPK: dict[str, type[Codec]] = {}


def _topk(name: str) -> type[Codec] | None:
    """``topk2:F``: :class:`TopK2Codec` sending the fraction F of each block (0 < F ≤ 0.5), ``topk2g4:F`` the same
    with :class:`TopK2GroupCodec` (groups of 4 values), or None."""
    head, _, frac = name.partition(":")
    base: type[Codec] | None = {"topk2": TopK2Codec, "topk2g4": TopK2GroupCodec}.get(head)
    if base is None or not frac:
        return None
    try:
        f = float(frac)
    except ValueError:
        return None
    if not 0 < f <= 0.5:
        return None
    if name not in _TOPK:
        _TOPK[name] = type(f"{base.__name__}_{frac}", (base,), {"name": name, "FRACTION": f,
                                                                 "__doc__": f"{base.__name__} with {f:g} of each block."})
    return _TOPK[name]


def is_codec(name: str) -> bool:
    """Whether ``name`` names a codec: one of :data:`CODECS`, or ``topk2:F``/``topk2g4:F`` for a fraction 0 < F ≤ 0.5."""
    return name in CODECS or _topk(name) is not None


def get_codec(name: str, device: torch.device | str | None = None) -> Codec:
    """A codec instance by name (:func:`is_codec`), encoding on ``device`` when that is a GPU; ValueError naming
    the valid choices for an unknown name."""
    cls = CODECS.get(name) or _topk(name)
    if cls is None:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(sorted(CODECS))} "
                         "(or topk2:F or topk2g4:F, a fraction 0 < F ≤ 0.5)")
    return cls(device)
