"""Real `p2ptrain join` processes on 127.0.0.1: one is SIGKILLed in the middle of an all-reduce."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.net, pytest.mark.timeout(300)]

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
run_id = "killtest"
step_seconds = 0.1
join_window = 1.0
heartbeat = 0.5
ttl = 3.0
min_step_seconds = 0.1
"""


def _join(tmp: Path, name: str, steps: int, initial: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "p2ptrain", "join", "-c", str(tmp / "recipe.toml"), "--steps", str(steps),
           "--json", str(tmp / f"{name}.json"), "--maddrs-file", str(tmp / f"{name}.maddrs"), "-q",
           "--log-level", "INFO", "--metrics-port", "0"]
    for m in initial:
        cmd += ["--initial-peers", m]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    log = open(tmp / f"{name}.log", "wb")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)


def _wait_file(path: Path, timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().split()
        time.sleep(0.2)
    raise TimeoutError(f"{path} did not appear")


def test_sigkill_mid_allreduce_does_not_stall_the_others(tmp_path: Path) -> None:
    (tmp_path / "recipe.toml").write_text(RECIPE)
    procs = []
    try:
        a = _join(tmp_path, "a", 150, [])
        procs.append(a)
        maddrs = _wait_file(tmp_path / "a.maddrs", 90)
        b = _join(tmp_path, "b", 150, maddrs)
        c = _join(tmp_path, "c", 150, maddrs, {"P2PTRAIN_FAULT_KILL_IN_ALLREDUCE": "4"})
        procs += [b, c]
        assert c.wait(120) == -9, (tmp_path / "c.log").read_text()[-2000:]  # died by SIGKILL, mid all-reduce
        killed_at = time.monotonic()
        for p, name in ((a, "a"), (b, "b")):
            assert p.wait(150) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        survivors = [json.loads((tmp_path / f"{n}.json").read_text()) for n in ("a", "b")]
        for s in survivors:
            assert s["steps"] == 150
            assert s["rounds_partial"] + s["rounds_failed"] >= 1  # the round c died in
            assert s["rounds_complete"] >= 3  # and they kept syncing after it
        common = set(survivors[0]["applied"]) & set(survivors[1]["applied"])
        assert common and all(survivors[0]["applied"][k] == survivors[1]["applied"][k] for k in common)
        assert time.monotonic() - killed_at < 140
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
