"""The run configuration of ``train``, ``simulate`` and ``join``: config file and flags -> config dataclasses.

Plain functions, no typer: each takes the parsed TOML file (``settings.load_file``) and the command's
flags (its dataclass from ``flags.py``, or a dict of the same keys; what is None is not given) and
returns everything its run needs. Flags override the file. A bad value raises ConfigError, or another
ValueError (DataError, HFError), whose message names the flag or key at fault; nothing is started.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..data import DataConfig
from ..explog import LogTarget, parse_targets
from ..model import PRESETS, ModelConfig, preset
from ..settings import ConfigError, build, merged
from ..single import TrainJob
from ..trainer import TrainerConfig
from .flags import SIM_METHODS, JoinFlags, SimulateFlags, TrainFlags
from .netargs import check_identity, host_maddrs, initial_peers
from .paths import input_path, output_dir, output_file

if TYPE_CHECKING:
    from ..algo.methods import MethodConfig
    from ..hf import HFCheckpoint
    from ..net.swarm import SwarmConfig
    from ..peer import PeerConfig
    from ..pipeline import PipelineConfig
    from ..sim.runner import RunSpec, SimConfig
    from ..stages import StagePlan

#: The peer's key in its checkpoint folder when ``--identity`` is not given: a peer restarted with ``--resume`` is the
#: same peer (the same id), not a new one beside the ghost of the old, which the others count live until its
#: announcement expires (bench/churn.py: 1 to 3 such ghosts in a swarm of 16 raised every round's quorum).
IDENTITY_FILE = "identity.key"

__all__ = ["IDENTITY_FILE", "JoinRun", "SimulateRun", "Stages", "TrainRun", "join_config", "log_targets", "model_and_trainer", "open_init_from",
           "simulate_config", "steps_of", "train_config"]

F = TypeVar("F")


@dataclass(frozen=True)
class TrainRun:
    """A ``train`` run: the job, the checkpoint it starts from (None: the preset, named ``preset``)."""

    job: TrainJob
    init: HFCheckpoint | None
    preset: str | None
    json_out: Path | None
    quiet: bool
    log_to: tuple[LogTarget, ...] = ()


@dataclass(frozen=True)
class SimulateRun:
    """A ``simulate`` run: the model, trainer and data of every virtual peer, the swarm, the methods."""

    model: ModelConfig
    trainer: TrainerConfig
    data: DataConfig
    sim: SimConfig
    specs: list[RunSpec]
    json_out: Path | None
    plot_dir: Path | None
    quiet: bool


@dataclass(frozen=True)
class Stages:
    """A staged peer: S_run stage groups of the run (``run_stages``), S pipeline processes of this peer
    (``pipeline_stages``), and whether this process is the launcher of those S processes (``launch``)."""

    run_stages: int
    pipeline_stages: int
    microbatches: int
    schedule: str
    timeout: float
    launch: bool

    def plan(self, model: ModelConfig, trainer: TrainerConfig,
             method: MethodConfig) -> tuple[StagePlan, PipelineConfig | None]:
        """The run's stage partition and this peer's pipeline config (None for one process), checked before
        any stage process, process group or transport starts. Raises ValueError naming the flag at fault."""
        from ..pipeline import PipelineConfig
        from ..staged import require_outer_method
        from ..stages import StagePlan

        require_outer_method(method)
        plan = StagePlan.of(model, self.run_stages)
        plan.held_by(0, self.pipeline_stages)  # S must divide S_run
        if self.pipeline_stages == 1:
            return plan, None
        pipe = PipelineConfig(stages=self.pipeline_stages, microbatches=self.microbatches,
                              schedule=self.schedule, timeout=self.timeout)  # type: ignore[arg-type]
        if trainer.batch_size % pipe.microbatches:
            raise ValueError(f"pipeline: the batch size ({trainer.batch_size}) must be a multiple of the "
                             f"micro-batches M ({pipe.microbatches}); set --batch-size or --micro-batches")
        return plan, pipe


@dataclass(frozen=True)
class JoinRun:
    """A ``join`` run: every config of the peer, its stages (None: a plain peer), the checkpoint it starts
    from (``init``; None: the preset, named ``preset``), the folder it resumes from, and its outputs."""

    model: ModelConfig
    trainer: TrainerConfig
    data: DataConfig
    method: MethodConfig
    peer: PeerConfig
    swarm: SwarmConfig
    stages: Stages | None
    init: HFCheckpoint | None
    preset: str | None
    resume: Path | None
    json_out: Path | None
    maddrs_file: Path | None
    metrics_port: int | None
    metrics_host: str
    quiet: bool
    log_to: tuple[LogTarget, ...] = ()


def _flags(cls: type[F], flags: F | Mapping[str, Any]) -> F:
    """``flags`` as a ``cls``; ConfigError naming a key that is not one of its flags."""
    if isinstance(flags, cls):
        return flags
    try:
        return cls(**flags)  # type: ignore[arg-type]
    except TypeError as e:
        raise ConfigError(f"flags: {e}") from None


def steps_of(flag: int | None, *places: tuple[str, dict[str, Any]]) -> int:
    """The run's total inner steps: ``--steps``, else ``steps`` of the first of ``places`` (its name for
    messages, the file's section) that has it, else 300. ConfigError naming the flag or key when it is
    not a whole number of at least 1."""
    name, value = "--steps", flag
    if flag is None:
        name, value = next(((key, section["steps"]) for key, section in places if "steps" in section), ("steps", 300))
    try:
        steps = int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a whole number, got {value!r}") from None
    if steps < 1:
        raise ConfigError(f"{name} must be at least 1, got {steps}")
    return steps


def model_and_trainer(file: dict[str, Any], preset_name: str | None, model_flags: dict[str, Any],
                      trainer_flags: dict[str, Any]) -> tuple[str, ModelConfig, TrainerConfig]:
    """The preset's name, its model config with ``[model]`` and ``model_flags`` on top, and the trainer
    config from ``[trainer]`` and ``trainer_flags``. ConfigError for an unknown preset or key."""
    name = preset_name or file.get("preset") or "tiny"
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    try:
        model_cfg = preset(name, **merged(file.get("model"), model_flags))
    except TypeError as e:
        raise ConfigError(f"[model]: {e}") from None
    except ValueError as e:
        raise ConfigError(str(e)) from None
    trainer_cfg = build(TrainerConfig, merged(file.get("trainer"), trainer_flags), "trainer")
    _check_device(trainer_cfg.device)
    return name, model_cfg, trainer_cfg


def _check_device(name: str) -> None:
    """ConfigError unless ``name`` is a device this machine has (``auto`` always is)."""
    from ..trainer import pick_device

    try:
        pick_device(name)
    except RuntimeError:  # torch's own: not a device string at all
        raise ConfigError(f"--device {name!r} is not a device: auto, cpu, cuda or cuda:N") from None
    except ValueError as e:
        raise ConfigError(f"--device: {e}") from None


def log_targets(specs: list[str] | None) -> tuple[LogTarget, ...]:
    """``--log-to``: parsed, its packages looked for and its folders writable (ValueError naming the value)."""
    targets = parse_targets(specs)
    for t in targets:
        if t.kind == "tensorboard":
            output_dir(f"--log-to tensorboard:{t.where}", t.where)
    return targets


def _check_data(data: DataConfig, flag_path: str | None, flag_tokenizer: str | None) -> None:
    """ConfigError naming the flag (or the recipe's key) when the data or tokenizer path does not exist."""
    input_path("--data" if flag_path else "[data] path", data.path)
    input_path("--tokenizer" if flag_tokenizer else "[data] tokenizer", data.tokenizer)


def open_init_from(file: dict[str, Any], preset_name: str | None, init_from: str | None,
                   seq_len: int | None) -> HFCheckpoint | None:
    """The checkpoint named by ``--init-from`` (or ``init_from`` in the config file), its context capped
    by ``--seq-len`` (or ``[model] seq_len``); None without one. The checkpoint sets the architecture, so
    a preset or other ``[model]`` keys alongside it are a ConfigError; an unusable folder an HFError."""
    path = init_from or file.get("init_from")
    if not path:
        return None
    if preset_name or file.get("preset"):
        raise ConfigError("--init-from sets the architecture from the checkpoint's config.json: drop --preset")
    model = dict(file.get("model") or {})
    cap = seq_len or model.pop("seq_len", None)
    if model:
        raise ConfigError(f"[model]: {', '.join(sorted(model))} cannot be set with --init-from (only seq_len)")
    from ..hf import open_hf

    return open_hf(str(path), seq_len=cap)


def _without_model(file: dict[str, Any], init: HFCheckpoint | None) -> dict[str, Any]:
    """The file as the preset sees it: with a checkpoint, its ``[model]`` keys went to the checkpoint."""
    return {k: v for k, v in file.items() if k != "model"} if init else file


def train_config(file: dict[str, Any], flags: TrainFlags | Mapping[str, Any]) -> TrainRun:
    """The ``train`` run from the file's top-level keys (the job) and sections, and the flags."""
    f = _flags(TrainFlags, flags)
    job_vals = merged({k: v for k, v in file.items() if not isinstance(v, dict) and k not in ("preset", "init_from")},
                      {"checkpoint_dir": f.checkpoint_dir, "eval_every": f.eval_every})
    total = steps_of(f.steps, ("steps", file))
    init = open_init_from(file, f.preset_name, f.init_from, f.seq_len)
    name, model_cfg, trainer_cfg = model_and_trainer(
        _without_model(file, init), None if init else f.preset_name, {"seq_len": f.seq_len},
        {"batch_size": f.batch_size, "lr": f.lr, "seed": f.seed, "device": f.device,
         "total_steps": file.get("trainer", {}).get("total_steps", total)})
    data_cfg = build(DataConfig, merged(file.get("data"), {"path": f.data, "seed": f.seed, "tokenizer": f.tokenizer}),
                     "data")
    _check_data(data_cfg, f.data, f.tokenizer)
    output_file("--json", f.json_out)
    if init is not None:
        from ..hf_run import data_for

        data_cfg, model_cfg = data_for(init, data_cfg), init.model_config
    job = build(TrainJob, {**job_vals, "steps": total, "model": model_cfg, "trainer": trainer_cfg, "data": data_cfg,
                           "resume": f.resume}, "job")
    output_dir("--checkpoint-dir", job.checkpoint_dir)
    return TrainRun(job=job, init=init, preset=None if init else name, json_out=f.json_out, quiet=f.quiet,
                    log_to=log_targets(f.log_to))


def simulate_config(file: dict[str, Any], flags: SimulateFlags | Mapping[str, Any]) -> SimulateRun:
    """The ``simulate`` run from ``[simulate]``, ``[method]``, ``[methods.NAME]`` and the model sections."""
    from ..sim.network import parse_duration
    from ..sim.runner import SimConfig
    from ..sim.suite import build_specs

    f = _flags(SimulateFlags, flags)
    sim_file = file.get("simulate", {})
    total = steps_of(f.steps, ("[simulate] steps", sim_file))
    _, model_cfg, trainer_cfg = model_and_trainer(
        file, f.preset_name, {},
        {"batch_size": f.batch_size, "lr": f.lr, "seed": f.seed,
         "total_steps": file.get("trainer", {}).get("total_steps", total)})
    data_cfg = build(DataConfig, merged(file.get("data"), {"path": f.data, "seed": f.seed}), "data")
    _check_data(data_cfg, f.data, None)
    output_file("--json", f.json_out)
    output_dir("--plot-dir", f.plot_dir)
    if f.plot_dir is not None:
        from ..plot import PLOT_EXTRA, available

        if not available():
            raise ConfigError(f"--plot-dir needs matplotlib, an optional extra: {PLOT_EXTRA}")
    step_time = str(f.step_time if f.step_time is not None else sim_file.get("step_time", 0.1))
    sim_cfg = build(SimConfig, merged({k: v for k, v in sim_file.items() if k != "step_time"}, {
        "peers": f.peers, "steps": total, "regions": f.regions, "bandwidth": f.bandwidth,
        "rtt": parse_duration(f.rtt) if f.rtt else None, "eval_every": f.eval_every, "target_loss": f.target_loss}),
        "simulate")
    sim_cfg.step_time = None if step_time == "measured" else parse_duration(step_time)
    knobs = merged(file.get("method"), {"H": f.H, "P": f.P, "tau": f.tau, "codec": f.codec, "outer_lr": f.outer_lr})
    per_method = {k: v for k, v in file.get("methods", {}).items() if isinstance(v, dict)}
    names = f.method or f.methods or SIM_METHODS  # --methods: the old spelling
    specs = build_specs([m.strip() for m in names.split(",") if m.strip()], knobs, per_method)
    return SimulateRun(model=model_cfg, trainer=trainer_cfg, data=data_cfg, sim=sim_cfg, specs=specs,
                       json_out=f.json_out, plot_dir=f.plot_dir, quiet=f.quiet)


def _method_knobs(file: dict[str, Any], flags: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The method's name (``--method``, ``[method] name``, else streaming: the best WAN method of the long runs,
    bench/results/methods.md) and its knobs, flags on top."""
    section = dict(file.get("method", {}))
    name = flags.pop("name", None) or section.pop("name", None) or "streaming"
    section.pop("name", None)
    return name, merged(section, flags)


def _stages(f: JoinFlags) -> Stages | None:
    """The staged shape of a ``join`` (None: a plain peer). ConfigError when S_run or S is below 1."""
    s_run = f.run_stages if f.run_stages is not None else f.pipeline_stages
    if s_run < 1 or f.pipeline_stages < 1:
        raise ConfigError("--run-stages and --pipeline-stages must be at least 1")
    if s_run == 1 and f.pipeline_stages == 1:
        return None
    from ..pipeline import stage_env

    return Stages(run_stages=s_run, pipeline_stages=f.pipeline_stages, microbatches=f.microbatches,
                  schedule=f.pipeline_schedule, timeout=f.pipeline_timeout,
                  launch=f.pipeline_stages > 1 and stage_env() is None)


def join_config(file: dict[str, Any], flags: JoinFlags | Mapping[str, Any]) -> JoinRun:
    """The ``join`` run from ``[peer]``, ``[method]``, the model sections and the flags. Bad stage flags
    fail here, once, before any stage process starts; so do an address that does not parse, an unreadable
    ``--swarm-key`` or ``--identity``, and ``--init-from`` or checkpoints with a staged peer (neither is
    supported yet)."""
    from ..algo.methods import method_config
    from ..net.auth import SwarmKey
    from ..net.guard import GuardConfig
    from ..net.swarm import SwarmConfig
    from ..peer import PeerConfig

    f = _flags(JoinFlags, flags)
    peer_file = file.get("peer", {})
    total = steps_of(f.steps, ("[peer] steps", peer_file), ("steps", file))
    init = open_init_from(file, f.preset_name, f.init_from, f.seq_len)
    model_flags: dict[str, Any] = {"seq_len": f.seq_len} | ({"tie_embeddings": False} if f.untie_embeddings else {})
    name, model_cfg, trainer_cfg = model_and_trainer(
        _without_model(file, init), None if init else f.preset_name, model_flags,
        {"batch_size": f.batch_size, "lr": f.lr, "seed": f.seed, "device": f.device,
         "compile": True if f.compile_blocks else None, "total_steps": file.get("trainer", {}).get("total_steps", total)})
    data_cfg = build(DataConfig, merged(file.get("data"), {"path": f.data, "tokenizer": f.tokenizer}), "data")
    method, knobs = _method_knobs(file, {"name": f.method, "H": f.H, "P": f.P, "tau": f.tau, "codec": f.codec,
                                         "timeout": f.timeout})
    method_cfg = method_config(method, **knobs)
    run_id = f.run_id or peer_file.get("run_id") or "p2ptrain"
    checkpoints = f.checkpoint_dir or peer_file.get("checkpoint_dir")
    if f.resume and not checkpoints:
        raise ConfigError("--resume needs --checkpoint-dir (the folder to continue from and keep writing to)")
    peer_cfg = build(PeerConfig, merged({k: v for k, v in peer_file.items() if k != "initial_peers"}, {
        "run_id": run_id, "region": f.region, "flat_rounds": f.flat_rounds or None, "max_group": f.max_group,
        "clock": f.clock, "steps": total,
        "step_seconds": f.step_seconds,
        "join_window": f.join_window, "min_step_seconds": f.min_step_seconds, "eval_every": f.eval_every,
        "checkpoint_dir": str(checkpoints) if checkpoints else None, "checkpoint_every": f.checkpoint_every,
        "checkpoint_seconds": f.checkpoint_seconds}), "peer")
    swarm_cfg = SwarmConfig(
        run_id=run_id, initial_peers=initial_peers(f.initial_peers) if f.initial_peers else
        initial_peers(peer_file.get("initial_peers", []), "[peer] initial_peers"),
        host_maddrs=host_maddrs(f.host_maddrs) or ["/ip4/127.0.0.1/tcp/0"],
        announce_maddrs=host_maddrs(f.announce_maddrs, announce=True),
        identity_path=str(f.identity) if f.identity else str(Path(checkpoints) / IDENTITY_FILE) if checkpoints else None,
        client_mode=f.client_mode,
        use_relay=not f.no_relay, use_auto_relay=f.use_auto_relay, join_window=peer_cfg.join_window, ttl=peer_cfg.ttl,
        direct=not f.no_direct, direct_port=f.direct_port, direct_announce=f.direct_announce,
        **({} if f.direct_congestion is None else
           {"direct_congestion": None if f.direct_congestion == "system" else f.direct_congestion}),
        quorum_memory=peer_cfg.quorum_memory,
        connect_attempts=f.connect_attempts, guard=GuardConfig(aggregation=f.aggregation, norm_bound=f.norm_bound),
        swarm_key=SwarmKey.load(f.swarm_key_file) if f.swarm_key_file else None)
    check_identity(f.identity)
    _check_data(data_cfg, f.data, f.tokenizer)
    output_file("--json", f.json_out)
    output_file("--maddrs-file", f.maddrs_file)
    stages = _stages(f)
    if stages is not None:
        if init is not None:
            raise ValueError("--init-from is not supported for staged peers (S_run > 1 or --pipeline-stages > 1) "
                             "yet: every stage would have to load its own slice of the checkpoint")
        stages.plan(model_cfg, trainer_cfg, method_cfg)
        if checkpoints:
            raise ConfigError("checkpoints of staged peers (S_run > 1 or --pipeline-stages > 1) are not supported "
                              "yet: run without --checkpoint-dir/--resume (a late joiner takes θ from the swarm)")
    output_dir("--checkpoint-dir", peer_cfg.checkpoint_dir)
    if init is not None:  # every peer that loads the same folder starts from the same θ
        from ..hf_run import data_for

        data_cfg, model_cfg = data_for(init, data_cfg), init.model_config
    return JoinRun(model=model_cfg, trainer=trainer_cfg, data=data_cfg, method=method_cfg, peer=peer_cfg,
                   swarm=swarm_cfg, stages=stages, init=init, preset=None if init else name, resume=Path(checkpoints) if f.resume and checkpoints else None,
                   json_out=f.json_out, maddrs_file=f.maddrs_file, metrics_port=f.metrics_port,
                   metrics_host=f.metrics_host, quiet=f.quiet, log_to=log_targets(f.log_to))
