"""The outer-loop methods end to end on virtual peers with a known, deterministic inner loop.

Each fake peer descends its own quadratic, ``x ← x − 0.1·(x − c_i)``, so the
math of every method can be checked against closed forms and against each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from p2ptrain.algo.fragments import make_fragments
from p2ptrain.algo.methods import (
    CoCoDCConfig,
    DiLoCoConfig,
    DiLoCoXConfig,
    EagerConfig,
    MethodConfig,
    OuterLoop,
    StreamingConfig,
    method_config,
)
from p2ptrain.sim.network import Network, Region
from p2ptrain.sim.runner import OuterRun, RunResult, SimConfig

SHAPES = {"embed.weight": (6, 4), "blocks.0.w": (4, 4), "blocks.1.w": (4, 4), "blocks.2.w": (4, 3),
          "blocks.3.w": (3, 3), "norm.weight": (3,)}
UNITS = [(n.rsplit(".", 1)[0], [(n, s)]) for n, s in SHAPES.items()]


@dataclass
class _Stats:
    seconds: float = 1.0
    loss: float = 0.0


class FakePeer:
    """A peer whose inner step is a gradient step on ½‖x − c_i‖² (lr 0.1)."""

    def __init__(self, rank: int, lr: float = 0.1) -> None:
        g = torch.Generator().manual_seed(100 + rank)
        self.x = {n: torch.zeros(s) for n, s in SHAPES.items()}
        self.c = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
        self.lr, self.tokens_seen, self.steps = lr, 0, 0

    def step(self) -> _Stats:
        for n in self.x:
            self.x[n] -= self.lr * (self.x[n] - self.c[n])
        self.tokens_seen += 10
        self.steps += 1
        return _Stats()

    def evaluate(self, params: dict[str, torch.Tensor] | None = None) -> _Stats:
        p = params or self.x
        return _Stats(loss=float(sum((p[n] - self.c[n]).pow(2).sum() for n in p)))

    def snapshot(self, names: Sequence[str]) -> list[torch.Tensor]:
        return [self.x[n].clone() for n in names]

    def apply_outer(self, names: Sequence[str], values: Sequence[torch.Tensor]) -> None:
        for n, v in zip(names, values, strict=True):
            self.x[n] = v.clone()


def run(cfg: MethodConfig, peers: int, steps: int, *, bandwidth: float = 1e12, step_time: float = 1.0,
        latency: float = 0.0) -> tuple[OuterRun, list[FakePeer], RunResult]:
    fakes = [FakePeer(i) for i in range(peers)]
    sim = SimConfig(peers=peers, steps=steps, step_time=step_time, eval_every=10**6)
    net = Network([Region("r", peers, bandwidth)], intra_latency=latency)
    res = RunResult(cfg.name, cfg.name, peers, cfg.to_dict())
    r = OuterRun(sim, cfg, fakes, net, res, None, make_fragments(UNITS, cfg.fragments, cfg.fragment_mode))
    r.run()
    return r, fakes, res


def local_only(peers: int, steps: int) -> list[FakePeer]:
    fakes = [FakePeer(i) for i in range(peers)]
    for f in fakes:
        for _ in range(steps):
            f.step()
    return fakes


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = 1e-5) -> bool:
    return all(torch.allclose(a[n], b[n], atol=tol, rtol=tol) for n in a)


def test_diloco_with_outer_sgd_lr1_is_fedavg() -> None:
    r, fakes, _ = run(DiLoCoConfig(H=5, outer_lr=1.0, outer_momentum=0.0), peers=3, steps=5)
    ref = local_only(3, 5)
    mean = {n: sum(f.x[n] for f in ref) / 3 for n in SHAPES}
    assert close(r.outers[0].outer_params(), mean, 1e-6)
    for f in fakes:  # every peer restarts from θ
        assert close(f.x, mean, 1e-6)


@pytest.mark.parametrize("cfg", [
    DiLoCoConfig(H=6),
    StreamingConfig(H=8, P=4, tau=1, codec="fp32"),
    StreamingConfig(H=8, P=2, tau=3, codec="e3m0"),
    CoCoDCConfig(H=8, P=4, tau=3, sends_per_window=8, codec="fp8"),
    DiLoCoXConfig(H=6, start_rule="delta", rank=2),
    DiLoCoXConfig(H=6, start_rule="naive", rank=2),
    EagerConfig(H=6, variant="naive"),
])
def test_outer_parameters_agree_across_peers(cfg: MethodConfig) -> None:
    r, _, res = run(cfg, peers=3, steps=30)
    assert res.syncs > 0
    ref = r.outers[0].outer_params()
    for o in r.outers[1:]:
        assert all(torch.equal(ref[n], t) for n, t in o.outer_params().items())


def test_eager_outer_parameters_are_per_peer() -> None:
    r, _, _ = run(EagerConfig(H=6, variant="eager"), peers=3, steps=30)
    a, b = r.outers[0].outer_params(), r.outers[1].outer_params()
    assert not all(torch.equal(a[n], b[n]) for n in a)


def test_streaming_with_one_fragment_no_overlap_and_alpha0_is_diloco() -> None:
    a, fa, _ = run(DiLoCoConfig(H=6, outer_lr=0.7, outer_momentum=0.9), peers=3, steps=24)
    b, fb, _ = run(StreamingConfig(H=6, P=1, tau=0, alpha=0.0, outer_lr=0.7, codec="fp32"), peers=3, steps=24)
    assert close(a.outers[0].outer_params(), b.outers[0].outer_params())
    assert close(fa[1].x, fb[1].x)


def test_cocodc_without_overlap_is_diloco() -> None:
    a, _, _ = run(DiLoCoConfig(H=6), peers=2, steps=24)
    b, _, _ = run(CoCoDCConfig(H=6, P=1, tau=0, sends_per_window=1, codec="fp32", outer_lr=0.7, late="stall"),
                  peers=2, steps=24)
    assert close(a.outers[0].outer_params(), b.outers[0].outer_params())


def test_eager_with_one_peer_is_diloco() -> None:
    """M = 1: Δ̃ = Δ(t−1) + (Δ_i(t) − Δ_i(t−1)) = Δ_i(t), the fresh value: no delay at all.
    (μ = 0: the end-of-run drain applies a zero Δ̃, which momentum would still move.)"""
    a, fa, _ = run(DiLoCoConfig(H=5, outer_momentum=0.0), peers=1, steps=25)
    b, fb, _ = run(EagerConfig(H=5, variant="eager", outer_momentum=0.0), peers=1, steps=25)
    assert close(a.outers[0].outer_params(), b.outers[0].outer_params())
    assert close(fa[0].x, fb[0].x)


def test_naive_delayed_with_one_peer_lags() -> None:
    a, _, _ = run(DiLoCoConfig(H=5), peers=1, steps=25)
    b, _, _ = run(EagerConfig(H=5, variant="naive"), peers=1, steps=25)
    assert not close(a.outers[0].outer_params(), b.outers[0].outer_params(), 1e-3)


@pytest.mark.parametrize("cfg", [
    CoCoDCConfig(H=8, P=4, tau=3, lambda0=0.0, sends_per_window=4, codec="fp32", outer_lr=1.0, outer_momentum=0.0),
    CoCoDCConfig(H=8, P=2, tau=5, lambda0=0.0, sends_per_window=8, codec="fp32", outer_lr=1.0, outer_momentum=0.0),
    EagerConfig(H=5, variant="eager", outer_lr=1.0, outer_momentum=0.0),
    EagerConfig(H=5, variant="eager", overlap_rounds=2, outer_lr=1.0, outer_momentum=0.0),
])
def test_one_peer_with_outer_sgd_lr1_is_plain_local_training(cfg: MethodConfig) -> None:
    """Nothing is counted twice or lost: with one peer the average is its own Δ, so an outer
    step of lr 1 lands on its own snapshot and the local trajectory is untouched. (λ0 = 0: the
    normalised Taylor term has size λ0·‖g‖ for any D ≠ 0, and float rounding leaves D ≠ 0.)
    The run ends on a round boundary: restart rules drop a partial last round's progress."""
    _, fakes, _ = run(cfg, peers=1, steps=40)
    assert close(fakes[0].x, local_only(1, 40)[0].x, 1e-5)


