"""Taylor delay compensation: zero correction without progress or displacement, first order in the displacement,
first-order agreement on a quadratic."""

from __future__ import annotations

import torch

from p2ptrain.algo.delay import taylor_compensate, taylor_progress


def test_no_local_progress_gives_the_new_global_value() -> None:
    s = [torch.randn(4, 3)]
    new = [torch.randn(4, 3)]
    out, corr = taylor_compensate(new, s, [s[0].clone()], lam=50.0)
    assert torch.equal(out[0], new[0]) and corr == 0.0


def test_formula_hand_computed() -> None:
    s = torch.tensor([1.0, 2.0])
    local = torch.tensor([0.8, 2.1])  # g = s − local = [0.2, −0.1]
    new = torch.tensor([1.5, 1.0])  # D = new − s = [0.5, −1.0]
    # λ·g⊙g⊙D = 2·[0.04·0.5, 0.01·(−1)] = [0.04, −0.02]; new − g − that = [1.26, 1.12]
    (out,), corr = taylor_compensate([new], [s], [local], lam=2.0)
    assert torch.allclose(out, torch.tensor([1.26, 1.12]), atol=1e-6)
    assert abs(corr - (0.04**2 + 0.02**2) ** 0.5) < 1e-6


def test_the_correction_is_first_order_in_the_displacement() -> None:
    """It vanishes as D → 0 and doubles with D (the normalised rule once coded kept its size λ0·‖g‖ for any
    D ≠ 0, so it was not a first-order term)."""
    s, local = torch.randn(6), torch.randn(6)
    d = torch.randn(6)
    sizes = [taylor_compensate([s + eps * d], [s], [local], lam=3.0)[1] for eps in (1e-3, 2e-3, 4e-3)]
    assert sizes[0] > 0 and abs(sizes[1] / sizes[0] - 2) < 1e-3 and abs(sizes[2] / sizes[0] - 4) < 1e-3
    assert taylor_compensate([s.clone()], [s], [local], lam=3.0)[1] == 0.0


def test_lambda_zero_is_the_delta_rule() -> None:
    s, local, new = torch.randn(5), torch.randn(5), torch.randn(5)
    (out,), _ = taylor_compensate([new], [s], [local], lam=0.0)
    assert torch.allclose(out, local + (new - s))


def test_first_order_agreement_with_finite_difference_on_a_quadratic() -> None:
    """On f(w) = ½·Σ h_k w_k² + b·w with h = λ·g⊙g (the Hessian the compensation assumes),
    the compensated progress equals the finite-difference gradient at the new point."""
    torch.manual_seed(0)
    w_old = torch.randn(6, dtype=torch.float64)
    g = torch.randn(6, dtype=torch.float64)  # the gradient observed at w_old
    lam = 0.7
    h = lam * g * g
    b = g - h * w_old  # so that ∇f(w_old) = g

    def f(w: torch.Tensor) -> torch.Tensor:
        return 0.5 * (h * w * w).sum() + (b * w).sum()

    w_new = w_old + 0.3 * torch.randn(6, dtype=torch.float64)
    eps = 1e-6
    fd = torch.stack([(f(w_new + eps * e) - f(w_new - eps * e)) / (2 * eps) for e in torch.eye(6, dtype=torch.float64)])
    est = taylor_progress(g, w_new - w_old, lam)
    assert torch.allclose(est, fd, atol=1e-7)
    # Uncompensated, the stale gradient is off by exactly the Hessian term.
    assert not torch.allclose(g, fd, atol=1e-3)
