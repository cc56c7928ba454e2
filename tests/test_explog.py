"""``--log-to``: targets parsed before anything starts; TensorBoard event files written and read back (offline)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from p2ptrain.cli import app
from p2ptrain.cli.session import RunSession
from p2ptrain.explog import LogTarget, open_log, parse_targets, peer_scalars
from p2ptrain.metrics import PeerMetrics

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
needs_tensorboard = pytest.mark.skipif(not HAS_TENSORBOARD, reason='the tensorboard package is not installed '
                                                                  '(pip install -e ".[tensorboard]"; [test] has it)')


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files in ``folder``: name -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_targets_are_parsed_and_their_packages_looked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())  # every package "installed"
    assert parse_targets(["tensorboard:runs/tb wandb", "wandb:proj"]) == (
        LogTarget("tensorboard", "runs/tb"), LogTarget("wandb", None), LogTarget("wandb", "proj"))
    assert parse_targets(None) == ()
    with pytest.raises(ValueError, match="unknown target 'mlflow'"):
        parse_targets(["mlflow"])
    with pytest.raises(ValueError, match="give the folder"):
        parse_targets(["tensorboard"])
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)  # nothing installed
    with pytest.raises(ValueError, match=r'--log-to wandb needs the wandb package, an optional extra: pip install -e "\.\[wandb\]"'):
        parse_targets(["wandb"])


def test_a_missing_package_fails_train_before_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    r = CliRunner().invoke(app, ["train", "--steps", "2", "-q", "--log-to", "wandb"])
    assert r.exit_code == 2 and ".[wandb]" in r.output


@needs_tensorboard
def test_train_writes_its_curves_to_tensorboard(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["train", "--steps", "6", "--batch-size", "4", "--eval-every", "3", "-q",
                                 "--log-to", f"tensorboard:{tmp_path / 'tb'}"])
    assert r.exit_code == 0, r.output
    got = _scalars(tmp_path / "tb")
    assert [s for s, _ in got["loss/train"]] == [1, 2, 3, 4, 5, 6]
    assert all(4.0 < v < 6.5 for _, v in got["loss/train"])  # nats per byte token, early in training
    assert [s for s, _ in got["throughput/tokens_per_second"]] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in got["loss/validation"]][-2:] == [3, 6]


class _FakePeer:
    """What a session drives, stepping on its own: three steps, a round per step, an evaluation at step 2."""

    def __init__(self, metrics: PeerMetrics) -> None:
        self.metrics, self.on_status, self.val_log = metrics, None, []

    def start(self) -> None: ...

    def request_stop(self) -> None: ...

    def close(self) -> None: ...

    def run(self) -> str:
        stats = type("Stats", (), {"seconds": [0.5], "bandwidth": 1e6, "in_flight": 1, "bytes_sent": 0,
                                   "bytes_received": 0})()
        seen = (0, 0)
        for step, outcome in ((1, "complete"), (2, "partial"), (3, "complete")):
            self.metrics.step_done(tokens=100, loss=5.0 - step, tokens_seen=100 * step, compute=0.1 * step,
                                   elapsed=0.2 * step)
            stats.bytes_sent, stats.bytes_received = 1000 * step, 900 * step
            seen = self.metrics.round_done("0", outcome, stats, "fp32", seen)
            if step == 2:
                self.val_log.append((0.0, 2, 4.5, 0.0))
            assert self.on_status is not None
            self.on_status({"step": step, "loss": 5.0 - step, "tokens_per_second": 1000.0, "rounds": step,
                            "failed": 0, "in_flight": 1})
        return "done"


@needs_tensorboard
def test_a_peer_s_scalars_per_step_from_its_metrics(tmp_path: Path) -> None:
    session = RunSession("streaming", "eu")
    log = open_log([LogTarget("tensorboard", str(tmp_path))], name="peer", subdir="run/peer")
    peer: Any = _FakePeer(session.metrics)
    result, val = session.run(peer, True, lambda r: 4.25, log)
    assert result == "done" and val == 4.25
    got = _scalars(tmp_path / "run" / "peer")
    assert got["loss/train"] == [(1, 4.0), (2, 3.0), (3, 2.0)]
    assert got["loss/validation"] == [(2, 4.5), (3, 4.25)]  # the evaluation during the run, then θ at the end
    assert got["rounds/complete"] == [(1, 1.0), (2, 1.0), (3, 2.0)] and got["rounds/partial"][-1] == (3, 1.0)
    assert got["rounds/failed"] == [(1, 0.0), (2, 0.0), (3, 0.0)]
    assert got["network/sent_bytes"][-1] == (3, 3000.0) and got["network/received_bytes"][-1] == (3, 2700.0)
    assert got["throughput/tokens_per_second"][-1][1] == pytest.approx(1000.0)
    assert got["throughput/compute_utilization"][-1][1] == pytest.approx(0.5)


def test_peer_scalars_before_any_round() -> None:
    values = peer_scalars(PeerMetrics(method="streaming", region="").registry)
    assert values["rounds/complete"] == values["rounds/partial"] == values["rounds/failed"] == 0.0
    assert values["loss/train"] == 0.0 and values["network/sent_bytes"] == 0.0


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None,
                    reason='the wandb package is not installed (pip install -e ".[wandb]")')
def test_wandb_offline_needs_no_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = open_log([LogTarget("wandb", "p2ptrain-test")], name="offline", config={"steps": 2})
    log.log(1, {"loss/train": 5.0})
    log.log(2, {"loss/train": 4.0})
    log.log(1, {"loss/validation": 4.5})  # late: goes to the current step, not dropped
    log.close()
    assert list(tmp_path.rglob("*.wandb")), "no offline run file written"
