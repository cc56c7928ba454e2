"""``p2ptrain join`` for a staged peer: ``--run-stages S_run`` and/or ``--pipeline-stages S``.

One code path (:class:`~p2ptrain.staged.StagedPeer`) for two shapes: with ``--run-stages S_run`` alone,
one process holds the whole model and is a member of every stage namespace of the run; in a
process-group environment (set by ``launcher.py`` or by ``torchrun --nproc-per-node S``), this process is
pipeline stage ``RANK`` (GPU ``LOCAL_RANK`` when CUDA is there) and a member of its own namespaces only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .. import __version__
from .config import JoinRun, Stages
from .launcher import offset_port, per_rank
from .options import fail, failing
from .session import HeldSignal, RunSession, join_hint, open_experiment_log, report, shutdown_grace, visible_maddrs

if TYPE_CHECKING:
    from ..net.swarm import SwarmConfig
    from ..net.transport import Transport
    from ..peer import PeerSummary
    from ..pipeline import StageEnv
    from ..staged import StagedPeer
    from ..stages import StageRange

__all__ = ["run_staged"]


def _stage_env(stages: Stages) -> StageEnv | None:
    """This process's place in its peer's pipeline (None for one process). Exit code 2 when the
    environment's WORLD_SIZE is not ``--pipeline-stages``."""
    from ..pipeline import stage_env

    if stages.pipeline_stages == 1:
        return None
    env = stage_env()
    if env is None:
        raise RuntimeError("run_staged: a pipeline stage needs RANK/WORLD_SIZE (use launch_stages)")
    if env.world != stages.pipeline_stages:
        raise fail(f"--pipeline-stages {stages.pipeline_stages} but WORLD_SIZE={env.world} in the environment")
    return env


def _transports(swarm: SwarmConfig) -> Callable[[int, str, list[str]], Callable[[], Awaitable[Transport]]]:
    """The transport factory of each stage group: its namespace, ports moved up by the group, its own identity."""
    from ..net.swarm import HivemindTransport

    def transport(g: int, ns: str, more: list[str]) -> Callable[[], Awaitable[Transport]]:
        cfg = replace(swarm, run_id=ns, initial_peers=[*swarm.initial_peers, *more],
                      host_maddrs=[offset_port(m, g) for m in swarm.host_maddrs],
                      announce_maddrs=[offset_port(m, g) for m in swarm.announce_maddrs],
                      identity_path=f"{swarm.identity_path}.stage{g}" if swarm.identity_path else None)
        return lambda: HivemindTransport.create(cfg)

    return transport


def run_staged(run: JoinRun, early: HeldSignal | None = None) -> None:
    """Join as a staged peer (the whole model in every namespace, or one pipeline stage): serve metrics,
    start, train until ``--steps`` or a signal, then print the summary (and write this process's JSON).
    Exit code 1 when the swarm cannot be joined, 2 for bad input."""
    import torch

    from ..pipeline import init_stage_group, make_stage_trainer, stage_device
    from ..staged import StagedPeer, data_rank
    from ..trainer import make_trainer
    from ..ui import console

    if run.stages is None:
        raise ValueError("run_staged: a plain peer's run (no stages); use run_peer")
    env = _stage_env(run.stages)
    rank, world = (env.rank, env.world) if env is not None else (0, 1)
    with failing():
        plan, pipe = run.stages.plan(run.model, run.trainer, run.method)
        held = plan.held_by(rank, world)
        if env is not None and pipe is not None:
            device = stage_device(run.trainer.device, env.local_rank)
            init_stage_group(env, device, pipe.timeout)
            trainer: Any = make_stage_trainer(run.model, run.trainer, run.data, pipe, plan, env, device)
        else:
            trainer = make_trainer(run.model, run.trainer, run.data)
    session = RunSession(run.method.name, run.peer.region)
    session.serve_metrics(run.metrics_port, run.metrics_host, offset=rank)
    with failing():
        staged = StagedPeer(run.peer, run.method, trainer, plan, held, _transports(run.swarm),
                            metrics=session.metrics, seed=run.trainer.seed)
    what = f"pipeline stage {rank} of {world}" if world > 1 else "whole model"
    console.print(f"p2ptrain {__version__} · {what} · stage groups {list(held.groups)} of {plan.stages} · "
                  f"run {run.peer.run_id} · {run.method.name}", highlight=False)
    session.stop_on_signals(staged, shutdown_grace(run), held=early)
    session.start(staged)
    trainer.stream.reseed(run.data.seed, data_rank(staged.identity))
    maddrs = visible_maddrs(staged.peers, per_rank(run.maddrs_file, rank, world))
    console.print(f"step pacing {staged.step_seconds}s · namespaces {[p.cfg.run_id for p in staged.peers]}; "
                  + join_hint(maddrs[:1], run, f" --run-stages {plan.stages} [--pipeline-stages S]"),
                  highlight=False, soft_wrap=True)

    def evaluate(summaries: list[PeerSummary]) -> float:
        theta: dict[str, torch.Tensor] = {}
        for s in summaries:
            theta.update(s.outer_params)
        return float(trainer.evaluate(theta or None).loss)

    log = open_experiment_log(run, staged.identity, f".rank{rank}" if world > 1 else "")
    try:
        # The stages step in lockstep: stage 0's status line speaks for all (one bar on a shared terminal).
        summaries, val = session.run(staged, run.quiet or rank > 0, evaluate, log, total=run.peer.steps)
    finally:
        if env is not None and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    rows = [(f"stage {p.cfg.run_id}", f"{s.peer_id[-12:]}: rounds {s.rounds_complete}/{s.rounds_partial}/"
                                       f"{s.rounds_failed} applied {s.rounds_applied}")
            for p, s in zip(staged.peers, summaries, strict=True)]
    rows += [("inner steps", summaries[0].steps), ("val loss of θ", f"{val:.4f}"),
             ("compute utilization", f"{summaries[0].utilization:.3f}")]
    report(f"p2ptrain join ({what}): summary", rows, per_rank(run.json_out, rank, world),
           lambda: _record(staged, held, summaries, val, run.method.name, plan.stages, (rank, world)))


def _record(staged: StagedPeer, held: StageRange, summaries: list[PeerSummary], val: float, method: str,
            run_stages: int, rank_world: tuple[int, int]) -> dict[str, Any]:
    """The ``--json`` summary of one staged process: its stage groups, each with its rounds and θ's sums."""
    return {
        "steps": summaries[0].steps, "val_loss": val, "method": method, "pipeline_rank": rank_world[0],
        "pipeline_stages": rank_world[1], "run_stages": run_stages, "loop_seconds": staged.loop_seconds,
        "final_train_loss": summaries[0].final_train_loss, "step_seconds": staged.step_seconds,
        "stages": [{"stage": g, "namespace": p.cfg.run_id, "peer_id": s.peer_id,
                    "rounds_complete": s.rounds_complete, "rounds_partial": s.rounds_partial,
                    "rounds_failed": s.rounds_failed, "rounds_applied": s.rounds_applied,
                    "stuck_rounds": s.stuck_rounds, "abandoned_rounds": s.abandoned_rounds, "bytes_sent": s.bytes_sent,
                    "applied": {k: v[0] for k, v in s.applied.items()},
                    "contributors": {key: len(c) for key, c, _ in p.history},
                    "theta": {n: float(t.double().sum()) for n, t in s.outer_params.items()}}
                   for g, p, s in zip(held.groups, staged.peers, summaries, strict=True)],
    }
