"""The churn benchmark's log reading (bench/churn.py, ``Phase.parse``): a round a leaving peer's drain cut short is
counted as abandoned, apart from stuck rounds (which outlived their own timeouts), and older records without
that count still report."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.churn import PeerRec, Phase, phase_figures


def _phase(tmp_path: Path) -> Phase:
    a = argparse.Namespace(seed=0, regions=2, peers=2, spare=0, method="streaming", P=2)
    return Phase("faults", a, tmp_path, faults=True)


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
