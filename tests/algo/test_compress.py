"""Multi-phase compressors of ``p2ptrain.algo.compress``, driven by a small simulated all-reduce (``_run_round``)
that averages every phase's payload across peers in float32, as the network layer does."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from p2ptrain.algo.compress import Compressor, Identity, LowRank


def _average(payloads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """What the all-reduce hands back: the float32 mean of each payload tensor across peers."""
    return [torch.stack(ts).mean(dim=0) for ts in zip(*payloads, strict=True)]


def _run_round(
    peers: list[Compressor], inputs: list[list[torch.Tensor]], trace: list[list[torch.Tensor]] | None = None
) -> list[list[torch.Tensor]]:
    """One round across simulated peers; ``trace`` collects each phase's averaged payload."""
    payloads = [c.begin(ts) for c, ts in zip(peers, inputs, strict=True)]
    while True:
        averaged = _average(payloads)
        if trace is not None:
            trace.append(averaged)
        nxt = [c.receive(averaged) for c in peers]
        if nxt[0] is None:
            assert all(p is None for p in nxt)
            break
        payloads = nxt  # type: ignore[assignment]
    return [c.result() for c in peers]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _low_rank_matrix(m: int, n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen) @ torch.randn(k, n, generator=gen)


def test_identity_is_one_phase_of_the_tensors() -> None:
    peers = [Identity(), Identity()]
    inputs = [[torch.randn(3, 4), torch.randn(5, dtype=torch.float64)] for _ in peers]
    payload = peers[0].begin(inputs[0])
    assert all(p.dtype == torch.float32 for p in payload)
    payload[0].zero_()  # payloads are copies: an in-place all-reduce cannot touch the inputs
    assert bool((inputs[0][0] != 0).any())
    trace: list[list[torch.Tensor]] = []
    results = _run_round(peers, inputs, trace)
    assert len(trace) == 1
    for result in results:
        for got, avg, x in zip(result, trace[0], inputs[0], strict=True):
            assert got.shape == x.shape and torch.equal(got, avg)
    assert Identity().state_dict() == {}


def test_identity_misuse() -> None:
    c = Identity()
    with pytest.raises(RuntimeError):
        c.receive([torch.zeros(1)])
    c.begin([torch.zeros(2, 2)])
    with pytest.raises(RuntimeError):
        c.result()
    with pytest.raises(ValueError):
        c.receive([torch.zeros(2, 2), torch.zeros(1)])
    with pytest.raises(ValueError):
        c.receive([torch.zeros(5)])
    assert c.receive([torch.ones(4)]) is None  # flattened by the network layer: reshaped back
    assert torch.equal(c.result()[0], torch.ones(2, 2))


