"""The churn benchmark's survival rule (bench/churn.py, ``Phase.judge``): a fault whose peer a later kill or leave
took before it was back is unknown, not "not survived"; one whose peer is simply not back in time is not survived; a
later cut or stop of a peer not back yet restarts the clock at its end."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.churn import PeerRec, Phase


def _phase(tmp_path: Path, *peers: PeerRec) -> Phase:
    a = argparse.Namespace(seed=0, regions=2, peers=2, spare=2, method="streaming", P=2, survive_within=180.0,
                           leave_grace=120.0)
    ph = Phase("faults", a, tmp_path, faults=True)
    ph.peers = {p.name: p for p in peers}
    return ph


def test_a_join_whose_peer_a_later_kill_took_first_is_unknown_and_a_peer_not_back_is_not_survived(
        tmp_path: Path) -> None:
    now = time.time()
    ph = _phase(tmp_path, PeerRec(name="s02g1", slot=2, host="us1", region="us", fresh=False, state="dead"),
                PeerRec(name="s03g1", slot=3, host="eu1", region="eu", fresh=False, state="dead"))
    ph.faults = [
        {"t": now - 100, "kind": "join", "survived": None, "target": "s02g1"},
        {"t": now - 25, "kind": "kill", "survived": None, "target": "s02g1", "restarted": None},  # not restarted yet
        {"t": now - 300, "kind": "join", "survived": None, "target": "s03g1"},  # died later with no fault of ours
    ]
    ph.judge()
    first, kill, other = ph.faults
    assert first["survived"] is None and first["cut_short_by"] == "kill 75 s after it"
    assert kill["survived"] is None and "cut_short_by" not in kill  # its restart has not come yet
    assert other["survived"] is False and other["not_back"] == ["s03g1"]
    ph.judge()  # judged once: the mark stays
    assert first["survived"] is None and "not_back" not in first


def test_a_later_cut_or_stop_of_a_peer_not_back_yet_restarts_the_clock_at_its_end(tmp_path: Path) -> None:
    now = time.time()
    cut = PeerRec(name="s03g1", slot=3, host="eu1", region="eu", fresh=False, state="live")
    ph = _phase(tmp_path, cut, PeerRec(name="s04g1", slot=4, host="eu2", region="ap", fresh=False, state="live"))
    ph.faults = [
        # healed 200 s ago (past the 180 s), but the region was cut again 10 s after the heal, until 130 s ago
        {"t": now - 260, "kind": "partition", "survived": None, "target": "eu", "peers": ["s03g1"],
         "healed": now - 200},
        {"t": now - 190, "kind": "partition", "survived": None, "target": "eu", "peers": ["s03g1"],
         "healed": now - 130},
        # healed 440 s ago, stopped 430 s ago until 410 s ago: still past the 180 s from the stop's end
        {"t": now - 500, "kind": "partition", "survived": None, "target": "ap", "peers": ["s04g1"],
         "healed": now - 440},
        {"t": now - 430, "kind": "stop", "survived": None, "target": "s04g1", "resumed": now - 410},
    ]
    ph.judge()
    first, second, third, stop = ph.faults
    assert first["survived"] is None and "not_back" not in first  # 130 s since the second cut healed
    assert second["survived"] is None
    assert third["survived"] is False and third["not_back"] == ["s04g1"]
    assert third["clock_restarted_by"] == "stop of s04g1 70 s after it"
    assert stop["survived"] is False
    cut.applied.append((now - 5, "f0.L1", "d"))  # back with the majority (two peers applied d)
    ph.rounds = {"f0.L1": {"digests": {"d": ["s03g1", "s05g1"]}}}
    ph.judge()
    assert first["survived"] is True and second["survived"] is True
