"""A live peer's metrics endpoint, scraped over HTTP and parsed with prometheus_client's parser."""

from __future__ import annotations

import threading
import time
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from p2ptrain.algo.methods import method_config
from p2ptrain.data import Corpus, DataConfig
from p2ptrain.metrics import PeerMetrics
from p2ptrain.net.memory import MemorySwarm
from p2ptrain.peer import PeerConfig, make_peer
from p2ptrain.sync import NetLoop
from p2ptrain.trainer import TrainerConfig, make_trainer

from .net.peers import MODEL

DOCUMENTED = {  # name (as the parser reports it) -> type
    "p2ptrain_inner_steps": "counter", "p2ptrain_tokens": "counter", "p2ptrain_train_loss": "gauge",
    "p2ptrain_validation_loss": "gauge", "p2ptrain_tokens_per_second": "gauge", "p2ptrain_outer_rounds": "counter",
    "p2ptrain_round_duration_seconds": "histogram", "p2ptrain_staleness_steps": "histogram",
    "p2ptrain_taylor_correction_norm": "gauge", "p2ptrain_sent_bytes": "counter",
    "p2ptrain_received_bytes": "counter", "p2ptrain_bandwidth_bytes_per_second": "gauge",
    "p2ptrain_live_peers": "gauge", "p2ptrain_compute_utilization_ratio": "gauge",
    "p2ptrain_last_checkpoint_timestamp_seconds": "gauge", "p2ptrain_checkpoint_age_seconds": "gauge",
    "p2ptrain_rounds_in_flight": "gauge", "p2ptrain_sharing_nothing_seconds": "gauge",
    "p2ptrain_build_info": "gauge",  # an Info is exposed as a gauge
    "p2ptrain_message_bytes": "counter",
}


def scrape(port: int) -> dict[str, Any]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict[str, Any], name: str, suffix: str = "_total", **labels: str) -> float:
    total = 0.0
    for s in fams[name].samples:
        if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()):
            total += s.value
    return total


def test_every_documented_metric_is_served_with_its_type_and_counters_move(corpus: Corpus) -> None:
    net, swarm = NetLoop(), MemorySwarm(join_window=0.3, ttl=3.0)
    method = method_config("cocodc", H=8, P=2, tau=2, sends_per_window=4, codec="e3m0", timeout=10)
    peers, ports = [], []
    for i in range(2):
        m = PeerMetrics(method="cocodc", region="eu")
        ports.append(m.serve(0))
        tr = make_trainer(MODEL, TrainerConfig(batch_size=2, total_steps=120), DataConfig(), rank=i, world=2,
                          corpus=corpus)
        cfg = PeerConfig(run_id="m", steps=120, step_seconds=0.03, join_window=0.3, heartbeat=0.2, ttl=3.0,
                         min_step_seconds=0.03, drain_timeout=10)

        async def make(i: int = i) -> Any:
            return swarm.transport(f"p{i}")

        peers.append(make_peer(cfg, method, tr, make, net=net, metrics=m))
    for p in peers:
        p.start()
    threads = [threading.Thread(target=p.run) for p in peers]
    for t in threads:
        t.start()
    time.sleep(1.5)
    early = scrape(ports[0])
    for t in threads:
        t.join(60)
    late = scrape(ports[0])
    net.close()
    for p in peers:
        p.metrics.close()  # type: ignore[union-attr]
    for name, kind in DOCUMENTED.items():
        assert name in late, f"{name} missing"
        assert late[name].type == kind, (name, late[name].type)
    assert value(late, "p2ptrain_inner_steps") == 120 > value(early, "p2ptrain_inner_steps") > 0
    assert value(late, "p2ptrain_tokens") == 120 * 2 * 32
    assert value(late, "p2ptrain_outer_rounds", outcome="complete") > value(early, "p2ptrain_outer_rounds",
                                                                             outcome="complete")
    assert value(late, "p2ptrain_sent_bytes", codec="e3m0") > 0
    # each round's seconds split into forming its group and its all-reduces (bench/utilization.py's table)
    stats = peers[0].runner.stats  # type: ignore[union-attr]
    assert len(stats.seconds) == len(stats.group_seconds) == len(stats.allreduce_seconds) >= 1
    assert all(g >= 0 and x >= 0 and g + x <= s + 1e-6
               for s, g, x in zip(stats.seconds, stats.group_seconds, stats.allreduce_seconds, strict=True))
    assert sum(stats.allreduce_seconds) > 0
    # while both trained (at the end one may have left before the other's last heartbeat)
    assert value(early, "p2ptrain_live_peers", "") == 2
    assert value(late, "p2ptrain_staleness_steps", "_count") > 0
    build = next(s for s in late["p2ptrain_build_info"].samples)
    assert build.labels["method"] == "cocodc" and build.labels["region"] == "eu"
    # low cardinality: no label carries a peer id
    for fam in late.values():
        for s in fam.samples:
            assert not any(v.startswith("p0") or v.startswith("p1") for v in s.labels.values()), s


def test_message_bytes_are_read_from_the_transport_at_each_scrape() -> None:
    counts = {"part": {"sent": 1000, "received": 40}}
    m = PeerMetrics(method="diloco", region="")
    m.watch_traffic(lambda: counts)
    m.watch_traffic(lambda: {"other": {"sent": 1, "received": 1}})  # a second call is ignored: once per registry
    port = m.serve(0)
    try:
        first = scrape(port)
        assert value(first, "p2ptrain_message_bytes", kind="part", direction="sent") == 1000
        assert value(first, "p2ptrain_message_bytes", kind="part", direction="received") == 40
        assert value(first, "p2ptrain_message_bytes", kind="other", direction="sent") == 0
        counts["part"]["sent"] = 5000
        counts["evidence"] = {"sent": 7, "received": 0}
        later = scrape(port)
        assert value(later, "p2ptrain_message_bytes", kind="part", direction="sent") == 5000
        assert value(later, "p2ptrain_message_bytes", kind="evidence", direction="sent") == 7
    finally:
        m.close()
