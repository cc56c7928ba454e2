"""The analytic compute-utilization model (p2ptrain.sim.utilization) against hand computations and
against Table 4 of Streaming DiLoCo (arXiv 2501.18512)."""

from __future__ import annotations

import itertools
import math

import pytest

from p2ptrain.sim.utilization import (
    CU_TARGETS,
    PAPER_METHODS,
    PAPER_SETTINGS,
    PAPER_TABLE4,
    format_utilization_table,
    paper_figure,
    required_bandwidth,
    sync_plan,
    utilization,
    utilization_table,
)

ONE_B = {"params": 1e9, "layers": 24, "step_time": 0.1}


def test_diloco_hand_computed_without_overlap() -> None:
    # DiLoCo, N = 1e9, bf16 (2 B/param), ring factor 2 (M → ∞), H = 100, t_step = 0.1 s, CU = 0.9,
    # nothing overlapped with the backward pass: compute per round = 100 · 0.1 = 10 s; allowed
    # stall = 10/0.9 − 10 = 1.111 s; bits = 1e9 · 2 B · 8 · 2 = 3.2e10 → 3.2e10 / 1.111 = 2.88e10 bit/s.
    bw = required_bandwidth("diloco", **ONE_B, cu=0.9, workers=None, bytes_per_param=2, backward_overlap=0.0)
    assert bw == pytest.approx(3.2e10 / (10 / 0.9 - 10), rel=1e-9)
    assert bw == pytest.approx(2.88e10, rel=1e-9)


def test_diloco_hand_computed_paper_conventions() -> None:
    # Paper conventions: M = 2 (ring factor 1), bf16, backward = 2/3 of the step. Layer ℓ's chunk
    # is ready at −(ℓ−1)/24 · 0.0667 s; the link drains from the first (layer 24, at −23/360 s)
    # and layer 1 — due at 0 — is last: stall = T − 23/360 s. CU 0.9 → stall = 10/9 s, so
    # T = 10/9 + 23/360 = 423/360 s for 1e9 · 16 bits.
    bw = required_bandwidth("diloco", **ONE_B, cu=0.9)
    assert bw == pytest.approx(1.6e10 / (423 / 360), rel=1e-9)
    assert utilization("diloco", bw, **ONE_B) == pytest.approx(0.9, rel=1e-9)


def test_ddp_hand_computed_tail() -> None:
    # DDP at CU 0.99: a layer's chunk (1e9/24 · 16 bits) is shorter than its backward slice, so
    # only layer 1's chunk, ready at the end of the backward pass and due at once, stalls:
    # 0.1 / (0.1 + c) = 0.99 → c = 0.1/99 s → bandwidth = (1.6e10/24) · 99 / 0.1 = 6.6e11 bit/s.
    bw = required_bandwidth("ddp", **ONE_B, cu=0.99)
    assert bw == pytest.approx(1.6e10 / 24 * 99 / 0.1, rel=1e-9)


def test_eager_is_throughput_bound() -> None:
    # Eager: the whole model (1.6e10 bits) may take the next round (10 s); at 50% CU the link is
    # the bottleneck, period = T = 20 s → 8e8 bit/s; at CU = 1 it must carry a round per round → 1.6e9.
    assert required_bandwidth("eager", **ONE_B, cu=0.5) == pytest.approx(8e8, rel=1e-9)
    assert required_bandwidth("eager", **ONE_B, cu=1.0) == pytest.approx(1.6e9, rel=1e-9)


@pytest.mark.parametrize("method", ["ddp", "diloco", "streaming", "streaming-overlap", "streaming-fp4", "eager"])
def test_utilization_is_monotone_in_bandwidth(method: str) -> None:
    sweep = [10 ** (7 + k / 10) for k in range(50)]  # 10 Mbit/s .. 1 Tbit/s
    cus = [utilization(method, b, **ONE_B) for b in sweep]
    assert all(0.0 <= c <= 1.0 for c in cus)
    assert all(a <= b + 1e-12 for a, b in itertools.pairwise(cus))
    assert utilization(method, 0.0, **ONE_B) == 0.0
    assert utilization(method, math.inf, **ONE_B) == pytest.approx(1.0)


@pytest.mark.parametrize("method", ["ddp", "diloco", "streaming", "streaming-overlap", "streaming-fp4", "eager"])
@pytest.mark.parametrize("cu", CU_TARGETS)
def test_required_bandwidth_is_the_least(method: str, cu: float) -> None:
    bw = required_bandwidth(method, **ONE_B, cu=cu)
    assert utilization(method, bw * (1 + 1e-9), **ONE_B) >= cu
    assert utilization(method, bw * (1 - 1e-6), **ONE_B) < cu


