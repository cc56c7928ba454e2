"""What the swarm benchmarks share: launch a bootstrap node and real peers (on 127.0.0.1 or in
testbed namespaces), collect their summaries, the bytes each one put on the wire and its memory,
reduce them to the figures the benches report, and write the results.

A peer is any command that takes ``--host-maddrs``, ``--announce-maddrs``, ``--initial-peers``
and ``--json PATH`` (``p2ptrain join`` and ``bench/hivemind_peer.py``). :func:`run_swarm` starts
them, waits until all have left or the deadline passes (then asks the rest to leave with
SIGTERM: a graceful leave that still writes the summary), and always stops every process it
started. In a testbed every peer has its own namespace, so the bytes its link sent
(``tx_bytes`` of the host's ``eth0``: payload, framing, DHT traffic and TCP/IP headers) are the
bytes that peer put on the wire.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2ptrain.procs import wait_lines

__all__ = [
    "PeerLaunch",
    "SwarmRun",
    "exit_on_sigterm",
    "fresh_start_args",
    "join_argv",
    "loss_at_step",
    "machine",
    "median",
    "rss_mb",
    "rss_tree_mb",
    "run_swarm",
    "summarize",
    "time_to_target",
    "val_curve",
    "write_json",
]

RESULTS = Path(__file__).parent / "results"
P2PTRAIN = [sys.executable, "-m", "p2ptrain"]
#: A ``join`` peer's direct path listens on its libp2p port + this (the testbed relays it between regions).
DIRECT_PORT = 5000


def machine() -> dict[str, Any]:
    """The machine a figure was measured on (architecture, cores, memory, GPU, Python, torch)."""
    import torch

    mem = math.nan
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) / 2**20
    return {"arch": platform.machine(), "cores": os.cpu_count(), "memory_gib": round(mem, 1),
            "gpu": torch.cuda.is_available(), "python": platform.python_version(), "torch": torch.__version__,
            "kernel": platform.release()}


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit, so that ``finally`` blocks and testbed teardown run as on Ctrl-C."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """``payload`` plus the command line and the machine, as indented JSON at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    script = Path(sys.argv[0]).resolve()
    with contextlib.suppress(ValueError):
        script = script.relative_to(Path(__file__).resolve().parents[1])
    command = " ".join(["python", script.as_posix(), *sys.argv[1:]])
    path.write_text(json.dumps({"command": command, "machine": machine(), **payload}, indent=1, default=str) + "\n")


