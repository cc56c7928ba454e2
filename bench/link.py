"""All-reduce goodput on shaped links: p2ptrain's transport vs hivemind's DecentralizedAverager.

    python bench/link.py                                       # 2/4/8 peers, 1..256 MB, 100 Mbit/s, 3 repeats
    python bench/link.py --peers 2 --sizes 4,64 --repeats 3    # the headline row
    python bench/link.py --systems p2ptrain --peers 4 --sizes 16

Each case builds a testbed (bench/testbed.py) with one region of k hosts, each behind
its own link shaped to ``--rate`` in both directions, and starts k real processes in
the hosts' namespaces. p2ptrain peers run ``HivemindTransport`` (p2ptrain/net/swarm.py):
``form_group`` then ``allreduce`` of one fp32 vector with the fp32 codec; hivemind
peers run ``DecentralizedAverager.step`` (no compression) with a trigger, so that
matchmaking and the all-reduce are timed apart. Both systems run on the same links in
the same run, one after the other for each (k, size).

Goodput fraction = ideal / measured, where the ideal is ``2(k−1)/k · payload / rate``:
in a butterfly (or ring) all-reduce each peer sends and receives 2(k−1)/k of the
vector, and each peer is behind its own link of ``rate`` each way. The measured time
of a round is the slowest peer's all-reduce (from its own start to its result); the
table shows the median over repeats. The same fraction against the bulk TCP goodput
of one link, measured in the same run, is shown too: TCP/IP headers alone keep TCP
below ~0.956 of a tbf rate at MTU 1500. Every result is checked against the exact
mean. Writes bench/results/link.json (and link.png).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.testbed import RegionSpec, Testbed, TestbedSpec, measure_throughput, parse_rate, unavailable_reason

RESULTS = Path(__file__).parent / "results"
MB = 1_000_000  # payload sizes are decimal MB, like link rates in Mbit/s
PORT = 31400
_cases = 0


# ---------------------------------------------------------------------------------------------- workers
def _values(rank: int, n: int) -> Any:
    """Peer ``rank``'s vector: exactly representable values, so the exact mean is known."""
    import torch

    return torch.full((n,), float(rank + 1), dtype=torch.float32)


def _emit(rec: dict[str, Any]) -> None:
    print("RESULT " + json.dumps(rec), flush=True)


async def _p2ptrain_worker(a: argparse.Namespace, initial: list[str]) -> None:
    from p2ptrain.collective.codecs import get_codec
    from p2ptrain.net.swarm import HivemindTransport, SwarmConfig
    from p2ptrain.net.transport import JoinRequest, PeerInfo

    cfg = SwarmConfig(run_id=a.run_id, initial_peers=initial, host_maddrs=[a.listen], announce_maddrs=[a.announce],
                      join_window=60.0, ttl=3600.0, recontact_every=3600.0, muxer=a.muxer)
    tr = await HivemindTransport.create(cfg)
    try:
        if a.rank == 0:
            text = "\n".join(await tr.visible_maddrs()) + "\n"
            await asyncio.to_thread(Path(a.maddrs).write_text, text)
        await tr.announce(PeerInfo(peer_id=tr.peer_id))
        deadline = time.monotonic() + 120
        while len(await tr.peers()) < a.k:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(await tr.peers())} of {a.k} peers visible after 120 s")
            await asyncio.sleep(0.2)
        codec = get_codec("fp32")
        n = int(a.size * MB) // 4
        x = _values(a.rank, n)
        expect = (a.k + 1) / 2
        timeout = max(60.0, 20 * a.ideal)
        for rep in range(-1, a.repeats):  # round -1: a tiny warm-up that opens the streams
            v = x if rep >= 0 else _values(a.rank, 1024)
            t0 = time.monotonic()
            group = await tr.form_group(JoinRequest(key=f"r{rep}", peer_id=tr.peer_id, weight=1.0, fragment=0), None,
                                        timeout=120)
            t1 = time.monotonic()
            res = await tr.allreduce(group, 0, [v], 1.0, codec, timeout=timeout)
            t2 = time.monotonic()
            err = float((res.tensors[0] - expect).abs().max())
            if rep >= 0:
                _emit({"rep": rep, "group_s": t1 - t0, "allreduce_s": t2 - t1, "members": len(group.members),
                       "partial": res.partial, "max_err": err})
        await tr.leave()
    finally:
        await tr.aclose()


