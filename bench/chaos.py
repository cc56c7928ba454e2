"""Chaos: attacks and faults against real libp2p peers, and what each one cost the honest peers.

    python bench/chaos.py                      # every attack, 6 trials of 3 rounds each, then the peer faults
    python bench/chaos.py --trials 2 --only owner   # a quick look at the lying owners

Part 1, attacks on rounds (5 peers on 127.0.0.1 in this process, each with its own daemon and identity; a
fresh swarm per trial, the attacker drawn among the five): part owners that lie (×100, NaN, sign flip, a
shift of 10% of the norm, and a shift told to half the members only), a member that lies about its own
contribution to get an honest owner blamed, broken contributions of every kind, and a member whose daemon is
SIGKILLed mid-round. For every round an honest peer ends, the result is compared with what the honest
contributions it names average to (the exact weighted mean; a part left out is zero, never wrong):

* detected: rounds in which every honest peer refused the attack (banned, struck or left the dead member out)
  and ended the round;
* data lost: honest results with a value that is not the honest aggregate, or that differ between honest
  peers where both hold a part (must be 0);
* banned: attackers banned by every honest peer / honest peers banned by anyone (must be 0);
* cost: verification's bytes (claims sent, evidence received) per honest peer and round, against the round's.

Each row runs with the fp32 wire; the lying owners also with the 4-bit E3M0 wire (streaming's), where a lie
within the codec's own rounding is not distinguishable from it (collective/sketch.py).

Part 2, faults on peers (``p2ptrain`` processes): a checkpoint whose tensor data was overwritten, resumed by
``train --resume``; a peer of another preset; a peer with the wrong swarm key; two peers started in the same
second; SIGTERM while a peer's rounds fail. Each is tried ``--process-trials`` times.

Writes bench/results/chaos.json (row by row, as it goes) and chaos.md, and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.harness import RESULTS, machine, write_json

N = 5
NUMEL = 1 << 15  # 32 Ki values per round: parts of ~6.5 Ki, a real butterfly of several messages each


@dataclass
class Attack:
    name: str
    faults: dict[str, Any] = field(default_factory=dict)
    kill: bool = False
    codec: str = "fp32"
    group: str = "owner"  # owner | member | contribution | fault
    audit_rate: float = 1.0  # chunks of each part audited exactly per round (the default)
    norm_bound: float | None = None


def attacks() -> list[Attack]:
    rows = []
    for codec in ("fp32", "e3m0"):
        wire = "" if codec == "fp32" else " (e3m0 wire)"
        rows += [Attack(f"owner lies: ×100{wire}", {"lie": "scale"}, codec=codec),
                 Attack(f"owner lies: NaN{wire}", {"lie": "nan"}, codec=codec),
                 Attack(f"owner lies: sign flip{wire}", {"lie": "flip"}, codec=codec),
                 Attack(f"owner lies: +10% shift{wire}", {"lie": "shift"}, codec=codec),
                 Attack(f"owner lies to half the members{wire}", {"lie": "shift", "lie_to_some": True}, codec=codec)]
    for codec in ("fp32", "e3m0"):  # the smart liar: its claims add up, only an exact audit sees it
        wire = "" if codec == "fp32" else " (e3m0 wire)"
        rows += [Attack(f"owner passes a +10% shift off as its own share{wire}", {"lie": "shift", "forge": True},
                        codec=codec),
                 Attack(f"owner passes a +10% shift off as its own share{wire}, audit rate 4",
                        {"lie": "shift", "forge": True}, codec=codec, audit_rate=4.0)]
    rows.append(Attack("member lies about its contribution", {"frame": True}, group="member"))
    for kind in ("nan", "scale", "random", "shape", "truncate"):  # with the norm bound a hostile swarm sets
        rows.append(Attack(f"contribution: {kind} (norm bound 10)", {"corrupt": kind}, group="contribution",
                           norm_bound=10.0))
    rows.append(Attack("member SIGKILLed mid-round", {"kill_in_allreduce": 2}, kill=True, group="fault"))
    return rows


def update(i: int, trial: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * trial + i)
    return torch.randn(NUMEL, generator=g) * 0.01 + 0.001 * (i + 1)


@dataclass
class Row:
    attack: str
    codec: str
    rounds: int = 0  # rounds attacked (trials × rounds)
    detected: int = 0
    data_lost: int = 0
    attacker_banned: int = 0  # trials in which every honest peer banned the attacker
    honest_banned: int = 0
    trials: int = 0
    partial: int = 0  # honest results with a part left out
    failed: int = 0  # honest rounds that failed outright
    verify_bytes: list[float] = field(default_factory=list)  # per honest peer and round
    round_bytes: list[float] = field(default_factory=list)
    verify_seconds: list[float] = field(default_factory=list)
    round_seconds: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        def med(xs: list[float]) -> float:
            return statistics.median(xs) if xs else 0.0

        return {"attack": self.attack, "codec": self.codec, "trials": self.trials, "rounds": self.rounds,
                "detected": self.detected, "data_lost": self.data_lost, "attacker_banned": self.attacker_banned,
                "honest_banned": self.honest_banned, "partial_results": self.partial, "failed_results": self.failed,
                "verify_bytes_median": med(self.verify_bytes), "round_bytes_median": med(self.round_bytes),
                "verify_share": med(self.verify_bytes) / max(1.0, med(self.round_bytes)),
                "verify_seconds_median": med(self.verify_seconds), "round_seconds_median": med(self.round_seconds)}


def honest_part(owner: int, contributors: list[int], peer_ids: list[str], lo: int, hi: int, trial: int,
                codec: Any) -> torch.Tensor:
    """What an honest owner sends for part ``[lo, hi)``: its own share raw, the others' through the codec,
    their weighted mean (weights 1 + i) summed in the owner's order (by peer id), through the codec."""
    from p2ptrain.collective.aggregate import weighted_mean
    from p2ptrain.collective.butterfly import CHUNK_VALUES, wire_roundtrip

    order = sorted(contributors, key=lambda i: peer_ids[i])
    xs = [update(i, trial)[lo:hi] if i == owner else wire_roundtrip(codec, update(i, trial)[lo:hi], CHUNK_VALUES)
          for i in order]
    return wire_roundtrip(codec, weighted_mean(xs, [1.0 + i for i in order]).float(), CHUNK_VALUES)


