"""The ``p2ptrain`` command line (typer). Thin: flags + config file -> configs -> run."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from . import __version__
from .checkpoint import CheckpointError
from .data import DataConfig, DataError
from .model import PRESETS, preset
from .settings import ConfigError, build, load_file, merged
from .trainer import TrainerConfig

app = typer.Typer(
    name="p2ptrain",
    help="Decentralized peer-to-peer training of language models (DiLoCo family) over a libp2p DHT.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="TOML config file; flags override it.")]
LogOpt = Annotated[str | None, typer.Option("--log-level", help="DEBUG/INFO/WARNING/ERROR (env P2PTRAIN_LOG_LEVEL).")]


def fail(message: str, code: int = 2) -> typer.Exit:
    from .ui import console

    console.print(f"[bold red]error:[/] {message}", highlight=False)
    return typer.Exit(code)


def version_callback(value: bool) -> None:
    if value:
        typer.echo(f"p2ptrain {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option("--version", callback=version_callback, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """p2ptrain: train language models across regions, clouds and volunteer GPUs, no coordinator."""


def _model_and_trainer(file: dict[str, Any], preset_name: str | None, model_flags: dict[str, Any],
                       trainer_flags: dict[str, Any]) -> tuple[Any, TrainerConfig]:
    name = preset_name or file.get("preset") or "tiny"
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    try:
        model_cfg = preset(name, **merged(file.get("model"), model_flags))
    except TypeError as e:
        raise ConfigError(f"[model]: {e}") from None
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return model_cfg, build(TrainerConfig, merged(file.get("trainer"), trainer_flags), "trainer")


@app.command()
def train(
    preset_name: Annotated[str | None, typer.Option("--preset", "-p", help=f"Model preset: {', '.join(PRESETS)}.")] = None,
    steps: Annotated[int | None, typer.Option("--steps", "-n", help="Total inner steps.")] = None,
    data: Annotated[str | None, typer.Option("--data", help="Text file, folder, or uint16 .bin tokens (default: built-in corpus).")] = None,
    checkpoint_dir: Annotated[str | None, typer.Option("--checkpoint-dir", help="Where to write checkpoints.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the newest checkpoint in --checkpoint-dir.")] = False,
    batch_size: Annotated[int | None, typer.Option("--batch-size", help="Sequences per micro-batch.")] = None,
    lr: Annotated[float | None, typer.Option("--lr", help="Peak inner learning rate.")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Seed of model init and data stream.")] = None,
    eval_every: Annotated[int | None, typer.Option("--eval-every", help="Inner steps between validation evaluations.")] = None,
    device: Annotated[str | None, typer.Option("--device", help="auto, cpu, cuda, cuda:N.")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the summary as JSON here.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
    config: ConfigOpt = None,
    log_level: LogOpt = None,
) -> None:
    """Train one peer locally, no network: the single-worker baseline."""
    from .single import TrainJob, run_train
    from .ui import console, out, progress_bar, setup_logging, table

    try:
        setup_logging(log_level)
        file = load_file(config)
        job_vals = merged({k: v for k, v in file.items() if not isinstance(v, dict) and k != "preset"},
                          {"steps": steps, "checkpoint_dir": checkpoint_dir, "eval_every": eval_every})
        total = int(job_vals.get("steps", 300))
        model_cfg, trainer_cfg = _model_and_trainer(
            file, preset_name, {},
            {"batch_size": batch_size, "lr": lr, "seed": seed, "device": device,
             "total_steps": file.get("trainer", {}).get("total_steps", total)})
        data_cfg = build(DataConfig, merged(file.get("data"), {"path": data, "seed": seed}), "data")
        job = build(TrainJob, {**job_vals, "model": model_cfg, "trainer": trainer_cfg, "data": data_cfg,
                               "resume": resume}, "job")
    except (ConfigError, DataError, ValueError) as e:
        raise fail(str(e)) from None

    console.print(f"p2ptrain {__version__} · train · preset {preset_name or file.get('preset', 'tiny')} "
                  f"· {total} steps", highlight=False)
    try:
        with progress_bar(job.steps, "train", disable=quiet) as prog:
            task = prog.task_ids[0]

            def on_step(s: Any) -> None:
                prog.update(task, completed=s.step, loss=f"{s.loss:.3f}",
                            extra=f"{s.tokens / max(s.seconds, 1e-9):,.0f} tok/s")

            def on_eval(step: int, loss: float) -> None:
                prog.update(task, completed=step)
                prog.console.print(f"step {step}: val loss {loss:.4f}", highlight=False)

            summary = run_train(job, on_step=on_step, on_eval=on_eval)
    except (DataError, CheckpointError, ValueError) as e:
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        raise fail("interrupted", 130) from None

    rows = [
        ("steps", f"{summary.start_step} → {summary.start_step + summary.steps}"),
        ("val loss", f"{summary.initial_val_loss:.4f} → {summary.final_val_loss:.4f}"),
        ("train loss (last step)", f"{summary.final_train_loss:.4f}"),
        ("tokens/s", f"{summary.tokens_per_second:,.0f}"),
        ("wall time", f"{summary.seconds:.1f} s"),
        ("checkpoint", summary.checkpoint or "-"),
    ]
    out.print(table("p2ptrain train: summary", ["", "value"], rows))
    if json_out:
        json_out.write_text(json.dumps({
            "start_step": summary.start_step, "steps": summary.steps,
            "initial_val_loss": summary.initial_val_loss, "final_val_loss": summary.final_val_loss,
            "final_train_loss": summary.final_train_loss, "tokens": summary.tokens,
            "seconds": summary.seconds, "tokens_per_second": summary.tokens_per_second,
            "checkpoint": summary.checkpoint, "evals": summary.evals,
        }, indent=2))


def run() -> None:  # console-script entry point
    app()


if __name__ == "__main__":
    sys.exit(app())