def test_streaming_alpha_merge_pulls_back_overlap_progress() -> None:
    # α = 1 keeps the local value: with one peer and lr 1 that is plain local training too.
    cfg = StreamingConfig(H=8, P=2, tau=2, alpha=1.0, codec="fp32", outer_lr=1.0, outer_momentum=0.0)
    _, fakes, _ = run(cfg, peers=1, steps=24)
    assert close(fakes[0].x, local_only(1, 24)[0].x, 1e-5)
    cfg = StreamingConfig(H=8, P=2, tau=2, alpha=0.5, codec="fp32", outer_lr=1.0, outer_momentum=0.0)
    _, fakes, _ = run(cfg, peers=1, steps=24)
    assert not close(fakes[0].x, local_only(1, 24)[0].x, 1e-3)


def test_cocodc_peers_choose_the_same_fragment() -> None:
    r, _, _ = run(CoCoDCConfig(H=8, P=4, tau=1, sends_per_window=8, codec="fp32"), peers=3, steps=40)
    sends = [(s, f) for s, kind, p, f in r.history if kind == "send" and p == 0]
    for peer in (1, 2):
        assert [(s, f) for s, kind, p, f in r.history if kind == "send" and p == peer] == sends
    assert {f for _, f in sends} == {0, 1, 2, 3}
    assert len(sends) == 40  # N = 8 sends per window of 8 steps: one every step (skipping busy fragments)


