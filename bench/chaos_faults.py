"""Part 2 of bench/chaos.py: faults on peer processes, each a function (trial) -> (detected, data lost, note)."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from p2ptrain.procs import wait_lines

P2PTRAIN = [sys.executable, "-m", "p2ptrain"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(args: list[str], log: Path, timeout: float) -> tuple[int, str]:
    with open(log, "wb") as f:
        proc = subprocess.run([*P2PTRAIN, *args], stdout=f, stderr=subprocess.STDOUT, env=ENV, timeout=timeout,
                              check=False)
    return proc.returncode, log.read_text(errors="replace")


def _start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        return subprocess.Popen([*P2PTRAIN, *args], stdout=f, stderr=subprocess.STDOUT, env=ENV)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def _bootstrap(work: Path) -> tuple[subprocess.Popen[bytes], list[str]]:
    boot = _start(["bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--maddrs-file", str(work / "boot.maddrs")],
                  work / "boot.log")
    return boot, wait_lines(work / "boot.maddrs", 60, boot)


def _join(work: Path, name: str, maddrs: list[str], run: str, extra: list[str]) -> subprocess.Popen[bytes]:
    args = ["join", "--run-id", run, "--preset", "micro", "--method", "streaming", "--H", "8", "--P", "2",
            "--step-seconds", "0.1", "--metrics-port", "-1", "-q", "--log-level", "INFO",
            "--json", str(work / f"{name}.json"), *extra]
    for m in maddrs:
        args += ["--initial-peers", m]
    return _start(args, work / f"{name}.log")


def corrupt_checkpoint(trial: int) -> tuple[bool, bool, str]:
    """Overwrite 64 KiB inside the tensor data of the newest checkpoint; resume with ``train --resume``."""
    work = Path(tempfile.mkdtemp(prefix="chaos-ckpt-"))
    ck = work / "ck"
    code, _ = _run(["train", "--preset", "micro", "--steps", "40", "--checkpoint-dir", str(ck),
                    "--json", str(work / "a.json")], work / "a.log", 600)
    if code == 0:  # a second checkpoint, 20 steps later (the last step of a run always saves)
        code, _ = _run(["train", "--preset", "micro", "--steps", "60", "--checkpoint-dir", str(ck), "--resume",
                        "--json", str(work / "a2.json")], work / "a2.log", 600)
    files = sorted(ck.glob("*.safetensors"), key=lambda p: p.stat().st_mtime)
    if code != 0 or len(files) < 2:
        return False, True, f"the first run did not leave two checkpoints (exit {code})"
    newest = files[-1]
    data = bytearray(newest.read_bytes())
    start = len(data) - 96 * 1024 - 1024 * trial
    data[start : start + 64 * 1024] = os.urandom(64 * 1024)
    newest.write_bytes(bytes(data))
    code, text = _run(["train", "--preset", "micro", "--steps", "80", "--checkpoint-dir", str(ck), "--resume",
                       "--json", str(work / "b.json")], work / "b.log", 600)
    named = newest.name in text
    import json

    summary = json.loads((work / "b.json").read_text()) if (work / "b.json").exists() else {}
    loss = summary.get("final_val_loss", math.nan)
    finite = isinstance(loss, (int, float)) and math.isfinite(loss)
    return named and code == 0, not finite, f"exit {code}; bad file named: {named}; final loss {loss}"


def another_preset(trial: int) -> tuple[bool, bool, str]:
    """A peer of another model joins a running swarm: refused with one line before it trains."""
    work = Path(tempfile.mkdtemp(prefix="chaos-preset-"))
    boot, maddrs = _bootstrap(work)
    run = f"chaos-preset-{trial}-{os.getpid()}"
    procs = [boot]
    try:
        procs.append(_join(work, "a", maddrs, run, ["--steps", "400"]))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "event=step" not in (work / "a.log").read_text(errors="replace") \
                and "train" not in (work / "a.log").read_text(errors="replace"):
            time.sleep(0.5)
        time.sleep(5)
        args = ["join", "--run-id", run, "--preset", "tiny", "--method", "streaming", "--H", "8", "--P", "2",
                "--step-seconds", "0.1", "--metrics-port", "-1", "-q", "--steps", "50"]
        for m in maddrs:
            args += ["--initial-peers", m]
        code, text = _run(args, work / "b.log", 300)
        said = re.search(r"(?i)another model|fingerprint|does not match", text) is not None
        trained = "rounds complete" in text
        return code != 0 and said and not trained, False, f"exit {code}; said why: {said}"
    finally:
        _stop(procs)


def wrong_key(trial: int) -> tuple[bool, bool, str]:
    """A peer with another swarm key: told once why the swarm refuses it."""
    work = Path(tempfile.mkdtemp(prefix="chaos-key-"))
    (work / "a.key").write_text(os.urandom(24).hex())
    (work / "b.key").write_text(os.urandom(24).hex())
    boot, maddrs = _bootstrap(work)
    run = f"chaos-key-{trial}-{os.getpid()}"
    procs = [boot]
    try:
        procs.append(_join(work, "a", maddrs, run, ["--steps", "400", "--swarm-key", str(work / "a.key")]))
        time.sleep(8)
        b = _join(work, "b", maddrs, run, ["--steps", "60", "--swarm-key", str(work / "b.key")])
        procs.append(b)
        b.wait(300)
        text = (work / "b.log").read_text(errors="replace")
        told = text.count("swarm_refuses_this_peer")
        return told == 1, False, f"told {told} time(s)"
    finally:
        _stop(procs)


def started_together(trial: int) -> tuple[bool, bool, str]:
    """Two peers started in the same second: they must share rounds (400 steps of 0.1 s: past the warm-up, which
    keeps a new peer out of rounds for three heartbeats)."""
    import json

    work = Path(tempfile.mkdtemp(prefix="chaos-together-"))
    boot, maddrs = _bootstrap(work)
    run = f"chaos-together-{trial}-{os.getpid()}"
    procs = [boot]
    try:
        a = _join(work, "a", maddrs, run, ["--steps", "400"])
        b = _join(work, "b", maddrs, run, ["--steps", "400"])
        procs += [a, b]
        try:
            a.wait(600)
            b.wait(600)
        except subprocess.TimeoutExpired:
            return False, False, "did not finish 400 steps in 10 minutes"
        shared = [json.loads((work / f"{n}.json").read_text()).get("rounds_shared", 0) for n in ("a", "b")
                  if (work / f"{n}.json").exists()]
        return len(shared) == 2 and min(shared) > 0, False, f"rounds shared {shared}"
    finally:
        _stop(procs)


def sigterm_while_failing(trial: int) -> tuple[bool, bool, str]:
    """SIGTERM to a peer whose rounds keep failing (its partner SIGSTOPped): it leaves within its bound."""
    work = Path(tempfile.mkdtemp(prefix="chaos-term-"))
    boot, maddrs = _bootstrap(work)
    run = f"chaos-term-{trial}-{os.getpid()}"
    procs = [boot]
    try:
        a = _join(work, "a", maddrs, run, ["--steps", "100000"])
        b = _join(work, "b", maddrs, run, ["--steps", "100000"])
        procs += [a, b]
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and "round_done" not in (work / "a.log").read_text(errors="replace") \
                and "rounds" not in (work / "a.log").read_text(errors="replace"):
            time.sleep(1)
        os.kill(b.pid, signal.SIGSTOP)  # the partner freezes: a's rounds now fail or wait out their timeouts
        time.sleep(15)
        t0 = time.monotonic()
        a.send_signal(signal.SIGTERM)
        try:
            code = a.wait(300)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - t0
        os.kill(b.pid, signal.SIGCONT)
        return code is not None, False, f"left in {took:.1f} s (exit {code})"
    finally:
        _stop(procs)


FAULTS: dict[str, Callable[[int], tuple[bool, bool, str]]] = {
    "corrupt newest checkpoint, train --resume": corrupt_checkpoint,
    "a peer of another preset joins": another_preset,
    "a peer with the wrong swarm key": wrong_key,
    "two peers started in the same second": started_together,
    "SIGTERM while rounds fail": sigterm_while_failing,
}
