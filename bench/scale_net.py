"""Scale, network only: k real libp2p peers in one process all-reduce a synthetic fragment, round after round.

    python bench/scale_net.py                                      # k = 2,4,8,16,32; 1 and 2 regions; 5 rounds
    python bench/scale_net.py --peers 8,32 --regions 1,4 --rounds 3 --numel 4194304

Every peer is a real :class:`~p2ptrain.net.swarm.HivemindTransport` with its own identity and its own p2pd
daemon, on 127.0.0.1; the k transports share this Python process and its event loop (32 training processes of
~700 MB each do not fit in 24 GiB; a transport without a model does); each (k, R) runs in a fresh worker process, so
that the memory it reports is its own. They announce themselves (region
``r{i mod R}``: round-robin over ``--regions`` R), wait until every one sees all k, then run ``--rounds`` rounds:
every transport forms the round's group (``JoinRequest(key="r{n}", region=...)``) concurrently, then all-reduces
its own seeded random fragment of ``--numel`` values with its weight (1, 1.5 or 2) through the codec: flat
(``Transport.allreduce``) or, when the group spans two or more regions with one of them holding two members,
hierarchical (``plan_for`` / ``hierarchical_allreduce``): the dispatch of ``sync.RoundRunner._drive``.

θ agreement, per round: every member's result is bitwise equal to every other member's (``torch.equal``) and within
``--tolerance`` of the float64 weighted mean of the contributors' fragments, computed here. Reported per (k, R): the
round time (first ``form_group`` call to the last member's result: median and max over rounds; also the median
member's group-forming and all-reduce seconds), rounds completed / partial (someone dropped or a part zeroed) /
failed (some member raised), payload bytes sent per peer per round (``ReduceResult.bytes_sent``), agreement, and
memory: this process's resident memory plus the sum of its p2pd daemons' (peak over the run, sampled every
second), divided by k; both parts are also recorded alone. Writes bench/results/scale_net.json after every
(k, R), prints a table and plots scale_net.png (round time and memory per peer against k). All transports are
closed at once in ``finally``, waiting at most ``close_timeout`` (90 s): a close still running then is recorded with
its coroutine stacks (``close_hung``), and the daemons this process started are checked gone (any left is killed by
its pid: ``daemons_left``).
The transports' INFO log (dropped members, failed sends, fallbacks) goes to ``--log`` (default: a file in /tmp).

The machine is shared (2 cores): the load average is recorded before and after every (k, R), and every wait is
bounded (``--join-timeout``, ``--round-timeout``, ``--settle-timeout``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import RESULTS, exit_on_sigterm, rss_mb, write_json

__all__ = ["NetScaleConfig", "daemon_pids", "run_net", "run_net_sync"]

log = logging.getLogger("bench.scale_net")


@dataclass(kw_only=True)
class NetScaleConfig:
    """One swarm of the benchmark: ``k`` transports in ``regions`` regions, ``rounds`` rounds of ``numel`` values."""

    k: int
    regions: int = 1
    rounds: int = 5
    numel: int = 1 << 20
    codec: str = "fp32"
    join_window: float = 30.0  # the leader closes as soon as every live peer joined; this is only the cap
    join_timeout: float = 120.0  # one form_group call
    round_timeout: float = 240.0  # one all-reduce (flat or hierarchical), bounds its every wait
    settle_timeout: float = 120.0  # until every peer sees all k announcements
    start_batch: int = 4  # daemons started at once
    ttl: float = 120.0  # announcements live this long; a heartbeat refreshes them every ttl/4
    tolerance: float = 1e-5
    verify: bool = True  # verified aggregation (SwarmConfig.verify, the default of a real run)
    close_timeout: float = 90.0  # closing all transports (each close bounds its own steps, but see _close_all)
    seed: int = 0
    run_id: str = field(default_factory=lambda: f"scalenet-{os.getpid()}-{time.monotonic_ns() % 10**6}")


# ---------------------------------------------------------------------------------------------- processes, memory
def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError):
                out += [int(c) for c in (task / "children").read_text().split()]
    return out


def daemon_pids(pid: int | None = None) -> list[int]:
    """The p2pd daemons among the children of ``pid`` (this process by default): the ones it started."""
    found = []
    for c in _children(os.getpid() if pid is None else pid):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{c}/comm").read_text().strip() == "p2pd":
                found.append(c)
    return sorted(found)


@dataclass
class _Memory:
    """Peak resident memory of this process and of the sum of its daemons, sampled."""

    python_mb: float = 0.0
    daemons_mb: float = 0.0
    total_mb: float = 0.0
    daemons: int = 0

    def sample(self) -> None:
        py = rss_mb(os.getpid())
        pids = daemon_pids()
        dm = sum(rss_mb(p) for p in pids)
        self.python_mb, self.daemons_mb = max(self.python_mb, py), max(self.daemons_mb, dm)
        self.total_mb, self.daemons = max(self.total_mb, py + dm), max(self.daemons, len(pids))

    async def every(self, seconds: float) -> None:
        while True:
            self.sample()
            await asyncio.sleep(seconds)


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ---------------------------------------------------------------------------------------------- one round
def _fragment(cfg: NetScaleConfig, rnd: int, i: int) -> Any:
    import torch

    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + rnd * 10_007 + i)
    return torch.randn(cfg.numel, generator=gen)


def _weight(i: int) -> float:
    return 1.0 + 0.5 * (i % 3)


async def _member(t: Any, cfg: NetScaleConfig, key: str, region: str, x: Any, w: float, codec: Any) -> dict[str, Any]:
    """One member's round: form the group, then the flat or the hierarchical all-reduce (as sync.RoundRunner)."""
    from p2ptrain.net.hierarchy import allreduce, plan_for
    from p2ptrain.net.transport import JoinRequest

    t0 = time.monotonic()
    rec: dict[str, Any] = {"peer": t.peer_id}
    try:
        group = await t.form_group(JoinRequest(key=key, peer_id=t.peer_id, weight=w, fragment=0, region=region),
                                   None, timeout=cfg.join_timeout)
        rec |= {"group_seconds": time.monotonic() - t0, "members": len(group.members)}
        plan = plan_for(group, t.peer_id)
        rec["mode"] = "flat" if plan is None else "hierarchical"
        res = await allreduce(t, group, plan, 0, [x], w, codec, timeout=cfg.round_timeout)
    except Exception as e:  # RoundFailed, TimeoutError, a broken stream, or a bug: recorded, the round fails
        return rec | {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - t0}
    return rec | {"result": res, "seconds": time.monotonic() - t0, "reduce_seconds": res.seconds,
                  "bytes_sent": res.bytes_sent, "bytes_received": res.bytes_received, "partial": res.partial}


