"""Real 4-peer swarms on 127.0.0.1, one per method: loss of θ and compute utilization.

    python bench/swarm_loopback.py                          # every method, tiny preset, 200 steps
    python bench/swarm_loopback.py --methods cocodc,diloco --steps 100
    python bench/swarm_loopback.py --methods streaming,cocodc --preset micro --steps 600 --H 12 --tau 5 \
        --seeds 0,1,2 --step-seconds 0.15 --out bench/results/swarm_streaming_vs_cocodc.json   # several seeds

For each method it starts a bootstrap node and four ``p2ptrain join`` processes
(one thread each: four peers share this machine's cores), waits for them to
leave after ``--steps`` inner steps, and reads their summaries. Utilization is
the fraction of each peer's wall time spent in inner steps (the rest is waiting
for the network: joining, blocking syncs, late results). Next to it: the one-peer
baseline (``p2ptrain train``) at the same number of steps. Writes
bench/results/swarm_loopback.json and prints a table. With several ``--seeds`` every
(method, seed) is a swarm of its own (model init and data streams from the seed), the JSON
is written after each and a (method, seed) already in it is not run again; the table then
adds each method's mean ± standard deviation and the paired gap of each method to the first.
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



def run_swarm(method: str, args: argparse.Namespace, work: Path, env: dict[str, str], seed: int) -> list[dict]:
    boot = subprocess.Popen([sys.executable, "-m", "p2ptrain", "bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                             "--maddrs-file", str(work / f"{method}.{seed}.boot")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env)
    procs = [boot]
    try:
        maddrs = wait_lines(work / f"{method}.{seed}.boot", 60)
        cmd = [sys.executable, "-m", "p2ptrain", "join", "--run-id", f"loop-{method}-{seed}-{os.getpid()}",
               "--method", method, "--seed", str(seed), "--preset", args.preset, "--steps", str(args.steps), "--batch-size", str(args.batch_size),
               "--H", str(args.H), "--metrics-port", "-1", "-q", "--step-seconds", str(args.step_seconds),
               "--log-level", "INFO"]
        if method in ("streaming", "cocodc"):
            cmd += ["--P", str(args.P), "--tau", str(args.tau)]
        for m in maddrs:
            cmd += ["--initial-peers", m]
        peers = []
        for i in range(4):
            log = (work / f"{method}.{seed}.{i}.log").open("wb")
            peers.append(subprocess.Popen([*cmd, "--json", str(work / f"{method}.{seed}.{i}.json")], stdout=log,
                                          stderr=subprocess.STDOUT, env=env))
            time.sleep(0.5)
        procs += peers
        for p in peers:
            p.wait(args.steps * 5 + 300)
        return [json.loads((work / f"{method}.{seed}.{i}.json").read_text()) for i in range(4)
                if (work / f"{method}.{seed}.{i}.json").exists()]
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()


def _summary(method: str, seed: int, peers: list[dict], steps: int, wall: float) -> dict:
    return {"method": method, "seed": seed, "peers": len(peers),
            "val_loss_mean": statistics.mean(p["val_loss"] for p in peers),
            "utilization_mean": statistics.mean(p["utilization"] for p in peers),
            "loop_utilization_mean": statistics.mean(p["compute_seconds"] / max(1e-9, p["loop_seconds"])
                                                     for p in peers),
            "drain_seconds_mean": statistics.mean(p["drain_seconds"] for p in peers),
            "bytes_sent_per_step": statistics.mean(p["bytes_sent"] for p in peers) / max(1, steps),
            "rounds_mean": sum(p["rounds_complete"] + p["rounds_partial"] for p in peers) / len(peers),
            "wall_seconds": wall, "summaries": [_slim(p) for p in peers]}


def _slim(summary: dict) -> dict:
    """A peer's summary without the per-step loss log and the applied rounds' digests (megabytes over a few
    swarms; the validation curve, counters and round times stay)."""
    return {k: v for k, v in summary.items() if k not in ("loss_log", "applied")}


def _spread(xs: list[float], fmt: str = ".4f") -> str:
    sd = format(statistics.stdev(xs), fmt.lstrip("+")) if len(xs) > 1 else ""
    return format(xs[0], fmt) if len(xs) == 1 else f"{statistics.mean(xs):{fmt}} ± {sd}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="ddp,diloco,streaming,eager,cocodc,dilocox")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--H", type=int, default=20)
    ap.add_argument("--P", type=int, default=4)
    ap.add_argument("--tau", type=int, default=2)
    ap.add_argument("--seeds", default="0", help="One swarm per method and seed (model init and data streams).")
    ap.add_argument("--step-seconds", type=float, default=0.6, help="round pacing (≈ one peer's step time here)")
    ap.add_argument("--out", type=Path, default=RESULTS / "swarm_loopback.json")
    args = ap.parse_args()

    from p2ptrain.ui import out, table

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    work = Path(tempfile.mkdtemp(prefix="p2ptrain-loop-"))
    seeds = [int(x) for x in args.seeds.split(",")]
    methods = args.methods.split(",")
    record = json.loads(args.out.read_text()) if args.out.exists() and len(seeds) > 1 else {}
    done = {(m["method"], m.get("seed", 0)): m for m in record.get("methods", [])}
    single = record.get("single_val_loss", {})
    single = single if isinstance(single, dict) else {}
    argv = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out")

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "command": f"python bench/swarm_loopback.py {argv}", "machine": platform.platform(),
            "args": {k: str(v) for k, v in vars(args).items()},
            "single_val_loss": single if len(seeds) > 1 else single[str(seeds[0])],
            "methods": list(done.values()), "logs": str(work)}, indent=2))

    for seed in seeds:
        if str(seed) not in single:
            base = work / f"single.{seed}.json"
            subprocess.run([sys.executable, "-m", "p2ptrain", "train", "--preset", args.preset, "--steps",
                            str(args.steps), "--batch-size", str(args.batch_size), "--seed", str(seed), "-q", "--json",
                            str(base)], check=True, env=env, stdout=subprocess.DEVNULL)
            single[str(seed)] = json.loads(base.read_text())["final_val_loss"]
        for method in methods:
            if (method, seed) in done:
                continue
            t0 = time.monotonic()
            peers = run_swarm(method, args, work, env, seed)
            done[(method, seed)] = (_summary(method, seed, peers, args.steps, time.monotonic() - t0) if peers else
                                    {"method": method, "seed": seed, "peers": 0, "logs": str(work)})
            out.print(f"{method} seed {seed}: " + (f"val loss {done[(method, seed)]['val_loss_mean']:.4f}"
                                                   if peers else "failed"), highlight=False)
            save()

    rows = [["single (train)", "1", _spread([single[str(s)] for s in seeds]), "1.000", "1.000", "-", "-", "-"]]
    for method in methods:
        ok = [done[(method, s)] for s in seeds if done.get((method, s), {}).get("peers")]
        if not ok:
            rows.append([method, "0", "failed", "-", "-", "-", "-", "-"])
            continue
        rows.append([method, str(ok[0]["peers"]), _spread([m["val_loss_mean"] for m in ok]),
                     _spread([m["loop_utilization_mean"] for m in ok], ".3f"),
                     _spread([m["utilization_mean"] for m in ok], ".3f"),
                     _spread([m["drain_seconds_mean"] for m in ok], ".1f"),
                     _spread([m["bytes_sent_per_step"] / 1e3 for m in ok], ".1f"),
                     _spread([m["rounds_mean"] for m in ok], ".0f")])
    out.print(table(f"4 real peers on 127.0.0.1, {args.preset}, {args.steps} steps each, seeds {seeds}",
                    ["method", "peers", "val loss of θ", "utilization (loop)", "utilization (all)", "drain s",
                     "kB sent/step", "rounds"], rows))
    first = methods[0]
    for method in methods[1:]:  # paired by seed: the same init and data streams
        gaps = [done[(method, s)]["val_loss_mean"] / done[(first, s)]["val_loss_mean"] - 1 for s in seeds
                if done.get((method, s), {}).get("peers") and done.get((first, s), {}).get("peers")]
        if gaps:
            out.print(f"{method} vs {first}: {_spread(gaps, '+.2%')} [" + ", ".join(f"{g:+.1%}" for g in gaps) + "]",
                      highlight=False)


if __name__ == "__main__":
    main()
