"""Checkpoint memory: what a checkpoint write and a read add to a process's peak resident memory.

    python bench/checkpoint_memory.py                         # states of 256 MB and 1 GB
    python bench/checkpoint_memory.py --mb 4096               # a larger state (the host needs ~3x it free)
    python bench/checkpoint_memory.py --code /tmp/old --out bench/results/checkpoint_memory_old.json
                                                              # another checkout's p2ptrain, to compare

A peer checkpoints from a Snapshot (every tensor copied to CPU, so that training moves on while a background
thread writes it), so a write costs the snapshot, plus whatever the writer holds beside it. At the scale the
project is for (a 1B-parameter peer: ~16 GB of model, outer and optimizer state) that extra is what the host must
keep free at every checkpoint. Each case runs in a fresh process, which builds a state of ``--mb`` MB of float32
tensors in 64 MB pieces, packs it as the peer does, resets its peak resident memory (``/proc/self/clear_refs``),
writes the checkpoint and reads the new peak (VmHWM). A second fresh process reads the file back
(``read_checkpoint``) the same way. "Beyond" is the peak above the memory the process held before the
operation, less the state it has to hold anyway: the snapshot for a write (already in the baseline), the state
read back for a read.

Writes bench/results/checkpoint_memory.json (and prints a table).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import RESULTS, write_json

# Runs in a fresh interpreter with the measured checkout first on sys.path: argv = code, op, MB, file.
_CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from p2ptrain.checkpoint import Snapshot, pack, read_checkpoint, write_checkpoint

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024.0
    raise KeyError(key)

op, mb, path = sys.argv[2], int(sys.argv[3]), sys.argv[4]
piece = 16 * 1024 * 1024  # floats: 64 MB
if op == "write":
    gen = torch.Generator().manual_seed(0)
    state = {"model": [torch.randn(min(piece, mb * 262144 - i), generator=gen)
                       for i in range(0, mb * 262144, piece)], "step": 7}
    snap = Snapshot(*pack(state))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak resident memory starts again from the current one
before = status("VmRSS")
t0 = time.perf_counter()
if op == "write":
    write_checkpoint(path, snap)
else:
    back = read_checkpoint(path)
    assert sum(t.numel() for t in back["model"]) == mb * 262144
seconds = time.perf_counter() - t0
print(json.dumps({"before_mb": before, "peak_mb": status("VmHWM"), "after_mb": status("VmRSS"), "seconds": seconds}))
"""


def measure(code: Path, op: str, mb: int, path: Path) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(code), op, str(mb), str(path)], capture_output=True,
                         text=True, timeout=60 + mb / 10, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{op} of {mb} MB failed:\n{out.stderr[-2000:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    held = 0.0 if op == "write" else mb  # a read must hold the state it returns; a write's snapshot is in "before"
    row.update(op=op, state_mb=mb, beyond_mb=row["peak_mb"] - row["before_mb"] - held,
               mb_per_s=mb / row["seconds"] if row["seconds"] > 0 else float("nan"))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, nargs="+", default=[256, 1024], help="state sizes, MB of float32")
    ap.add_argument("--code", type=Path, default=Path(__file__).resolve().parents[1],
                    help="the checkout whose p2ptrain is measured (default: this one)")
    ap.add_argument("--dir", type=Path, default=None, help="where the checkpoint files go (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=RESULTS / "checkpoint_memory.json")
    a = ap.parse_args()
    if any(mb < 1 for mb in a.mb):
        ap.error("--mb: sizes of at least 1 MB")
    rows = []
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        for mb in a.mb:
            path = Path(tmp) / f"ckpt-{mb}.safetensors"
            for op in ("write", "read"):
                row = measure(a.code, op, mb, path)
                rows.append(row)
                print(f"{op:>5} {mb:>6} MB  peak beyond the state {row['beyond_mb']:8.1f} MB "
                      f"({row['beyond_mb'] / mb:4.2f}x)  {row['seconds']:6.2f} s  {row['mb_per_s']:7.0f} MB/s",
                      flush=True)
            path.unlink(missing_ok=True)
    commit = subprocess.run(["git", "-C", str(a.code), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    write_json(a.out, {"code": str(a.code), "commit": commit, "rows": rows})
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