def _check(cfg: NetScaleConfig, xs: list[Any], ids: list[str], recs: list[dict[str, Any]]) -> dict[str, Any]:
    """θ agreement of the members that returned: bitwise equal results, equal to the float64 weighted mean of the
    contributors' fragments (within the tolerance). The contributors are the union of what the members report: a
    hierarchical round's member reports only its region and its shards' carriers (see the module docstring)."""
    import torch

    done = [r for r in recs if "result" in r]
    if not done:
        return {"bitwise_equal": False, "max_abs_error": float("nan"), "contributors": 0, "reported": [0, 0]}
    ref = done[0]["result"].tensors[0]
    equal = all(torch.equal(r["result"].tensors[0], ref) for r in done)
    index = {p: i for i, p in enumerate(ids)}
    contrib = sorted({index[p] for r in done for p in r["result"].contributors if p in index})
    total = sum(_weight(i) for i in contrib)
    exp = torch.zeros(cfg.numel, dtype=torch.float64)
    for i in contrib:
        exp.add_(xs[i].double(), alpha=_weight(i))
    exp /= total
    err = max(float((r["result"].tensors[0].double() - exp).abs().max()) for r in done)
    reported = [len(r["result"].contributors) for r in done]
    out: dict[str, Any] = {"bitwise_equal": equal, "max_abs_error": err, "contributors": len(contrib),
                           "reported": [min(reported), max(reported)]}
    if not equal or err > cfg.tolerance or any(r["result"].partial for r in done):
        out["members"] = [_diagnose(cfg, r, exp, ref, ids) for r in done]
    return out


