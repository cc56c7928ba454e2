"""The pure helpers of the swarm benchmarks: time to a target loss, loss curves from peer summaries,
the WAN penalty's target rule, the results writer."""

from __future__ import annotations

import json
import math

import pytest

from bench.harness import loss_at_step, time_to_target, val_curve, write_json
from bench.wan_penalty import default_target, swarm_time_to_target


def test_time_to_target_interpolates_between_the_two_points_around_the_crossing() -> None:
    pts = [(0.0, 5.0), (10.0, 4.0), (20.0, 3.0)]
    assert time_to_target(pts, 3.5) == pytest.approx(15.0)  # halfway from 4.0 (t=10) to 3.0 (t=20)
    assert time_to_target(pts, 3.8) == pytest.approx(12.0)
    assert time_to_target(pts, 4.0) == pytest.approx(10.0)  # reached exactly at a point
    assert time_to_target(pts, 6.0) == 0.0  # already below at the first point
    assert time_to_target(pts, 2.9) is None  # never


def test_time_to_target_takes_the_first_crossing_and_survives_a_flat_step() -> None:
    pts = [(0.0, 5.0), (1.0, 3.0), (2.0, 4.0), (3.0, 2.0)]
    assert time_to_target(pts, 3.0) == pytest.approx(1.0)
    assert time_to_target([(0.0, 4.0), (5.0, 3.0), (9.0, 3.0)], 3.0) == pytest.approx(5.0)


def _summary(start: float, log: list[tuple[float, int, float, float]], steps: int = 10) -> dict:
    return {"loop_started": start, "val_log": [list(x) for x in log], "steps": steps}


def test_val_curve_counts_training_time_without_the_evaluation_pauses() -> None:
    # loop starts at t=100; each evaluation takes 2 s; eval_so_far includes the evaluation of that point
    s = _summary(100.0, [(102.0, 0, 5.0, 2.0), (113.0, 5, 4.0, 4.0), (124.0, 10, 3.0, 6.0)])
    assert val_curve(s) == [(0.0, 5.0), (9.0, 4.0), (18.0, 3.0)]
    assert loss_at_step(s, 8) == 4.0
    assert loss_at_step(s, 10) == 3.0
    assert loss_at_step(_summary(0.0, [(1.0, 5, 4.0, 1.0)]), 4) is None


def test_a_swarm_reaches_the_target_when_its_last_peer_does() -> None:
    fast = _summary(0.0, [(0.0, 0, 5.0, 0.0), (10.0, 5, 3.0, 0.0)])  # 4.0 at t=5
    slow = _summary(0.0, [(0.0, 0, 5.0, 0.0), (20.0, 5, 3.0, 0.0)])  # 4.0 at t=10
    t, each = swarm_time_to_target([fast, slow], 4.0)
    assert t == pytest.approx(10.0) and each == pytest.approx([5.0, 10.0])
    assert swarm_time_to_target([fast, None], 4.0)[0] is None  # a peer without a summary: not reached
    assert swarm_time_to_target([fast, slow], 2.0)[0] is None


def test_default_target_is_the_worst_methods_loss_at_the_fraction_of_its_steps() -> None:
    a = [_summary(0.0, [(0.0, 0, 5.0, 0.0), (1.0, 8, 3.0, 0.0), (2.0, 10, 2.5, 0.0)])] * 2  # 3.0 at step 8
    b = [_summary(0.0, [(0.0, 0, 5.0, 0.0), (1.0, 8, 3.6, 0.0), (2.0, 10, 3.0, 0.0)]),
         _summary(0.0, [(0.0, 0, 5.0, 0.0), (1.0, 8, 3.4, 0.0), (2.0, 10, 3.0, 0.0)])]  # mean 3.5 at step 8
    assert default_target({"a": a, "b": b}, 0.8) == pytest.approx(3.5)
    with pytest.raises(RuntimeError, match="target"):
        default_target({"a": [None]}, 0.8)


def test_write_json_records_the_command_and_the_machine(tmp_path) -> None:
    path = tmp_path / "r" / "x.json"
    write_json(path, {"figure": 1.5, "nan": math.nan})
    got = json.loads(path.read_text())
    assert got["figure"] == 1.5 and got["command"].startswith("python ")
    assert got["machine"]["cores"] >= 1 and got["machine"]["arch"]
