"""Which applied rounds of a churn run made it into the θ the swarm ended on (:func:`kept_rounds`), from the peers'
logs: bench/churn.py's goodput counts the tokens of those, and bench/churn_tokens.py each life's share of them; and
how many of the tokens trained inside the run's window reached θ by the run's end
(:func:`trained_in_window_reaching_theta`).

A round applied by some members and failed by others forks θ; the vote that follows repairs the minority onto the
majority's θ, and what that round averaged is gone.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

__all__ = ["CUT_STATES", "cut_state", "failure_kind", "failure_kinds", "kept_rounds", "rounds_by_cut",
           "trained_in_window_reaching_theta"]

_KEPT = re.compile(r"^ts=(\S+ \S+) .*event=applied key=(\S+) fragment=(\d+) .* divergent=(\w+) .* own=(\d+)")


def failure_kind(reason: str) -> str:
    """A round failure's ``reason=`` text without what names one round, shard or peer, and without its details in
    parentheses: the same cause on every round reads the same (``RoundFailed: hier/f0.L598…/0/s3: no carrier
    delivered it (…)`` -> ``no carrier delivered it``; ``… leader says round f2.L5…: no quorum: 6 of 14 live peers
    joined (…)`` -> ``no quorum: N of N live peers joined``)."""
    r = re.sub(r"^[A-Z]\w*(?:Error|Failed|Mismatch|Declined|Unreachable)?: ", "", reason.strip())
    r = re.sub(r"\s\(.*", "", r)  # details: which peers said what
    while (m := re.match(r"(?:leader says |round \S+?(?: phase \w+)?: |hier/\S+: |\S+ to \S+: )", r)) is not None:
        r = r[m.end():]  # the round, shard or call it is about, and who said it
    r = re.sub(r"\b[1-9A-HJ-NP-Za-km-z]{8}\b", lambda m: "<peer>" if any(
        ch.isupper() or ch.isdigit() for ch in m.group(0)[1:]) else m.group(0), r)  # a peer id's tail
    r = re.sub(r"\[[\d, ]*\]|\d+", "N", r)
    return re.sub(r"\s+", " ", r).strip(" :") or "?"


def failure_kinds(rows: list[dict[str, Any]], everywhere: bool = False) -> dict[str, int]:
    """How many failures on a peer each kind of reason caused (``everywhere``: in rounds no member applied), most
    common first; rows from records without reasons count nothing."""
    counts: dict[str, int] = {}
    for r in rows:
        if everywhere and r["outcome"] != "failed":
            continue
        for kind, n in r.get("failed_why", {}).items():
            kind = failure_kind(kind)  # (a kind is its own kind: records filed by an older reading merge)
            counts[kind] = counts.get(kind, 0) + n
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


#: Where a round stood against the region cuts of its run (:func:`cut_state`), in the report's order.
CUT_STATES = ("no cut", "began in a cut", "cut began mid-round", "after a heal")


def cut_state(t: float, cuts: list[tuple[float, float]], span: float) -> str:
    """Where a round that began at ``t`` stood against the region cuts ``cuts`` ((start, end) times): ``began in a
    cut``; ``cut began mid-round`` (a cut began within ``span`` seconds after it began: its members were split while
    it ran); ``after a heal`` (it began within ``span`` seconds after a cut ended); else ``no cut``."""
    if any(a <= t <= b for a, b in cuts):
        return "began in a cut"
    if any(t < a <= t + span for a, _ in cuts):
        return "cut began mid-round"
    if any(b < t <= b + span for _, b in cuts):
        return "after a heal"
    return "no cut"


def rounds_by_cut(phase: dict[str, Any], step_seconds: float, cut_seconds: float, span: float = 45.0
                  ) -> dict[str, dict[str, int]]:
    """The window's rounds by where they stood against the phase's region cuts (``partition`` faults of
    ``cut_seconds``; :func:`cut_state`): how many, how many no member applied, and their failures on a peer. A round
    began at its key's logical step × ``step_seconds`` (unix time). Churn runs: the rounds no member applied all
    had a cut in them or began in one (churn_failures, churn_failures2)."""
    t0 = float(phase["started_unix"])
    w0, w1 = phase["window_s"]
    cuts = [(float(f["t"]), float(f["t"]) + cut_seconds) for f in phase["faults"] if f["kind"] == "partition"]
    out = {k: {"rounds": 0, "failed_everywhere": 0, "failures": 0} for k in CUT_STATES}
    for key, r in phase["rounds"].items():
        t = _order(key) * step_seconds - t0
        if not w0 <= t <= w1:
            continue
        c = out[cut_state(t, cuts, span)]
        c["rounds"] += 1
        c["failed_everywhere"] += r["outcome"] == "failed"
        c["failures"] += len(r["failed_on"])
    return out


def _order(key: str) -> int:
    """A round key's logical time (``f3.L598627070`` -> 598627070; 0 if it names none)."""
    tail = key.rpartition(".L")[2]
    return int(tail) if tail.isdigit() else 0


