"""bench/churn_tokens.py: a life's tokens in θ are its ``own`` over its applied rounds, over P; only inside the
run's window; summed by how the life ended."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from bench.churn_tokens import life_rows, summarise

T0 = datetime(2026, 11, 27, 1, 0, 0).timestamp()


def _line(t: float, key: str, own: int) -> str:
    ts = datetime.fromtimestamp(T0 + t).strftime("%Y-%m-%d %H:%M:%S,000")
    return (f"ts={ts} level=INFO logger=p2ptrain.peer.replica event=applied key={key} fragment=0 members=3 "
            f"tokens=999 divergent=False digest=00aa own={own}")


def test_tokens_in_theta_follow_each_lives_own_tokens_over_the_fragments(tmp_path: Path) -> None:
    (tmp_path / "a.0.log").write_text("\n".join([
        _line(5, "f0.L1", 400),  # before the window: not counted
        _line(20, "f0.L2", 800), _line(40, "f1.L3", 0), _line(60, "f1.L4", 400)]) + "\nstep 3 loss 1.0\n")
    (tmp_path / "a.1.log").write_text(_line(90, "f0.L5", 200) + "\n")
    phase = {"window_s": [10.0, 100.0], "started_unix": T0, "work": str(tmp_path), "peers": {"a": {
        "lives": [{"started": 0.0, "ended": 70.0, "how": "killed", "log": "a.0.log"},
                  {"started": 75.0, "ended": None, "how": "left at the end", "log": "a.1.log"}],
        "loss": [[12.0, 10, 2.0], [30.0, 20, 2.0], [69.0, 30, 2.0], [80.0, 25, 2.0], [95.0, 29, 2.0]]}}}
    rows = life_rows(phase, seq=4, fragments=2)
    assert [(r["how"], r["trained"], r["in_theta"], r["rounds_applied"], r["rounds_without_own"]) for r in rows] == [
        ("killed", 20 * 4, (800 + 0 + 400) / 2, 3, 1), ("left at the end", 4 * 4, 200 / 2, 1, 0)]
    total = summarise(rows)[-1]
    assert (total["how"], total["lives"], total["trained"], total["in_theta"]) == ("all", 2, 96, 700.0)
    assert abs(total["kept"] - 700 / 96) < 1e-12



def test_a_bequest_that_reached_theta_is_the_leavers_not_the_heirs(tmp_path: Path) -> None:
    """An heir's ``own`` in the round that carried a leaver's bequest holds the leaver's tokens: they are moved to
    the leaver's life (and counted as handed on), the life of that peer id that bequeathed (a restarted peer keeps
    its id); a bequest sent in a round the heir did not apply stays nobody's."""
    ts = datetime.fromtimestamp(T0 + 50).strftime("%Y-%m-%d %H:%M:%S,000")
    sent = (f"ts={ts} level=INFO logger=p2ptrain.driver event=inherited_sent key={{}} fragment=0 tokens={{}} "
            f"from={{}}")
    (tmp_path / "h.0.log").write_text("\n".join([
        "p2ptrain 0.1.0 · peer 12D3KooWheirheir · run r · streaming",
        sent.format("f0.L5", 300, "leaverAA:300"), _line(55, "f0.L5", 500),
        sent.format("f1.L6", 90, "leaverAA:40,otherBBB:50"), _line(60, "f1.L6", 190),
        sent.format("f0.L7", 70, "leaverAA:70")]) + "\n")  # f0.L7: never applied
    (tmp_path / "l.0.log").write_text("p2ptrain 0.1.0 · peer 12D3KooWleaverAA · run r · streaming\n")  # killed
    (tmp_path / "l.1.log").write_text("p2ptrain 0.1.0 · peer 12D3KooWleaverAA · run r · streaming\n"  # restarted
                                      + _line(20, "f0.L2", 100) + "\n"
                                      + "ts=x level=INFO event=bequeathed heir=heirheir fragments=0,1 tokens=410\n")
    phase = {"window_s": [10.0, 100.0], "started_unix": T0, "work": str(tmp_path), "peers": {
        "h": {"lives": [{"started": 0.0, "ended": None, "how": "left at the end", "log": "h.0.log"}], "loss": []},
        "l": {"lives": [{"started": 0.0, "ended": 12.0, "how": "killed", "log": "l.0.log"},
                        {"started": 15.0, "ended": 40.0, "how": "left", "log": "l.1.log"}], "loss": []}}}
    heir, killed, leaver = life_rows(phase, seq=4, fragments=2)
    assert (killed["in_theta"], killed["handed_on"]) == (0.0, 0.0)
    assert (heir["in_theta"], heir["handed_on"]) == ((500 + 190 - 300 - 40 - 50) / 2, 0.0)
    assert (leaver["in_theta"], leaver["handed_on"]) == ((100 + 300 + 40) / 2, (300 + 40) / 2)
    assert summarise([heir, killed, leaver])[-1]["handed_on"] == 170.0

