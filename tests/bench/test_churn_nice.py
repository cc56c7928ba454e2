"""``--start-nice`` (bench/churn.py, ``set_start_nice``): a start-up's session gets the niceness as a scheduling group,
not only its processes (with autogroups on, a process's own niceness weighs only inside its session's group)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.churn import set_start_nice


def test_a_start_ups_session_and_its_processes_take_the_niceness_and_give_it_back() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        group = Path(f"/proc/{child.pid}/autogroup")
        assert set_start_nice(child.pid, 5)
        assert os.getpriority(os.PRIO_PGRP, child.pid) == 5
        if group.exists():  # (kernels built without autogroups have no such file)
            assert group.read_text().split()[-1] == "5", group.read_text()
        if os.geteuid() != 0:
            pytest.skip("giving the niceness back below its start needs root")
        assert set_start_nice(child.pid, 0)
        assert os.getpriority(os.PRIO_PGRP, child.pid) == 0
        if group.exists():
            assert group.read_text().split()[-1] == "0", group.read_text()
    finally:
        child.kill()
        child.wait(timeout=10)


def test_a_session_that_is_gone_is_not_raised() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    child.wait(timeout=30)
    assert not set_start_nice(child.pid, 5)
