"""fp32 snapshots of parameters for the outer loop, in pinned host memory on a GPU.

The outer loop keeps a copy of every fragment's θ (and its momentum): on a GPU
that copy belongs in host memory, next to the network, not in the device memory
training needs. :class:`HostSnapshots` copies parameters device → pinned host
memory on a side CUDA stream: the copy waits for the compute stream's pending
writes, runs while the compute stream goes on, and the compute stream waits (on
the device, not the host) for the copy before it may overwrite those parameters.
``take(...).wait()`` blocks the host only until the copy itself is done.

On the CPU (or without CUDA) a snapshot is a plain fp32 clone, ready at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["HostSnapshots", "PendingSnapshot"]


class PendingSnapshot:
    """Tensors being copied; :meth:`wait` returns them once the copy is complete."""

    def __init__(self, tensors: list[torch.Tensor], event: torch.cuda.Event | None = None) -> None:
        self._tensors, self._event = tensors, event

    def ready(self) -> bool:
        return self._event is None or bool(self._event.query())

    def wait(self) -> list[torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._tensors


class HostSnapshots:
    """Snapshots of tensors on ``device``: pinned host fp32 copies on a side stream (CUDA), or clones (CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @torch.no_grad()
    def take(self, tensors: Sequence[torch.Tensor]) -> PendingSnapshot:
        """Start copying ``tensors`` (fp32 copies; on CUDA into pinned host memory)."""
        if self.stream is None:
            return PendingSnapshot([t.detach().float().clone() for t in tensors])
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # see every write queued so far
        out = []
        with torch.cuda.stream(self.stream):
            for t in tensors:
                src = t.detach()
                if src.dtype != torch.float32:
                    src = src.float()  # made on the side stream: it lives until the copy below is done
                buf = torch.empty(src.shape, dtype=torch.float32, pin_memory=True)
                buf.copy_(src, non_blocking=True)
                out.append(buf)
            event = torch.cuda.Event()
            event.record(self.stream)
        compute.wait_event(event)  # later writes to these parameters wait for the copy (on the device)
        return PendingSnapshot(out, event)