def test_each_lives_start_up_line_is_read_and_summarised_by_kind_of_start(tmp_path: Path) -> None:
    """``event=started`` (p2ptrain/peer/startup.py): a life 0 started in the phase's first minute is a first start,
    any other a restart or a join; medians per phase, and the seconds in all against the peers' time."""
    from bench.churn_tokens import startup_summary, startups

    def started(age: float, state: float) -> str:
        return (f"ts=2026-11-27 01:00:00,000 level=INFO logger=p2ptrain.peer.startup event=started "
                f"process_seconds={age} before_start={age - 10 - state} cpu_seconds=9.0 connect=8.0 pacing=2.0 "
                f"state={state}")

    (tmp_path / "a.0.log").write_text("step 1\n" + started(80.0, 0.0) + "\n")
    (tmp_path / "a.1.log").write_text(started(100.0, 20.0) + "\n" + started(1.0, 0.0) + "\n")  # first line only
    (tmp_path / "b.0.log").write_text(started(120.0, 10.0) + "\n")  # a joiner: life 0, started late
    phase = {"work": str(tmp_path), "peers": {
        "a": {"lives": [{"started": 0.0, "log": "a.0.log"}, {"started": 300.0, "log": "a.1.log"}]},
        "b": {"lives": [{"started": 200.0, "log": "b.0.log"}, {"started": 500.0, "log": "missing.log"}]}}}
    rows = startups(phase)
    assert [(r["log"], r["first"], r["process_seconds"], r["state"]) for r in rows] == [
        ("a.0.log", True, 80.0, 0.0), ("a.1.log", False, 100.0, 20.0), ("b.0.log", False, 120.0, 10.0)]
    first, later, both = startup_summary(rows, peer_seconds=1000.0)
    assert (first["starts"], first["count"], first["seconds"]) == ("first starts", 1, 80.0)
    assert (later["count"], later["median"]["process_seconds"], later["median"]["state"]) == (2, 110.0, 15.0)
    assert (both["count"], both["seconds"], both["share_of_peer_time"]) == (3, 300.0, 0.3)


def test_a_rounds_total_is_split_by_cell_against_its_appliers_own_tokens(tmp_path: Path) -> None:
    """Two cells (weights 300 and 100) in a shard total of 400: the first cell's three members all applied, one of
    them outvoted (``own=0``: its 100 tokens are counted twice by the totals); of the second cell's two contributors
    one wrote no ``applied`` line (its 40 tokens are counted by the totals, missed by the own account)."""
    from bench.churn_tokens import round_accounts

    def shards(t: float, w: int, local: str) -> str:
        ts = datetime.fromtimestamp(T0 + t).strftime("%Y-%m-%d %H:%M:%S,000")
        return (f"ts={ts} level=INFO logger=p2ptrain.net.hierarchy event=shards key=f0.L9 phase=0 local={local} "
                f"weight={w} shards=s0:h:0badf00d:2:400,s1:c:0badf00d:2:400")

    def applied(t: float, own: int, divergent: bool = False) -> str:
        return _line(t, "f0.L9", own).replace("tokens=999 divergent=False", f"tokens=400 divergent={divergent}")

    logs = {"a": [shards(20, 300, "3/3"), applied(21, 100)], "b": [shards(20, 300, "3/3"), applied(21, 100)],
            "c": [shards(20, 300, "3/3"), applied(21, 0, True)], "d": [shards(20, 100, "2/2"), applied(21, 60)]}
    for name, lines in logs.items():
        (tmp_path / f"{name}.0.log").write_text("\n".join(lines) + "\n")
    phase = {"window_s": [10.0, 100.0], "started_unix": T0, "work": str(tmp_path),
             "peers": {n: {"lives": [{"log": f"{n}.0.log"}]} for n in logs}}
    (row,) = round_accounts(phase)
    assert (row["tokens"], row["own"], row["cells"], row["cells_in_total"]) == (400.0, 260.0, 2, 2)
    assert (row["counted_twice"], row["not_applied"], row["either"]) == (100.0, 40.0, 0.0)