def kept_rounds(phase: dict[str, Any]) -> dict[str, bool]:
    """For every round applied anywhere in the phase, whether the θ it made is in the θ the swarm ended on.

    A round applied by some members and failed by the others forks θ; the next vote repairs the minority onto the
    majority's θ, and what the round averaged (the Δs of its appliers, counted as sent) is gone. So a round is kept
    when a round the swarm ended on was built on its θ, directly or through others: round R' is built on R when a
    peer applied R and then, as its next round of that fragment, R' without being outvoted: ``divergent=False``
    (its θ was its group's), or its Δ counted in R' (``own`` > 0: a hierarchical round flags every member of a cell
    in which any member diverged, and a member outvoted across cells has no Δ in the round). The round the swarm
    ended on, per fragment: the last one applied by at least half as many peers as the fragment's most applied
    round. An estimate from the logs (they name no θ before a round): a member with nothing to send whose cell
    was flagged reads as outvoted."""
    work = Path(phase["work"])
    built_on: dict[str, set[str]] = {}  # round -> the rounds built on its θ
    appliers: dict[str, int] = {}
    fragment: dict[str, int] = {}
    for p in phase["peers"].values():
        for life in p["lives"]:
            log = work / life["log"]
            if not log.exists():
                continue
            last: dict[int, str] = {}  # fragment -> this life's last applied round of it
            for line in log.read_text(errors="replace").splitlines():
                if (m := _KEPT.match(line)) is None:
                    continue
                key, f = m.group(2), int(m.group(3))
                fragment[key] = f
                appliers[key] = appliers.get(key, 0) + 1
                if f in last and (m.group(4) == "False" or int(m.group(5)) > 0):
                    built_on.setdefault(last[f], set()).add(key)
                last[f] = key
    kept: set[str] = set()
    for f in set(fragment.values()):
        rounds = sorted((k for k in fragment if fragment[k] == f), key=_order)
        most = max(appliers[k] for k in rounds)
        kept.add([k for k in rounds if 2 * appliers[k] >= most][-1])
    for key in sorted(fragment, key=_order, reverse=True):  # (a round is only built on by later ones)
        if key not in kept and built_on.get(key, set()) & kept:
            kept.add(key)
    return {k: k in kept for k in fragment}


def trained_in_window_reaching_theta(phase: dict[str, Any], fragments: int, step_seconds: float,
                                     kept: dict[str, bool] | None = None) -> float:
    """The tokens trained inside the phase's window that reached θ by the run's end, from its rounds alone.

    A goodput by the rounds applied in the window counts the progress trained before the window that its first
    rounds carry, and not what its last minutes trained (the rounds sent after it: the leaves' flush). A round of
    fragment f sent at slot L (the key's ``.L``: the send is at L × ``step_seconds``) carries what its members
    trained since the last applied round of f (a failed round's progress rides on the next one); here each
    applied round's total (over ``fragments``) is spread evenly over that interval and only its share inside the
    window counted, whenever the round was applied. ``kept``: only the rounds kept (:func:`kept_rounds`; None:
    every applied round). The first round of a fragment carries what was trained since the phase began."""
    w0, w1 = phase["window_s"]
    t0 = phase["started_unix"]
    by_fragment: dict[int, list[tuple[float, float]]] = {}
    for key, r in phase["rounds"].items():
        if r["outcome"] != "applied" or not r["tokens"] or (kept is not None and not kept.get(key, False)):
            continue
        by_fragment.setdefault(int(r["fragment"]), []).append((_order(key) * step_seconds - t0, float(r["tokens"])))
    total = 0.0
    for sends in by_fragment.values():
        prev = 0.0
        for sent, tokens in sorted(sends):
            if sent > prev:
                total += tokens * max(0.0, min(sent, w1) - max(prev, w0)) / (sent - prev)
            prev = max(prev, sent)
    return total / fragments
