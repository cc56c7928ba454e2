"""Error feedback in front of the 1- and 2-bit codecs: nothing is lost over rounds, the buffer stays bounded, every
coordinate is sent eventually, and the buffer is per-peer state (checkpointed, not handed to a joiner)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2ptrain.algo.compress import Identity
from p2ptrain.algo.feedback import ErrorFeedback
from p2ptrain.algo.fragments import make_fragments
from p2ptrain.algo.methods import CoCoDCConfig, DiLoCoConfig, OuterLoop, StreamingConfig
from p2ptrain.checkpoint import state_from_bytes, state_to_bytes
from p2ptrain.collective.butterfly import butterfly_mean, parts_roundtrip
from p2ptrain.collective.codecs import get_codec
from tests.algo.test_methods import SHAPES, UNITS, FakePeer, run

HYP = settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _ef(name: str, members: int = 1, decay: float = 1.0) -> ErrorFeedback:
    codec = get_codec(name)
    ef = ErrorFeedback(lambda flat, m: parts_roundtrip(codec, flat, m), decay)
    ef.expect_members(members)
    return ef


def _send(ef: ErrorFeedback, delta: torch.Tensor) -> torch.Tensor:
    out = ef.begin([delta])
    assert ef.receive(out) is None
    return out[0]


@pytest.mark.parametrize("name", ["topk2", "topk2:0.03", "2bit", "1bit"])
@HYP
@given(seed=st.integers(0, 2**31 - 1), members=st.integers(1, 4), heavy=st.booleans())
def test_every_coordinates_mass_is_sent_and_the_residual_stays_bounded(name: str, seed: int, members: int,
                                                                        heavy: bool) -> None:
    """A stream of random updates: what was sent plus the buffer is the sum of the updates (nothing lost),
    the buffer's largest entry stays within a few times the largest update so far (no growth over 200 rounds), and
    a coordinate whose update never stands out (all equal) is still sent within a bounded number of rounds."""
    gen = torch.Generator().manual_seed(seed)
    n = 2100
    ef = _ef(name, members)
    total = torch.zeros(n, dtype=torch.float64)
    sent = torch.zeros(n, dtype=torch.float64)
    worst: list[float] = []
    largest = 0.0  # the largest update entry so far: the scale the buffer is measured against
    for _ in range(200):
        d = torch.randn(n, generator=gen)
        if heavy:
            d = d * torch.exp(2.0 * torch.randn(n, generator=gen))
        total += d.double()
        sent += _send(ef, d).double()
        assert ef.error is not None
        # (against this round's update alone, one heavy-tailed round with a small maximum inflates the ratio)
        largest = max(largest, float(d.abs().max()))
        worst.append(float(ef.error.abs().max()) / largest)
    assert torch.allclose(sent + ef.error.double(), total, atol=1e-3 * float(total.abs().max()), rtol=0)
    assert max(worst[100:]) <= 1.5 * max(worst[:100]) + 1.0  # bounded: the second half is no worse
    assert max(worst) < 200.0
    # A constant update on every coordinate: every one of them is sent within ~1/fraction rounds.
    ef = _ef(name, members)
    first = torch.full((n,), -1)
    for t in range(150):
        out = _send(ef, torch.full((n,), 1e-3))
        first = torch.where((first < 0) & (out != 0), t, first)
    assert bool((first >= 0).all())


def test_the_owner_decodes_exactly_what_error_feedback_assumed() -> None:
    """With the group the round expected, a butterfly's result is the mean of the peers' payloads exactly as
    each computed them (the codecs are idempotent), so no mass is lost between a peer and the owners."""
    codec = get_codec("topk2")
    gen = torch.Generator().manual_seed(0)
    efs = [_ef("topk2", 3) for _ in range(3)]
    payloads = [_send(ef, torch.randn(9000, generator=gen)) for ef in efs]
    for j, p in enumerate(payloads):  # each owner's view of every contribution is the payload itself
        assert torch.equal(parts_roundtrip(codec, p, 3), p), j
    exact = sum(p.double() for p in payloads) / 3
    got = butterfly_mean(payloads, [1.0, 1.0, 1.0], codec)
    # The owners' results are re-encoded (densify at the owner, sparse again on the way back): top-k of the
    # union keeps the strongest coordinates; this is the all-gather's loss, which no buffer holds.
    assert int((got != 0).sum()) <= int((exact != 0).sum())


def test_decay_forgets_old_mass() -> None:
    ef = _ef("topk2", decay=0.5)
    _send(ef, torch.ones(2048))
    before = ef.error.clone()  # type: ignore[union-attr]
    _send(ef, torch.zeros(2048))
    # m = 0 + 0.5·e; the same top-k leaves 0.5·e outside the sent slots
    kept = ef.error  # type: ignore[union-attr]
    assert torch.allclose(kept[before != 0].sum(), 0.5 * before.sum() - 0.0, rtol=0.2)


def test_abort_puts_the_buffer_back_and_state_round_trips() -> None:
    ef = _ef("topk2")
    _send(ef, torch.randn(3000))
    saved = ef.state_dict()
    ef.begin([torch.randn(3000)])
    ef.abort()  # the round failed: its progress re-enters the next pseudo-gradient, the buffer is as before
    assert torch.equal(ef.error, saved["error"][0])  # type: ignore[arg-type]
    other = _ef("topk2")
    other.load_state_dict(saved)
    assert torch.equal(other.error, saved["error"][0])  # type: ignore[arg-type]
    for bad in ({"error": [torch.zeros(3, 3)]}, {"error": [torch.tensor([float("nan")])]}, {"nope": 1},
                {"error": [torch.zeros(2), torch.zeros(2)]}):
        with pytest.raises(ValueError):
            other.load_state_dict(bad)
    with pytest.raises(ValueError, match="error buffer holds"):
        other.begin([torch.randn(10)])
    with pytest.raises(RuntimeError):
        _ef("topk2").receive([torch.zeros(3)])


def test_an_outvoted_round_is_withdrawn_from_the_buffer() -> None:
    """A round that arrived without our input (outvoted) is withdrawn: the buffer is as before its send, since the
    local model keeps the whole progress it sent; not once another round began (its buffer builds on this one)."""
    ef = _ef("topk2")
    _send(ef, torch.randn(3000))
    saved = ef.error.clone()  # type: ignore[union-attr]
    _send(ef, torch.randn(3000))
    assert not torch.equal(ef.error, saved)  # type: ignore[arg-type]
    assert ef.withdraw() and torch.equal(ef.error, saved)  # type: ignore[arg-type]
    ef.begin([torch.randn(3000)])
    assert not ef.withdraw()  # a round is open: nothing is put back
    assert Identity().withdraw()  # nothing to put back


@pytest.mark.parametrize("cfg", [
    DiLoCoConfig(H=4, codec="topk2"),
    StreamingConfig(H=8, P=4, tau=1, codec="topk2:0.03"),
    CoCoDCConfig(H=8, P=4, tau=1, sends_per_window=4, codec="2bit"),
])
def test_methods_run_behind_error_feedback_and_peers_agree(cfg: DiLoCoConfig) -> None:
    r, _, res = run(cfg, peers=3, steps=32)
    assert res.syncs > 0
    ref = r.outers[0].outer_params()
    for o in r.outers[1:]:
        assert all(torch.equal(ref[n], t) for n, t in o.outer_params().items())
    assert any(st.get("compressor", {}).get("error") for st in r.outers[0].state_dict()["fragments"])


def test_the_buffer_is_checkpointed_kept_on_resync_and_not_given_to_a_joiner() -> None:
    # α 0.5: the buffer keeps half of what was not sent after each apply (at α 1, the default, the local model
    # takes all of it and the buffer is empty between rounds)
    cfg = StreamingConfig(H=8, P=4, tau=1, codec="topk2", alpha=0.5)
    r, _, _ = run(cfg, peers=2, steps=24)
    src = r.outers[0]
    state = src.state_dict()
    errors = [f["compressor"]["error"] for f in state["fragments"]]
    assert all(len(e) == 1 and e[0].abs().sum() > 0 for e in errors)
    # a checkpoint (its bytes, as a peer writes them) restores it
    again = OuterLoop(cfg, make_fragments(UNITS, cfg.fragments, cfg.fragment_mode))
    again.init(FakePeer(0))
    again.load_state_dict(state_from_bytes(state_to_bytes(state, finite=True)))
    assert all(torch.equal(a["compressor"]["error"][0], e[0])
               for a, e in zip(again.state_dict()["fragments"], errors, strict=True))
    # a joiner takes the shared state: no buffer of another peer (it sent nothing yet)
    joiner = OuterLoop(cfg, make_fragments(UNITS, cfg.fragments, cfg.fragment_mode))
    joiner.init(FakePeer(1))
    joiner.load_state_dict(src.shared_state())
    assert all(f["compressor"]["error"] == [] for f in joiner.state_dict()["fragments"])
    # a peer resyncing from another keeps its own buffer
    mine = r.outers[1].state_dict()
    r.outers[1].load_state_dict(src.shared_state())
    assert r.outers[1].keep_own(mine) == cfg.P
    assert all(torch.equal(a["compressor"]["error"][0], b["compressor"]["error"][0])
               for a, b in zip(r.outers[1].state_dict()["fragments"], mine["fragments"], strict=True))
    assert set(SHAPES) == set(src.outer_params())
