"""Scale: the simulator's cost as virtual peers grow, and real peers on this machine.

    python bench/scale.py                                  # sim 4,8,16,32,64 peers; real 2,4,8 peers (tiny)
    python bench/scale.py --sim-peers 4,16 --real-peers 2,4 --real-seconds 30

Simulator (``p2ptrain simulate``'s engine, one process per swarm size so that its peak
memory is its own): M virtual peers each take ``--sim-steps`` real inner steps, in rounds of
``--H``; reported: wall seconds per outer round and per inner step of one peer, and memory per
peer = (peak resident memory − memory before the peers were built) / M.

Real peers: M ``p2ptrain join`` processes on 127.0.0.1 (one thread each: all share this
machine's cores) and a bootstrap node, training for ``--real-seconds`` (then they leave
gracefully, SIGTERM); reported: the median
round time (a fragment's send to its arrival, from every peer's log), seconds per inner step
(compute), compute utilization, and the peak resident memory of each peer with its libp2p
daemon. Writes bench/results/scale.json and scale.png, prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import RESULTS, PeerLaunch, exit_on_sigterm, join_argv, rss_tree_mb, run_swarm, summarize, write_json


def _sim_worker(a: argparse.Namespace) -> None:
    """One swarm size, in this process: prints one JSON line."""
    import torch

    from p2ptrain.algo.methods import method_config
    from p2ptrain.data import DataConfig, load_corpus
    from p2ptrain.model import preset
    from p2ptrain.sim.runner import RunSpec, SimConfig, Simulator
    from p2ptrain.trainer import TrainerConfig

    torch.set_num_threads(1)
    data = DataConfig()
    corpus = load_corpus(data)
    sim = SimConfig(peers=a.peers, steps=a.steps, step_time=0.1, eval_every=a.steps)
    knobs: dict[str, Any] = {"H": a.H}
    if a.method in ("streaming", "cocodc"):
        knobs |= {"P": a.P, "tau": a.tau}
    spec = RunSpec(a.method, method_config(a.method, **knobs))
    trainer = TrainerConfig(batch_size=a.batch_size, total_steps=a.steps, device="cpu")
    before = rss_tree_mb(os.getpid())
    t0 = time.perf_counter()
    res = Simulator(sim, preset(a.preset), trainer, data, corpus).run(spec)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"peers": a.peers, "wall_seconds": wall, "rss_before_mb": before, "peak_rss_mb": peak,
                      "final_val_loss": res.final_loss, "syncs": res.syncs, "steps": res.steps}), flush=True)


def _run_sim(m: int, a: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "_sim", "--peers", str(m), "--steps", str(a.sim_steps),
           "--H", str(a.H), "--P", str(a.P), "--tau", str(a.tau), "--method", a.method, "--preset", a.preset,
           "--batch-size", str(a.batch_size)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.sim_timeout,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    if p.returncode != 0:
        raise RuntimeError(f"simulator with {m} peers failed:\n{p.stderr[-2000:]}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    rounds = max(1, a.sim_steps // a.H)
    r |= {"seconds_per_round": r["wall_seconds"] / rounds,
          "seconds_per_peer_step": r["wall_seconds"] / (m * a.sim_steps),
          "mb_per_peer": (r["peak_rss_mb"] - r["rss_before_mb"]) / m}
    return r


def _run_real(m: int, a: argparse.Namespace, work: Path) -> dict[str, Any]:
    run_id = f"scale{m}-{os.getpid()}"
    launches = [PeerLaunch(join_argv(a.method, preset=a.preset, steps=10**8, batch_size=a.batch_size, H=a.H,
                                     step_seconds=a.step_seconds, run_id=run_id, tau=a.tau, P=a.P), name=f"p{i}")
                for i in range(m)]
    run = run_swarm(launches, work=work / f"real{m}", deadline=a.real_seconds, stagger=0.3, sample_every=1.0)
    s = summarize(run)
    if s["peers"] < m:
        raise RuntimeError(f"{m} real peers: only {s['peers']} left a summary; logs in {run.logs}")
    return s | {"peers_started": m, "peak_rss_mb": run.peak_rss_mb}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    if len(sys.argv) > 1 and sys.argv[1] == "_sim":
        for flag, kind in (("--peers", int), ("--steps", int), ("--H", int), ("--P", int), ("--tau", int),
                           ("--method", str), ("--preset", str), ("--batch-size", int)):
            ap.add_argument(flag, type=kind, required=True)
        _sim_worker(ap.parse_args(sys.argv[2:]))
        return
    ap.add_argument("--sim-peers", default="4,8,16,32,64")
    ap.add_argument("--real-peers", default="2,4,8")
    ap.add_argument("--method", default="streaming")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--sim-steps", type=int, default=8, help="inner steps of every virtual peer")
    ap.add_argument("--real-seconds", type=float, default=60.0, help="how long the real peers train")
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--P", type=int, default=4)
    ap.add_argument("--tau", type=int, default=2)
    ap.add_argument("--step-seconds", type=float, default=0.5, help="real peers' round pacing")
    ap.add_argument("--sim-timeout", type=float, default=1800.0, help="seconds one simulator size may take")
    ap.add_argument("--out", type=Path, default=RESULTS / "scale.json")
    a = ap.parse_args()
    exit_on_sigterm()
    if a.sim_steps < a.H:
        ap.error("--sim-steps must be at least --H (one round)")

    from rich.progress import Progress

    from p2ptrain.ui import out, table

    sims, reals = [int(x) for x in a.sim_peers.split(",") if x], [int(x) for x in a.real_peers.split(",") if x]
    work = Path(tempfile.mkdtemp(prefix="p2ptrain-scale-"))
    sim_rows, real_rows = [], []
    with Progress(console=out, transient=True) as bar:
        task = bar.add_task("scale", total=len(sims) + len(reals))
        for m in sims:
            bar.update(task, description=f"simulator, {m} peers")
            sim_rows.append(_run_sim(m, a))
            bar.advance(task)
        for m in reals:
            bar.update(task, description=f"real peers, {m}")
            real_rows.append(_run_real(m, a, work))
            bar.advance(task)
    write_json(a.out, {"args": vars(a), "simulator": sim_rows, "real": real_rows, "logs": str(work)})
    _plot(sim_rows, real_rows, a.out.with_suffix(".png"))
    rows = [["simulator", r["peers"], f"{r['seconds_per_round']:.2f}", f"{r['seconds_per_peer_step']:.3f}", "-",
             f"{r['mb_per_peer']:.1f}", f"{r['final_val_loss']:.3f}"] for r in sim_rows]
    rows += [["real (loopback)", r["peers"], f"{r['round_seconds_median']:.2f}",
              f"{r['compute_seconds_per_step']:.3f}", f"{r['utilization_mean']:.3f}", f"{r['peak_rss_mb_mean']:.0f}",
              f"{r['val_loss_mean']:.3f}"] for r in real_rows]
    out.print(table(f"scale: {a.method}, {a.preset}, H={a.H}; sim {a.sim_steps} steps, real {a.real_seconds:g} s",
                    ["what", "peers", "s per round", "s per peer step", "utilization", "MB per peer", "val loss"],
                    rows))


def _plot(sims: list[dict[str, Any]], reals: list[dict[str, Any]], path: Path) -> None:
    from p2ptrain.plot import pyplot

    plt = pyplot()

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(13, 4))
    if sims:
        ax1.plot([r["peers"] for r in sims], [r["seconds_per_round"] for r in sims], "o-")
        ax3.plot([r["peers"] for r in sims], [r["mb_per_peer"] for r in sims], "o-", label="simulator")
    ax1.set_title("simulator: wall seconds per outer round")
    if reals:
        ax2.plot([r["peers"] for r in reals], [r["round_seconds_median"] for r in reals], "s-",
                 label="round: send → arrival (median)")
        ax2.plot([r["peers"] for r in reals], [r["compute_seconds_per_step"] for r in reals], "^-",
                 label="inner step (compute)")
        ax2.legend()
        ax3.plot([r["peers"] for r in reals], [r["peak_rss_mb_mean"] for r in reals], "s-",
                 label="real peer (+ its libp2p daemon)")
    ax2.set_title("real peers on 127.0.0.1: seconds")
    ax3.set_title("peak memory per peer, MB")
    ax3.legend()
    for ax in (ax1, ax2, ax3):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("peers")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