def test_a_round_whose_theta_the_swarm_repaired_away_is_not_kept(tmp_path: Path) -> None:
    """A round applied by a minority forks θ; the next vote repairs its appliers onto the majority's θ (outvoted:
    divergent, no Δ of theirs in the round), so what it averaged never reached the θ the swarm ended on. A round
    built on by one that was is kept, through a chain of them; a member of a flagged cell whose Δ counted (own > 0)
    still built on its θ."""
    from bench.churn_tokens import kept_rounds

    def applied(t: float, key: str, divergent: bool, own: int) -> str:
        return _line(t, key, own).replace("divergent=False", f"divergent={divergent}")

    logs = {
        # a and b apply f0.L1, f0.L2 (the fork: c and d failed it) and f0.L3 where the vote goes against them
        "a": [applied(20, "f0.L1", False, 10), applied(30, "f0.L2", False, 10), applied(40, "f0.L3", True, 0)],
        "b": [applied(20, "f0.L1", False, 10), applied(30, "f0.L2", False, 10), applied(40, "f0.L3", True, 0)],
        # c and d held f0.L1's θ, won f0.L3 (d's cell was flagged, its Δ counted), then applied f0.L4
        "c": [applied(20, "f0.L1", False, 10), applied(40, "f0.L3", False, 10), applied(50, "f0.L4", False, 10)],
        "d": [applied(20, "f0.L1", False, 10), applied(40, "f0.L3", True, 10), applied(50, "f0.L4", False, 10)],
        # another fragment, applied by one peer only at the end: its last round is what the swarm ended on
        "e": [_line(60, "f1.L5", 10).replace("fragment=0", "fragment=1")],
    }
    for name, lines in logs.items():
        (tmp_path / f"{name}.0.log").write_text("\n".join(lines) + "\n")
    phase = {"work": str(tmp_path), "peers": {n: {"lives": [{"log": f"{n}.0.log"}]} for n in logs}}
    assert kept_rounds(phase) == {"f0.L1": True, "f0.L2": False, "f0.L3": True, "f0.L4": True, "f1.L5": True}
    # without the own > 0 rule, d alone would not carry f0.L1 into f0.L3: c still does
    (tmp_path / "c.0.log").write_text(applied(20, "f0.L1", False, 10) + "\n")
    assert kept_rounds(phase)["f0.L1"] is True
    (tmp_path / "d.0.log").write_text("\n".join([applied(20, "f0.L1", False, 10), applied(40, "f0.L3", True, 0),
                                                 applied(50, "f0.L4", False, 10)]) + "\n")
    assert kept_rounds(phase)["f0.L1"] is False  # nobody built f0.L3 on it any more


def test_churn_counts_goodput_in_the_rounds_the_swarm_kept(tmp_path: Path) -> None:
    """bench/churn.py's goodput target reads the kept rounds' tokens: a round applied by a minority and repaired
    away counts in ``tokens_in_theta`` but not here; a phase whose logs are gone has no such figure."""
    from bench.churn import kept_tokens, targets

    def applied(t: float, key: str, divergent: bool, own: int) -> str:
        return _line(t, key, own).replace("divergent=False", f"divergent={divergent}")

    logs = {"a": [applied(20, "f0.L1", False, 10), applied(40, "f0.L3", True, 0)],  # f0.L1 forked, then outvoted
            "b": [applied(40, "f0.L3", False, 10)], "c": [applied(40, "f0.L3", False, 10)]}
    for name, lines in logs.items():
        (tmp_path / f"{name}.0.log").write_text("\n".join(lines) + "\n")
    rounds = {"f0.L1": {"tokens": 300.0, "in_window": True}, "f0.L3": {"tokens": 500.0, "in_window": True}}
    phase = {"work": str(tmp_path), "peers": {n: {"lives": [{"log": f"{n}.0.log"}]} for n in logs}, "rounds": rounds}
    assert kept_tokens(phase, fragments=2) == 500.0 / 2
    assert kept_tokens({**phase, "work": str(tmp_path / "gone")}, fragments=2) is None
    figs = {"faults": {"diverged_replicas": 0, "rounds_with_diverged_replicas": 0, "stuck_rounds": 0,
                       "stuck_rounds_when_leaving": 0, "rss_growth_mb_per_min_median": None, "rss_growth": []}}
    goodput = [t for t in targets({"goodput": 0.99, "goodput_kept": 0.8}, figs) if t[0].startswith("goodput")]
    assert goodput == [("goodput ≥ 0.98 of the fault-free run", "0.800", False)]


