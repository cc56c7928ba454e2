"""A 4-peer swarm on this machine, in two regions, learning: the whole product in one command.

    python examples/local_swarm.py                       # 4 peers, streaming, tiny preset, ~4 minutes
    python examples/local_swarm.py --method cocodc --seconds 240

It starts a bootstrap node and four ``p2ptrain join`` processes on 127.0.0.1 (two
labelled ``us``, two ``eu``; the ``eu`` peers are padded to run 1.5× slower, as a
second cloud with older GPUs would), watches the swarm through the DHT as
``p2ptrain status`` does, lets them train for ``--seconds``, asks all to leave
(SIGTERM: a graceful leave) and prints each peer's validation loss of θ next to
the one-peer baseline's (``p2ptrain train`` for as many steps as a ``us`` peer
made). Every process is stopped when it ends, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from p2ptrain.procs import wait_lines

console = Console()


def _spawn(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "p2ptrain", *args], stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, env=env)



async def _watch(initial: list[str], run_id: str, procs: list[subprocess.Popen[bytes]], deadline: float) -> None:
    from p2ptrain.net.swarm import HivemindTransport, SwarmConfig

    t = await HivemindTransport.create(SwarmConfig(run_id=run_id, initial_peers=initial, client_mode=True))
    try:
        with Live(console=console, refresh_per_second=2) as live:
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
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
    ap.add_argument("--method", default="streaming")
    ap.add_argument("--seconds", type=float, default=150.0, help="how long the swarm trains (then all leave)")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--H", type=int, default=20)
    ap.add_argument("--no-baseline", action="store_true", help="skip the one-peer baseline run")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="p2ptrain-demo-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # four peers share this machine's cores
    run_id = f"demo{os.getpid()}"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(_spawn(["bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--maddrs-file",
                             str(work / "boot.maddrs")], work / "boot.log", env))
        boot = wait_lines(work / "boot.maddrs", 60)
        console.print(f"bootstrap node: {boot[0]}\nlogs in {work}")
        common = ["join", "--metrics-port", "0", "--run-id", run_id, "--method", args.method, "--preset", args.preset,
                  "--steps", "100000000", "--batch-size", str(args.batch_size), "--H", str(args.H), "-q"]
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
        deadline = time.monotonic() + args.seconds
        asyncio.run(_watch(boot, run_id, peers, deadline))
        for p in peers:
            p.send_signal(signal.SIGTERM)  # all leave together: a graceful leave, with a summary
        codes = [p.wait(120) for p in peers]
        summaries = [json.loads((work / f"peer{i}.json").read_text()) if (work / f"peer{i}.json").exists() else None
                     for i in range(len(peers))]
        us_steps = sorted(s["steps"] for s, r in zip(summaries, ["us", "us", "eu", "eu"], strict=True)
                          if s is not None and r == "us")
        steps = us_steps[len(us_steps) // 2] if us_steps else 100
        baseline = None
        if not args.no_baseline:
            console.print(f"one-peer baseline: p2ptrain train for {steps} steps (as many as a 'us' peer made) ...")
            out = work / "baseline.json"
            subprocess.run([sys.executable, "-m", "p2ptrain", "train", "--preset", args.preset, "--steps",
                            str(steps), "--batch-size", str(args.batch_size), "-q", "--json", str(out)],
                           check=True, env=env, stdout=subprocess.DEVNULL)
            baseline = json.loads(out.read_text())["final_val_loss"]
        table = Table(title=f"{args.method}: 4 peers for {args.seconds:.0f} s (eu peers 1.5× slower)")
        for col in ("peer", "region", "exit", "inner steps", "val loss of θ", "rounds ok/partial/failed",
                    "utilization"):
            table.add_column(col, justify="right")
        for i, (code, s, region) in enumerate(zip(codes, summaries, ["us", "us", "eu", "eu"], strict=True)):
            if s is None:
                table.add_row(f"peer{i}", region, str(code), "-", "-", "-", "-")
                continue
            table.add_row(f"peer{i}", region, str(code), str(s["steps"]), f"{s['val_loss']:.4f}",
                          f"{s['rounds_complete']}/{s['rounds_partial']}/{s['rounds_failed']}",
                          f"{s['compute_seconds'] / max(1e-9, s['loop_seconds']):.2f}")
        if baseline is not None:
            table.add_row("one peer (train)", "-", "0", str(steps), f"{baseline:.4f}", "-", "1.00")
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