def test_lowrank_settings_are_validated() -> None:
    for kwargs in (
        {"rank": 0, "rank_min": 0},
        {"rank": 4, "rank_min": 5},
        {"rank": 40},
        {"energy": 0.0},
        {"energy": 1.5},
    ):
        with pytest.raises(ValueError):
            LowRank(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_lowrank_recovers_a_matrix_of_rank_at_most_r_in_one_round(k: int) -> None:
    """span(P_hat) contains range(M Q) = range(M) for a generic Q when rank(M) <= r, so P_hat P_hat^T M = M
    already in the first round (no warm start needed), up to float32 round-off amplified by the conditioning of
    M Q (largest for k == r)."""
    mat = _low_rank_matrix(96, 80, k, seed=k)
    (result,) = _run_round([LowRank(rank=4, seed=1)], [[mat]])
    assert _rel(result[0], mat) <= 1e-5


@pytest.mark.parametrize("k", [1, 2])
def test_lowrank_stays_exact_with_warm_start(k: int) -> None:
    """Later rounds start from the previous round's Q (plus redrawn columns) and stay exact for rank(M) < r.

    Pinned with a fixed rank and no error feedback on purpose: with r == rank(M) a single power-iteration step
    only finds range(M) to within (perturbation / sigma_min(M Q)), so the float32 residue that error feedback
    carries into the next round can cost 1e-3 relative and more; oversampling (r > rank(M)) removes that.
    """
    c = LowRank(rank=4, rank_min=4, rank_max=4, error_feedback=False, seed=2)
    for seed in range(4):
        mat = _low_rank_matrix(96, 80, k, seed=10 + seed)
        (result,) = _run_round([c], [[mat]])
        assert _rel(result[0], mat) <= 1e-5


def test_lowrank_three_peers_project_the_true_average() -> None:
    gen = torch.Generator().manual_seed(3)
    shapes = [(64, 48), (40,), (8, 4, 6), (4, 4)]  # matrix, vector, 3-D (viewed as 8 x 24), too small to save
    peers = [LowRank(rank=4, seed=11) for _ in range(3)]
    for _round in range(3):
        inputs = [[torch.randn(*s, generator=gen) for s in shapes] for _ in peers]
        trace: list[list[torch.Tensor]] = []
        results = _run_round(peers, inputs, trace)
        assert len(trace) == 2
        for other in results[1:]:  # every peer ends with bit-identical results
            assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))
        if _round == 0:  # error buffers are still zero, so M_i is exactly the input
            for i in (0, 2):
                mean = torch.stack([ts[i].double() for ts in inputs]).mean(0)
                mean = mean.reshape(shapes[i][0], -1)
                p_hat = torch.linalg.qr(trace[0][i].double()).Q  # from the same averaged P, in float64
                expected = (p_hat @ p_hat.T @ mean).reshape(shapes[i])
                assert _rel(results[0][i], expected) <= 1e-5
            for i in (1, 3):  # sent in full
                mean = torch.stack([ts[i] for ts in inputs]).mean(0)
                assert torch.equal(results[0][i], mean)
        for i, shape in enumerate(shapes):
            assert results[0][i].shape == shape


def test_lowrank_phase_sizes_and_full_tensors() -> None:
    m, n, r = 64, 48, 3
    vec, mat = torch.randn(10), torch.randn(m, n)
    c = LowRank(rank=r, rank_min=r, rank_max=r)
    payload = c.begin([vec, mat])
    assert torch.equal(payload[0], vec) and payload[1].shape == (m, r)
    assert c.ranks() == [0, r]
    phase1 = c.receive(payload)
    assert phase1 is not None and len(phase1) == 1 and phase1[0].shape == (n, r)
    assert c.receive(phase1) is None
    assert torch.equal(c.result()[0], vec)
    # r*(m+n) values per round instead of m*n.
    assert payload[1].numel() + phase1[0].numel() == r * (m + n) < m * n
    # Only vectors (or matrices too small to save anything): a single phase.
    c = LowRank(rank=4)
    payload = c.begin([torch.randn(5), torch.randn(6, 6)])  # 4 * 12 >= 36
    assert c.receive(payload) is None and c.ranks() == [0, 0]
    assert [t.shape for t in c.result()] == [(5,), (6, 6)]


def test_error_feedback_running_mean_converges() -> None:
    """Feeding the same G every round, the results sum to t*G - e_t exactly (one peer), and e_t stays bounded,
    so the running mean approaches G like 1/t.

    With rank 2 and a full-rank Gaussian 64x48 G, the buffer settles around 14 ||G||: it must grow until the
    directions of G not yet sent dominate M_t and get picked by the power iteration. The mean is therefore
    about 0.28 away from G at t = 50 and below 0.1 only from t of about 140 on.
    """
    G = torch.randn(64, 48, generator=torch.Generator().manual_seed(0))
    c = LowRank(rank=2, rank_min=2, rank_max=2, seed=0)
    total = torch.zeros(64, 48, dtype=torch.float64)
    errs, buffers = {}, []
    for t in range(1, 201):
        (result,) = _run_round([c], [[G]])
        total += result[0].double()
        (e_t,) = c.state_dict()["error"]
        assert _rel(total, t * G.double() - e_t.double()) <= 1e-5
        buffers.append(float(e_t.norm() / G.norm()))
        errs[t] = _rel(total / t, G)
    assert max(buffers) <= 20.0 and max(buffers[100:]) <= 1.2 * max(buffers[50:100])  # bounded, not growing
    assert errs[10] > errs[50] > errs[100] > errs[200]
    assert errs[50] < 0.4 and errs[200] < 0.1
    # Without error feedback the mean stays at a rank-2 approximation of G, far from G.
    c = LowRank(rank=2, rank_min=2, rank_max=2, seed=0, error_feedback=False)
    total.zero_()
    for _ in range(50):
        total += _run_round([c], [[G]])[0][0].double()
    assert _rel(total / 50, G) > 0.5