def _diagnose(cfg: NetScaleConfig, rec: dict[str, Any], exp: Any, ref: Any, ids: list[str]) -> dict[str, Any]:
    """One member of a round that went wrong: what it reports, and which parts of its result (the flat butterfly's
    part bounds over the group) are off the float64 mean or differ from the first member's."""
    from p2ptrain.collective.butterfly import part_bounds

    res = rec["result"]
    got = res.tensors[0]
    bad, differ = [], []
    for j, (lo, hi) in enumerate(part_bounds(cfg.numel, rec["members"])):
        e = float((got[lo:hi].double() - exp[lo:hi]).abs().max()) if hi > lo else 0.0
        if e > cfg.tolerance:
            bad.append([j, e, bool((got[lo:hi] == 0).all())])
        if not bool((got[lo:hi] == ref[lo:hi]).all()):
            differ.append(j)
    return {"peer": ids.index(rec["peer"]), "id": rec["peer"][-8:], "partial": res.partial,
            "divergent": res.divergent, "contributors": len(res.contributors), "total_weight": res.total_weight,
            "liars": list(res.liars), "bytes_sent": res.bytes_sent, "bytes_received": res.bytes_received,
            "timeline": {k: round(v, 3) for k, v in res.timeline.items()},
            "parts_off_mean": bad, "parts_differing_from_first": differ}


async def _round(ts: list[Any], cfg: NetScaleConfig, rnd: int, regions: list[str], codec: Any) -> dict[str, Any]:
    ids = [t.peer_id for t in ts]
    xs = [_fragment(cfg, rnd, i) for i in range(len(ts))]
    t0 = time.monotonic()
    recs = list(await asyncio.gather(*(_member(t, cfg, f"r{rnd}", regions[i], xs[i], _weight(i), codec)
                                       for i, t in enumerate(ts))))
    wall = time.monotonic() - t0
    check = await asyncio.to_thread(_check, cfg, xs, ids, recs)
    done = [r for r in recs if "result" in r]
    errors = [r["error"] for r in recs if "error" in r]
    if errors:
        outcome = "failed"
    elif any(r["partial"] for r in done) or any(r["members"] < len(ts) for r in done):
        outcome = "partial"
    else:
        outcome = "completed"
    agree = bool(done) and check["bitwise_equal"] and check["max_abs_error"] <= cfg.tolerance

    def med(key: str) -> float:
        vals = [r[key] for r in done if key in r]
        return statistics.median(vals) if vals else float("nan")

    return {"round": rnd, "outcome": outcome, "agree": agree, "seconds": wall, "members_done": len(done),
            "modes": sorted({r["mode"] for r in recs if "mode" in r}),
            "group_seconds_median": med("group_seconds"), "reduce_seconds_median": med("reduce_seconds"),
            "bytes_sent_mean": statistics.fmean(r["bytes_sent"] for r in done) if done else float("nan"),
            "bytes_sent_max": max((r["bytes_sent"] for r in done), default=0),
            "bytes_received_mean": statistics.fmean(r["bytes_received"] for r in done) if done else float("nan"),
            "errors": errors[:5], "error_count": len(errors), **check}


# ---------------------------------------------------------------------------------------------- one swarm
async def _start(cfg: NetScaleConfig, started: list[Any]) -> None:
    """Start the k transports into ``started`` (the first is everyone's initial peer): it holds every transport
    created, also when a later one failed (the caller closes them all)."""
    from p2ptrain.net.swarm import HivemindTransport, SwarmConfig

    def conf(initial: list[str]) -> SwarmConfig:
        return SwarmConfig(run_id=cfg.run_id, initial_peers=initial, join_window=cfg.join_window, ttl=cfg.ttl,
                           verify=cfg.verify, dht_timeout=60.0)

    first = await asyncio.wait_for(HivemindTransport.create(conf([])), 120)
    started.append(first)
    maddrs = await first.visible_maddrs()
    left = cfg.k - 1
    while left > 0:
        n = min(cfg.start_batch, left)
        made = await asyncio.gather(*(asyncio.wait_for(HivemindTransport.create(conf(maddrs)), 120) for _ in range(n)),
                                    return_exceptions=True)
        started += [t for t in made if not isinstance(t, BaseException)]
        for e in made:
            if isinstance(e, BaseException):
                raise RuntimeError(f"a transport did not start: {type(e).__name__}: {e}") from e
        left -= n


