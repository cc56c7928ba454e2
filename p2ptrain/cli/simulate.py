"""``p2ptrain simulate``: several methods on M virtual peers in one process, with a virtual WAN clock."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from .. import __version__
from .app import app
from .flags import SimulateFlags
from .options import fail, failing, flags_command
from .paths import STDOUT

if TYPE_CHECKING:  # the run's modules import torch: only the command body imports them (a fast --help)
    from .config import SimulateRun

__all__ = ["print_utilization_table", "run_simulation", "simulate"]


@flags_command(app, SimulateFlags)
def simulate(file: dict[str, Any], flags: SimulateFlags) -> None:
    """Run several methods on M virtual peers in one process with a virtual WAN clock."""
    if flags.utilization_table:
        print_utilization_table()
        return
    from .config import simulate_config

    with failing():
        run = simulate_config(file, flags)
    run_simulation(run)


def run_simulation(run: SimulateRun) -> None:
    """Run every method with a progress bar, print the results table, and write the JSON and plots asked
    for. A corpus that cannot be read fails with exit code 2; Ctrl-C with 130."""
    from ..data import load_corpus
    from ..sim.report import COLUMNS, plot_runs, plot_utilization, results_json, summary_rows, write_json
    from ..sim.runner import Simulator, replay_utilization
    from ..ui import console, out, progress_bar, table

    sim = run.sim
    with failing():
        corpus = load_corpus(run.data)
    console.print(f"p2ptrain {__version__} · simulate · {len(run.specs)} runs · {sim.num_peers} peers · "
                  f"{sim.steps} steps · {corpus.describe()}", highlight=False)
    simulator = Simulator(sim, run.model, run.trainer, run.data, corpus)
    results = []
    try:
        with progress_bar(len(run.specs) * sim.steps, "simulate", disable=run.quiet) as prog:
            task = prog.task_ids[0]
            for k, spec in enumerate(run.specs):
                prog.update(task, extra=spec.label)
                res = simulator.run(spec, on_step=lambda s, k=k: prog.update(task, completed=k * sim.steps + s))
                prog.update(task, loss=f"{res.final_loss:.3f}")
                results.append(res)
    except KeyboardInterrupt:
        raise fail("interrupted", 130) from None
    target = sim.target_loss
    (console if run.json_out == STDOUT else out).print(  # stdout is the JSON alone with --json -
        table(f"p2ptrain simulate: {sim.num_peers} peers, {sim.steps} steps", COLUMNS, summary_rows(results, target)))
    if run.json_out:
        meta = {"sim": vars(sim), "model": run.model.to_dict(), "trainer": repr(run.trainer), "data": repr(run.data)}
        if run.json_out == STDOUT:
            print(json.dumps(results_json(results, target, meta), indent=2), flush=True)
        else:
            write_json(run.json_out, results, target, meta)
    if run.plot_dir:
        plot_runs(results, run.plot_dir, target)
        step_time = sim.step_time or 0.1
        grid = [10 ** (6 + k / 4) for k in range(17)]  # 1 Mbit/s .. 10 Gbit/s
        plot_utilization({r.label: [(b, replay_utilization(r, bandwidth=b, step_time=step_time,
                                                          latency=sim.rtt / 2)) for b in grid]
                          for r in results if r.peers > 1}, run.plot_dir)
        console.print(f"plots written to {run.plot_dir}", highlight=False)


def print_utilization_table() -> None:
    """Print the bandwidth each method needs for a compute utilization, next to the paper's Table 4."""
    from ..sim.utilization import CU_TARGETS, utilization_table
    from ..ui import out, table

    rows = utilization_table()  # paper setting: H=100, 3 layers per fragment, 2 workers, bf16 / 4-bit
    cells: dict[tuple[str, str], dict[float, str]] = {}
    for r in rows:
        paper = f"{r.paper_gbps:g}" if r.paper_gbps is not None else "-"
        cells.setdefault((r.model, r.method), {})[r.cu] = f"{r.ours_gbps:.3g} ({paper})"
    out.print(table("Gbit/s needed for a compute utilization: ours (Streaming DiLoCo paper, Table 4)",
                    ["model", "method", *[f"{int(c * 100)}%" for c in CU_TARGETS]],
                    [[m, meth, *[v.get(c, "-") for c in CU_TARGETS]] for (m, meth), v in cells.items()]))
