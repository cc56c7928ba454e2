"""``p2ptrain join`` for staged runs: ``--run-stages S_run`` and ``--pipeline-stages S``.

Three shapes, one code path (:class:`~p2ptrain.staged.StagedPeer`):

* ``--run-stages S_run`` alone: one process holds the whole model and is a member of
  every stage namespace of the run;
* ``--pipeline-stages S`` without a process-group environment: this process is the
  *launcher*. It starts S stage processes (the same command, with ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` set), forwards
  SIGTERM/SIGINT to them (they leave together after the same step), and stops the
  rest when one exits with an error (SIGTERM, then SIGKILL after a grace period);
* with that environment (set by the launcher, or by ``torchrun --nproc-per-node S``):
  this process is pipeline stage ``RANK`` (GPU ``LOCAL_RANK`` when CUDA is there).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from .algo.methods import MethodConfig
from .data import DataConfig
from .metrics import DEFAULT_METRICS_PORT, PeerMetrics
from .model import ModelConfig
from .peer import PeerConfig
from .procs import free_port
from .trainer import TrainerConfig

if TYPE_CHECKING:
    from .pipeline import PipelineConfig
    from .stages import StagePlan

__all__ = ["launch_stages", "run_staged", "staged_or_none", "staged_plan"]

GRACE_SECONDS = 30.0


def offset_port(maddr: str, k: int) -> str:
    """``maddr`` with its TCP/UDP port moved up by ``k`` (port 0, "any", stays 0): namespace k of one
    machine listens on its own port."""
    def bump(m: re.Match[str]) -> str:
        port = int(m.group(2))
        return f"/{m.group(1)}/{port + k if port else 0}"

    return re.sub(r"/(tcp|udp)/(\d+)", bump, maddr, count=1)


def per_rank(path: Path | None, rank: int, world: int) -> Path | None:
    """A stage process's own output file: ``name.rankR.ext`` (unchanged for one process)."""
    if path is None or world == 1:
        return path
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def staged_plan(model_cfg: ModelConfig, trainer_cfg: TrainerConfig, method_cfg: MethodConfig, *, run_stages: int,
                pipeline_stages: int, microbatches: int, schedule: str,
                pipeline_timeout: float) -> tuple[StagePlan, PipelineConfig | None]:
    """The run's stage partition and this peer's pipeline config (None for one process), checked before
    any stage process, process group or transport starts. Raises ValueError naming the flag at fault."""
    from .pipeline import PipelineConfig
    from .staged import require_outer_method
    from .stages import StagePlan

    require_outer_method(method_cfg)
    plan = StagePlan.of(model_cfg, run_stages)
    plan.held_by(0, pipeline_stages)  # S must divide S_run
    if pipeline_stages == 1:
        return plan, None
    pipe = PipelineConfig(stages=pipeline_stages, microbatches=microbatches, schedule=schedule,  # type: ignore[arg-type]
                          timeout=pipeline_timeout)
    if trainer_cfg.batch_size % pipe.microbatches:
        raise ValueError(f"pipeline: the batch size ({trainer_cfg.batch_size}) must be a multiple of the "
                         f"micro-batches M ({pipe.microbatches}); set --batch-size or --micro-batches")
    return plan, pipe


def launch_stages(stages: int, argv: list[str]) -> int:
    """Run ``p2ptrain <argv>`` as ``stages`` pipeline processes on this machine; their worst exit code."""
    from .ui import console

    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    for r in range(stages):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(stages), "LOCAL_RANK": str(r),
               "LOCAL_WORLD_SIZE": str(stages), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-m", "p2ptrain", *argv], env=env))
    console.print(f"pipeline peer: {stages} stage processes {[p.pid for p in procs]}", highlight=False)

    def forward(signum: int, _frame: Any) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        failed_at: float | None = None
        while any(p.poll() is None for p in procs):
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                bad = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
                console.print(f"[red]stage {bad} exited with an error: stopping the others[/]", highlight=False)
                forward(signal.SIGTERM, None)
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > GRACE_SECONDS:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.2)
    finally:
        for p in procs:  # never leave a stage behind (the launcher itself was killed or failed)
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for s, h in old.items():
            signal.signal(s, h)
    return max((p.returncode or 0) for p in procs) if all(p.returncode is not None and p.returncode >= 0
                                                          for p in procs) else 1


