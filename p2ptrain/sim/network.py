"""The simulator's network: regions of peers, links with bandwidth and latency, a virtual clock.

A transfer (one all-reduce phase among a group) costs
``latency + ring_factor · encoded_bytes / bandwidth`` seconds, with the group's
worst one-way latency (half the RTT between regions, ``intra_latency`` inside
one), its slowest member's bandwidth (a ring runs at the pace of its slowest
link) and ``ring_factor = 2(M−1)/M`` (a ring all-reduce moves that fraction of
the vector through every peer's link, each way). A link carries one transfer at
a time: a transfer starts when every member is ready and every member's link is
free.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..collective.butterfly import ring_factor

__all__ = ["Network", "Region", "parse_bandwidth", "parse_duration", "parse_regions"]

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_bandwidth(text: str) -> float:
    """``"100mbit"``, ``"1gbit"``, ``"2.5gbps"``, ``"800kbit"`` → bits per second."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|bps|b/s)?\s*", text.lower())
    if not m:
        raise ValueError(f"cannot read bandwidth {text!r}; write e.g. 100mbit or 1gbit")
    value = float(m.group(1)) * _UNITS[m.group(2)]
    if value <= 0:
        raise ValueError(f"bandwidth must be positive, got {text!r}")
    return value


def parse_duration(text: str) -> float:
    """``"120ms"``, ``"0.1s"``, ``"250us"`` or a bare number of seconds → seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(us|ms|s)?\s*", text.lower())
    if not m:
        raise ValueError(f"cannot read duration {text!r}; write e.g. 120ms or 0.1s")
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}[m.group(2)]


@dataclass(frozen=True)
class Region:
    name: str
    peers: int
    bandwidth: float  # bits/s of each peer's link


def parse_regions(text: str) -> list[Region]:
    """``"us:4:1gbit,eu:4:100mbit"`` → regions (name, peer count, per-peer bandwidth)."""
    out = []
    for part in text.split(","):
        bits = part.strip().split(":")
        if len(bits) != 3:
            raise ValueError(f"region {part!r} must read NAME:PEERS:BANDWIDTH, e.g. us:4:1gbit")
        name, count, bw = bits
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"region {name!r}: peer count must be a positive integer, got {count!r}")
        out.append(Region(name, int(count), parse_bandwidth(bw)))
    names = [r.name for r in out]
    if len(set(names)) != len(names):
        raise ValueError(f"region names must be unique: {names}")
    return out


class Network:
    """Peers' links and when each is next free, on the simulator's virtual clock."""

    def __init__(self, regions: Sequence[Region], *, rtt: float = 0.0, intra_latency: float = 0.0005) -> None:
        if rtt < 0 or intra_latency < 0:
            raise ValueError("latencies must be >= 0")
        self.region_of: list[str] = [r.name for r in regions for _ in range(r.peers)]
        self.bandwidth: list[float] = [r.bandwidth for r in regions for _ in range(r.peers)]
        self.rtt, self.intra_latency = rtt, intra_latency
        self.link_free: list[float] = [0.0] * len(self.bandwidth)

    @property
    def size(self) -> int:
        return len(self.bandwidth)

    def latency(self, members: Sequence[int]) -> float:
        regions = {self.region_of[m] for m in members}
        return self.rtt / 2 if len(regions) > 1 else self.intra_latency

    def duration(self, members: Sequence[int], nbytes: float) -> float:
        """Seconds one all-reduce phase of ``nbytes`` (one peer's encoded vector) takes."""
        if len(members) < 2:
            return 0.0
        bw = min(self.bandwidth[m] for m in members) / 8.0  # bytes/s
        return self.latency(members) + ring_factor(len(members)) * nbytes / bw

    def transfer(self, members: Sequence[int], nbytes: float, ready: float) -> float:
        """Schedule a phase that can start at ``ready``; returns its end time and books the links."""
        start = max([ready] + [self.link_free[m] for m in members])
        end = start + self.duration(members, nbytes)
        for m in members:
            self.link_free[m] = end
        return end