def test_an_agreed_change_of_n_applies_from_its_window_start_and_travels_with_the_state() -> None:
    frags = make_fragments(UNITS, 2)
    o = OuterLoop(CoCoDCConfig(H=8, P=2, tau=1, codec="fp32"), frags)
    o.init(FakePeer(0))
    assert [t for t in range(1, 17) if o.is_slot(t)] == [4, 8, 12, 16]  # N = P until agreed otherwise
    with pytest.raises(ValueError, match="must start a window"):
        o.schedule_sends(4, 20)
    o.schedule_sends(4, 24)
    o.schedule_sends(99, 40)  # clamped to H
    assert [t for t in range(17, 33) if o.is_slot(t)] == [20, 24, 26, 28, 30, 32]
    state = o.state_dict()
    assert state["sends_per_window"] == 4 and state["sends_changes"] == [[40, 8]]
    joiner = OuterLoop(CoCoDCConfig(H=8, P=2, tau=1, codec="fp32"), frags)
    joiner.load_state_dict(state)
    assert [t for t in range(33, 49) if joiner.is_slot(t)] == [34, 36, 38, 40, 41, 42, 43, 44, 45, 46, 47, 48]
    for w in range(100):  # a leader that schedules far ahead, window after window: the earliest few are kept
        joiner.schedule_sends(3, 8 * (1000 + w))
    assert len(joiner.sends_changes) == 8 and joiner.sends_changes[0] == (8000, 3)
    # the N each step was on, as it took effect: the joiner's history starts where it joined
    assert o.grid is not None and joiner.grid is not None
    assert o.grid.history == [(24, 4)] and joiner.grid.history == [(40, 8)]
    assert [o.grid.took_effect(t) for t in (23, 24, 39)] == [None, 4, 4] and joiner.grid.took_effect(48) == 8


