"""Prometheus metrics of a peer, defined once.

Names follow Prometheus conventions: ``p2ptrain_`` prefix, base units
(``_seconds``, ``_bytes``), ``_total`` on counters, and only low-cardinality
labels (fragment, outcome, codec — never a peer id). Each peer owns its
registry, so several peers can live in one process (tests, the simulator).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server
from prometheus_client.core import CounterMetricFamily

from . import __version__

__all__ = ["DEFAULT_METRICS_PORT", "PeerMetrics"]

#: Out of the way of Prometheus itself (9090) and the usual exporters (9100-9199).
DEFAULT_METRICS_PORT = 9464

_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
_STALENESS_BUCKETS = (0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89)


class PeerMetrics:
    """Every metric a peer exports (see ``docs`` in the README's Observability section)."""

    def __init__(self, *, method: str, region: str, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.inner_steps = Counter("p2ptrain_inner_steps", "Inner optimizer steps taken.", registry=r)
        self.tokens = Counter("p2ptrain_tokens", "Training tokens processed.", registry=r)
        self.train_loss = Gauge("p2ptrain_train_loss", "Training loss of the last inner step (nats/token).", registry=r)
        self.val_loss = Gauge("p2ptrain_validation_loss", "Validation loss of θ at the last evaluation.", registry=r)
        self.tokens_per_second = Gauge("p2ptrain_tokens_per_second", "Inner-loop throughput (tokens/s).", registry=r)
        self.rounds = Counter("p2ptrain_outer_rounds", "Outer rounds by fragment and outcome.",
                              ["fragment", "outcome"], registry=r)
        self.round_duration = Histogram("p2ptrain_round_duration_seconds", "Wall time from send to arrival.",
                                        buckets=_DURATION_BUCKETS, registry=r)
        self.staleness = Histogram("p2ptrain_staleness_steps", "Logical steps between a round's send and apply.",
                                   buckets=_STALENESS_BUCKETS, registry=r)
        self.correction = Gauge("p2ptrain_taylor_correction_norm", "Norm of the last Taylor delay correction.",
                                registry=r)
        self.bytes_sent = Counter("p2ptrain_sent_bytes", "Payload bytes sent, by wire codec.", ["codec"], registry=r)
        self.bytes_received = Counter("p2ptrain_received_bytes", "Payload bytes received, by wire codec.", ["codec"],
                                      registry=r)
        self.bandwidth = Gauge("p2ptrain_bandwidth_bytes_per_second", "Measured all-reduce throughput (EMA).",
                               registry=r)
        self.live_peers = Gauge("p2ptrain_live_peers", "Peers of the run seen alive in the DHT.", registry=r)
        self.utilization = Gauge("p2ptrain_compute_utilization_ratio",
                                 "Fraction of wall time spent in inner steps.", registry=r)
        self.checkpoint_time = Gauge("p2ptrain_last_checkpoint_timestamp_seconds",
                                     "Unix time of the last checkpoint (0: none yet).", registry=r)
        self.checkpoint_age = Gauge("p2ptrain_checkpoint_age_seconds", "Seconds since the last checkpoint.",
                                    registry=r)
        self.checkpoint_age.set_function(self._checkpoint_age)
        self.sharing_nothing = Gauge("p2ptrain_sharing_nothing_seconds",
                                     "Seconds without a round shared with another peer, once that is longer than "
                                     "every fragment syncing twice (0: sharing).", registry=r)
        self.rounds_in_flight = Gauge("p2ptrain_rounds_in_flight", "Fragment rounds in flight.", registry=r)
        self.build = Info("p2ptrain_build", "Version, method and region of this peer.", registry=r)
        self.build.info({"version": __version__, "method": method, "region": region or "-"})
        self._started = time.time()

    def round_done(self, label: str, outcome: str, stats: Any, codec: str, seen: tuple[int, int]) -> tuple[int, int]:
        """A round of ``label`` ended with ``outcome``; ``stats`` the runner's totals (``RoundStats``), ``seen``
        the byte totals already counted. Returns the byte totals counted now."""
        self.rounds.labels(fragment=label, outcome=outcome).inc()
        if outcome != "failed" and stats.seconds:
            self.round_duration.observe(stats.seconds[-1])
        self.bandwidth.set(stats.bandwidth)
        self.rounds_in_flight.set(stats.in_flight)
        self.bytes_sent.labels(codec=codec).inc(max(0, stats.bytes_sent - seen[0]))
        self.bytes_received.labels(codec=codec).inc(max(0, stats.bytes_received - seen[1]))
        return stats.bytes_sent, stats.bytes_received

    def watch_traffic(self, read: Callable[[], dict[str, dict[str, int]]]) -> None:
        """Export ``p2ptrain_message_bytes_total{kind, direction}`` from ``read()`` (the transport's counts of its
        own messages, net/traffic.py) at each scrape. Once per registry: a second call is ignored."""
        if getattr(self, "_traffic", None) is None:
            self._traffic = _TrafficCollector(read)
            self.registry.register(self._traffic)

    def step_done(self, tokens: int, loss: float, tokens_seen: int, compute: float, elapsed: float | None) -> None:
        """An inner step of ``tokens`` at ``loss``; throughput from the totals, utilization from the loop's
        ``elapsed`` wall time (None before the loop)."""
        self.inner_steps.inc()
        self.tokens.inc(tokens)
        self.train_loss.set(loss)
        if compute > 0:
            self.tokens_per_second.set(tokens_seen / compute)
        if elapsed is not None:
            self.utilization.set(compute / max(1e-9, elapsed))

    def _checkpoint_age(self) -> float:
        last = self.checkpoint_time._value.get()
        return time.time() - (last if last > 0 else self._started)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` over HTTP in a daemon thread; returns the port (``port=0`` picks a free one)."""
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._server.server_address[1])

    def close(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None:
            server.shutdown()
            server.server_close()
            self._server = None


class _TrafficCollector:
    """The transport's message bytes by kind and direction, read when Prometheus scrapes (kinds are the protocol's
    dozen message names: low cardinality)."""

    def __init__(self, read: Callable[[], dict[str, dict[str, int]]]) -> None:
        self.read = read

    def collect(self) -> Iterator[CounterMetricFamily]:
        fam = CounterMetricFamily("p2ptrain_message_bytes", "Bytes of this peer's own messages by kind and direction "
                                  "(frames; not TCP/IP, libp2p or DHT overhead).", labels=["kind", "direction"])
        for kind, counts in self.read().items():
            for direction, n in counts.items():
                fam.add_metric([kind, direction], n)
        yield fam
