"""All-reduce goodput on shaped links: p2ptrain's transport vs hivemind's DecentralizedAverager.

    python bench/link.py                                       # 2/4/8 peers, 1..256 MB, 100 Mbit/s, 5 repeats
    python bench/link.py --peers 2 --sizes 4,16,64 --wan-sizes 64   # the headline rows
    python bench/link.py --systems p2ptrain,p2ptrain-plain,hivemind --peers 2 --sizes 64
    python bench/link.py --peers 2 --sizes 1 --max-total-mb 0 --wan-sizes '' --hier-sizes 16,64   # diloco's shape
    git worktree add --detach /tmp/old <commit> && rm -r /tmp/old/bench   # then, before and after in turn:
    python bench/link.py --systems p2ptrain,p2ptrain@base --base /tmp/old --peers 2 --sizes 1,4

``p2ptrain`` is the default peer: verified aggregation on (every member checks every part's average, which
costs CPU time after the transfer, net/verify.py) and parts and results over the direct path (net/direct.py: a TCP
connection per exchange, sealed); ``p2ptrain-plain`` turns verification off, which is what hivemind's averager does
(no check at all); ``-libp2p`` sends everything over the daemon's streams (no direct path); ``-mplex`` runs the
daemons with the mplex stream multiplexer.

Each case builds a testbed (bench/testbed.py) with one region of k hosts, each behind
its own link shaped to ``--rate`` in both directions, and starts k real processes in
the hosts' namespaces. p2ptrain peers run ``HivemindTransport`` (p2ptrain/net/swarm.py):
``form_group`` then ``allreduce`` of one fp32 vector with the fp32 codec; hivemind
peers run ``DecentralizedAverager.step`` (no compression) with a trigger, so that
matchmaking and the all-reduce are timed apart. Both systems run on the same links in
the same run: for each (k, size) the peers of every system start at once, then the
systems take the repeats in turn (A B, B A, A B, …), so that the machine's load, which
drifts over a run, weighs on each alike; every repeat records the load average.
A system is "ahead" of the others only where the ranges of its repeats separate.
WAN rows (``--wan-rtt-ms``): two regions with one peer each, the same host links, the
round trip added by the testbed's delay relay. Hierarchical rows (``--hier-sizes``, link ``hier``): two regions of
two peers each, hosts on ``--hier-host-rate`` links behind a region uplink of ``--rate`` with the same round trip
(the testbed of bench/utilization.py, where diloco's round is hierarchical): p2ptrain peers announce their region
and run the round cell by cell (net/hierarchy.py), hivemind's averager runs its flat butterfly. Their ideal is
``payload / rate``: what must leave a region, at the least, for every member to hold the exact mean.

Goodput fraction = ideal / measured, where the ideal is ``2(k−1)/k · payload / rate``:
in a butterfly (or ring) all-reduce each peer sends and receives 2(k−1)/k of the
vector, and each peer is behind its own link of ``rate`` each way. The measured time
of a round is the slowest peer's all-reduce (from its own start to its result); the
table shows the median over repeats. The same fraction against the bulk TCP goodput
of one link, measured in the same run, is shown too: TCP/IP headers alone keep TCP
below ~0.956 of a tbf rate at MTU 1500 (hier rows: of four bulk flows crossing the uplinks at once, two each way,
the traffic of their cross step: ~0.8 of the rate here, bench/testbed.py ``measure_flows``). Every result is checked against the exact
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
    # A worker of a system@base: the p2ptrain package of an older checkout (see --base), the bench code of this one.
    if _tree := os.environ.get("P2PTRAIN_LINK_TREE"):
        sys.path.insert(0, _tree)

from bench.harness import DIRECT_PORT  # a peer's direct path: its libp2p port + this (relayed between regions)
from bench.testbed import (
    RegionSpec,
    Testbed,
    TestbedSpec,
    measure_flows,
    measure_throughput,
    parse_rate,
    unavailable_reason,
)

RESULTS = Path(__file__).parent / "results"
MB = 1_000_000  # payload sizes are decimal MB, like link rates in Mbit/s
PORT = 31400
_cases = 0


# ---------------------------------------------------------------------------------------------- workers
def _values(rank: int, n: int) -> Any:
    """Peer ``rank``'s vector: exactly representable values, so the exact mean is known."""
    import torch

    return torch.full((n,), float(rank + 1), dtype=torch.float32)


