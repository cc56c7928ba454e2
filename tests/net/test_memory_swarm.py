"""Swarm peers end to end on the in-memory transport: the runtime, not the network."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from p2ptrain.algo.methods import MethodConfig, method_config
from p2ptrain.data import Corpus, DataConfig
from p2ptrain.model import ModelConfig
from p2ptrain.net.memory import MemorySwarm
from p2ptrain.net.transport import Transport
from p2ptrain.peer import Peer, PeerConfig, PeerSummary
from p2ptrain.sync import NetLoop
from p2ptrain.trainer import TrainerConfig, make_trainer

MODEL = ModelConfig(d_model=32, n_layers=3, n_heads=2, seq_len=32)


def _factory(swarm: MemorySwarm, name: str) -> Callable[[], Any]:
    async def make() -> Transport:
        return swarm.transport(name)

    return make


def run_swarm(method: MethodConfig, n: int, corpus: Corpus, *, steps: int = 40, step_seconds: float = 0.03,
              delays: dict[int, float] | None = None, slow: dict[int, float] | None = None,
              join_window: float = 0.5) -> list[PeerSummary]:
    net = NetLoop()
    swarm = MemorySwarm(join_window=join_window, ttl=3.0)
    peers, results, errors = [], [None] * n, []
    for i in range(n):
        tr = make_trainer(MODEL, TrainerConfig(batch_size=2, warmup_steps=2, total_steps=steps), DataConfig(),
                          rank=i, world=n, corpus=corpus)
        if slow and i in slow:
            inner = tr.step

            def slowed(inner: Any = inner, extra: float = slow[i]) -> Any:
                import time

                out = inner()
                time.sleep(extra)
                return out

            tr.step = slowed  # type: ignore[method-assign]
        cfg = PeerConfig(run_id="t", steps=steps, step_seconds=step_seconds, join_window=join_window,
                         join_timeout=10, heartbeat=0.3, ttl=3.0, drain_timeout=10)
        peers.append(Peer(cfg, method, tr, _factory(swarm, f"peer{i}"), net=net))

    def go(i: int) -> None:
        try:
            results[i] = peers[i].run()
        except BaseException as e:
            errors.append(e)

    for p in peers:  # start in order: peer0 creates the run, the others join it
        p.start()
    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    net.close()
    assert not errors, errors
    return results  # type: ignore[return-value]


@pytest.mark.parametrize("name,knobs", [
    ("diloco", {"H": 8}),
    ("streaming", {"H": 8, "P": 2, "tau": 2, "codec": "fp32"}),
    ("cocodc", {"H": 8, "P": 2, "tau": 2, "sends_per_window": 4, "codec": "fp32"}),
    ("eager", {"H": 8}),
    ("dilocox", {"H": 8, "rank": 2}),
    ("ddp", {}),
])
def test_methods_run_and_outer_params_agree(name: str, knobs: dict[str, Any], corpus: Corpus) -> None:
    res = run_swarm(method_config(name, **knobs), 3, corpus, steps=30 if name == "ddp" else 48)
    assert all(r.rounds_complete > 0 for r in res), [(r.rounds_complete, r.rounds_failed) for r in res]
    if name == "ddp":  # every peer applies the same averaged gradient to the same parameters
        for r in res[1:]:
            assert all(torch.equal(t, r.outer_params[n_]) for n_, t in res[0].outer_params.items())
    elif name != "eager":  # eager's outer parameters are per peer by design
        common = set.intersection(*(set(r.applied) for r in res))
        assert len(common) >= 2, [sorted(r.applied) for r in res]
        for key in common:  # after every applied round, θ^(p) is bitwise equal on every peer
            assert len({r.applied[key][0] for r in res}) == 1, key
