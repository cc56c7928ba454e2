"""The run session's metrics endpoint (the port search and its errors), and the summary it writes."""

from __future__ import annotations

import json
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer

from p2ptrain.cli import session as session_module
from p2ptrain.cli.session import RunSession, report
from p2ptrain.procs import free_port


@pytest.fixture
def session() -> Iterator[RunSession]:
    s = RunSession("diloco", "us")
    yield s
    s.metrics.close()


@pytest.fixture
def taken() -> Iterator[int]:
    """A port on 127.0.0.1 that something else listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def test_off_any_and_a_given_port(session: RunSession) -> None:
    assert session.serve_metrics(-1, "127.0.0.1") is None
    port = session.serve_metrics(0, "127.0.0.1")
    assert port and "p2ptrain_build_info" in _scrape(port)
    session.metrics.close()
    wanted = free_port()
    assert session.serve_metrics(wanted - 1, "127.0.0.1", offset=1) == wanted  # N plus a stage's rank


def test_the_default_takes_the_next_free_port(session: RunSession, taken: int,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session_module, "DEFAULT_METRICS_PORT", taken)
    port = session.serve_metrics(None, "127.0.0.1")
    assert port is not None and taken < port < taken + session_module.METRICS_PORTS


def test_taken_ports_fail_naming_the_flag(session: RunSession, taken: int, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(typer.Exit) as e:
        session.serve_metrics(taken, "127.0.0.1")
    assert e.value.exit_code == 2
    assert f"cannot serve metrics on 127.0.0.1:{taken}" in " ".join(capsys.readouterr().err.split())
    monkeypatch.setattr(session_module, "DEFAULT_METRICS_PORT", taken)
    monkeypatch.setattr(session_module, "METRICS_PORTS", 1)
    with pytest.raises(typer.Exit):
        session.serve_metrics(None, "127.0.0.1")
    text = " ".join(capsys.readouterr().err.split())
    assert f"ports {taken}-{taken} are all taken; pick one with --metrics-port, or -1" in text


def test_report_writes_the_json_only_when_asked(tmp_path: Path) -> None:
    calls: list[int] = []

    def record() -> dict[str, int]:
        calls.append(1)
        return {"steps": 3}

    report("summary", [("steps", 3)], None, record)
    assert not calls
    report("summary", [("steps", 3)], tmp_path / "s.json", record)
    assert json.loads((tmp_path / "s.json").read_text()) == {"steps": 3}


def test_join_hint_names_what_another_machine_needs(tmp_path: Path) -> None:
    from p2ptrain.cli.config import join_config
    from p2ptrain.cli.session import join_hint

    peer = "/p2p/12D3KooWAupgdBAYgxcu6EbnoP2EGJvaFrwAo795BwSsmnG11agR"
    key = tmp_path / "swarm.key"
    key.write_text("0123456789abcdef0123456789abcdef")
    run = join_config({}, {"run_id": "demo", "method": "diloco", "preset_name": "micro", "region": "us",
                           "swarm_key_file": key})
    text = join_hint([f"/ip4/127.0.0.1/tcp/4001{peer}"], run)
    assert f"p2ptrain join --initial-peers /ip4/127.0.0.1/tcp/4001{peer} --run-id demo --method diloco " \
           "--preset micro --region REGION --swarm-key SWARM_KEY_FILE" in text
    assert "loopback" in text and "--host-maddrs /ip4/0.0.0.0/tcp/PORT" in text
    open_run = join_config({}, {"run_id": "demo"})
    text = join_hint([f"/ip4/203.0.113.10/tcp/4001{peer}", f"/ip4/127.0.0.1/tcp/4001{peer}"], open_run)
    assert "loopback" not in text and "--swarm-key" not in text and "--region REGION" in text
