"""Real `p2ptrain join` processes on 127.0.0.1: one is SIGKILLed in the middle of an all-reduce."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from .procs import join, kill_all, wait_file, write_recipe

pytestmark = [pytest.mark.net, pytest.mark.timeout(300)]


def test_sigkill_mid_allreduce_does_not_stall_the_others(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, "killtest")
    # The survivor that runs last is left with the dead peer counted toward its quorum (it announced no region)
    # for quorum_memory seconds, rounds failing and compute stalled meanwhile: the cut rule, tested on its own
    # (tests/net/test_region_partition.py); 10 s instead of the default 120 s keeps this test about the kill.
    recipe.write_text(recipe.read_text() + "quorum_memory = 10.0\n")
    procs = []
    try:
        # ``a`` is the swarm: it trains until told to leave, so that it is still there however long the others take
        # to start (a loaded machine: with 150 steps of its own it finished before b's and c's daemons were up).
        a = join(tmp_path, "a", 100_000, [])
        procs.append(a)
        maddrs = wait_file(tmp_path / "a.maddrs", 90)
        b = join(tmp_path, "b", 150, maddrs)
        c = join(tmp_path, "c", 150, maddrs, {"P2PTRAIN_FAULT_KILL_IN_ALLREDUCE": "4"})
        procs += [b, c]
        assert c.wait(120) == -9, (tmp_path / "c.log").read_text()[-2000:]  # died by SIGKILL, mid all-reduce
        killed_at = time.monotonic()
        assert b.wait(150) == 0, (tmp_path / "b.log").read_text()[-3000:]
        assert time.monotonic() - killed_at < 90
        a.send_signal(signal.SIGTERM)  # a graceful leave: exit code 0 and its summary
        assert a.wait(60) == 0, (tmp_path / "a.log").read_text()[-3000:]
        survivors = [json.loads((tmp_path / f"{n}.json").read_text()) for n in ("a", "b")]
        assert survivors[1]["steps"] == 150
        for s in survivors:
            assert s["rounds_partial"] + s["rounds_failed"] >= 1  # the round c died in
            assert s["rounds_complete"] >= 3  # and they kept syncing after it ...
            assert s["rounds_shared"] >= 3  # ... with each other (a's rounds alone before b came do not count)
            assert s["stuck_rounds"] == 0  # every round, the one c died in too, ended within its own timeout
        common = set(survivors[0]["applied"]) & set(survivors[1]["applied"])
        assert common and all(survivors[0]["applied"][k] == survivors[1]["applied"][k] for k in common)
    finally:
        kill_all(procs)
