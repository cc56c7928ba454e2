"""A protocol-only model of one fragment round among k peers: time, bytes, streams, buffers, no tensors.

For the scale benchmark (bench/scale_protocol.py) to 1024 peers and beyond, which no machine here runs
for real. Four ways to average one fragment of F bytes:

Why it is long: the four schemes share one link and straggler model and one report; split apart, each
would carry a copy of the per-step timing it shares with the others.

* **flat**: one butterfly over all k peers (the round with ``--flat-rounds``, or of a single cell).
  Reduce-scatter: every peer sends each other peer its 1/k slice ((k−1)/k·F out, the same in); all-gather:
  every part's owner sends its average to the k−1 others (again (k−1)/k·F). 2(k−1) streams per peer,
  k(k−1) per phase in the swarm.
* **bounded**: the members split into groups of at most G (algo/grouping.split_groups, new each round),
  each a flat butterfly of its own, run in parallel. One round averages within groups only: it takes
  several rounds to mix (measured on scalars by :func:`rounds_to_mix`, the real split_groups).
* **hierarchical**: R regions. Inside each region of n: reduce-scatter (shard s of F/n to member s);
  across regions: member s of every region all-reduces shard s with its R−1 counterparts (a butterfly of
  R over F/n, so every member carries 1/n of its region's cross bytes, 2(R−1)/R·F per region); inside
  each region: all-gather. With n = 1 it is the flat butterfly of the R region members.
* **cells** (what the product runs, p2ptrain/net/hierarchy.py, ``--max-group`` G, default 32): the real
  :func:`~p2ptrain.net.hierarchy.cells_of` / :func:`~p2ptrain.net.hierarchy.plan_for` put the members in
  cells (a region's members; a region of more than G split into balanced cells of ≤ G by split_groups,
  new each round). Step 1: each cell's n_c members all-reduce the whole fragment (a flat butterfly of F);
  step 2: F is cut into S shards (S = the largest cell), shard s all-reduced by its C carriers (one per
  cell: a butterfly of C over F/S; a member carrying several shards runs them at once on its one link);
  step 3: every member fetches each shard it did not carry from its cell's carrier (F·(1 − carried/S) in
  over the intra link, the carrier serving n_c − 1 members), checks it against the 64-byte digest of a
  carrier of another cell (a round trip, cross-region when that cell is in another region; the witness is
  picked as the product does, and answers its requests one after another) and asks its carrier whether it
  was outvoted (one more intra round trip). One round gives every member the exact swarm mean: no rounds to
  mix. When plan_for declines (one cell, or no cell of two) the product runs the flat butterfly, and so does
  the model. The product does not recurse: for C > G (k > G² in one region) step 2 is a butterfly of more
  than G carriers, and the model runs it as such. A vanished carrier's shard is fetched, after the product's
  2 s wait for a silent carrier, from the first other carrier of that shard.

Time of one butterfly phase at peer i (a message to every other member, sizes as above):
``latency + streams · stream_cost + max(intra_bytes / intra_bw, inter_bytes / inter_bw)``, with latency
the largest one-way latency to a member it sends to; intra and inter traffic on separate bottlenecks
(a peer's LAN and its WAN path), each direction full duplex, and, with ``region_bandwidth``, a region's
cross bytes in that phase also no faster than through the region's shared uplink. A phase ends when its
last message is in; peers start a round at their own ready time, a seeded lognormal straggler delay
(compute jitter, arrival); the all-gather starts when every part's contributions are in.

What it does not model: TCP/libp2p dynamics (slow start, congestion between flows of one link, stream
set-up beyond ``stream_cost``), encoding and aggregation compute, group formation over the DHT (its
Python cost is measured separately), failures and partial rounds, and unequal regions beyond a rough
approximation (shards of the smallest region set the cross-region time).

The byte and message counts of the flat butterfly are checked against the real one (sim/loopback.py)
in tests/sim/test_protocol.py.
"""

from __future__ import annotations

import math
import random
import statistics
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from typing import Any

from ..algo.grouping import average_within, split_groups
from ..net.hierarchy import cells_of, plan_for
from ..net.transport import Group