def test_ordering_where_the_math_says_so() -> None:
    for s in PAPER_SETTINGS.values():
        setting = {"params": s.params, "layers": s.layers, "step_time": s.step_time}
        for cu in CU_TARGETS:
            bw = {m: required_bandwidth(m, **setting, cu=cu) for m in (*PAPER_METHODS, "eager")}
            # Same fragments, due τ steps later: overlap never needs more.
            assert bw["streaming-overlap"] <= bw["streaming"]
            # Same syncs, due a round later: eager never needs more than DiLoCo.
            assert bw["eager"] <= bw["diloco"]
            # The 4-bit wire carries a quarter of bf16's bits with the same timing: exactly 4× less.
            assert bw["streaming-fp4"] == pytest.approx(bw["streaming-overlap"] / 4, rel=1e-9)
            # Not a theorem, but true at the paper's settings (as in its Table 4).
            assert bw["streaming"] <= bw["diloco"] < bw["ddp"]


def test_tau_and_fragments() -> None:
    base = required_bandwidth("streaming-overlap", **ONE_B, cu=0.95)
    assert required_bandwidth("streaming-overlap", **ONE_B, cu=0.95, tau=0) == pytest.approx(
        required_bandwidth("streaming", **ONE_B, cu=0.95), rel=1e-9)
    assert required_bandwidth("streaming-overlap", **ONE_B, cu=0.95, tau=5) < base
    plan = sync_plan("streaming", params=1e9, layers=24)
    assert len(plan.syncs) == 8 and plan.window_steps == pytest.approx(12.5)
    assert plan.syncs[0] == (1, 9, 17)
    assert sorted(layer for s in plan.syncs for layer in s) == list(range(1, 25))
    assert len(sync_plan("streaming", params=100e9, layers=108).syncs) == 36


def test_ring_factor_and_alias() -> None:
    two = required_bandwidth("diloco", **ONE_B, cu=0.9)
    assert required_bandwidth("diloco", **ONE_B, cu=0.9, workers=None) == pytest.approx(2 * two, rel=1e-9)
    assert required_bandwidth("diloco", **ONE_B, cu=0.9, workers=4) == pytest.approx(1.5 * two, rel=1e-9)
    assert required_bandwidth("cocodc", **ONE_B, cu=0.9) == required_bandwidth("streaming-fp4", **ONE_B, cu=0.9)


def test_unreachable_and_trivial_targets() -> None:
    for method in ("ddp", "diloco", "streaming"):  # blocking: the last chunk always stalls
        assert required_bandwidth(method, **ONE_B, cu=1.0) == math.inf
    assert math.isfinite(required_bandwidth("streaming-overlap", **ONE_B, cu=1.0))
    assert required_bandwidth("diloco", **ONE_B, cu=1.5) == math.inf
    assert required_bandwidth("diloco", **ONE_B, cu=0.0) == 0.0
    # A 0.5 s latency against 1 step (0.1 s) of overlap stalls ≥ 0.4 s per 1.25 s window: CU ≤ 0.76.
    assert required_bandwidth("streaming-overlap", **ONE_B, cu=0.8, latency=0.5) == math.inf
    assert math.isfinite(required_bandwidth("streaming-overlap", **ONE_B, cu=0.7, latency=0.5))
    with pytest.raises(ValueError):
        required_bandwidth("nope", **ONE_B, cu=0.9)
    with pytest.raises(ValueError):
        utilization("diloco", 1e9, **ONE_B, workers=1)


def test_paper_table_shape() -> None:
    assert set(PAPER_SETTINGS) == {"1B", "10B", "100B"}
    for model in PAPER_SETTINGS:
        for method in PAPER_METHODS:
            row = PAPER_TABLE4[(model, method)]
            assert tuple(row) == CU_TARGETS and all(isinstance(v, float) for v in row.values())
        assert all(v is None for v in PAPER_TABLE4[(model, "eager")].values())
    assert paper_figure("1B", "ddp", 0.99) == 569.0
    assert paper_figure("100B", "streaming-fp4", 0.5) == 0.5
    assert paper_figure("1B", "cocodc", 0.5) is None


def test_within_a_factor_two_of_every_paper_figure() -> None:
    rows = utilization_table()
    assert len(rows) == 3 * 6 * 5
    compared = [r for r in rows if r.paper_gbps is not None]
    assert len(compared) == 3 * 5 * 5
    for r in compared:
        assert r.ratio == pytest.approx(r.ours_gbps / r.paper_gbps)
        assert 0.5 <= r.ratio <= 2.0, r
    assert all(r.ratio is None for r in rows if r.method == "eager")


def test_format() -> None:
    text = format_utilization_table(utilization_table())
    assert "streaming-fp4" in text and "100B" in text and "CU 99%" in text
    assert "569" in text