def _hivemind_worker(a: argparse.Namespace, initial: list[str]) -> None:
    import multiprocessing as mp

    mp.set_start_method("fork", force=True)  # DecentralizedAverager is an mp.Process that needs fork
    from hivemind.averaging import DecentralizedAverager
    from hivemind.averaging.control import AveragingStage
    from hivemind.dht import DHT

    dht = DHT(initial_peers=initial or None, host_maddrs=[a.listen], announce_maddrs=[a.announce], start=True)
    avg = None
    try:
        if a.rank == 0:
            Path(a.maddrs).write_text("\n".join(str(m) for m in dht.get_visible_maddrs()) + "\n")
        n = int(a.size * MB) // 4
        timeout = max(60.0, 20 * a.ideal)
        avg = DecentralizedAverager([_values(a.rank, n)], dht, start=True, prefix=a.run_id, target_group_size=a.k,
                                    min_group_size=a.k, min_matchmaking_time=2.0, request_timeout=5.0,
                                    allreduce_timeout=timeout)
        expect = (a.k + 1) / 2
        for rep in range(a.repeats):
            with avg.get_tensors() as ts:
                ts[0].copy_(_values(a.rank, n))
            t0 = time.monotonic()
            for attempt in range(1, 4):  # a failed matchmaking is retried (counted), the all-reduce is not
                ctl = avg.step(wait=False, require_trigger=True, timeout=120, allow_retries=False)
                while ctl.stage not in (AveragingStage.AWAITING_TRIGGER, AveragingStage.FINISHED):
                    if time.monotonic() - t0 > 130:
                        raise TimeoutError("hivemind matchmaking did not finish")
                    time.sleep(0.002)
                if ctl.stage == AveragingStage.AWAITING_TRIGGER or attempt == 3:
                    break
                with contextlib.suppress(Exception):
                    ctl.result(timeout=1)
            t1 = time.monotonic()
            ctl.allow_allreduce()
            group = ctl.result(timeout=timeout + 10)
            t2 = time.monotonic()
            with avg.get_tensors() as ts:
                err = float((ts[0] - expect).abs().max())
            _emit({"rep": rep, "group_s": t1 - t0, "allreduce_s": t2 - t1, "matchmaking_attempts": attempt,
                   "members": 0 if group is None else len(group), "partial": group is None, "max_err": err})
    finally:
        if avg is not None:
            avg.shutdown()
        dht.shutdown()