def test_the_tokens_a_window_trained_count_whenever_their_round_is_applied(tmp_path: Path) -> None:
    """A round carries what was trained since its fragment's last applied round: its total is spread over that
    interval and the window's share of it counts, whether the round was applied inside the window or after it
    (the leaves' flush); a failed round counts nothing (its progress rides on the next), nor one not kept."""
    from bench.churn import targets
    from bench.churn_rounds import trained_in_window_reaching_theta

    # step_seconds 2, phase started at unix 1000: slot L is sent at 2L - 1000 seconds into the phase.
    rounds = {"f0.L550": {"fragment": 0, "outcome": "applied", "tokens": 400.0},   # sent at 100: (0, 100]
              "f0.L560": {"fragment": 0, "outcome": "failed", "tokens": 0},        # its progress rides on L570
              "f0.L570": {"fragment": 0, "outcome": "applied", "tokens": 600.0},   # sent at 140: (100, 140]
              "f0.L600": {"fragment": 0, "outcome": "applied", "tokens": 300.0},   # sent at 200: (140, 200]
              "f1.L580": {"fragment": 1, "outcome": "applied", "tokens": 800.0},   # sent at 160: (0, 160]
              "f1.L620": {"fragment": 1, "outcome": "applied", "tokens": 100.0}}   # sent at 240: (160, 240], after
    phase = {"window_s": [60.0, 180.0], "started_unix": 1000.0, "rounds": rounds}
    # f0: 400 · 40/100 + 600 + 300 · 40/60; f1: 800 · 100/160 + 100 · 20/80; over 2 fragments
    want = (160.0 + 600.0 + 200.0 + 500.0 + 25.0) / 2
    assert trained_in_window_reaching_theta(phase, fragments=2, step_seconds=2.0) == pytest.approx(want)
    kept = {k: k != "f0.L600" for k in rounds}  # repaired away: its share is in no θ
    assert trained_in_window_reaching_theta(phase, 2, 2.0, kept) == pytest.approx(want - 200.0 / 2)
    figs = {"faults": {"diverged_replicas": 0, "rounds_with_diverged_replicas": 0, "stuck_rounds": 0,
                       "stuck_rounds_when_leaving": 0, "rss_growth_mb_per_min_median": None, "rss_growth": []}}
    goodput = [t for t in targets({"goodput": 0.99, "goodput_kept": 0.8, "goodput_reached": 0.985}, figs)
               if t[0].startswith("goodput")]
    assert goodput == [("goodput ≥ 0.98 of the fault-free run", "0.985", True)]


def test_each_kill_loses_the_steps_since_the_checkpoint_its_next_life_resumed_from(tmp_path: Path) -> None:
    from bench.churn_tokens import kill_losses

    (tmp_path / "a.1.log").write_text("ts=x level=INFO logger=p2ptrain.peer.base event=resumed step=17 state=ab\n")
    (tmp_path / "a.2.log").write_text("no resume line: a life whose start never came that far\n")
    phase = {"work": str(tmp_path), "peers": {"a": {
        "lives": [{"started": 0.0, "ended": 50.0, "how": "killed", "log": "a.0.log"},
                  {"started": 50.0, "ended": 90.0, "how": "killed", "log": "a.1.log"},
                  {"started": 90.0, "ended": None, "how": "left at the end", "log": "a.2.log"}],
        "loss": [[10.0, 4, 2.0], [30.0, 12, 2.0], [49.0, 21, 2.0], [70.0, 25, 2.0], [95.0, 27, 2.0]]}}}
    assert kill_losses(phase) == [{"peer": "a", "log": "a.0.log", "last_step": 21, "resumed": 17, "lost": 4}]


def test_the_peer_time_is_each_lifes_seconds_inside_the_window() -> None:
    from bench.churn_tokens import live_seconds

    phase = {"window_s": [100.0, 400.0], "peers": {
        "a": {"lives": [{"started": 0.0, "ended": 150.0}, {"started": 180.0, "ended": None}]},  # 50 + 220
        "b": {"lives": [{"started": 410.0, "ended": 420.0}]},  # after the window: 0
        "c": {"lives": [{"started": 200.0, "ended": 250.0}]}}}  # 50
    assert live_seconds(phase) == pytest.approx(320.0)