def run_staged(*, model_cfg: ModelConfig, trainer_cfg: TrainerConfig, data_cfg: DataConfig,
               method_cfg: MethodConfig, peer_cfg: PeerConfig, swarm_cfg: Any, run_stages: int,
               pipeline_stages: int, microbatches: int, schedule: str, pipeline_timeout: float,
               json_out: Path | None, maddrs_file: Path | None, metrics_port: int | None, metrics_host: str,
               quiet: bool, preset_name: str) -> None:
    """Join as a staged peer (the whole model in every namespace, or one pipeline stage)."""
    import torch

    from . import __version__
    from .cli import fail
    from .net.swarm import HivemindTransport, SwarmError
    from .pipeline import init_stage_group, make_stage_trainer, stage_device, stage_env
    from .staged import StagedPeer, data_rank
    from .trainer import make_trainer
    from .ui import console, out, status_printer, table

    env = stage_env() if pipeline_stages > 1 else None
    if pipeline_stages > 1 and env is None:
        raise RuntimeError("run_staged: a pipeline stage needs RANK/WORLD_SIZE (use launch_stages)")
    if env is not None and env.world != pipeline_stages:
        raise fail(f"--pipeline-stages {pipeline_stages} but WORLD_SIZE={env.world} in the environment")
    rank, world = (env.rank, env.world) if env is not None else (0, 1)
    try:
        plan, pipe = staged_plan(model_cfg, trainer_cfg, method_cfg, run_stages=run_stages,
                                 pipeline_stages=pipeline_stages, microbatches=microbatches, schedule=schedule,
                                 pipeline_timeout=pipeline_timeout)
        held = plan.held_by(rank, world)
    except ValueError as e:
        raise fail(str(e)) from None
    if env is not None and pipe is not None:
        device = stage_device(trainer_cfg.device, env.local_rank)
        init_stage_group(env, device, pipe.timeout)
        trainer: Any = make_stage_trainer(model_cfg, trainer_cfg, data_cfg, pipe, plan, env, device)
    else:
        trainer = make_trainer(model_cfg, trainer_cfg, data_cfg)

    def transport(g: int, ns: str, more: list[str]) -> Any:
        cfg = replace(swarm_cfg, run_id=ns, initial_peers=[*swarm_cfg.initial_peers, *more], host_maddrs=[offset_port(m, g) for m in swarm_cfg.host_maddrs],
                      announce_maddrs=[offset_port(m, g) for m in swarm_cfg.announce_maddrs],
                      identity_path=f"{swarm_cfg.identity_path}.stage{g}" if swarm_cfg.identity_path else None)
        return lambda: HivemindTransport.create(cfg)

    metrics = PeerMetrics(method=method_cfg.name, region=peer_cfg.region)
    port: int | None = None
    base = DEFAULT_METRICS_PORT if metrics_port is None else metrics_port
    if base > 0:
        for candidate in range(base + rank, base + rank + 16):
            try:
                port = metrics.serve(candidate, metrics_host)
                break
            except OSError:
                continue
    elif base == 0:
        port = metrics.serve(0, metrics_host)
    try:
        staged = StagedPeer(peer_cfg, method_cfg, trainer, plan, held, transport, metrics=metrics,
                            seed=trainer_cfg.seed)
    except ValueError as e:
        raise fail(str(e)) from None
    what = f"pipeline stage {rank} of {world}" if world > 1 else "whole model"
    console.print(f"p2ptrain {__version__} · {what} · stage groups {list(held.groups)} of {plan.stages} · "
                  f"run {peer_cfg.run_id} · {method_cfg.name}" + (f" · metrics :{port}" if port else ""),
                  highlight=False)

    def on_signal(signum: int, _frame: Any) -> None:
        console.print(f"signal {signal.Signals(signum).name}: leaving after this step", highlight=False)
        staged.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        staged.start()
    except SwarmError as e:
        staged.close()
        raise fail(str(e), 1) from None
    trainer.stream.reseed(data_cfg.seed, data_rank(staged.identity))
    maddrs = [a for p in staged.peers for a in p.net.call(p.transport.visible_maddrs(), 10)]  # type: ignore[union-attr]
    if (mf := per_rank(maddrs_file, rank, world)) is not None:
        mf.write_text("\n".join(maddrs) + "\n")
    console.print(f"step pacing {staged.step_seconds}s · namespaces "
                  f"{[p.cfg.run_id for p in staged.peers]}; another machine joins with:\n  p2ptrain join "
                  + " ".join(f"--initial-peers {a}" for a in maddrs[:1])
                  + f" --run-id {peer_cfg.run_id} --run-stages {plan.stages} --method {method_cfg.name} "
                    f"--preset {preset_name} [--pipeline-stages S]", highlight=False, soft_wrap=True)
    staged.on_status = status_printer(quiet)
    try:
        summaries = staged.run()
        theta: dict[str, torch.Tensor] = {}
        for s in summaries:
            theta.update(s.outer_params)
        val = trainer.evaluate(theta or None).loss
        metrics.val_loss.set(val)
    finally:
        metrics.close()
        if env is not None and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    rows = [(f"stage {p.cfg.run_id}", f"{s.peer_id[-12:]}: rounds {s.rounds_complete}/{s.rounds_partial}/"
                                       f"{s.rounds_failed} applied {s.rounds_applied}")
            for p, s in zip(staged.peers, summaries, strict=True)]
    rows += [("inner steps", summaries[0].steps), ("val loss of θ", f"{val:.4f}"),
             ("compute utilization", f"{summaries[0].utilization:.3f}")]
    out.print(table(f"p2ptrain join ({what}): summary", ["", "value"], rows))
    if (jf := per_rank(json_out, rank, world)) is not None:
        jf.write_text(json.dumps({
            "steps": summaries[0].steps, "val_loss": val, "method": method_cfg.name, "pipeline_rank": rank,
            "pipeline_stages": world, "run_stages": plan.stages, "loop_seconds": staged.loop_seconds,
            "final_train_loss": summaries[0].final_train_loss, "step_seconds": staged.step_seconds,
            "stages": [{"stage": g, "namespace": p.cfg.run_id, "peer_id": s.peer_id,
                        "rounds_complete": s.rounds_complete, "rounds_partial": s.rounds_partial,
                        "rounds_failed": s.rounds_failed, "rounds_applied": s.rounds_applied,
                        "stuck_rounds": s.stuck_rounds, "bytes_sent": s.bytes_sent,
                        "applied": {k: v[0] for k, v in s.applied.items()},
                        "contributors": {key: len(c) for key, c, _ in p.history},
                        "theta": {n: float(t.double().sum()) for n, t in s.outer_params.items()}}
                       for g, p, s in zip(held.groups, staged.peers, summaries, strict=True)],
        }, indent=2))


def staged_or_none(run_stages: int | None, pipeline_stages: int) -> tuple[int, bool] | None:
    """(S_run, launch?) when ``join`` must take the staged path, else None."""
    s_run = run_stages if run_stages is not None else pipeline_stages
    if s_run < 1 or pipeline_stages < 1:
        raise typer.BadParameter("--run-stages and --pipeline-stages must be at least 1")
    if s_run == 1 and pipeline_stages == 1:
        return None
    from .pipeline import stage_env

    return s_run, pipeline_stages > 1 and stage_env() is None
