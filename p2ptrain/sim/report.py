"""Simulator output: a summary table, a JSON file, and PNG plots."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .runner import RunResult

__all__ = ["plot_runs", "summary_rows", "write_json"]

COLUMNS = [
    "run", "peers", "final val loss", "steps→target", "sim s→target", "MB sent/peer", "peak MB/sync",
    "syncs", "utilization", "stall s", "wall s",
]


def summary_rows(results: Sequence[RunResult], target: float | None) -> list[list[Any]]:
    rows = []
    for r in results:
        s, t = r.to_target(target)
        rows.append([
            r.label, r.peers, r.final_loss, "-" if s is None else round(s, 1), "-" if t is None else round(t, 1),
            r.bytes_sent_per_peer / 1e6, r.peak_bytes_per_sync / 1e6, r.syncs, r.utilization,
            r.stall_seconds, r.wall_seconds,
        ])
    return rows


def results_json(results: Sequence[RunResult], target: float | None, meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` and every run's results, as JSON values."""
    return json.loads(json.dumps({**meta, "runs": [r.to_dict(target) for r in results]}, default=_jsonable))


def write_json(path: str | Path, results: Sequence[RunResult], target: float | None,
               meta: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(results_json(results, target, meta), indent=2))


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return str(v)


def plot_runs(results: Sequence[RunResult], out_dir: str | Path, target: float | None = None,
              title: str = "") -> list[Path]:
    """loss vs step and loss vs simulated time, one line per run."""
    from ..plot import pyplot

    plt = pyplot()

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for xkey, xlabel, fname in ((0, "inner step (per peer)", "loss_vs_step.png"),
                                (1, "simulated time (s)", "loss_vs_time.png")):
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        for r in results:
            xs = [e[xkey] for e in r.evals]
            ys = [e[2] for e in r.evals]
            ax.plot(xs, ys, label=r.label, marker="." if len(xs) < 40 else None)
        if target is not None:
            ax.axhline(target, color="grey", linestyle=":", linewidth=1, label=f"target {target:g}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss of θ")
        ax.set_title(title or "p2ptrain simulate")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        p = out / fname
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    return paths


def plot_utilization(curves: dict[str, list[tuple[float, float]]], out_dir: str | Path,
                     fname: str = "utilization_vs_bandwidth.png") -> Path:
    """Compute utilization vs bandwidth (bits/s on a log axis), one line per method."""
    from ..plot import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for label, pts in curves.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label)
    ax.set_xscale("log")
    ax.set_xlabel("bandwidth per peer (bit/s)")
    ax.set_ylabel("compute utilization")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    p = Path(out_dir) / fname
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return p
