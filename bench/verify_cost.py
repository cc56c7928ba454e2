"""What verified aggregation costs an honest round: bytes and seconds, with and without it, on real peers.

    python bench/verify_cost.py                        # 5 peers, 2^16 .. 2^24 values, fp32 and e3m0
    python bench/verify_cost.py --peers 4 --sizes 20 22 --repeats 3

Five libp2p peers on 127.0.0.1 in this process (each its own daemon and identity) all-reduce vectors of
2^s values, with verification on and off in alternating repeats (A B A B …, so that the machine's load falls
on both alike). Per configuration: the median over peers and repeats of the round's payload bytes, the
verification bytes (claims sent, evidence received: none in an honest round), their share, and the round's
seconds with and without verification. Loopback has no latency: on a WAN, verification adds about one round
trip (the claims) to every round. Writes bench/results/verify_cost.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.harness import RESULTS, machine, write_json


async def measure(peers: int, numel: int, codec_name: str, verify: bool, repeats: int, run: str) -> list[Any]:
    import signal

    from p2ptrain.collective.codecs import get_codec
    from p2ptrain.net.swarm import HivemindTransport, SwarmConfig
    from p2ptrain.net.transport import JoinRequest, PeerInfo

    def dump() -> None:  # kill -USR1 <pid>: every task's stack, to see what a stuck run waits on
        for task in asyncio.all_tasks():
            task.print_stack(file=sys.stderr)

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump)
    codec = get_codec(codec_name)
    ts: list[Any] = []
    out = []
    try:
        for _ in range(peers):
            initial = await ts[0].visible_maddrs() if ts else []
            ts.append(await HivemindTransport.create(SwarmConfig(run_id=run, initial_peers=initial, join_window=1.0,
                                                                 ttl=60, verify=verify)))
        for t in ts:
            await t.announce(PeerInfo(peer_id=t.peer_id))
        for t in ts:
            for _ in range(100):
                if len(await t.peers()) == peers:
                    break
                await asyncio.sleep(0.1)
        xs = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(peers)]
        for r in range(repeats + 1):  # the first round warms up (dials, allocations): not counted
            async def one(i: int, t: Any, r: int = r) -> Any:
                g = await t.form_group(JoinRequest(key=f"r{r}", peer_id=t.peer_id, weight=1.0, fragment=0), None,
                                       timeout=30)
                return await t.allreduce(g, 0, [xs[i]], 1.0, codec, timeout=120.0)

            res = await asyncio.gather(*(one(i, t) for i, t in enumerate(ts)))
            if r > 0:
                out += list(res)
    finally:
        await asyncio.gather(*(asyncio.wait_for(t.aclose(), 30) for t in ts), return_exceptions=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=5)
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 20, 22, 24], help="log2 of the values per round")
    ap.add_argument("--codecs", nargs="+", default=["fp32", "e3m0"])
    ap.add_argument("--repeats", type=int, default=3, help="alternations of (on, off) per configuration")
    ap.add_argument("--out", type=Path, default=RESULTS / "verify_cost.json")
    args = ap.parse_args()

    from p2ptrain.ui import out as console_out
    from p2ptrain.ui import table

    rows: list[dict[str, Any]] = []
    payload = {"peers": args.peers, "rows": rows, "machine": machine(), "load_before": os.getloadavg()}
    for s in args.sizes:
        for codec in args.codecs:
            on: list[Any] = []
            off: list[Any] = []
            for rep in range(args.repeats):
                for verify, into in ((True, on), (False, off)):
                    into += asyncio.run(measure(args.peers, 1 << s, codec, verify, 1, f"cost-{s}-{codec}-{rep}-{verify}"))
            med = statistics.median
            row = {"numel": 1 << s, "codec": codec,
                   "round_bytes": med([x.bytes_sent + x.bytes_received for x in on]),
                   "verify_bytes": med([x.verify_bytes for x in on]),
                   "seconds_verified": med([x.seconds for x in on]), "seconds_plain": med([x.seconds for x in off]),
                   "verify_seconds": med([x.verify_seconds for x in on]),
                   "partial": sum(x.partial for x in on + off)}
            row["verify_share"] = row["verify_bytes"] / max(1.0, row["round_bytes"])
            rows.append(row)
            write_json(args.out, payload)
            print(f"2^{s} {codec}: {row}", flush=True)
    payload["load_after"] = os.getloadavg()
    write_json(args.out, payload)
    console_out.print(table(
        f"verified aggregation, {args.peers} peers on 127.0.0.1 (median per peer and round)",
        ["values", "wire", "round bytes", "verification bytes", "share", "round s (verified)", "round s (plain)",
         "of it, judging s"],
        [(f"2^{r['numel'].bit_length() - 1}", r["codec"], f"{r['round_bytes'] / 1e6:.2f} MB",
          f"{r['verify_bytes'] / 1e3:.1f} kB", f"{r['verify_share']:.2%}", f"{r['seconds_verified']:.3f}",
          f"{r['seconds_plain']:.3f}", f"{r['verify_seconds']:.3f}") for r in rows]))


if __name__ == "__main__":
    main()
