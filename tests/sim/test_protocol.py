"""The protocol model (sim/protocol.py): byte counts by hand and against the real butterfly, times in order."""

from __future__ import annotations

import asyncio
import random

import pytest

from p2ptrain.sim.loopback import loopback_round, memory_swarm_bytes
from p2ptrain.sim.protocol import (
    MIB,
    LinkModel,
    bounded,
    flat,
    hierarchical,
    mean_over_trials,
    ready_times,
    rounds_to_mix,
)

F = 64 * MIB


@pytest.mark.parametrize("k,per_phase", [(2, F / 2), (4, 3 * F / 4)])
def test_flat_butterfly_bytes_by_hand(k: int, per_phase: float) -> None:
    """Each peer sends (k−1)/k·F in the reduce-scatter and the same in the all-gather: k=2, F/2 each;
    k=4, 3F/4 each. One region, no jitter: each phase takes latency + (k−1)·stream_cost + (k−1)/k·F·8/bw."""
    link = LinkModel(fragment_bytes=F, regions=1, jitter_scale=0.0)
    r = flat(k, link, [0.0] * k)
    assert r.bytes_sent_per_peer == r.bytes_sent_max == 2 * per_phase
    assert r.inter_bytes_per_peer == 0 and r.streams_per_peer == 2 * (k - 1) and r.streams_total == 2 * k * (k - 1)
    phase = link.intra_latency + (k - 1) * link.stream_cost + per_phase * 8 / link.intra_bandwidth
    assert r.round_seconds == pytest.approx(2 * phase)
    assert r.buffer_bytes == pytest.approx(2 * F + per_phase)  # snapshot + result + contributions to own part


def test_flat_across_regions_crosses_once_per_member() -> None:
    """k=8 in 2 regions: a peer sends 4 of its 7 slices (each way) to the other region."""
    r = flat(8, LinkModel(fragment_bytes=F, regions=2, jitter_scale=0.0), [0.0] * 8)
    assert r.inter_bytes_per_peer == 2 * 4 * F / 8
    assert r.inter_bytes_per_region == 4 * r.inter_bytes_per_peer  # = 4F: the region's 4 members each cross


@pytest.mark.parametrize("k", [2, 6, 16, 64, 256])
def test_hierarchical_crosses_about_one_fragment_per_region(k: int) -> None:
    """2 regions: every shard's butterfly of 2 sends half of it each way, so a region sends F across in all,
    spread 1/n over its n members (flat: n·F)."""
    link = LinkModel(fragment_bytes=F, regions=2, jitter_scale=0.0)
    h, f = hierarchical(k, link, [0.0] * k), flat(k, link, [0.0] * k)
    n = k // 2
    assert h.inter_bytes_per_region == pytest.approx(F)
    assert h.inter_bytes_per_peer == pytest.approx(F / n)
    assert f.inter_bytes_per_region == pytest.approx(n * F)
    assert h.bytes_sent_per_peer == pytest.approx(2 * (n - 1) / n * F + F / n)


def test_hierarchical_of_one_peer_per_region_is_the_flat_butterfly() -> None:
    link = LinkModel(fragment_bytes=F, regions=4, jitter_scale=0.0)
    h, f = hierarchical(4, link, [0.0] * 4), flat(4, link, [0.0] * 4)
    assert h.bytes_sent_per_peer == f.bytes_sent_per_peer and h.inter_bytes_per_region == f.inter_bytes_per_region
    assert h.round_seconds == pytest.approx(f.round_seconds)


def test_bounded_groups_beat_the_flat_round_at_1024() -> None:
    """Defaults (4 regions, 1 Gbit/s / 100 Mbit/s, 1 ms a stream, lognormal stragglers), G = 8, 4 trials:
    the slowest group ends before the flat round, and bytes and streams per peer are bounded by G."""
    link, k = LinkModel(), 1024
    rows: dict[str, list] = {"flat": [], "bounded": []}
    for t in range(4):
        ready = ready_times(k, link, random.Random(t))
        rows["flat"].append(flat(k, link, ready))
        rows["bounded"].append(bounded(k, 8, link, ready, seed=f"round{t}"))
    f, b = mean_over_trials(rows["flat"]), mean_over_trials(rows["bounded"])
    assert b.round_seconds < f.round_seconds and b.group_seconds < f.round_seconds
    assert b.streams_per_peer == 14 and f.streams_per_peer == 2046
    assert b.bytes_sent_max <= 2 * 7 / 8 * F < f.bytes_sent_per_peer


def test_a_vanished_peer_holds_up_its_group_only() -> None:
    link = LinkModel(fragment_bytes=F, regions=1, jitter_scale=0.0, fail_wait=30.0)
    ready = [0.0] * 64
    ready[5] = float("inf")
    f, b = flat(64, link, ready), bounded(64, 8, link, ready, seed="x")
    assert f.round_seconds > 30 and b.round_seconds > 30  # the slowest group waits as long as the flat round
    assert b.group_seconds < f.round_seconds / 4  # but only 1 of 8 groups does


def test_rounds_to_mix() -> None:
    assert rounds_to_mix(8, 8) == 1
    assert 4 <= rounds_to_mix(64, 8) <= 8


@pytest.mark.parametrize("k", [2, 4, 8])
def test_model_bytes_match_the_real_butterfly(k: int) -> None:
    """The swarm's own ButterflyRun, messages handed over in memory: each member's payload bytes sent and
    its message count are the model's (F = 4 bytes × values, fp32), also when parts are streamed in chunks;
    the in-memory transport reports the same."""
    numel = 1 << 14  # parts of 2048 values or more: streamed in chunks of 1024 (the smallest chunk allowed)
    model = flat(k, LinkModel(fragment_bytes=4 * numel, regions=1, jitter_scale=0.0), [0.0] * k)
    for chunk in (1 << 18, 1024):
        real = asyncio.run(loopback_round(k, numel, chunk=chunk, timeout=10.0))
        assert all(r.bytes_sent == model.bytes_sent_per_peer for r in real.results)
        assert real.payload_sent == [model.bytes_sent_per_peer] * k
        assert real.messages_sent == [model.streams_per_peer] * k
    assert asyncio.run(memory_swarm_bytes(k, numel)) == [model.bytes_sent_per_peer] * k


def test_link_model_checks() -> None:
    with pytest.raises(ValueError, match="F must be positive"):
        LinkModel(fragment_bytes=0)
    with pytest.raises(ValueError, match="regions R"):
        LinkModel(regions=0)
    with pytest.raises(ValueError, match="fail_prob"):
        LinkModel(fail_prob=1.0)
