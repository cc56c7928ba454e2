"""How long the command line takes to answer ``--help``: the wall time of a fresh process, as a user sees it.

    python bench/cli_speed.py                    # 5 runs of each command, label "current"
    python bench/cli_speed.py --runs 9 --label after-lazy-imports

Times ``python -m p2ptrain --help``, ``p2ptrain join --help`` and ``p2ptrain status --help`` (the console
script next to this Python, else ``python -m p2ptrain``), each as a subprocess, and reports the median.
Target: under 1 s each (torch, hivemind and the model are imported only by the commands that run them).
Prints a table and adds the figures under ``--label`` to bench/results/cli_speed.json (other labels kept),
with the machine's load average, since a loaded machine slows every start.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
TARGET_SECONDS = 1.0


def commands() -> dict[str, list[str]]:
    """The commands timed, by the name they are reported under."""
    script = Path(sys.executable).parent / "p2ptrain"
    entry = [str(script)] if script.exists() else [shutil.which("p2ptrain") or ""]
    if not entry[0]:
        entry = [sys.executable, "-m", "p2ptrain"]
    return {
        "python -m p2ptrain --help": [sys.executable, "-m", "p2ptrain", "--help"],
        "p2ptrain join --help": [*entry, "join", "--help"],
        "p2ptrain status --help": [*entry, "status", "--help"],
    }


def wall_time(cmd: list[str]) -> float:
    """Seconds from start to exit of ``cmd`` (its output discarded); RuntimeError if it fails."""
    t0 = time.perf_counter()
    r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)
    seconds = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {r.returncode}: {r.stderr.decode(errors='replace')[-500:]}")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="Runs of each command (the median is reported).")
    ap.add_argument("--label", default="current", help="The key the figures are stored under in the JSON.")
    args = ap.parse_args()

    cmds = commands()
    for cmd in cmds.values():  # once, untimed: bytecode caches written, files in the page cache
        wall_time(cmd)
    times: dict[str, list[float]] = {name: [] for name in cmds}
    for _ in range(args.runs):  # interleaved, so that a burst of load elsewhere hits every command alike
        for name, cmd in cmds.items():
            times[name].append(wall_time(cmd))

    rows = {name: {"median_seconds": round(statistics.median(ts), 3), "runs_seconds": [round(t, 3) for t in ts],
                   "under_target": statistics.median(ts) < TARGET_SECONDS} for name, ts in times.items()}
    print(f"{'command':<28} {'median':>8} {'min':>7} {'max':>7}  target < {TARGET_SECONDS:g} s")
    for name, ts in times.items():
        print(f"{name:<28} {statistics.median(ts):>7.3f}s {min(ts):>6.3f}s {max(ts):>6.3f}s  "
              f"{'ok' if rows[name]['under_target'] else 'MISSED'}")

    path = RESULTS / "cli_speed.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[args.label] = {"commands": rows, "runs": args.runs, "load_average_1m": round(os.getloadavg()[0], 2),
                        "cpus": os.cpu_count(), "python": platform.python_version(),
                        "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path} (label {args.label!r})")


if __name__ == "__main__":
    main()
