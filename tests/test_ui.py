"""A swarm peer's status line: in place on a terminal, a line now and then elsewhere, nothing when quiet."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from p2ptrain import ui

STATUS = {"step": 7, "loss": 3.25, "tokens_per_second": 1234.0, "rounds": 2, "failed": 1, "in_flight": 1}


@pytest.fixture
def screen(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    buf = io.StringIO()
    monkeypatch.setattr(ui, "console", Console(file=buf, force_terminal=True, width=160))
    return buf


def test_on_a_terminal_one_bar_is_redrawn_in_place(screen: io.StringIO) -> None:
    with ui.StatusLine(100, quiet=False, live=True) as line:
        for step in range(1, 4):
            line.update({**STATUS, "step": step})
    text = screen.getvalue()
    assert "3/100" in text and "1,234 tok/s" in text and "rounds 2 (failed 1)" in text
    assert "\x1b[" in text  # cursor movements: redrawn in place, not a line per update
    assert text.count("step ") == 0  # not the log-style line


def test_elsewhere_a_line_every_so_often(screen: io.StringIO) -> None:
    with ui.StatusLine(100, quiet=False, every=3600.0, live=False) as line:
        line.update(STATUS)
        line.update({**STATUS, "step": 8})  # within the interval: not said
    lines = [x for x in screen.getvalue().splitlines() if x.strip()]
    assert len(lines) == 1 and "step      7" in lines[0] and "loss 3.250" in lines[0]


def test_quiet_says_nothing(screen: io.StringIO) -> None:
    for live in (True, False):
        with ui.StatusLine(100, quiet=True, live=live) as line:
            line.update(STATUS)
    assert screen.getvalue() == ""


def test_sharing_nothing_is_said() -> None:
    assert "nothing shared with another peer for 45 s" in ui.StatusLine.text({**STATUS, "sharing_nothing": 45.0})
