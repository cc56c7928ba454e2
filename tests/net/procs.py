"""Helpers that run real `p2ptrain join` processes on 127.0.0.1 (a recipe, start, wait, stop)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from p2ptrain.procs import wait_lines

RECIPE = """
preset = "tiny"
[model]
d_model = 32
n_layers = 3
n_heads = 2
seq_len = 32
[trainer]
batch_size = 2
warmup_steps = 2
[method]
name = "streaming"
H = 8
P = 2
tau = 2
codec = "fp32"
timeout = 6.0
[peer]
run_id = "{run_id}"
step_seconds = 0.1
join_window = 1.0
heartbeat = 0.5
ttl = 3.0
min_step_seconds = 0.1
"""


def write_recipe(tmp: Path, run_id: str) -> Path:
    path = tmp / "recipe.toml"
    path.write_text(RECIPE.format(run_id=run_id))
    return path


def join(tmp: Path, name: str, steps: int, initial: list[str], env: dict[str, str] | None = None,
         metrics_port: int = 0, region: str | None = None, extra: list[str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``p2ptrain join`` with the recipe in ``tmp``; its log, summary and addresses go to ``tmp/name.*``."""
    cmd = [sys.executable, "-m", "p2ptrain", "join", "-c", str(tmp / "recipe.toml"), "--steps", str(steps),
           "--json", str(tmp / f"{name}.json"), "--maddrs-file", str(tmp / f"{name}.maddrs"), "-q",
           "--log-level", "INFO", "--metrics-port", str(metrics_port)]
    if region:
        cmd += ["--region", region]
    for m in initial:
        cmd += ["--initial-peers", m]
    cmd += extra or []
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with open(tmp / f"{name}.log", "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)



wait_file = wait_lines


def wait_log(path: Path, pattern: str, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> re.Match[str]:
    """Wait until a line of the log at ``path`` matches ``pattern``; the match."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and (m := re.search(pattern, path.read_text(errors="replace"))):
            return m
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.1)
    tail = path.read_text(errors="replace")[-2000:] if path.exists() else ""
    raise TimeoutError(f"{pattern!r} not in {path.name}: {tail}")


def kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)
