"""Every option has a ``P2PTRAIN_*`` twin, shown in ``--help``; values layer as flag > variable > recipe > default."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

import p2ptrain.cli.join as join_module
from p2ptrain.cli import app
from p2ptrain.cli.netargs import split_list
from p2ptrain.cli.options import env_var

A = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWAupgdBAYgxcu6EbnoP2EGJvaFrwAo795BwSsmnG11agR"
B = "/ip4/127.0.0.1/tcp/31338/p2p/QmUcCwXRJwDi6TxHmE181nq7Uidkn2HSwgRRBFiWnzMz9D"


def test_every_option_of_every_command_reads_its_variable_and_help_says_so() -> None:
    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    for name, command in commands.items():
        for param in command.params:
            if param.param_type_name != "option" or param.name == "help":
                continue
            long = next(o for o in param.opts if o.startswith("--"))
            assert param.envvar == env_var(long), f"{name} {long}"
            assert param.show_envvar, f"{name} {long}"
    r = CliRunner().invoke(app, ["join", "--help"], terminal_width=200)
    assert "P2PTRAIN_INITIAL_PEERS" in r.output and "P2PTRAIN_RUN_ID" in r.output


def test_env_var_names() -> None:
    assert env_var("--initial-peers") == "P2PTRAIN_INITIAL_PEERS"
    assert env_var("--H") == "P2PTRAIN_H"


def test_list_values_split_on_spaces_and_commas() -> None:
    assert split_list([f"{A},{B}"]) == [A, B]
    assert split_list([f" {A}  {B} ", ""]) == [A, B]
    assert split_list(None) == []


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The runs ``join`` would start (nothing starts), and no P2PTRAIN_* variable from outside the test."""
    import os

    for name in [n for n in os.environ if n.startswith("P2PTRAIN_")]:
        monkeypatch.delenv(name)
    runs: list[Any] = []
    monkeypatch.setattr(join_module, "run_peer", lambda run, held=None: runs.append(run))
    return runs


@pytest.mark.parametrize(("flag", "env", "recipe", "expected"), [
    (["--steps", "3"], {"P2PTRAIN_STEPS": "5"}, "steps = 7\n", 3),  # the flag
    ([], {"P2PTRAIN_STEPS": "5"}, "steps = 7\n", 5),  # then the variable
    ([], {}, "steps = 7\n", 7),  # then the recipe
    ([], {}, "", 300),  # then the default
])
def test_layers_flag_then_env_then_recipe_then_default(tmp_path: Path, captured: list[Any], flag: list[str],
                                                        env: dict[str, str], recipe: str, expected: int) -> None:
    (tmp_path / "r.toml").write_text(recipe)
    r = CliRunner().invoke(app, ["join", *flag], env={"P2PTRAIN_CONFIG": str(tmp_path / "r.toml"), **env})
    assert r.exit_code == 0, r.output
    assert captured[0].peer.steps == expected


def test_a_join_configured_by_variables_only(captured: list[Any]) -> None:
    env = {"P2PTRAIN_INITIAL_PEERS": f"{A},{B}", "P2PTRAIN_RUN_ID": "envrun", "P2PTRAIN_REGION": "eu",
           "P2PTRAIN_METHOD": "diloco", "P2PTRAIN_PRESET": "micro", "P2PTRAIN_QUIET": "1",
           "P2PTRAIN_HOST_MADDRS": "/ip4/0.0.0.0/tcp/31400 /ip6/::/tcp/31400", "P2PTRAIN_METRICS_PORT": "-1"}
    r = CliRunner().invoke(app, ["join"], env=env)
    assert r.exit_code == 0, r.output
    run = captured[0]
    assert run.swarm.initial_peers == [A, B] and run.swarm.run_id == "envrun" and run.peer.region == "eu"
    assert run.method.name == "diloco" and run.preset == "micro" and run.quiet and run.metrics_port == -1
    assert run.swarm.host_maddrs == ["/ip4/0.0.0.0/tcp/31400", "/ip6/::/tcp/31400"]


def test_a_bad_variable_is_named(captured: list[Any]) -> None:
    r = CliRunner().invoke(app, ["join"], env={"P2PTRAIN_STEPS": "many"})
    assert r.exit_code == 2 and "P2PTRAIN_STEPS" in r.output