def median(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(xs) if xs else math.nan


def time_to_target(points: Sequence[tuple[float, float]], target: float) -> float | None:
    """The first time a loss curve ``[(time, loss), ...]`` reaches ``target`` (≤), linearly interpolated
    between the two points around the crossing; None if it never does. Points must be in time order."""
    prev: tuple[float, float] | None = None
    for t, loss in points:
        if loss <= target:
            if prev is None or prev[1] == loss:
                return t
            return prev[0] + (prev[1] - target) / (prev[1] - loss) * (t - prev[0])
        prev = (t, loss)
    return None


def val_curve(summary: dict[str, Any]) -> list[tuple[float, float]]:
    """A peer's ``val_log`` as ``[(training seconds, val loss of θ)]``: seconds since its inner-step loop
    started, without the evaluations before each point (the loop pauses while it evaluates)."""
    start = float(summary["loop_started"])
    curve = []
    for t, _step, loss, eval_so_far in summary.get("val_log", []):
        curve.append((max(0.0, t - start - eval_so_far), float(loss)))
    return curve


def loss_at_step(summary: dict[str, Any], step: float) -> float | None:
    """The val loss of θ at the last evaluation at or before inner step ``step`` (None: none that early)."""
    before = [loss for _t, s, loss, _e in summary.get("val_log", []) if s <= step]
    return before[-1] if before else None


def fresh_start_args(work: Path) -> list[str]:
    """``-c RECIPE`` for peers that all start at once from the shared seeded initialisation: no state
    download on joining (``[peer] sync_on_join = false``). The download is for late joiners; at a common
    start it only delays the peers on slow links (ddp: its step-keyed groups then never line up again)
    and repeats inside the loop after the warm-up (outer methods), which would be counted as lost compute."""
    work.mkdir(parents=True, exist_ok=True)
    recipe = work / "fresh_start.toml"
    recipe.write_text("[peer]\nsync_on_join = false\n")
    return ["-c", str(recipe)]


def join_argv(method: str, *, preset: str, steps: int, batch_size: int, H: int, step_seconds: float,
              run_id: str, region: str = "", tau: int | None = None, P: int | None = None,
              extra: Sequence[str] = ()) -> list[str]:
    """A ``p2ptrain join`` command for one peer of a bench (no metrics endpoint, no status line)."""
    argv = [*P2PTRAIN, "join", "--run-id", run_id, "--method", method, "--preset", preset, "--steps", str(steps),
            "--batch-size", str(batch_size), "--step-seconds", str(step_seconds), "--metrics-port", "-1", "-q",
            "--log-level", "INFO"]
    if method != "ddp":
        argv += ["--H", str(H)]
    if region:
        argv += ["--region", region]
    if method in ("streaming", "cocodc"):
        if P is not None:
            argv += ["--P", str(P)]
        if tau is not None:
            argv += ["--tau", str(tau)]
    return argv + list(extra)


def rss_mb(pid: int) -> float:
    """Resident memory of one process, MB (0 once it is gone)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def rss_tree_mb(pid: int) -> float:
    """Resident memory of a process and all its descendants (a peer and its p2pd daemon), MB."""
    total, todo, seen = 0.0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        total += rss_mb(p)
        with contextlib.suppress(OSError, ValueError):
            for task in Path(f"/proc/{p}/task").iterdir():
                with contextlib.suppress(OSError, ValueError):
                    todo += [int(c) for c in (task / "children").read_text().split()]
    return total


@dataclass
class PeerLaunch:
    """One peer to start: its command (without address flags), its testbed host (None: 127.0.0.1)."""

    argv: list[str]
    host: str | None = None
    name: str = ""


@dataclass
class SwarmRun:
    """What a swarm left behind: per peer (launch order) its summary, exit code, wire bytes, peak memory."""

    summaries: list[dict[str, Any] | None]
    codes: list[int | None]
    wire_tx_bytes: list[int | None]
    peak_rss_mb: list[float]
    wall_seconds: float
    logs: Path
    terminated: bool = False  # the deadline passed and the peers were asked to leave
    extra: dict[str, Any] = field(default_factory=dict)


def _tx_bytes(tb: Any, host: str) -> int | None:
    try:
        out = subprocess.run(["ip", "-n", tb.ns(host), "-s", "-j", "link", "show", "dev", "eth0"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])
    except (subprocess.SubprocessError, OSError, ValueError, KeyError, IndexError):
        return None


def run_swarm(launches: Sequence[PeerLaunch], *, work: Path, deadline: float, tb: Any = None,
              boot_host: str | None = None, env: dict[str, str] | None = None, stagger: float = 0.5,
              grace: float = 150.0, on_tick: Callable[[float, list[subprocess.Popen[bytes]]], None] | None = None,
              sample_every: float = 2.0) -> SwarmRun:
    """Start a bootstrap node and ``launches``; wait until they leave or ``deadline`` seconds pass (then
    SIGTERM: leave gracefully, ``grace`` seconds to do so). ``tb``: a running Testbed (peers and the
    bootstrap node in its hosts), else 127.0.0.1. Every process is stopped before this returns."""
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(argv: list[str], host: str | None, log: Path) -> subprocess.Popen[bytes]:
        out = log.open("wb")
        try:
            if tb is None:
                p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            else:
                assert host is not None, "in a testbed every process needs a host"
                p = tb.run(host, argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        finally:
            out.close()
        procs.append(p)
        return p

    def addrs(host: str | None, direct: bool = False) -> list[str]:
        if tb is None:
            return ["--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
        listen, announce = tb.maddrs(host)
        out = ["--host-maddrs", listen[0], "--announce-maddrs", announce[0]]
        if direct and host is not None:  # the direct path's port, relayed between regions like libp2p's
            port = int(listen[0].rsplit("/", 1)[1]) + DIRECT_PORT
            tb.expose(host, port)
            out += ["--direct-port", str(port)]
        return out

    jsons = [work / f"{lp.name or f'peer{i}'}.json" for i, lp in enumerate(launches)]
    for j in jsons:
        j.unlink(missing_ok=True)
    peak = [0.0] * len(launches)
    peers: list[subprocess.Popen[bytes]] = []
    terminated = False
    t0 = time.monotonic()
    try:
        boot_file = work / "boot.maddrs"
        boot_file.unlink(missing_ok=True)
        boot = spawn([*P2PTRAIN, "bootstrap", *addrs(boot_host), "--maddrs-file", str(boot_file)], boot_host,
                     work / "boot.log")
        initial = [a for a in wait_lines(boot_file, 90, boot) if tb is None or "/ip4/10.200." in a]
        for i, lp in enumerate(launches):
            argv = [*lp.argv, *addrs(lp.host, direct=lp.argv[:len(P2PTRAIN) + 1] == [*P2PTRAIN, "join"]),
                    "--json", str(jsons[i])]
            for a in initial:
                argv += ["--initial-peers", a]
            peers.append(spawn(argv, lp.host, work / f"{lp.name or f'peer{i}'}.log"))
            time.sleep(stagger)
        t0 = time.monotonic()
        last_sample = 0.0
        while any(p.poll() is None for p in peers):
            now = time.monotonic()
            if now - last_sample >= sample_every:
                last_sample = now
                for i, p in enumerate(peers):
                    if p.poll() is None:
                        peak[i] = max(peak[i], rss_tree_mb(p.pid))
                if on_tick is not None:
                    on_tick(now - t0, peers)
            if not terminated and now - t0 > deadline:
                terminated = True
                for p in peers:
                    if p.poll() is None:
                        p.send_signal(signal.SIGTERM)
            if terminated and now - t0 > deadline + grace:
                break
            time.sleep(0.2)
        wall = time.monotonic() - t0
        wire = [_tx_bytes(tb, lp.host) if tb is not None and lp.host else None for lp in launches]
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
    summaries = [json.loads(j.read_text()) if j.exists() else None for j in jsons]
    return SwarmRun(summaries=summaries, codes=[p.returncode for p in peers], wire_tx_bytes=wire, peak_rss_mb=peak,
                    wall_seconds=wall, logs=work, terminated=terminated)


def message_bytes_per_step(summaries: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per message kind, the mean over the peers that counted their messages of the bytes each sent per inner
    step (``traffic`` in a peer's summary); {} when none did."""
    counted = [s for s in summaries if s.get("traffic")]
    kinds = sorted({k for s in counted for k in s["traffic"]})
    return {k: statistics.fmean([s["traffic"].get(k, {}).get("sent", 0) / max(1, s["steps"]) for s in counted])
            for k in kinds}


def summarize(run: SwarmRun) -> dict[str, Any]:
    """The figures of one swarm run, averaged over the peers that left a summary.

    ``utilization``: compute seconds over the inner-step loop's wall time (evaluations taken out);
    ``payload_bytes_per_step``: what the peer's all-reduces sent (its own count) per inner step;
    ``wire_bytes_per_step``: what its namespace's link sent per inner step (testbed only);
    ``message_bytes_per_step``: per message kind, the bytes of its own messages it sent per inner step (the
    transport's count, net/traffic.py: payload and protocol alike, without TCP/IP, libp2p or the DHT)."""
    ok = [(s, w) for s, w in zip(run.summaries, run.wire_tx_bytes, strict=True) if s is not None]
    if not ok:
        return {"peers": 0, "logs": str(run.logs)}
    ss = [s for s, _ in ok]

    def mean(xs: Sequence[float]) -> float:
        xs = [x for x in xs if x is not None and not math.isnan(x)]
        return statistics.fmean(xs) if xs else math.nan

    util = [s["compute_seconds"] / max(1e-9, s["loop_seconds"] - s.get("eval_seconds", 0.0)) for s in ss]
    wire = [w / max(1, s["steps"]) for s, w in ok if w is not None]
    rounds = [s.get("round_seconds", []) for s in ss]
    return {
        "peers": len(ss), "exit_codes": run.codes, "steps_mean": mean([s["steps"] for s in ss]),
        "val_loss_mean": mean([s["val_loss"] for s in ss]), "utilization_mean": mean(util),
        "utilization_min": min(util), "compute_seconds_per_step": mean([s["compute_seconds"] / max(1, s["steps"])
                                                                         for s in ss]),
        "payload_bytes_per_step": mean([s["bytes_sent"] / max(1, s["steps"]) for s in ss
                                        if s.get("bytes_sent") is not None]),
        "wire_bytes_per_step": mean(wire) if wire else None,
        "message_bytes_per_step": message_bytes_per_step(ss),
        "rounds_mean": mean([s.get("rounds_complete", 0) + s.get("rounds_partial", 0) for s in ss]),
        "rounds_failed_mean": mean([s.get("rounds_failed", 0) for s in ss]),
        "round_seconds_median": median([x for r in rounds for x in r]),
        # of a round: forming its group (waiting for the slowest member to start it) and its all-reduces
        "group_seconds_median": median([x for s in ss for x in s.get("group_seconds", [])]),
        "allreduce_seconds_median": median([x for s in ss for x in s.get("allreduce_seconds", [])]),
        "peak_rss_mb_mean": mean([m for m, s in zip(run.peak_rss_mb, run.summaries, strict=True) if s is not None]),
        "wall_seconds": run.wall_seconds, "terminated_at_deadline": run.terminated, "logs": str(run.logs),
    }
