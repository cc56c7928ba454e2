"""Churn: ≥ 16 real peers in 2–3 testbed regions, a fault every ≤ 30 s for 30 minutes, next to the same
swarm without faults for the same time.

    python bench/churn.py                                   # 16 peers, 3 regions, 30 min faults, then 30 min baseline
    python bench/churn.py --peers 6 --minutes 3 --every 20  # a smoke run
    python bench/churn.py --phases baseline --minutes 10    # only the fault-free swarm

Each phase gets a fresh testbed (bench/testbed.py: regions ``us``, ``eu``, ``ap``; every peer its own
namespace and link, each region's uplink ``--between-rate`` with ``--delay-ms`` one way between regions), a
bootstrap node and ``--peers`` ``p2ptrain join`` processes (one thread each, ``--min-step-seconds`` pads every
inner step so that a peer's compute rate does not depend on how many others share this machine's 2 cores: a
fault that stops a peer must not hand its CPU to the others and inflate their tokens). After ``--warmup``
seconds the measured window of ``--minutes`` starts; in the fault phase a fault is drawn (seeded) every
``--every`` seconds from:

* ``kill``: SIGKILL to a peer and its libp2p daemon (its process group: a crashed machine), restarted
  ``--restart-after`` seconds later on the same host with ``--resume`` (its checkpoints, one every
  ``--checkpoint-every`` applied rounds and every ``--checkpoint-seconds``: the steps since the last one are lost;
  the same peer id, its key kept in the checkpoint folder);
* ``stop``: SIGSTOP to a peer and its daemon, SIGCONT ``--stop-seconds`` (20) later (a frozen machine);
* ``partition``: a region is cut off from the others for ``--partition-seconds`` (60) (a blackhole route in
  its gateway and in the core: :meth:`Testbed.partition`), then healed;
* ``join``: a new peer (fresh identity and state) joins in a free slot (``--spare`` slots beyond ``--peers``);
* ``leave``: SIGTERM to a peer: it finishes its step, sends each fragment's unsent progress at its slot (within
  H logical steps: PeerConfig.leave_flush), drains its rounds, writes a checkpoint and its summary, leaves.

What is read, as it happens (every peer's log; the ``--json`` summaries at the end cross-check):
``event=applied key fragment members tokens digest`` (a round applied, with θ's digest after it),
``event=round_failed``, ``event=round_timeout`` (a stuck round: it outlived its own timeouts),
``event=round_abandoned`` (a leaving peer's drain limit came before the round's own: it left mid-round),
``event=repaired``, and the status line (inner step, train loss). Per round key: outcome, members, how many
peers applied it and whether their θ agreed (diverged replicas: appliers whose θ differs from the
majority's right after it), failed and stuck counts. Goodput: tokens that reached θ (the total weight of
each round applied, by the majority, in the window) over the same figure of the fault-free phase; the target's
figure counts only the rounds whose θ the swarm kept (bench/churn_rounds.py: a round applied by a minority is
repaired away).
Memory: resident memory of each peer and its daemon every ``--rss-every`` seconds. Survival per fault: the
peer (or the cut region's peers) applied a round with the swarm again within ``--survive-within`` seconds;
a leave: exit code 0 and a summary written.

Writes bench/results/churn.json every few seconds (a crash loses nothing), and at the end churn.md (tables)
and churn.png (live peers, tokens in θ, loss, memory over time).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import itertools

from bench.churn_rounds import (
    CUT_STATES,
    failure_kind,
    failure_kinds,
    kept_rounds,
    rounds_by_cut,
    trained_in_window_reaching_theta,
)
from bench.harness import DIRECT_PORT, P2PTRAIN, RESULTS, exit_on_sigterm, rss_tree_mb
from bench.testbed import RegionSpec, Testbed, TestbedSpec, parse_rate, unavailable_reason
from p2ptrain.procs import wait_lines

KINDS = ("kill", "stop", "partition", "join", "leave")
REGION_NAMES = ("us", "eu", "ap")

_APPLIED = re.compile(r"event=applied key=(\S+) fragment=(\d+) members=(\d+) tokens=(\d+) divergent=(\w+) "
                      r"digest=(\w+)(?: own=(\d+))?")
_FAILED = re.compile(r"event=round_failed key=(\S+)(?: reason=(.*))?")
_STUCK = re.compile(r"event=round_timeout key=(\S+)( when=leaving)?")
_ABANDONED = re.compile(r"event=round_abandoned key=(\S+)")
# a carrier that averaged a shard with its partner's stand-in (p2ptrain/net/standin.py): key=<round>#s<shard>~<id>
_STOOD_IN = re.compile(r"event=standin_carried key=([^#\s]+)#s(\d+)~")
_STATUS = re.compile(r"^step\s+(\d+)\s+loss\s+([0-9.naif]+)")
_TS = re.compile(r"^ts=(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")


def _ts(line: str, default: float) -> float:
    m = _TS.match(line)
    if not m:
        return default
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


# ---------------------------------------------------------------------------------------------- peers
def set_start_nice(pid: int, nice: int) -> bool:
    """Give the session ``pid`` leads (a peer and its daemon) niceness ``nice``; True when it took.

    With the kernel's autogroups on, each session is its own scheduling group and the cores are shared between
    groups by the group's niceness: a process's own niceness weighs only inside its group, so ``setpriority`` alone
    gave a start-up nothing against the 15 training peers, each in a session of its own (4 spinners on 2 cores, one
    at -10 by setpriority: 0.39 against 0.42-0.47 CPU s; by its autogroup: 2.3 against 0.23)."""
    took = False
    with contextlib.suppress(OSError):  # (gone, or not ours to raise)
        os.setpriority(os.PRIO_PGRP, pid, nice)
        took = True
    with contextlib.suppress(OSError):  # (gone, not ours, or a kernel without autogroups)
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
        took = True
    return took


@dataclass
class Life:
    """One process of a peer (a restart after SIGKILL is a new life of the same peer)."""

    index: int
    proc: subprocess.Popen[bytes]
    log: Path
    json: Path
    started: float
    offset: int = 0
    buf: str = ""
    ended: float | None = None
    code: int | None = None
    how: str = ""  # killed / left / stopped-at-end / exited
    raised: bool = False  # its process group runs at --start-nice until its ``event=started`` line


@dataclass
class PeerRec:
    """One peer: a slot's identity, its checkpoints, its lives."""

    name: str
    slot: int
    host: str
    region: str
    fresh: bool  # one of the peers that started the run together (no state download at start)
    lives: list[Life] = field(default_factory=list)
    state: str = "live"  # live / stopped / dead (killed, waiting to restart) / leaving / gone
    rss: list[tuple[float, float]] = field(default_factory=list)
    loss: list[tuple[float, int, float]] = field(default_factory=list)  # (unix time, inner step, train loss)
    applied: list[tuple[float, str, str]] = field(default_factory=list)  # (unix time, round key, digest)

    @property
    def life(self) -> Life:
        return self.lives[-1]