async def _settle(ts: list[Any], cfg: NetScaleConfig, regions: list[str]) -> float:
    """Announce every peer; wait until every one sees all k (RuntimeError after ``settle_timeout``)."""
    from p2ptrain.net.transport import PeerInfo

    t0 = time.monotonic()
    await asyncio.gather(*(t.announce(PeerInfo(peer_id=t.peer_id, region=r)) for t, r in zip(ts, regions, strict=True)))
    deadline = t0 + cfg.settle_timeout
    while True:
        seen = await asyncio.gather(*(asyncio.wait_for(t.peers(), 60) for t in ts), return_exceptions=True)
        counts = [len(s) if not isinstance(s, BaseException) else 0 for s in seen]
        if min(counts) >= cfg.k:
            return time.monotonic() - t0
        if time.monotonic() > deadline:
            raise RuntimeError(f"after {cfg.settle_timeout:g} s the peers see {sorted(counts)} of {cfg.k} announcements")
        await asyncio.sleep(0.5)


async def _heartbeat(ts: list[Any], regions: list[str], every: float) -> None:
    from p2ptrain.net.transport import PeerInfo

    while True:
        await asyncio.sleep(every)
        await asyncio.gather(*(t.announce(PeerInfo(peer_id=t.peer_id, region=r))
                               for t, r in zip(ts, regions, strict=True)), return_exceptions=True)


async def run_net(cfg: NetScaleConfig, on_round: Any = None) -> dict[str, Any]:
    """Start ``cfg.k`` transports in this event loop, run ``cfg.rounds`` rounds, close everything: the summary
    (with every round's record). ``on_round(record)`` is called after each round (progress)."""
    from p2ptrain.collective.codecs import get_codec

    codec = get_codec(cfg.codec)
    regions = [f"r{i % cfg.regions}" for i in range(cfg.k)] if cfg.regions > 1 else [""] * cfg.k
    before_daemons = daemon_pids()
    load_before = _load()
    mem = _Memory()
    python_before = rss_mb(os.getpid())
    started: list[Any] = []
    rounds: list[dict[str, Any]] = []
    bg: list[asyncio.Task[None]] = [asyncio.create_task(mem.every(1.0))]
    summary: dict[str, Any] = {"k": cfg.k, "regions": cfg.regions, "config": asdict(cfg), "load_before": load_before,
                               "python_rss_before_mb": python_before}
    t_start = time.monotonic()
    try:
        await _start(cfg, started)
        ts = started
        summary["start_seconds"] = time.monotonic() - t_start
        # (announce order = index order; the leader is the smallest peer id, whichever index that is)
        summary["settle_seconds"] = await _settle(ts, cfg, regions)
        bg.append(asyncio.create_task(_heartbeat(ts, regions, cfg.ttl / 4)))
        mem.sample()
        summary["idle_mb"] = {"python": rss_mb(os.getpid()), "daemons": sum(rss_mb(p) for p in daemon_pids())}
        for n in range(cfg.rounds):
            rec = await _round(ts, cfg, n, regions, codec)
            mem.sample()
            rounds.append(rec)
            if on_round is not None:
                on_round(rec)
    except Exception as e:
        summary["error"] = f"{type(e).__name__}: {e}"
        log.warning("k=%d regions=%d: %s", cfg.k, cfg.regions, summary["error"])
    finally:
        for task in bg:
            task.cancel()
        await asyncio.gather(*bg, return_exceptions=True)
        mem.sample()
        t_close = time.monotonic()
        summary["close_hung"] = await _close_all(started, cfg.close_timeout)
        summary["close_seconds"] = time.monotonic() - t_close
        summary["daemons_left"] = _reap(before_daemons)
    summary["load_after"] = _load()
    summary["transports_started"] = len(started)
    return summary | _summarize(cfg, rounds, mem) | {"rounds": rounds}


