"""A protocol-only model of one fragment round among k peers: time, bytes, streams, buffers, no tensors.

For the scale benchmark (bench/scale_protocol.py) to 1024 peers and beyond, which no machine here runs
for real. Three ways to average one fragment of F bytes:

* **flat**: one butterfly over all k peers (today's round). Reduce-scatter: every peer sends each other
  peer its 1/k slice ((k−1)/k·F out, the same in); all-gather: every part's owner sends its average to
  the k−1 others (again (k−1)/k·F). 2(k−1) streams per peer, k(k−1) per phase in the swarm.
* **bounded**: the members split into groups of at most G (algo/grouping.split_groups, new each round),
  each a flat butterfly of its own, run in parallel. One round averages within groups only: it takes
  several rounds to mix (measured on scalars by :func:`rounds_to_mix`, the real split_groups).
* **hierarchical**: R regions. Inside each region of n: reduce-scatter (shard s of F/n to member s);
  across regions: member s of every region all-reduces shard s with its R−1 counterparts (a butterfly of
  R over F/n, so every member carries 1/n of its region's cross bytes, 2(R−1)/R·F per region); inside
  each region: all-gather. With n = 1 it is the flat butterfly of the R region members.

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
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..algo.grouping import average_within, split_groups

__all__ = ["MIB", "LinkModel", "RoundModel", "bounded", "flat", "hierarchical", "log2_ratio", "mean_over_trials",
           "peer_names", "ready_times", "region_of", "rounds_to_mix"]

MIB = 2**20


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
    the parts it owns)."""

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
    live = [(t, s) for t, s in zip(ready, ph.seconds, strict=True) if math.isfinite(t)]
    if not live:
        return math.nan
    if len(ready) == 1:
        return ready[0]
    rs_end = max(t + s for t, s in live)
    if len(live) < len(ready):
        rs_end = max(rs_end, min(t for t, _ in live) + link.fail_wait)
    return rs_end + max(ph.seconds)


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
                      max(len(g) for g in groups))


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
                      R, max(len(v) for v in members.values()), {"regions": R})


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
    out.extra = {**first.extra, "round_seconds_max": max(r.round_seconds for r in rows),
                 "trials": len(rows)}
    return out


def log2_ratio(seconds: float, per_group: float, k: int) -> float:
    """``seconds / (per_group · log2 k)`` (log2 k taken as 1 below k = 2): the issue's O(log k) yardstick."""
    return seconds / (per_group * max(1.0, math.log2(k)))
