"""A leaver's unsent progress taken into an heir's contribution: the blend gives the weighted mean of the
pseudo-gradients (float64 reference), and an heir's bounds refuse what an honest leaver could not have sent."""

from __future__ import annotations

import torch

from p2ptrain.algo.bequest import Bequest, blend, displacement, problem

SHAPES = [torch.Size([3, 4]), torch.Size([5])]


def _rand(seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * scale for s in SHAPES]


def test_the_heirs_pseudo_gradient_after_the_blend_is_the_weighted_mean_of_all_of_them() -> None:
    theta = _rand(0)
    x_h = [t + d for t, d in zip(theta, _rand(1, 0.1), strict=True)]
    leavers = [(_rand(2, 0.1), 30), (_rand(3, 0.2), 5)]
    w_h = 20
    got = blend(x_h, theta, w_h, [Bequest(0, d, w) for d, w in leavers])
    for i in range(len(SHAPES)):
        t = theta[i].double()
        # Δ = θ − x for each contributor: the heir's own, and each leaver's −d
        want = (w_h * (t - x_h[i].double()) + sum(w * -d[i].double() for d, w in leavers)) / (w_h + 35)
        assert torch.allclose(t - got[i].double(), want, atol=1e-6)


def test_an_heir_without_tokens_of_its_own_sends_the_leavers_delta() -> None:
    theta, d = _rand(0), _rand(4, 0.3)
    got = blend(_rand(5), theta, 0, [Bequest(0, d, 7)])
    for g, t, di in zip(got, theta, d, strict=True):
        assert torch.allclose(g.double(), t.double() + di.double(), atol=1e-6)


def test_displacement_is_x_minus_theta() -> None:
    theta, x = _rand(0), _rand(6)
    for got, t, xi in zip(displacement(x, theta), theta, x, strict=True):
        assert torch.equal(got, xi - t)


def test_an_heir_refuses_what_breaks_its_bounds_and_takes_an_honest_bequest() -> None:
    own = _rand(7, 0.1)
    honest = Bequest(0, _rand(8, 0.1), 40)
    assert problem(honest, SHAPES, own, 20, cap=1000) is None
    assert "not the fragment's" in (problem(Bequest(0, _rand(8)[:1], 40), SHAPES, own, 20, cap=1000) or "")
    bad = _rand(8, 0.1)
    bad[1][2] = float("nan")
    assert problem(Bequest(0, bad, 40), SHAPES, own, 20, cap=1000) == "non-finite values"
    assert "tokens" in (problem(Bequest(0, _rand(8, 0.1), 5000), SHAPES, own, 20, cap=1000) or "")
    assert "tokens" in (problem(Bequest(0, _rand(8, 0.1), 0), SHAPES, own, 20, cap=1000) or "")
    # the norm: within 3× ours scaled by the tokens (40 vs 20: 6× ours) passes, more fails
    mine = float(torch.cat([t.flatten() for t in own]).norm())
    unit = _rand(9)
    n = float(torch.cat([t.flatten() for t in unit]).norm())
    at = [t * (5.9 * mine / n) for t in unit]
    over = [t * (6.1 * mine / n) for t in unit]
    assert problem(Bequest(0, at, 40), SHAPES, own, 20, cap=1000) is None
    assert "norm" in (problem(Bequest(0, over, 40), SHAPES, own, 20, cap=1000) or "")
    # nothing of our own to hold it to
    zero = [torch.zeros(s) for s in SHAPES]
    assert "no progress" in (problem(honest, SHAPES, zero, 20, cap=1000) or "")
    assert "no progress" in (problem(honest, SHAPES, own, 0, cap=1000) or "")