__all__ = ["DIGEST_BYTES", "MIB", "CellLayout", "LinkModel", "RoundModel", "bounded", "cell_layout", "cells",
           "cells_group", "flat", "hierarchical", "log2_ratio", "mean_over_trials", "peer_names", "ready_times",
           "region_of", "rounds_to_mix"]

MIB = 2**20
DIGEST_BYTES = 64  # a shard offer's digest, hex (what a member fetches from another cell's carrier)
SILENT_CARRIER_WAIT = 2.0  # seconds a member gives its cell's silent carrier once the witness answered (hierarchy.py)


@dataclass(frozen=True, kw_only=True)
class LinkModel:
    """The network and the peers, as the model sees them.

    Attributes:
        fragment_bytes: F, the encoded fragment one round all-reduces (bytes).
        intra_bandwidth: a peer's bits/s to peers of its own region.
        inter_bandwidth: a peer's bits/s to peers of other regions (its share of the WAN path).
        intra_latency: one-way seconds inside a region.
        inter_latency: one-way seconds between regions.
        region_bandwidth: bits/s of a region's shared uplink to the other regions (None: not shared, each
            peer has its own ``inter_bandwidth``).
        regions: R; peer i is in region i mod R.
        stream_cost: seconds of a peer's time per message (stream) it sends, one after another (opening a
            stream, framing, the handler): what makes k−1 messages cost more than one of the same bytes.
        jitter_scale: median straggler delay (seconds) before a peer starts its round.
        jitter_sigma: σ of the lognormal straggler delay (heavier tail as it grows; 0: no jitter).
        fail_prob: probability that a peer vanishes during a round (drawn per peer and round).
        fail_wait: seconds the other members of its group (hierarchical: of the whole round) then wait
            before they average without it (the real round's gather deadline, half its timeout).
    """

    fragment_bytes: float = 64 * MIB
    intra_bandwidth: float = 1e9
    inter_bandwidth: float = 100e6
    intra_latency: float = 0.0005
    inter_latency: float = 0.05
    region_bandwidth: float | None = None
    regions: int = 4
    stream_cost: float = 0.001
    jitter_scale: float = 0.05
    jitter_sigma: float = 1.0
    fail_prob: float = 0.0
    fail_wait: float = 30.0

    def __post_init__(self) -> None:
        if not self.fragment_bytes > 0:
            raise ValueError(f"the fragment size F must be positive, got {self.fragment_bytes}")
        if not (self.intra_bandwidth > 0 and self.inter_bandwidth > 0):
            raise ValueError("bandwidths must be positive")
        if self.region_bandwidth is not None and not self.region_bandwidth > 0:
            raise ValueError("region_bandwidth must be positive (or None)")
        if min(self.intra_latency, self.inter_latency, self.stream_cost, self.jitter_scale, self.jitter_sigma) < 0:
            raise ValueError("latencies, stream_cost and jitter must be >= 0")
        if not 0.0 <= self.fail_prob < 1.0 or self.fail_wait < 0:
            raise ValueError("fail_prob must be in [0, 1) and fail_wait >= 0")
        if self.regions < 1:
            raise ValueError(f"the number of regions R must be at least 1, got {self.regions}")


@dataclass
class RoundModel:
    """One scheme's round among k peers (means over the trials for the times).

    ``round_seconds``: from the first peer's start of the round to the last peer's end (the slowest group
    for bounded groups); ``group_seconds``: the mean over groups of their own time (what a peer waits for
    when groups do not wait for each other); bytes are payload sent per peer (received is the same);
    ``inter_bytes_per_region``: bytes a region sends to other regions in one round; ``buffer_bytes``: the
    largest per-peer buffers of a round (fragment snapshot + result being assembled + contributions to
    the parts it owns); ``streams_per_peer``: the most messages (streams) a peer sends or opens in a round;
    ``peers_per_peer``: the most distinct peers one peer exchanges with in a round."""

    scheme: str
    k: int
    round_seconds: float
    group_seconds: float
    bytes_sent_per_peer: float
    bytes_sent_max: float
    inter_bytes_per_peer: float
    inter_bytes_per_region: float
    streams_per_peer: int
    streams_total: int
    buffer_bytes: float
    groups: int
    group_size_max: int
    extra: dict[str, Any] = field(default_factory=dict)
    peers_per_peer: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def peer_names(k: int) -> list[str]:
    """``peer0000``… (sorted as numbers are): the model's peer ids."""
    return [f"peer{i:04d}" for i in range(k)]


