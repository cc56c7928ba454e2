"""Memory growth: resident memory of every peer of a small real swarm over many rounds (is it flat?).

    python bench/memory_growth.py                          # 4 peers, 8 minutes, a round about every second
    python bench/memory_growth.py --peers 3 --minutes 4    # a shorter run

A bootstrap node and ``--peers`` ``p2ptrain join`` processes on 127.0.0.1 (streaming, preset micro, one thread
each). Short steps and a small H make many rounds happen (with the defaults: every peer applies about 45 rounds
a minute, 15 times the churn benchmark's rate), so that memory kept per round shows within minutes.
Every ``--every`` seconds: the resident memory of each peer's Python process and, separately, of its libp2p
daemon (p2pd). After ``--warmup`` seconds, growth is the least-squares slope of RSS over time, per peer; with
the rounds it applied in the same window (``event=applied`` lines of its log) it gives MB kept per round.

What it found (bench/results/memory_growth.json): a Round object lived on after it was applied, held by the
digest Future's done-callback (a concurrent Future keeps its callbacks after running them, and the replica's
applied_log keeps every Future): about 1 MB a round with preset micro, +3 MB/min per peer in bench/churn.py.

Writes bench/results/memory_growth.json (and prints a table).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import P2PTRAIN, RESULTS, exit_on_sigterm, fresh_start_args, join_argv, rss_mb, write_json
from p2ptrain.procs import wait_lines

_APPLIED = re.compile(r"^ts=(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*event=applied ")


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (a peer's p2pd daemon)."""
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            out += [int(x) for x in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    except OSError:
        pass
    return out


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (minutes, MB) points, MB/min (nan with fewer than two)."""
    if len(points) < 2:
        return float("nan")
    mt = sum(t for t, _ in points) / len(points)
    mv = sum(v for _, v in points) / len(points)
    den = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (v - mv) for t, v in points) / den if den else float("nan")


def applied_times(log: Path) -> list[float]:
    """Unix times of the rounds a peer applied (its log's ``event=applied`` lines)."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if m := _APPLIED.match(line):
            out.append(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--minutes", type=float, default=8.0)
    ap.add_argument("--warmup", type=float, default=90.0, help="seconds after the last start before the slope window")
    ap.add_argument("--every", type=float, default=5.0,
                    help="seconds between RSS samples (RSS swings by tens of MB as the allocator trims: sample densely)")
    ap.add_argument("--print-every", type=float, default=30.0, help="seconds between printed samples")
    ap.add_argument("--preset", default="micro")
    ap.add_argument("--step-seconds", type=float, default=0.5)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--P", type=int, default=4)
    ap.add_argument("--tau", type=int, default=2)
    ap.add_argument("--join-window", type=float, default=1.0)
    ap.add_argument("--flat-limit", type=float, default=0.5, help="MB/min: growth at or below it counts as flat")
    ap.add_argument("--out", type=Path, default=RESULTS / "memory_growth.json")
    a = ap.parse_args()
    exit_on_sigterm()

    work = Path(tempfile.mkdtemp(prefix="memory_growth-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        with log.open("wb") as f:
            p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        procs.append(p)
        return p

    samples: list[dict[str, Any]] = []
    try:
        boot = spawn([*P2PTRAIN, "bootstrap", "--maddrs-file", str(work / "boot.maddrs")], work / "boot.log")
        initial = [m for m in wait_lines(work / "boot.maddrs", 90, boot) if "/ip4/127.0.0.1/" in m][:1]
        peers = []
        run_id = f"memory-growth-{os.getpid()}"
        for i in range(a.peers):
            argv = join_argv("streaming", preset=a.preset, steps=100_000_000, batch_size=8, H=a.H,
                             step_seconds=a.step_seconds, run_id=run_id, tau=a.tau, P=a.P,
                             extra=["--min-step-seconds", str(a.step_seconds), "--join-window", str(a.join_window),
                                    "--checkpoint-dir", str(work / f"peer{i}.ck"), *fresh_start_args(work)])
            for m in initial:
                argv += ["--initial-peers", m]
            peers.append(spawn(argv, work / f"peer{i}.log"))
            time.sleep(1.0)
        t0 = time.time()
        print(f"{a.peers} peers, {a.minutes:g} min, RSS every {a.every:g} s (work: {work})", flush=True)
        while time.time() - t0 < a.minutes * 60:
            row: dict[str, Any] = {"t": round(time.time() - t0, 1)}
            for i, p in enumerate(peers):
                alive = p.poll() is None
                row[f"peer{i}"] = rss_mb(p.pid) if alive else None
                row[f"daemon{i}"] = sum(rss_mb(c) for c in children(p.pid)) if alive else None
            samples.append(row)
            if len(samples) == 1 or row["t"] // a.print_every != samples[-2]["t"] // a.print_every:
                print("  " + "  ".join(f"{k}={v:.0f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                      flush=True)
            time.sleep(max(0.0, a.every - (time.time() - t0 - row["t"])))
        t_end = time.time()
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass

    rows = []
    print(f"\n| peer | RSS at {a.warmup:g} s MB | RSS at end MB | growth MB/min | p2pd MB/min | rounds/min | MB/round |")
    print("|---|---|---|---|---|---|---|")
    for i in range(a.peers):
        pts = [(r["t"] / 60, r[f"peer{i}"]) for r in samples if r["t"] >= a.warmup and r.get(f"peer{i}")]
        dpts = [(r["t"] / 60, r[f"daemon{i}"]) for r in samples if r["t"] >= a.warmup and r.get(f"daemon{i}")]
        g, gd = slope(pts), slope(dpts)
        times = [t for t in applied_times(work / f"peer{i}.log") if t0 + a.warmup <= t <= t_end]
        rate = len(times) / max(1e-9, (t_end - t0 - a.warmup) / 60)
        per_round = g / rate if rate > 0 else float("nan")
        rows.append({"peer": i, "rss_start_mb": pts[0][1] if pts else None, "rss_end_mb": pts[-1][1] if pts else None,
                     "growth_mb_per_min": g, "daemon_growth_mb_per_min": gd, "rounds_per_min": rate,
                     "mb_per_round": per_round})
        print(f"| {i} | {pts[0][1] if pts else float('nan'):.0f} | {pts[-1][1] if pts else float('nan'):.0f} | "
              f"{g:+.2f} | {gd:+.2f} | {rate:.1f} | {per_round:+.3f} |")
    growth = sorted(r["growth_mb_per_min"] for r in rows)
    med = growth[len(growth) // 2] if growth else float("nan")
    flat = bool(growth) and med <= a.flat_limit
    print(f"\nmedian growth {med:+.2f} MB/min per peer: {'flat' if flat else 'NOT flat'} (limit {a.flat_limit:g})")
    write_json(a.out, {"config": vars(a) | {"out": str(a.out)}, "peers": rows, "median_growth_mb_per_min": med,
                       "flat": flat, "samples": samples})
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
