"""Helpers that run several real peers (threads in this process) on a chosen transport."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from p2ptrain.algo.methods import MethodConfig
from p2ptrain.data import Corpus, DataConfig
from p2ptrain.model import ModelConfig
from p2ptrain.net.memory import MemorySwarm
from p2ptrain.net.transport import Transport
from p2ptrain.peer import PeerConfig, PeerSummary, make_peer
from p2ptrain.sync import NetLoop
from p2ptrain.trainer import TrainerConfig, make_trainer

MODEL = ModelConfig(d_model=32, n_layers=3, n_heads=2, seq_len=32)


@dataclass
class Spec:
    """One peer of a test swarm."""

    steps: int = 40
    delay: float = 0.0  # seconds to sleep after every inner step (a slower machine)
    start_after: float = 0.0  # seconds after the first peer started
    start_when: Callable[[SwarmRun], bool] | None = None  # and once this holds of the run (polled; within its timeout)
    run: bool = True
    region: str = ""  # the region the peer announces


@dataclass
class SwarmRun:
    results: list[PeerSummary | None]
    peers: list[Any]
    errors: list[BaseException] = field(default_factory=list)
    step_rates: list[float] = field(default_factory=list)
    #: seconds each peer's loop spent outside its inner steps (the step's compute and its ``delay`` are inside),
    #: per inner step: the time the outer loop took from training (waits, merges, applies)
    waits: list[float] = field(default_factory=list)


def memory_transports(swarm: MemorySwarm | None = None) -> Callable[[int, list[str]], Callable[[], Any]]:
    swarm = swarm or MemorySwarm(join_window=0.5, ttl=3.0)

    def make(i: int, initial: list[str]) -> Callable[[], Any]:
        async def create() -> Transport:
            return swarm.transport(f"peer{i}")

        return create

    return make


def libp2p_transports(run_id: str, join_window: float = 0.5) -> Callable[[int, list[str]], Callable[[], Any]]:
    from p2ptrain.net.swarm import HivemindTransport, SwarmConfig

    def make(i: int, initial: list[str]) -> Callable[[], Any]:
        cfg = SwarmConfig(run_id=run_id, initial_peers=initial, join_window=join_window, ttl=4.0,
                          recontact_every=2.0)
        return lambda: HivemindTransport.create(cfg)

    return make


def run_peers(method: MethodConfig, specs: list[Spec], corpus: Corpus,
              transports: Callable[[int, list[str]], Callable[[], Any]], *, step_seconds: float = 0.03,
              join_window: float = 0.5, shared_loop: bool = False, timeout: float = 120.0,
              keep_applied: bool = False, started: Callable[[SwarmRun], Any] | None = None,
              **overrides: Any) -> SwarmRun:
    """Start the peers in order (the first creates the run), run them concurrently, collect summaries.
    ``overrides``: more PeerConfig fields (e.g. ``clock="steps"``)."""
    shared = NetLoop() if shared_loop else None
    n = len(specs)
    out = SwarmRun([None] * n, [])
    busy = [0.0] * n
    initial: list[str] = []
    for i, spec in enumerate(specs):
        tr = make_trainer(MODEL, TrainerConfig(batch_size=2, warmup_steps=2, total_steps=spec.steps), DataConfig(),
                          rank=i, world=n, corpus=corpus)
        inner = tr.step

        def timed(inner: Any = inner, extra: float = spec.delay, i: int = i) -> Any:
            t = time.perf_counter()
            st = inner()
            if extra:
                time.sleep(extra)
            busy[i] += time.perf_counter() - t
            return st

        tr.step = timed  # type: ignore[method-assign]
        cfg = PeerConfig(**{"run_id": "t", "steps": spec.steps, "step_seconds": step_seconds,
                            "join_window": join_window, "join_timeout": 10, "heartbeat": 0.3, "ttl": 4.0,
                            "drain_timeout": 15, "region": spec.region, **overrides})
        peer = make_peer(cfg, method, tr, transports(i, list(initial)), net=shared)
        if keep_applied:
            peer.keep_applied = True  # type: ignore[attr-defined]
        out.peers.append(peer)
    t0 = time.monotonic()
    rates = [0.0] * n

    def go(i: int) -> None:
        spec, peer = specs[i], out.peers[i]
        try:
            delay = spec.start_after - (time.monotonic() - t0)
            if delay > 0:
                time.sleep(delay)
            while spec.start_when is not None and not spec.start_when(out) and time.monotonic() < t0 + timeout:
                time.sleep(0.05)
            if peer.transport is None:
                peer.start()
            out.results[i] = peer.run()
            rates[i] = peer.trainer.step_count / max(peer.loop_seconds, 1e-9)
        except BaseException as e:
            out.errors.append(e)
            peer.close()

    first = out.peers[0]
    first.start()
    if hasattr(first.transport, "visible_maddrs"):
        initial.extend(first.net.call(first.transport.visible_maddrs(), 10))  # type: ignore[union-attr]
        for i in range(1, n):
            out.peers[i].transport_factory = transports(i, list(initial))
    if started is not None:
        started(out)  # the peers exist (the first has started): a test may reach into them from now on
    threads = [threading.Thread(target=go, args=(i,), daemon=True) for i in range(n) if specs[i].run]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):  # never leave a peer running behind a test
        for p in out.peers:
            p.request_stop()
        for t in threads:
            t.join(60)
        out.errors.append(TimeoutError(f"peers still running after {timeout:.0f} s"))
    if shared is not None:
        shared.close()
    out.step_rates = rates
    out.waits = [(p.loop_seconds - b) / max(p.trainer.step_count, 1) for p, b in zip(out.peers, busy, strict=True)]
    return out


def applied_agree(results: list[PeerSummary | None], min_common: int = 2, peers: list[Any] | None = None) -> set[str]:
    """The round keys every peer applied; asserts θ^(p) is bitwise equal on all of them after each. ``peers``
    (the run's): a disagreement also says what each peer's replica went through on that fragment up to it."""
    done = [r for r in results if r is not None]
    common = set.intersection(*(set(r.applied) for r in done))
    assert len(common) >= min_common, [sorted(r.applied) for r in done]
    for key in sorted(common, key=_round_order):
        digests = [r.applied[key][0][:12] for r in done]
        assert len(set(digests)) == 1, f"θ differs after round {key}: {digests}{_story(peers, key)}"
    return common


def _round_order(key: str) -> tuple[int, str]:
    """Round keys (``f1.L12``) by their step, then as text."""
    step = key.rpartition(".L")[2]
    return (int(step), key) if step.isdigit() else (-1, key)


def _story(peers: list[Any] | None, key: str) -> str:
    """Each peer's rounds of ``key``'s fragment up to it: (key, last 4 characters of each contributor, repaired),
    and its repairs."""
    if not peers:
        return ""
    frag = key.partition(".")[0]
    lines = []
    for p in peers:
        replica = getattr(p, "replica", None)
        if replica is None:
            continue
        mine = [h for h in replica.history if h[0].partition(".")[0] == frag and _round_order(h[0]) <= _round_order(key)]
        lines.append(f"  {p.peer_id[-6:]}: repairs={replica.repairs} {mine[-4:]}")
    return "\n" + "\n".join(lines)


async def announce_and_wait(transports: list[Any], n: int, tries: int = 100) -> None:
    """Announce every transport and wait (``tries`` × 0.1 s) until each sees ``n`` live peers."""
    import asyncio

    from p2ptrain.net.transport import PeerInfo

    for t in transports:
        await t.announce(PeerInfo(peer_id=t.peer_id))
    for _ in range(tries):
        if all([len(await t.peers()) == n for t in transports]):
            return
        await asyncio.sleep(0.1)
    raise AssertionError("peers did not see each other")
