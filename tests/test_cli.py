from __future__ import annotations

import json
import re
from pathlib import Path

from typer.testing import CliRunner

from p2ptrain.checkpoint import CheckpointDir
from p2ptrain.cli import app

runner = CliRunner()
TINY = ["--batch-size", "4", "--eval-every", "0", "-q"]


def test_help_lists_commands() -> None:
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0 and "train" in r.output


def test_train_then_resume(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    r = runner.invoke(app, ["train", "--steps", "4", "--checkpoint-dir", str(ck), *TINY])
    assert r.exit_code == 0, r.output
    assert [s for s, _ in CheckpointDir(ck).paths()] == [4]
    out = tmp_path / "s.json"
    r = runner.invoke(app, ["train", "--steps", "6", "--checkpoint-dir", str(ck), "--resume", "--json", str(out), *TINY])
    assert r.exit_code == 0, r.output
    summary = json.loads(out.read_text())
    assert summary["start_step"] == 4 and summary["steps"] == 2
    assert [s for s, _ in CheckpointDir(ck).paths()] == [4, 6]


def test_training_lowers_validation_loss(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    r = runner.invoke(app, ["train", "--steps", "60", "--batch-size", "8", "--lr", "3e-3", "-q", "--json", str(out)])
    assert r.exit_code == 0, r.output
    s = json.loads(out.read_text())
    assert s["initial_val_loss"] > 5.0 and s["final_val_loss"] < s["initial_val_loss"] - 1.5


def test_config_file_and_flag_override(tmp_path: Path) -> None:
    cfg = tmp_path / "p.toml"
    cfg.write_text('preset = "tiny"\nsteps = 2\n[model]\nn_layers = 1\n[trainer]\nbatch_size = 2\nlr = 1e-3\n')
    out = tmp_path / "s.json"
    r = runner.invoke(app, ["train", "-c", str(cfg), "--steps", "3", "-q", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["steps"] == 3


def _plain(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_bad_input_errors(tmp_path: Path) -> None:
    r = runner.invoke(app, ["train", "--preset", "huge", "-q"])
    assert r.exit_code == 2 and "'huge' is not one of" in _plain(r.output)  # a choice: the names are listed
    r = runner.invoke(app, ["train", "--data", str(tmp_path / "none"), "-q"])
    assert r.exit_code == 2 and "does not exist" in _plain(r.output)
    r = runner.invoke(app, ["train", "--resume", "-q"])
    assert r.exit_code == 2 and "--checkpoint-dir" in _plain(r.output)
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer]\nlearning_rate = 1\n")
    r = runner.invoke(app, ["train", "-c", str(bad), "-q"])
    assert r.exit_code == 2 and "unknown key(s) learning_rate" in _plain(r.output)
    r = runner.invoke(app, ["train", "--lr", "-1", "-q"])
    assert r.exit_code == 2 and "lr must be positive" in _plain(r.output)
