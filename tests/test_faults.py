"""Fault plans: read from the environment, counted per plan, and dying exactly where they say."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from p2ptrain.checkpoint import CheckpointDir
from p2ptrain.faults import ENV_KILL_IN_ALLREDUCE, ENV_KILL_IN_CHECKPOINT, FaultPlan


def test_a_plan_comes_from_the_environment() -> None:
    assert FaultPlan.from_env({}) == FaultPlan()
    plan = FaultPlan.from_env({ENV_KILL_IN_ALLREDUCE: "4", ENV_KILL_IN_CHECKPOINT: "2"})
    assert (plan.kill_in_allreduce, plan.kill_in_checkpoint, plan.corrupt) == (4, 2, None)
    with pytest.raises(ValueError, match=ENV_KILL_IN_ALLREDUCE):
        FaultPlan.from_env({ENV_KILL_IN_ALLREDUCE: "soon"})
    with pytest.raises(ValueError, match="unknown corruption"):
        FaultPlan(corrupt="gentle")


def test_each_plan_counts_its_own_calls() -> None:
    deaths: list[str] = []
    a = FaultPlan(kill_in_allreduce=2, kill=lambda: deaths.append("a"))
    b = FaultPlan(kill_in_allreduce=2, kill=lambda: deaths.append("b"))
    a.in_allreduce()
    b.in_allreduce()
    assert deaths == []
    a.in_allreduce()
    assert deaths == ["a"]  # the second call of a, not the fourth call of the process
    FaultPlan(kill=lambda: deaths.append("never")).in_allreduce()
    assert deaths == ["a"]


def test_a_checkpoint_write_dies_half_way_in_the_chosen_write(tmp_path: Path) -> None:
    class Died(Exception):
        pass

    def die() -> None:
        raise Died

    plan = FaultPlan(kill_in_checkpoint=2, kill=die)
    store = CheckpointDir(tmp_path, faults=plan)
    plan.checkpoint_begins()
    store.save(1, {"w": torch.ones(3)})
    plan.checkpoint_begins()
    with pytest.raises(Died):
        store.save(2, {"w": torch.ones(3)})
    assert [s for s, _ in store.paths()] == [1]  # the old checkpoint stands, the torn one never landed
    plan.checkpoint_begins()
    store.save(3, {"w": torch.ones(3)})
    assert [s for s, _ in store.paths()] == [1, 3]
