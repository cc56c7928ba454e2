"""Leaving on signals: the first lets the peer leave cleanly, bounded by a grace period; a second leaves at once."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest

from p2ptrain.cli.session import RunSession


@pytest.fixture(autouse=True)
def _handlers_put_back() -> Any:
    """Every test here installs handlers for SIGTERM and SIGINT: the ones from before are put back after it."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield saved
    for s, h in saved.items():
        signal.signal(s, h)


class _Stuck:
    """A peer whose rounds keep failing: it is asked to stop and never does."""

    on_status = None

    def __init__(self) -> None:
        self.stop_requested = threading.Event()

    def request_stop(self) -> None:
        self.stop_requested.set()


def test_a_peer_that_does_not_leave_is_made_to_and_a_second_signal_leaves_at_once() -> None:
    exits: list[int] = []
    exited = threading.Event()

    def exit_now(code: int) -> Any:
        exits.append(code)
        exited.set()

    peer = _Stuck()
    RunSession("streaming", "").stop_on_signals(peer, grace=0.3, exit_now=exit_now)  # type: ignore[arg-type]
    os.kill(os.getpid(), signal.SIGTERM)
    assert peer.stop_requested.wait(5)  # asked to leave after its step
    assert exited.wait(5) and exits == [124]  # still there after the grace period: made to leave
    with pytest.raises(SystemExit) as e:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C after the first signal: at once
        time.sleep(5)  # the handler runs between bytecodes, long before this ends
    assert e.value.code == 130


def test_the_deadline_is_off_once_the_peer_has_left() -> None:
    """A peer that left in time: its summary (a final evaluation of θ) is not cut short by the deadline."""
    exits: list[int] = []

    class _Leaves(_Stuck):
        def run(self) -> int:
            os.kill(os.getpid(), signal.SIGTERM)  # asked to leave while running, and it does
            assert self.stop_requested.wait(5)
            return 7

    session, peer = RunSession("streaming", ""), _Leaves()
    session.stop_on_signals(peer, grace=0.2, exit_now=exits.append)  # type: ignore[arg-type]
    result, _ = session.run(peer, True, lambda r: time.sleep(0.5) or 1.0)  # type: ignore[arg-type]
    assert result == 7 and exits == []  # the 0.5 s evaluation outlived the 0.2 s deadline unharmed


def test_a_signal_while_the_peer_is_built_is_held_and_acted_on_once_the_session_can() -> None:
    """A SIGTERM during the imports and the model's build does not end the process: the session's handlers take
    it as their first signal (the peer is asked to leave, the deadline runs); a second one leaves at once."""
    from p2ptrain.cli.session import HeldSignal

    exits: list[int] = []
    held = HeldSignal().arm()
    os.kill(os.getpid(), signal.SIGTERM)  # would end the process with exit code -15 by default
    deadline = time.monotonic() + 5
    while held.signum is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert held.signum == signal.SIGTERM
    peer = _Stuck()
    RunSession("streaming", "").stop_on_signals(peer, grace=30, exit_now=exits.append,  # type: ignore[arg-type]
                                                held=held)
    assert peer.stop_requested.is_set() and exits == []  # asked to leave at once, cleanly
    with pytest.raises(SystemExit) as e:
        os.kill(os.getpid(), signal.SIGTERM)  # the held one was the first: this is the second
        time.sleep(5)
    assert e.value.code == 130


def test_a_second_signal_while_held_leaves_at_once_and_disarm_puts_the_old_handlers_back(
        _handlers_put_back: dict[int, Any]) -> None:
    from p2ptrain.cli.session import HeldSignal

    saved = _handlers_put_back

    held = HeldSignal().arm()
    with pytest.raises(SystemExit) as e:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    assert e.value.code == 130 and held.signum == signal.SIGINT
    held.disarm()
    assert {s: signal.getsignal(s) for s in saved} == saved
