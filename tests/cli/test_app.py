"""The command line's shape: its commands, their options, its entry points and its import direction."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import typer

import p2ptrain
from p2ptrain.cli import app
from p2ptrain.cli.app import old_spellings
from p2ptrain.cli.config import steps_of
from p2ptrain.cli.flags import JoinFlags, SimulateFlags, TrainFlags

PACKAGE = Path(p2ptrain.__file__).parent


def test_each_flags_dataclass_is_exactly_its_command_s_options() -> None:
    commands = {c.name: c for c in typer.main.get_command(app).commands.values()}  # type: ignore[attr-defined]
    for name, flags in (("train", TrainFlags), ("simulate", SimulateFlags), ("join", JoinFlags)):
        params = [p.name for p in commands[name].params]
        assert params == [f.name for f in dataclasses.fields(flags)] + ["config", "log_level"], name
    assert list(commands) == ["train", "simulate", "export", "join", "bootstrap", "status", "keygen"]


def _imports(path: Path) -> set[str]:
    """The modules of p2ptrain that the file at ``path`` imports, as dotted names."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module.removesuffix(".__init__") if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("p2ptrain")}
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            anchor = ".".join(parts[:len(parts) - node.level + 1]) if node.level else ""
            target = ".".join(x for x in (anchor, node.module) if x)
            if target.startswith("p2ptrain"):
                found |= {target} | {f"{target}.{a.name}" for a in node.names}
    return found


def test_only_the_cli_imports_the_cli_and_its_modules_import_downward() -> None:
    outside = [p for p in PACKAGE.rglob("*.py") if PACKAGE / "cli" not in p.parents and p.name != "__main__.py"]
    assert not [p for p in outside if any(m.startswith("p2ptrain.cli") for m in _imports(p))]
    graph = {p.stem: {m.split(".")[2] for m in _imports(p) if m.startswith("p2ptrain.cli.")}
             for p in (PACKAGE / "cli").glob("*.py") if p.stem not in ("__init__", "__main__")}
    for module, deps in graph.items():
        seen, todo = set(), list(deps)
        while todo:
            dep = todo.pop()
            assert dep != module, f"p2ptrain.cli.{module} imports itself back through {sorted(seen)}"
            if dep not in seen and dep in graph:
                seen.add(dep)
                todo += graph[dep]


def test_python_dash_m_runs_the_app() -> None:
    r = subprocess.run([sys.executable, "-m", "p2ptrain", "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("p2ptrain "), r.stderr


HEAVY = ("torch", "hivemind", "matplotlib", "numpy", "p2ptrain.model", "p2ptrain.trainer", "p2ptrain.peer")


def test_help_imports_nothing_heavy() -> None:
    """``--help`` of every command answers without importing torch, hivemind, matplotlib or the run's modules
    (they cost seconds; bench/cli_speed.py times it)."""
    script = ("import contextlib, io, sys\n"
              "from p2ptrain.cli import run\n"
              "for argv in sys.argv[1:]:\n"
              "    sys.argv = ['p2ptrain', *argv.split()]\n"
              "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
              "        run()\n"
              f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))\n")
    argvs = ["--help"] + [f"{c} --help" for c in ("train", "simulate", "export", "join", "bootstrap", "status", "keygen")]
    r = subprocess.run([sys.executable, "-c", script, *argvs], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", f"--help imported {r.stdout.strip()}"


def test_old_spellings_are_rewritten_to_today_s() -> None:
    assert old_spellings(["join", "--resume", "ck", "-q"]) == ["join", "--checkpoint-dir", "ck", "--resume", "-q"]
    assert old_spellings(["join", "--resume=ck"]) == ["join", "--checkpoint-dir", "ck", "--resume"]
    assert old_spellings(["join", "--checkpoint-dir", "ck", "--resume", "-q"]) == [
        "join", "--checkpoint-dir", "ck", "--resume", "-q"]  # today's spelling: as it is
    assert old_spellings(["status", "--json"]) == ["status", "--json", "-"]
    assert old_spellings(["status", "--json", "--run-id", "r"]) == ["status", "--json", "-", "--run-id", "r"]
    assert old_spellings(["status", "--json", "peers.json"]) == ["status", "--json", "peers.json"]
    assert old_spellings(["train", "--resume", "-q"]) == ["train", "--resume", "-q"]
    assert old_spellings([]) == []


def test_defaults_shown_in_help_are_the_configs() -> None:
    """``--help`` shows the defaults of options left None (the recipe may set them): they are the configs'."""
    from p2ptrain.net.swarm import SwarmConfig
    from p2ptrain.peer import PeerConfig
    from p2ptrain.sim.runner import SimConfig
    from p2ptrain.single import TrainJob
    from p2ptrain.trainer import TrainerConfig

    commands = {c.name: c for c in typer.main.get_command(app).commands.values()}  # type: ignore[attr-defined]
    shown = {(name, p.name): p.show_default for name, c in commands.items() for p in c.params}
    trainer = TrainerConfig()
    for command in ("train", "join", "simulate"):
        assert shown[command, "batch_size"] == str(trainer.batch_size)
        assert shown[command, "lr"] == str(trainer.lr)
        assert shown[command, "seed"] == str(trainer.seed)
        assert shown[command, "steps"] == str(steps_of(None)) == str(PeerConfig().steps) == str(SimConfig().steps)
        assert shown[command, "preset_name"] == "tiny"
    assert shown["train", "device"] == shown["join", "device"] == trainer.device
    assert shown["train", "eval_every"] == str(TrainJob.__dataclass_fields__["eval_every"].default)
    peer = PeerConfig()
    assert shown["join", "run_id"] == peer.run_id and shown["join", "join_window"] == str(peer.join_window)
    assert shown["join", "checkpoint_every"] == str(peer.checkpoint_every)
    assert shown["join", "checkpoint_seconds"] == f"{peer.checkpoint_seconds:g}"
    assert shown["join", "eval_every"] == str(peer.eval_every)
    assert shown["join", "host_maddrs"] == SwarmConfig().host_maddrs[0]
    sim = SimConfig()
    assert shown["simulate", "peers"] == str(sim.peers) and shown["simulate", "eval_every"] == str(sim.eval_every)
    assert shown["simulate", "bandwidth"] == sim.bandwidth and shown["simulate", "step_time"] == f"{sim.step_time}s"
