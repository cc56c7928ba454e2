"""Where a churn run's peers did not train: the gaps between their checkpoint lines.

    python bench/churn_gaps.py /tmp/p2ptrain-churn-XXXX/faults

A peer writes a checkpoint every few seconds of training (``--checkpoint-seconds``), each line with its inner step.
Between two lines a peer that trains steadily takes the pacing per step; a gap longer than 8 s at more than 3.5 s a
step is time it did not train (a stop, a leave's last seconds, a repair that waited). Prints the steady seconds per
step and the gaps by length, with the seconds they lost against 3 s a step (``--step-seconds``).
"""

from __future__ import annotations

import argparse
import itertools
import re
from datetime import datetime
from pathlib import Path

LINE = re.compile(r"^ts=(\S+ \S+) .*event=checkpoint why=\w+ step=(\d+)", re.M)
KINDS = (("8-19 s (a leave's last seconds)", 8.0, 19.0), ("19-30 s (the stops)", 19.0, 30.0),
         ("over 30 s (repairs)", 30.0, float("inf")))


def gaps(folder: Path, step_seconds: float) -> tuple[float, int, dict[str, tuple[int, float]]]:
    """(steady seconds a step, steady steps, {kind: (gaps, seconds lost)}) over every peer log in ``folder``."""
    steady = steps = 0.0
    out = {k: (0, 0.0) for k, _, _ in KINDS}
    for log in sorted(folder.glob("s*.log")):
        points = [(datetime.strptime(t, "%Y-%m-%d %H:%M:%S,%f").timestamp(), int(s))
                  for t, s in LINE.findall(log.read_text(errors="replace"))]
        for (t0, s0), (t1, s1) in itertools.pairwise(points):
            dt, ds = t1 - t0, s1 - s0
            if ds <= 0:
                continue
            if dt > 8.0 and dt / ds > 3.5:
                for kind, lo, hi in KINDS:
                    if lo < dt <= hi:
                        n, lost = out[kind]
                        out[kind] = (n + 1, lost + dt - step_seconds * ds)
            else:
                steady, steps = steady + dt, steps + ds
    return (steady / steps if steps else float("nan")), int(steps), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="a churn phase's peer logs (bench/churn.py prints 'logs in ...')")
    ap.add_argument("--step-seconds", type=float, default=3.0)
    a = ap.parse_args()
    per_step, steps, out = gaps(a.folder, a.step_seconds)
    print(f"steady: {per_step:.3f} s a step over {steps} steps (pacing {a.step_seconds:g} s)")
    print(f"{'gaps':<36} {'count':>6} {'seconds lost':>13}")
    for kind, (n, lost) in out.items():
        print(f"{kind:<36} {n:>6} {lost:>13.0f}")


if __name__ == "__main__":
    main()
