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

__all__ = ["maybe_die_in_allreduce", "maybe_die_in_checkpoint", "maybe_die_mid_write"]

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
