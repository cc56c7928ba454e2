"""Wire codecs and multi-phase compressors for the outer all-reduce.

Two independent layers, both pure math (torch, numpy and the stdlib only):

* **Codecs** (:class:`Codec`, :data:`CODECS`, :func:`get_codec`) turn one 1-D float tensor into the exact bytes
  sent over the wire and back. They only quantise the *transfer*: a receiver decodes to float32 and every sum or
  average is taken in float32.
* **Compressors** (:class:`Compressor`, :class:`Identity`, :class:`LowRank`) turn one peer's pseudo-gradients
  into one or more all-reduce *phases*. Each phase's payload is a list of float32 tensors that the caller
  averages across peers (possibly through a codec) and hands back; the compressor then produces the next phase or
  the final estimate of the peers' average pseudo-gradient.

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

All block headers come first, then the packed values, so both sides vectorise without per-block loops.
"""

from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

__all__ = [
    "CODECS",
    "BF16Codec",
    "Codec",
    "Compressor",
    "E3M0Codec",
    "FP8Codec",
    "FP16Codec",
    "FP32Codec",
    "Identity",
    "LowRank",
    "Uint8Codec",
    "get_codec",
]

_NON_FINITE_INPUT = "non-finite values cannot be encoded"
_NON_FINITE_PAYLOAD = "payload decodes to non-finite values"
_F32_MAX = float(torch.finfo(torch.float32).max)


# --------------------------------------------------------------------------------------------------------------
# Codecs
# --------------------------------------------------------------------------------------------------------------


def _check_numel(numel: int) -> int:
    """Return ``numel`` as an int; ValueError unless it is a non-negative integer."""
    if isinstance(numel, bool) or not isinstance(numel, (int, np.integer)) or numel < 0:
        raise ValueError(f"numel must be a non-negative integer, got {numel!r}")
    return int(numel)


