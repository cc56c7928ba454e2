"""Soak: N real peers on 127.0.0.1 for T minutes; memory over time, rounds by outcome, stuck rounds.

    python bench/soak.py                       # 4 peers × 20 minutes, streaming, tiny preset
    python bench/soak.py --peers 4 --minutes 2 --method cocodc

Starts a bootstrap node and N ``p2ptrain join`` processes, samples each one's
resident memory with its libp2p daemon's (``/proc/PID/status``) every ``--every`` seconds, then asks them
to leave (SIGTERM) and reads their summaries. A stuck round is one that outlived
all of its own timeouts and had to be aborted by the peer's compute thread (must
be 0). Writes bench/results/soak.{json,png} and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import RESULTS, machine, rss_tree_mb
from p2ptrain.procs import wait_lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--method", default="streaming")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--step-seconds", type=float, default=0.5)
    ap.add_argument("--every", type=float, default=15.0, help="seconds between memory samples")
    ap.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    args = ap.parse_args()

    from rich.progress import Progress

    from p2ptrain.ui import out, table

    work = Path(tempfile.mkdtemp(prefix="p2ptrain-soak-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    samples: list[list[float]] = []  # [seconds, rss of each peer...]
    try:
        boot = subprocess.Popen([sys.executable, "-m", "p2ptrain", "bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                                 "--maddrs-file", str(work / "boot.maddrs")], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=env)
        procs.append(boot)
        maddrs = wait_lines(work / "boot.maddrs", 60)
        cmd = [sys.executable, "-m", "p2ptrain", "join", "--run-id", f"soak-{os.getpid()}", "--method", args.method,
               "--preset", args.preset, "--steps", "100000000", "--step-seconds", str(args.step_seconds),
               "--metrics-port", "-1", "-q", "--log-level", "INFO"]
        if args.method in ("streaming", "cocodc"):
            cmd += ["--P", "4", "--tau", "2"]
        for m in maddrs:
            cmd += ["--initial-peers", m]
        peers = []
        for i in range(args.peers):
            peers.append(subprocess.Popen([*cmd, "--json", str(work / f"p{i}.json")],
                                          stdout=(work / f"p{i}.log").open("wb"), stderr=subprocess.STDOUT, env=env))
            time.sleep(0.5)
        procs += peers
        t0 = time.monotonic()
        end = t0 + 60 * args.minutes
        with Progress(console=out, transient=True) as bar:
            task = bar.add_task("soak", total=end - t0)
            while time.monotonic() < end:
                dead = [i for i, p in enumerate(peers) if p.poll() is not None]
                if dead:
                    raise RuntimeError(f"peer(s) {dead} exited early; logs in {work}")
                samples.append([time.monotonic() - t0, *(rss_tree_mb(p.pid) for p in peers)])
                bar.update(task, completed=time.monotonic() - t0)
                time.sleep(min(args.every, max(0.0, end - time.monotonic())))
        samples.append([time.monotonic() - t0, *(rss_tree_mb(p.pid) for p in peers)])
        for p in peers:
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(180) for p in peers]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    summaries = [json.loads((work / f"p{i}.json").read_text()) for i in range(args.peers)]
    rows, report = [], []
    for i, s in enumerate(summaries):
        series = [row[1 + i] for row in samples]
        warm = series[min(len(series) - 1, 2)]  # after start-up (imports, first rounds)
        rows.append([f"p{i}", s["steps"], f"{series[0]:.0f}", f"{warm:.0f}", f"{series[-1]:.0f}",
                     f"{series[-1] - warm:+.0f}", s["rounds_complete"], s["rounds_partial"], s["rounds_failed"],
                     s["stuck_rounds"], codes[i]])
        report.append({"peer": f"p{i}", "exit_code": codes[i], "rss_mb": series, "rss_growth_mb_after_warmup":
                       series[-1] - warm, **{k: s[k] for k in ("steps", "rounds_complete", "rounds_partial",
                                                              "rounds_failed", "stuck_rounds", "repairs", "val_loss",
                                                              "utilization")}})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": f"python bench/soak.py --peers {args.peers} --minutes {args.minutes:g} "
                                               f"--method {args.method}", "machine": machine(),
                                    "rss": "peer process + its libp2p daemon, MB",
                                    "sample_seconds": [row[0] for row in samples], "peers": report, "logs": str(work)},
                                   indent=1))
    _plot(samples, args.out.with_suffix(".png"), args)
    out.print(table(f"soak: {args.peers} peers × {args.minutes:g} min ({args.method}, {args.preset})",
                    ["peer", "steps", "RSS start MB", "RSS warm MB", "RSS end MB", "growth MB", "complete",
                     "partial", "failed", "stuck", "exit"], rows))


def _plot(samples: list[list[float]], path: Path, args: argparse.Namespace) -> None:
    from p2ptrain.plot import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(8, 4))
    for i in range(len(samples[0]) - 1):
        ax.plot([r[0] / 60 for r in samples], [r[1 + i] for r in samples], label=f"p{i}")
    ax.set_xlabel("minutes")
    ax.set_ylabel("resident memory, peer + its daemon (MB)")
    ax.set_title(f"soak: {args.peers} peers, {args.method}, {args.preset}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
