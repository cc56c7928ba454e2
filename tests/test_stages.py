"""The run's stage partition and the model slices built from it (no network)."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.algo.fragments import make_fragments, model_units
from p2ptrain.model import GPT, ModelConfig
from p2ptrain.stages import StageModel, StagePlan

UNTIED = ModelConfig(d_model=32, n_layers=5, n_heads=2, seq_len=16, tie_embeddings=False)


def test_partition_is_contiguous_and_covers_every_unit_once() -> None:
    plan = StagePlan.of(UNTIED, 2)
    assert plan.groups == (("embed", "blocks.0", "blocks.1"), ("blocks.2", "blocks.3", "blocks.4", "norm", "head"))
    assert plan.namespace("demo", 0) == "demo.stage0of2" and plan.namespace("demo", 1) == "demo.stage1of2"
    assert StagePlan.of(UNTIED, 1).namespace("demo", 0) == "demo"  # an unsplit run keeps its namespace
    assert [tuple(plan.held_by(r, 2).groups) for r in range(2)] == [(0,), (1,)]
    assert tuple(plan.held_by(0, 1).groups) == (0, 1)  # a one-process peer holds every group


def test_bad_partitions_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="untied embeddings"):
        StagePlan.of(ModelConfig(d_model=32, n_layers=4, n_heads=2), 2)
    with pytest.raises(ValueError, match="between 1 and the model's 5 layers"):
        StagePlan.of(UNTIED, 6)
    with pytest.raises(ValueError, match="S must divide S_run"):
        StagePlan.of(UNTIED, 4).held_by(0, 3)


def test_stage_slices_compose_to_the_whole_model_with_the_same_names_and_fragments() -> None:
    torch.manual_seed(0)
    full = GPT(UNTIED)
    plan = StagePlan.of(UNTIED, 2)
    stages = [StageModel(full, g) for g in plan.groups]
    x = torch.randint(0, 256, (2, 16))
    out = x
    for s in stages:
        out = s(out)
    torch.testing.assert_close(out, full(x), rtol=0, atol=0)
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert names == [n for n, _ in full.named_parameters()]
    # Fragments of a stage are made of that stage's units only, with the whole model's names.
    frags = make_fragments(model_units(stages[1]), 2)
    assert {u for f in frags for u in f.units} == set(plan.groups[1])
    with pytest.raises(ValueError, match="contiguous"):
        StageModel(full, ["embed", "blocks.2"])


@pytest.mark.parametrize(("flags", "match"), [
    (["--pipeline-stages", "2"], "set [model] tie_embeddings = false"),  # printed as text, not markup
    (["--pipeline-stages", "2", "--untie-embeddings", "--run-stages", "3"], "S must divide S_run"),
    (["--pipeline-stages", "2", "--untie-embeddings", "--micro-batches", "1"], "1F1B needs micro-batches"),
    (["--pipeline-stages", "2", "--untie-embeddings", "--pipeline-schedule", "zigzag"], "'zigzag' is not one of"),  # a choice
    (["--pipeline-stages", "2", "--untie-embeddings", "--batch-size", "3"], "multiple of the micro-batches"),
    (["--pipeline-stages", "2", "--untie-embeddings", "--pipeline-timeout", "0"], "timeout must be positive"),
    (["--run-stages", "2", "--untie-embeddings", "--method", "ddp"], "outer-loop method"),
    (["--run-stages", "9", "--untie-embeddings"], "between 1 and the model's 6 layers"),
])
def test_bad_stage_flags_fail_once_before_any_stage_process(flags: list[str], match: str) -> None:
    """The launcher checks the stage flags itself: one clear error, exit code 2, no stage process started
    (a launch from here would fail with another message: this is not the `p2ptrain join` command line)."""
    from typer.testing import CliRunner

    from p2ptrain.cli import app

    r = CliRunner().invoke(app, ["join", "--steps", "1", "--metrics-port", "-1", "-q", *flags])
    assert r.exit_code == 2, r.output
    assert match in " ".join(r.output.split()) and "stage processes" not in r.output, r.output
