"""Checkpoints of a swarm peer: SIGKILL at random moments (also half-way through a checkpoint write)
always resumes from a valid checkpoint with identical counters, optimizer and outer state; a
graceful leave (SIGTERM) writes a checkpoint and exits 0."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest

from p2ptrain.checkpoint import CheckpointDir
from p2ptrain.peer_checkpoint import resumable_digest

from .procs import join, kill_all, wait_file, wait_log, write_recipe

pytestmark = [pytest.mark.net, pytest.mark.timeout(600)]

KILLS = 20


def _recipe(tmp: Path) -> None:
    path = write_recipe(tmp, "resume")
    path.write_text(path.read_text() + "checkpoint_every = 1\n")  # a checkpoint per applied round


def test_sigkill_at_twenty_random_moments_always_resumes_exactly(tmp_path: Path) -> None:
    _recipe(tmp_path)
    ckdir, rng = tmp_path / "ck", random.Random(20261122)
    store = CheckpointDir(ckdir)
    procs = []
    last_step, resumed, mid_write = -1, 0, 0
    try:
        for i in range(KILLS):
            found = store.latest()
            in_write = i % 4 == 3  # every fourth death comes half-way through a checkpoint write
            env = {"P2PTRAIN_FAULT_KILL_IN_CHECKPOINT": str(rng.randint(1, 3))} if in_write else {}
            extra = ["--resume", str(ckdir)] if found else ["--checkpoint-dir", str(ckdir)]
            proc = join(tmp_path, f"run{i}", 100_000, [], env=env, extra=extra)
            procs.append(proc)
            log = tmp_path / f"run{i}.log"
            if found:  # the restored state is the newest valid checkpoint's, exactly
                path, state = found
                m = wait_log(log, r"event=resumed step=(\d+) state=([0-9a-f]{64})", 90, proc)
                assert int(m.group(1)) == state["trainer"]["step"], path
                assert m.group(2) == resumable_digest(state["trainer"], state["outer"]), path
                resumed += 1
            else:
                wait_file(tmp_path / f"run{i}.maddrs", 90)
            if in_write:
                assert proc.wait(90) == -signal.SIGKILL, log.read_text()[-2000:]
                assert any(p.name.endswith(".tmp") for p in ckdir.iterdir()), "the kill did not come mid-write"
                mid_write += 1
            else:
                if i == 0:  # the first run lives until it has written a checkpoint
                    wait_log(log, r"event=checkpoint", 60, proc)
                time.sleep(rng.uniform(0.0, 2.5))  # then death at a random moment of training
                assert proc.poll() is None, log.read_text()[-2000:]
                proc.send_signal(signal.SIGKILL)
                assert proc.wait(30) == -signal.SIGKILL
            now = store.latest()
            assert now is not None, f"run {i}: no valid checkpoint"
            step = now[1]["trainer"]["step"]
            assert step >= last_step, (i, step, last_step)  # never behind an earlier checkpoint
            last_step = step
        assert resumed >= KILLS - 1 and mid_write == KILLS // 4
        # A graceful leave: SIGTERM finishes the step, writes a checkpoint, leaves, exits 0.
        proc = join(tmp_path, "last", 100_000, [], extra=["--resume", str(ckdir)])
        procs.append(proc)
        wait_log(tmp_path / "last.log", r"event=checkpoint why=rounds", 90, proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, (tmp_path / "last.log").read_text()[-2000:]
        assert "event=checkpoint why=leave" in (tmp_path / "last.log").read_text()
        assert store.latest()[1]["trainer"]["step"] >= last_step  # type: ignore[index]
        assert not [p for p in ckdir.iterdir() if p.name.endswith(".tmp")]
    finally:
        kill_all(procs)
