"""The all-reduce arithmetic, shared by the simulator and the in-memory transport.

A quantized all-reduce quantizes twice, as a butterfly / ring does: every peer's
contribution on its way to the part's owner (reduce-scatter), and the averaged
part on its way back (all-gather). The sum itself runs in fp32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..algo.compress import Codec

__all__ = ["quantized_mean", "wire_roundtrip"]


def wire_roundtrip(codec: Codec, flat: torch.Tensor) -> torch.Tensor:
    """``decode(encode(x))``: what a receiver sees of ``flat`` (1-D fp32)."""
    if codec.name == "fp32":
        return flat.float().clone()
    return codec.decode(codec.encode(flat), flat.numel())


def quantized_mean(payloads: Sequence[Sequence[torch.Tensor]], weights: Sequence[float],
                   codec: Codec) -> tuple[list[torch.Tensor], int]:
    """Weighted mean of every peer's tensors as a quantized all-reduce delivers it.

    Returns the averaged tensors (shapes of the first peer's) and the encoded size of
    one peer's vector in bytes (what a ring moves ``2(M−1)/M`` times).
    """
    if not payloads or len(payloads) != len(weights):
        raise ValueError("one payload and one weight per peer are needed")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("the weights of an all-reduce must sum to a positive number")
    shapes = [t.shape for t in payloads[0]]
    acc: torch.Tensor | None = None
    for tensors, w in zip(payloads, weights, strict=True):
        if [t.shape for t in tensors] != shapes:
            raise ValueError("peers' payloads differ in shape")
        flat = torch.cat([t.reshape(-1).float().cpu() for t in tensors]) if tensors else torch.zeros(0)
        part = wire_roundtrip(codec, flat) * (w / total)
        acc = part if acc is None else acc.add_(part)
    assert acc is not None
    out = wire_roundtrip(codec, acc)
    nbytes = codec.encoded_size(out.numel())
    device = payloads[0][0].device if payloads[0] else torch.device("cpu")
    pieces, offset = [], 0
    for s in shapes:
        n = int(torch.Size(s).numel())
        pieces.append(out[offset : offset + n].view(s).to(device))
        offset += n
    return pieces, nbytes
