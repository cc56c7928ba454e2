"""``p2ptrain join``: the command, and the run of a plain peer (one process, the whole model).

The command builds the run (``config.join_config``) and hands it on: a plain peer runs here, a staged
one in ``staged.py``, and ``--pipeline-stages S`` without a process-group environment starts S stage
processes through ``launcher.py``. This module and ``session.py`` are where the CLI meets the Peer.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from .. import __version__
from .app import app
from .flags import JoinFlags
from .options import fail, failing, flags_command

if TYPE_CHECKING:  # the run's modules import torch and hivemind: only the command body imports them
    from ..peer import PeerBase, PeerSummary
    from ..trainer import Trainer
    from .config import JoinRun
    from .session import HeldSignal

__all__ = ["join", "run_peer"]


@flags_command(app, JoinFlags)
def join(file: dict[str, Any], flags: JoinFlags) -> None:
    """Join a swarm (or start one, with no --initial-peers) and train until --steps."""
    from .session import HeldSignal

    held = HeldSignal().arm()  # before the imports of torch and hivemind: a leave while they run is a clean one
    try:
        _join(file, flags, held)
    finally:
        held.disarm()


def _join(file: dict[str, Any], flags: JoinFlags, held: HeldSignal) -> None:
    from ..peer.malloc import mmap_threshold, pin_mmap_threshold
    from .config import join_config

    with failing():
        pin_mmap_threshold(mmap_threshold())  # before the run allocates: see peer/malloc.py
        run = join_config(file, flags)
    if run.stages is None:
        run_peer(run, held)
    elif run.stages.launch:
        from .launcher import launch_stages

        held.disarm()  # the launcher hands the signals on to its stages
        if held.signum is not None:  # told to leave before any stage ran
            raise typer.Exit(0)
        if sys.argv[1:2] != ["join"]:
            raise fail("--pipeline-stages > 1 is launched from the `p2ptrain join` command line")
        raise typer.Exit(launch_stages(run.stages.pipeline_stages, sys.argv[1:]))
    else:
        from .staged import run_staged

        run_staged(run, held)


def _trainer(run: JoinRun) -> Trainer:
    """The peer's trainer, from the ``--init-from`` checkpoint or the seed; exit code 2 when the data
    cannot be read or does not fit the checkpoint."""
    from ..hf_run import trainer_from_hf
    from ..trainer import make_trainer

    with failing():
        if run.init is not None:
            return trainer_from_hf(run.init, run.trainer, run.data)
        return make_trainer(run.model, run.trainer, run.data)


def _resume(peer: PeerBase, trainer: Trainer, folder: Path) -> int | None:
    """Restore ``peer`` (and so its ``trainer``) from the newest checkpoint in ``folder``; the inner step it
    resumes at, or None when the folder has none yet (a first start: the peer starts afresh, so a restarting
    container can always pass --resume). Exit code 2 when the checkpoints there cannot be read or do not fit
    this peer."""
    from ..checkpoint import CheckpointError
    from ..peer_checkpoint import PeerCheckpoints
    from ..ui import console

    with failing(CheckpointError, ValueError, KeyError, prefix=f"--resume from {folder}: "):
        found = PeerCheckpoints(folder).latest()
        if found is None:
            console.print(f"no checkpoint in {folder} yet: starting afresh", highlight=False)
            return None
        PeerCheckpoints.restore(peer, found[1])
    step = trainer.step_count
    console.print(f"resuming from {found[0].name} (inner step {step})", highlight=False)
    return step


def run_peer(run: JoinRun, held: HeldSignal | None = None) -> None:
    """Join as one peer: resume, serve metrics, start, train until ``--steps`` or a signal, then print the
    summary (and write the JSON). A signal ``held`` from before (or one during the start) lets the peer start,
    then leave cleanly. Exit code 1 when the swarm cannot be joined, 2 for bad input."""
    from ..net.swarm import HivemindTransport
    from ..peer import make_peer
    from ..staged import data_rank
    from ..ui import console
    from .session import RunSession, join_hint, open_experiment_log, report, shutdown_grace, visible_maddrs

    trainer = _trainer(run)
    session = RunSession(run.method.name, run.peer.region)
    peer = make_peer(run.peer, run.method, trainer, lambda: HivemindTransport.create(run.swarm),
                     metrics=session.metrics)
    resumed_step = _resume(peer, trainer, run.resume) if run.resume is not None else None
    session.serve_metrics(run.metrics_port, run.metrics_host)
    if not run.swarm.initial_peers:
        console.print("[yellow]no --initial-peers: starting a new swarm[/]", highlight=False)
    if run.swarm.swarm_key is None:
        console.print("[yellow]this swarm is open: any peer that knows an address can join (no swarm key)[/]",
                      highlight=False)
    else:
        console.print(f"private swarm: key fingerprint {run.swarm.swarm_key.fingerprint}", highlight=False)
    # Before the start: a signal while it connects (and, resumed, trains) ends that and leaves cleanly after it.
    session.stop_on_signals(peer, shutdown_grace(run), held=held)
    session.start(peer)
    if resumed_step is None:  # a resumed peer keeps its data position
        trainer.stream.reseed(run.data.seed, data_rank(peer.peer_id))
    maddrs = visible_maddrs([peer], run.maddrs_file)
    rid, method = run.peer.run_id, run.method.name
    console.print(f"p2ptrain {__version__} · peer {peer.peer_id} · run {rid} · {method} · "
                  f"step pacing {peer.step_seconds}s", highlight=False)
    console.print(join_hint(maddrs, run), highlight=False, soft_wrap=True)
    log = open_experiment_log(run, peer.peer_id)
    summary, val = session.run(peer, run.quiet, lambda s: trainer.evaluate(s.outer_params or None).loss, log,
                               total=run.peer.steps)
    rows = [("peer", summary.peer_id), ("inner steps", summary.steps), ("val loss of θ", f"{val:.4f}"),
            ("rounds complete / partial / failed", f"{summary.rounds_complete} / {summary.rounds_partial} / "
                                                   f"{summary.rounds_failed}"),
            ("compute utilization", f"{summary.utilization:.3f}"), ("stall", f"{summary.stall_seconds:.1f} s"),
            ("bytes sent / received", f"{summary.bytes_sent:,} / {summary.bytes_received:,}"),
            ("rounds shared with other peers", summary.rounds_shared), ("repairs", summary.repairs)]
    if summary.rounds_shared == 0:
        console.print("[bold yellow]this peer shared no round with any other peer: its θ is its own training "
                      "only[/]", highlight=False)
    report("p2ptrain join: summary", rows, run.json_out, lambda: _record(peer, summary, val, method, resumed_step))


def _record(peer: PeerBase, summary: PeerSummary, val: float, method: str, resumed_step: int | None) -> dict[str, Any]:
    """The ``--json`` summary of a plain peer."""
    return {
        "peer_id": summary.peer_id, "steps": summary.steps, "val_loss": val, "wall_seconds": summary.wall_seconds,
        "compute_seconds": summary.compute_seconds, "stall_seconds": summary.stall_seconds,
        "loop_seconds": summary.loop_seconds, "drain_seconds": summary.drain_seconds,
        "stuck_rounds": summary.stuck_rounds,
        "abandoned_rounds": summary.abandoned_rounds,
        "utilization": summary.utilization, "rounds_complete": summary.rounds_complete,
        "rounds_partial": summary.rounds_partial, "rounds_failed": summary.rounds_failed,
        "rounds_applied": summary.rounds_applied, "rounds_shared": summary.rounds_shared, "repairs": summary.repairs, "bytes_sent": summary.bytes_sent,
        "bytes_received": summary.bytes_received, "final_train_loss": summary.final_train_loss,
        "applied": {k: v[0] for k, v in summary.applied.items()}, "method": method,
        "resumed_step": resumed_step, "synced_from": peer.synced_from, "loss_log": peer.loss_log,
        "loop_started": peer.loop_started, "eval_seconds": summary.eval_seconds, "val_log": peer.val_log,
        "outer_seconds": summary.outer_seconds,
        "round_seconds": list(peer.runner.stats.seconds) if peer.runner is not None else [],
        "group_seconds": list(peer.runner.stats.group_seconds) if peer.runner is not None else [],
        "allreduce_seconds": list(peer.runner.stats.allreduce_seconds) if peer.runner is not None else [],
        "traffic": peer.transport.traffic() if peer.transport is not None else {},
    }