def region_of(i: int, link: LinkModel) -> int:
    return i % link.regions


def ready_times(k: int, link: LinkModel, rng: random.Random) -> list[float]:
    """Each peer's straggler delay before it starts the round: ``jitter_scale · lognormal(0, σ)``; ``inf``
    for a peer that vanishes this round (probability ``fail_prob``)."""
    out = [0.0] * k if link.jitter_scale == 0 else \
        [link.jitter_scale * rng.lognormvariate(0.0, link.jitter_sigma) for _ in range(k)]
    if link.fail_prob > 0:
        out = [math.inf if rng.random() < link.fail_prob else t for t in out]
    return out


@dataclass
class _Phase:
    """One butterfly phase at every member of a group: seconds, bytes to the own / other regions, streams."""

    seconds: list[float]
    intra: list[float]
    inter: list[float]
    streams: int


def _phase(regions: Sequence[int], vector_bytes: float, link: LinkModel) -> _Phase:
    """One butterfly phase (reduce-scatter or all-gather) of a vector of ``vector_bytes`` among members in
    ``regions``: each member sends a 1/m slice to every other member."""
    m = len(regions)
    part = vector_bytes / m
    count = {r: regions.count(r) for r in set(regions)}
    secs, intra, inter = [], [], []
    cross_of_region: dict[int, float] = {}
    for r in regions:
        same = count[r] - 1
        other = m - 1 - same
        intra.append(same * part)
        inter.append(other * part)
        cross_of_region[r] = cross_of_region.get(r, 0.0) + other * part
    for r, a, b in zip(regions, intra, inter, strict=True):
        latency = link.inter_latency if b > 0 else link.intra_latency if a > 0 else 0.0
        wire = max(8 * a / link.intra_bandwidth, 8 * b / link.inter_bandwidth)
        if link.region_bandwidth is not None:
            wire = max(wire, 8 * cross_of_region[r] / link.region_bandwidth)
        secs.append(latency + (m - 1) * link.stream_cost + wire)
    return _Phase(secs, intra, inter, m - 1)


def _butterfly_seconds(ready: Sequence[float], ph: _Phase, link: LinkModel) -> float:
    """End of a two-phase butterfly whose members start at ``ready`` (both phases move the same bytes):
    the reduce-scatter ends with the last message in, then every owner sends its average. A vanished
    member (ready = inf) is waited for until ``fail_wait`` after the first member started."""
    return _butterfly_end(ready, ph.seconds, link)


def _butterfly_end(ready: Sequence[float], seconds: Sequence[float], link: LinkModel) -> float:
    """:func:`_butterfly_seconds` with each member's phase time given."""
    live = [(t, s) for t, s in zip(ready, seconds, strict=True) if math.isfinite(t)]
    if not live:
        return math.nan
    if len(ready) == 1:
        return ready[0]
    rs_end = max(t + s for t, s in live)
    if len(live) < len(ready):
        rs_end = max(rs_end, min(t for t, _ in live) + link.fail_wait)
    return rs_end + max(seconds)


def _inter_per_region(k: int, inter: Sequence[float], link: LinkModel) -> float:
    per: dict[int, float] = {}
    for i, b in enumerate(inter):
        per[region_of(i, link)] = per.get(region_of(i, link), 0.0) + b
    return max(per.values()) if per else 0.0


def _flat_group(idx: Sequence[int], ready: Sequence[float], link: LinkModel) -> tuple[float, _Phase]:
    ph = _phase([region_of(i, link) for i in idx], link.fragment_bytes, link)
    return _butterfly_seconds([ready[i] for i in idx], ph, link), ph


def flat(k: int, link: LinkModel, ready: Sequence[float]) -> RoundModel:
    """One butterfly over all ``k`` peers, each starting at ``ready[i]``."""
    return bounded(k, max(k, 2), link, ready, seed="flat", scheme="flat")