async def _close_all(ts: list[Any], timeout: float) -> list[dict[str, Any]]:
    """Close every transport at once, waiting at most ``timeout`` seconds (``asyncio.wait``, not ``wait_for``: a
    close that does not honour cancellation must not hang the benchmark). The closes still running then are
    recorded (peer, daemon pid, the coroutine's stack) and left behind; their daemons are reaped by pid."""
    tasks = {asyncio.create_task(t.aclose()): t for t in ts}
    if not tasks:
        return []
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    hung = []

    def frames(task: asyncio.Task[Any] | None) -> list[str]:
        return [] if task is None else [f"{f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}"
                                        for f in task.get_stack(limit=30)]

    for task in pending:
        t = tasks[task]
        child = getattr(getattr(t, "p2p", None), "_child", None)
        runner = getattr(t, "_runner", None)  # what HivemindTransport.aclose waits for after cancelling it
        hung.append({"peer": t.peer_id[-8:], "daemon_pid": getattr(child, "pid", None),
                     "daemon_returncode": getattr(child, "returncode", None), "stack": frames(task),
                     "runner_done": None if runner is None else runner.done(), "runner_stack": frames(runner)})
        log.warning("event=close_hung peer=%s after %.0f s; stack: %s; runner: %s", t.peer_id[-8:], timeout,
                    " <- ".join(frames(task)), " <- ".join(frames(runner)))
    if hung:  # where every other task of the loop waits (the runners' children among them)
        where = Counter(" <- ".join(frames(x)[-3:]) for x in asyncio.all_tasks() if x not in pending
                        and x is not asyncio.current_task())
        hung.append({"pending_tasks": dict(where.most_common(12))})
        log.warning("event=close_hung_tasks %s", dict(where.most_common(12)))
    return hung


def _reap(before: list[int], wait: float = 10.0) -> list[int]:
    """Daemons this process started that are still there after the transports closed (waits ``wait`` seconds for
    them to exit, then kills each by its pid). Returns the pids that were left."""
    deadline = time.monotonic() + wait
    left = [p for p in daemon_pids() if p not in before]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [p for p in daemon_pids() if p not in before]
    for p in left:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)
    return left


def _summarize(cfg: NetScaleConfig, rounds: list[dict[str, Any]], mem: _Memory) -> dict[str, Any]:
    secs = [r["seconds"] for r in rounds if r["outcome"] != "failed"]
    outcomes = [r["outcome"] for r in rounds]

    def med(key: str) -> float:
        vals = [r[key] for r in rounds if r["outcome"] != "failed" and r[key] == r[key]]
        return statistics.median(vals) if vals else float("nan")

    return {"rounds_run": len(rounds), "completed": outcomes.count("completed"), "partial": outcomes.count("partial"),
            "failed": outcomes.count("failed"),
            "agreement": bool(rounds) and len(rounds) == cfg.rounds and all(r["agree"] for r in rounds),
            "modes": sorted({m for r in rounds for m in r["modes"]}),
            "round_seconds_median": statistics.median(secs) if secs else float("nan"),
            "round_seconds_max": max(secs) if secs else float("nan"),
            "group_seconds_median": med("group_seconds_median"), "reduce_seconds_median": med("reduce_seconds_median"),
            "bytes_sent_per_peer": med("bytes_sent_mean"), "bytes_sent_max": max((r["bytes_sent_max"] for r in rounds),
                                                                                 default=0),
            "fragment_bytes": cfg.numel * 4, "max_abs_error": max((r["max_abs_error"] for r in rounds), default=None),
            "peak_python_mb": mem.python_mb, "peak_daemons_mb": mem.daemons_mb, "peak_total_mb": mem.total_mb,
            "daemons_seen": mem.daemons, "mb_per_peer": mem.total_mb / cfg.k,
            "daemon_mb_per_peer": mem.daemons_mb / max(1, mem.daemons)}


