"""Where a churn run's trained tokens went: per peer life, the tokens it trained against those of its own that
reached θ, summed by how the life ended (a table and JSON beside the run's).

    python bench/churn_tokens.py bench/results/churn_X.json       # needs the run's peer logs (its "work" dirs)

bench/churn.py's goodput is the tokens that reached θ over the fault-free run's; what it does not say is where
the rest went. Each peer logs, for every round it applies, ``own=``: its tokens in that round's average (0 when
outvoted: its tokens then go into the fragment's next round). A token reaches all of θ once every fragment's
round holding it is applied, so a life's tokens in θ are its ``own`` summed over its applied rounds, over the
number of fragments P. What a life trained and never got into θ was lost with it (killed before its rounds
carried it), or was still on its way when the window closed, or went into a round that failed everywhere
and was re-sent. Lives are counted inside the run's window only (the same window as goodput).

A round applied by some members and failed by others forks θ, and the vote that follows repairs the minority
away: what that round averaged is not in θ, though its total counts in bench/churn.py's goodput. The last table
counts the tokens of the rounds whose θ the swarm kept (``kept_rounds``).

Where the time before a life's first step went is read from its ``event=started`` line (p2ptrain/peer/startup.py):
medians of each phase of a start, for the first starts and for the restarts and joins.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import statistics
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.churn import _seq_len
from bench.churn_rounds import kept_rounds, trained_in_window_reaching_theta
from p2ptrain.ui import out, table

_OWN = re.compile(r"^ts=(\S+ \S+) .*event=applied key=(\S+) fragment=(\d+) .* own=(\d+)")


def _unix(ts: str) -> float:
    return datetime.strptime(ts, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def own_applied(log: Path) -> list[tuple[float, str, int, float]]:
    """(unix time, round key, fragment, own tokens) of every ``applied`` line in a peer's log that says ``own``."""
    if not log.exists():
        return []
    rows = []
    for line in log.read_text(errors="replace").splitlines():
        if (m := _OWN.match(line)) is not None:
            rows.append((_unix(m.group(1)), m.group(2), int(m.group(3)), float(m.group(4))))
    return rows


_PEER = re.compile(r"· peer (\S+) ·")
_INHERITED = re.compile(r"event=inherited_sent key=(\S+) fragment=\d+ tokens=\d+ from=(\S+)")


def bequests_applied(log: Path, keys: set[str]) -> list[tuple[str, str, float]]:
    """(round key, leaver's peer-id tail, its tokens) of every bequest this heir sent in a round of ``keys`` (the rounds it
    applied): its ``own`` there holds them, and they are the leaver's (p2ptrain/peer/bequest.py)."""
    if not log.exists():
        return []
    out = []
    for m in _INHERITED.finditer(log.read_text(errors="replace")):
        if m.group(1) in keys:
            for part in m.group(2).split(","):
                tail, _, tokens = part.partition(":")
                out.append((m.group(1), tail, float(tokens or 0)))
    return out


def life_rows(phase: dict[str, Any], seq: int, fragments: int,
              kept: dict[str, bool] | None = None) -> list[dict[str, Any]]:
    """One row per life of every peer in ``phase`` (a phase of bench/churn.py's JSON). Tokens a leaver handed to
    an heir (a bequest) that reached θ in the heir's round are the leaver's (``handed_on``), not the heir's."""
    kept = kept_rounds(phase) if kept is None else kept  # (read from the logs once by main)
    rows = _life_rows(phase, seq, fragments, kept)
    work = Path(phase["work"])
    ids: dict[str, str] = {}  # log -> the peer id it names
    wills: set[str] = set()  # logs of lives that handed a will on
    for r in rows:
        log = work / r["log"]
        text = log.read_text(errors="replace") if log.exists() else ""
        if (m := _PEER.search(text[:20000])) is not None:
            ids[r["log"]] = m.group(1)
        if "event=bequeathed " in text:
            wills.add(r["log"])
    for r in rows:
        for key, tail, tokens in bequests_applied(work / r["log"], r.pop("_keys")):
            r["in_theta"] -= tokens / fragments
            if kept.get(key, False):
                r["in_kept"] -= tokens / fragments
            # (a restarted peer keeps its id: the life of it that bequeathed, the last one if several did)
            mine = [x for x in rows if ids.get(x["log"], "").endswith(tail)]
            leaver = ([x for x in mine if x["log"] in wills] or mine or [None])[-1]
            if leaver is not None:
                leaver["in_theta"] += tokens / fragments
                leaver["handed_on"] += tokens / fragments
                if kept.get(key, False):
                    leaver["in_kept"] += tokens / fragments
    return rows