async def one_trial(attack: Attack, trial: int, rounds: int, row: Row, rng: random.Random) -> None:
    from p2ptrain.collective.codecs import get_codec
    from p2ptrain.faults import FaultPlan
    from p2ptrain.net.guard import GuardConfig
    from p2ptrain.net.swarm import HivemindTransport, SwarmConfig
    from p2ptrain.net.transport import JoinRequest, PeerInfo

    bad = rng.randrange(N)
    codec = get_codec(attack.codec)
    ts: list[Any] = []
    try:
        for i in range(N):
            initial = await ts[0].visible_maddrs() if ts else []
            plan = FaultPlan(**attack.faults) if i == bad else FaultPlan()
            ts.append(await HivemindTransport.create(SwarmConfig(
                run_id=f"chaos-{trial}-{os.getpid()}", initial_peers=initial, join_window=1.0, ttl=30,
                guard=GuardConfig(ban_after=2, norm_bound=attack.norm_bound), audit_rate=attack.audit_rate,
                faults=plan)))
        if attack.kill:  # dying is the daemon's SIGKILL: the member vanishes from the network mid-round
            pid = ts[bad].p2p._child.pid
            ts[bad].cfg.faults.kill = lambda: os.kill(pid, signal.SIGKILL)
        for t in ts:
            await t.announce(PeerInfo(peer_id=t.peer_id))
        for t in ts:
            for _ in range(100):
                if len(await t.peers()) == N:
                    break
                await asyncio.sleep(0.1)
        ids = {t.peer_id: i for i, t in enumerate(ts)}
        attacker = ts[bad].peer_id
        for r in range(rounds):
            async def one(i: int, t: Any, r: int = r) -> Any:
                g = await t.form_group(JoinRequest(key=f"r{r}", peer_id=t.peer_id, weight=1.0 + i, fragment=0), None,
                                       timeout=20)
                return await t.allreduce(g, 0, [update(i, trial)], 1.0 + i, codec, timeout=12.0)

            live = [(i, t) for i, t in enumerate(ts) if not (attack.kill and i == bad and r > 0)]
            res = dict(zip([i for i, _ in live], await asyncio.gather(*(one(i, t) for i, t in live),
                                                                      return_exceptions=True), strict=True))
            row.rounds += 1
            honest = {i: x for i, x in res.items() if i != bad}
            lost, refused = judge_round(honest, ids, trial, codec, attacker, ts, attack, row)
            row.data_lost += lost
            row.detected += int(refused and lost == 0)
        row.trials += 1
        banned_by_all = all(t.guard.is_banned(attacker) for i, t in enumerate(ts) if i != bad)
        row.attacker_banned += int(banned_by_all)
        row.honest_banned += sum(len(t.guard.banned - {attacker}) for i, t in enumerate(ts) if i != bad)
    finally:
        await asyncio.gather(*(asyncio.wait_for(t.aclose(), 30) for t in ts), return_exceptions=True)