def _worker(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    for name, kind in (("system", str), ("rank", int), ("k", int), ("size", float), ("repeats", int),
                       ("ideal", float), ("listen", str), ("announce", str), ("maddrs", str), ("run_id", str)):
        ap.add_argument(f"--{name.replace('_', '-')}", type=kind, required=True)
    ap.add_argument("--muxer", default="yamux")
    a = ap.parse_args(argv)
    initial: list[str] = []
    if a.rank > 0:
        from p2ptrain.procs import wait_lines

        initial = wait_lines(Path(a.maddrs), 120)
    if a.system.startswith("p2ptrain"):
        import uvloop

        uvloop.run(_p2ptrain_worker(a, initial))
    else:
        _hivemind_worker(a, initial)


# ---------------------------------------------------------------------------------------------- driver
def run_case(tb: Testbed, system: str, k: int, size: float, repeats: int, rate: float, work: Path) -> dict[str, Any]:
    """Start k peers of ``system`` in the testbed's hosts; per repeat the slowest peer's times."""
    ideal = 2 * (k - 1) / k * size * MB * 8 / rate
    run_id = f"link-{system}-{k}-{size:g}-{os.getpid()}"
    maddrs = work / f"{run_id}.maddrs"
    procs, logs = [], []
    global _cases
    _cases += 1
    port = PORT + _cases  # a fresh port per case: no clash with the previous case's lingering sockets
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HIVEMIND_LOGLEVEL": "ERROR"}
    for rank, host in enumerate(tb.hosts[:k]):
        listen, announce = tb.maddrs(host, port)
        log = work / f"{run_id}.{rank}.log"
        logs.append(log)
        cmd = [sys.executable, str(Path(__file__).resolve()), "_worker", "--system", system,
               "--muxer", system.split("-", 1)[1] if system.startswith("p2ptrain-") else "yamux", "--rank", str(rank),
               "--k", str(k), "--size", str(size), "--repeats", str(repeats), "--ideal", str(ideal),
               "--listen", listen[0], "--announce", announce[0], "--maddrs", str(maddrs), "--run-id", run_id]
        procs.append(tb.run(host, cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env))
        if rank == 0:
            from p2ptrain.procs import wait_lines

            wait_lines(maddrs, 120, procs[0])
    budget = 240 + repeats * (60 + 20 * ideal)
    deadline = time.monotonic() + budget
    for p in procs:
        try:
            p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            break
    failed = [i for i, p in enumerate(procs) if p.poll() != 0]
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    per_peer: list[dict[int, dict[str, Any]]] = []
    for log in logs:
        recs = [json.loads(line[7:]) for line in log.read_text(errors="replace").splitlines()
                if line.startswith("RESULT ")]
        per_peer.append({r["rep"]: r for r in recs})
    reps = []
    for rep in range(repeats):
        got = [pp[rep] for pp in per_peer if rep in pp]
        if len(got) < k:
            continue
        reps.append({"allreduce_s": max(r["allreduce_s"] for r in got), "group_s": max(r["group_s"] for r in got),
                     "round_s": max(r["group_s"] + r["allreduce_s"] for r in got),
                     "members": min(r["members"] for r in got), "partial": any(r["partial"] for r in got),
                     "max_err": max(r["max_err"] for r in got)})
    out: dict[str, Any] = {"system": system, "peers": k, "size_mb": size, "ideal_s": ideal, "repeats": reps,
                           "failed_ranks": failed}
    if failed or len(reps) < repeats:
        tail = logs[failed[0] if failed else 0].read_text(errors="replace")[-1500:]
        out["error"] = f"ranks {failed} failed or results missing; log tail:\n{tail}"
    ok = [r for r in reps if r["max_err"] < 1e-5 and not r["partial"] and r["members"] == k]
    if ok:
        t = statistics.median(r["allreduce_s"] for r in ok)
        out |= {"allreduce_s": t, "goodput": ideal / t, "group_s": statistics.median(r["group_s"] for r in ok),
                "round_s": statistics.median(r["round_s"] for r in ok), "correct_rounds": len(ok)}
    return out


def _plot(cases: list[dict[str, Any]], path: Path) -> None:
    from p2ptrain.plot import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for system, style in (("p2ptrain", "-o"), ("p2ptrain-mplex", ":^"), ("hivemind", "--s")):
        for k in sorted({c["peers"] for c in cases}):
            pts = sorted((c["size_mb"], c["goodput"]) for c in cases
                         if c["system"] == system and c["peers"] == k and "goodput" in c)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{system}, {k} peers")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("payload (MB, fp32)")
    ax.set_ylabel("goodput / link rate")
    ax.axhline(0.95, color="grey", lw=0.5)
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("all-reduce goodput on shaped links (ideal = 2(k−1)/k · payload / rate)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        _worker(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default="2,4,8", help="comma-separated group sizes k")
    ap.add_argument("--sizes", default="1,4,16,64,256", help="comma-separated payloads in MB (fp32)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rate", default="100mbit", help="each peer's link, both directions (tc units)")
    ap.add_argument("--systems", default="p2ptrain,hivemind")
    ap.add_argument("--max-total-mb", type=float, default=1024.0,
                    help="skip cases with peers × size above this (memory: every peer holds a few copies)")
    ap.add_argument("--out", type=Path, default=RESULTS / "link.json")
    args = ap.parse_args()
    from rich.progress import Progress

    from p2ptrain.ui import console, out, table

    if (reason := unavailable_reason()) is not None:
        raise SystemExit(f"testbed unavailable: {reason}")
    rate = parse_rate(args.rate)
    if rate is None:
        raise SystemExit("--rate must be a rate, e.g. 100mbit")
    peers = [int(x) for x in args.peers.split(",")]
    sizes = [float(x) for x in args.sizes.split(",")]
    systems = [s for s in args.systems.split(",") if s]
    if bad := set(systems) - {"p2ptrain", "p2ptrain-mplex", "hivemind"}:
        raise SystemExit(f"unknown systems {sorted(bad)}: p2ptrain, p2ptrain-mplex (the daemon's mplex muxer), hivemind")
    if min(peers) < 2 or args.repeats < 1:
        raise SystemExit("--peers must be ≥ 2 and --repeats ≥ 1")
    plan = [(k, s) for k in peers for s in sizes if k * s <= args.max_total_mb]
    skipped = [(k, s) for k in peers for s in sizes if k * s > args.max_total_mb]
    cases: list[dict[str, Any]] = []
    tcp: dict[int, float] = {}
    work = Path(tempfile.mkdtemp(prefix="p2ptrain-link-"))
    t_start, load_before = time.time(), os.getloadavg()
    with Progress(console=console) as prog:
        task = prog.add_task("cases", total=len(plan) * len(systems))
        for k in peers:
            todo = [s for kk, s in plan if kk == k]
            if not todo:
                continue
            spec = TestbedSpec(regions=(RegionSpec(name="lan", hosts=k, host_rate=rate),))
            with Testbed(spec) as tb:
                tcp[k] = measure_throughput(tb, tb.hosts[0], tb.hosts[1], nbytes=16 * MB)["bits_per_s"]
                for size in todo:
                    for system in systems:
                        prog.update(task, description=f"{system} k={k} {size:g} MB")
                        case = run_case(tb, system, k, size, args.repeats, rate, work)
                        case["tcp_bits"] = tcp[k]
                        cases.append(case)
                        if "error" in case:
                            console.print(f"[red]{system} k={k} {size:g} MB: {case['error']}")
                        prog.advance(task)
    result = {"rate_bits": rate, "repeats": args.repeats, "cases": cases, "tcp_bits": tcp,
              "skipped": skipped, "seconds": time.time() - t_start,
              "load_average": {"before": load_before, "after": os.getloadavg()},
              "command": "python bench/link.py " + " ".join(sys.argv[1:]), "machine": _machine()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    if any("goodput" in c for c in cases):
        _plot(cases, args.out.with_suffix(".png"))
    out.print(f"wrote {args.out}" + (f"; skipped (peers × MB > {args.max_total_mb:g}): {skipped}" if skipped else ""))
    rows = []
    for c in cases:
        g = c.get("goodput")
        rows.append([c["system"], c["peers"], f"{c['size_mb']:g}", f"{c['ideal_s']:.2f}",
                     f"{c['allreduce_s']:.2f}" if g else "failed", f"{g:.3f}" if g else "-",
                     f"{g * rate / c['tcp_bits']:.3f}" if g else "-",
                     f"{c['group_s']:.2f}" if g else "-", f"{c.get('correct_rounds', 0)}/{args.repeats}"])
    out.print(table(f"all-reduce goodput, each peer behind its own {rate / 1e6:g} Mbit/s link "
                    f"(ideal = 2(k−1)/k · payload / rate; TCP goodput of one link: "
                    + ", ".join(f"k={k}: {v / 1e6:.1f}" for k, v in tcp.items()) + " Mbit/s)",
                    ["system", "peers", "MB", "ideal s", "all-reduce s", "of rate", "of TCP", "group s", "ok"], rows))


def _machine() -> dict[str, Any]:
    import platform

    import torch

    return {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "kernel": platform.release()}


if __name__ == "__main__":
    main()
