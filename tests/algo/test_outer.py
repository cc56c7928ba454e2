"""Outer-loop primitives against hand-computed and float64 references."""

from __future__ import annotations

import torch

from p2ptrain.algo.outer import alpha_merge, eager_estimate, nesterov_step, pseudo_gradient


def test_pseudo_gradient_sign_is_global_minus_local() -> None:
    theta = [torch.tensor([1.0, 2.0])]
    local = [torch.tensor([0.5, 2.5])]  # the peer moved down in x0, up in x1
    (d,) = pseudo_gradient(theta, local)
    assert torch.equal(d, torch.tensor([0.5, -0.5]))
    # An outer SGD step of lr 1 on the mean Δ lands exactly on the peers' average.
    locals_ = [torch.tensor([0.5, 2.5]), torch.tensor([1.5, 1.0])]
    mean_delta = sum(pseudo_gradient(theta, [x])[0] for x in locals_) / 2
    t = [theta[0].clone()]
    t, _ = nesterov_step(t, [torch.zeros(2)], [mean_delta], lr=1.0, mu=0.0)
    assert torch.allclose(t[0], (locals_[0] + locals_[1]) / 2)


def test_nesterov_matches_torch_sgd() -> None:
    g = torch.Generator().manual_seed(0)
    p64 = torch.randn(5, 3, dtype=torch.float64, generator=g)
    deltas = [torch.randn(5, 3, dtype=torch.float64, generator=g) for _ in range(6)]
    ref = torch.nn.Parameter(p64.clone())
    opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    theta, buf = [p64.float().clone()], [torch.zeros(5, 3)]
    for d in deltas:
        ref.grad = d.clone()
        opt.step()
        theta, buf = nesterov_step(theta, buf, [d.float()], lr=0.7, mu=0.9)
    assert torch.allclose(theta[0].double(), ref.detach(), rtol=1e-5, atol=1e-5)


def test_nesterov_hand_computed_two_steps() -> None:
    theta, buf = [torch.tensor([1.0])], [torch.zeros(1)]
    before = [theta[0].clone(), buf[0].clone()]
    old = list(theta)
    theta, buf = nesterov_step(theta, buf, [torch.tensor([0.5])], lr=0.1, mu=0.9)
    assert torch.equal(old[0], before[0])  # copy-on-write: the old θ is untouched
    # b = 0.5; θ = 1 − 0.1·(0.5 + 0.9·0.5) = 0.905
    assert torch.allclose(theta[0], torch.tensor([0.905])) and torch.allclose(buf[0], torch.tensor([0.5]))
    theta, buf = nesterov_step(theta, buf, [torch.tensor([0.2])], lr=0.1, mu=0.9)
    # b = 0.9·0.5 + 0.2 = 0.65; θ = 0.905 − 0.1·(0.2 + 0.9·0.65) = 0.8265
    assert torch.allclose(theta[0], torch.tensor([0.8265]))


def test_alpha_merge() -> None:
    local, glob = [torch.tensor([2.0, 4.0])], [torch.tensor([0.0, 8.0])]
    assert torch.equal(alpha_merge(local, glob, 0.0)[0], glob[0])
    assert torch.equal(alpha_merge(local, glob, 1.0)[0], local[0])
    assert torch.allclose(alpha_merge(local, glob, 0.25)[0], torch.tensor([0.5, 7.0]))


def test_eager_estimate_algebra() -> None:
    # M = 4 peers, equal weights. Δ(t−1) = mean of all stale; peer 0 swaps its stale share for its fresh one.
    g = torch.Generator().manual_seed(1)
    stale = [torch.randn(3, generator=g) for _ in range(4)]
    fresh0 = torch.randn(3, generator=g)
    avg_stale = sum(stale) / 4
    (est,) = eager_estimate([avg_stale], [fresh0], [stale[0]], share=0.25)
    expected = (fresh0 + stale[1] + stale[2] + stale[3]) / 4
    assert torch.allclose(est, expected, atol=1e-6)
    # With no change in the own pseudo-gradient the estimate is the stale average.
    (same,) = eager_estimate([avg_stale], [stale[0]], [stale[0]], share=0.25)
    assert torch.equal(same, avg_stale)
