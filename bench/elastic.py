"""Peers come and go (2 → 4 → 3) in one real swarm on 127.0.0.1: the loss must not jump back.

    python bench/elastic.py                        # streaming, tiny preset, 3 phases of 60 s
    python bench/elastic.py --method cocodc --phase 90

Two ``p2ptrain join`` processes start the run; after one phase two more join (they
download θ and the outer state from a live peer before their first inner step);
after another phase one of the first two leaves gracefully (SIGTERM: it finishes
its step, writes a checkpoint and leaves); after a third phase all leave. Each
peer's per-step training loss is read from its summary and plotted against wall
time with the number of live peers, and for each joiner the table compares its
first steps' loss with the swarm's just before it joined (a joiner that started
from scratch would be near ln 256 ≈ 5.5). Writes bench/results/elastic.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from p2ptrain.procs import wait_lines

RESULTS = Path(__file__).parent / "results"



def _ema(values: list[float], beta: float = 0.9) -> list[float]:
    out, m = [], values[0] if values else 0.0
    for v in values:
        m = beta * m + (1 - beta) * v
        out.append(m)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="streaming")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--phase", type=float, default=60.0, help="seconds between membership changes")
    ap.add_argument("--step-seconds", type=float, default=0.4)
    ap.add_argument("--H", type=int, default=20)
    ap.add_argument("--out", type=Path, default=RESULTS / "elastic.json")
    args = ap.parse_args()

    from p2ptrain.ui import out, table

    work = Path(tempfile.mkdtemp(prefix="p2ptrain-elastic-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = [sys.executable, "-m", "p2ptrain", "join", "--run-id", f"elastic-{os.getpid()}", "--method", args.method,
            "--preset", args.preset, "--steps", "1000000", "--H", str(args.H), "--step-seconds",
            str(args.step_seconds), "--metrics-port", "-1", "-q", "--log-level", "INFO"]
    if args.method in ("streaming", "cocodc"):
        base += ["--P", "4", "--tau", "2"]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    events: list[tuple[float, str, int]] = []  # (seconds since start, what, live peers after)

    def start(name: str, initial: list[str]) -> None:
        cmd = [*base, "--json", str(work / f"{name}.json"), "--maddrs-file", str(work / f"{name}.maddrs"),
               "--checkpoint-dir", str(work / f"{name}.ck")]
        for m in initial:
            cmd += ["--initial-peers", m]
        procs[name] = subprocess.Popen(cmd, stdout=(work / f"{name}.log").open("wb"), stderr=subprocess.STDOUT,
                                       env=env)

    def leave(name: str) -> None:
        procs[name].send_signal(signal.SIGTERM)
        if procs[name].wait(120) != 0:
            raise RuntimeError(f"{name} did not leave cleanly: {(work / f'{name}.log').read_text()[-2000:]}")

    t0 = time.time()
    try:
        start("a", [])
        initial = wait_lines(work / "a.maddrs", 90)
        start("b", initial)
        events.append((0.0, "a, b start", 2))
        time.sleep(args.phase)
        for name in ("c", "d"):
            start(name, initial)
        events.append((time.time() - t0, "c, d join", 4))
        time.sleep(args.phase)
        leave("b")
        events.append((time.time() - t0, "b leaves", 3))
        time.sleep(args.phase)
        for name in ("a", "c", "d"):
            procs[name].send_signal(signal.SIGTERM)
        for name in ("a", "c", "d"):
            if procs[name].wait(120) != 0:
                raise RuntimeError(f"{name} did not leave cleanly")
        events.append((time.time() - t0, "all leave", 0))
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)

    peers = {n: json.loads((work / f"{n}.json").read_text()) for n in ("a", "b", "c", "d")}
    curves = {n: [(t - t0, step, loss) for t, step, loss in p["loss_log"]] for n, p in peers.items()}
    rows, joiners = [], {}
    for name in ("c", "d"):
        first = curves[name][:10]
        joined_at = first[0][0]
        before = [loss for n in ("a", "b") for t, _, loss in curves[n] if joined_at - 10.0 <= t < joined_at]
        swarm = statistics.mean(before)
        mine = statistics.mean(loss for _, _, loss in first)
        joiners[name] = {"joined_at_s": joined_at, "first_step": first[0][1], "first10_loss": mine,
                         "swarm_loss_10s_before": swarm, "jump": mine - swarm, "synced_from": peers[name]["synced_from"]}
        rows.append([name, f"{joined_at:.0f}", first[0][1], f"{swarm:.3f}", f"{mine:.3f}", f"{mine - swarm:+.3f}"])
    report = {"command": f"python bench/elastic.py --method {args.method} --phase {args.phase:g}",
              "machine": platform.platform(), "args": {k: str(v) for k, v in vars(args).items()}, "events": events,
              "joiners": joiners, "final_val_loss": {n: p["val_loss"] for n, p in peers.items()},
              "curves": curves, "logs": str(work)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    _plot(curves, events, args.out.with_suffix(".png"), args.method)
    out.print(table(f"joiners of a 2 → 4 → 3 swarm ({args.method}, {args.preset})",
                    ["peer", "joined at s", "first step", "swarm loss before", "joiner's first 10", "jump"], rows))
    out.print("final validation loss of θ: " + ", ".join(f"{n} {p['val_loss']:.3f}" for n, p in peers.items()))
    out.print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def _plot(curves: dict[str, list[tuple[float, int, float]]], events: list[tuple[float, str, int]], path: Path,
          method: str) -> None:
    from p2ptrain.plot import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(9, 5))
    for name, pts in curves.items():
        ax.plot([t for t, _, _ in pts], _ema([loss for _, _, loss in pts]), label=f"peer {name}", lw=1.2)
    for t, what, _ in events[1:]:
        ax.axvline(t, color="grey", ls="--", lw=0.8)
        ax.text(t, ax.get_ylim()[1], f" {what}", va="top", fontsize=8, color="grey")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("training loss (EMA 0.9 over steps)")
    ax.set_title(f"{method}: peers 2 → 4 → 3; joiners start from the swarm's θ")
    ax2 = ax.twinx()
    xs = [e[0] for e in events]
    ax2.step(xs, [e[2] for e in events], where="post", color="black", alpha=0.3, lw=2)
    ax2.set_ylabel("live peers")
    ax2.set_ylim(0, 5)
    ax.legend(loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
