"""Real 4-peer swarms on 127.0.0.1, one per method: loss of θ and compute utilization.

    python bench/swarm_loopback.py                          # every method, tiny preset, 200 steps
    python bench/swarm_loopback.py --methods cocodc,diloco --steps 100

For each method it starts a bootstrap node and four ``p2ptrain join`` processes
(one thread each: four peers share this machine's cores), waits for them to
leave after ``--steps`` inner steps, and reads their summaries. Utilization is
the fraction of each peer's wall time spent in inner steps (the rest is waiting
for the network: joining, blocking syncs, late results). Next to it: the one-peer
baseline (``p2ptrain train``) at the same number of steps. Writes
bench/results/swarm_loopback.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from p2ptrain.procs import wait_lines

RESULTS = Path(__file__).parent / "results"



def run_swarm(method: str, args: argparse.Namespace, work: Path, env: dict[str, str]) -> list[dict]:
    boot = subprocess.Popen([sys.executable, "-m", "p2ptrain", "bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                             "--maddrs-file", str(work / f"{method}.boot")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env)
    procs = [boot]
    try:
        maddrs = wait_lines(work / f"{method}.boot", 60)
        cmd = [sys.executable, "-m", "p2ptrain", "join", "--run-id", f"loop-{method}-{os.getpid()}", "--method",
               method, "--preset", args.preset, "--steps", str(args.steps), "--batch-size", str(args.batch_size),
               "--H", str(args.H), "--metrics-port", "-1", "-q", "--step-seconds", str(args.step_seconds),
               "--log-level", "INFO"]
        if method in ("streaming", "cocodc"):
            cmd += ["--P", "4", "--tau", str(args.tau)]
        for m in maddrs:
            cmd += ["--initial-peers", m]
        peers = []
        for i in range(4):
            log = (work / f"{method}.{i}.log").open("wb")
            peers.append(subprocess.Popen([*cmd, "--json", str(work / f"{method}.{i}.json")], stdout=log,
                                          stderr=subprocess.STDOUT, env=env))
            time.sleep(0.5)
        procs += peers
        for p in peers:
            p.wait(args.steps * 5 + 300)
        return [json.loads((work / f"{method}.{i}.json").read_text()) for i in range(4)
                if (work / f"{method}.{i}.json").exists()]
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="ddp,diloco,streaming,eager,cocodc,dilocox")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--H", type=int, default=20)
    ap.add_argument("--tau", type=int, default=2)
    ap.add_argument("--step-seconds", type=float, default=0.6, help="round pacing (≈ one peer's step time here)")
    ap.add_argument("--out", type=Path, default=RESULTS / "swarm_loopback.json")
    args = ap.parse_args()

    from p2ptrain.ui import out, table

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    work = Path(tempfile.mkdtemp(prefix="p2ptrain-loop-"))
    base = work / "single.json"
    subprocess.run([sys.executable, "-m", "p2ptrain", "train", "--preset", args.preset, "--steps", str(args.steps),
                    "--batch-size", str(args.batch_size), "-q", "--json", str(base)], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    single = json.loads(base.read_text())["final_val_loss"]
    rows, report = [["single (train)", 1, f"{single:.4f}", "1.000", "1.000", "-", "-", "-"]], []
    for method in args.methods.split(","):
        t0 = time.monotonic()
        peers = run_swarm(method, args, work, env)
        wall = time.monotonic() - t0
        if not peers:
            rows.append([method, 0, "failed", "-", "-", "-", "-", "-"])
            report.append({"method": method, "peers": 0, "logs": str(work)})
            continue
        loss = statistics.mean(p["val_loss"] for p in peers)
        util = statistics.mean(p["utilization"] for p in peers)
        loop_util = statistics.mean(p["compute_seconds"] / max(1e-9, p["loop_seconds"]) for p in peers)
        drain = statistics.mean(p["drain_seconds"] for p in peers)
        sent = statistics.mean(p["bytes_sent"] for p in peers) / max(1, args.steps)
        rounds = sum(p["rounds_complete"] + p["rounds_partial"] for p in peers) / len(peers)
        rows.append([method, len(peers), f"{loss:.4f}", f"{loop_util:.3f}", f"{util:.3f}", f"{drain:.1f}",
                     f"{sent / 1e3:.1f}", f"{rounds:.0f}"])
        report.append({"method": method, "peers": len(peers), "val_loss_mean": loss, "utilization_mean": util, "loop_utilization_mean": loop_util,
                       "drain_seconds_mean": drain,
                       "bytes_sent_per_step": sent, "rounds_mean": rounds, "wall_seconds": wall, "summaries": peers})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": "python bench/swarm_loopback.py", "machine": platform.platform(),
                                    "args": {k: str(v) for k, v in vars(args).items()}, "single_val_loss": single,
                                    "methods": report, "logs": str(work)}, indent=2))
    out.print(table(f"4 real peers on 127.0.0.1, {args.preset}, {args.steps} steps each",
                    ["method", "peers", "val loss of θ", "utilization (loop)", "utilization (all)", "drain s",
                     "kB sent/step", "rounds"], rows))


if __name__ == "__main__":
    main()
