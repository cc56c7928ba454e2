"""``p2ptrain train``: one peer, local, no network (the baseline every method is compared with)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import __version__
from .app import app
from .flags import TrainFlags
from .options import fail, failing, flags_command

if TYPE_CHECKING:  # the run's modules import torch: only the command body imports them (a fast --help)
    from .config import TrainRun

__all__ = ["run_training", "train"]


@flags_command(app, TrainFlags)
def train(file: dict[str, Any], flags: TrainFlags) -> None:
    """Train one peer locally, no network: the single-worker baseline."""
    from .config import train_config

    with failing():
        run = train_config(file, flags)
    run_training(run)


def run_training(run: TrainRun) -> None:
    """Train with a progress bar, then print the summary (and write it as JSON with ``--json``). A checkpoint
    that does not fit the data, or data that cannot be read, fails with exit code 2; Ctrl-C with 130."""
    from ..checkpoint import CheckpointError
    from ..explog import open_log
    from ..single import run_train
    from ..ui import console, progress_bar
    from .session import report

    start = None
    if run.init is not None:
        from ..hf_run import trainer_from_hf

        with failing():
            start = trainer_from_hf(run.init, run.job.trainer, run.job.data)
    arch = f"from {run.init.path}" if run.init else f"preset {run.preset}"
    with failing():
        log = open_log(run.log_to, name="train", config={"command": "train", "model": arch, "steps": run.job.steps,
                                                         "batch_size": run.job.trainer.batch_size,
                                                         "lr": run.job.trainer.lr})
    console.print(f"p2ptrain {__version__} · train · {arch} · {run.job.steps} steps", highlight=False)
    try:
        with failing(ValueError, CheckpointError), progress_bar(run.job.steps, "train", disable=run.quiet) as prog:
            task = prog.task_ids[0]

            def on_step(s: Any) -> None:
                tokens_per_second = s.tokens / max(s.seconds, 1e-9)
                prog.update(task, completed=s.step, loss=f"{s.loss:.3f}", extra=f"{tokens_per_second:,.0f} tok/s")
                log.log(s.step, {"loss/train": s.loss, "throughput/tokens_per_second": tokens_per_second})

            def on_eval(step: int, loss: float) -> None:
                prog.update(task, completed=step)
                prog.console.print(f"step {step}: val loss {loss:.4f}", highlight=False)
                log.log(step, {"loss/validation": loss})

            summary = run_train(run.job, on_step=on_step, on_eval=on_eval, trainer=start)
    except KeyboardInterrupt:
        raise fail("interrupted", 130) from None
    finally:
        log.close()

    rows = [
        ("steps", f"{summary.start_step} → {summary.start_step + summary.steps}"),
        ("val loss", f"{summary.initial_val_loss:.4f} → {summary.final_val_loss:.4f}"),
        ("train loss (last step)", f"{summary.final_train_loss:.4f}"),
        ("tokens/s", f"{summary.tokens_per_second:,.0f}"),
        ("wall time", f"{summary.seconds:.1f} s"),
        ("checkpoint", summary.checkpoint or "-"),
    ]
    report("p2ptrain train: summary", rows, run.json_out, lambda: {
        "start_step": summary.start_step, "steps": summary.steps,
        "initial_val_loss": summary.initial_val_loss, "final_val_loss": summary.final_val_loss,
        "final_train_loss": summary.final_train_loss, "tokens": summary.tokens,
        "seconds": summary.seconds, "tokens_per_second": summary.tokens_per_second,
        "checkpoint": summary.checkpoint, "evals": summary.evals,
    })
