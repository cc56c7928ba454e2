"""Where a peer's start-up time goes: one ``event=started`` line with the wall and CPU seconds of each phase.

A restarted or new peer trains nothing until it has imported torch and the network stack, built its model,
connected, agreed the pacing and downloaded the swarm's state; on a loaded machine that takes a minute or more,
and every second of it is a second of the peer's GPU lost to the swarm. The line says which phase took it:

    event=started process_seconds=61.2 cpu_seconds=7.9 before_start=48.0 connect=6.1 pacing=0.4 state=6.7

``process_seconds``: wall time since the process began (from ``/proc``; absent where there is none);
``cpu_seconds``: the CPU time the process used by then (a loaded machine stretches the wall time of the same CPU
work); ``before_start``: the wall seconds before the peer's start began (imports, model, checkpoint); the rest:
each phase of :meth:`~p2ptrain.peer.base.PeerBase.start`; ``trained``, when there: the seconds of those phases
the peer trained through (a resumed peer trains its checkpoint's model while it connects), not lost to the swarm.
"""

from __future__ import annotations

import logging
import os
import time

__all__ = ["StartupClock", "process_age"]

log = logging.getLogger(__name__)


def process_age(stat: str | None = None, uptime: str | None = None) -> float | None:
    """Wall seconds since this process began, from ``/proc/self/stat`` (its start, in clock ticks after boot)
    and ``/proc/uptime``; None where they cannot be read (not Linux). ``stat``/``uptime``: their text, for tests."""
    try:
        if stat is None:
            with open("/proc/self/stat") as f:
                stat = f.read()
        if uptime is None:
            with open("/proc/uptime") as f:
                uptime = f.read()
        # The command name (field 2) may hold spaces and parentheses: count fields after its closing one.
        fields = stat[stat.rindex(")") + 2:].split()
        start_ticks = int(fields[19])  # field 22 of stat(5): starttime
        ticks = os.sysconf("SC_CLK_TCK")
        return max(0.0, float(uptime.split()[0]) - start_ticks / ticks)
    except (OSError, ValueError, IndexError):
        return None


class StartupClock:
    """The phases of a start: :meth:`mark` at the end of each, :meth:`report` once at the end."""

    def __init__(self) -> None:
        self._age0 = process_age()
        self._t = time.monotonic()
        self.phases: dict[str, float] = {}
        self.notes: dict[str, float] = {}  # figures of the start that are not phases (``trained``)

    def mark(self, phase: str) -> None:
        """The phase ``phase`` ended now (its seconds: since the last mark, or since the clock began)."""
        now = time.monotonic()
        self.phases[phase] = now - self._t
        self._t = now

    def fields(self) -> dict[str, float]:
        """The line's fields: process and CPU seconds so far, the seconds before the start, each phase's."""
        out: dict[str, float] = {}
        elapsed = sum(self.phases.values())
        if self._age0 is not None:
            out["process_seconds"] = self._age0 + elapsed
            out["before_start"] = self._age0
        out["cpu_seconds"] = time.process_time()
        out.update(self.phases)
        out.update(self.notes)
        return out

    def report(self) -> dict[str, float]:
        """Log the ``event=started`` line; its fields."""
        f = self.fields()
        log.info("event=started %s", " ".join(f"{k}={v:.1f}" for k, v in f.items()))
        return f
