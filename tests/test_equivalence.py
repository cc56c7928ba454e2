"""One loop, two clocks: the simulator and a swarm started from the same seed, data and schedule end with the
same θ. Every method runs in the simulator (virtual clock) and on an in-memory swarm of real peers (threads,
``clock="steps"`` so the schedule is the simulator's); streaming and cocodc also on real libp2p peers on
127.0.0.1. Both sides drive the method with :class:`~p2ptrain.driver.OuterDriver` (data parallel:
:class:`~p2ptrain.driver.DDPDriver`); any copy of the loop that drifts shows up as a θ that differs.

fp32 on the wire must give bitwise equal θ; a lossy codec too on the in-memory swarm, whose members sum in the
simulator's order. On libp2p the parts' owners are ordered by random peer ids, so only fp32 is exact there.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from p2ptrain.algo.methods import MethodConfig, method_config
from p2ptrain.data import Corpus, DataConfig
from p2ptrain.net.memory import MemorySwarm
from p2ptrain.sim.runner import OuterRun, RunSpec, SimConfig, Simulator
from p2ptrain.trainer import TrainerConfig

from .net.peers import MODEL, Spec, libp2p_transports, memory_transports, run_peers

PEERS = 2
STEPS = 24  # three windows of H = 8

CASES: list[tuple[str, dict[str, Any]]] = [
    ("ddp", {"codec": "fp32"}),
    ("diloco", {"H": 8, "codec": "fp32"}),
    ("streaming", {"H": 8, "P": 2, "tau": 2, "codec": "fp32"}),
    ("streaming", {"H": 8, "P": 2, "tau": 2, "codec": "e3m0"}),
    ("eager", {"H": 8, "codec": "fp32"}),
    ("eager", {"H": 8, "codec": "fp32", "variant": "naive", "overlap_rounds": 2}),
    ("cocodc", {"H": 8, "P": 2, "tau": 2, "sends_per_window": 4, "late": "stall", "codec": "fp32"}),
    ("dilocox", {"H": 8, "rank": 2, "codec": "uint8"}),
]


def _method(name: str, knobs: dict[str, Any]) -> MethodConfig:
    return method_config(name, timeout=20, **knobs)


def _simulated(method: MethodConfig, corpus: Corpus) -> list[dict[str, torch.Tensor]]:
    """θ of every virtual peer after the run (the peers' parameters for ddp)."""
    sim = Simulator(SimConfig(peers=PEERS, steps=STEPS, step_time=0.1, bandwidth="10gbit", eval_every=10**6), MODEL,
                    TrainerConfig(batch_size=2, warmup_steps=2, total_steps=STEPS), DataConfig(), corpus)
    r = sim.runner(RunSpec(method.name, method))
    r.run()
    if isinstance(r, OuterRun):
        return [dict(o.outer_params()) for o in r.outers]
    return [{n: p.detach().float().clone() for n, p in tr.params.items()} for tr in r.trainers]


def _swarm(method: MethodConfig, corpus: Corpus, transports: Any, *, shared_loop: bool) -> list[dict[str, torch.Tensor]]:
    run = run_peers(method, [Spec(steps=STEPS)] * PEERS, corpus, transports, step_seconds=0.05, join_window=10.0,
                    timeout=240, shared_loop=shared_loop, clock="steps", warmup=2.0, sync_on_join=False)
    assert not run.errors, run.errors
    assert all(r is not None and r.rounds_failed == 0 and r.repairs == 0 for r in run.results), [
        (r.rounds_complete, r.rounds_partial, r.rounds_failed, r.repairs) for r in run.results if r is not None]
    return [r.outer_params for r in run.results if r is not None]


def _assert_same(sim: list[dict[str, torch.Tensor]], swarm: list[dict[str, torch.Tensor]]) -> None:
    assert len(sim) == len(swarm) == PEERS
    for i, (a, b) in enumerate(zip(sim, swarm, strict=True)):
        assert a.keys() == b.keys()
        for n in a:
            assert torch.equal(a[n], b[n].to(a[n].dtype)), (i, n, float((a[n] - b[n]).abs().max()))


@pytest.mark.slow
@pytest.mark.parametrize(("name", "knobs"), CASES, ids=[f"{n}-{k['codec']}" + ("-naive" if k.get("variant") else "")
                                                      for n, k in CASES])
def test_simulator_and_memory_swarm_end_with_the_same_theta(name: str, knobs: dict[str, Any], corpus: Corpus) -> None:
    method = _method(name, knobs)
    sim = _simulated(method, corpus)
    swarm = _swarm(method, corpus, memory_transports(MemorySwarm(join_window=10.0, ttl=4.0)), shared_loop=True)
    _assert_same(sim, swarm)


@pytest.mark.net
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "knobs"), [c for c in CASES if c[0] in ("streaming", "cocodc") and
                                             c[1]["codec"] == "fp32"], ids=["streaming", "cocodc"])
def test_simulator_and_libp2p_swarm_end_with_the_same_theta(name: str, knobs: dict[str, Any], corpus: Corpus) -> None:
    method = _method(name, knobs)
    sim = _simulated(method, corpus)
    swarm = _swarm(method, corpus, libp2p_transports(f"eq-{name}", join_window=10.0), shared_loop=False)
    _assert_same(sim, swarm)