BASE = "@base"  # a system's suffix: its peers run the p2ptrain package of the --base checkout
SYSTEMS = ("p2ptrain", "p2ptrain-plain", "p2ptrain-libp2p", "p2ptrain-libp2p-plain", "p2ptrain-mplex",
           "p2ptrain-mplex-plain", "p2ptrain-cubic", "p2ptrain-bbr", "p2ptrain-plain-cubic", "p2ptrain-plain-bbr",
           "p2ptrain-noaudit",
           "hivemind")


def _variant(system: str) -> dict[str, Any]:
    """A p2ptrain system's settings: ``p2ptrain`` is the default peer (yamux, verified aggregation, direct path with
    its default congestion control, CUBIC; ``-cubic``/``-bbr``: the direct path's connections on that one).
    ``-noaudit``: verified, but no random audit of a slice (what the audits cost, apart from the claims and their
    checks). ``@base``: the same settings on the package of ``--base`` (those it has)."""
    try:
        from p2ptrain.net.congestion import DEFAULT_CONGESTION
    except ImportError:  # a @base checkout older than the direct path
        DEFAULT_CONGESTION = "cubic"

    words = system.removesuffix(BASE).split("-")[1:]
    return {"muxer": "mplex" if "mplex" in words else "yamux", "verify": "plain" not in words,
            "direct": "libp2p" not in words and "mplex" not in words,
            "congestion": next((w for w in words if w in ("cubic", "bbr")), DEFAULT_CONGESTION),
            "audit": {"audit_rate": 0.0} if "noaudit" in words else {}}


