"""Fault injection for tests of real peers, switched on by environment variables only.

``P2PTRAIN_FAULT_KILL_IN_ALLREDUCE=N``: the process SIGKILLs itself in its N-th
all-reduce phase, right after its share has left for the part owners and before
it averages its own part (the worst moment for the others).
"""

from __future__ import annotations

import os
import signal

__all__ = ["maybe_die_in_allreduce"]

_calls = 0


def maybe_die_in_allreduce() -> None:
    global _calls
    target = os.environ.get("P2PTRAIN_FAULT_KILL_IN_ALLREDUCE")
    if not target:
        return
    _calls += 1
    if _calls == int(target):
        os.kill(os.getpid(), signal.SIGKILL)