def test_adaptive_rank_grows_and_shrinks_with_the_full_spectrum() -> None:
    """The rank follows each peer's full update (not its projection on the current directions): one round of a
    matrix that needs many directions grows it from 2 at once, a rank-1 update shrinks it to one spare above 1,
    a full-rank one takes it to the cap, and rank_min holds."""
    c = LowRank(rank=2, error_feedback=False)
    _run_round([c], [[_low_rank_matrix(64, 48, 20, seed=1)]])
    M = _low_rank_matrix(64, 48, 20, seed=1).double()
    power = torch.linalg.svdvals(M).square()
    k90 = int((power.cumsum(0) < 0.9 * power.sum()).sum()) + 1  # what 90% of the energy needs
    assert k90 >= 8 and k90 + 1 <= c.ranks()[0] <= k90 + 3  # grew from 2 in one round (a spare, estimation slack)
    for seed in (2, 3, 4):
        _run_round([c], [[_low_rank_matrix(64, 48, 1, seed=seed)]])
        assert c.ranks() == [2]  # shrank: k = 1 plus one spare direction, and stays there
    cap = (64 * 48 - 1) // (64 + 48)  # 27: the largest rank that still saves bytes (below rank_max = 32)
    _run_round([c], [[torch.randn(64, 48, generator=torch.Generator().manual_seed(1))]])
    assert c.ranks() == [cap]  # a Gaussian matrix needs more than the cap for 90%
    c = LowRank(rank=8, rank_min=3)
    _run_round([c], [[_low_rank_matrix(64, 48, 1, seed=2)]])
    assert c.ranks() == [3]


def test_peers_agree_on_the_mean_of_their_proposals() -> None:
    peers = [LowRank(rank=2, seed=5, error_feedback=False), LowRank(rank=2, seed=5, error_feedback=False)]
    wide, narrow = _low_rank_matrix(64, 48, 20, seed=1), _low_rank_matrix(64, 48, 1, seed=2)
    _run_round(peers, [[wide], [narrow]])
    alone = LowRank(rank=2, seed=5, error_feedback=False)
    _run_round([alone], [[wide]])
    assert peers[0].ranks() == peers[1].ranks() == [math.floor((alone.ranks()[0] + 2) / 2 + 0.5)]


def test_error_feedback_counts_what_the_wire_loses() -> None:
    """With a lossy wire, the error buffer is M − P̂·Q~ᵀ with Q~ what the wire delivers of Q: after a round the
    buffer plus what was transmitted is exactly this peer's update."""
    def wire(t: torch.Tensor) -> torch.Tensor:
        return (t * 256).round() / 256  # a coarse quantiser

    c = LowRank(rank=3, rank_max=3, wire=wire)
    M = _low_rank_matrix(64, 48, 6, seed=3)
    trace: list[list[torch.Tensor]] = []
    _run_round([c], [[M]], trace)
    p_hat = torch.linalg.qr(trace[0][0].double(), mode="reduced").Q.float()
    sent = wire(M.T @ p_hat)
    error = c.state_dict()["error"][0]
    assert torch.allclose(error + p_hat @ sent.T, M, atol=1e-5)
    assert not torch.allclose(error + p_hat @ (M.T @ p_hat).T, M, atol=1e-6)  # the quantisation error is in it


def test_adaptive_rank_is_identical_across_peers() -> None:
    gen = torch.Generator().manual_seed(4)
    decay = torch.linspace(1.0, 0.01, 48)
    peers = [LowRank(rank=2, seed=5), LowRank(rank=2, seed=5)]
    seen = set()
    for _ in range(12):
        inputs = [[torch.randn(64, 48, generator=gen) * decay * (1 + i)] for i in range(2)]
        results = _run_round(peers, inputs)
        assert peers[0].ranks() == peers[1].ranks()
        assert torch.equal(results[0][0], results[1][0])
        seen.add(peers[0].ranks()[0])
    assert len(seen) > 1  # the rank did adapt


