"""A 4-peer swarm on this machine, in two regions, learning: the whole product in one command.

    python examples/local_swarm.py                       # 4 peers, cocodc, tiny preset, ~3 minutes
    python examples/local_swarm.py --method streaming --steps 400

It starts a bootstrap node and four ``p2ptrain join`` processes on 127.0.0.1 (two
labelled ``us``, two ``eu``; the ``eu`` peers are padded to run 1.5× slower, as a
second cloud with older GPUs would), watches the swarm through the DHT as
``p2ptrain status`` does, and prints each peer's validation loss of θ at the end
next to the one-peer baseline's (``p2ptrain train`` for the same number of steps).
Every process is stopped when it ends, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

console = Console()


def _spawn(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "p2ptrain", *args], stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, env=env)


def _wait_lines(path: Path, timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().split()
        time.sleep(0.2)
    raise TimeoutError(f"{path} did not appear in {timeout:.0f} s")


async def _watch(initial: list[str], run_id: str, procs: list[subprocess.Popen[bytes]]) -> None:
    from p2ptrain.net.swarm import HivemindTransport, SwarmConfig

    t = await HivemindTransport.create(SwarmConfig(run_id=run_id, initial_peers=initial, client_mode=True))
    try:
        with Live(console=console, refresh_per_second=2) as live:
            while any(p.poll() is None for p in procs):
                peers = [p for p in await t.peers() if p.peer_id != t.peer_id]
                table = Table(title=f"run {run_id}: {len(peers)} live peers")
                for col in ("peer", "region", "step", "train loss", "tok/s", "rounds"):
                    table.add_column(col, justify="right")
                for p in peers:
                    table.add_row(p.peer_id[-8:], p.region, str(p.step), f"{p.loss:.3f}",
                                  f"{p.tokens_per_second:,.0f}", str(p.extra.get("rounds", "-")))
                live.update(table)
                await asyncio.sleep(1.0)
    finally:
        await t.aclose()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="cocodc")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--H", type=int, default=40)
    ap.add_argument("--no-baseline", action="store_true", help="skip the one-peer baseline run")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="p2ptrain-demo-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # four peers share this machine's cores
    run_id = f"demo{os.getpid()}"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(_spawn(["bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--maddrs-file",
                             str(work / "boot.maddrs")], work / "boot.log", env))
        boot = _wait_lines(work / "boot.maddrs", 60)
        console.print(f"bootstrap node: {boot[0]}\nlogs in {work}")
        common = ["join", "--metrics-port", "0", "--run-id", run_id, "--method", args.method, "--preset", args.preset, "--steps",
                  str(args.steps), "--batch-size", str(args.batch_size), "--H", str(args.H), "-q"]
        for a in boot:
            common += ["--initial-peers", a]
        peers = []
        for i, region in enumerate(["us", "us", "eu", "eu"]):
            extra = ["--region", region, "--json", str(work / f"peer{i}.json")]
            if region == "eu":
                extra += ["--min-step-seconds", "0.4"]  # a slower second cloud
            peers.append(_spawn(common + extra, work / f"peer{i}.log", env))
            time.sleep(3 if i == 0 else 0.5)  # the first peer sets the pacing
        procs += peers
        asyncio.run(_watch(boot, run_id, peers))
        codes = [p.wait() for p in peers]
        baseline = None
        if not args.no_baseline:
            console.print("one-peer baseline: p2ptrain train ...")
            out = work / "baseline.json"
            subprocess.run([sys.executable, "-m", "p2ptrain", "train", "--preset", args.preset, "--steps",
                            str(args.steps), "--batch-size", str(args.batch_size), "-q", "--json", str(out)],
                           check=True, env=env, stdout=subprocess.DEVNULL)
            baseline = json.loads(out.read_text())["final_val_loss"]
        table = Table(title=f"{args.method}: 4 peers × {args.steps} inner steps")
        for col in ("peer", "exit", "val loss of θ", "rounds ok/partial/failed", "utilization"):
            table.add_column(col, justify="right")
        for i, code in enumerate(codes):
            f = work / f"peer{i}.json"
            if not f.exists():
                table.add_row(f"peer{i}", str(code), "-", "-", "-")
                continue
            s = json.loads(f.read_text())
            table.add_row(f"peer{i}", str(code), f"{s['val_loss']:.4f}",
                          f"{s['rounds_complete']}/{s['rounds_partial']}/{s['rounds_failed']}", f"{s['utilization']:.2f}")
        if baseline is not None:
            table.add_row("one peer (train)", "0", f"{baseline:.4f}", "-", "1.00")
        console.print(table)
        return 0 if all(c == 0 for c in codes) else 1
    except KeyboardInterrupt:
        return 130
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    sys.exit(main())
