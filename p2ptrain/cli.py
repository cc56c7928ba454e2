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
TokenizerOpt = Annotated[str | None, typer.Option("--tokenizer", help="A local tokenizer.json (or its folder) for text/.jsonl/.parquet data; default: bytes, or the --init-from folder's.")]
InitFromOpt = Annotated[str | None, typer.Option("--init-from", help="Start from a local Llama checkpoint folder (config.json + safetensors); sets the architecture.")]
SeqLenOpt = Annotated[int | None, typer.Option("--seq-len", help="Context length in tokens (caps an --init-from checkpoint's max_position_embeddings).")]


def fail(message: str, code: int = 2) -> typer.Exit:
    from rich.markup import escape

    from .ui import console

    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)  # "[model]" is text, not markup
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
    data: Annotated[str | None, typer.Option("--data", help="Text file, folder, .jsonl/.parquet, or uint16 .bin tokens (default: built-in corpus).")] = None,
    tokenizer: TokenizerOpt = None,
    init_from: InitFromOpt = None,
    seq_len: SeqLenOpt = None,
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
        job_vals.pop("init_from", None)
        total = int(job_vals.get("steps", 300))
        from .hf_cli import open_init_from

        init = open_init_from(file, preset_name, init_from, seq_len)
        model_cfg, trainer_cfg = _model_and_trainer(
            {k: v for k, v in file.items() if k != "model"} if init else file, None if init else preset_name,
            {"seq_len": seq_len},
            {"batch_size": batch_size, "lr": lr, "seed": seed, "device": device,
             "total_steps": file.get("trainer", {}).get("total_steps", total)})
        data_cfg = build(DataConfig, merged(file.get("data"), {"path": data, "seed": seed, "tokenizer": tokenizer}), "data")
        start = None
        if init is not None:
            from .hf import data_for, trainer_from_hf

            data_cfg = data_for(init, data_cfg)
            model_cfg = init.model_config
            start = trainer_from_hf(init, trainer_cfg, data_cfg)
        job = build(TrainJob, {**job_vals, "model": model_cfg, "trainer": trainer_cfg, "data": data_cfg,
                               "resume": resume}, "job")
    except (ConfigError, DataError, ValueError) as e:
        raise fail(str(e)) from None

    arch = f"from {init.path}" if init else f"preset {preset_name or file.get('preset', 'tiny')}"
    console.print(f"p2ptrain {__version__} · train · {arch} · {total} steps", highlight=False)
    try:
        with progress_bar(job.steps, "train", disable=quiet) as prog:
            task = prog.task_ids[0]

            def on_step(s: Any) -> None:
                prog.update(task, completed=s.step, loss=f"{s.loss:.3f}",
                            extra=f"{s.tokens / max(s.seconds, 1e-9):,.0f} tok/s")

            def on_eval(step: int, loss: float) -> None:
                prog.update(task, completed=step)
                prog.console.print(f"step {step}: val loss {loss:.4f}", highlight=False)

            summary = run_train(job, on_step=on_step, on_eval=on_eval, trainer=start)
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