def judge_round(honest: dict[int, Any], ids: dict[str, int], trial: int, codec: Any, attacker: str,
                ts: list[Any], attack: Attack, row: Row) -> tuple[int, bool]:
    """(honest results that lost data, whether every honest peer refused the attack) for one round."""
    from p2ptrain.collective.butterfly import part_bounds

    lost, refused = 0, True
    values: dict[int, torch.Tensor] = {}
    for i, x in honest.items():
        if isinstance(x, BaseException):
            row.failed += 1
            refused = False
            continue
        row.partial += int(x.partial)
        row.verify_bytes.append(x.verify_bytes)
        row.round_bytes.append(x.bytes_sent + x.bytes_received)
        row.verify_seconds.append(x.verify_seconds)
        row.round_seconds.append(x.seconds)
        got = x.tensors[0]
        values[i] = got
        contributors = [ids[p] for p in x.contributors]
        bounds = part_bounds(NUMEL, len(x.members))
        for j, owner in enumerate(x.members):
            lo, hi = bounds[j]
            part = got[lo:hi]
            if not bool(torch.isfinite(part).all()):
                lost += 1
                break
            if hi > lo and bool((part == 0).all()):
                continue  # left out: zero on every survivor, never wrong
            peer_ids = [t.peer_id for t in ts]
            o = ids[owner]
            # An owner averages whoever reached it in time (the round's contributors, most likely): any set of
            # members with the owner in it is an honest aggregate; anything else is data lost.
            others = [ids[m] for m in x.members if ids[m] != o]
            options = [sorted(set(contributors) | {o})] + [
                [o] + [k for b, k in enumerate(others) if mask >> b & 1] for mask in range(1 << len(others))]
            ok = any(torch.equal(part, honest_part(o, opt, peer_ids, lo, hi, trial, codec)) for opt in options)
            if not ok:
                lost += 1
                break
        guard = ts[i].guard
        seen = guard.is_banned(attacker) or guard.strikes[attacker] > 0 or attacker in x.liars
        if attack.kill:
            seen = ids[attacker] not in contributors or not x.partial
        if attack.group == "contribution":  # refused: left out of the average (a strike, or dropped)
            seen |= ids[attacker] not in contributors
        if attack.faults.get("lie_to_some") and attacker in x.members:
            # It lies to the members at odd places only (net/allreduce.py); the others got the truth.
            seen |= x.members.index(ts[i].peer_id) % 2 == 0
        refused &= seen or attacker not in x.members
    first: dict[tuple[str, ...], torch.Tensor] = {}
    for i, v in values.items():  # honest peers of one group agree wherever both hold a part
        members = honest[i].members
        base = first.setdefault(members, v)
        both = (v != 0) & (base != 0)
        if not torch.equal(v[both], base[both]):
            lost += 1
    return lost, refused


def run_attacks(args: argparse.Namespace, out: dict[str, Any], save: Callable[[], None]) -> None:
    from rich.progress import Progress

    rng = random.Random(args.seed)
    todo = [a for a in attacks() if args.only is None or args.only in a.group or args.only in a.name]
    with Progress(transient=True) as bar:
        task = bar.add_task("attacks", total=len(todo) * args.trials)
        for attack in todo:
            row = Row(attack.name, attack.codec)
            for trial in range(args.trials):
                bar.update(task, description=f"{attack.name} · trial {trial + 1}")
                asyncio.run(one_trial(attack, trial, args.rounds, row, rng))
                bar.advance(task)
            out["attacks"].append(row.summary())
            save()