def _known(cls: Any, **kw: Any) -> dict[str, Any]:
    """The keyword arguments the dataclass ``cls`` has fields for (a @base checkout may lack newer ones)."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in kw.items() if k in names}


def _max_err(t: Any, expect: float, step: int = 1 << 20) -> float:
    """max |t − expect|, a slice at a time: two temporaries of the whole 256 MB vector in every worker held more than
    the all-reduce itself (8 × 256 MB did not fit beside the other systems' workers)."""
    return max((float((t[i : i + step] - expect).abs().max()) for i in range(0, t.numel(), step)), default=0.0)


def _peak_mb(*pids: int) -> float:
    """The peak resident memory (VmHWM) of these processes, summed, in MB (0 for one that is gone)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
    return total / MB


def _emit(rec: dict[str, Any]) -> None:
    print("RESULT " + json.dumps(rec), flush=True)


def _turn(path: Path, want: str, timeout: float = 900.0) -> None:
    """Block until the driver writes ``want`` into ``path`` (the repeat whose turn it is; ``end``: leave)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            got = path.read_text().strip()
            if got == want or got == "end":
                return
        time.sleep(0.01)
    raise TimeoutError(f"turn {want!r} not given in {timeout:.0f} s")


async def _p2ptrain_worker(a: argparse.Namespace, initial: list[str]) -> None:
    from p2ptrain.collective.codecs import get_codec
    from p2ptrain.net.hierarchy import hierarchical_allreduce, plan_for
    from p2ptrain.net.swarm import HivemindTransport, SwarmConfig
    from p2ptrain.net.transport import JoinRequest, PeerInfo, RoundFailed

    v = _variant(a.system)
    cfg = SwarmConfig(**_known(SwarmConfig, run_id=a.run_id, initial_peers=initial, host_maddrs=[a.listen],
                               announce_maddrs=[a.announce], join_window=60.0, ttl=3600.0, recontact_every=3600.0,
                               muxer=v["muxer"], verify=v["verify"], direct=v["direct"],
                               direct_port=int(a.listen.rsplit("/", 1)[1]) + DIRECT_PORT,
                               direct_congestion=v["congestion"], **v["audit"]))
    tr = await HivemindTransport.create(cfg)
    try:
        if a.rank == 0:
            text = "\n".join(await tr.visible_maddrs()) + "\n"
            await asyncio.to_thread(Path(a.maddrs).write_text, text)
        await tr.announce(PeerInfo(**_known(PeerInfo, peer_id=tr.peer_id, region=a.region)))
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
            if rep >= 0:
                await asyncio.to_thread(_turn, Path(a.turns), f"{a.system}:{rep}")
            t0 = time.monotonic()
            try:
                group = await tr.form_group(JoinRequest(key=f"r{rep}", peer_id=tr.peer_id, weight=1.0, fragment=0,
                                                        region=a.region), None, timeout=120)
                t1 = time.monotonic()
                # cell by cell when the members announce regions of two or more (the hier rows), else the flat one
                plan = plan_for(group, tr.peer_id)
                res = await (tr.allreduce(group, 0, [v], 1.0, codec, timeout=timeout) if plan is None else
                             hierarchical_allreduce(tr, group, plan, 0, [v], 1.0, codec, timeout=timeout))
            except RoundFailed as e:  # a round that failed here is recorded as such, and the next repeat runs
                print(f"repeat {rep}: {e}", file=sys.stderr, flush=True)
                if rep >= 0:
                    _emit({"rep": rep, "group_s": time.monotonic() - t0, "allreduce_s": 0.0, "members": 0,
                           "partial": True, "max_err": float("inf"), "failed": str(e)[:300]})
                else:  # a warm-up that failed is still done: the harness waits for this word, the repeats follow
                    print("READY", flush=True)
                continue
            t2 = time.monotonic()
            err = _max_err(res.tensors[0], expect)
            if rep >= 0:
                _emit({"rep": rep, "group_s": t1 - t0, "allreduce_s": t2 - t1, "members": len(group.members),
                       "partial": res.partial, "max_err": err, "timeline": getattr(res, "timeline", None),
                       "verify_s": getattr(res, "verify_seconds", 0.0), "verify_bytes": getattr(res, "verify_bytes", 0),
                       "audits": getattr(res, "verify_audits", 0), "peak_mb": _peak_mb(os.getpid()),
                       "hierarchical": len(set(group.region_of().values())) > 1})
            else:
                print("READY", flush=True)
            del res  # (checked: not held while the next round runs, which would count it in that round's peak)
        await asyncio.to_thread(_turn, Path(a.turns), "end")
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
        print("READY", flush=True)
        for rep in range(a.repeats):
            with avg.get_tensors() as ts:
                ts[0].copy_(_values(a.rank, n))
            _turn(Path(a.turns), f"{a.system}:{rep}")
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
            try:
                group = ctl.result(timeout=timeout + 10)
            except Exception as e:  # its own failure: recorded as a round that did not average, the next one runs
                print(f"repeat {rep}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                group = None
            t2 = time.monotonic()
            with avg.get_tensors() as ts:
                err = _max_err(ts[0], expect)
            _emit({"rep": rep, "group_s": t1 - t0, "allreduce_s": t2 - t1, "matchmaking_attempts": attempt,
                   "peak_mb": _peak_mb(os.getpid(), avg.pid),  # (the averager is a process of its own)
                   "members": 0 if group is None else len(group), "partial": group is None, "max_err": err})
        _turn(Path(a.turns), "end")
    finally:
        if avg is not None:
            avg.shutdown()
        dht.shutdown()


def _worker(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    for name, kind in (("system", str), ("rank", int), ("k", int), ("size", float), ("repeats", int),
                       ("ideal", float), ("listen", str), ("announce", str), ("maddrs", str), ("run_id", str),
                       ("turns", str), ("region", str)):
        ap.add_argument(f"--{name.replace('_', '-')}", type=kind, required=True)
    a = ap.parse_args(argv)
    initial: list[str] = []
    if a.rank > 0:
        from p2ptrain.procs import wait_lines

        initial = wait_lines(Path(a.maddrs), 120)
    if a.system.startswith("p2ptrain"):
        import logging

        import uvloop

        from p2ptrain.ui import setup_logging

        # The peers' own logs (event=carried …) in the case's log files at P2PTRAIN_LOG_LEVEL; without it, warnings
        # and how each round's group formed (a round that failed to form leaves its story in the case's log tail,
        # which a failed case's JSON holds).
        setup_logging()
        if not os.environ.get("P2PTRAIN_LOG_LEVEL"):
            for name in ("p2ptrain.net.groups", "p2ptrain.net.swarm"):
                logging.getLogger(name).setLevel(logging.INFO)
        uvloop.run(_p2ptrain_worker(a, initial))
    else:
        _hivemind_worker(a, initial)


# ---------------------------------------------------------------------------------------------- driver
def _records(log: Path) -> dict[int, dict[str, Any]]:
    recs = [json.loads(line[7:]) for line in log.read_text(errors="replace").splitlines() if line.startswith("RESULT ")]
    return {r["rep"]: r for r in recs}


def _ready(log: Path) -> bool:
    return any(line == "READY" for line in log.read_text(errors="replace").splitlines())


def run_case(tb: Testbed, systems: list[str], k: int, size: float, repeats: int, rate: float, work: Path,
             hosts: list[str] | None = None, label: str = "lan", base: str | None = None) -> list[dict[str, Any]]:
    """Start k peers of every system in the testbed's hosts at once, then give the systems their repeats in
    turn (A B A B …: the machine's load drifts over a run, and each system sees the same drift); per system
    and repeat the slowest peer's times and the load average when the repeat began. ``rate``: each host's link
    (lan, wan), or each region's uplink (hier: the peers announce their regions)."""
    ideal = (1.0 if label == "hier" else 2 * (k - 1) / k) * size * MB * 8 / rate
    hosts = hosts or tb.hosts[:k]
    global _cases
    _cases += 1
    turns = work / f"case{_cases}-{os.getpid()}.turn"
    turns.write_text("start")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HIVEMIND_LOGLEVEL": "ERROR"}
    procs: dict[str, list[subprocess.Popen[bytes]]] = {}
    logs: dict[str, list[Path]] = {}
    runs: dict[str, str] = {}
    for si, system in enumerate(systems):
        run_id = runs[system] = f"link-{system}-{label}-{k}-{size:g}-{os.getpid()}-{_cases}"
        maddrs = work / f"{run_id}.maddrs"
        # A fresh port per case and system: no clash with lingering sockets of the case before.
        port = PORT + 10 * _cases + si
        procs[system], logs[system] = [], []
        for rank, host in enumerate(hosts):
            listen, announce = tb.maddrs(host, port)
            if system.startswith("p2ptrain") and _variant(system)["direct"]:  # (a @base without it: unused)
                tb.expose(host, port + DIRECT_PORT)  # the direct path crosses regions through the relay too
            log = work / f"{run_id}.{rank}.log"
            logs[system].append(log)
            cmd = [sys.executable, str(Path(__file__).resolve()), "_worker", "--system", system,
                   "--rank", str(rank), "--k", str(k), "--size", str(size), "--repeats", str(repeats),
                   "--ideal", str(ideal), "--listen", listen[0], "--announce", announce[0], "--maddrs", str(maddrs),
                   "--run-id", run_id, "--turns", str(turns),
                   "--region", tb.spec.region_of(host).name if label == "hier" else ""]
            penv = {**env, "P2PTRAIN_LINK_TREE": base} if system.endswith(BASE) and base else env
            procs[system].append(tb.run(host, cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=penv))
            if rank == 0:
                from p2ptrain.procs import wait_lines

                wait_lines(maddrs, 120, procs[system][0])
    every = [p for ps in procs.values() for p in ps]
    errors: dict[str, str] = {}
    loads: dict[str, dict[int, float]] = {system: {} for system in systems}

    def alive(system: str) -> bool:
        return all(p.poll() is None for p in procs[system])

    deadline = time.monotonic() + 240
    while not all(_ready(log) for ls in logs.values() for log in ls) and time.monotonic() < deadline:
        if not all(alive(s) for s in systems):
            break
        time.sleep(0.2)
    for system in systems:
        if not all(_ready(log) for log in logs[system]):
            errors[system] = "not ready after 240 s"
    for rep in range(repeats):
        for system in systems if rep % 2 == 0 else systems[::-1]:  # A B, B A, …: neither always goes first
            if system in errors:
                continue
            loads[system][rep] = os.getloadavg()[0]
            turns.write_text(f"{system}:{rep}")
            limit = time.monotonic() + 120 + 20 * ideal
            while time.monotonic() < limit and alive(system):
                if all(rep in _records(log) for log in logs[system]):
                    break
                time.sleep(0.05)
            else:
                errors[system] = f"repeat {rep} did not finish" + ("" if alive(system) else " (a peer exited)")
    turns.write_text("end")
    for p in every:
        try:
            p.wait(max(1.0, 60.0))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
    out = []
    for system in systems:
        per_peer = [_records(log) for log in logs[system]]
        failed = [i for i, p in enumerate(procs[system]) if p.returncode != 0]
        reps = []
        for rep in range(repeats):
            got = [pp[rep] for pp in per_peer if rep in pp]
            if len(got) < k:
                continue
            reps.append({"allreduce_s": max(r["allreduce_s"] for r in got),
                         "group_s": max(r["group_s"] for r in got),
                         "round_s": max(r["group_s"] + r["allreduce_s"] for r in got),
                         "members": min(r["members"] for r in got), "partial": any(r["partial"] for r in got),
                         "max_err": max(r["max_err"] for r in got), "load": loads[system].get(rep),
                         "timeline": max(got, key=lambda r: r["allreduce_s"]).get("timeline"),  # the slowest's
                         "hierarchical": all(r.get("hierarchical", False) for r in got),
                         # verified rounds: chunk audits drawn by any member (each fetches one chunk of every
                         # contribution to a part; every member waits for its verdict), and the slowest judging
                         "audits": sum(r.get("audits", 0) for r in got),
                         "verify_s": max(r.get("verify_s", 0.0) for r in got),
                         "peak_mb": max(r.get("peak_mb", 0.0) for r in got)})  # the largest peer's, so far
        case: dict[str, Any] = {"system": system, "link": label, "peers": k, "size_mb": size, "ideal_s": ideal,
                                "repeats": reps, "failed_ranks": failed}
        if system in errors or failed or len(reps) < repeats:
            tail = logs[system][failed[0] if failed else 0].read_text(errors="replace")[-1500:]
            case["error"] = f"{errors.get(system, '')}; ranks {failed} failed or results missing; log tail:\n{tail}"
        ok = [r for r in reps if r["max_err"] < 1e-5 and not r["partial"] and r["members"] == k]
        if ok:
            times = sorted(r["allreduce_s"] for r in ok)
            t = statistics.median(times)
            case |= {"allreduce_s": t, "goodput": ideal / t, "goodput_min": ideal / times[-1],
                     "goodput_max": ideal / times[0], "group_s": statistics.median(r["group_s"] for r in ok),
                     "round_s": statistics.median(r["round_s"] for r in ok), "correct_rounds": len(ok)}
        if reps:
            case["peak_mb"] = max(r["peak_mb"] for r in reps)
        out.append(case)
    return out


def _plot(cases: list[dict[str, Any]], path: Path) -> None:
    from p2ptrain.plot import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = {"hivemind": "--s", "p2ptrain": "-o", "p2ptrain-plain": "-.D", "p2ptrain-mplex": ":^",
              "p2ptrain-mplex-plain": ":v", "p2ptrain-libp2p": ":o", "p2ptrain-libp2p-plain": ":D",
              "p2ptrain-cubic": "-^", "p2ptrain-bbr": "-v", "p2ptrain-plain-cubic": "-.^", "p2ptrain-plain-bbr": "-.v"}
    for system in sorted({c["system"] for c in cases}):
        style = styles.get(system.removesuffix(BASE), "-x")  # (a @base system: its peer's style, drawn fainter)
        for link in ("lan", "wan", "hier"):
            for k in sorted({c["peers"] for c in cases}):
                row = sorted((c["size_mb"], c["goodput"], c["goodput_min"], c["goodput_max"]) for c in cases
                             if c["system"] == system and c["peers"] == k and c["link"] == link and "goodput" in c)
                if row:
                    x, y = [p[0] for p in row], [p[1] for p in row]
                    err = [[p[1] - p[2] for p in row], [p[3] - p[1] for p in row]]
                    ax.errorbar(x, y, yerr=err, fmt=style, capsize=2,
                                alpha=0.6 if link == "wan" or system.endswith(BASE) else 1.0,
                                label=f"{system}, {k} peers" + {"lan": "", "wan": ", across regions",
                                                                 "hier": ", 2 regions × 2"}[link])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("payload (MB, fp32)")
    ax.set_ylabel("goodput / link rate")
    ax.axhline(0.95, color="grey", lw=0.5)
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("all-reduce goodput on shaped links (median, range of repeats)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        _worker(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default="2,4,8", help="comma-separated group sizes k")
    ap.add_argument("--sizes", default="1,4,16,64,256", help="comma-separated payloads in MB (fp32)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rate", default="100mbit", help="each peer's link, both directions (tc units)")
    ap.add_argument("--systems", default="p2ptrain,hivemind")
    ap.add_argument("--max-total-mb", type=float, default=1024.0,
                    help="skip cases with peers × size above this (memory: every peer holds a few copies)")
    ap.add_argument("--big", default="",
                    help="MB:SYSTEMS: cases with peers × size above MB run only these systems (e.g. 1024:p2ptrain,"
                         "hivemind: eight peers of three systems at 256 MB each do not fit 24 GiB)")
    ap.add_argument("--wan-rtt-ms", type=float, default=100.0,
                    help="rows across two regions (one peer each) with this round-trip time; 0: none")
    ap.add_argument("--wan-sizes", default="16,64", help="payloads (MB) of the rows across regions")
    ap.add_argument("--hier-sizes", default="",
                    help="payloads (MB) of the rows of 2 regions × 2 peers behind shared uplinks of --rate (link hier)")
    ap.add_argument("--hier-host-rate", default="1gbit", help="each host's link in the hier rows (tc units)")
    ap.add_argument("--base", type=Path, default=None,
                    help="a checkout (e.g. a git worktree of an older commit, its bench/ removed) whose p2ptrain "
                         "package the systems named SYSTEM@base run: before and after in one run, in turn")
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
    if any(s.endswith(BASE) for s in systems) and args.base is None:
        raise SystemExit(f"systems ending in {BASE} need --base (a checkout whose p2ptrain package they run)")
    if args.base is not None and not (args.base / "p2ptrain" / "__init__.py").is_file():
        raise SystemExit(f"--base {args.base}: no p2ptrain package there")
    if args.base is not None and (args.base / "bench").exists():
        raise SystemExit(f"--base {args.base}: remove its bench/ (the workers take this checkout's bench code)")
    if bad := {s.removesuffix(BASE) for s in systems} - set(SYSTEMS):
        raise SystemExit(f"unknown systems {sorted(bad)}: choose among {', '.join(SYSTEMS)} (-mplex: the daemon's "
                         "mplex muxer; -libp2p: no direct path; -plain: without verified aggregation, as hivemind's "
                         "averager)")
    if min(peers) < 2 or args.repeats < 1:
        raise SystemExit("--peers must be ≥ 2 and --repeats ≥ 1")
    big_mb, big_systems = float("inf"), systems
    if args.big:
        limit, _, names = args.big.partition(":")
        try:
            big_mb = float(limit)
        except ValueError:
            raise SystemExit("--big takes MB:SYSTEMS, e.g. 1024:p2ptrain,hivemind") from None
        big_systems = [x for x in names.split(",") if x]
        if not big_systems or not set(big_systems) <= set(systems):
            raise SystemExit(f"--big: its systems must be some of --systems ({', '.join(systems)})")
    plan = [(k, s) for k in peers for s in sizes if k * s <= args.max_total_mb]
    skipped = [(k, s) for k in peers for s in sizes if k * s > args.max_total_mb]
    wan_plan = [(2, s) for s in (float(x) for x in args.wan_sizes.split(",") if x)] if args.wan_rtt_ms > 0 else []
    hier_plan = [(4, s) for s in (float(x) for x in args.hier_sizes.split(",") if x)]
    hier_host = parse_rate(args.hier_host_rate)
    if hier_plan and (hier_host is None or args.wan_rtt_ms <= 0):
        raise SystemExit("--hier-sizes needs --hier-host-rate as a rate (e.g. 1gbit) and --wan-rtt-ms > 0")
    cases: list[dict[str, Any]] = []
    tcp: dict[str, float] = {}
    work = Path(tempfile.mkdtemp(prefix="p2ptrain-link-"))
    t_start, load_before = time.time(), os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save(done: bool = False) -> None:  # after every case: a run cut short keeps what it measured
        result = {"rate_bits": rate, "repeats": args.repeats, "cases": cases, "tcp_bits": tcp,
                  "skipped": skipped, "seconds": time.time() - t_start, "complete": done,
                  "load_average": {"before": load_before, "after": os.getloadavg()},
                  "command": "python bench/link.py " + " ".join(sys.argv[1:]), "machine": _machine()}
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    with Progress(console=console) as prog:
        task = prog.add_task("cases", total=len(plan) + len(wan_plan) + len(hier_plan))
        legs: list[tuple[str, TestbedSpec, list[tuple[int, float]]]] = []
        for k in peers:
            if todo := [(kk, s) for kk, s in plan if kk == k]:
                legs.append((f"lan{k}", TestbedSpec(regions=(RegionSpec(name="lan", hosts=k, host_rate=rate),)), todo))
        if wan_plan:  # one peer per region; each region's uplink adds a quarter of the RTT each way
            d = args.wan_rtt_ms / 4
            legs.append(("wan", TestbedSpec(regions=(RegionSpec(name="us", hosts=1, host_rate=rate, delay_ms=d),
                                                     RegionSpec(name="eu", hosts=1, host_rate=rate, delay_ms=d))),
                         wan_plan))
        if hier_plan:  # two regions of two hosts; the uplinks are --rate, each adds a quarter of the RTT each way
            d = args.wan_rtt_ms / 4
            legs.append(("hier", TestbedSpec(regions=tuple(
                RegionSpec(name=r, hosts=2, host_rate=hier_host, uplink_rate=rate, delay_ms=d) for r in ("us", "eu"))),
                hier_plan))
        for name, spec, todo in legs:
            with Testbed(spec) as tb:
                if name == "hier":  # the cross step's flows: a carrier each way per shard, both ways at once
                    us0, us1, eu0, eu1 = tb.hosts
                    flows = measure_flows(tb, [(us0, eu0), (us1, eu1), (eu0, us0), (eu1, us1)], nbytes=16 * MB)
                    tcp[name] = min(flows.values())
                else:
                    tcp[name] = measure_throughput(tb, tb.hosts[0], tb.hosts[1], nbytes=16 * MB)["bits_per_s"]
                for k, size in todo:
                    these = big_systems if k * size > big_mb else systems
                    prog.update(task, description=f"{name}: k={k} {size:g} MB, {'/'.join(these)} in turn")
                    for case in run_case(tb, these, k, size, args.repeats, rate, work,
                                         label=name if name in ("wan", "hier") else "lan",
                                         base=None if args.base is None else str(args.base.resolve())):
                        case["tcp_bits"] = tcp[name]
                        cases.append(case)
                        if "error" in case:
                            console.print(f"[red]{case['system']} {name} k={k} {size:g} MB: {case['error']}")
                    save()
                    prog.advance(task)
    save(done=True)
    if any("goodput" in c for c in cases):
        _plot(cases, args.out.with_suffix(".png"))
    out.print(f"wrote {args.out}" + (f"; skipped (peers × MB > {args.max_total_mb:g}): {skipped}" if skipped else ""))
    rows = []
    for c in cases:
        g = c.get("goodput")
        rival = [o for o in cases if o is not c and o["link"] == c["link"] and o["peers"] == c["peers"]
                 and o["size_mb"] == c["size_mb"] and "goodput" in o]
        rows.append([c["system"], c["link"], c["peers"], f"{c['size_mb']:g}", f"{c['ideal_s']:.2f}",
                     f"{c['allreduce_s']:.2f}" if g else "failed", f"{g:.3f}" if g else "-",
                     f"{c['goodput_min']:.3f}–{c['goodput_max']:.3f}" if g else "-",
                     f"{g * rate / c['tcp_bits']:.3f}" if g else "-", _verdict(c, rival),
                     f"{c['group_s']:.2f}" if g else "-", f"{c.get('correct_rounds', 0)}/{args.repeats}",
                     f"{c['peak_mb']:.0f}" if "peak_mb" in c else "-"])
    out.print(table(f"all-reduce goodput, each peer behind its own {rate / 1e6:g} Mbit/s link, systems in turn "
                    f"(ideal = 2(k−1)/k · payload / rate; median and range of {args.repeats} repeats; TCP goodput of "
                    "one link: " + ", ".join(f"{k}: {v / 1e6:.1f}" for k, v in tcp.items()) + " Mbit/s)",
                    ["system", "link", "peers", "MB", "ideal s", "all-reduce s", "of rate", "range", "of TCP",
                     "vs others", "group s", "ok", "peak MB a peer"], rows))


def _verdict(c: dict[str, Any], rivals: list[dict[str, Any]]) -> str:
    """``ahead``/``behind`` only when the ranges of the repeats separate; else ``overlap``."""
    if "goodput" not in c or not rivals:
        return "-"
    if all(c["goodput_min"] > r["goodput_max"] for r in rivals):
        return "ahead"
    if all(c["goodput_max"] < r["goodput_min"] for r in rivals):
        return "behind"
    return "overlap"


def _machine() -> dict[str, Any]:
    import platform

    import torch

    return {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "kernel": platform.release()}


if __name__ == "__main__":
    main()
