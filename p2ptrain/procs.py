"""Small helpers for scripts that run p2ptrain processes (benchmarks, examples, tests)."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

__all__ = ["free_port", "wait_lines"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_lines(path: Path, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> list[str]:
    """The whitespace-separated words of ``path`` once it has any (e.g. a ``--maddrs-file``); TimeoutError
    after ``timeout`` seconds, RuntimeError if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().split()
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {path.name} appeared")
        time.sleep(0.2)
    raise TimeoutError(f"{path} did not appear in {timeout:.0f} s")
