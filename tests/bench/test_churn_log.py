"""The churn benchmark's log reading (bench/churn.py, ``Phase.parse``): a round a leaving peer's drain cut short is
counted as abandoned, apart from stuck rounds (which outlived their own timeouts), and older records without
that count still report."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.churn import PeerRec, Phase, phase_figures


def _phase(tmp_path: Path) -> Phase:
    a = argparse.Namespace(seed=0, regions=2, peers=2, spare=0, method="streaming", P=2)
    return Phase("faults", a, tmp_path, faults=True)


def _rows(tmp_path: Path, lines: list[tuple[str, str]]) -> dict[str, dict[str, Any]]:
    """The round rows of a phase that read ``lines`` as (peer, log line without its time stamp)."""
    ph = _phase(tmp_path)
    for name, line in lines:
        ph.parse(PeerRec(name=name, slot=0, host="us0", region="us", fresh=True), "ts=2026-11-27 07:00:30,000 " + line,
                 0.0)
    return ph.round_rows()


def test_abandoned_and_stuck_rounds_are_told_apart(tmp_path: Path) -> None:
    ph = _phase(tmp_path)
    rec = PeerRec(name="s00g0", slot=0, host="us0", region="us", fresh=True)
    ts = "ts=2026-11-27 07:00:00,000 "
    for line in (ts + "event=round_abandoned key=f1.L9 reason=the leave's drain limit came before the round's own",
                 ts + "event=round_timeout key=f0.L8 when=leaving",
                 ts + "event=round_timeout key=f0.L4"):
        ph.parse(rec, line, 0.0)
    rows = ph.round_rows()
    assert rows["f1.L9"]["abandoned_on"] == ["s00g0"] and rows["f1.L9"]["stuck_on"] == []
    assert rows["f0.L8"]["stuck_on"] == ["s00g0 (leaving)"] and rows["f0.L8"]["abandoned_on"] == []
    assert rows["f0.L4"]["stuck_on"] == ["s00g0"]
    record = {"rounds": rows, "faults": [], "window_s": [0.0, 60.0], "live": [], "peers": {}}
    f = phase_figures(record, fragments=2)
    assert (f["stuck_rounds"], f["stuck_rounds_when_leaving"], f["rounds_abandoned_when_leaving"]) == (1, 1, 1)
    for r in rows.values():  # a record written before abandoned rounds were told apart
        del r["abandoned_on"]
    assert phase_figures(record, fragments=2)["rounds_abandoned_when_leaving"] == 0


def test_the_appliers_own_tokens_are_summed_beside_the_rounds_total(tmp_path: Path) -> None:
    """Each applied line's ``own=`` is summed per round (every applier, whatever its digest), so that goodput can
    also be counted by the tokens the appliers say are theirs; a line from before ``own`` was logged counts 0."""
    rows = _rows(tmp_path, [
        ("s00g0", "event=applied key=f0.L9 fragment=0 members=3 tokens=300 divergent=False digest=aa own=100"),
        ("s01g0", "event=applied key=f0.L9 fragment=0 members=3 tokens=300 divergent=True digest=aa own=0"),
        ("s02g0", "event=applied key=f0.L9 fragment=0 members=3 tokens=300 divergent=False digest=aa own=120"),
        ("s00g0", "event=applied key=f1.L9 fragment=1 members=2 tokens=50 divergent=False digest=bb")])
    assert (rows["f0.L9"]["tokens"], rows["f0.L9"]["own"]) == (300, 220)
    assert (rows["f1.L9"]["tokens"], rows["f1.L9"]["own"]) == (50, 0)
    for r in rows.values():
        r["in_window"] = True
    record = {"rounds": rows, "faults": [], "window_s": [0.0, 60.0], "live": [], "peers": {}}
    f = phase_figures(record, fragments=2)
    assert (f["tokens_in_theta"], f["tokens_in_theta_own"]) == (175.0, 110.0)
    for r in rows.values():  # a record written before the own tokens were kept
        del r["own"]
    assert phase_figures(record, fragments=2)["tokens_in_theta_own"] == 0


def test_shards_carried_with_a_stand_in_are_counted_per_round(tmp_path: Path) -> None:
    """A carrier's ``event=standin_carried key=<round>#s<shard>~<id>`` line counts for its round (the shard key's
    round, not the cell or shard key), in the rows and the phase's figures, applied or not."""
    rows = _rows(tmp_path, [
        ("s00g0", "event=standin_carried key=f0.L9#s1~12D3KooWabcd"),
        ("s01g0", "event=standin_carried key=f0.L9#s3~12D3KooWefgh"),
        ("s02g0", "event=applied key=f0.L9 fragment=0 members=6 tokens=300 divergent=False digest=aa own=100"),
        ("s00g0", "event=standin_carried key=f1.L9#s0~12D3KooWabcd"),
        ("s00g0", "event=round_failed key=f1.L9 reason=RoundFailed: no carrier delivered it")])
    assert (rows["f0.L9"]["shards_stood_in"], rows["f1.L9"]["shards_stood_in"]) == (2, 1)
    record = {"rounds": rows, "faults": [], "window_s": [0.0, 60.0], "live": [], "peers": {}}
    f = phase_figures(record, fragments=2)
    assert (f["shards_stood_in"], f["rounds_with_stand_in"], f["rounds_with_stand_in_applied"]) == (3, 2, 1)


