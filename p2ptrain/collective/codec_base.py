"""What every wire codec shares: the :class:`Codec` contract and the byte helpers (torch and stdlib only).

The formats themselves are in :mod:`p2ptrain.collective.codecs` (fp32 … e3m0) and
:mod:`p2ptrain.collective.lowbit` (the 2-bit ones); both build on this module, which imports neither.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

__all__ = ["Codec", "all_finite"]

_NON_FINITE_INPUT = "non-finite values cannot be encoded"
_NON_FINITE_PAYLOAD = "payload decodes to non-finite values"
_F32_MAX = float(torch.finfo(torch.float32).max)
_LITTLE = sys.byteorder == "little"


def _check_numel(numel: int) -> int:
    """Return ``numel`` as an int; ValueError unless it is a non-negative integer."""
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
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
    if not all_finite(flat):
        raise ValueError(_NON_FINITE_INPUT)
    return flat


def all_finite(x: torch.Tensor) -> bool:
    """True if every value of ``x`` is finite. A finite sum proves it (a NaN or an infinity makes the sum NaN or
    infinite): one reduction, ~15× faster than ``isfinite(x).all()`` on the CPU; only a sum that overflowed (or a
    value that is not finite) takes the exact, elementwise check."""
    return bool(torch.isfinite(x.sum())) or bool(torch.isfinite(x).all())


def _pad(x: torch.Tensor, total: int, value: torch.Tensor | float = 0.0) -> torch.Tensor:
    """``x`` (1-D) extended to ``total`` values with ``value`` (a scalar or a 1-element tensor)."""
    missing = total - x.numel()
    if missing == 0:
        return x
    fill = value.reshape(1).expand(missing) if isinstance(value, torch.Tensor) else x.new_full((missing,), value)
    return torch.cat([x, fill])


def _le(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a CPU tensor) in little-endian byte order: unchanged on little-endian hosts."""
    if _LITTLE or t.element_size() == 1:
        return t
    n = t.element_size()  # pragma: no cover - big-endian hosts only
    return t.contiguous().view(torch.uint8).view(-1, n).flip(1).reshape(-1).view(t.dtype)  # pragma: no cover


def _to_bytes(*parts: torch.Tensor) -> bytes:
    """The little-endian bytes of ``parts`` (each 1-D, on any device) one after the other: the one device → host
    copy of an encode, written straight into the payload buffer."""
    host = [_le(p.detach().contiguous().cpu()).view(torch.uint8) for p in parts]
    buf = bytearray(sum(h.numel() for h in host))
    if buf:
        out, pos = torch.frombuffer(buf, dtype=torch.uint8), 0
        for h in host:
            out[pos : pos + h.numel()] = h
            pos += h.numel()
    return bytes(buf)


def _read(buf: memoryview, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor:
    """``count`` little-endian values of ``dtype`` at byte ``offset`` as a fresh, writable CPU tensor (a copy:
    the result never aliases the payload)."""
    if count == 0:
        return torch.zeros(0, dtype=dtype)
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.frombuffer(bytearray(buf[offset : offset + count * size]), dtype=torch.uint8)
    return _le(raw.view(dtype))


def _read_f32(buf: memoryview, offset: int, count: int) -> torch.Tensor:
    """``count`` little-endian float32 values at byte ``offset`` as a fresh, writable float32 tensor."""
    return _read(buf, torch.float32, offset, count)


def _read_u8(buf: memoryview, offset: int, count: int) -> torch.Tensor:
    """``count`` bytes at ``offset`` as a fresh, writable uint8 tensor."""
    return _read(buf, torch.uint8, offset, count)


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
    #: Whether the codec is meant to run behind error feedback (:mod:`p2ptrain.algo.feedback`): it drops so
    #: much that a peer must keep what it did not send.
    error_feedback: ClassVar[bool] = False
    #: Inputs smaller than this are encoded on the CPU (a GPU round trip costs more than it saves).
    GPU_MIN_NUMEL: ClassVar[int] = 1 << 16
    #: Bytes per value when a payload is the values' encodings one after the other (no block headers), so that
    #: any range of values is a range of bytes; 0 otherwise.
    value_bytes: ClassVar[int] = 0

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
        if not all_finite(out):
            raise ValueError(f"{self.name}: {_NON_FINITE_PAYLOAD}")
        return out

    def decode_into(self, data: bytes, out: torch.Tensor) -> None:
        """Decode a payload of ``out.numel()`` values into ``out`` (a 1-D float32 CPU tensor), ValueError as
        :meth:`decode` (``out`` may then hold part of the payload). A codec whose payload is its values' bytes
        writes them straight in, with no tensor of its own in between."""
        out.copy_(self.decode(data, out.numel()))

    @abstractmethod
    def encoded_size(self, numel: int) -> int:
        """Exact payload size in bytes for ``numel`` values (ValueError for a negative or non-integer count)."""

    #: Whether :meth:`error_bound` of a value depends on that value alone (no block scales): then the bound of
    #: a payload encoded in chunks is the bound of all its values at once.
    elementwise_bound = False

    def error_bound(self, decoded: torch.Tensor) -> torch.Tensor:
        """For each value of one decoded payload (1-D float32), the largest ``|x − decoded|`` of any finite input
        ``x`` that encodes to it (inf where the codec saturates); block headers are read back from the decoded
        values themselves. Used to check a part owner's average (collective/sketch.py)."""
        return torch.zeros_like(decoded)

    @property
    def lossless(self) -> bool:
        """Whether :meth:`error_bound` is 0 everywhere (the codec's own, not overridden): a payload decodes to
        exactly the float32 values encoded."""
        return type(self).error_bound is Codec.error_bound

    @abstractmethod
    def _encode(self, x: torch.Tensor) -> bytes:
        """Payload of ``x``: a non-empty, finite, contiguous 1-D float32 tensor (CPU, or the encoding GPU)."""

    @abstractmethod
    def _decode(self, buf: memoryview, numel: int) -> torch.Tensor:
        """Values of a payload whose length has been checked; ``numel`` > 0."""