def _life_rows(phase: dict[str, Any], seq: int, fragments: int, kept: dict[str, bool]) -> list[dict[str, Any]]:
    w0, w1 = phase["window_s"]
    t0 = phase["started_unix"]
    work = Path(phase["work"])
    rows = []
    for name, p in phase["peers"].items():
        for life in p["lives"]:
            a = max(w0, life["started"])
            b = min(w1, life["ended"] if life["ended"] is not None else w1)
            if b <= a:
                continue
            pts = [(t, s) for t, s, _ in p["loss"] if a <= t <= b]
            steps = sum(max(0, s1 - s0) for (_, s0), (_, s1) in itertools.pairwise(pts))
            applied = [r for r in own_applied(work / life["log"]) if a <= r[0] - t0 <= b]
            rows.append({"peer": name, "log": life["log"], "how": life["how"], "seconds": round(b - a, 1),
                         "trained": steps * seq, "in_theta": sum(r[3] for r in applied) / fragments,
                         "in_kept": sum(r[3] for r in applied if kept.get(r[1], False)) / fragments,
                         "rounds_applied": len(applied), "rounds_without_own": sum(r[3] == 0 for r in applied),
                         "handed_on": 0.0, "_keys": {r[1] for r in applied}})
    return rows


_APPLIED = re.compile(r"^ts=(\S+ \S+) .*event=applied key=(\S+) .* tokens=(\d+) divergent=(\w+) .* own=(\d+)")
_SHARDS = re.compile(r"^ts=(\S+ \S+) .*event=shards key=(\S+) phase=0 local=(\d+)/\d+ weight=(\d+) shards=(\S+)")


def _cells_summing_to(weights: list[float], total: float) -> tuple[float, ...] | None:
    """The cells' weights whose sum is ``total`` (to a token per cell: the logs round them), or None."""
    for n in range(len(weights), 0, -1):
        for sub in itertools.combinations(weights, n):
            if abs(sum(sub) - total) <= n:
                return sub
    return None


def round_accounts(phase: dict[str, Any], kept: dict[str, bool] | None = None) -> list[dict[str, Any]]:
    """Per hierarchical round applied in the window, where its total weight (``tokens=``: the largest of its shards'
    totals, net/hierarchy.py) came from, against the tokens its appliers said were theirs (``own=``). Each member's
    ``event=shards`` line names its cell's weight and every shard's total; the cells a total holds are the subset
    of the round's cells' weights that sums to it. For each cell in the total, what its members' ``own`` lines
    do not account for (its weight less their own tokens) is put down to: members that applied the round with
    ``own=0`` (outvoted: their tokens go into their next round, so the totals count them twice) when every
    contributor of the cell (``local=``) wrote an ``applied`` line; members that wrote none (they died, left or
    failed it: the totals count them, the own account misses them) when none of those that did says ``own=0``;
    either, otherwise."""
    w0, w1 = phase["window_s"]
    t0 = phase["started_unix"]
    work = Path(phase["work"])
    cell: dict[str, dict[str, float]] = {}  # key -> log -> its cell's weight
    size: dict[tuple[str, float], int] = {}  # (key, a cell's weight) -> its contributors
    totals: dict[str, float] = {}  # key -> the largest shard total any member saw
    applied: dict[str, dict[str, tuple[float, bool, float]]] = {}  # key -> log -> (tokens, divergent, own)
    for p in phase["peers"].values():
        for life in p["lives"]:
            log = work / life["log"]
            if not log.exists():
                continue
            for line in log.read_text(errors="replace").splitlines():
                if (m := _SHARDS.match(line)) is not None:
                    key, w = m.group(2), float(m.group(4))
                    cell.setdefault(key, {})[life["log"]] = w
                    size[(key, w)] = max(size.get((key, w), 0), int(m.group(3)))
                    shard_totals = [float(f.split(":")[4]) for f in m.group(5).split(",") if f.count(":") == 4]
                    totals[key] = max([totals.get(key, 0.0), *shard_totals])
                elif (m := _APPLIED.match(line)) is not None and w0 <= _unix(m.group(1)) - t0 <= w1:
                    applied.setdefault(m.group(2), {})[life["log"]] = (float(m.group(3)), m.group(4) == "True",
                                                                       float(m.group(5)))
    kept = kept_rounds(phase) if kept is None else kept
    rows = []
    for key, appliers in sorted(applied.items()):
        if key not in cell:
            continue  # a flat round: its total is its members' weights
        tokens = max(t for t, _, _ in appliers.values())
        weights = sorted(set(cell[key].values()))
        held = _cells_summing_to(weights, totals.get(key, tokens))
        twice = missed = either = 0.0
        for w in held or ():
            logs = [lg for lg, cw in cell[key].items() if cw == w]
            own = [appliers[lg][2] for lg in logs if lg in appliers]
            short = max(0.0, w - sum(own))
            if len(own) >= size.get((key, w), len(logs)):
                twice += short
            elif all(own):
                missed += short
            else:
                either += short
        rows.append({"key": key, "tokens": tokens, "own": sum(o for _, _, o in appliers.values()),
                     "cells": len(weights), "cells_in_total": None if held is None else len(held),
                     "counted_twice": twice, "not_applied": missed, "either": either, "kept": kept.get(key, False)})
    return rows