def test_round_failures_are_tallied_by_kind_of_reason(tmp_path: Path) -> None:
    """Each ``event=round_failed`` line's reason is filed under its kind (the round, shard, peer and counts it names
    left out), per round and for the phase, apart for the rounds no member applied; records without reasons
    count nothing."""
    ph = _phase(tmp_path)
    ts = "ts=2026-11-27 07:00:30,000 "
    lines = [
        ("s00g0", "event=round_failed key=f0.L9 reason=RoundFailed: hier/f0.L9/0/s3: no carrier delivered it "
                  "(hier/f0.L9/0/s3: 3k7Qz9aB did not offer it in time (not yet))"),
        ("s01g0", "event=round_failed key=f0.L9 reason=RoundFailed: hier/f0.L9/0/s1: no carrier delivered it "
                  "(nobody to ask)"),
        ("s02g0", "event=round_failed key=f1.L9 reason=RoundFailed: round f1.L9: our cell's θ lost the vote on "
                  "shard(s) [1, 2] without a majority of the 3 cells against it (applying would fork θ)"),
        ("s00g0", "event=round_failed key=f1.L9 reason=RoundFailed: hier/f1.L9/0/s0#div: our cell's carrier "
                  "Ab12cdEF did not say how the shard's vote went (FrameError: short)"),
        ("s01g0", "event=applied key=f1.L9 fragment=1 members=3 tokens=50 divergent=False digest=bb own=10"),
        ("s01g0", "event=round_failed key=f2.L9"),
        ("s02g0", "event=round_failed key=f3.L9 reason=RoundFailed: round f3.L9: leader says round f3.L9: the group "
                  "closed before FCpXZVLQ joined"),
    ]
    for name, line in lines:
        ph.parse(PeerRec(name=name, slot=0, host="us0", region="us", fresh=True), ts + line, 0.0)
    rows = ph.round_rows()
    assert rows["f0.L9"]["failed_why"] == {"no carrier delivered it": 2}
    assert rows["f1.L9"]["failed_why"] == {
        "our cell's θ lost the vote on shard(s) N without a majority of the N cells against it": 1,
        "our cell's carrier <peer> did not say how the shard's vote went": 1}
    assert rows["f2.L9"]["failed_why"] == {"?": 1}
    assert rows["f3.L9"]["failed_why"] == {"the group closed before <peer> joined": 1}
    record = {"rounds": rows, "faults": [], "window_s": [0.0, 60.0], "live": [], "peers": {}}
    f = phase_figures(record, fragments=4)
    assert next(iter(f["failure_kinds"].items())) == ("no carrier delivered it", 2)
    assert sum(f["failure_kinds"].values()) == 6
    assert f["failure_kinds_everywhere"] == {"no carrier delivered it": 2, "?": 1,  # f1.L9 was applied by one
                                             "the group closed before <peer> joined": 1}
    for r in rows.values():  # a record written before the reasons were kept
        del r["failed_why"]
    assert phase_figures(record, fragments=4)["failure_kinds"] == {}


def test_rounds_are_counted_by_where_they_stood_against_the_region_cuts() -> None:
    """A round began at its key's logical step × the step's seconds (unix time); the window and the cuts are in
    seconds since the phase started. Counted by hand: one round of each state in the window, one outside it."""
    from bench.churn_rounds import CUT_STATES, rounds_by_cut

    start = 3000.0  # the phase's start (unix); steps of 3 s: L = (start + t) / 3

    def row(outcome: str, failed: int) -> dict[str, object]:
        return {"outcome": outcome, "failed_on": [f"p{i}" for i in range(failed)]}

    phase = {"started_unix": start, "window_s": [60.0, 600.0],
             "faults": [{"t": 200.0, "kind": "partition"}, {"t": 400.0, "kind": "stop"}],
             "rounds": {f"f0.L{int((start + 90) / 3)}": row("applied", 0),  # no cut (a stop is no cut)
                        f"f1.L{int((start + 180) / 3)}": row("failed", 9),  # the cut began 20 s after it began
                        f"f2.L{int((start + 230) / 3)}": row("failed", 5),  # in the cut (200–260)
                        f"f3.L{int((start + 240) / 3)}": row("applied", 2),  # in the cut
                        f"f0.L{int((start + 290) / 3)}": row("applied", 1),  # 30 s after the heal
                        f"f1.L{int((start + 30) / 3)}": row("failed", 16)}}  # before the window: not counted
    got = rounds_by_cut(phase, step_seconds=3.0, cut_seconds=60.0)
    assert list(got) == list(CUT_STATES)
    assert got == {"no cut": {"rounds": 1, "failed_everywhere": 0, "failures": 0},
                   "began in a cut": {"rounds": 2, "failed_everywhere": 1, "failures": 7},
                   "cut began mid-round": {"rounds": 1, "failed_everywhere": 1, "failures": 9},
                   "after a heal": {"rounds": 1, "failed_everywhere": 0, "failures": 1}}


def test_the_load_average_is_the_median_inside_the_window() -> None:
    """A run beside other work compares only at like loads: the record's load samples inside the window give its
    median (outside it: start-up and the report, not counted); a record from before the load was kept has none."""
    record = {"rounds": {}, "faults": [], "window_s": [10.0, 70.0], "live": [], "peers": {},
              "load": [[0.0, 30.0], [10.0, 2.0], [40.0, 9.0], [70.0, 4.0], [90.0, 50.0]]}
    assert phase_figures(record, fragments=1)["load_average_median"] == 4.0
    del record["load"]
    assert phase_figures(record, fragments=1)["load_average_median"] is None