def _blocks(numel: int, block: int) -> int:
    """Number of blocks of ``block`` values covering ``numel`` values (the last one may be shorter)."""
    return -(-numel // block)


def _as_float32_cpu(x: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """Validate a codec input and return it as a contiguous 1-D float32 tensor on the CPU, or on ``device``
    (a GPU: the codec computes there; see :attr:`Codec.device`).

    Raises TypeError for a non-tensor or a non-floating tensor, ValueError for a tensor that is not 1-D or that
    holds NaN/inf (float64 values beyond float32's range become inf here and are rejected the same way).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"expected a floating-point tensor, got {x.dtype}")
    if x.dim() != 1:
        raise ValueError(f"expected a 1-D tensor, got shape {tuple(x.shape)}")
    flat = x.detach().to(device=device or "cpu", dtype=torch.float32, non_blocking=True).contiguous()
    # One reduction over the whole tensor: cheaper than per-block checks and catches NaN and +-inf alike.
    if not bool(torch.isfinite(flat).all()):
        raise ValueError(_NON_FINITE_INPUT)
    return flat


def _pad(x: torch.Tensor, total: int, value: torch.Tensor | float = 0.0) -> torch.Tensor:
    """``x`` (1-D) extended to ``total`` values with ``value`` (a scalar or a 1-element tensor)."""
    missing = total - x.numel()
    if missing == 0:
        return x
    fill = value.reshape(1).expand(missing) if isinstance(value, torch.Tensor) else x.new_full((missing,), value)
    return torch.cat([x, fill])


def _host(t: torch.Tensor) -> np.ndarray:
    """The values of ``t`` (on any device) as a host array: the one device → host copy of an encode."""
    return t.contiguous().cpu().numpy()


def _f32_bytes(t: torch.Tensor) -> bytes:
    """Little-endian float32 bytes of a float32 tensor (no copy on little-endian CPU hosts before ``tobytes``)."""
    return _host(t).astype("<f4", copy=False).tobytes()


def _read_f32(buf: memoryview, offset: int, count: int) -> torch.Tensor:
    """``count`` little-endian float32 values at byte ``offset`` as a fresh, writable float32 tensor."""
    arr = np.frombuffer(buf, dtype="<f4", count=count, offset=offset)
    return torch.from_numpy(arr.astype(np.float32))  # astype copies: the result does not alias the payload


def _read_u8(buf: memoryview, offset: int, count: int) -> torch.Tensor:
    """``count`` bytes at ``offset`` as a fresh, writable uint8 tensor."""
    return torch.from_numpy(np.frombuffer(buf, dtype=np.uint8, count=count, offset=offset).copy())


class Codec(ABC):
    """Lossy or lossless wire format for one 1-D float tensor.

    ``encode`` accepts any floating dtype on any device and returns the exact payload; ``decode`` returns a 1-D
    float32 CPU tensor. ``encoded_size(n)`` is exactly ``len(encode(x))`` for every ``x`` with ``n`` values, so a
    receiver knows how many bytes to expect before reading them.

    Failures: ``encode`` raises ValueError("non-finite values cannot be encoded") for NaN/inf input, ValueError
    for a tensor that is not 1-D and TypeError for a non-floating tensor. ``decode`` raises ValueError when the
    payload length differs from ``encoded_size(numel)`` (it never reads past the payload) and when the payload
    decodes to NaN/inf or carries an invalid block header: payloads come from the network.
    """

    name: ClassVar[str]
    #: Whether encoding computes anything (quantisation) worth running on a GPU.
    computes: ClassVar[bool] = True
    #: Inputs smaller than this are encoded on the CPU (a GPU round trip costs more than it saves).
    GPU_MIN_NUMEL: ClassVar[int] = 1 << 16

    def __init__(self, device: torch.device | str | None = None) -> None:
        #: A CUDA device to encode on (the input is copied there; only the packed payload comes back),
        #: or None: encode on the CPU. The bytes are the same either way.
        self.device = torch.device(device) if device is not None else None
        self._stream: Any = None

    def _compute_device(self, x: torch.Tensor) -> torch.device | None:
        dev = self.device if self.device is not None and self.device.type == "cuda" else None
        if dev is None and x.is_cuda:
            dev = x.device
        if dev is None or not self.computes or x.numel() < self.GPU_MIN_NUMEL:
            return None
        return dev

    def encode(self, x: torch.Tensor) -> bytes:
        """Encode the 1-D float tensor ``x`` into its wire payload (see the class docstring for failures).

        On a GPU (:attr:`device`, or an input already there) the work runs on a side CUDA stream, after the
        writes already queued for ``x``; the result is the same bytes as on the CPU."""
        dev = self._compute_device(x) if isinstance(x, torch.Tensor) else None
        if dev is None:
            return self._encode_flat(_as_float32_cpu(x))
        if self._stream is None:
            self._stream = torch.cuda.Stream(dev)
        if x.is_cuda:
            self._stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(self._stream):
            return self._encode_flat(_as_float32_cpu(x, dev))

    def _encode_flat(self, flat: torch.Tensor) -> bytes:
        if flat.numel() == 0:
            return b""
        data = self._encode(flat)
        # Cheap self-check: the size formula is the contract the network layer relies on.
        assert len(data) == self.encoded_size(flat.numel())
        return data

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        """Decode a payload of ``numel`` values into a 1-D float32 CPU tensor (ValueError on a bad payload)."""
        n = _check_numel(numel)
        buf = memoryview(data).cast("B")  # byte view of any buffer, so len() counts bytes
        expected = self.encoded_size(n)
        if len(buf) != expected:
            raise ValueError(f"{self.name}: payload for {n} values must be {expected} bytes, got {len(buf)}")
        if n == 0:
            return torch.zeros(0, dtype=torch.float32)
        out = self._decode(buf, n)
        if not bool(torch.isfinite(out).all()):
            raise ValueError(f"{self.name}: {_NON_FINITE_PAYLOAD}")
        return out

    @abstractmethod
    def encoded_size(self, numel: int) -> int:
        """Exact payload size in bytes for ``numel`` values (ValueError for a negative or non-integer count)."""

    @abstractmethod
    def _encode(self, x: torch.Tensor) -> bytes:
        """Payload of ``x``: a non-empty, finite, contiguous 1-D float32 tensor (CPU, or the encoding GPU)."""

    @abstractmethod
    def _decode(self, buf: memoryview, numel: int) -> torch.Tensor:
        """Values of a payload whose length has been checked; ``numel`` > 0."""


class FP32Codec(Codec):
    """Raw little-endian float32: lossless, 4 bytes per value."""

    name: ClassVar[str] = "fp32"
    computes: ClassVar[bool] = False  # raw bytes: nothing to compute

    def encoded_size(self, numel: int) -> int:
        return 4 * _check_numel(numel)

    def _encode(self, x: torch.Tensor) -> bytes:
        return _f32_bytes(x)

    def _decode(self, buf: memoryview, numel: int) -> torch.Tensor:
        return _read_f32(buf, 0, numel)


class FP16Codec(Codec):
    """IEEE half precision, 2 bytes per value: relative error <= 2^-11 within the normal range.

    Finite values beyond +-65504 saturate to +-65504 instead of becoming inf (one outlier must not poison the
    average); magnitudes below 2^-24 flush to zero.
    """

    name: ClassVar[str] = "fp16"
    _MAX: ClassVar[float] = float(torch.finfo(torch.float16).max)

    def encoded_size(self, numel: int) -> int:
        return 2 * _check_numel(numel)

    def _encode(self, x: torch.Tensor) -> bytes:
        half = x.clamp(-self._MAX, self._MAX).to(torch.float16)
        return _host(half).astype("<f2", copy=False).tobytes()

    def _decode(self, buf: memoryview, numel: int) -> torch.Tensor:
        arr = np.frombuffer(buf, dtype="<f2", count=numel).astype(np.float16)  # copy, native order
        return torch.from_numpy(arr).to(torch.float32)


class BF16Codec(Codec):
    """bfloat16 (float32's exponent, 8 significant bits), 2 bytes per value: relative error <= 2^-8.

    Sent as the little-endian int16 bit pattern (the host array type used for the bytes has no bfloat16). Values
    beyond bfloat16's largest finite value (about 3.39e38) saturate instead of rounding to inf.
    """

    name: ClassVar[str] = "bf16"
    _MAX: ClassVar[float] = float(torch.finfo(torch.bfloat16).max)

    def encoded_size(self, numel: int) -> int:
        return 2 * _check_numel(numel)

    def _encode(self, x: torch.Tensor) -> bytes:
        bits = x.clamp(-self._MAX, self._MAX).to(torch.bfloat16).view(torch.int16)
        return _host(bits).astype("<i2", copy=False).tobytes()

    def _decode(self, buf: memoryview, numel: int) -> torch.Tensor:
        arr = np.frombuffer(buf, dtype="<i2", count=numel).astype(np.int16)  # copy, native order
        return torch.from_numpy(arr).view(torch.bfloat16).to(torch.float32)


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
        return _f32_bytes(header) + _host(q.reshape(-1)[:n]).tobytes()

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
        return _f32_bytes(scale) + _host(codes).tobytes()

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
        return _f32_bytes(scale) + _host(packed).tobytes()

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


CODECS: dict[str, type[Codec]] = {
    cls.name: cls for cls in (FP32Codec, FP16Codec, BF16Codec, Uint8Codec, FP8Codec, E3M0Codec)
}


def get_codec(name: str, device: torch.device | str | None = None) -> Codec:
    """A codec instance by name, encoding on ``device`` when that is a GPU; ValueError naming the valid
    choices for an unknown name."""
    try:
        return CODECS[name](device)
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(sorted(CODECS))}") from None


# --------------------------------------------------------------------------------------------------------------
# Compressors
# --------------------------------------------------------------------------------------------------------------


def _match(averaged: list[torch.Tensor], shapes: list[torch.Size], devices: list[torch.device]) -> list[torch.Tensor]:
    """The averaged payload reshaped to ``shapes`` as float32 on ``devices``.

    The network layer may hand back flattened tensors, so only the element counts must match. ValueError when
    the number of tensors or any element count differs.
    """
    if len(averaged) != len(shapes):
        raise ValueError(f"expected {len(shapes)} averaged tensors, got {len(averaged)}")
    out = []
    for i, (t, shape, device) in enumerate(zip(averaged, shapes, devices, strict=True)):
        if t.numel() != math.prod(shape):
            raise ValueError(f"averaged tensor {i}: expected {math.prod(shape)} values, got {t.numel()}")
        out.append(t.detach().to(device=device, dtype=torch.float32).reshape(shape))
    return out


class Compressor(ABC):
    """Turns one peer's pseudo-gradient tensors into one or more all-reduce phases.

    Protocol for one round: ``payload = begin(tensors)``; then repeatedly average ``payload`` across peers and
    call ``payload = receive(averaged)`` until it returns None; then ``result()`` is the estimate of the peers'
    average pseudo-gradient. Every peer of a round must run the same compressor configuration and state, so that
    the phases line up. Calling ``begin`` again abandons an unfinished round (e.g. after a failed all-reduce)
    without keeping anything from it. ``receive`` outside a round and ``result`` before the round finished
    raise RuntimeError; an averaged list of the wrong length or element counts raises ValueError.
    """

    @abstractmethod
    def begin(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Start a round; return the float32 tensors to all-reduce (average across peers) in phase 0."""

    @abstractmethod
    def receive(self, averaged: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Take the current phase's averaged payload; return the next phase's payload, or None when done."""

    @abstractmethod
    def result(self) -> list[torch.Tensor]:
        """The estimate of the peers' average, shaped like ``begin``'s input; valid once ``receive`` gave None."""

    @abstractmethod
    def abort(self) -> None:
        """Abandon an unfinished round (a failed all-reduce): nothing of it is kept."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint: tensors, ints, floats and lists only (an unfinished round is not included)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output (ValueError if it does not fit); abandons any unfinished round."""


class Identity(Compressor):
    """No compression: one phase whose payload is the tensors themselves (as float32 copies)."""

    def __init__(self) -> None:
        self._shapes: list[torch.Size] | None = None
        self._devices: list[torch.device] = []
        self._result: list[torch.Tensor] | None = None

    def begin(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        self._shapes = [t.shape for t in tensors]
        self._devices = [t.device for t in tensors]
        self._result = None
        # Copies, so an all-reduce that works in place cannot touch the caller's tensors.
        return [t.detach().to(torch.float32, copy=True) for t in tensors]

    def receive(self, averaged: list[torch.Tensor]) -> list[torch.Tensor] | None:
        if self._shapes is None or self._result is not None:
            raise RuntimeError("receive() called without a round in progress")
        self._result = _match(averaged, self._shapes, self._devices)
        return None

    def result(self) -> list[torch.Tensor]:
        if self._result is None:
            raise RuntimeError("result() called before the round finished")
        return list(self._result)

    def abort(self) -> None:
        self._shapes, self._result = None, None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Identity keeps no state between rounds; this only abandons an unfinished round."""
        self._shapes, self._result = None, None


def _generator(seed: int, *parts: int) -> torch.Generator:
    """A CPU generator seeded from ``seed`` and ``parts``, identical on every peer and every run.

    Hashing (rather than ``hash()`` or arithmetic) keeps nearby seeds and indices statistically independent.
    """
    digest = hashlib.blake2b(":".join(str(p) for p in (seed, *parts)).encode(), digest_size=8).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest, "little") >> 1)


def _unit_columns(q: torch.Tensor) -> torch.Tensor:
    """``q`` (n x r) with every column scaled to unit length (a zero column stays zero)."""
    norms = q.norm(dim=0, keepdim=True)
    return q / torch.where(norms > 0, norms, torch.ones_like(norms))


@dataclass
class _Slot:
    """Per-matrix state of :class:`LowRank`. ``q`` is shared by all peers; ``error`` is this peer's own."""

    rows: int  # m
    cols: int  # n
    cap: int  # largest rank allowed: rank_max, and r*(m+n) < m*n so the factors stay smaller than the matrix
    rank: int  # current r
    q: torch.Tensor  # (n, r) f32, unit columns
    error: torch.Tensor | None  # (m, n) f32 error-feedback buffer, None until first needed or when disabled


@dataclass
class _Round:
    """Scratch state of the round in progress; dropped as a whole if the round is abandoned."""

    phase: int  # 0: waiting for the averaged P (or full tensors); 1: waiting for the averaged Q
    m: dict[int, torch.Tensor]  # slot index -> M_i = pseudo-gradient + error buffer, (m, n) f32, until phase 1
    p_hat: dict[int, torch.Tensor]  # slot index -> orthonormal basis of the averaged P, (m, r) f32
    new_error: dict[int, torch.Tensor]  # slot index -> M_i - P_hat Q_i^T, (m, n) f32, from phase 1 on
    devices: list[torch.device]  # device of each input tensor: results go back there
    results: list[torch.Tensor | None]


class LowRank(Compressor):
    """Rank-r factorisation of each matrix with error feedback and adaptive rank: two all-reduce phases.

    One step of subspace (power) iteration per round, as in PowerSGD (arXiv 1905.13727); DiLoCoX (arXiv
    2506.21263) compresses pseudo-gradients this way, with quantisation and error feedback. For each matrix
    M_i (m x n: this peer's pseudo-gradient plus its error buffer e_i; tensors with more than two dims are
    viewed as ``shape[0] x rest``):

    * phase 0 sends P_i = M_i Q (m x r). Q (n x r) is the same on every peer: first drawn from a generator seeded
      with ``seed`` and the tensor's index, afterwards warm-started from the previous round. The averaged P is
      orthonormalised (reduced QR) into P_hat, identical on every peer because the averaged P is;
    * phase 1 sends Q_i = M_i^T P_hat (n x r); with the averaged Q_bar the result is P_hat Q_bar^T, which is
      P_hat P_hat^T M_bar, the projection of the true average M_bar onto span(P_hat);
    * error feedback keeps what this peer did not transmit: e_i <- M_i - P_hat Q_i^T;
    * warm start: the next Q spans the same space as Q_bar (so the next P_hat would be the same), stored as its
      left singular vectors ordered by singular value; directions with (numerically) zero singular value are
      redrawn from a generator seeded with ``seed``, the index and the round, so the rank does not collapse;
    * adaptive rank, from averaged data only (so identical on every peer): with sigma the singular values of Q_bar
      (those of P_hat^T M_bar), k is the smallest rank holding ``energy`` of sum(sigma^2); if k < r the rank
      becomes max(rank_min, k + 1) (the strongest directions and one spare), if k == r it doubles, up to rank_max and the
      largest rank that still saves bytes. A rank-1 matrix therefore alternates between ranks 1 and 2.

    Cost per round and matrix: r*m values in phase 0 plus r*n in phase 1, i.e. r(m+n) instead of m*n. Tensors
    with fewer than two dims, or where the initial rank gives r(m+n) >= m*n, are sent in full in phase 0; if no
    tensor is factorised the round has a single phase.

    Shared state (Q and the ranks) must be the same on all peers of a round: a joining peer loads it from
    ``state_dict()`` of a current member (its own error buffers may start empty). QR and SVD run in float64 on
    the CPU so that identical averaged inputs give identical P_hat, Q and ranks; peers on different hardware or
    math libraries may still differ in the last bits of P_hat (so of the result), and a rank decision sitting
    exactly on the ``energy`` threshold could then differ, which would break the next round's shapes.

    Accuracy: a matrix of rank <= r is recovered to float32 round-off, but one power-iteration step with
    r == rank(M) finds range(M) only to within (perturbation / smallest singular value of M Q), so shrinking
    the rank all the way to k leaves no oversampling margin.

    Failures: ValueError from the constructor for inconsistent settings, from ``begin`` when the tensor shapes
    differ from the first round's, and from ``receive``/``load_state_dict`` for mismatching data.
    """

    # A singular value at or below this fraction of the largest is treated as a collapsed direction: float32
    # round-off leaves about 1e-7 relative noise in directions the matrix does not have.
    _DEAD: ClassVar[float] = 1e-5

    def __init__(
        self,
        rank: int = 4,
        rank_min: int = 1,
        rank_max: int = 32,
        energy: float = 0.9,
        error_feedback: bool = True,
        seed: int = 0,
    ) -> None:
        if not 1 <= rank_min <= rank <= rank_max:
            raise ValueError(f"need 1 <= rank_min <= rank <= rank_max, got {rank_min}, {rank}, {rank_max}")
        if not 0.0 < energy <= 1.0:
            raise ValueError(f"energy must be in (0, 1], got {energy}")
        self.rank, self.rank_min, self.rank_max = rank, rank_min, rank_max
        self.energy, self.error_feedback, self.seed = float(energy), bool(error_feedback), int(seed)
        self._shapes: list[torch.Size] | None = None
        self._slots: dict[int, _Slot] = {}
        self._rounds = 0  # completed rounds: salts the redrawn directions
        self._round: _Round | None = None
        self._done: list[torch.Tensor] | None = None

    # -- layout ------------------------------------------------------------------------------------------------

    def _layout(self, shapes: list[torch.Size]) -> dict[int, tuple[int, int, int]]:
        """Index -> (m, n, cap) of the tensors to factorise, decided by the shapes and the initial rank only."""
        out = {}
        for i, shape in enumerate(shapes):
            if len(shape) < 2:
                continue
            m, n = shape[0], math.prod(shape[1:])
            if self.rank * (m + n) >= m * n:  # no saving (also covers empty tensors)
                continue
            out[i] = (m, n, min(self.rank_max, (m * n - 1) // (m + n)))
        return out

    def _setup(self, shapes: list[torch.Size]) -> None:
        self._shapes = list(shapes)
        self._slots = {}
        for i, (m, n, cap) in self._layout(self._shapes).items():
            q = torch.randn(n, self.rank, generator=_generator(self.seed, i), dtype=torch.float32)
            self._slots[i] = _Slot(rows=m, cols=n, cap=cap, rank=self.rank, q=_unit_columns(q), error=None)

    def ranks(self) -> list[int]:
        """Current rank per input tensor, 0 for tensors sent in full; empty before the first round."""
        if self._shapes is None:
            return []
        return [self._slots[i].rank if i in self._slots else 0 for i in range(len(self._shapes))]

    # -- protocol ------------------------------------------------------------------------------------------

    def begin(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Phase 0: P_i = M_i Q for each factorised tensor, the tensor itself (a float32 copy) for the others.

        Without error feedback M_i may be a view of the caller's tensor: leave the inputs unchanged until the
        round ends. ValueError if the shapes differ from the first round's.
        """
        shapes = [t.shape for t in tensors]
        if self._shapes is None:
            self._setup(shapes)
        elif shapes != self._shapes:
            raise ValueError("tensor shapes differ from the first round's")
        self._done = None
        devices = [t.device for t in tensors]
        state = _Round(phase=0, m={}, p_hat={}, new_error={}, devices=devices, results=[None] * len(tensors))
        payload = []
        for i, t in enumerate(tensors):
            g = t.detach().to(torch.float32)
            slot = self._slots.get(i)
            if slot is None:
                payload.append(g.clone())  # sent in full; a copy so an in-place all-reduce cannot alias it
                continue
            m = g.reshape(slot.rows, slot.cols)  # (m, n) f32, may alias the caller's tensor
            if self.error_feedback:
                # A tensor of our own: phase 0 turns it into the new error buffer in place.
                m = m + slot.error.to(m.device) if slot.error is not None else m.clone()
            state.m[i] = m
            payload.append(m @ slot.q.to(m.device))  # P_i: (m, r)
        self._round = state
        return payload

    def receive(self, averaged: list[torch.Tensor]) -> list[torch.Tensor] | None:
        state = self._round
        if state is None or self._shapes is None:
            raise RuntimeError("receive() called without a round in progress")
        return self._phase0(state, averaged) if state.phase == 0 else self._phase1(state, averaged)

    def _phase0(self, state: _Round, averaged: list[torch.Tensor]) -> list[torch.Tensor] | None:
        assert self._shapes is not None
        shapes = []
        for i, shape in enumerate(self._shapes):
            slot = self._slots.get(i)
            shapes.append(torch.Size((slot.rows, slot.rank)) if slot is not None else shape)
        avg = _match(averaged, shapes, state.devices)
        payload = []
        for i, a in enumerate(avg):
            if i not in self._slots:
                state.results[i] = a
                continue
            m = state.m[i]
            # Reduced QR of the averaged P in float64 on the CPU: the same input gives the same basis on every
            # peer, and float64 keeps the basis orthonormal even when P is badly conditioned. (m, r) f32.
            p_hat = torch.linalg.qr(a.to("cpu", torch.float64), mode="reduced").Q.to(m.device, torch.float32)
            q_own = m.T @ p_hat  # Q_i: (n, r)
            state.p_hat[i] = p_hat
            if self.error_feedback:
                # e_i = M_i - P_hat Q_i^T, the part of M_i this peer does not transmit, computed in M_i's own
                # buffer (M_i is not needed any more): one m x n buffer per matrix during the round, not two.
                state.new_error[i] = m.addmm_(p_hat, q_own.T, alpha=-1.0)
                del state.m[i]
            payload.append(q_own)
        if not self._slots:
            self._finish(state)
            return None
        state.phase = 1
        return payload

    def _phase1(self, state: _Round, averaged: list[torch.Tensor]) -> None:
        order = sorted(self._slots)
        shapes = [torch.Size((self._slots[i].cols, self._slots[i].rank)) for i in order]
        avg = _match(averaged, shapes, [state.devices[i] for i in order])
        for i, q_bar in zip(order, avg, strict=True):
            state.results[i] = state.p_hat[i] @ q_bar.T  # (m, n) = P_hat P_hat^T M_bar
        # Commit only now, so an abandoned round leaves the error buffers, Q and the ranks untouched.
        for i, q_bar in zip(order, avg, strict=True):
            slot = self._slots[i]
            if self.error_feedback:
                slot.error = state.new_error[i]
            self._adapt(i, slot, q_bar)
        self._finish(state)

    def _finish(self, state: _Round) -> None:
        assert self._shapes is not None
        done = []
        for r, shape in zip(state.results, self._shapes, strict=True):
            assert r is not None  # every tensor got its result in phase 0 (full) or phase 1 (factorised)
            done.append(r.reshape(shape))
        self._done = done
        self._round = None
        self._rounds += 1

    def _adapt(self, index: int, slot: _Slot, q_bar: torch.Tensor) -> None:
        """Choose the next rank and warm-start Q from the averaged Q_bar (n x r); identical on every peer."""
        u, s, _ = torch.linalg.svd(q_bar.to("cpu", torch.float64), full_matrices=False)  # u (n, r), s (r,)
        r, power = slot.rank, s.square()
        total = float(power.sum())
        new_rank = r
        if total > 0:
            # Smallest k whose leading k singular values hold `energy` of the total.
            k = min(r, int((power.cumsum(0) < self.energy * total).sum()) + 1)
            # One spare direction above k keeps the rank stable (k < r) instead of oscillating.
            new_rank = max(self.rank_min, k + 1) if k < r else min(slot.cap, 2 * r)
        keep = min(r, new_rank)
        alive = s[:keep] > self._DEAD * float(s[0]) if total > 0 else torch.zeros(keep, dtype=torch.bool)
        q = u[:, :keep]  # (n, keep) f64, orthonormal, strongest direction first
        if keep < new_rank or not bool(alive.all()):
            # Redraws for collapsed directions and new columns, from a generator every peer seeds the same way.
            gen = _generator(self.seed, index, self._rounds + 1)
            fresh = _unit_columns(torch.randn(slot.cols, new_rank, generator=gen, dtype=torch.float64))
            q = torch.cat([torch.where(alive.unsqueeze(0), q, fresh[:, :keep]), fresh[:, keep:]], dim=1)
        slot.q = q.to(torch.float32)
        slot.rank = new_rank

    def result(self) -> list[torch.Tensor]:
        if self._done is None:
            raise RuntimeError("result() called before the round finished")
        return list(self._done)

    def abort(self) -> None:
        self._round = None

    # -- state ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state: ``shapes`` (the layout, [] before the first round), ``rounds``, and per
        factorised tensor (in ``index`` order) its ``rank`` and ``q`` (shared by all peers) and ``error`` (this
        peer's own; [] when error feedback is off). Tensors are CPU copies."""
        order = sorted(self._slots)
        errors: list[torch.Tensor] = []
        if self.error_feedback:
            for i in order:
                slot = self._slots[i]
                e = slot.error if slot.error is not None else torch.zeros(slot.rows, slot.cols)
                errors.append(e.detach().to("cpu", copy=True))
        return {
            "shapes": [list(s) for s in self._shapes] if self._shapes is not None else [],
            "rounds": self._rounds,
            "index": order,
            "rank": [self._slots[i].rank for i in order],
            "q": [self._slots[i].q.detach().to("cpu", copy=True) for i in order],
            "error": errors,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            shapes = [torch.Size(int(d) for d in s) for s in state["shapes"]]
            rounds, index, ranks = int(state["rounds"]), [int(i) for i in state["index"]], list(state["rank"])
            qs, errors = list(state["q"]), list(state["error"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a LowRank state: {exc}") from None
        self._round, self._done = None, None
        if not shapes:
            self._shapes, self._slots, self._rounds = None, {}, rounds
            return
        layout = self._layout(shapes)
        if sorted(layout) != index or len(ranks) != len(index) or len(qs) != len(index):
            raise ValueError("state was saved with a different layout (shapes or initial rank differ)")
        if self.error_feedback and errors and len(errors) != len(index):
            raise ValueError("state has the wrong number of error buffers")
        slots = {}
        for j, i in enumerate(index):
            m, n, cap = layout[i]
            r = int(ranks[j])
            if not 1 <= r <= cap or tuple(qs[j].shape) != (n, r):
                raise ValueError(f"tensor {i}: rank {r} or Q shape {tuple(qs[j].shape)} does not fit a {m}x{n} matrix")
            error = None
            if self.error_feedback and errors:
                if tuple(errors[j].shape) != (m, n):
                    raise ValueError(f"tensor {i}: error buffer shape {tuple(errors[j].shape)} is not {(m, n)}")
                error = errors[j].detach().to(torch.float32, copy=True)
            q = qs[j].detach().to("cpu", torch.float32, copy=True)
            slots[i] = _Slot(rows=m, cols=n, cap=cap, rank=r, q=q, error=error)
        self._shapes, self._slots, self._rounds = shapes, slots, rounds
