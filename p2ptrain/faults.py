"""Fault injection for tests of real peers, switched on by environment variables only.

``P2PTRAIN_FAULT_KILL_IN_ALLREDUCE=N``: the process SIGKILLs itself in its N-th
all-reduce phase, right after its share has left for the part owners and before
it averages its own part (the worst moment for the others).

``P2PTRAIN_FAULT_KILL_IN_CHECKPOINT=N``: the process SIGKILLs itself in its N-th
checkpoint write, after half of the temporary file is on disk and before the rename.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import torch

__all__ = ["CORRUPTIONS", "corrupt_payload", "corrupt_update", "maybe_die_in_allreduce", "maybe_die_in_checkpoint", "maybe_die_mid_write"]

_calls = 0
_checkpoints = 0
_armed = False


def maybe_die_in_allreduce() -> None:
    global _calls
    target = os.environ.get("P2PTRAIN_FAULT_KILL_IN_ALLREDUCE")
    if not target:
        return
    _calls += 1
    if _calls == int(target):
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_die_in_checkpoint() -> None:
    """Arm :func:`maybe_die_mid_write` for this checkpoint if it is the N-th."""
    global _checkpoints, _armed
    target = os.environ.get("P2PTRAIN_FAULT_KILL_IN_CHECKPOINT")
    if not target:
        return
    _checkpoints += 1
    _armed = _checkpoints == int(target)


def maybe_die_mid_write() -> None:
    """Called by the checkpoint writer with half the temporary file written."""
    if _armed:
        os.kill(os.getpid(), signal.SIGKILL)


CORRUPTIONS = ("nan", "scale", "random", "shape", "truncate")


def corrupt_update(flat: torch.Tensor, mode: str) -> torch.Tensor:
    """A broken or hostile peer's version of the update it sends (tests and fault-injection runs only):
    ``nan`` (some values NaN), ``scale`` (×100), ``random`` (noise 100× the update's norm), ``shape``
    (three extra values). ``truncate`` cuts the encoded payload instead: see the transports."""
    if mode == "nan":
        out = flat.clone()
        out[:: max(1, out.numel() // 7)] = float("nan")
        return out
    if mode == "scale":
        return flat * 100.0
    if mode == "random":
        noise = torch.randn_like(flat)
        return noise * (100.0 * float(flat.norm()) / max(1e-12, float(noise.norm())))
    if mode == "shape":
        return torch.cat([flat, torch.zeros(3, dtype=flat.dtype)])
    if mode == "truncate":
        return flat
    raise ValueError(f"unknown corruption {mode!r}: choose one of {', '.join(CORRUPTIONS)}")


def corrupt_payload(codec: Any, flat: torch.Tensor, mode: str) -> tuple[bytes, torch.Tensor]:
    """The encoded bytes a broken or hostile peer sends for ``flat``, and the tensor they claim to hold
    (codecs refuse to encode non-finite values, so ``nan`` is written as raw fp32 NaNs, or as 0xFF
    bytes for the other codecs)."""
    bad = corrupt_update(flat, mode)
    if mode == "nan":
        if codec.name == "fp32":
            return bad.float().numpy().tobytes(), bad
        return b"\xff" * codec.encoded_size(flat.numel()), flat
    data = codec.encode(bad)
    if mode == "truncate":
        data = data[: len(data) // 2]
    return data, bad