def test_collapsed_directions_are_redrawn() -> None:
    """A zero round or a rank-1 round leaves Q_bar with zero columns; they are redrawn, so a later matrix of
    full rank r is still recovered exactly."""
    c = LowRank(rank=4, rank_min=4, rank_max=4, error_feedback=False)
    (result,) = _run_round([c], [[torch.zeros(64, 48)]])
    assert torch.equal(result[0], torch.zeros(64, 48))
    _run_round([c], [[_low_rank_matrix(64, 48, 1, seed=5)]])
    q = c.state_dict()["q"][0]
    assert bool(torch.isfinite(q).all()) and torch.linalg.matrix_rank(q).item() == 4
    mat = _low_rank_matrix(64, 48, 4, seed=6)
    (result,) = _run_round([c], [[mat]])
    assert _rel(result[0], mat) <= 1e-5


def test_initial_q_depends_on_seed_only() -> None:
    mat = torch.randn(32, 24)
    a, b, other = LowRank(seed=7), LowRank(seed=7), LowRank(seed=8)
    assert torch.equal(a.begin([mat])[0], b.begin([mat])[0])
    assert not torch.equal(a.begin([mat])[0], other.begin([mat])[0])


def _check_plain(value: Any) -> None:
    """Only tensors, ints, floats and lists (and the top-level dict's str keys)."""
    if isinstance(value, list):
        for v in value:
            _check_plain(v)
    else:
        assert isinstance(value, (torch.Tensor, int, float)), type(value)


def test_state_dict_round_trip_gives_identical_next_results() -> None:
    gen = torch.Generator().manual_seed(9)
    shapes = [(64, 48), (30,), (32, 40)]

    def make() -> list[torch.Tensor]:
        return [torch.randn(*s, generator=gen) * torch.linspace(1, 0.05, s[-1]) for s in shapes]

    a = LowRank(rank=2, seed=3)
    for _ in range(3):
        _run_round([a], [make()])
    state = a.state_dict()
    snapshot = [q.clone() for q in state["q"]] + [e.clone() for e in state["error"]]
    assert isinstance(state, dict) and all(isinstance(k, str) for k in state)
    for v in state.values():
        _check_plain(v)
    b = LowRank(rank=2, seed=3)
    b.load_state_dict(state)
    assert b.ranks() == a.ranks()
    for _ in range(2):
        batch = make()
        (ra,) = _run_round([a], [batch])
        (rb,) = _run_round([b], [batch])
        assert a.ranks() == b.ranks()
        assert all(torch.equal(x, y) for x, y in zip(ra, rb, strict=True))
    # The saved state is a copy: later rounds of either compressor did not change it.
    assert all(torch.equal(x, y) for x, y in zip(state["q"] + state["error"], snapshot, strict=True))
    # A state from a different layout is refused (rank 18 no longer saves bytes on 32x40); an empty state resets.
    with pytest.raises(ValueError, match="layout"):
        LowRank(rank=18).load_state_dict(state)
    fresh = LowRank(rank=2, seed=3)
    fresh.load_state_dict(LowRank(rank=2, seed=3).state_dict())
    assert fresh.ranks() == []


def test_abandoned_round_keeps_nothing() -> None:
    mats = [torch.randn(64, 48), torch.randn(64, 48)]
    a, b = LowRank(rank=2, seed=1), LowRank(rank=2, seed=1)
    _run_round([a], [[mats[0]]])
    _run_round([b], [[mats[0]]])
    payload = a.begin([torch.randn(64, 48)])  # a round that fails after phase 0
    a.receive(payload)
    with pytest.raises(RuntimeError):
        a.result()
    (ra,) = _run_round([a], [[mats[1]]])
    (rb,) = _run_round([b], [[mats[1]]])
    assert torch.equal(ra[0], rb[0]) and a.ranks() == b.ranks()


def test_lowrank_misuse() -> None:
    c = LowRank(rank=2)
    with pytest.raises(RuntimeError):
        c.receive([torch.zeros(1)])
    payload = c.begin([torch.randn(64, 48)])
    with pytest.raises(ValueError):
        c.receive([torch.zeros(3)])
    c.receive(payload)
    with pytest.raises(ValueError):
        c.begin([torch.randn(48, 64)])
    with pytest.raises(RuntimeError):
        c.result()