_STARTED = re.compile(r"event=started (.*)$")
#: The phases of a start a peer's ``event=started`` line gives (p2ptrain/peer/startup.py).
START_FIELDS = ("process_seconds", "before_start", "cpu_seconds", "connect", "pacing", "state", "trained")


def live_seconds(phase: dict[str, Any]) -> float:
    """Seconds the phase's peer processes lived inside its window, summed over every life."""
    w0, w1 = phase["window_s"]
    return sum(max(0.0, min(w1, lf["ended"] if lf["ended"] is not None else w1) - max(w0, lf["started"]))
               for p in phase["peers"].values() for lf in p["lives"])


def startups(phase: dict[str, Any]) -> list[dict[str, Any]]:
    """Every peer life's ``event=started`` line (where its start-up went), marked whether it was one of the
    phase's first starts (a life 0 started in the phase's first minute) or a restart or join."""
    work, rows = Path(phase["work"]), []
    for name, p in phase["peers"].items():
        for i, life in enumerate(p["lives"]):
            log = work / life["log"]
            if not log.exists():
                continue
            for line in log.read_text(errors="replace").splitlines():
                if (m := _STARTED.search(line)) is not None:
                    fields = {k: float(v) for k, v in re.findall(r"(\w+)=([0-9.]+)", m.group(1)) if k in START_FIELDS}
                    fields.setdefault("trained", 0.0)  # (a start that trained through none of it)
                    rows.append({"peer": name, "log": life["log"], "first": i == 0 and life["started"] < 60.0,
                                 **fields})
                    break
    return rows


def startup_summary(rows: list[dict[str, Any]], peer_seconds: float) -> list[dict[str, Any]]:
    """Medians of each phase for the first starts, the restarts and joins, and all; with the wall seconds the
    starts took in all, less those they trained through, and their share of ``peer_seconds`` (the lives' time in
    the window: the first starts' seconds mostly fall before it)."""
    out_ = []
    for label, sel in (("first starts", [r for r in rows if r["first"]]),
                       ("restarts and joins", [r for r in rows if not r["first"]]), ("all", rows)):
        if not sel:
            continue
        med = {k: statistics.median(r[k] for r in sel) for k in START_FIELDS if all(k in r for r in sel)}
        # (the seconds a resumed peer trained while it connected are not lost)
        total = sum(r.get("process_seconds", 0.0) - r.get("trained", 0.0) for r in sel)
        out_.append({"starts": label, "count": len(sel), "median": med, "seconds": total,
                     "share_of_peer_time": total / peer_seconds if peer_seconds else None})
    return out_


_RESUMED = re.compile(r"event=resumed step=(\d+)")