def bounded(k: int, max_size: int, link: LinkModel, ready: Sequence[float], *, seed: str,
            scheme: str = "bounded") -> RoundModel:
    """Groups of at most ``max_size`` (split_groups with ``seed``, the round key), each a butterfly."""
    names = peer_names(k)
    index = {n: i for i, n in enumerate(names)}
    groups = split_groups(names, max_size, seed)
    F = link.fragment_bytes
    times, sent, inter = [], [0.0] * k, [0.0] * k
    streams, buffers = 0, 0.0
    for grp in groups:
        idx = [index[n] for n in grp]
        t, ph = _flat_group(idx, ready, link)
        times.append(t)
        m = len(idx)
        for j, i in enumerate(idx):
            sent[i] = 2 * (ph.intra[j] + ph.inter[j])
            inter[i] = 2 * ph.inter[j]
        streams = max(streams, 2 * ph.streams)
        buffers = max(buffers, 2 * F + (m - 1) * F / m)
    start = min(ready)
    times = [t for t in times if not math.isnan(t)]  # a group whose every member vanished has no time
    return RoundModel(scheme, k, max(times) - start, statistics.fmean(times) - start, statistics.fmean(sent),
                      max(sent), statistics.fmean(inter), _inter_per_region(k, inter, link), streams,
                      sum(2 * (len(g) - 1) * len(g) for g in groups), buffers, len(groups),
                      max(len(g) for g in groups), peers_per_peer=max(len(g) for g in groups) - 1)


def hierarchical(k: int, link: LinkModel, ready: Sequence[float]) -> RoundModel:
    """Reduce-scatter inside each region, shard all-reduce across regions, all-gather inside."""
    F = link.fragment_bytes
    members: dict[int, list[int]] = {}
    for i in range(k):
        members.setdefault(region_of(i, link), []).append(i)
    R = len(members)
    rs_end, inner_secs = 0.0, 0.0
    sent, inter = [0.0] * k, [0.0] * k
    streams, buffers = 0, 0.0
    cross_secs = 0.0
    for idx in members.values():
        n = len(idx)
        live = [ready[i] for i in idx if math.isfinite(ready[i])]
        if not live:
            continue
        start = max(live)
        if len(live) < n:  # a vanished member: its region waits for it until the deadline
            start = max(start, min(live) + link.fail_wait)
        if n > 1:
            ph = _phase([0] * n, F, link)  # every member in one region: intra only
            rs_end, inner_secs = max(rs_end, start + max(ph.seconds)), max(inner_secs, max(ph.seconds))
        else:
            rs_end = max(rs_end, start)
        shard = F / n
        cross_bytes = 2 * (R - 1) / R * shard  # both phases of a butterfly of R over one shard
        if R > 1:
            # one phase: a message to each of the R−1 counterparts; the region's n shards share its uplink
            wire = 8 * cross_bytes / 2 / link.inter_bandwidth
            if link.region_bandwidth is not None:
                wire = max(wire, 8 * n * cross_bytes / 2 / link.region_bandwidth)
            cross_secs = max(cross_secs, 2 * (link.inter_latency + (R - 1) * link.stream_cost + wire))
        for i in idx:
            sent[i] = 2 * (n - 1) / n * F + cross_bytes
            inter[i] = cross_bytes
        streams = max(streams, 2 * (n - 1) + 2 * (R - 1))
        buffers = max(buffers, 2 * F + (n - 1) * F / n + (R - 1) * shard / R)
    end = rs_end + cross_secs + inner_secs
    t0 = min(ready)
    total_streams = sum(2 * (len(v) - 1) * len(v) for v in members.values()) + 2 * (R - 1) * k
    return RoundModel("hierarchical", k, end - t0, end - t0, statistics.fmean(sent), max(sent),
                      statistics.fmean(inter), _inter_per_region(k, inter, link), streams, total_streams, buffers,
                      R, max(len(v) for v in members.values()), {"regions": R},
                      peers_per_peer=max(len(v) for v in members.values()) - 1 + R - 1)


