"""Leaving on signals: the first lets the peer leave cleanly, bounded by a grace period; a second leaves at once."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest

from p2ptrain.cli.session import RunSession


class _Stuck:
    """A peer whose rounds keep failing: it is asked to stop and never does."""

    on_status = None

    def __init__(self) -> None:
        self.stop_requested = threading.Event()

    def request_stop(self) -> None:
        self.stop_requested.set()


def test_a_peer_that_does_not_leave_is_made_to_and_a_second_signal_leaves_at_once() -> None:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    exits: list[int] = []
    exited = threading.Event()

    def exit_now(code: int) -> Any:
        exits.append(code)
        exited.set()

    peer = _Stuck()
    try:
        RunSession.stop_on_signals(peer, grace=0.3, exit_now=exit_now)  # type: ignore[arg-type]
        os.kill(os.getpid(), signal.SIGTERM)
        assert peer.stop_requested.wait(5)  # asked to leave after its step
        assert exited.wait(5) and exits == [124]  # still there after the grace period: made to leave
        with pytest.raises(SystemExit) as e:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C after the first signal: at once
            time.sleep(5)  # the handler runs between bytecodes, long before this ends
        assert e.value.code == 130
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
