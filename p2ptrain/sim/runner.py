"""The WAN simulator: M virtual peers in one process, real inner steps, a virtual clock.

Every peer has its own data stream, model replica, inner AdamW and outer loop,
driven by the same :class:`~p2ptrain.driver.OuterDriver` (or
:class:`~p2ptrain.driver.DDPDriver`) a swarm peer runs, over a virtual-clock
collective (:mod:`p2ptrain.sim.collective`). An inner step costs ``step_time``
virtual seconds (or its measured wall time); an all-reduce phase costs what
:class:`~p2ptrain.sim.network.Network` says, starts when every member has sent
and every member's link is free, and a peer that needs a result before it has
arrived stalls until it does (the stall is accounted). Peers advance in
lockstep, one inner step at a time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..algo.configs import DDPConfig, MethodConfig
from ..algo.fragments import Fragment, make_fragments, model_units
from ..algo.outer_loop import OuterLoop
from ..collective.butterfly import ring_factor
from ..collective.codecs import get_codec
from ..data import Corpus, DataConfig
from ..driver import DDPDriver, DriverHooks, OuterDriver
from ..model import ModelConfig
from ..trainer import TrainerConfig, make_trainer
from .collective import VirtualSwarm
from .network import Network, Region, parse_bandwidth, parse_regions

__all__ = ["OuterRun", "RunResult", "RunSpec", "SimConfig", "SimPeer", "Simulator", "replay_utilization"]


@dataclass(kw_only=True)
class SimConfig:
    """The simulated swarm.

    Attributes:
        peers: M, number of virtual peers (ignored when ``regions`` is given: their sum).
        steps: inner steps per peer.
        step_time: virtual seconds per inner step; None uses each step's measured wall time.
        regions: ``"us:2:1gbit,eu:2:100mbit"``; None puts all peers in one region at ``bandwidth``.
        bandwidth: per-peer link bandwidth when ``regions`` is None (e.g. ``1gbit``).
        rtt: round-trip time between regions, seconds.
        intra_latency: one-way latency inside a region, seconds.
        eval_every: inner steps between evaluations of θ.
        target_loss: validation loss whose first crossing is reported (steps and time).
    """

    peers: int = 4
    steps: int = 300
    step_time: float | None = 0.1
    regions: str | None = None
    bandwidth: str = "1gbit"
    rtt: float = 0.0
    intra_latency: float = 0.0005
    eval_every: int = 25
    target_loss: float | None = None

    def __post_init__(self) -> None:
        if self.steps < 1 or self.eval_every < 1:
            raise ValueError("simulate: steps and eval_every must be at least 1")
        if self.step_time is not None and self.step_time <= 0:
            raise ValueError("simulate: step_time must be positive")
        if self.rtt < 0 or self.intra_latency < 0:
            raise ValueError("simulate: latencies must be >= 0")
        self.region_list()  # validate early

    def region_list(self) -> list[Region]:
        if self.regions:
            return parse_regions(self.regions)
        if self.peers < 1:
            raise ValueError("simulate: peers must be at least 1")
        return [Region("local", self.peers, parse_bandwidth(self.bandwidth))]

    @property
    def num_peers(self) -> int:
        return sum(r.peers for r in self.region_list())


@dataclass
class RunSpec:
    """One line of a comparison: a label, a method config and how many peers run it."""

    label: str
    method: MethodConfig
    peers: int | None = None  # None: the SimConfig's; 1 for the single-worker baseline


@dataclass
class RunResult:
    label: str
    method: str
    peers: int
    config: dict[str, Any]
    evals: list[tuple[int, float, float]] = field(default_factory=list)  # (step, sim seconds, val loss of θ)
    final_loss: float = math.nan
    # the loss of the peers' mean model at the end (what one last exact round of everything each peer holds and θ
    # lacks would give θ: unsent progress, an error-feedback buffer); NaN for a method without an outer θ
    final_mean_loss: float = math.nan
    bytes_sent_per_peer: float = 0.0
    peak_bytes_per_sync: float = 0.0
    syncs: int = 0
    compute_seconds: float = 0.0
    stall_seconds: float = 0.0
    sim_seconds: float = 0.0
    wall_seconds: float = 0.0
    steps: int = 0
    max_delay: int = 0
    mean_correction: float = 0.0
    # (send step, due step, may apply late, encoded bytes of each phase): enough to replay the
    # network at another bandwidth without training again (see :func:`replay_utilization`).
    trace: list[tuple[int, int, bool, list[int]]] = field(default_factory=list)

    @property
    def utilization(self) -> float:
        return self.compute_seconds / self.sim_seconds if self.sim_seconds > 0 else 1.0

    def to_target(self, target: float | None) -> tuple[float | None, float | None]:
        """(step, sim seconds) where the validation curve first crosses ``target``, linearly
        interpolated between the two evaluations around the crossing; (None, None) if never."""
        if target is None:
            return None, None
        prev = None
        for step, t, loss in self.evals:
            if loss <= target:
                if prev is None or prev[2] == loss:
                    return float(step), t
                f = (prev[2] - target) / (prev[2] - loss)
                return prev[0] + f * (step - prev[0]), prev[1] + f * (t - prev[1])
            prev = (step, t, loss)
        return None, None

    def to_dict(self, target: float | None = None) -> dict[str, Any]:
        s, t = self.to_target(target)
        return {
            "label": self.label, "method": self.method, "peers": self.peers, "config": self.config,
            "final_val_loss": self.final_loss, "final_mean_val_loss": self.final_mean_loss, "steps": self.steps, "evals": self.evals,
            "bytes_sent_per_peer": self.bytes_sent_per_peer, "peak_bytes_per_sync": self.peak_bytes_per_sync,
            "syncs": self.syncs, "compute_utilization": self.utilization, "stall_seconds": self.stall_seconds,
            "sim_seconds": self.sim_seconds, "wall_seconds": self.wall_seconds, "max_delay_steps": self.max_delay,
            "mean_taylor_correction_norm": self.mean_correction,
            "target_loss": target, "steps_to_target": s, "sim_seconds_to_target": t,
        }


class Simulator:
    """Runs :class:`RunSpec` s on one shared corpus with identical seeds and data."""

    def __init__(self, sim: SimConfig, model: ModelConfig, trainer: TrainerConfig, data: DataConfig,
                 corpus: Corpus) -> None:
        self.sim, self.model_cfg, self.trainer_cfg, self.data_cfg, self.corpus = sim, model, trainer, data, corpus

    # ------------------------------------------------------------------ set-up
    def _network(self, peers: int) -> Network:
        regions = self.sim.region_list()
        if peers != sum(r.peers for r in regions):
            regions = [Region("local", peers, regions[0].bandwidth)]
        return Network(regions, rtt=self.sim.rtt, intra_latency=self.sim.intra_latency)

    def runner(self, spec: RunSpec, on_step: Callable[[int], None] | None = None) -> OuterRun | DDPRun:
        """The run of ``spec``, built (peers, network, drivers) but not started: ``.run()`` it, then read its
        ``result`` (and every peer's state: ``outers``, ``trainers``)."""
        peers = spec.peers or self.sim.num_peers
        trainers = [make_trainer(self.model_cfg, self.trainer_cfg, self.data_cfg, rank=i, world=peers,
                                 corpus=self.corpus) for i in range(peers)]
        res = RunResult(spec.label, spec.method.name if peers > 1 or not isinstance(spec.method, DDPConfig)
                        else "single", peers, spec.method.to_dict())
        if isinstance(spec.method, DDPConfig):
            return DDPRun(self.sim, spec.method, trainers, self._network(peers), res, on_step)
        frags = make_fragments(model_units(trainers[0].model), spec.method.fragments,
                               spec.method.fragment_mode)  # type: ignore[arg-type]
        return OuterRun(self.sim, spec.method, trainers, self._network(peers), res, on_step, frags)

    def run(self, spec: RunSpec, on_step: Callable[[int], None] | None = None) -> RunResult:
        wall0 = time.perf_counter()
        r = self.runner(spec, on_step)
        r.run()
        r.res.wall_seconds = time.perf_counter() - wall0
        return r.res


class SimPeer(Protocol):
    """What a virtual peer must offer (a :class:`~p2ptrain.trainer.Trainer`, or a test's stand-in)."""

    tokens_seen: int

    def step(self) -> Any: ...  # returns an object with ``.seconds``

    def evaluate(self, params: dict[str, torch.Tensor] | None = None) -> Any: ...  # ``.loss``

    def snapshot(self, names: Sequence[str]) -> list[torch.Tensor]: ...

    def apply_outer(self, names: Sequence[str], values: Sequence[torch.Tensor]) -> None: ...


class _Run:
    """M virtual peers in lockstep: every peer takes an inner step, then every driver advances until all are
    through the step (a driver blocked on the others is polled again once a collective ran)."""

    def __init__(self, sim: SimConfig, cfg: MethodConfig, trainers: Sequence[Any], net: Network, res: RunResult,
                 on_step: Callable[[int], None] | None, *, late_ok: bool = False) -> None:
        self.sim, self.cfg, self.trainers, self.net, self.res, self.on_step = sim, cfg, trainers, net, res, on_step
        self.m = len(trainers)
        self.swarm = VirtualSwarm(self.m, net, get_codec(cfg.codec), step_time=sim.step_time or 0.1, late_ok=late_ok)

    def _all(self, advance: Callable[[int], bool], what: str) -> None:
        """Call ``advance(i)`` for every peer until each returned True (a virtual collective blocks a peer
        until the others have acted)."""
        pending = set(range(self.m))
        for _ in range(10_000):
            events = self.swarm.events
            progressed = False
            for i in sorted(pending):
                if advance(i):
                    pending.discard(i)
                    progressed = True
            progressed |= self.swarm.complete() or self.swarm.events != events
            if not pending:
                return
            if not progressed:
                raise RuntimeError(f"simulator: peers cannot make progress at {what} (schedules disagree)")
        raise RuntimeError(f"simulator: too many passes at {what}")

    def _eval(self, step: int, params: dict[str, torch.Tensor] | None) -> None:
        loss = self.trainers[0].evaluate(params).loss
        self.res.evals.append((step, self.swarm.clock[0], loss))

    def _finish(self) -> None:
        sw, res = self.swarm, self.res
        res.steps = self.sim.steps
        res.compute_seconds = sum(sw.compute) / self.m
        res.stall_seconds = sum(sw.stall) / self.m
        res.sim_seconds = sum(sw.clock) / self.m
        res.bytes_sent_per_peer = sw.acct.bytes_sent_per_peer
        res.peak_bytes_per_sync = sw.acct.peak_bytes_per_sync
        res.syncs = sw.acct.syncs
        res.trace = list(sw.acct.trace)
        res.final_loss = res.evals[-1][2]


class DDPRun(_Run):
    """Gradients all-reduced after every inner step (blocking; no overlap with the backward pass)."""

    def __init__(self, sim: SimConfig, cfg: MethodConfig, trainers: Sequence[Any], net: Network, res: RunResult,
                 on_step: Callable[[int], None] | None) -> None:
        super().__init__(sim, cfg, trainers, net, res, on_step)
        self.drivers = [DDPDriver(tr, self.swarm.view(i)) for i, tr in enumerate(trainers)]

    def _ddp_advance(self, i: int, step: int) -> bool:
        d = self.drivers[i]
        if d.round is None:  # forward/backward and send; the average needs every peer's gradients
            t0 = time.perf_counter()
            done = d.advance(step)
            self.swarm.tick(i, self.sim.step_time if self.sim.step_time is not None else time.perf_counter() - t0)
            return done
        return d.advance(step)

    def run(self) -> None:
        self._eval(0, None)
        for step in range(1, self.sim.steps + 1):
            if self.m == 1:
                st = self.trainers[0].step()
                self.swarm.tick(0, self.sim.step_time if self.sim.step_time is not None else st.seconds)
            else:
                self._all(lambda i, step=step: self._ddp_advance(i, step), f"step {step}")
            if step % self.sim.eval_every == 0 or step == self.sim.steps:
                self._eval(step, None)
            if self.on_step:
                self.on_step(step)
        self._finish()


class OuterRun(_Run):
    """One outer-loop method on M virtual peers (any :class:`SimPeer`), one :class:`OuterDriver` each."""

    def __init__(self, sim: SimConfig, cfg: MethodConfig, peers: Sequence[SimPeer], net: Network, res: RunResult,
                 on_step: Callable[[int], None] | None, frags: Sequence[Fragment],
                 hooks: Sequence[DriverHooks | None] | None = None) -> None:
        self.outers = [OuterLoop(cfg, frags, num_peers=len(peers)) for _ in peers]
        super().__init__(sim, cfg, peers, net, res, on_step, late_ok=self.outers[0].late_ok)
        self.frags = list(frags)
        for o, tr in zip(self.outers, self.trainers, strict=True):
            o.init(tr)
        hooks = list(hooks) if hooks is not None else [None] * len(peers)
        self.drivers = [OuterDriver(o, tr, self.swarm.view(i), hooks=hooks[i], negotiate_at_slot=True)
                        for i, (o, tr) in enumerate(zip(self.outers, self.trainers, strict=True))]

    def _mean_model_loss(self) -> float:
        """Validation loss of the mean of the peers' own models (each fragment's values as the peers train with them)."""
        names = list(self.outers[0].outer_params())
        locals_ = [tr.snapshot(names) for tr in self.trainers]
        mean = {n: torch.stack([vals[j].detach().double() for vals in locals_]).mean(0).to(locals_[0][j].dtype)
                for j, n in enumerate(names)}
        return float(self.trainers[0].evaluate(mean).loss)

    @property
    def history(self) -> list[tuple[int, str, int, int]]:
        """(step, "send"/"apply", peer, fragment) of every peer, each peer's in its own order."""
        return [(s, kind, i, f) for i, d in enumerate(self.drivers) for s, kind, f in d.stats.history]

    def run(self) -> None:
        self._eval(0, self.outers[0].outer_params())
        for step in range(1, self.sim.steps + 1):
            for i, tr in enumerate(self.trainers):
                st = tr.step()
                self.swarm.tick(i, self.sim.step_time if self.sim.step_time is not None else st.seconds)
            self._all(lambda i, step=step: self.drivers[i].advance(step), f"step {step}")
            if step % self.sim.eval_every == 0 and step != self.sim.steps:
                self._eval(step, self.outers[0].outer_params())
            if self.on_step:
                self.on_step(step)
        self._all(lambda i: self.drivers[i].drain(self.sim.steps), "the final drain")
        self._eval(self.sim.steps, self.outers[0].outer_params())
        self.res.final_mean_loss = self._mean_model_loss()
        corrections = [c for d in self.drivers for c in d.stats.corrections]
        self.res.mean_correction = sum(corrections) / len(corrections) if corrections else 0.0
        self.res.max_delay = max(d.stats.max_delay for d in self.drivers)
        if self.outers[0].grid is not None:
            self.res.config["sends_per_window"] = self.outers[0].sends_at(self.sim.steps)
        self._finish()


def replay_utilization(res: RunResult, *, bandwidth: float, step_time: float, latency: float = 0.0) -> float:
    """Compute utilization the run *would* have had at ``bandwidth`` (bits/s per peer), by
    replaying its recorded syncs on one link (all peers alike) without training again.

    Same rules as the run: a phase starts when the link is free, a round must have arrived
    by its due step unless the method may apply it late, DDP's all-reduce blocks its step.
    """
    if res.peers < 2:
        return 1.0
    by_send: dict[int, list[tuple[int, bool, list[int]]]] = {}
    for send, due, late, phases in res.trace:
        by_send.setdefault(send, []).append((due, late, phases))
    rf = ring_factor(res.peers)
    clock = link_free = 0.0
    pending: list[tuple[int, bool, float]] = []  # (due step, late ok, arrival time)
    for step in range(1, res.steps + 1):
        clock += step_time
        for due, late, phases in by_send.get(step, []):
            start = max(clock, link_free)
            end = start + sum(latency + rf * nb * 8.0 / bandwidth for nb in phases)
            link_free = end
            pending.append((due, late, end))
        for item in [p for p in pending if p[0] <= step]:
            due, late, end = item
            if not late:
                clock = max(clock, end)
            if late and end > clock:
                continue  # applied later, when it arrives; the peer does not wait
            pending.remove(item)
    for _, _, end in pending:  # the final drain
        clock = max(clock, end)
    return res.steps * step_time / clock