@dataclass(frozen=True)
class CellLayout:
    """One round's cells and carriers as the product plans them (net/hierarchy.py), by peer index.

    ``cells[c]``: the sorted members of cell c; ``cell_of[i]``: peer i's cell; ``shards``: S;
    ``carriers[s]``: shard s's carriers, one per cell (the step-2 group); ``holder[c][s]``: cell c's carrier
    of shard s; ``carried[i]``: the shards peer i carries; ``witness[i]``: for each shard peer i fetches
    (shard, the carrier of another cell it asks for the digest); ``peers[i]``: every peer i exchanges with
    in the round (its cell, its shards' other carriers, the witnesses it asks and the members asking it);
    ``data_peers``: the most peers one exchanges fragment bytes with (its cell and its shards' carriers)."""

    cells: tuple[tuple[int, ...], ...]
    cell_of: tuple[int, ...]
    shards: int
    carriers: tuple[tuple[int, ...], ...]
    holder: tuple[tuple[int, ...], ...]
    carried: tuple[tuple[int, ...], ...]
    witness: tuple[tuple[tuple[int, int], ...], ...]
    peers: tuple[frozenset[int], ...]
    data_peers: int


def cells_group(k: int, regions: int, key: str) -> Group:
    """The round's :class:`~p2ptrain.net.transport.Group` of the model's k peers (peer i in region i mod R;
    no region labels for one region)."""
    names = peer_names(k)
    labels = tuple(f"region{i % regions}" for i in range(k)) if regions > 1 else ()
    return Group(key, tuple(names), min(names), 0, regions=labels)


@lru_cache(maxsize=64)
def cell_layout(k: int, regions: int, max_group: int, key: str) -> CellLayout | None:
    """The cells of a round of ``k`` peers in ``regions`` regions with round key ``key``, from the product's
    own :func:`cells_of` and :func:`plan_for` (None where plan_for declines: the product then runs the flat
    butterfly). The digest witness is picked as hierarchy._shard_bytes does."""
    group = cells_group(k, regions, key)
    names = group.members
    plan = plan_for(group, names[0], max_group)
    if plan is None:
        return None
    index = {n: i for i, n in enumerate(names)}
    cells = tuple(tuple(index[m] for m in ms) for _, ms in cells_of(group, max_group))
    cell_of = [0] * k
    for c, idx in enumerate(cells):
        for i in idx:
            cell_of[i] = c
    S = plan.shards
    carriers = tuple(tuple(index[m] for m in plan.carriers[s]) for s in range(S))
    holder = [[0] * S for _ in cells]
    carried: list[list[int]] = [[] for _ in range(k)]
    for s, cs in enumerate(carriers):
        for i in cs:  # one carrier per cell
            holder[cell_of[i]][s] = i
            carried[i].append(s)
    peers: list[set[int]] = [set(cells[cell_of[i]]) - {i} for i in range(k)]
    witness: list[list[tuple[int, int]]] = [[] for _ in range(k)]
    others = [[[x for x in carriers[s] if x != holder[c][s]] for s in range(S)] for c in range(len(cells))]
    for i in range(k):
        for s in carried[i]:
            peers[i].update(carriers[s])
        peers[i].discard(i)
    data_peers = max(len(p) for p in peers)  # before the digests: the cell and the shards' carriers
    for i in range(k):
        mine, crc, candidates = set(carried[i]), zlib.crc32(names[i].encode()), others[cell_of[i]]
        for s in range(S):
            if s not in mine:
                w = candidates[s][crc % len(candidates[s])]
                witness[i].append((s, w))
                peers[i].add(w)
                peers[w].add(i)
    return CellLayout(cells, tuple(cell_of), S, carriers, tuple(tuple(h) for h in holder),
                      tuple(tuple(c) for c in carried), tuple(tuple(w) for w in witness),
                      tuple(frozenset(p) for p in peers), data_peers)


