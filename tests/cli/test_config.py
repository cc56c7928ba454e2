"""The run configuration of train / simulate / join, built from a config file and flags without typer."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2ptrain.cli.config import Stages, join_config, simulate_config, steps_of, train_config
from p2ptrain.cli.flags import JoinFlags, TrainFlags
from p2ptrain.settings import ConfigError

PEER1 = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWAupgdBAYgxcu6EbnoP2EGJvaFrwAo795BwSsmnG11agR"
PEER2 = "/ip4/127.0.0.1/tcp/2/p2p/QmUcCwXRJwDi6TxHmE181nq7Uidkn2HSwgRRBFiWnzMz9D"
FILE = {"preset": "tiny", "steps": 7, "model": {"n_layers": 1}, "trainer": {"batch_size": 2, "lr": 1e-3}}


@pytest.fixture(autouse=True)
def _no_stage_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a pipeline stage process unless a test says so."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def test_steps_come_from_the_flag_then_the_file_then_300() -> None:
    assert steps_of(5, ("steps", {"steps": 9})) == 5
    assert steps_of(None, ("[peer] steps", {}), ("steps", {"steps": 9})) == 9
    assert steps_of(None, ("[peer] steps", {"steps": 4}), ("steps", {"steps": 9})) == 4
    assert steps_of(None, ("steps", {})) == 300


@pytest.mark.parametrize(("flag", "places", "message"), [
    (0, (), "--steps must be at least 1, got 0"),
    (-3, (), "--steps must be at least 1, got -3"),
    (None, (("[peer] steps", {"steps": 0}),), "[peer] steps must be at least 1, got 0"),
    (None, (("steps", {"steps": "many"}),), "steps must be a whole number, got 'many'"),
])
def test_steps_below_one_or_not_a_number_are_refused_naming_the_key(
        flag: int | None, places: tuple[tuple[str, dict[str, object]], ...], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        steps_of(flag, *places)
    assert str(e.value) == message


def test_train_flags_override_the_file() -> None:
    run = train_config(FILE, {"steps": 3, "lr": 2e-3, "checkpoint_dir": "ck", "resume": True})
    assert run.job.steps == 3 and run.job.trainer.total_steps == 3
    assert run.job.trainer.lr == 2e-3 and run.job.trainer.batch_size == 2  # the flag, and the file where none
    assert run.job.model.n_layers == 1 and run.preset == "tiny" and run.init is None
    assert run.job.checkpoint_dir == "ck" and run.job.resume
    assert train_config(FILE, TrainFlags()).job.steps == 7  # the dataclass, or a dict of its keys


@pytest.mark.parametrize(("file", "flags", "message"), [
    (FILE, {"steps": 0}, "--steps must be at least 1"),
    ({"steps": 0}, {}, "steps must be at least 1"),
    ({"trainer": {"learning_rate": 1}}, {}, "[trainer]: unknown key(s) learning_rate"),
    ({"model": {"width": 3}}, {}, "[model]:"),
    ({"data": {"colour": "red"}}, {}, "[data]: unknown key(s) colour"),
    ({"epochs": 2}, {}, "[job]: unknown key(s) epochs"),
    ({}, {"preset_name": "huge"}, "unknown preset 'huge'"),
    ({}, {"resume": True}, "--resume needs --checkpoint-dir"),
    ({}, {"lr": -1.0}, "lr must be positive"),
    ({}, {"learning_rate": 1.0}, "learning_rate"),  # not a flag of train
])
def test_train_bad_values_name_their_key(file: dict[str, object], flags: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as e:
        train_config(file, flags)
    assert message in str(e.value)


def test_simulate_flags_override_the_simulate_section() -> None:
    file = {"simulate": {"peers": 3, "steps": 40, "step_time": "measured", "bandwidth": "100mbit"},
            "method": {"H": 10}}
    run = simulate_config(file, {"methods": "single,diloco", "steps": 20, "rtt": "120ms", "H": 5})
    assert run.sim.peers == 3 and run.sim.steps == 20 and run.trainer.total_steps == 20
    assert run.sim.step_time is None and run.sim.bandwidth == "100mbit" and run.sim.rtt == pytest.approx(0.12)
    assert [s.label for s in run.specs] == ["single", "diloco"] and run.specs[1].method.H == 5
    assert simulate_config(file, {"methods": "diloco"}).specs[0].method.H == 10
    # -m/--method, as in join (several, comma-separated); --methods is its old spelling, kept hidden
    assert [s.label for s in simulate_config(file, {"method": "eager", "methods": "diloco"}).specs] == ["eager"]
    assert [s.label for s in simulate_config({}, {}).specs] == ["single", "diloco", "streaming", "cocodc"]
    with pytest.raises(ConfigError, match="--steps must be at least 1"):
        simulate_config({}, {"steps": 0})
    with pytest.raises(ValueError, match="unknown method 'sgd'"):
        simulate_config({}, {"methods": "sgd"})


def test_join_flags_override_the_file() -> None:
    file = {**FILE, "method": {"name": "streaming", "H": 8}, "peer": {"run_id": "demo", "steps": 11,
                                                                      "initial_peers": [PEER1]}}
    run = join_config(file, {})
    assert run.method.name == "streaming" and run.method.H == 8
    assert run.peer.run_id == "demo" == run.swarm.run_id and run.peer.steps == 11 == run.trainer.total_steps
    assert run.swarm.initial_peers == [PEER1] and run.swarm.host_maddrs == ["/ip4/127.0.0.1/tcp/0"]
    assert run.stages is None and run.init is None and run.preset == "tiny" and run.metrics_port is None
    run = join_config(file, JoinFlags(method="diloco", H=4, run_id="other", steps=2, region="eu",
                                      initial_peers=[PEER2], checkpoint_dir=Path("ck")))
    assert run.method.name == "diloco" and run.method.H == 4
    assert run.peer.run_id == "other" == run.swarm.run_id and run.peer.steps == 2 and run.peer.region == "eu"
    # how long a leave by signal may send its unsent progress: 120 s unless the recipe says otherwise
    assert run.peer.leave_flush == 120.0
    assert join_config({**file, "peer": {**file["peer"], "leave_flush": 0}}, {}).peer.leave_flush == 0
    with pytest.raises(ValueError, match="leave_flush must be at least 0"):
        join_config({**file, "peer": {**file["peer"], "leave_flush": -1}}, {})
    assert run.swarm.initial_peers == [PEER2] and run.peer.checkpoint_dir == "ck"
    resumed = join_config({}, {"resume": True, "checkpoint_dir": Path("old")})
    assert resumed.peer.checkpoint_dir == "old" and resumed.resume == Path("old")  # resume keeps writing there
    assert join_config({"peer": {"checkpoint_dir": "rec"}}, {"resume": True}).resume == Path("rec")
    assert join_config({}, {"checkpoint_dir": Path("new")}).resume is None
    # a peer keeps its key in its checkpoint folder (a restart is the same peer), unless --identity says otherwise
    assert resumed.swarm.identity_path == str(Path("old") / "identity.key")
    assert join_config({}, {"checkpoint_dir": Path("new"), "identity": Path("k.key")}).swarm.identity_path == "k.key"
    assert join_config({}, {}).swarm.identity_path is None
    assert join_config({}, {}).method.name == "streaming"


@pytest.mark.parametrize(("flags", "message"), [
    ({"steps": 0}, "--steps must be at least 1, got 0"),  # not a silent 300
    ({"aggregation": "median-of-means"}, "unknown aggregation 'median-of-means'"),
    ({"norm_bound": 0.5}, "norm_bound must be above 1"),
    ({"method": "adam"}, "adam"),
    ({"resume": True}, "--resume needs --checkpoint-dir"),
    ({"swarm_key_file": Path("/nonexistent/p2ptrain.key")}, "swarm key /nonexistent/p2ptrain.key: cannot read it"),
    ({"run_stages": 0}, "--run-stages and --pipeline-stages must be at least 1"),
    ({"pipeline_stages": 2}, "set [model] tie_embeddings = false"),
    ({"run_stages": 2, "untie_embeddings": True, "method": "ddp"}, "outer-loop method"),
    ({"pipeline_stages": 2, "untie_embeddings": True, "batch_size": 3}, "multiple of the micro-batches"),
    ({"run_stages": 2, "untie_embeddings": True, "checkpoint_dir": Path("ck")}, "checkpoints of staged peers"),
    ({"run_stages": 2, "untie_embeddings": True, "init_from": "/nonexistent"}, "--init-from"),
])
def test_join_bad_values_name_their_flag(flags: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as e:
        join_config({}, flags)
    assert message in str(e.value)


def test_join_stages_and_who_launches_them(monkeypatch: pytest.MonkeyPatch) -> None:
    run = join_config({}, {"run_stages": 2, "untie_embeddings": True})
    assert run.stages == Stages(run_stages=2, pipeline_stages=1, microbatches=0, schedule="1f1b", timeout=600.0,
                                launch=False)
    assert run.model.tie_embeddings is False
    piped = join_config({}, {"pipeline_stages": 2, "untie_embeddings": True, "microbatches": 2})
    assert piped.stages is not None and piped.stages.run_stages == 2 and piped.stages.launch  # no stage env: launcher
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    staged = join_config({}, {"pipeline_stages": 2, "untie_embeddings": True, "microbatches": 2}).stages
    assert staged is not None and not staged.launch  # a stage process itself
    plan, pipe = staged.plan(piped.model, piped.trainer, piped.method)
    assert plan.stages == 2 and pipe is not None and pipe.microbatches == 2