class Phase:
    """One phase: a testbed, a bootstrap node, the peers, the faults, and what their logs said."""

    def __init__(self, name: str, a: argparse.Namespace, work: Path, faults: bool) -> None:
        self.name, self.a, self.work, self.with_faults = name, a, work, faults
        self.rng = random.Random(a.seed)
        self.run_id = f"churn-{name}-{os.getpid()}"
        self.regions = list(REGION_NAMES[: a.regions])
        self.slots = a.peers + (a.spare if faults else 0)
        self.slot_host = {s: (self.regions[s % len(self.regions)], f"{self.regions[s % len(self.regions)]}"
                                                                     f"{s // len(self.regions)}")
                          for s in range(self.slots)}
        self.peers: dict[str, PeerRec] = {}
        self.gen = Counter[int]()
        self.rounds: dict[str, dict[str, Any]] = {}
        self.faults: list[dict[str, Any]] = []
        self.live: list[tuple[float, int, int]] = []  # (unix time, peers computing, peer processes)
        # (unix time, the machine's 1-minute load average): runs beside other work compare only at like loads
        self.load: list[tuple[float, float]] = []
        self.boot: list[str] = []
        self.partitioned: dict[str, float] = {}  # region -> unix time it heals
        self.timers: list[tuple[float, str, Any]] = []  # (unix time, action, arg)
        self.t0 = math.nan  # all initial peers started
        self.window = (math.nan, math.nan)
        self.summaries: dict[str, Any] = {}
        self.ended = False
        self.fragments = a.P if a.method in ("streaming", "cocodc") else 1

    # ------------------------------------------------------------------ the testbed
    def spec(self) -> TestbedSpec:
        per_region = math.ceil(self.slots / len(self.regions)) + 1  # +1: the bootstrap host in the first region
        rate = parse_rate(self.a.between_rate)
        return TestbedSpec(regions=tuple(
            RegionSpec(name=r, hosts=per_region, host_rate=parse_rate(self.a.host_rate), uplink_rate=rate,
                       delay_ms=self.a.delay_ms / 2) for r in self.regions))

    def boot_host(self) -> str:
        return f"{self.regions[0]}{math.ceil(self.slots / len(self.regions))}"

    # ------------------------------------------------------------------ starting peers
    def argv(self, rec: PeerRec, resume: bool, initial: list[str]) -> list[str]:
        a = self.a
        argv = [*P2PTRAIN, "join", "--run-id", self.run_id, "--method", a.method, "--preset", a.preset,
                "--steps", "100000000", "--batch-size", str(a.batch_size), "--step-seconds", str(a.step_seconds),
                "--min-step-seconds", str(a.min_step_seconds if a.min_step_seconds is not None else a.step_seconds),
                "--H", str(a.H), "--region", rec.region, "--metrics-port", "-1", "--log-level", "INFO",
                "--checkpoint-dir", str(self.work / f"{rec.name}.ck"), "--checkpoint-every", str(a.checkpoint_every),
                "--checkpoint-seconds", str(a.checkpoint_seconds),
                "--maddrs-file", str(self.work / f"{rec.name}.maddrs")]
        if a.method in ("streaming", "cocodc"):
            argv += ["--P", str(a.P), "--tau", str(a.tau)]
        if a.join_window is not None:
            argv += ["--join-window", str(a.join_window)]
        if rec.fresh and not resume:
            argv += ["-c", str(self.work / "fresh_start.toml")]
        elif a.late != "stall":
            argv += ["-c", str(self.work / "method.toml")]
        if resume:
            argv += ["--resume"]
        for m in initial:
            argv += ["--initial-peers", m]
        return argv

    def initial_for(self, rec: PeerRec) -> list[str]:
        """The bootstrap node and two live peers (its own region's first): what a joiner would be given."""
        others = [p for p in self.peers.values() if p.state == "live" and p is not rec
                  and (self.work / f"{p.name}.maddrs").exists()]
        others.sort(key=lambda p: (p.region != rec.region, self.rng.random()))
        out = list(self.boot)
        for p in others[:2]:
            out += [m for m in (self.work / f"{p.name}.maddrs").read_text().split() if "/ip4/10.200." in m][:1]
        return out

    def spawn(self, tb: Testbed, rec: PeerRec, resume: bool) -> None:
        i = len(rec.lives)
        log, js = self.work / f"{rec.name}.{i}.log", self.work / f"{rec.name}.{i}.json"
        (self.work / f"{rec.name}.maddrs").unlink(missing_ok=True)
        listen, announce = tb.maddrs(rec.host)
        direct = int(listen[0].rsplit("/", 1)[1]) + DIRECT_PORT  # the direct path, relayed between regions too
        tb.expose(rec.host, direct)
        argv = [*self.argv(rec, resume, self.initial_for(rec)), "--host-maddrs", listen[0], "--announce-maddrs",
                announce[0], "--direct-port", str(direct), "--json", str(js)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with log.open("wb") as out:
            proc = tb.run(rec.host, argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        life = Life(i, proc, log, js, time.time())
        if self.a.start_nice and (i > 0 or not rec.fresh):
            # A machine of its own, for its start-up only: a restart or a joiner does not share the cores with
            # the 15 training peers and their daemons while it imports, loads and connects (its children, the
            # daemon among them, inherit the niceness). Back to 0 at its ``event=started`` line.
            life.raised = set_start_nice(proc.pid, -self.a.start_nice)
        rec.lives.append(life)
        rec.state = "live"

    def new_peer(self, tb: Testbed, slot: int, fresh: bool) -> PeerRec:
        self.gen[slot] += 1
        region, host = self.slot_host[slot]
        rec = PeerRec(f"s{slot:02d}g{self.gen[slot]}", slot, host, region, fresh)
        self.peers[rec.name] = rec
        self.spawn(tb, rec, resume=False)
        return rec

    # ------------------------------------------------------------------ reading the logs
    def read_logs(self) -> None:
        now = time.time()
        for rec in self.peers.values():
            for life in rec.lives:
                if life.offset < 0:
                    continue
                try:
                    with life.log.open("rb") as f:
                        f.seek(life.offset)
                        data = f.read()
                except OSError:
                    continue
                life.offset += len(data)
                text = life.buf + data.decode(errors="replace")
                lines = text.split("\n")
                life.buf = lines.pop()
                for line in lines:
                    self.parse(rec, line, now)
                    if life.raised and "event=started" in line:
                        life.raised = False
                        set_start_nice(life.proc.pid, 0)
                if life.ended is not None and life.proc.poll() is not None and not data:
                    life.offset = -1  # done with this file

    def round(self, key: str) -> dict[str, Any]:
        return self.rounds.setdefault(key, {"fragment": None, "first": math.inf, "digests": {}, "tokens": {},
                                            "members": [], "failed": [], "why": {}, "stuck": [], "abandoned": [],
                                            "flagged": 0, "own": 0, "stood_in": []})

    def parse(self, rec: PeerRec, line: str, now: float) -> None:
        if (m := _STATUS.match(line)) is not None:
            with contextlib.suppress(ValueError):
                rec.loss.append((now, int(m.group(1)), float(m.group(2))))
            return
        if "event=" not in line:
            return
        t = _ts(line, now)
        if (m := _APPLIED.search(line)) is not None:
            key, frag, members, tokens, divergent, digest, own = m.groups()
            r = self.round(key)
            r["fragment"], r["first"] = int(frag), min(r["first"], t)
            r["digests"].setdefault(digest, []).append(rec.name)
            r["tokens"][digest] = max(r["tokens"].get(digest, 0), int(tokens))
            r["members"].append(int(members))
            r["flagged"] += divergent == "True"
            r["own"] += int(own or 0)
            rec.applied.append((t, key, digest))
        elif (m := _FAILED.search(line)) is not None:
            r = self.round(m.group(1))
            r["failed"].append(rec.name)
            kind = failure_kind(m.group(2) or "")
            r["why"][kind] = r["why"].get(kind, 0) + 1
        elif (m := _STUCK.search(line)) is not None:
            self.round(m.group(1))["stuck"].append(rec.name + (" (leaving)" if m.group(2) else ""))
        elif (m := _ABANDONED.search(line)) is not None:
            self.round(m.group(1))["abandoned"].append(rec.name)
        elif (m := _STOOD_IN.search(line)) is not None:
            self.round(m.group(1))["stood_in"].append(int(m.group(2)))

    # ------------------------------------------------------------------ faults
    def busy(self, rec: PeerRec) -> bool:
        return rec.state != "live" or any(arg is rec for _, _, arg in self.timers)

    def targets(self) -> list[PeerRec]:
        return [p for p in self.peers.values() if not self.busy(p) and p.life.proc.poll() is None
                and time.time() - p.life.started > self.a.settle]

    def feasible(self) -> list[str]:
        targets = self.targets()
        live = [p for p in self.peers.values() if p.state in ("live", "stopped", "dead")]
        used = {p.slot for p in self.peers.values() if p.state != "gone"}
        kinds = []
        if targets:
            kinds += ["kill", "stop"]
            if len(live) > self.a.peers - self.a.spare:
                kinds.append("leave")
        if not self.partitioned and len(self.regions) > 1:
            kinds.append("partition")
        if len(used) < self.slots:
            kinds.append("join")
        return kinds

    def inject(self, tb: Testbed) -> None:
        kinds = self.feasible()
        if not kinds:
            return
        kind = self.rng.choice(KINDS)
        if kind not in kinds:
            kind = self.rng.choice(kinds)
        now = time.time()
        f: dict[str, Any] = {"t": now, "kind": kind, "survived": None}
        if kind == "partition":
            region = self.rng.choice(self.regions)
            tb.partition(region, True)
            self.partitioned[region] = now + self.a.partition_seconds
            self.timers.append((now + self.a.partition_seconds, "heal", region))
            f |= {"target": region, "peers": [p.name for p in self.peers.values()
                                               if p.region == region and p.state == "live"]}
        elif kind == "join":
            used = {p.slot for p in self.peers.values() if p.state != "gone"}
            slot = self.rng.choice([s for s in range(self.slots) if s not in used])
            rec = self.new_peer(tb, slot, fresh=False)
            f |= {"target": rec.name, "region": rec.region}
        else:
            rec = self.rng.choice(self.targets())
            f |= {"target": rec.name, "region": rec.region}
            pgid = rec.life.proc.pid
            if kind == "kill":
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
                rec.state = "dead"
                rec.life.how = "killed"
                self.timers.append((now + self.a.restart_after, "restart", rec))
            elif kind == "stop":
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGSTOP)
                rec.state = "stopped"
                self.timers.append((now + self.a.stop_seconds, "cont", rec))
            else:
                rec.life.proc.send_signal(signal.SIGTERM)
                rec.state = "leaving"
                rec.life.how = "left"
        self.faults.append(f)
        msg = f"  {now - self.t0:6.0f} s  {kind:9s} {f.get('target', '')}"
        print(msg, flush=True)

    def due_timers(self, tb: Testbed) -> None:
        now = time.time()
        keep = []
        for when, action, arg in self.timers:
            if when > now:
                keep.append((when, action, arg))
                continue
            if action == "heal":
                tb.partition(arg, False)
                self.partitioned.pop(arg, None)
                for f in self.faults:
                    if f["kind"] == "partition" and f["target"] == arg and "healed" not in f:
                        f["healed"] = now
            elif action == "cont":
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(arg.life.proc.pid, signal.SIGCONT)
                if arg.state == "stopped":
                    arg.state = "live"
                for f in self.faults:
                    if f["kind"] == "stop" and f["target"] == arg.name and "resumed" not in f:
                        f["resumed"] = now
            elif action == "restart":
                with contextlib.suppress(subprocess.TimeoutExpired):
                    arg.life.proc.wait(5)
                arg.life.ended, arg.life.code = now, arg.life.proc.returncode
                self.spawn(tb, arg, resume=True)
                for f in self.faults:
                    if f["kind"] == "kill" and f["target"] == arg.name and "restarted" not in f:
                        f["restarted"] = now
        self.timers = keep

    def reap(self) -> None:
        """Notice processes that ended on their own (a leave, or a crash)."""
        for rec in self.peers.values():
            life = rec.life
            if life.ended is None and rec.state != "dead" and life.proc.poll() is not None:
                life.ended, life.code = time.time(), life.proc.returncode
                if rec.state == "leaving":
                    rec.state = "gone"
                    for f in self.faults:
                        if f["kind"] == "leave" and f["target"] == rec.name:
                            f["left_after"] = life.ended - f["t"]
                            f["exit_code"] = life.code
                else:
                    life.how = life.how or "exited"
                    rec.state = "gone"

    def judge(self, final: bool = False) -> None:
        """Whether each fault was survived (None: not yet known). ``final``: the peers were asked to leave at the
        end of the phase; only leaves are judged then (a fault whose peer had no time to come back stays unknown)."""
        within = self.a.survive_within
        now = time.time()
        majority = {k: max(r["digests"].items(), key=lambda kv: len(kv[1]))[0] for k, r in self.rounds.items()
                    if r["digests"]}

        def rejoined(rec: PeerRec, after: float) -> float | None:
            for t, key, digest in rec.applied:
                if t > after and majority.get(key) == digest and len(self.rounds[key]["digests"][digest]) > 1:
                    return t
            return None

        def cut_short(f: dict[str, Any]) -> str | None:
            # A later kill or leave of the same peer before it came back: whether it would have is not known (the
            # draw killed 4 of 7 joiners 75–100 s after they joined, before their first apply, in churn_memory).
            for g in self.faults:
                if g is not f and f["t"] < g["t"] <= now and g["kind"] in ("kill", "leave") \
                        and g.get("target") == f.get("target"):
                    return f"{g['kind']} {g['t'] - f['t']:.0f} s after it"
            return None

        def hit_again(f: dict[str, Any], recs: list[PeerRec | None], back: list[float | None],
                      start: float) -> tuple[float, str] | None:
            # A later cut or stop of a peer that was not back yet, begun within the window: the clock restarts at its
            # end (math.inf while it lasts). Seed 12 cut one region off three times in 210 s (churn_seed12d), and its
            # peers could not be back from the first cut before the next one began.
            names = {r.name for b, r in zip(back, recs, strict=True) if r is not None and b is None}
            ends = []
            for g in self.faults:
                if g is f or not f["t"] < g["t"] <= min(now, start + within):
                    continue
                hit = names & set(g["peers"]) if g["kind"] == "partition" else \
                    names & {g.get("target")} if g["kind"] == "stop" else set()
                if hit:
                    end = g.get("healed") if g["kind"] == "partition" else g.get("resumed")
                    ends.append((math.inf if end is None else max(start, end),
                                 f"{g['kind']} of {g['target']} {g['t'] - f['t']:.0f} s after it"))
            return max(ends) if ends else None

        for f in self.faults:
            if f["survived"] is not None or "cut_short_by" in f:
                continue
            kind, rec = f["kind"], self.peers.get(f.get("target", ""))
            start = {"kill": f.get("restarted"), "stop": f.get("resumed"), "partition": f.get("healed"),
                     "join": f["t"], "leave": f["t"]}[kind]
            if start is None:
                continue
            if final and kind != "leave":
                continue
            if kind == "leave":
                if "exit_code" in f:
                    f["survived"] = f["exit_code"] == 0 and rec is not None and rec.life.json.exists()
                elif now - start > self.a.leave_grace:
                    f["survived"] = False
                continue
            recs = [self.peers[n] for n in f["peers"]] if kind == "partition" else [rec]
            back = [rejoined(r, start) if r is not None else None for r in recs]
            alive = [r for r in recs if r is not None and r.state in ("live", "stopped", "leaving")]
            if kind == "partition":  # the rest of the swarm went on while the region was cut off
                f["rounds_applied_elsewhere_during"] = len({key for p in self.peers.values() if p.region != f["target"]
                                                            for t, key, _ in p.applied if f["t"] <= t <= start})
            if kind == "stop":
                f["rounds_applied_by_others_during"] = len({key for p in self.peers.values() if p is not rec
                                                            for t, key, _ in p.applied if f["t"] <= t <= start})
            if all(b is not None for b, r in zip(back, recs, strict=True) if r in alive) and alive:
                f["survived"] = True
                f["back_after"] = max(b for b in back if b is not None) - start
            elif kind != "partition" and not alive and (by := cut_short(f)) is not None:
                f["cut_short_by"] = by  # survived stays None: unknown
            elif not alive or now - (again := hit_again(f, recs, back, start) or (start, ""))[0] > within:
                if alive and again[1]:
                    f["clock_restarted_by"] = again[1]
                f["survived"] = False
                f["not_back"] = [r.name for b, r in zip(back, recs, strict=True) if r is not None and b is None]

    # ------------------------------------------------------------------ samples
    def sample(self, rss: bool) -> None:
        now = time.time()
        computing = sum(1 for p in self.peers.values() if p.state == "live" and p.life.proc.poll() is None)
        running = sum(1 for p in self.peers.values() if p.life.proc.poll() is None)
        self.live.append((now, computing, running))
        self.load.append((now, os.getloadavg()[0]))
        if rss:
            for p in self.peers.values():
                if p.life.proc.poll() is None and p.state != "dead":
                    p.rss.append((now, rss_tree_mb(p.life.proc.pid)))

    # ------------------------------------------------------------------ the phase
    def run(self, report: Report) -> None:
        a = self.a
        method = "" if a.late == "stall" else f'[method]\nlate = "{a.late}"\n'
        (self.work / "fresh_start.toml").write_text("[peer]\nsync_on_join = false\n" + method)
        (self.work / "method.toml").write_text(method)
        print(f"[{self.name}] {a.peers} peers in {len(self.regions)} regions, {a.minutes:g} min"
              + (f", a fault every {a.every:g} s" if self.with_faults else ", no faults"), flush=True)
        with Testbed(self.spec()) as tb:
            try:
                bh = self.boot_host()
                listen, announce = tb.maddrs(bh)
                bf = self.work / "boot.maddrs"
                boot = tb.run(bh, [*P2PTRAIN, "bootstrap", "--host-maddrs", listen[0], "--announce-maddrs",
                                   announce[0], "--maddrs-file", str(bf)],
                              stdout=(self.work / "boot.log").open("wb"), stderr=subprocess.STDOUT)
                self.boot = [m for m in wait_lines(bf, 90, boot) if "/ip4/10.200." in m][:1]
                for s in range(a.peers):
                    self.new_peer(tb, s, fresh=True)
                    time.sleep(a.stagger)
                self.t0 = time.time()
                start = self.t0 + a.warmup
                end = start + 60 * a.minutes
                self.window = (start, end)
                next_fault = start if self.with_faults else math.inf
                last_rss = last_write = 0.0
                while time.time() < end:
                    now = time.time()
                    self.due_timers(tb)
                    if now >= next_fault:
                        self.inject(tb)
                        next_fault += a.every
                    self.reap()
                    self.read_logs()
                    rss = now - last_rss >= a.rss_every
                    last_rss = now if rss else last_rss
                    self.sample(rss)
                    self.judge()
                    if now - last_write >= 10:
                        last_write = now
                        report.write()
                    time.sleep(1.0)
                self.finish(tb)
            finally:
                for rec in self.peers.values():  # nothing stays frozen behind us
                    if rec.life.proc.poll() is None:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(rec.life.proc.pid, signal.SIGCONT)
        self.ended = True
        report.write()

    def finish(self, tb: Testbed) -> None:
        """Undo what is still faulted, go on without faults for ``--drain`` seconds (killed peers restart), ask every
        peer to leave (SIGTERM), read what they left behind."""
        self.reap()
        self.read_logs()
        self.judge()
        for region in list(self.partitioned):
            tb.partition(region, False)
        self.partitioned.clear()
        for _, action, arg in self.timers:
            if action == "cont":
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(arg.life.proc.pid, signal.SIGCONT)
                arg.state = "live"
        self.timers = [t for t in self.timers if t[1] == "restart"]
        if self.a.drain > 0:
            # The swarm goes on without faults for a while (killed peers restart) before everyone leaves: what the
            # window trained and a fault held back (a round that failed for a cut in its last minutes) may still
            # reach θ, as it would in a swarm that did not stop here. Tokens trained meanwhile are outside the
            # window: the goodput of tokens reaching θ counts a round for its interval's share inside the window.
            print(f"[{self.name}] window over: {self.a.drain:g} s without faults before the leaves", flush=True)
            end = time.time() + self.a.drain
            while time.time() < end:
                self.due_timers(tb)
                self.reap()
                self.read_logs()
                self.sample(False)
                time.sleep(1.0)
        self.timers = []  # killed peers not back by now stay down
        for rec in self.peers.values():
            if rec.life.proc.poll() is None and rec.state in ("live", "stopped"):
                rec.life.proc.send_signal(signal.SIGTERM)
                rec.state = "leaving"
                rec.life.how = rec.life.how or "left at the end"
        deadline = time.time() + self.a.leave_grace
        while time.time() < deadline and any(p.life.proc.poll() is None for p in self.peers.values()
                                             if p.state != "dead"):
            self.reap()
            self.read_logs()
            time.sleep(1.0)
        self.reap()
        self.read_logs()
        self.judge(final=True)
        for rec in self.peers.values():
            for life in rec.lives:
                if life.json.exists():
                    with contextlib.suppress(ValueError, OSError):
                        s = json.loads(life.json.read_text())
                        self.summaries[f"{rec.name}.{life.index}"] = {
                            k: s.get(k) for k in ("peer_id", "steps", "val_loss", "rounds_complete", "rounds_partial",
                                                  "rounds_failed", "rounds_applied", "stuck_rounds", "repairs",
                                                  "stall_seconds", "loop_seconds", "utilization")} | {
                            "applied": s.get("applied", {})}

    # ------------------------------------------------------------------ figures
    def in_window(self, t: float) -> bool:
        return self.window[0] <= t <= self.window[1]

    def round_rows(self) -> dict[str, dict[str, Any]]:
        out = {}
        for key, r in sorted(self.rounds.items(), key=lambda kv: kv[1]["first"]):
            n = sum(len(v) for v in r["digests"].values())
            top = max(r["digests"].items(), key=lambda kv: len(kv[1]), default=(None, []))
            outcome = "applied" if n else ("stuck" if r["stuck"] else "failed")
            out[key] = {"fragment": r["fragment"], "t": r["first"] - self.t0 if n else None, "outcome": outcome,
                        "applied_by": n, "distinct_theta": len(r["digests"]), "diverged": n - len(top[1]),
                        "diverged_peers": sorted(p for d, ps in r["digests"].items() if d != top[0] for p in ps),
                        "members_min": min(r["members"], default=0), "members_max": max(r["members"], default=0),
                        "tokens": r["tokens"].get(top[0], 0) if top[0] else 0, "failed_on": r["failed"],
                        "failed_why": dict(r["why"]), "stuck_on": r["stuck"], "abandoned_on": r["abandoned"], "flagged_divergent": r["flagged"],
                        "own": r["own"], "shards_stood_in": len(r["stood_in"]),
                        "in_window": bool(n) and self.in_window(r["first"])}
        return out

    def figures(self) -> dict[str, Any]:
        rows = self.round_rows()
        win = [r for r in rows.values() if r["in_window"]]
        stuck = [s for r in rows.values() for s in r["stuck_on"]]
        # tokens trained: per life, the inner steps its status lines saw advance inside the window
        seq = self.a.batch_size * _seq_len(self.a.preset)
        steps = 0
        for p in self.peers.values():
            pts = [(t, s) for t, s, _ in p.loss if self.in_window(t)]
            for (_, s0), (_, s1) in itertools.pairwise(pts):
                steps += max(0, s1 - s0)
        growth = []
        for p in self.peers.values():
            pts = [(t, m) for t, m in p.rss if t >= self.window[0]]
            if len(pts) >= 6 and pts[-1][0] - pts[0][0] >= 300:
                first = statistics.median(m for _, m in pts[:3])
                last = statistics.median(m for _, m in pts[-3:])
                growth.append({"peer": p.name, "start_mb": first, "end_mb": last, "minutes": (pts[-1][0] - pts[0][0]) / 60,
                               "growth_mb_per_min": (last - first) / ((pts[-1][0] - pts[0][0]) / 60)})
        by_kind: dict[str, dict[str, int]] = {k: {"injected": 0, "survived": 0, "not_survived": 0, "pending": 0}
                                              for k in KINDS}
        for f in self.faults:
            k = by_kind[f["kind"]]
            k["injected"] += 1
            k["survived" if f["survived"] else "pending" if f["survived"] is None else "not_survived"] += 1
        return {
            "rounds_in_window": len(win), "rounds_applied_in_window": sum(r["outcome"] == "applied" for r in win),
            "rounds_with_diverged_replicas": sum(r["diverged"] > 0 for r in rows.values()),
            "diverged_replicas": sum(r["diverged"] for r in rows.values()),
            "rounds_failed_everywhere": sum(r["outcome"] == "failed" for r in rows.values()),
            "round_failures": sum(len(r["failed_on"]) for r in rows.values()),
            **_stood_in(list(rows.values())),
            "failure_kinds": failure_kinds(list(rows.values())),
            "failure_kinds_everywhere": failure_kinds(list(rows.values()), everywhere=True),
            "stuck_rounds": len([s for s in stuck if "leaving" not in s]),
            "stuck_rounds_when_leaving": len([s for s in stuck if "leaving" in s]),
            "rounds_abandoned_when_leaving": sum(len(r["abandoned_on"]) for r in rows.values()),
            # each fragment's round carries the tokens since that fragment's last round that was not aborted (an
            # aborted round's progress rides on the next one's Δ, p2ptrain/driver.py): a token reaches all of θ
            # once every fragment's round that holds it is applied, so the sum over rounds counts it P times
            "tokens_in_theta": sum(r["tokens"] for r in win) / self.fragments,
            "tokens_in_theta_own": sum(r["own"] for r in win) / self.fragments,
            "tokens_trained": steps * seq,
            "members_median": statistics.median([r["members_max"] for r in win]) if win else None,
            "faults": by_kind, "rss_growth": growth,
            "rss_growth_mb_per_min_median": statistics.median(g["growth_mb_per_min"] for g in growth) if growth else None,
            "rss_growth_mb_per_min_max": max((g["growth_mb_per_min"] for g in growth), default=None),
        }

    def to_json(self) -> dict[str, Any]:
        def rel(t: float) -> float:
            return round(t - self.t0, 2)

        return {
            "phase": self.name, "faults_on": self.with_faults, "run_id": self.run_id, "work": str(self.work),
            "started_unix": self.t0, "window_s": [rel(self.window[0]), rel(self.window[1])], "ended": self.ended,
            "figures": self.figures() if not math.isnan(self.t0) else {},
            "faults": [{**f, "t": rel(f["t"]), **{k: rel(f[k]) for k in ("healed", "resumed", "restarted") if k in f}}
                       for f in self.faults],
            "live": [[rel(t), c, r] for t, c, r in self.live[::5]],
            "load": [[rel(t), round(x, 2)] for t, x in self.load[::5]],
            "rounds": self.round_rows(),
            "peers": {p.name: {"slot": p.slot, "host": p.host, "region": p.region,
                               "lives": [{"started": rel(x.started), "ended": None if x.ended is None else rel(x.ended),
                                          "exit_code": x.code, "how": x.how, "log": x.log.name} for x in p.lives],
                               "rss_mb": [[rel(t), round(m, 1)] for t, m in p.rss],
                               "loss": [[rel(t), s, round(v, 4)] for t, s, v in p.loss]} for p in self.peers.values()},
            "summaries": self.summaries,
        }


def _seq_len(preset: str) -> int:
    from p2ptrain.model import preset as model_preset

    return int(model_preset(preset).seq_len)


# ---------------------------------------------------------------------------------------------- report
class Report:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a, self.phases = a, []

    def payload(self) -> dict[str, Any]:
        out: dict[str, Any] = {"args": vars(self.a) | {"out": str(self.a.out)},
                               "phases": {p.name: p.to_json() for p in self.phases}}
        figs = {p.name: p.figures() for p in self.phases if not math.isnan(p.t0)}
        # (a phase stopped early is no ratio's side: a 2-minute baseline once made a goodput of 12)
        ended = all(p.ended for p in self.phases if p.name in ("faults", "baseline"))
        if ended and "faults" in figs and "baseline" in figs and figs["baseline"]["tokens_in_theta"]:
            out["goodput"] = figs["faults"]["tokens_in_theta"] / figs["baseline"]["tokens_in_theta"]
            if figs["baseline"]["tokens_in_theta_own"]:
                out["goodput_own"] = figs["faults"]["tokens_in_theta_own"] / figs["baseline"]["tokens_in_theta_own"]
            if figs["baseline"]["tokens_trained"]:
                out["tokens_trained_ratio"] = figs["faults"]["tokens_trained"] / figs["baseline"]["tokens_trained"]
            kept = {name: kept_tokens(ph, self.a.P) for name, ph in out["phases"].items()}
            if kept.get("faults") is not None and kept.get("baseline"):
                out["goodput_kept"] = kept["faults"] / kept["baseline"]
            reached = {name: reached_tokens(ph, self.a.P, self.a.step_seconds) for name, ph in out["phases"].items()}
            if reached.get("faults") is not None and reached.get("baseline"):
                out["goodput_reached"] = reached["faults"] / reached["baseline"]
        return out

    def write(self) -> None:
        from bench.harness import write_json

        tmp = self.a.out.with_suffix(".json.tmp")
        write_json(tmp, self.payload())
        tmp.replace(self.a.out)


def _life_of(lives: list[dict[str, Any]], t: float) -> int:
    """The index of the life running at ``t`` (seconds since the phase started)."""
    i = 0
    for k, life in enumerate(lives):
        if life["started"] <= t:
            i = k
    return i


#: Seconds of a peer process's life its memory growth is not counted from (see :func:`memory_growth`).
WARMUP_S = 600.0


def memory_growth(ph: dict[str, Any], after_start: float = WARMUP_S, min_span: float = 300.0) -> list[dict[str, Any]]:
    """Resident memory growth of every peer process that lived ``min_span`` seconds inside the window, from
    ``after_start`` seconds after it started to its end: the least-squares slope of its samples (its RSS saws up
    and down by ~20 MB every few minutes, so two ends of three samples each could read ±1 MB/min of noise as growth).

    A process's first minutes are a warm-up, not growth: imports, the first rounds, the allocator's arenas and the
    caches take a fresh peer from ~340 MB to a plateau near 545 MB, reached within 4–8 minutes in the fault-free
    phase of ``churn_cut_leader`` (its peers then stay within ±10 MB of it for the remaining 22 minutes). Counted
    from minute 2, that ramp made up most of the "growth" of every run before (and of short-lived processes above
    all); :data:`WARMUP_S` leaves it out. ``after_start=120`` gives the earlier figure."""
    w0, w1 = ph["window_s"]
    out = []
    for name, p in ph["peers"].items():
        by_life: dict[int, list[tuple[float, float]]] = {}
        for t, mb in p["rss_mb"]:
            i = _life_of(p["lives"], t)
            if t >= max(w0, p["lives"][i]["started"] + after_start) and t <= w1:
                by_life.setdefault(i, []).append((t, mb))
        for i, pts in by_life.items():
            if len(pts) < 6 or pts[-1][0] - pts[0][0] < min_span:
                continue
            t0, t1 = pts[0][0], pts[-1][0]
            first = statistics.median(m for t, m in pts if t <= t0 + 240)
            last = statistics.median(m for t, m in pts if t >= t1 - 240)
            slope = statistics.linear_regression([t for t, _ in pts], [m for _, m in pts]).slope
            out.append({"peer": f"{name}.{i}", "start_mb": round(first, 1), "end_mb": round(last, 1),
                        "minutes": round((t1 - t0) / 60, 1), "growth_mb_per_min": round(slope * 60, 3)})
    return out


def _stood_in(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Shards carried with a stand-in (counted once per carrier that logged it), the rounds that had any, and those
    of them applied (records from before stand-ins count 0)."""
    had = [r for r in rows if r.get("shards_stood_in")]
    return {"shards_stood_in": sum(r["shards_stood_in"] for r in had), "rounds_with_stand_in": len(had),
            "rounds_with_stand_in_applied": sum(r["outcome"] == "applied" for r in had)}


def phase_figures(ph: dict[str, Any], fragments: int) -> dict[str, Any]:
    """The figures of one phase, from its JSON record alone (so a report can be remade from churn.json)."""
    rows = list(ph["rounds"].values())
    win = [r for r in rows if r["in_window"]]
    stuck = [s for r in rows for s in r["stuck_on"]]
    growth = memory_growth(ph)
    rates = [g["growth_mb_per_min"] for g in growth]
    early = [g["growth_mb_per_min"] for g in memory_growth(ph, after_start=120.0)]
    kinds: dict[str, dict[str, int]] = {k: {"injected": 0, "survived": 0, "not_survived": 0, "pending": 0}
                                        for k in KINDS}
    for f in ph["faults"]:
        k = kinds[f["kind"]]
        k["injected"] += 1
        k["survived" if f["survived"] else "pending" if f["survived"] is None else "not_survived"] += 1
    w0, w1 = ph["window_s"]
    covered = min(w1, max((t for t, _, _ in ph["live"]), default=w0)) - w0
    return {
        "minutes_covered": round(covered / 60, 2),
        "rounds_applied_in_window": sum(r["outcome"] == "applied" for r in win),
        "rounds_with_diverged_replicas": sum(r["diverged"] > 0 for r in rows),
        "diverged_replicas": sum(r["diverged"] for r in rows),
        "rounds_failed_everywhere": sum(r["outcome"] == "failed" for r in rows),
        "round_failures": sum(len(r["failed_on"]) for r in rows),
        **_stood_in(rows),
        "failure_kinds": failure_kinds(rows),
        "failure_kinds_everywhere": failure_kinds(rows, everywhere=True),
        "stuck_rounds": len([s for s in stuck if "leaving" not in s]),
        "stuck_rounds_when_leaving": len([s for s in stuck if "leaving" in s]),
        "rounds_abandoned_when_leaving": sum(len(r.get("abandoned_on", [])) for r in rows),
        "tokens_in_theta": sum(r["tokens"] for r in win) / fragments,
        # the appliers' own tokens (``own=`` on their applied lines; 0 in records from before it was kept)
        "tokens_in_theta_own": sum(r.get("own", 0) for r in win) / fragments,
        "tokens_trained": (ph.get("figures") or {}).get("tokens_trained", 0),
        "members_median": statistics.median([r["members_max"] for r in win]) if win else None,
        "faults": kinds, "rss_growth": growth,
        "rss_growth_mb_per_min_median": statistics.median(rates) if rates else None,
        "rss_growth_mb_per_min_max": max(rates, default=None),
        "rss_growth_from_minute_2_median": statistics.median(early) if early else None,
        "rss_mb_median": statistics.median([m for p in ph["peers"].values() for t, m in p["rss_mb"]
                                            if w0 <= t <= w1]) if ph["peers"] else None,
        # (records from before the load was kept have none)
        "load_average_median": statistics.median(loads) if (loads := [x for t, x in ph.get("load", [])
                                                                      if w0 <= t <= w1]) else None,
    }


#: Memory counts as flat when the median peer grows less than this (MB per minute, after its warm-up: WARMUP_S).
FLAT_MB_PER_MIN = 0.5


def kept_tokens(ph: dict[str, Any], fragments: int) -> float | None:
    """Tokens in θ counted in the rounds whose θ the swarm kept (bench/churn_rounds.py): a round applied by a
    minority and repaired away counts in ``tokens_in_theta`` but is in no θ. None when the phase's logs are gone."""
    if not Path(ph["work"]).exists():
        return None
    kept = kept_rounds(ph)
    return sum(r["tokens"] for k, r in ph["rounds"].items() if r["in_window"] and kept.get(k, False)) / fragments


def reached_tokens(ph: dict[str, Any], fragments: int, step_seconds: float) -> float | None:
    """The tokens trained inside the window that reached a kept θ by the run's end
    (bench/churn_rounds.py ``trained_in_window_reaching_theta``). None when the phase's logs are gone."""
    if not Path(ph["work"]).exists():
        return None
    return trained_in_window_reaching_theta(ph, fragments, step_seconds, kept_rounds(ph))


def targets(payload: dict[str, Any], figs: dict[str, dict[str, Any]]) -> list[tuple[str, str, bool | None]]:
    """The issue's done-when targets for churn: (target, measured, holds)."""
    f = figs.get("faults")
    if not f:
        return []
    # (runs from before each: the rounds kept in the window; before that, every applied round in it)
    g = payload.get("goodput_reached", payload.get("goodput_kept", payload.get("goodput")))
    m = f["rss_growth_mb_per_min_median"]
    return [
        ("0 diverged replicas after any applied round", f"{f['diverged_replicas']} in {f['rounds_with_diverged_replicas']}"
                                                          " rounds", f["diverged_replicas"] == 0),
        ("0 stuck rounds", f"{f['stuck_rounds']} (+{f['stuck_rounds_when_leaving']} when leaving; "
                           f"{f.get('rounds_abandoned_when_leaving', 0)} abandoned by a leave)",
         f["stuck_rounds"] + f["stuck_rounds_when_leaving"] == 0),
        ("goodput ≥ 0.98 of the fault-free run", "-" if g is None else f"{g:.3f}", None if g is None else g >= 0.98),
        (f"memory flat (median growth < {FLAT_MB_PER_MIN} MB/min from minute {WARMUP_S / 60:g} of each process)",
         "-" if m is None else f"median {m:+.2f}, max {f['rss_growth_mb_per_min_max']:+.2f} MB/min over "
                               f"{len(f['rss_growth'])} peer processes that lived {WARMUP_S / 60 + 5:g} min or more"
                               + ("" if (e := f.get("rss_growth_from_minute_2_median")) is None else
                                  f" (from minute 2, warm-up included: median {e:+.2f})"),
         None if m is None else m < FLAT_MB_PER_MIN),
    ]


def _plot(payload: dict[str, Any], path: Path) -> None:
    from p2ptrain.plot import pyplot

    plt = pyplot()
    a = payload["args"]
    fragments = a["P"] if a["method"] in ("streaming", "cocodc") else 1
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    (ax_live, ax_tok), (ax_loss, ax_mem) = axes
    colors = {"faults": "tab:red", "baseline": "tab:blue"}
    for name, ph in payload["phases"].items():
        if not ph.get("live"):
            continue
        c = colors.get(name, "gray")
        w0 = ph["window_s"][0]
        ax_live.step([(t - w0) / 60 for t, _, _ in ph["live"]], [n for _, n, _ in ph["live"]], where="post", color=c,
                     label=f"{name}: peers computing")
        rows = sorted((r for r in ph["rounds"].values() if r["in_window"]), key=lambda r: r["t"])
        cum, xs, ys = 0.0, [], []
        for r in rows:
            cum += r["tokens"] / fragments
            xs.append((r["t"] - w0) / 60)
            ys.append(cum / 1e6)
        ax_tok.plot(xs, ys, color=c, label=name)
        bins: dict[int, list[float]] = {}
        for p in ph["peers"].values():
            for t, _, v in p["loss"]:
                if math.isfinite(v):
                    bins.setdefault(int((t - w0) // 30), []).append(v)
        ks = sorted(bins)
        ax_loss.plot([(k * 30 + 15) / 60 for k in ks], [statistics.median(bins[k]) for k in ks], color=c, label=name)
        for p in ph["peers"].values():
            ax_mem.plot([(t - w0) / 60 for t, _ in p["rss_mb"]], [m for _, m in p["rss_mb"]], color=c, alpha=0.35,
                        lw=0.8)
        if ph["faults_on"]:
            marks = {"kill": "x", "stop": "s", "partition": "^", "join": "+", "leave": "v"}
            for kind, mk in marks.items():
                ts = [(f["t"] - w0) / 60 for f in ph["faults"] if f["kind"] == kind]
                ax_live.scatter(ts, [0.5] * len(ts), marker=mk, color="black", s=18, label=kind)
    ax_live.set_ylabel("live peers (computing: not frozen, not dead)")
    ax_live.set_ylim(bottom=0)
    ax_live.legend(fontsize=7, ncol=2)
    ax_tok.set_ylabel("tokens that reached θ (M, cumulative)")
    ax_tok.legend(fontsize=8)
    ax_loss.set_ylabel("train loss (median of live peers, 30 s bins)")
    ax_loss.legend(fontsize=8)
    ax_mem.set_ylabel("RSS per peer + its daemon (MB)")
    for ax in axes.flat:
        ax.set_xlabel("minutes since the measured window started")
        ax.axvline(0, color="gray", lw=0.6, ls="--")
    fig.suptitle(f"churn: {a['peers']} peers, {a['regions']} regions, {a['method']}/{a['preset']}, a fault every "
                 f"{a['every']:g} s (red) vs none (blue)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _markdown(payload: dict[str, Any]) -> str:
    a = payload["args"]
    fragments = a["P"] if a["method"] in ("streaming", "cocodc") else 1
    figs = {n: phase_figures(ph, fragments) for n, ph in payload["phases"].items() if ph.get("live")}
    lines = [f"# Churn: {a['peers']} peers in {a['regions']} regions, a fault every {a['every']:g} s for "
             f"{a['minutes']:g} min", "", f"`{payload.get('command', '')}`", "",
             f"{a['method']}, preset {a['preset']}, batch {a['batch_size']}, H {a['H']}"
             + (f", P {a['P']}, τ {a['tau']}" if a["method"] in ("streaming", "cocodc") else "")
             + f", step {a['step_seconds']:g} s (inner steps padded to it), join window "
               f"{a['join_window'] if a['join_window'] is not None else 'default'}; regions with "
               f"{a['between_rate']} uplinks, {a['delay_ms']:g} ms one way between them; one thread per peer on "
               f"{payload.get('machine', {}).get('cores', '?')} cores.", ""]
    for name, f in figs.items():
        ph = payload["phases"][name]
        if (load := f.get("load_average_median")) is not None:
            lines += [f"{name}: the machine's load average in the window, median {load:.1f}.", ""]
        if not ph["ended"]:
            lines += [f"**{name}: stopped after {f['minutes_covered']:g} of {a['minutes']:g} minutes** (partial).", ""]
    if "faults" in figs:
        k = figs["faults"]["faults"]
        lines += ["| fault | injected | survived | not survived | unknown |", "|---|---:|---:|---:|---:|"]
        for kind in KINDS:
            d = k[kind]
            lines.append(f"| {kind} | {d['injected']} | {d['survived']} | {d['not_survived']} | {d['pending']} |")
        tot = {x: sum(k[kind][x] for kind in KINDS) for x in ("injected", "survived", "not_survived", "pending")}
        lines += [f"| **all** | {tot['injected']} | {tot['survived']} | {tot['not_survived']} | {tot['pending']} |",
                  "", "Survived: the peer (a cut region: each of its peers) applied a round with the majority's θ "
                  f"again within {a['survive_within']:g} s of coming back; a leave: exit code 0 and its summary "
                  "written. Unknown: the window ended first, or a later kill or leave of the same peer came before "
                  "it was back. A later cut or stop of a peer not back yet restarts its clock at that fault's "
                  "end.", ""]
    lines += ["| phase | minutes | rounds applied | members (median) | diverged replicas (rounds) | rounds failed "
              "everywhere | round failures on a peer | stuck rounds | tokens in θ (M) | tokens trained (M) | "
              "RSS median MB | RSS growth MB/min (median / max) |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, f in figs.items():
        g1, g2 = f["rss_growth_mb_per_min_median"], f["rss_growth_mb_per_min_max"]
        lines.append(f"| {name} | {f['minutes_covered']:g} | {f['rounds_applied_in_window']} | {f['members_median']} "
                     f"| {f['diverged_replicas']} ({f['rounds_with_diverged_replicas']}) | "
                     f"{f['rounds_failed_everywhere']} | {f['round_failures']} | {f['stuck_rounds']} "
                     f"(+{f['stuck_rounds_when_leaving']} when leaving) | {f['tokens_in_theta'] / 1e6:.2f} | "
                     f"{f['tokens_trained'] / 1e6:.2f} | {f['rss_mb_median'] or 0:.0f} | "
                     f"{'-' if g1 is None else f'{g1:+.2f}'} / {'-' if g2 is None else f'{g2:+.2f}'} |")
    for name, f in figs.items():
        for everywhere in (False, True):
            kinds = f.get("failure_kinds_everywhere" if everywhere else "failure_kinds") or {}
            if kinds:
                top = "; ".join(f"{k} ({n})" for k, n in list(kinds.items())[:6])
                lines += ["", f"Why rounds failed on a peer{' (rounds failed everywhere)' if everywhere else ''}, "
                              f"{name}, most common first: {top}."]
    for name, f in figs.items():
        if f.get("shards_stood_in"):
            lines += ["", f"Shards a stand-in carried for a silent carrier in a round of two cells, {name}: "
                          f"{f['shards_stood_in']}, in {f['rounds_with_stand_in']} rounds "
                          f"({f['rounds_with_stand_in_applied']} of them applied)."]
    for name, ph in payload["phases"].items():
        if not any(f["kind"] == "partition" for f in ph.get("faults", [])) or "started_unix" not in ph:
            continue
        by_cut = rounds_by_cut(ph, a["step_seconds"], a.get("partition_seconds", 60.0))
        lines += ["", f"Rounds of {name} by where they stood against the region cuts (a round began at its logical "
                      "step; mid-round: a cut began within 45 s after it; after a heal: within 45 s after one "
                      "ended):", "", "| rounds | in the window | failed everywhere | failures on a peer |",
                  "|---|---:|---:|---:|"]
        lines += [f"| {k} | {by_cut[k]['rounds']} | {by_cut[k]['failed_everywhere']} | {by_cut[k]['failures']} |"
                  for k in CUT_STATES]
    if payload.get("baseline_from"):
        lines += ["", f"The fault-free phase is {payload['baseline_from']}."]
    if "goodput" in payload:
        lines += ["", f"Goodput (tokens that reached θ, faults / fault-free): **{payload['goodput']:.3f}**; "
                      f"tokens trained, faults / fault-free: {payload.get('tokens_trained_ratio', math.nan):.3f}."]
        if "goodput_kept" in payload:
            lines += ["", f"Goodput in the rounds whose θ the swarm kept (a round applied by a minority is repaired "
                          f"away, bench/churn_rounds.py): **{payload['goodput_kept']:.3f}**."]
        if "goodput_reached" in payload:
            lines += ["", f"Goodput of the tokens trained in the window that reached a kept θ by the run's end (a "
                          f"round carries what its members trained since its fragment's last applied round; the share "
                          f"of that interval inside the window counts, whenever the round was applied, so the leaves' "
                          f"flush after the window counts for what the window trained): "
                          f"**{payload['goodput_reached']:.3f}** (the target's figure)."]
        if "goodput_own" in payload:
            lines += ["", f"Goodput counted by the appliers' own tokens (each applier's `own=`: a contributor that "
                          f"died or left before applying is missed): {payload['goodput_own']:.3f}. The two differ where a round's "
                          "total holds weight of members that did not apply it, or of members outvoted in it (`own=0`: "
                          "their tokens ride on their next round, and would count twice)."]
    if ts := targets(payload, figs):
        lines += ["", "| done-when target | measured | holds |", "|---|---|---|"]
        for what, measured, ok in ts:
            lines.append(f"| {what} | {measured} | {'unknown' if ok is None else 'yes' if ok else '**no**'} |")
    lines += ["", "Members: contributors a peer's applied round names (hierarchical rounds: its region's and the "
                  "carriers it met across regions, not the whole group). Tokens in θ: the total weight of every round "
                  "applied by the majority in the window, over the P fragments (each fragment's round carries the "
                  "tokens since that fragment's last round that was not aborted, whose progress its Δ holds)."]
    return "\n".join(lines) + "\n"


def write_report(payload: dict[str, Any], out: Path) -> None:
    """churn.md and churn.png next to ``out`` from its JSON payload (sections written by hand between block markers,
bench/md_blocks.py, are kept)."""
    from bench.md_blocks import blocks

    md = out.with_suffix(".md")
    kept = blocks(md)
    md.write_text(_markdown(payload) + "".join("\n" + b for b in kept.values()))
    _plot(payload, out.with_suffix(".png"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=16)
    ap.add_argument("--regions", type=int, default=3, choices=(2, 3))
    ap.add_argument("--spare", type=int, default=2, help="slots beyond --peers for joiners (a leave frees one)")
    ap.add_argument("--minutes", type=float, default=30.0, help="the measured window of each phase")
    ap.add_argument("--every", type=float, default=25.0, help="seconds between faults (≤ 30)")
    ap.add_argument("--phases", default="faults,baseline", help="faults, baseline, or both (in that order)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=float, default=60.0, help="seconds from the last start to the window")
    ap.add_argument("--method", default="streaming", choices=("streaming", "diloco"))
    ap.add_argument("--preset", default="micro")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--H", type=int, default=40)
    ap.add_argument("--P", type=int, default=4)
    ap.add_argument("--tau", type=int, default=5)
    ap.add_argument("--late", default="stall", choices=("stall", "apply"),
                    help="streaming: a round not in at send + τ is waited for (stall) or applied when it arrives")
    ap.add_argument("--step-seconds", type=float, default=1.0)
    ap.add_argument("--min-step-seconds", type=float, default=None, help="pad inner steps (default: --step-seconds)")
    ap.add_argument("--join-window", type=float, default=None)
    ap.add_argument("--host-rate", default="1gbit")
    ap.add_argument("--between-rate", default="100mbit")
    ap.add_argument("--delay-ms", type=float, default=40.0, help="one-way delay between two regions")
    ap.add_argument("--restart-after", type=float, default=10.0)
    ap.add_argument("--start-nice", type=int, default=0,
                    help="a restart's or joiner's process group runs at niceness -N until it has started (connected "
                         "and training), as on a machine of its own; 0: off, it shares the cores like any peer")
    ap.add_argument("--checkpoint-every", type=int, default=1,
                    help="applied rounds between a peer's checkpoints: a kill loses the steps since its last one")
    ap.add_argument("--checkpoint-seconds", type=float, default=6.0,
                    help="seconds of training between a peer's checkpoints, whatever its rounds do")
    ap.add_argument("--drain", type=float, default=150.0,
                    help="seconds the swarm goes on without faults after the window before everyone leaves")
    ap.add_argument("--stop-seconds", type=float, default=20.0)
    ap.add_argument("--partition-seconds", type=float, default=60.0)
    ap.add_argument("--settle", type=float, default=30.0, help="a peer is not faulted in its first seconds")
    ap.add_argument("--survive-within", type=float, default=180.0)
    ap.add_argument("--leave-grace", type=float, default=240.0,
                    help="seconds a leave may take (its flush of unsent progress up to 120, the drain, a checkpoint)")
    ap.add_argument("--stagger", type=float, default=1.0)
    ap.add_argument("--rss-every", type=float, default=15.0)
    ap.add_argument("--out", type=Path, default=RESULTS / "churn.json")
    ap.add_argument("--report", type=Path, default=None,
                    help="only remake the .md and .png of an existing churn JSON (written next to it)")
    a = ap.parse_args()
    if a.report is not None:
        write_report(json.loads(a.report.read_text()), a.report)
        print(a.report.with_suffix(".md").read_text(), flush=True)
        return
    exit_on_sigterm()
    if a.every > 30:
        raise SystemExit("--every must be at most 30 s")
    if a.late != "stall" and a.method != "streaming":
        raise SystemExit("--late is streaming's")
    if (reason := unavailable_reason()) is not None:
        raise SystemExit(f"testbed unavailable: {reason}")
    work = Path(tempfile.mkdtemp(prefix="p2ptrain-churn-"))
    print(f"logs in {work}", flush=True)
    report = Report(a)
    try:
        for name in [p.strip() for p in a.phases.split(",") if p.strip()]:
            if name not in ("faults", "baseline"):
                raise SystemExit(f"unknown phase {name!r}")
            ph = Phase(name, a, work / name, faults=name == "faults")
            ph.work.mkdir(parents=True, exist_ok=True)
            report.phases.append(ph)
            ph.run(report)
    finally:
        report.write()
        write_report(json.loads(a.out.read_text()), a.out)
        print(a.out.with_suffix(".md").read_text(), flush=True)
        print(f"wrote {a.out}, {a.out.with_suffix('.md')}, {a.out.with_suffix('.png')}", flush=True)


if __name__ == "__main__":
    main()