def cells(k: int, max_group: int, link: LinkModel, ready: Sequence[float], *, seed: str) -> RoundModel:
    """The product's round (net/hierarchy.py): cells of at most ``max_group`` (G), the round key ``seed``.
    See the module docstring for the three steps and what is timed."""
    lay = cell_layout(k, link.regions, max_group, seed)
    if lay is None:  # plan_for declines: the product runs the flat butterfly
        r = flat(k, link, ready)
        return replace(r, scheme="cells", extra={"plan": "flat", "cells": 1, "carriers": 0, "shards": 1,
                                                 "cell_size_max": k, "digest_bytes_per_region": 0.0})
    F, S, C = link.fragment_bytes, lay.shards, len(lay.cells)
    reg = [region_of(i, link) for i in range(k)]
    sent, inter = [0.0] * k, [0.0] * k
    streams = [0] * k
    buffers = 0.0
    # Step 1: every cell all-reduces F (a flat butterfly inside one region).
    end1 = [0.0] * len(lay.cells)
    for c, idx in enumerate(lay.cells):
        n = len(idx)
        if n == 1:
            end1[c] = ready[idx[0]]
            continue
        ph = _phase([reg[i] for i in idx], F, link)
        t = _butterfly_seconds([ready[i] for i in idx], ph, link)
        end1[c] = math.inf if math.isnan(t) else t
        for j, i in enumerate(idx):
            sent[i] += 2 * (ph.intra[j] + ph.inter[j])
            inter[i] += 2 * ph.inter[j]
            streams[i] += 2 * ph.streams
        buffers = max(buffers, 2 * F + (n - 1) * F / n)
    # Step 2: per shard a butterfly of the C carriers over F/S; a member runs its shards at once on its link.
    part = F / S / C
    same_region = {s: {r: sum(1 for c in cs if reg[c] == r) for r in set(reg[c] for c in cs)}
                   for s, cs in enumerate(lay.carriers)}
    a2, b2 = [0.0] * k, [0.0] * k  # one phase's bytes to the own / other regions
    for i in range(k):
        for s in lay.carried[i]:
            same = same_region[s][reg[i]] - 1
            a2[i] += same * part
            b2[i] += (C - 1 - same) * part
    cross2: dict[int, float] = {}
    for i in range(k):
        cross2[reg[i]] = cross2.get(reg[i], 0.0) + b2[i]
    secs2 = [0.0] * k
    for i in range(k):
        m = len(lay.carried[i])
        if m == 0:
            continue
        latency = link.inter_latency if b2[i] > 0 else link.intra_latency
        wire = max(8 * a2[i] / link.intra_bandwidth, 8 * b2[i] / link.inter_bandwidth)
        if link.region_bandwidth is not None:
            wire = max(wire, 8 * cross2[reg[i]] / link.region_bandwidth)
        secs2[i] = latency + m * (C - 1) * link.stream_cost + wire
        sent[i] += 2 * (a2[i] + b2[i])
        inter[i] += 2 * b2[i]
        streams[i] += 2 * m * (C - 1)
    end2 = []
    for cs in lay.carriers:  # a carrier starts its shards when its cell's step 1 ends
        starts = [end1[lay.cell_of[c]] if math.isfinite(ready[c]) else math.inf for c in cs]
        t = _butterfly_end(starts, [secs2[c] for c in cs], link)
        end2.append(math.inf if math.isnan(t) else t)
    # Step 3: fetch the other shards from the cell's carrier (who serves n_c − 1 members), the digest from
    # a carrier of another cell (who answers its requests one after another), then the carrier's "outvoted?".
    asked = [0] * k
    digest_cross: dict[int, float] = {}
    for i in range(k):
        for _, w in lay.witness[i]:
            asked[w] += 1
            if reg[w] != reg[i]:
                digest_cross[reg[w]] = digest_cross.get(reg[w], 0.0) + DIGEST_BYTES
    serve = [0.0] * k  # a carrier's time to serve its shards to its cell
    for idx in lay.cells:
        n = len(idx)
        for i in idx:
            out = len(lay.carried[i]) * F / S * (n - 1)
            sent[i] += out
            serve[i] = 2 * len(lay.carried[i]) * (n - 1) * link.stream_cost + 8 * out / link.intra_bandwidth
    ends = []
    for i in range(k):
        if not math.isfinite(ready[i]):
            continue
        c = lay.cell_of[i]
        own = max((end2[s] for s in lay.carried[i]), default=end1[c])
        fetched = lay.witness[i]
        streams[i] += 3 * len(fetched)
        if not fetched:
            ends.append(own)
            continue
        start = max(own, *(end2[s] for s, _ in fetched))
        in_intra = in_inter = 0.0
        fetch_lat, holder_time, digest_time, wait = 0.0, 0.0, 0.0, 0.0
        for s, w in fetched:
            h = lay.holder[c][s]
            if not math.isfinite(ready[h]):  # silent carrier: the first other carrier of s, after a wait
                wait = SILENT_CARRIER_WAIT
                h = next((x for x in lay.carriers[s] if x != h and math.isfinite(ready[x])), h)
            else:
                holder_time = max(holder_time, serve[h])
            if reg[h] == reg[i]:
                in_intra += F / S
                fetch_lat = max(fetch_lat, 2 * link.intra_latency)
            else:
                in_inter += F / S
                fetch_lat = max(fetch_lat, 2 * link.inter_latency)
            lat = link.inter_latency if reg[w] != reg[i] else link.intra_latency
            digest_time = max(digest_time, 2 * lat + asked[w] * link.stream_cost)
        wire = max(8 * in_intra / link.intra_bandwidth, 8 * in_inter / link.inter_bandwidth, holder_time)
        step3 = 3 * len(fetched) * link.stream_cost + max(fetch_lat + wire, digest_time) + wait \
            + 2 * link.intra_latency
        ends.append(start + step3)
        buffers = max(buffers, 3 * F + len(lay.carried[i]) * F / S)  # snapshot, cell mean, result, offers
    ends = [t for t in ends if math.isfinite(t)]
    t0 = min(ready)
    end = max(ends) - t0 if ends else math.nan
    sizes = [len(idx) for idx in lay.cells]
    extra = {"plan": "cells", "cells": C, "carriers": C, "shards": S, "cell_size_max": max(sizes),
             "carriers_over_G": C > max_group,
             "digest_bytes_per_region": max(digest_cross.values(), default=0.0),
             "peers_max_without_digests": lay.data_peers}
    return RoundModel("cells", k, end, end, statistics.fmean(sent), max(sent), statistics.fmean(inter),
                      _inter_per_region(k, inter, link), max(streams), sum(streams), buffers, C,
                      max(max(sizes), C), extra, peers_per_peer=max(len(p) for p in lay.peers))


