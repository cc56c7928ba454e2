"""A peer of another model is refused with one clear reason before it trains (it used to train, take a
state that did not fit, and crash with IndexError on the next source); a measured pacing is bounded, and peers
that start together agree on it."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from p2ptrain.algo.methods import method_config
from p2ptrain.data import Corpus, DataConfig
from p2ptrain.model import ModelConfig
from p2ptrain.net.memory import MemorySwarm
from p2ptrain.peer import PeerConfig, make_peer
from p2ptrain.peer.vitals import PACING_MAX_SECONDS, JoinRefused, measured_pacing, model_fingerprint
from p2ptrain.trainer import TrainerConfig, make_trainer

from .peers import MODEL, memory_transports

OTHER = ModelConfig(d_model=32, n_layers=2, n_heads=2, seq_len=32)  # another preset: one layer fewer


def _peer(model: ModelConfig, i: int, corpus: Corpus, transports: object,
          step_seconds: float | None = 0.05, **more: object) -> object:
    steps = int(more.pop("steps", 4))  # type: ignore[call-overload]
    tr = make_trainer(model, TrainerConfig(batch_size=2, total_steps=steps), DataConfig(), corpus=corpus)
    cfg = PeerConfig(run_id="t", steps=steps, step_seconds=step_seconds, join_window=0.3, join_timeout=5,
                     heartbeat=0.2, ttl=3.0, **more)  # type: ignore[arg-type]
    return make_peer(cfg, method_config("streaming", H=4, P=2, codec="fp32", timeout=5), tr,
                     transports(i, []))  # type: ignore[operator]


def test_a_peer_of_another_model_is_refused_before_it_trains(corpus: Corpus) -> None:
    transports = memory_transports(MemorySwarm(join_window=0.3, ttl=3.0))
    first, other, same = (_peer(m, i, corpus, transports) for i, m in enumerate((MODEL, OTHER, MODEL)))
    try:
        first.start()  # type: ignore[attr-defined]
        with pytest.raises(JoinRefused, match=r"trains another model .* announced by 1 peer") as e:
            other.start()  # type: ignore[attr-defined]
        assert model_fingerprint(first.trainer.model) in str(e.value)  # type: ignore[attr-defined]
        assert other.trainer.step_count == 0  # type: ignore[attr-defined]  # refused before any inner step
        same.start()  # type: ignore[attr-defined]  # the same model joins as before
        assert same.synced_from == first.peer_id  # type: ignore[attr-defined]
    finally:
        for p in (first, other, same):
            p.close()  # type: ignore[attr-defined]



def test_the_measured_pacing_leaves_out_the_first_step_and_is_bounded() -> None:
    assert measured_pacing([5.0, 0.2, 0.3, 0.25]) == (0.25, "")  # the compiling first step is left out
    assert measured_pacing([0.2, 0.2, 9.0, 0.2]) == (0.2, "")  # one busy moment does not count
    seconds, warning = measured_pacing([30.0, 28.0, 27.0, 29.0])
    assert seconds == 28.0 and "--step-seconds" in warning  # slow: kept, but said
    seconds, warning = measured_pacing([300.0, 280.0, 290.0, 295.0])
    assert seconds == PACING_MAX_SECONDS and "clamped" in warning
    assert measured_pacing([0.0001, 0.0001]) == (0.01, "")


def test_peers_started_at_the_same_moment_end_on_one_pacing(corpus: Corpus) -> None:
    """Both find nothing published, both measure (different step times) and publish: they used to keep their
    own, so they never met in a round. Each now looks again a heartbeat later and takes the first published."""
    for attempt in range(3):
        transports = memory_transports(MemorySwarm(join_window=0.3, ttl=3.0))
        peers = [_peer(MODEL, i, corpus, transports, step_seconds=None) for i in range(2)]
        for p, seconds in zip(peers, (0.05, 0.08), strict=True):
            def measure(seconds: float = seconds) -> float:
                time.sleep(0.2)  # both measure at once: neither sees the other's value before publishing
                return seconds

            p._measure_pacing = measure  # type: ignore[attr-defined]
        threads = [threading.Thread(target=p.start) for p in peers]  # type: ignore[attr-defined]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            paces = [p.step_seconds for p in peers]  # type: ignore[attr-defined]
            assert paces[0] == paces[1] and paces[0] in (0.05, 0.08), (attempt, paces)
        finally:
            for p in peers:
                p.close()  # type: ignore[attr-defined]


def test_a_peer_that_shares_nothing_says_so(corpus: Corpus, caplog: pytest.LogCaptureFixture) -> None:
    """Alone in its swarm (rounds of one member), it counts no shared round and, once the silence is longer
    than every fragment syncing twice (here: at once), says so in its status, its log and its summary."""
    transports = memory_transports(MemorySwarm(join_window=0.1, ttl=3.0))
    peer = _peer(MODEL, 0, corpus, transports, steps=16, clock="steps")
    statuses: list[dict] = []
    peer.on_status = statuses.append  # type: ignore[attr-defined]
    peer.sharing_nothing = lambda: 99.0 if peer.runner.stats.shared == 0 else 0.0  # type: ignore[attr-defined]
    try:
        with caplog.at_level("INFO", logger="p2ptrain.peer.vitals"):
            summary = peer.run()  # type: ignore[attr-defined]
    finally:
        peer.close()  # type: ignore[attr-defined]
    assert summary.rounds_complete + summary.rounds_partial > 0 and summary.rounds_shared == 0
    assert statuses and all(s["sharing_nothing"] == 99.0 for s in statuses)
    assert "event=sharing_nothing seconds=99 live_peers=1" in caplog.text


def test_the_sharing_watch_counts_from_the_loop_start_and_says_it_as_the_silence_doubles(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from types import SimpleNamespace

    from p2ptrain.peer import vitals

    now = [1000.0]
    monkeypatch.setattr(vitals.time, "monotonic", lambda: now[0])
    watch, stats = vitals.SharingWatch(), SimpleNamespace(complete=3, partial=0, shared=0)
    now[0] += 20
    assert watch.quiet(None, round_seconds=10.0) == 0.0  # under the 30 s floor
    now[0] += 20
    assert watch.quiet(None, round_seconds=10.0) == 40.0  # 40 s since the loop started, nothing shared
    assert watch.quiet(None, round_seconds=60.0) == 0.0  # ... but a round of this method takes longer
    assert watch.quiet(now[0] - 5, round_seconds=10.0) == 0.0  # a round shared 5 s ago
    with caplog.at_level("INFO", logger="p2ptrain.peer.vitals"):
        for quiet in (40.0, 50.0, 79.0, 80.0, 0.0, 35.0):
            watch.say(quiet, live=2, stats=stats)
    said = [r for r in caplog.records if "event=sharing_nothing" in r.getMessage()]
    assert [r.getMessage().split()[1] for r in said] == ["seconds=40", "seconds=80", "seconds=35"]  # then reset
    assert all(r.levelno == logging.WARNING for r in said)  # other peers are live: something keeps them apart