def kill_losses(phase: dict[str, Any]) -> list[dict[str, Any]]:
    """What each kill lost: the last step its life's status lines reached against the step its next life resumed
    from (``event=resumed``: its newest checkpoint's). The steps between are trained again (a status line comes
    every few steps, so a few more may be lost than these say)."""
    work, rows = Path(phase["work"]), []
    for name, p in phase["peers"].items():
        lives = p["lives"]
        for life, after in itertools.pairwise(lives):
            if life["how"] != "killed":
                continue
            end = life["ended"] if life["ended"] is not None else math.inf
            steps = [s for t, s, _ in p["loss"] if life["started"] <= t <= end]
            log = work / after["log"]
            m = _RESUMED.search(log.read_text(errors="replace")) if log.exists() else None
            if steps and m is not None:
                rows.append({"peer": name, "log": life["log"], "last_step": max(steps), "resumed": int(m.group(1)),
                             "lost": max(0, max(steps) - int(m.group(1)))})
    return rows


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows summed by how the life ended, then all of them."""
    out_: list[dict[str, Any]] = []
    groups = sorted({r["how"] for r in rows})
    for how in [*groups, "all"]:
        sel = [r for r in rows if how in ("all", r["how"])]
        trained = sum(r["trained"] for r in sel)
        in_theta = sum(r["in_theta"] for r in sel)
        in_kept = sum(r.get("in_kept", 0.0) for r in sel)
        out_.append({"how": how, "lives": len(sel), "trained": trained, "in_theta": in_theta,
                     "kept": in_theta / trained if trained else None, "in_kept_rounds": in_kept,
                     "kept_in_kept_rounds": in_kept / trained if trained else None,
                     "handed_on": sum(r.get("handed_on", 0.0) for r in sel),
                     "rounds_applied": sum(r["rounds_applied"] for r in sel),
                     "rounds_without_own": sum(r["rounds_without_own"] for r in sel)})
    return out_


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a bench/churn.py JSON whose peer logs are still on disk")
    ap.add_argument("--out", type=Path, help="the JSON written (default: beside the run, *_tokens.json)")
    ap.add_argument("--baseline-tokens", type=float, default=None,
                    help="the fault-free run's tokens in θ (its tokens_in_theta), for a goodput of the kept rounds")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="a bench/churn.py JSON with a fault-free phase (baseline): a goodput of the tokens trained in "
                         "the window that reached θ by the run's end, each run counted alike")
    a = ap.parse_args(argv)
    payload = json.loads(a.run.read_text())
    args = payload["args"]
    reached_base = None
    base_seconds = None
    if a.baseline is not None:
        base_run = json.loads(a.baseline.read_text())
        bph = base_run["phases"]["baseline"]
        # (a fault-free phase whose logs are gone: every applied round counts as kept)
        reached_base = trained_in_window_reaching_theta(bph, base_run["args"]["P"], base_run["args"]["step_seconds"],
                                                        kept_rounds(bph) if Path(bph["work"]).exists() else None)
        base_seconds = live_seconds(bph)
    seq = args["batch_size"] * _seq_len(args["preset"])
    result: dict[str, Any] = {"run": str(a.run), "phases": {}}
    phases = payload["phases"]
    for ph in phases.values() if isinstance(phases, dict) else phases:
        if not Path(ph["work"]).exists():
            out.print(f"{ph['phase']}: {ph['work']} is gone; skipped")
            continue
        kept = kept_rounds(ph)
        rows = life_rows(ph, seq, args["P"], kept)
        if not any(r["rounds_applied"] for r in rows):
            out.print(f"{ph['phase']}: no 'own=' on any applied line (a run from before the field existed); skipped")
            continue
        summary = summarise(rows)
        starts = startups(ph)
        peer_seconds = live_seconds(ph)
        start_summary = startup_summary(starts, peer_seconds)
        accounts = round_accounts(ph, kept)
        result["phases"][ph["phase"]] = {"lives": rows, "summary": summary, "startups": starts,
                                         "startup_summary": start_summary, "rounds": accounts}
        if accounts:
            fields = ("tokens", "own", "counted_twice", "not_applied", "either")
            sums = {k: sum(r[k] for r in accounts) for k in fields}
            rest = sums["tokens"] - sums["own"] - sums["counted_twice"] - sums["not_applied"] - sums["either"]
            out.print(table(f"{ph['phase']}: the hierarchical rounds' totals against their appliers' own tokens "
                            f"({len(accounts)} rounds; {sum(r['cells_in_total'] is None for r in accounts)} "
                            "totals no subset of the cells sums to)",
                            ["Σ totals (tokens=)", "Σ own", "own=0 appliers (counted twice)",
                             "members that did not apply", "either", "rest"],
                            [[f"{sums[k]:,.0f}" for k in fields] + [f"{rest:,.0f}"]]))
            kept_accounts = [r for r in accounts if r["kept"]]
            figures = {"rounds": len(accounts), "rounds_kept": len(kept_accounts),
                       "tokens_in_theta": sums["tokens"] / args["P"],
                       "tokens_in_kept_rounds": sum(r["tokens"] for r in kept_accounts) / args["P"],
                       "tokens_in_kept_rounds_once": sum(r["tokens"] - r["counted_twice"]
                                                         for r in kept_accounts) / args["P"]}
            result["phases"][ph["phase"]]["kept"] = figures
            base = a.baseline_tokens
            out.print(table(f"{ph['phase']}: tokens in θ, by the rounds' totals over P: all applied rounds (as "
                            "bench/churn.py counts them), the rounds whose θ the swarm kept (kept_rounds), and those "
                            "less the tokens of their own=0 appliers (counted again in a later round)",
                            ["rounds applied", "kept", "all rounds", "kept rounds", "kept, counted once",
                             *(["goodput (kept, once)"] if base else [])],
                            [[figures["rounds"], figures["rounds_kept"], f"{figures['tokens_in_theta']:,.0f}",
                              f"{figures['tokens_in_kept_rounds']:,.0f}", f"{figures['tokens_in_kept_rounds_once']:,.0f}",
                              *([f"{figures['tokens_in_kept_rounds_once'] / base:.3f}"] if base else [])]]))
        reached = trained_in_window_reaching_theta(ph, args["P"], args["step_seconds"], kept)
        trained = sum(r["trained"] for r in rows)
        # The peer time the faults left (a stopped peer counts as live: its process lives) against the fault-free
        # run's: the goodput the run's fault mix allows at most if compute alone were lost (a join adds, a kill's
        # restart and a leave take away), and the goodput of that peer time.
        share = peer_seconds / base_seconds if base_seconds else None
        result["phases"][ph["phase"]]["reached"] = {"tokens": reached, "trained": trained, "baseline": reached_base,
                                                    "peer_seconds": peer_seconds, "baseline_peer_seconds": base_seconds}
        both = reached_base and share
        out.print(table(f"{ph['phase']}: tokens trained in the window that reached a kept θ by the run's end (each "
                        "round's total spread over the time since its fragment's last applied round; the window's "
                        "share counts, whenever the round was applied); peer time: the seconds the peers' processes "
                        "lived in the window, against the fault-free run's",
                        ["trained in the window", "reached θ", "of the trained",
                         *(["fault-free run's, reached θ", "goodput", "peer time of the fault-free run's",
                            "goodput of the peer time"] if both else [])],
                        [[f"{trained:,}", f"{reached:,.0f}", f"{reached / trained:.3f}" if trained else "—",
                          *([f"{reached_base:,.0f}", f"{reached / reached_base:.3f}", f"{share:.3f}",
                             f"{reached / reached_base / share:.3f}"] if both else [])]]))
        kills = kill_losses(ph)
        result["phases"][ph["phase"]]["kills"] = kills
        if kills:
            lost = [k["lost"] for k in kills]
            out.print(table(f"{ph['phase']}: steps each kill lost (its life's last status step against the step its "
                            "next life resumed from, its newest checkpoint's)",
                            ["kills", "median", "mean", "max", "steps in all", "tokens in all"],
                            [[len(lost), f"{statistics.median(lost):g}", f"{statistics.mean(lost):.1f}", max(lost),
                              sum(lost), f"{sum(lost) * seq:,}"]]))
        if start_summary:
            out.print(table(f"{ph['phase']}: where the starts went (median seconds of each phase; event=started)",
                            ["starts", "count", *START_FIELDS, "seconds in all", "of the peer time"],
                            [[x["starts"], x["count"], *[f"{x['median'].get(k, float('nan')):.1f}" for k in START_FIELDS],
                              f"{x['seconds']:,.0f}", "—" if x["share_of_peer_time"] is None
                              else f"{x['share_of_peer_time']:.1%}"] for x in start_summary]))
        out.print(table(f"{ph['phase']}: tokens trained and reaching θ, by how each life ended",
              ["life ended", "lives", "trained", "in θ", "of it handed on", "kept", "kept, in kept rounds",
               "rounds applied", "of them without own Δ"],
              [[s["how"], s["lives"], f"{s['trained']:,}", f"{s['in_theta']:,.0f}", f"{s['handed_on']:,.0f}",
                "—" if s["kept"] is None else f"{s['kept']:.3f}",
                "—" if s["kept_in_kept_rounds"] is None else f"{s['kept_in_kept_rounds']:.3f}",
                s["rounds_applied"], s["rounds_without_own"]]
               for s in summary]))
    dest = a.out or a.run.with_name(a.run.stem + "_tokens.json")
    dest.write_text(json.dumps(result, indent=1))
    out.print(f"wrote {dest}")


if __name__ == "__main__":
    main()
