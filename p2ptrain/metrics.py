"""Prometheus metrics of a peer, defined once.

Names follow Prometheus conventions: ``p2ptrain_`` prefix, base units
(``_seconds``, ``_bytes``), ``_total`` on counters, and only low-cardinality
labels (fragment, outcome, codec — never a peer id). Each peer owns its
registry, so several peers can live in one process (tests, the simulator).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

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
        self.rounds_in_flight = Gauge("p2ptrain_rounds_in_flight", "Fragment rounds in flight.", registry=r)
        self.build = Info("p2ptrain_build", "Version, method and region of this peer.", registry=r)
        self.build.info({"version": __version__, "method": method, "region": region or "-"})
        self._started = time.time()

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
