"""Streaming behind error feedback counts a peer's progress once: what the wire did not carry lives either in
the buffer or in the local fragment (α of it, handed over at the apply), never in both (StreamingRules.merge:
the delta rule, then OuterLoop.finish moves α of the buffer into the local fragment; not the α-merge).

One peer, outer SGD η 1 without momentum: the outer step lands exactly on what was sent, so every unit of
local progress is in exactly one of three places: in θ (sent), in the buffer (not sent yet) or in the local
fragment's lead over θ (made after its snapshot, in no Δ yet). Hand-computed: ``θ_i − e = θ_0 + Σ progress``,
in float64, with the progress a fixed random drift per inner step.
"""

from __future__ import annotations

import pytest
import torch

from p2ptrain.algo.fragments import make_fragments
from p2ptrain.algo.methods import StreamingConfig
from p2ptrain.algo.rules import StreamingRules
from p2ptrain.sim.network import Network, Region
from p2ptrain.sim.runner import OuterRun, RunResult, SimConfig
from tests.algo.test_methods import SHAPES, UNITS, _Stats


class DriftPeer:
    """A peer whose every inner step adds a fixed drift ``v`` (float64): its total progress is known."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = {n: torch.zeros(s, dtype=torch.float64) for n, s in SHAPES.items()}
        # heavy-tailed so top-k leaves most coordinates behind for many rounds
        self.v = {n: torch.randn(s, generator=g, dtype=torch.float64) * torch.rand(s, generator=g,
                                                                                  dtype=torch.float64) ** 4
                  for n, s in SHAPES.items()}
        self.tokens_seen, self.steps = 0, 0

    def step(self) -> _Stats:
        for n in self.x:
            self.x[n] += self.v[n]
        self.tokens_seen += 10
        self.steps += 1
        return _Stats()

    def evaluate(self, params: dict[str, torch.Tensor] | None = None) -> _Stats:
        return _Stats()

    def snapshot(self, names: list[str]) -> list[torch.Tensor]:
        return [self.x[n].clone() for n in names]

    def apply_outer(self, names: list[str], values: list[torch.Tensor]) -> None:
        for n, v in zip(names, values, strict=True):
            self.x[n] = v.to(torch.float64).clone()


def _run(cfg: StreamingConfig, steps: int) -> tuple[OuterRun, DriftPeer, RunResult]:
    peer = DriftPeer()
    sim = SimConfig(peers=1, steps=steps, step_time=1.0, eval_every=10**6)
    net = Network([Region("r", 1, 1e12)])
    res = RunResult(cfg.name, cfg.name, 1, cfg.to_dict())
    r = OuterRun(sim, cfg, [peer], net, res, None, make_fragments(UNITS, cfg.fragments, cfg.fragment_mode))
    r.run()
    return r, peer, res


def _unaccounted(r: OuterRun, peer: DriftPeer, steps: int) -> float:
    """The largest |θ_i − e − Σ progress| over every parameter (θ_0 = 0), relative to the total progress."""
    outer = r.outers[0]
    frags = make_fragments(UNITS, outer.cfg.fragments, outer.cfg.fragment_mode)
    worst, scale = 0.0, 0.0
    for frag, state in zip(frags, outer.state_dict()["fragments"], strict=True):
        err = state["compressor"]["error"]
        buf = frag.split(err[0].double()) if err else [torch.zeros(s, dtype=torch.float64) for s in frag.shapes]
        for name, e in zip(frag.names, buf, strict=True):
            total = steps * peer.v[name]
            worst = max(worst, float((peer.x[name] - e.view(total.shape) - total).abs().max()))
            scale = max(scale, float(total.abs().max()))
    return worst / scale


@pytest.mark.parametrize("codec", ["topk2", "topk2:0.03", "2bit", "1bit"])
@pytest.mark.parametrize(("tau", "alpha"), [(0, 0.5), (1, 0.0), (1, 0.5), (3, 1.0)])
def test_streaming_behind_error_feedback_counts_progress_once(codec: str, tau: int, alpha: float) -> None:
    cfg = StreamingConfig(H=8, P=4, tau=tau, alpha=alpha, codec=codec, outer_lr=1.0, outer_momentum=0.0)
    steps = 8 * 30 + 3  # 30 rounds of every fragment, ending mid-window (fragments with a lead)
    r, peer, res = _run(cfg, steps)
    assert res.syncs > 0
    if alpha == 1.0:  # the local fragment keeps all it did not send: the buffer is empty after each apply
        states = r.outers[0].state_dict()["fragments"]
        assert all(float(st["compressor"]["error"][0].abs().max()) == 0.0 for st in states)
    # float32 on the wire and in the buffer: a few ulps of the total per round
    assert _unaccounted(r, peer, steps) < 1e-4


def test_the_alpha_merge_would_count_the_unsent_progress_twice() -> None:
    """The same check fails for the α-merge (the rule used before): the instrument can see the defect."""
    cfg = StreamingConfig(H=8, P=4, tau=1, alpha=0.5, codec="topk2", outer_lr=1.0, outer_momentum=0.0)
    steps = 8 * 30 + 3
    plain, keeps = StreamingRules.merge, StreamingRules.keeps_unsent
    try:
        StreamingRules.merge = lambda self, theta, snap, local: (  # type: ignore[method-assign]
            [0.5 * x + 0.5 * t for x, t in zip(local, theta, strict=True)], 0.0)
        StreamingRules.keeps_unsent = 0.0  # type: ignore[assignment]
        r, peer, _ = _run(cfg, steps)
    finally:
        StreamingRules.merge, StreamingRules.keeps_unsent = plain, keeps  # type: ignore[method-assign]
    assert _unaccounted(r, peer, steps) > 0.05


@pytest.mark.parametrize("m", [0.25, 0.5])
def test_sent_merge_keeps_that_share_of_the_sent_positions_distance_from_theta(m: float) -> None:
    """One peer, one round, outer SGD η 0.5 from θ_0 = 0: the sent part Q moves θ to −ηQ while it alone would have
    put the peer at −Q, so the position's distance from the new θ is ((1 − η)/η)·θ = θ, and the local fragment
    with ``sent_merge`` m ends at the one without it plus m·θ (float64, by hand)."""
    def cfg(sent_merge: float) -> StreamingConfig:
        return StreamingConfig(H=4, P=1, tau=0, codec="topk2:0.03", outer_lr=0.5, outer_momentum=0.0,
                               sent_merge=sent_merge)

    r0, plain, _ = _run(cfg(0.0), 4)
    r1, merged, _ = _run(cfg(m), 4)
    theta = r1.outers[0].outer_params()
    assert all(torch.equal(theta[n], t) for n, t in r0.outers[0].outer_params().items())  # θ is not touched
    assert any(float(theta[n].abs().max()) > 0 for n in theta)
    for n in theta:
        expected = plain.x[n] + m * theta[n].double()
        assert torch.allclose(merged.x[n], expected, rtol=0, atol=1e-6), n


def test_sent_merge_defaults_to_a_quarter_behind_error_feedback_with_alpha_1_only() -> None:
    assert StreamingConfig(H=4, P=1, codec="topk2").sent_merge == 0.25
    assert StreamingConfig(H=4, P=1, codec="topk2", alpha=0.5).sent_merge == 0.0
    assert StreamingConfig(H=4, P=1, codec="e3m0").sent_merge == 0.0
    with pytest.raises(ValueError, match="sent_merge"):
        StreamingConfig(H=4, P=1, codec="topk2", sent_merge=1.0)