def test_streaming_schedule_in_a_run() -> None:
    r, _, _ = run(StreamingConfig(H=8, P=4, tau=1, codec="fp32"), peers=2, steps=16)
    sends = [(s, f) for s, kind, p, f in r.history if kind == "send" and p == 0]
    applies = [(s, f) for s, kind, p, f in r.history if kind == "apply" and p == 0]
    assert sends == [(2, 1), (4, 2), (6, 3), (8, 0), (10, 1), (12, 2), (14, 3), (16, 0)]
    assert applies == [(s + 1, f) for s, f in sends[:-1]] + [(16, 0)]  # the last is drained at the end


def test_late_results() -> None:
    # A transfer takes ~4 steps (1 MB/s link, step 0.01 s): τ = 1 is far too short.
    slow = {"bandwidth": 8e3 * 2, "step_time": 0.01}
    cfg = CoCoDCConfig(H=16, P=2, tau=1, sends_per_window=2, codec="fp32")
    _, _, res = run(cfg, peers=2, steps=48, **slow)
    assert res.stall_seconds <= 0.1  # only the final drain waits (one transfer: ~0.1 s)
    assert res.max_delay > 1  # applied on arrival, for the actual delay
    _, _, stalled = run(StreamingConfig(H=16, P=2, tau=1, codec="fp32"), peers=2, steps=48, **slow)
    assert stalled.stall_seconds > 0.3 and stalled.max_delay == 1
    assert stalled.utilization < res.utilization