# ---------------------------------------------------------------------- part 2: faults on peers
@dataclass
class FaultRow:
    fault: str
    tried: int = 0
    detected: int = 0
    data_lost: int = 0
    notes: list[str] = field(default_factory=list)


def run_faults(args: argparse.Namespace, out: dict[str, Any], save: Callable[[], None]) -> None:
    from bench.chaos_faults import FAULTS

    for name, fn in FAULTS.items():
        if args.only is not None and args.only not in name:
            continue
        row = FaultRow(name)
        for trial in range(args.process_trials):
            detected, lost, note = fn(trial)
            row.tried += 1
            row.detected += int(detected)
            row.data_lost += int(lost)
            row.notes.append(note)
            print(f"{name} · trial {trial + 1}: detected={detected} data_lost={lost} · {note}", flush=True)
        out["faults"].append(asdict(row))
        save()


def report(out: dict[str, Any]) -> str:
    lines = ["| attack | wire | rounds | detected | data lost | attacker banned (trials) | honest banned | "
             "verification bytes / round bytes | verification s / round s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in out["attacks"]:
        lines.append(f"| {r['attack']} | {r['codec']} | {r['rounds']} | {r['detected']} | {r['data_lost']} | "
                     f"{r['attacker_banned']}/{r['trials']} | {r['honest_banned']} | "
                     f"{r['verify_bytes_median'] / 1e3:.1f} kB / {r['round_bytes_median'] / 1e3:.0f} kB "
                     f"({r['verify_share']:.1%}) | {r['verify_seconds_median']:.3f} / {r['round_seconds_median']:.3f} |")
    if out["faults"]:
        lines += ["", "| fault | tried | detected | data lost | note (last trial) |", "|---|---:|---:|---:|---|"]
        for f in out["faults"]:
            lines.append(f"| {f['fault']} | {f['tried']} | {f['detected']} | {f['data_lost']} | "
                         f"{f['notes'][-1] if f['notes'] else ''} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=6, help="fresh swarms per attack")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per trial")
    ap.add_argument("--process-trials", type=int, default=2, help="trials per peer fault")
    ap.add_argument("--only", default=None, help="only attacks or faults whose name or group contains this")
    ap.add_argument("--no-faults", action="store_true", help="skip part 2 (the peer processes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--merge", action="store_true", help="keep the rows of --out that this run does not redo")
    ap.add_argument("--out", type=Path, default=RESULTS / "chaos.json")
    args = ap.parse_args()

    out: dict[str, Any] = {"attacks": [], "faults": [], "peers": N, "numel": NUMEL, "rounds_per_trial": args.rounds,
                           "machine": machine(), "load_before": os.getloadavg()}

    kept: dict[str, Any] = {"attacks": [], "faults": []}
    if args.merge and args.out.exists():
        kept = json.loads(args.out.read_text())

    def save() -> None:
        for part, name in (("attacks", "attack"), ("faults", "fault")):  # this run's rows replace kept ones
            mine = {r[name] for r in out[part]}
            out[part] = [r for r in kept.get(part, []) if r[name] not in mine] + \
                [r for r in out[part] if r[name] in mine]
        write_json(args.out, out)

    t0 = time.monotonic()
    run_attacks(args, out, save)
    if not args.no_faults:
        run_faults(args, out, save)
    out["seconds"] = time.monotonic() - t0
    out["load_after"] = os.getloadavg()
    save()
    table = report(out)
    args.out.with_suffix(".md").write_text(
        "# Chaos: attacks and faults against real peers\n\n"
        f"`{' '.join(['python', 'bench/chaos.py', *sys.argv[1:]])}` · {N} peers on 127.0.0.1, {NUMEL} values per round, "
        f"{args.rounds} rounds per trial · load average {out['load_before'][0]:.1f} → {out['load_after'][0]:.1f}\n\n"
        + table + "\n")
    print(table)
    print(json.dumps({"seconds": round(out["seconds"], 1)}))


if __name__ == "__main__":
    main()
