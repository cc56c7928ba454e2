"""Fragments, fixed schedules and CoCoDC's choice of fragment."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.algo.fragments import make_fragments, model_units
from p2ptrain.algo.priority import (
    choose_fragment,
    choose_merged,
    drift_score,
    is_send_slot,
    send_interval,
    sends_per_window,
)
from p2ptrain.algo.schedule import streaming_offsets, streaming_sends
from p2ptrain.model import GPT, ModelConfig

UNITS = [("embed", [("embed.weight", (8, 4))])] + [
    (f"blocks.{i}", [(f"blocks.{i}.w", (4, 4)), (f"blocks.{i}.g", (4,))]) for i in range(6)
] + [("norm", [("norm.weight", (4,))]), ("head", [])]


def test_fragments_cover_all_parameters_once() -> None:
    for mode in ("strided", "sequential"):
        for p in (1, 2, 4, 7):
            frags = make_fragments(UNITS, p, mode)  # type: ignore[arg-type]
            names = [n for f in frags for n in f.names]
            assert sorted(names) == sorted(n for _, ps in UNITS for n, _ in ps)
            assert len(names) == len(set(names)) and len(frags) == p


def test_strided_and_sequential_assignment() -> None:
    strided = make_fragments(UNITS, 2, "strided")
    assert strided[0].units == ("embed", "blocks.1", "blocks.3", "blocks.5")
    assert strided[1].units == ("blocks.0", "blocks.2", "blocks.4", "norm")
    seq = make_fragments(UNITS, 2, "sequential")
    assert seq[0].units == ("embed", "blocks.0", "blocks.1", "blocks.2")


def test_fragment_flatten_split_round_trip() -> None:
    m = GPT(ModelConfig(d_model=16, n_layers=3, n_heads=2, seq_len=8))
    frag = make_fragments(model_units(m), 2)[1]
    params = dict(m.named_parameters())
    flat = frag.flatten([params[n] for n in frag.names])
    assert flat.numel() == frag.numel
    for view, name in zip(frag.split(flat), frag.names, strict=True):
        assert torch.equal(view, params[name])


def test_bad_fragment_counts() -> None:
    with pytest.raises(ValueError, match="between 1 and"):
        make_fragments(UNITS, 9)
    with pytest.raises(ValueError, match="mode"):
        make_fragments(UNITS, 2, "random")  # type: ignore[arg-type]


def test_streaming_sends_each_fragment_once_per_window() -> None:
    H, P = 48, 4
    assert streaming_offsets(H, P) == [0, 12, 24, 36]
    for start in (1, 48, 100):
        sent = [p for t in range(start, start + H) for p in streaming_sends(t, H, P)]
        assert sorted(sent) == list(range(P))
    assert streaming_sends(0, H, P) == [] and streaming_sends(12, H, P) == [1] and streaming_sends(48, H, P) == [0]
    assert [t for t in range(1, 101) if streaming_sends(t, 50, 1)] == [50, 100]  # DiLoCo


def test_sends_per_window() -> None:
    # t_send = 1e6 B / 1e7 B/s + 0.01 s = 0.11 s; H·t_step = 100·0.1 = 10 s -> N = 90
    assert sends_per_window(H=100, P=4, step_time=0.1, fragment_bytes=1e6, bandwidth=1e7, latency=0.01) == 90
    assert sends_per_window(H=100, P=4, step_time=0.1, fragment_bytes=1e9, bandwidth=1e7) == 4  # slow link: N = P
    assert sends_per_window(H=100, P=4, step_time=0.1, fragment_bytes=1, bandwidth=1e12) == 100  # capped at H
    assert send_interval(100, 90) == 1 and send_interval(100, 4) == 25


def test_choose_fragment_rules() -> None:
    # never sent first (lowest index)
    assert choose_fragment(step=5, H=10, last_sent=[3, None, None], in_flight=set(), scores=None) == 1
    # staleness guard beats drift
    assert choose_fragment(step=20, H=10, last_sent=[9, 12, 15], in_flight=set(), scores=[0, 0, 9]) == 0
    # largest summed drift otherwise; in-flight fragments are never chosen
    assert choose_fragment(step=20, H=10, last_sent=[12, 14, 16], in_flight=set(), scores=[1, 3, 2]) == 1
    assert choose_fragment(step=20, H=10, last_sent=[12, 14, 16], in_flight={1}, scores=[1, 3, 2]) == 2
    assert choose_fragment(step=20, H=10, last_sent=[12, 14, 16], in_flight={0, 1, 2}, scores=[1, 3, 2]) is None


def test_a_leader_without_scores_chooses_although_a_never_sent_fragment_is_in_flight() -> None:
    # Fragment 2 was never sent and is in flight (assigned at an earlier slot); 0 and 1 are free and were sent
    # 14 and 12 steps ago (< H = 20, not stale). Nobody sent drift scores: the lowest free index, not an error
    # (an error here was raised on the leader's stream handler and struck the joiner as malformed).
    views = [[6, 8, -1], [5, 8, -1]]
    assert choose_merged(step=20, H=20, last_sent=views, busy=[[2], []], scores=[None, None]) == 0
    # with scores, the larger summed drift among the free ones
    assert choose_merged(step=20, H=20, last_sent=views, busy=[[2], []], scores=[[1.0, 2.0, 9.0], [0.5, 1.0, 9.0]]) == 1

def test_drift_score() -> None:
    theta = [torch.zeros(4), torch.zeros(2)]
    local = [torch.tensor([1.0, -1.0, 0.0, 0.0]), torch.tensor([2.0, 0.0])]
    # ‖·‖₁ = 4 over 6 parameters and 2 steps
    assert drift_score(theta, local, 2) == pytest.approx(4 / 12)


def test_send_slots_are_counted_from_each_window_start() -> None:
    # H = 12, N = 5: h = 2, slots at r = 0, 2, 4, 6, 8 of every window (five, not the six of a global grid)
    assert [t for t in range(1, 25) if is_send_slot(t, 12, 5)] == [2, 4, 6, 8, 12, 14, 16, 18, 20, 24]
    # H = 10, N = 3: h = 3, r = 0, 3, 6: the window start stays a slot although 3 does not divide 10
    assert [t for t in range(1, 21) if is_send_slot(t, 10, 3)] == [3, 6, 10, 13, 16, 20]
    assert not is_send_slot(0, 12, 5)  # nothing trained yet
    for H, N in ((12, 2), (12, 5), (10, 3), (48, 7), (8, 8)):
        for w in (0, H, 5 * H):  # exactly N slots per window, the first at its start (for any N)
            slots = [t for t in range(w + 1, w + H + 1) if is_send_slot(t, H, N)]
            assert len(slots) == N and w + H in slots