@pytest.mark.parametrize("bandwidth", [8e3 * 2, 8e3 * 2 / 6])
def test_streaming_late_apply_trains_on_and_applies_each_round_when_it_arrives(bandwidth: float) -> None:
    """``late="apply"``: the transfer (~4 steps; ~24 on the slower link, longer than H) outlasts τ = 1; the peers
    train on instead of stalling, apply each round when it is in, agree on θ, and a fragment's next send waits for
    its round (one round a fragment: every fragment's sends and applies alternate)."""
    slow = {"bandwidth": bandwidth, "step_time": 0.01}
    r, _, res = run(StreamingConfig(H=16, P=2, tau=1, codec="fp32", late="apply"), peers=2, steps=48, **slow)
    _, _, stalled = run(StreamingConfig(H=16, P=2, tau=1, codec="fp32"), peers=2, steps=48, **slow)
    assert res.max_delay > 1 and stalled.max_delay == 1 and res.utilization > stalled.utilization
    if bandwidth == 8e3 * 2:
        assert res.stall_seconds <= 0.1 < stalled.stall_seconds  # only the final drain waits
    ref = r.outers[0].outer_params()
    assert all(torch.equal(ref[n], t) for n, t in r.outers[1].outer_params().items())
    for f in (0, 1):
        kinds = [kind for s, kind, p, g in r.history if p == 0 and g == f]
        assert kinds == ["send", "apply"] * (len(kinds) // 2) and len(kinds) >= 4, kinds


def test_streaming_late_apply_changes_nothing_when_every_round_is_on_time() -> None:
    a, fa, _ = run(StreamingConfig(H=8, P=4, tau=2, codec="fp32"), peers=3, steps=32)
    b, fb, _ = run(StreamingConfig(H=8, P=4, tau=2, codec="fp32", late="apply"), peers=3, steps=32)
    assert a.history == b.history
    assert all(torch.equal(t, b.outers[0].outer_params()[n]) for n, t in a.outers[0].outer_params().items())
    assert all(torch.equal(t, fb[1].x[n]) for n, t in fa[1].x.items())


def test_late_takes_only_its_methods_values() -> None:
    with pytest.raises(ValueError, match="late must be 'stall' or 'apply'"):
        StreamingConfig(H=8, P=2, late="compensate")
    with pytest.raises(ValueError, match="late must be 'compensate' or 'stall'"):
        CoCoDCConfig(H=8, P=2, late="apply")


def test_a_catching_up_peer_takes_a_rounds_adapted_ranks() -> None:
    """A peer that synced from a state one round behind takes θ and the round state after that round:
    the low-rank ranks and bases it adapted, or its next round would not match the swarm's."""
    cfg = DiLoCoXConfig(H=4, rank=1, rank_min=1, rank_max=3, energy=0.5)
    r, _, _ = run(cfg, peers=2, steps=16)
    src = r.outers[0]
    behind = OuterLoop(cfg, make_fragments(UNITS, cfg.fragments, cfg.fragment_mode))
    behind.init(FakePeer(0))
    assert behind.signature(0) != src.signature(0)  # no round yet: no layout, no ranks
    behind.take_round_state(0, src.round_state(0))
    assert behind.signature(0) == src.signature(0)
    theirs, mine = src.round_state(0), behind.round_state(0)
    assert mine["seq"] == theirs["seq"] and mine["compressor"]["rank"] == theirs["compressor"]["rank"]
    assert all(torch.equal(a, b) for a, b in zip(mine["compressor"]["q"], theirs["compressor"]["q"], strict=True))
    with pytest.raises(ValueError):
        behind.take_round_state(0, {"seq": 1, "compressor": {"shapes": [[9, 9]], "rounds": 1, "index": [0],
                                                             "rank": [1, 2], "q": [torch.zeros(9, 1)], "error": []}})


def test_dilocox_sends_far_fewer_bytes() -> None:
    _, _, full = run(DiLoCoConfig(H=6), peers=2, steps=24)
    _, _, lowrank = run(DiLoCoXConfig(H=6, rank=1, rank_max=1), peers=2, steps=24)
    assert lowrank.bytes_sent_per_peer < full.bytes_sent_per_peer / 3


@pytest.mark.parametrize(("name", "knobs", "message"), [
    ("streaming", {"H": 50, "P": 4}, "multiple of the number of fragments P"),
    ("streaming", {"H": 48, "P": 4, "tau": 48}, "τ < H"),
    ("cocodc", {"H": 48, "P": 4, "tau": 48}, "τ < H"),
    ("cocodc", {"H": 48, "P": 4, "sends_per_window": 2}, "P ≤ N ≤ H"),
    ("diloco", {"outer_lr": 0}, "outer learning rate η"),
    ("diloco", {"codec": "fp4"}, "unknown codec"),
    ("eager", {"overlap_rounds": 3}, "overlap_rounds"),
    ("dilocox", {"rank": 0}, "rank"),
    ("diloco", {"tau": 1}, "unknown setting"),
    ("sgd", {}, "unknown method"),
])
def test_config_errors(name: str, knobs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        method_config(name, **knobs)


@pytest.mark.parametrize("members", [1, 4])
def test_eager_warm_up_moves_theta_by_the_peers_share(members: int) -> None:
    """Eager's first round has no stale average to apply: θ moves by this peer's share Δ_i/M of it, with M the
    peers the round is expected to have (a swarm passes its live count; once it was always 1)."""
    cfg = EagerConfig(H=5, variant="eager", outer_lr=0.7, outer_momentum=0.9)
    o = OuterLoop(cfg, make_fragments(UNITS, 1))
    peer = FakePeer(0)
    o.init(peer)
    theta0 = {n: t.clone() for n, t in o.outer_params().items()}
    for _ in range(5):
        peer.step()
    local = {n: t.clone() for n, t in peer.x.items()}
    o.start(0, 5, peer, members=members)
    for n, t in o.outer_params().items():
        delta = (theta0[n] - local[n]) / members  # Δ_i/M; b = Δ_i/M; θ1 = θ0 − η·(Δ_i/M + μ·b)
        assert torch.allclose(t, theta0[n] - 0.7 * (delta + 0.9 * delta), atol=1e-6)
    assert close(peer.x, o.outer_params())  # eager restarts from θ^(i)


def test_with_more_sends_than_fragments_the_drift_ranking_chooses() -> None:
    """P < N < H: a fragment is due by staleness only after H steps, so most slots are the ranking's to decide.
    Round-robin (the control) sends the one sent longest ago; drift picks by drift per parameter per step, and
    on peers whose fragments drift at different rates it departs from the cycle."""
    def sends(choice: str) -> list[int]:
        cfg = CoCoDCConfig(H=16, P=4, tau=1, sends_per_window=8, codec="fp32", choice=choice)
        r, _, _ = run(cfg, peers=2, steps=64)
        return [f for s, kind, p, f in r.history if kind == "send" and p == 0]

    rr, drift = sends("round-robin"), sends("drift")
    assert len(rr) == len(drift) == 32  # N = 8 per 16 steps, same syncs and bytes either way
    assert rr[4:] == [rr[4 + (i % 4)] for i in range(len(rr) - 4)]  # a cycle through the four fragments
    assert drift != rr  # the ranking chose something else at least once
    assert sorted(set(drift)) == [0, 1, 2, 3]  # and still sent every fragment (the staleness guard)


def test_an_outer_state_that_does_not_fit_leaves_the_old_one() -> None:
    """It used to clear the state first, so a second source after a refused one failed with IndexError."""
    frags = make_fragments(UNITS, 2)
    cfg = CoCoDCConfig(H=8, P=2, tau=1, codec="fp32")
    mine, theirs = OuterLoop(cfg, frags), OuterLoop(cfg, frags)
    mine.init(FakePeer(0))
    theirs.init(FakePeer(1))
    state = theirs.state_dict()
    last = state["fragments"][1]  # another model's shape, in the last fragment (copies: the state shares θ)
    state["fragments"] = [state["fragments"][0], {**last, "theta": [torch.zeros(3, 3), *last["theta"][1:]]}]
    before = [[t.clone() for t in mine.theta(f)] for f in range(2)]
    with pytest.raises(ValueError, match="fragment 1 does not match the model's shapes"):
        mine.load_state_dict(state)
    assert all(torch.equal(a, b) for f in range(2) for a, b in zip(mine.theta(f), before[f], strict=True))
    mine.load_state_dict(theirs.state_dict())  # the next source's state, which fits, is taken whole
    assert all(torch.equal(a, b) for f in range(2) for a, b in zip(mine.theta(f), theirs.theta(f), strict=True))


def test_thetas_version_is_the_send_step_of_the_last_round_applied_into_it() -> None:
    """A fragment's θ^(p) carries the send step of the last round applied into it; a round sent on it carries that
    version (its fingerprint leads with it: a tie between two versions of θ goes to the newer one); the version
    travels with the state, a catch-up's round state and a repair's θ."""
    cfg = StreamingConfig(H=4, P=2, tau=1, codec="fp32")
    r, _, _ = run(cfg, peers=2, steps=16)
    src = r.outers[0]
    versions = [src.version(f) for f in range(2)]
    assert all(v > 0 for v in versions) and versions == [r.outers[1].version(f) for f in range(2)]
    assert all(v <= src.last_send(f) for f, v in enumerate(versions))  # a round sent, then applied
    peer = FakePeer(0)
    fresh = OuterLoop(cfg, make_fragments(UNITS, cfg.fragments, cfg.fragment_mode))
    fresh.init(peer)
    assert [fresh.version(f) for f in range(2)] == [0, 0]
    rnd = fresh.start(0, 40, peer)
    assert rnd.based_on == 0
    fresh.load_state_dict(src.state_dict())
    assert [fresh.version(f) for f in range(2)] == versions
    assert fresh.start(1, 44, peer).based_on == versions[1]
    old = src.state_dict()
    for frag in old["fragments"]:
        del frag["version"]  # a state from before versions: none
    fresh.load_state_dict(old)
    assert [fresh.version(f) for f in range(2)] == [0, 0]
    fresh.take_round_state(0, src.round_state(0))
    assert fresh.version(0) == versions[0]
    fresh.overwrite(1, src.theta(1), src.momentum(1), version=7)
    assert fresh.version(1) == 7
    fresh.overwrite(1, src.theta(1), src.momentum(1))  # no version given: kept
    assert fresh.version(1) == 7