@app.command()
def simulate(
    methods: Annotated[str, typer.Option("--methods", "-m", help="Comma-separated: single, ddp, diloco, streaming, eager, cocodc, dilocox.")] = "single,diloco,streaming,cocodc",
    peers: Annotated[int | None, typer.Option("--peers", "-M", help="Virtual peers (unless --regions).")] = None,
    steps: Annotated[int | None, typer.Option("--steps", "-n", help="Inner steps per peer.")] = None,
    preset_name: Annotated[str | None, typer.Option("--preset", "-p", help="Model preset.")] = None,
    data: Annotated[str | None, typer.Option("--data", help="Corpus (default: built-in).")] = None,
    step_time: Annotated[str | None, typer.Option("--step-time", help="Virtual seconds per inner step, or 'measured'.")] = None,
    regions: Annotated[str | None, typer.Option("--regions", help="NAME:PEERS:BANDWIDTH,... e.g. us:2:1gbit,eu:2:100mbit")] = None,
    bandwidth: Annotated[str | None, typer.Option("--bandwidth", help="Per-peer bandwidth without --regions (e.g. 1gbit).")] = None,
    rtt: Annotated[str | None, typer.Option("--rtt", help="Round-trip time between regions, e.g. 120ms.")] = None,
    H: Annotated[int | None, typer.Option("--H", help="Inner steps per round.")] = None,
    P: Annotated[int | None, typer.Option("--P", help="Fragments (streaming, cocodc).")] = None,
    tau: Annotated[int | None, typer.Option("--tau", help="Overlap τ in inner steps (streaming, cocodc).")] = None,
    codec: Annotated[str | None, typer.Option("--codec", help="Wire codec for every method: fp32, fp16, bf16, uint8, fp8, e3m0.")] = None,
    outer_lr: Annotated[float | None, typer.Option("--outer-lr", help="Outer learning rate η for every method.")] = None,
    batch_size: Annotated[int | None, typer.Option("--batch-size", help="Sequences per inner step.")] = None,
    lr: Annotated[float | None, typer.Option("--lr", help="Inner peak learning rate.")] = None,
    seed: Annotated[int | None, typer.Option("--seed")] = None,
    eval_every: Annotated[int | None, typer.Option("--eval-every", help="Inner steps between evaluations of θ.")] = None,
    target_loss: Annotated[float | None, typer.Option("--target-loss", help="Report steps/time to reach this validation loss.")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write all results as JSON here.")] = None,
    plot_dir: Annotated[Path | None, typer.Option("--plot-dir", help="Write PNG plots here.")] = None,
    utilization_table: Annotated[bool, typer.Option("--utilization-table", help="Only print the bandwidth each method needs for 50–99% compute utilization (paper setting), no training.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q")] = False,
    config: ConfigOpt = None,
    log_level: LogOpt = None,
) -> None:
    """Run several methods on M virtual peers in one process with a virtual WAN clock."""
    from .ui import console, out, progress_bar, setup_logging, table

    setup_logging(log_level)
    if utilization_table:
        _print_utilization_table()
        return
    from .data import load_corpus
    from .sim.network import parse_duration
    from .sim.report import COLUMNS, plot_runs, plot_utilization, summary_rows, write_json
    from .sim.runner import SimConfig, Simulator, replay_utilization
    from .sim.suite import build_specs

    try:
        file = load_file(config)
        sim_file = file.get("simulate", {})
        total = steps or int(sim_file.get("steps", 300))
        model_cfg, trainer_cfg = _model_and_trainer(
            file, preset_name, {},
            {"batch_size": batch_size, "lr": lr, "seed": seed,
             "total_steps": file.get("trainer", {}).get("total_steps", total)})
        data_cfg = build(DataConfig, merged(file.get("data"), {"path": data, "seed": seed}), "data")
        st = str(step_time if step_time is not None else sim_file.get("step_time", 0.1))
        sim_cfg = build(SimConfig, merged({k: v for k, v in sim_file.items() if k != "step_time"}, {
            "peers": peers, "steps": steps, "regions": regions, "bandwidth": bandwidth,
            "rtt": parse_duration(rtt) if rtt else None, "eval_every": eval_every, "target_loss": target_loss}),
            "simulate")
        sim_cfg.step_time = None if st == "measured" else parse_duration(st)
        knobs = merged(file.get("method"), {"H": H, "P": P, "tau": tau, "codec": codec, "outer_lr": outer_lr})
        per_method = {k: v for k, v in file.get("methods", {}).items() if isinstance(v, dict)}
        specs = build_specs([m.strip() for m in methods.split(",") if m.strip()], knobs, per_method)
        corpus = load_corpus(data_cfg)
    except (ConfigError, DataError, ValueError) as e:
        raise fail(str(e)) from None

    console.print(f"p2ptrain {__version__} · simulate · {len(specs)} runs · {sim_cfg.num_peers} peers · "
                  f"{sim_cfg.steps} steps · {corpus.describe()}", highlight=False)
    simulator = Simulator(sim_cfg, model_cfg, trainer_cfg, data_cfg, corpus)
    results = []
    try:
        with progress_bar(len(specs) * sim_cfg.steps, "simulate", disable=quiet) as prog:
            task = prog.task_ids[0]
            for k, spec in enumerate(specs):
                prog.update(task, extra=spec.label)
                res = simulator.run(spec, on_step=lambda s, k=k: prog.update(task, completed=k * sim_cfg.steps + s))
                prog.update(task, loss=f"{res.final_loss:.3f}")
                results.append(res)
    except KeyboardInterrupt:
        raise fail("interrupted", 130) from None
    target = sim_cfg.target_loss
    out.print(table(f"p2ptrain simulate: {sim_cfg.num_peers} peers, {sim_cfg.steps} steps", COLUMNS,
                    summary_rows(results, target)))
    meta = {"sim": vars(sim_cfg), "model": model_cfg.to_dict(), "trainer": repr(trainer_cfg),
            "data": repr(data_cfg)}
    if json_out:
        write_json(json_out, results, target, meta)
    if plot_dir:
        plot_runs(results, plot_dir, target)
        stime = sim_cfg.step_time or 0.1
        grid = [10 ** (6 + k / 4) for k in range(17)]  # 1 Mbit/s .. 10 Gbit/s
        plot_utilization({r.label: [(b, replay_utilization(r, bandwidth=b, step_time=stime,
                                                          latency=sim_cfg.rtt / 2)) for b in grid]
                          for r in results if r.peers > 1}, plot_dir)
        console.print(f"plots written to {plot_dir}", highlight=False)


def _print_utilization_table() -> None:
    from .sim.utilization import CU_TARGETS, utilization_table
    from .ui import out, table

    rows = utilization_table()  # paper setting: H=100, 3 layers per fragment, 2 workers, bf16 / 4-bit
    cells: dict[tuple[str, str], dict[float, str]] = {}
    for r in rows:
        paper = f"{r.paper_gbps:g}" if r.paper_gbps is not None else "-"
        cells.setdefault((r.model, r.method), {})[r.cu] = f"{r.ours_gbps:.3g} ({paper})"
    out.print(table("Gbit/s needed for a compute utilization: ours (Streaming DiLoCo paper, Table 4)",
                    ["model", "method", *[f"{int(c * 100)}%" for c in CU_TARGETS]],
                    [[m, meth, *[v.get(c, "-") for c in CU_TARGETS]] for (m, meth), v in cells.items()]))


def run() -> None:  # console-script entry point
    app()


from . import hf_cli, swarm_cli  # noqa: E402,F401  (register join / bootstrap / status / export on the app)

if __name__ == "__main__":
    sys.exit(app())