def rounds_to_mix(k: int, max_size: int, *, tol: float = 1e-3, trials: int = 3, seed: int = 0,
                  limit: int = 200) -> int:
    """Rounds of averaging in bounded groups (the real split_groups, one round key a round) until the
    spread (max − min) of k random scalars is below ``tol`` of its start: the most over ``trials``.
    1 when all fit in one group; ``limit`` + 1 if never."""
    if k <= max_size:
        return 1
    names = peer_names(k)
    worst = 0
    for t in range(trials):
        rng = random.Random(seed * 1000 + t)
        values = {n: rng.uniform(-1.0, 1.0) for n in names}
        start = max(values.values()) - min(values.values())
        r = 0
        while r <= limit:
            values = average_within(values, split_groups(names, max_size, f"mix{seed}.{t}/round{r}"))
            r += 1
            if max(values.values()) - min(values.values()) < tol * start:
                break
        worst = max(worst, r)
    return worst


def mean_over_trials(rows: Sequence[RoundModel]) -> RoundModel:
    """The rows of one scheme and k, averaged (times and bytes; counts from the first)."""
    first = rows[0]
    out = RoundModel(**{**first.as_dict()})
    for name in ("round_seconds", "group_seconds", "bytes_sent_per_peer", "inter_bytes_per_peer"):
        setattr(out, name, statistics.fmean(getattr(r, name) for r in rows))
    for name in ("bytes_sent_max", "inter_bytes_per_region", "buffer_bytes"):
        setattr(out, name, max(getattr(r, name) for r in rows))
    for name in ("streams_per_peer", "peers_per_peer", "group_size_max"):
        setattr(out, name, max(getattr(r, name) for r in rows))
    out.extra = {**first.extra, "round_seconds_max": max(r.round_seconds for r in rows),
                 "trials": len(rows)}
    for name in ("cells", "carriers", "shards", "cell_size_max"):
        if name in first.extra:
            out.extra[name] = max(r.extra[name] for r in rows)
    return out


def log2_ratio(seconds: float, per_group: float, k: int) -> float:
    """``seconds / (per_group · log2 k)`` (log2 k taken as 1 below k = 2): the issue's O(log k) yardstick."""
    return seconds / (per_group * max(1.0, math.log2(k)))
