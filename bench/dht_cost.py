"""Control traffic of idle peers: what the DHT costs each peer per second, beside any round.

    sudo python bench/dht_cost.py                      # 4 peers and a bootstrap node, 40 s per variant
    sudo python bench/dht_cost.py --peers 8 --seconds 60

A bootstrap node and ``--peers`` real transports (hivemind daemons and DHT nodes) in one process, inside a network
namespace this benchmark makes (its loopback counts only their bytes), each looping as a peer's heartbeat does
(peer/link.py): announce itself (one DHT store), then read who is live (one DHT get), every ``--heartbeat``
seconds. Variants: ``announce+read`` (a peer today), ``announce+read+store`` (a second record a heartbeat, as the
pacing had before it rode on the announcement), ``announce`` (no reads). Prints kB/s per peer (the loopback's bytes
over the peers; each packet is counted once) and kB per heartbeat, and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import RESULTS, write_json

NS = "p2pt-dhtcost"
VARIANTS = {"announce+read": (True, False), "announce+read+store": (True, True), "announce": (False, False)}


def _lo_tx() -> int:
    return int(Path("/sys/class/net/lo/statistics/tx_bytes").read_text())


async def _measure(peers: int, heartbeat: float, seconds: float, read: bool, second_store: bool) -> float:
    """Loopback bytes per second of ``peers`` transports heart-beating beside a bootstrap node (after 10 s)."""
    from hivemind.utils import get_dht_time

    from p2ptrain.net.swarm import HivemindTransport, SwarmConfig
    from p2ptrain.net.transport import PeerInfo

    boot = await HivemindTransport.create(SwarmConfig(run_id="dhtcost"))
    ts: list[Any] = []
    try:
        maddrs = [str(m) for m in await boot.visible_maddrs()]
        for _ in range(peers):
            ts.append(await HivemindTransport.create(SwarmConfig(run_id="dhtcost", initial_peers=maddrs)))
        stop = asyncio.Event()

        async def beat(t: Any) -> None:
            info = PeerInfo(peer_id=t.peer_id, region="r0", extra={"pacing": [5.0, time.time()]})
            while not stop.is_set():
                t0 = time.monotonic()
                await t.announce(info)
                if read:
                    await t.peers()
                if second_store:
                    await t._store("meta", {"step_seconds": 5.0, "since": 1.0}, get_dht_time() + t.cfg.ttl)
                await asyncio.sleep(max(0.0, heartbeat - (time.monotonic() - t0)))

        async with asyncio.TaskGroup() as tg:
            for t in ts:
                tg.create_task(beat(t))
            await asyncio.sleep(10.0)  # the DHT settles
            a, t0 = _lo_tx(), time.monotonic()
            await asyncio.sleep(seconds)
            rate = (_lo_tx() - a) / (time.monotonic() - t0)
            stop.set()
        return rate
    finally:
        await asyncio.gather(*(t.aclose() for t in [*ts, boot]), return_exceptions=True)


def _inside(a: argparse.Namespace) -> None:
    rows = {}
    for name in a.variants.split(","):
        read, second = VARIANTS[name]
        rate = asyncio.run(_measure(a.peers, a.heartbeat, a.seconds, read, second))
        rows[name] = {"bytes_per_second_per_peer": rate / a.peers,
                      "bytes_per_heartbeat_per_peer": rate / a.peers * a.heartbeat}
        print(json.dumps({name: rows[name]}), flush=True)
    Path(a.inside).write_text(json.dumps(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--heartbeat", type=float, default=2.0, help="seconds between a peer's announcements")
    ap.add_argument("--seconds", type=float, default=40.0, help="measured per variant (after 10 s to settle)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", type=Path, default=RESULTS / "dht_cost.json")
    ap.add_argument("--inside", default=None, help=argparse.SUPPRESS)  # (run in the namespace; JSON to this file)
    a = ap.parse_args()
    if a.inside is not None:
        _inside(a)
        return
    if unknown := [v for v in a.variants.split(",") if v not in VARIANTS]:
        raise SystemExit(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    if os.geteuid() != 0:
        raise SystemExit("dht_cost needs root: it measures inside a network namespace of its own")
    from p2ptrain.ui import out, table

    subprocess.run(["ip", "netns", "del", NS], capture_output=True)
    subprocess.run(["ip", "netns", "add", NS], check=True)
    tmp = Path(f"/tmp/{NS}-{os.getpid()}.json")
    try:
        subprocess.run(["ip", "-n", NS, "link", "set", "lo", "up"], check=True)
        argv = [sys.executable, __file__, "--peers", str(a.peers), "--heartbeat", str(a.heartbeat),
                "--seconds", str(a.seconds), "--variants", a.variants, "--inside", str(tmp)]
        subprocess.run(["ip", "netns", "exec", NS, *argv], check=True, timeout=120 + 80 * len(a.variants.split(",")))
        rows = json.loads(tmp.read_text())
    finally:
        subprocess.run(["ip", "netns", "del", NS], capture_output=True)
        tmp.unlink(missing_ok=True)
    write_json(a.out, {"command": " ".join(["python bench/dht_cost.py", *sys.argv[1:]]), "args": vars(a) | {
        "out": str(a.out)}, "variants": rows})
    out.print(table(f"{a.peers} idle peers and a bootstrap node, a heartbeat every {a.heartbeat:g} s",
                    ["variant", "kB/s per peer", "kB per heartbeat per peer"],
                    [[n, f"{r['bytes_per_second_per_peer'] / 1e3:.2f}", f"{r['bytes_per_heartbeat_per_peer'] / 1e3:.1f}"]
                     for n, r in rows.items()]))


if __name__ == "__main__":
    main()