def run_net_sync(cfg: NetScaleConfig) -> dict[str, Any]:
    return asyncio.run(run_net(cfg))


# ---------------------------------------------------------------------------------------------- the benchmark
def _row(r: dict[str, Any]) -> list[Any]:
    return [r["k"], r["regions"], "/".join(m[:4] for m in r.get("modes", [])) or "-", r["round_seconds_median"],
            r["round_seconds_max"], f"{r['completed']}/{r['partial']}/{r['failed']}",
            r["bytes_sent_per_peer"] / 2**20 if r["bytes_sent_per_peer"] == r["bytes_sent_per_peer"] else float("nan"),
            "yes" if r["agreement"] else "NO", r["mb_per_peer"], r["daemon_mb_per_peer"],
            f"{r['load_before'][0]:.1f}→{r['load_after'][0]:.1f}",
            f"{sum('peer' in h for h in r.get('close_hung', []))}/{len(r['daemons_left'])}"]


_COLUMNS = ["k", "regions", "mode", "round s (median)", "round s (max)", "done/partial/failed", "MiB sent/peer/round",
            "θ agree", "MB/peer (proc+daemons)", "MB/daemon", "load 1m", "closes hung/daemons reaped"]


def _setup_log(path: Path) -> None:
    """The transports' own log (INFO: dropped members, failed sends, fallbacks) to ``path``, not the terminal."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name, level in (("p2ptrain", logging.INFO), ("hivemind", logging.WARNING), ("bench", logging.INFO)):
        lg = logging.getLogger(name)
        lg.setLevel(level)
        lg.addHandler(handler)
        lg.propagate = False


def _worker(argv: list[str]) -> None:
    """One (k, R) in this process (``_one CONFIG_JSON LOG``): progress on stderr, the summary as the last line of
    stdout. A process of its own per swarm, so that its memory is its own (a Python process does not give back to
    the system what an earlier, larger swarm took)."""
    exit_on_sigterm()
    cfg = NetScaleConfig(**json.loads(argv[0]))
    _setup_log(Path(argv[1]))

    def progress(rec: dict[str, Any]) -> None:
        print(f"  k={cfg.k} R={cfg.regions} round {rec['round']}: {rec['outcome']}, {rec['seconds']:.1f} s, "
              f"agree={rec['agree']} err={rec['max_abs_error']:.2e} sent={rec['bytes_sent_mean'] / 2**20:.2f} MiB "
              f"modes={rec['modes']} load={_load()[0]}" + (f" errors={rec['errors'][:2]}" if rec["errors"] else ""),
              file=sys.stderr, flush=True)

    loop = asyncio.new_event_loop()
    res = loop.run_until_complete(run_net(cfg, progress))
    print(json.dumps(res, default=str), flush=True)
    if res.get("close_hung"):
        # Closes that never ended are still pending on the loop: asyncio.run would wait for them forever.
        os._exit(0)
    loop.close()


def _run_one(cfg: NetScaleConfig, log_path: Path, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "_one", json.dumps(asdict(cfg)), str(log_path)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        stdout, _ = p.communicate(timeout=timeout)
    except (subprocess.TimeoutExpired, KeyboardInterrupt, SystemExit) as e:
        p.terminate()  # SIGTERM: its finally blocks close the transports
        try:
            stdout, _ = p.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, _ = p.communicate()
        if not isinstance(e, subprocess.TimeoutExpired):
            raise
    lines = [x for x in stdout.splitlines() if x.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"k": cfg.k, "regions": cfg.regions, "config": asdict(cfg), "rounds": [],
                "error": f"worker exited {p.returncode} (timeout {timeout:g} s?)", **_summarize(cfg, [], _Memory()),
                "load_before": _load(), "load_after": _load(), "daemons_left": []}
    return dict(json.loads(lines[-1]))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_one":
        _worker(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default="2,4,8,16,32", help="swarm sizes k")
    ap.add_argument("--regions", default="1,2", help="region counts R to run every k with (peer i in region i mod R)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--numel", type=int, default=1 << 20, help="values in the fragment (fp32 in memory)")
    ap.add_argument("--codec", default="fp32")
    ap.add_argument("--join-window", type=float, default=30.0)
    ap.add_argument("--join-timeout", type=float, default=120.0)
    ap.add_argument("--round-timeout", type=float, default=240.0)
    ap.add_argument("--settle-timeout", type=float, default=120.0)
    ap.add_argument("--start-batch", type=int, default=4, help="daemons started at once")
    ap.add_argument("--no-verify", action="store_true", help="turn verified aggregation off (default: on, as a run)")
    ap.add_argument("--max-load", type=float, default=8.0,
                    help="before each (k, R), wait (up to --load-wait s) for the 1-minute load to drop below this")
    ap.add_argument("--load-wait", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS / "scale_net.json")
    ap.add_argument("--log", type=Path, default=None, help="the transports' INFO log (default: a file in /tmp)")
    a = ap.parse_args()
    exit_on_sigterm()
    log_path = a.log or Path(tempfile.gettempdir()) / f"scale_net-{os.getpid()}.log"

    from p2ptrain.ui import out, table

    ks = [int(x) for x in a.peers.split(",") if x]
    rs = [int(x) for x in a.regions.split(",") if x]
    rows: list[dict[str, Any]] = []
    for k in ks:
        for r in rs:
            if r > k:
                continue
            waited = _wait_load(a.max_load, a.load_wait)
            cfg = NetScaleConfig(k=k, regions=r, rounds=a.rounds, numel=a.numel, codec=a.codec,
                                 join_window=a.join_window, join_timeout=a.join_timeout,
                                 round_timeout=a.round_timeout, settle_timeout=a.settle_timeout,
                                 start_batch=a.start_batch, verify=not a.no_verify, seed=a.seed)
            out.print(f"k={k} regions={r}: starting (load {_load()}, waited {waited:.0f} s for it)", style="dim")
            budget = 300 + cfg.settle_timeout + 60 * k + a.rounds * (cfg.join_timeout + cfg.round_timeout)
            res = _run_one(cfg, log_path, budget)
            res["load_waited_seconds"] = waited
            rows.append(res)
            write_json(a.out, {"args": vars(a), "log": str(log_path), "runs": rows})
            out.print(table(f"k={k}, R={r}", _COLUMNS, [_row(res)]))
    write_json(a.out, {"args": vars(a), "log": str(log_path), "runs": rows})
    out.print(table(f"scale, network only: {a.numel} values ({a.numel * 4 / 2**20:g} MiB fp32), codec {a.codec}, "
                    f"{a.rounds} rounds, k transports in one process (one per k) on 127.0.0.1", _COLUMNS,
                    [_row(r) for r in rows]))
    try:
        _plot(rows, a.out.with_suffix(".png"))
    except Exception as e:  # matplotlib missing
        out.print(f"no plot: {e}")


def _wait_load(limit: float, wait: float) -> float:
    t0 = time.monotonic()
    while os.getloadavg()[0] > limit and time.monotonic() - t0 < wait:
        time.sleep(10)
    return time.monotonic() - t0


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    from p2ptrain.plot import pyplot

    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in sorted({x["regions"] for x in rows}):
        sel = sorted((x for x in rows if x["regions"] == r), key=lambda x: x["k"])
        ks = [x["k"] for x in sel]
        ax1.plot(ks, [x["round_seconds_median"] for x in sel], "o-", label=f"{r} region(s): median")
        ax1.plot(ks, [x["round_seconds_max"] for x in sel], "x:", label=f"{r} region(s): max")
        ax2.plot(ks, [x["mb_per_peer"] for x in sel], "o-", label=f"{r} region(s): (process + daemons) / k")
        ax2.plot(ks, [x["daemon_mb_per_peer"] for x in sel], "s--", label=f"{r} region(s): one p2pd daemon")
    ax1.set_title("round time, s (form group + all-reduce)")
    ax2.set_title("peak resident memory per peer, MB")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("peers k (one process, one daemon each)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
