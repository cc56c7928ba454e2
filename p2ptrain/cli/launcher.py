"""The stage launcher of ``join --pipeline-stages S``, and the per-stage ports and file names.

Without a process-group environment, ``join --pipeline-stages S`` is the *launcher*: it starts S stage
processes (the same command, with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``
set), forwards SIGTERM/SIGINT to them (they leave together after the same step), and stops the rest when
one exits with an error (SIGTERM, then SIGKILL after a grace period). ``torchrun --nproc-per-node S`` sets
the same environment, so each of its processes is a stage without this launcher.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..procs import free_port

__all__ = ["GRACE_SECONDS", "launch_stages", "offset_port", "per_rank"]

#: Seconds the other stages get to leave after one failed, before they are killed.
GRACE_SECONDS = 30.0


def offset_port(maddr: str, k: int) -> str:
    """``maddr`` with its TCP/UDP port moved up by ``k`` (port 0, "any", stays 0): namespace k of one
    machine listens on its own port."""
    def bump(m: re.Match[str]) -> str:
        port = int(m.group(2))
        return f"/{m.group(1)}/{port + k if port else 0}"

    return re.sub(r"/(tcp|udp)/(\d+)", bump, maddr, count=1)


def per_rank(path: Path | None, rank: int, world: int) -> Path | None:
    """A stage process's own output file: ``name.rankR.ext`` (unchanged for one process)."""
    if path is None or world == 1 or str(path) == "-":  # standard output is every stage's
        return path
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def launch_stages(stages: int, argv: list[str]) -> int:
    """Run ``p2ptrain <argv>`` as ``stages`` pipeline processes on this machine; their worst exit code
    (1 when one was killed by a signal). No stage outlives the launcher, whatever ends it."""
    from ..ui import console

    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    for r in range(stages):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(stages), "LOCAL_RANK": str(r),
               "LOCAL_WORLD_SIZE": str(stages), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-m", "p2ptrain", *argv], env=env))
    console.print(f"pipeline peer: {stages} stage processes {[p.pid for p in procs]}", highlight=False)

    def forward(signum: int, _frame: Any) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        failed_at: float | None = None
        while any(p.poll() is None for p in procs):
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                bad = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
                console.print(f"[red]stage {bad} exited with an error: stopping the others[/]", highlight=False)
                forward(signal.SIGTERM, None)
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > GRACE_SECONDS:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.2)
    finally:
        for p in procs:  # never leave a stage behind (the launcher itself was killed or failed)
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for s, h in old.items():
            signal.signal(s, h)
    return max((p.returncode or 0) for p in procs) if all(p.returncode is not None and p.returncode >= 0
                                                          for p in procs) else 1
