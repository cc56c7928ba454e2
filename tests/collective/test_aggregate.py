"""Robust aggregation against hand-computed and float64 references."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.collective.aggregate import aggregate, centered_clip, trimmed_mean, weighted_mean


def test_weighted_mean_by_hand() -> None:
    xs = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])]
    assert torch.equal(weighted_mean(xs, [1.0, 3.0]), torch.tensor([2.5, 5.0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_weighted_mean_sums_in_float64(dtype: torch.dtype) -> None:
    """Each contribution is added to a float64 sum as it is (no float64 copy of it): the same values as adding its
    float64 copy, and within one float32 rounding of the exact mean."""
    g = torch.Generator().manual_seed(1)
    xs = [(torch.randn(5001, generator=g) * 10 ** k).to(dtype) for k in range(3)]
    ws = [1.0, 2.5, 0.5]
    total = sum(ws)
    ref = torch.zeros(5001, dtype=torch.float64)
    for x, w in zip(xs, ws, strict=True):
        ref.add_(x.to(torch.float64), alpha=w / total)
    got = weighted_mean(xs, ws)
    assert got.dtype == dtype
    assert torch.equal(got, ref.to(dtype))
    exact = sum(x.double() * w for x, w in zip(xs, ws, strict=True)) / total
    assert torch.allclose(got.double(), exact, rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-6, atol=1e-12)


def test_trimmed_mean_by_hand() -> None:
    # per coordinate, n = 5, trim 0.2 → drop the smallest and the largest value
    xs = [torch.tensor([1.0, 10.0]), torch.tensor([2.0, -50.0]), torch.tensor([3.0, 20.0]),
          torch.tensor([4.0, 30.0]), torch.tensor([1000.0, 40.0])]
    out = trimmed_mean(xs, [1.0] * 5)
    assert torch.allclose(out, torch.tensor([3.0, 20.0]))  # (2+3+4)/3, (10+20+30)/3
    # weights follow their values through the sort: weight 2 on the value 4 → (2 + 3 + 2·4) / 4
    out = trimmed_mean(xs, [1.0, 1.0, 1.0, 2.0, 1.0])
    assert torch.allclose(out[0], torch.tensor(13.0 / 4))


def test_trimmed_mean_of_few_peers_is_the_mean() -> None:
    xs = [torch.randn(7) for _ in range(4)]  # ⌊0.2·4⌋ = 0: nothing to trim
    assert torch.allclose(trimmed_mean(xs, [1.0, 2.0, 3.0, 4.0]), weighted_mean(xs, [1.0, 2.0, 3.0, 4.0]))


def test_centered_clip_equals_the_mean_when_everyone_is_within_tau() -> None:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(50, generator=g, dtype=torch.float64) for _ in range(5)]
    ws = [1.0, 2.0, 1.0, 1.0, 3.0]
    ref = weighted_mean(xs, ws)
    out = centered_clip(xs, ws, tau=1e6, iters=1)  # no clipping: one step from the median lands on the mean
    assert torch.allclose(out, ref, atol=1e-12)


def test_centered_clip_one_step_by_hand() -> None:
    xs = [torch.tensor([0.0], dtype=torch.float64), torch.tensor([0.0], dtype=torch.float64),
          torch.tensor([10.0], dtype=torch.float64)]
    # v0 = median = 0; τ = 1: the outlier pulls by min(1, 1/10)·10 = 1 with weight 1/3
    out = centered_clip(xs, [1.0, 1.0, 1.0], tau=1.0, iters=1)
    assert out.item() == pytest.approx(1.0 / 3.0, abs=1e-12)


@pytest.mark.parametrize("how", ["trimmed-mean", "centered-clip"])
def test_one_scaled_peer_of_five_barely_moves_a_robust_aggregate(how: str) -> None:
    g = torch.Generator().manual_seed(1)
    base = torch.randn(1000, generator=g)
    honest = [base + 0.1 * torch.randn(1000, generator=g) for _ in range(4)]
    attacker = -100.0 * honest[0]
    ws = [1.0] * 5
    ref = weighted_mean(honest, [1.0] * 4)
    err_mean = (aggregate([*honest, attacker], ws, "mean") - ref).norm() / ref.norm()
    err_robust = (aggregate([*honest, attacker], ws, how) - ref).norm() / ref.norm()
    assert err_mean > 10.0  # the plain mean is ruined
    assert err_robust < 0.15, float(err_robust)


def test_bad_input_is_refused() -> None:
    x = [torch.zeros(3)]
    with pytest.raises(ValueError):
        aggregate(x, [1.0], "median-of-means")
    with pytest.raises(ValueError):
        aggregate(x, [0.0])
    with pytest.raises(ValueError):
        aggregate(x, [float("nan")])
    with pytest.raises(ValueError):
        aggregate([torch.zeros(3), torch.zeros(4)], [1.0, 1.0])
    with pytest.raises(ValueError):
        aggregate([], [])
