"""Memory of one all-reduce: how much a member holds at its peak beyond its input, as a multiple of the vector.

    python bench/allreduce_memory.py                            # k 2 and 4, 16 and 64 MB, verified and plain
    python bench/allreduce_memory.py --peers 2 --sizes 256 --verify on

At 1B parameters a fragment is ~1 GB of fp32 (P = 4): a member that holds several copies of it while it
averages needs that many GB of host memory beside the model, the optimizer and the data. Each case runs in a
fresh process: ``k`` real transports (:class:`~p2ptrain.net.swarm.HivemindTransport`, each with its own libp2p
daemon, on 127.0.0.1) form a group and all-reduce one fp32 vector of ``size`` MB each (fp32 wire, the default
direct path). The process's resident memory is read before the round (inputs allocated, streams warmed up
by a small round) and its high-water mark after it (``VmHWM``, reset before the round through
``/proc/self/clear_refs``); ``extra per member`` = (peak − before) / k. The daemons are separate processes
and not counted. The members share one process (one allocator, one GIL), so the figure is a per-member
average. Every result is checked against the exact mean.

Writes bench/results/allreduce_memory.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

MB = 1 << 20
OUT = Path(__file__).resolve().parent / "results" / "allreduce_memory.json"


def _reset_peak() -> None:
    """Start the high-water mark (VmHWM) again from the current resident memory."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _status(field: str) -> float:
    """A ``/proc/self/status`` field in MB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


async def _one(k: int, size: float, verify: bool) -> dict[str, Any]:
    import gc

    import torch

    from p2ptrain.collective.codecs import get_codec
    from p2ptrain.net.swarm import HivemindTransport, SwarmConfig
    from p2ptrain.net.transport import JoinRequest, PeerInfo

    def cfg(initial: list[str]) -> SwarmConfig:
        return SwarmConfig(run_id="allreduce-memory", initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                           verify=verify, join_window=30.0)

    trs = [await HivemindTransport.create(cfg([]))]
    try:
        first = list(await trs[0].visible_maddrs())
        for _ in range(k - 1):
            trs.append(await HivemindTransport.create(cfg(first)))
        for t in trs:
            await t.announce(PeerInfo(peer_id=t.peer_id))
        deadline = time.monotonic() + 60
        while min([len(await t.peers()) for t in trs]) < k:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {k} peers visible after 60 s")
            await asyncio.sleep(0.2)
        codec = get_codec("fp32")

        async def reduce(t: Any, x: torch.Tensor, key: str) -> Any:
            g = await t.form_group(JoinRequest(key=key, peer_id=t.peer_id, weight=1.0, fragment=0), None, timeout=60)
            return await t.allreduce(g, 0, [x], 1.0, codec, timeout=300)

        await asyncio.gather(*[reduce(t, torch.full((1024,), 1.0), "warm") for t in trs])
        xs = [torch.full((int(size * MB) // 4,), float(i + 1)) for i in range(k)]
        gc.collect()
        before = _status("VmRSS")
        _reset_peak()
        t0 = time.monotonic()
        res = await asyncio.gather(*[reduce(t, x, "r0") for t, x in zip(trs, xs, strict=True)])
        seconds = time.monotonic() - t0
        peak = _status("VmHWM")
        err = max(float((r.tensors[0] - (k + 1) / 2).abs().max()) for r in res)
        partial = any(r.partial for r in res)
        extra = (peak - before) / k
        return {"peers": k, "size_mb": size, "verify": verify, "seconds": seconds, "rss_before_mb": before,
                "peak_mb": peak, "extra_per_member_mb": extra, "extra_per_member_x": extra / size,
                "exact": err == 0.0 and not partial}
    finally:
        for t in trs:
            await t.aclose()


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "_one":  # one case, in its own process
        print("RESULT " + json.dumps(asyncio.run(_one(int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "on"))))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default="2,4", help="comma-separated group sizes")
    ap.add_argument("--sizes", default="16,64", help="comma-separated vector sizes in MB (fp32)")
    ap.add_argument("--verify", default="on,off", help="on, off or on,off (verified aggregation)")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    cases = [(int(k), float(s), v) for k in a.peers.split(",") for s in a.sizes.split(",") for v in a.verify.split(",")]
    if any(v not in ("on", "off") for _, _, v in cases):
        raise SystemExit("--verify takes on, off or on,off")
    console = Console()
    rows: list[dict[str, Any]] = []
    record = {"command": "python bench/allreduce_memory.py " + " ".join(sys.argv[1:]), "rows": rows,
              "machine": f"{platform.machine()}, {os.cpu_count()} cpus", "load_average": os.getloadavg()}
    for k, size, v in cases:
        console.print(f"k={k} {size:g} MB verify={v} …")
        proc = subprocess.run([sys.executable, __file__, "_one", str(k), str(size), v], capture_output=True, text=True,
                              timeout=900)
        got = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not got:
            raise SystemExit(f"case k={k} {size} MB verify={v} failed: {proc.stderr[-2000:]}")
        rows.append(json.loads(got[0]))
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(record, indent=1))  # as it goes
    table = Table(title="one all-reduce's memory beyond its input, per member (fp32 wire, 127.0.0.1)")
    for col in ("peers", "MB", "verified", "seconds", "extra per member MB", "× the vector", "exact"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["peers"]), f"{r['size_mb']:g}", "yes" if r["verify"] else "no", f"{r['seconds']:.1f}",
                      f"{r['extra_per_member_mb']:.0f}", f"{r['extra_per_member_x']:.1f}", "yes" if r["exact"] else "NO")
    console.print(table)
    console.print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
