"""What a pinned mmap threshold (p2ptrain/peer/malloc.py) costs the inner step: seconds per Trainer step with
glibc's own rule against thresholds pinned at several sizes, each in a fresh process, in turn, repeat by repeat.

    python bench/mmap_threshold.py                                # tiny preset, thresholds 128 KiB to 32 MiB
    python bench/mmap_threshold.py --preset small --batch-size 4 --steps 8 --repeats 2

A threshold too small maps (and faults in, zeroed) every activation and gradient of that size anew at each step;
the peer's default (4 MiB) must cost nothing measurable. Writes bench/results/mmap_threshold.json and prints a
table (median of the repeats' medians, and the range).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"

# One process: pin (or not), build the trainer, time the steps after a warm-up.
_STEPS = """
import json, statistics, sys, time
import torch
from p2ptrain.peer.malloc import pin_mmap_threshold
threshold, preset_name, batch, steps = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
pinned = pin_mmap_threshold(threshold)
torch.set_num_threads(1)
from p2ptrain.data import DataConfig
from p2ptrain.model import preset
from p2ptrain.trainer import TrainerConfig, make_trainer
cfg = preset(preset_name)
trainer = make_trainer(cfg, TrainerConfig(batch_size=batch), DataConfig())
times = []
for i in range(steps + 3):
    t0 = time.perf_counter()
    trainer.step()
    if i >= 3:
        times.append(time.perf_counter() - t0)
print(json.dumps({"pinned": pinned, "median": statistics.median(times)}))
"""


def one(threshold: int, a: argparse.Namespace) -> dict[str, float | bool]:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"} | {"OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _STEPS, str(threshold), a.preset, str(a.batch_size), str(a.steps)],
                         capture_output=True, text=True, timeout=1800, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per process (after 3 of warm-up)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--thresholds", default="0,131072,1048576,4194304,33554432",
                    help="bytes, comma-separated; 0 is glibc's own rule")
    ap.add_argument("--out", default=str(RESULTS / "mmap_threshold.json"))
    a = ap.parse_args()
    thresholds = [int(t) for t in a.thresholds.split(",")]
    runs: dict[int, list[float]] = {t: [] for t in thresholds}
    load: list[float] = []
    for rep in range(a.repeats):
        for t in thresholds:  # in turn: machine noise hits every threshold alike
            load.append(os.getloadavg()[0])
            r = one(t, a)
            if t and not r["pinned"]:
                raise SystemExit(f"could not pin the threshold at {t} bytes (not glibc?)")
            runs[t].append(float(r["median"]))
            print(f"repeat {rep + 1}: threshold {t or 'glibc'}: {r['median'] * 1e3:.1f} ms/step", flush=True)
    base = statistics.median(runs[0]) if 0 in runs else None
    rows = []
    for t, xs in runs.items():
        med = statistics.median(xs)
        rows.append({"threshold": t, "ms_per_step": med * 1e3, "min_ms": min(xs) * 1e3, "max_ms": max(xs) * 1e3,
                     "vs_glibc": med / base if base else None})
    print(f"\n{a.preset}, batch {a.batch_size}, {a.steps} steps a process, {a.repeats} repeats in turn "
          f"(load average {min(load):.1f}–{max(load):.1f})\n")
    print("| threshold | ms per step (median) | range | vs glibc's rule |")
    print("|---|---:|---|---:|")
    for r in rows:
        name = "glibc's rule" if r["threshold"] == 0 else f"{r['threshold'] // 1024} KiB"
        vs = f"{r['vs_glibc']:.2f}×" if r["vs_glibc"] else "—"
        print(f"| {name} | {r['ms_per_step']:.1f} | {r['min_ms']:.1f}–{r['max_ms']:.1f} | {vs} |")
    Path(a.out).write_text(json.dumps({"command": " ".join(sys.argv), "machine": platform.platform(),
                                       "started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(a),
                                       "load": load, "rows": rows, "runs": {str(k): v for k, v in runs.items()}},
                                      indent=1))
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
