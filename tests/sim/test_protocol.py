"""The protocol model (sim/protocol.py): byte counts by hand and against the real butterfly, times in order."""

from __future__ import annotations

import asyncio
import math
import random
import zlib

import pytest

from p2ptrain.net.hierarchy import plan_for
from p2ptrain.sim.loopback import loopback_round, memory_swarm_bytes
from p2ptrain.sim.protocol import (
    MIB,
    LinkModel,
    bounded,
    cell_layout,
    cells,
    cells_group,
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


@pytest.mark.parametrize("R", [2, 3])
def test_cells_cross_one_fragment_share_per_region(R: int) -> None:
    """R regions of 3 peers (cells = regions, S = 3 shards, one carrier per shard and region): a region
    sends 2(R−1)/R·F across (F for R = 2), as the hierarchical scheme; by hand, a member sends its cell's
    butterfly (2·2/3·F), its shard's butterfly of R (2(R−1)/R·F/3) and its shard to its 2 cell mates."""
    k = 3 * R
    link = LinkModel(fragment_bytes=F, regions=R, jitter_scale=0.0)
    c, h = cells(k, 32, link, [0.0] * k, seed="r"), hierarchical(k, link, [0.0] * k)
    assert c.extra["plan"] == "cells" and c.extra["cells"] == R and c.extra["shards"] == 3
    assert c.inter_bytes_per_region == pytest.approx(F * 2 * (R - 1) / R) == h.inter_bytes_per_region
    assert c.bytes_sent_per_peer == pytest.approx(2 * 2 / 3 * F + 2 * (R - 1) / R * F / 3 + 2 * F / 3)
    assert c.extra["digest_bytes_per_region"] == 3 * 2 * 64  # 3 members × 2 fetched shards, 64 B from abroad
    assert math.isfinite(c.round_seconds) and c.round_seconds > 0


def test_cells_layout_is_the_products_plan_and_bounds_the_peers() -> None:
    """One region of k = 10, G = 4: cells of 4, 3, 3 (C = 3), S = 4 shards. The model's layout is what
    plan_for gives each member; the peers a member exchanges with, derived here from each member's own plan:
    fragment bytes with its cell mates and its shards' other carriers, at most (G − 1) + ⌈S / n_min⌉·(C − 1)
    (here 5 of that bound's 7); counting the 64-byte digests (a witness in another cell per fetched shard,
    and the members asking it) every member of this small swarm meets all 9 others."""
    k, G = 10, 4
    link = LinkModel(fragment_bytes=F, regions=1, jitter_scale=0.0)
    lay = cell_layout(k, 1, G, "r")
    group = cells_group(k, 1, "r")
    names = group.members
    assert lay is not None and sorted(len(c) for c in lay.cells) == [3, 3, 4] and lay.shards == 4
    data: dict[str, set[str]] = {}
    full: dict[str, set[str]] = {}
    for i, me in enumerate(names):
        plan = plan_for(group, me, G)
        assert plan is not None and plan.local.members == tuple(names[j] for j in lay.cells[lay.cell_of[i]])
        assert plan.carried == lay.carried[i]
        assert all(tuple(names[j] for j in lay.carriers[s]) == plan.carriers[s] for s in range(plan.shards))
        data[me] = (set(plan.local.members) | {c for s in plan.carried for c in plan.carriers[s]}) - {me}
        full.setdefault(me, set()).update(data[me])
        for s in range(plan.shards):
            if s not in plan.carried:
                others = [c for c in plan.carriers[s] if c != plan.holder[s]]
                w = others[zlib.crc32(me.encode()) % len(others)]
                full[me].add(w)
                full.setdefault(w, set()).add(me)
    C, S, n_min = len(lay.cells), lay.shards, min(len(c) for c in lay.cells)
    r = cells(k, G, link, [0.0] * k, seed="r")
    assert r.extra["peers_max_without_digests"] == max(len(v) for v in data.values()) == 5
    assert max(len(v) for v in data.values()) <= (G - 1) + -(-S // n_min) * (C - 1) == 7
    assert r.peers_per_peer == max(len(v) for v in full.values()) == k - 1
    assert r.group_size_max == max(G, C) and not r.extra["carriers_over_G"]
    assert r.inter_bytes_per_region == 0  # one region: nothing crosses


def test_cells_more_carriers_than_G_are_flagged() -> None:
    """k = 20 in one region, G = 4: 5 cells, so step 2 is a butterfly of 5 carriers > G (k > G²)."""
    r = cells(20, 4, LinkModel(fragment_bytes=F, regions=1, jitter_scale=0.0), [0.0] * 20, seed="r")
    assert r.extra["carriers"] == 5 and r.extra["carriers_over_G"] and r.group_size_max == 5


@pytest.mark.parametrize("k,R", [(8, 1), (32, 1), (4, 4)])
def test_cells_of_a_single_cell_is_the_flat_butterfly(k: int, R: int) -> None:
    """One cell (k ≤ G in one region), or no cell of two (one peer a region): plan_for declines and the
    product runs the flat butterfly; so does the model, bytes, streams and time alike."""
    link = LinkModel(fragment_bytes=F, regions=R, jitter_scale=0.0)
    assert cell_layout(k, R, 32, "r") is None
    c, f = cells(k, 32, link, [0.0] * k, seed="r"), flat(k, link, [0.0] * k)
    assert c.bytes_sent_per_peer == f.bytes_sent_per_peer == 2 * (k - 1) / k * F
    assert c.streams_per_peer == f.streams_per_peer and c.peers_per_peer == f.peers_per_peer == k - 1
    assert c.round_seconds == f.round_seconds and c.extra["plan"] == "flat"


def test_cells_at_1024_cross_once_per_cell() -> None:
    """Defaults (4 regions of 256), G = 32: 8 cells a region, C = 32 carriers; every cell's carriers send
    2(C − 8)/C·F to other regions (the other 24 cells are abroad), 8 × 1.5F a region against the
    hierarchical scheme's 1.5F; fragment bytes with at most 31 cell mates + 31 carriers."""
    link = LinkModel(fragment_bytes=F)
    ready = ready_times(1024, link, random.Random(0))
    c, h = cells(1024, 32, link, ready, seed="r"), hierarchical(1024, link, ready)
    assert c.extra["cells"] == 32 and c.extra["shards"] == 32 and not c.extra["carriers_over_G"]
    assert c.inter_bytes_per_region == pytest.approx(8 * 1.5 * F) and h.inter_bytes_per_region == pytest.approx(1.5 * F)
    assert c.extra["peers_max_without_digests"] == 62
    assert c.round_seconds < flat(1024, link, ready).round_seconds


def test_link_model_checks() -> None:
    with pytest.raises(ValueError, match="F must be positive"):
        LinkModel(fragment_bytes=0)
    with pytest.raises(ValueError, match="regions R"):
        LinkModel(regions=0)
    with pytest.raises(ValueError, match="fail_prob"):
        LinkModel(fail_prob=1.0)
