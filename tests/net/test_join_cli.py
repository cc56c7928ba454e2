"""`p2ptrain join` from the outside: a clear error when nobody answers."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.net, pytest.mark.timeout(120)]


def test_unreachable_initial_peers_give_a_clear_error_after_retries() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    maddr = f"/ip4/127.0.0.1/tcp/{port}/p2p/12D3KooWAupgdBAYgxcu6EbnoP2EGJvaFrwAo795BwSsmnG11agR"
    r = subprocess.run([sys.executable, "-m", "p2ptrain", "join", "--initial-peers", maddr, "--connect-attempts", "2",
                        "--steps", "1", "-q", "--metrics-port", "-1"], capture_output=True, text=True, timeout=100)
    text = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 1, text[-2000:]
    assert "could not join the swarm after 2 attempts" in text
    assert "event=connect_retry attempt=1 of=2" in text
    assert "Traceback" not in text


@pytest.mark.parametrize("flags,message", [
    (["--aggregation", "median-of-means"], "'median-of-means' is not one of"),  # a choice: the names are listed
    (["--norm-bound", "0.5"], "norm_bound must be above 1"),
    (["--resume"], "--resume needs --checkpoint-dir"),
])
def test_bad_flags_give_a_clear_error(flags: list[str], message: str) -> None:
    r = subprocess.run([sys.executable, "-m", "p2ptrain", "join", "--steps", "1", "-q", "--metrics-port", "-1", *flags],
                       capture_output=True, text=True, timeout=100)
    text = " ".join((r.stdout + r.stderr).split())
    assert r.returncode != 0 and message in text, text[-2000:]
    assert "Traceback" not in text
