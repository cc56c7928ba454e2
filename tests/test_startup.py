"""The start-up line's clock: a process's age from /proc, and the phases of a start."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest

from p2ptrain.peer.startup import StartupClock, process_age


def test_process_age_reads_the_start_tick_after_a_command_name_with_spaces_and_parentheses() -> None:
    ticks = os.sysconf("SC_CLK_TCK")
    # pid, (comm), state, then fields 4..21, then starttime (field 22) = 5 s after boot in ticks
    stat = "4242 (a (weird) name) S " + " ".join(["0"] * 18) + f" {5 * ticks} 0 0\n"
    assert process_age(stat, "12.50 3.00\n") == pytest.approx(7.5)
    assert process_age("garbage", "1.0 1.0") is None
    assert process_age(stat, "") is None


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="no /proc here")
def test_process_age_of_a_child_lies_between_its_sleep_and_the_wall_time_around_it() -> None:
    code = "import time; time.sleep(1.0); from p2ptrain.peer.startup import process_age; print(process_age())"
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    wall = time.monotonic() - t0
    assert 1.0 <= float(out.stdout) <= wall + 0.02, (out.stdout, wall)  # /proc counts in clock ticks


def test_the_clock_logs_each_phase_and_the_cpu_time(caplog: pytest.LogCaptureFixture) -> None:
    clock = StartupClock()
    time.sleep(0.05)
    clock.mark("connect")
    clock.mark("state")
    with caplog.at_level(logging.INFO, logger="p2ptrain.peer.startup"):
        fields = clock.report()
    assert fields["connect"] >= 0.05 and 0 <= fields["state"] < fields["connect"]
    assert 0 < fields["cpu_seconds"] <= time.process_time()
    if "process_seconds" in fields:  # Linux
        assert fields["process_seconds"] >= fields["before_start"] + fields["connect"]
    line = caplog.records[-1].getMessage()
    assert line.startswith("event=started ") and f"connect={fields['connect']:.1f}" in line
