"""Measured throughput: an exponential moving average per link, time passed in (no clock here)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["LinkMeter", "ThroughputEMA"]


@dataclass
class ThroughputEMA:
    """Bytes per second over real transfers: ``rate ← (1−α)·rate + α·bytes/seconds``.

    Transfers smaller than ``min_bytes`` are ignored: their time is mostly latency, not bandwidth.
    """

    alpha: float = 0.3
    min_bytes: int = 64 * 1024
    rate: float = 0.0
    samples: int = 0

    def update(self, nbytes: int, seconds: float) -> float:
        if nbytes >= self.min_bytes and seconds > 0:
            sample = nbytes / seconds
            self.rate = sample if self.samples == 0 else (1 - self.alpha) * self.rate + self.alpha * sample
            self.samples += 1
        return self.rate


@dataclass
class LinkMeter:
    """One EMA per remote peer, and their aggregate."""

    alpha: float = 0.3
    links: dict[str, ThroughputEMA] = field(default_factory=dict)

    def update(self, peer: str, nbytes: int, seconds: float) -> None:
        self.links.setdefault(peer, ThroughputEMA(self.alpha)).update(nbytes, seconds)

    def rate(self, peer: str) -> float:
        link = self.links.get(peer)
        return link.rate if link else 0.0

    def slowest(self) -> float:
        """The slowest measured link (what a butterfly's round waits for); 0 before any sample."""
        rates = [link.rate for link in self.links.values() if link.samples]
        return min(rates) if rates else 0.0
