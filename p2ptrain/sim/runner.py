"""The WAN simulator: M virtual peers in one process, real inner steps, a virtual clock.

Every peer has its own data stream, model replica, inner AdamW and outer loop
(the same ``p2ptrain.algo`` objects the swarm runs). An inner step costs
``step_time`` virtual seconds (or its measured wall time); an all-reduce phase
costs what :class:`~p2ptrain.sim.network.Network` says, starts when every member
has sent and every member's link is free, and a peer that needs a result before
it has arrived stalls until it does (the stall is accounted). Peers advance in
lockstep, one inner step at a time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..algo.fragments import Fragment, make_fragments, model_units
from ..algo.methods import DDPConfig, MethodConfig, OuterLoop, Round
from ..algo.priority import sends_per_window
from ..collective.butterfly import butterfly_mean, ring_factor
from ..collective.codecs import get_codec
from ..data import Corpus, DataConfig
from ..model import ModelConfig
from ..trainer import TrainerConfig, make_trainer
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
            "final_val_loss": self.final_loss, "steps": self.steps, "evals": self.evals,
            "bytes_sent_per_peer": self.bytes_sent_per_peer, "peak_bytes_per_sync": self.peak_bytes_per_sync,
            "syncs": self.syncs, "compute_utilization": self.utilization, "stall_seconds": self.stall_seconds,
            "sim_seconds": self.sim_seconds, "wall_seconds": self.wall_seconds, "max_delay_steps": self.max_delay,
            "mean_taylor_correction_norm": self.mean_correction,
            "target_loss": target, "steps_to_target": s, "sim_seconds_to_target": t,
        }


def _mean(payloads: Sequence[Sequence[torch.Tensor]], weights: Sequence[float], codec: Any) -> tuple[list[torch.Tensor], int]:
    """The peers' weighted mean as a butterfly all-reduce delivers it (shapes of the first peer's tensors),
    and the encoded size of one peer's vector in bytes (what a ring moves ``2(M−1)/M`` times)."""
    flats = [torch.cat([t.reshape(-1).float().cpu() for t in ts]) for ts in payloads]
    out = butterfly_mean(flats, weights, codec)
    pieces, offset = [], 0
    for t in payloads[0]:
        pieces.append(out[offset : offset + t.numel()].view(t.shape).to(t.device))
        offset += t.numel()
    return pieces, codec.encoded_size(out.numel())


class _Collective:
    """One fragment round across all peers: every member's Round, then the phases' timing."""

    def __init__(self) -> None:
        self.rounds: dict[int, Round] = {}
        self.ready = 0.0


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

    def run(self, spec: RunSpec, on_step: Callable[[int], None] | None = None) -> RunResult:
        peers = spec.peers or self.sim.num_peers
        trainers = [make_trainer(self.model_cfg, self.trainer_cfg, self.data_cfg, rank=i, world=peers,
                                 corpus=self.corpus) for i in range(peers)]
        res = RunResult(spec.label, spec.method.name if peers > 1 or not isinstance(spec.method, DDPConfig)
                        else "single", peers, spec.method.to_dict())
        wall0 = time.perf_counter()
        if isinstance(spec.method, DDPConfig):
            _DDPRun(self.sim, spec.method, trainers, self._network(peers), res, on_step).run()
        else:
            frags = make_fragments(model_units(trainers[0].model), spec.method.fragments,
                                   spec.method.fragment_mode)  # type: ignore[arg-type]
            OuterRun(self.sim, spec.method, trainers, self._network(peers), res, on_step, frags).run()
        res.wall_seconds = time.perf_counter() - wall0
        return res


class SimPeer(Protocol):
    """What a virtual peer must offer (a :class:`~p2ptrain.trainer.Trainer`, or a test's stand-in)."""

    tokens_seen: int

    def step(self) -> Any: ...  # returns an object with ``.seconds``

    def evaluate(self, params: dict[str, torch.Tensor] | None = None) -> Any: ...  # ``.loss``

    def snapshot(self, names: Sequence[str]) -> list[torch.Tensor]: ...

    def apply_outer(self, names: Sequence[str], values: Sequence[torch.Tensor]) -> None: ...


class _Base:
    def __init__(self, sim: SimConfig, cfg: MethodConfig, trainers: Sequence[Any], net: Network,
                 res: RunResult, on_step: Callable[[int], None] | None) -> None:
        self.sim, self.cfg, self.trainers, self.net, self.res, self.on_step = sim, cfg, trainers, net, res, on_step
        self.codec = get_codec(cfg.codec)
        self.m = len(trainers)
        self.clock = [0.0] * self.m
        self.compute = [0.0] * self.m
        self.stall = [0.0] * self.m

    def _inner_step(self, i: int) -> None:
        st = self.trainers[i].step()
        dt = self.sim.step_time if self.sim.step_time is not None else st.seconds
        self.clock[i] += dt
        self.compute[i] += dt

    def _eval(self, step: int, params: dict[str, torch.Tensor] | None) -> None:
        loss = self.trainers[0].evaluate(params).loss
        self.res.evals.append((step, self.clock[0], loss))

    def _finish(self) -> None:
        self.res.steps = self.sim.steps
        self.res.compute_seconds = sum(self.compute) / self.m
        self.res.stall_seconds = sum(self.stall) / self.m
        self.res.sim_seconds = sum(self.clock) / self.m


class _DDPRun(_Base):
    """Gradients all-reduced after every inner step (blocking; no overlap with the backward pass)."""

    def run(self) -> None:
        self._eval(0, None)
        members = list(range(self.m))
        for step in range(1, self.sim.steps + 1):
            for i, tr in enumerate(self.trainers):
                t0 = time.perf_counter()
                tr.model.train()
                _, tokens = tr.forward_backward()
                tr.tokens_seen += tokens
                dt = self.sim.step_time if self.sim.step_time is not None else time.perf_counter() - t0
                self.clock[i] += dt
                self.compute[i] += dt
            if self.m > 1:
                grads = [list(tr.gradients()) for tr in self.trainers]
                avg, nbytes = _mean(grads, [1.0] * self.m, self.codec)
                for tr in self.trainers:
                    for g, a in zip(tr.gradients(), avg, strict=True):
                        g.copy_(a)
                end = self.net.transfer(members, nbytes, max(self.clock))
                for i in range(self.m):
                    self.stall[i] += end - self.clock[i]
                    self.clock[i] = end
                per_peer = ring_factor(self.m) * nbytes
                self.res.trace.append((step, step, False, [nbytes]))
                self.res.bytes_sent_per_peer += per_peer
                self.res.peak_bytes_per_sync = max(self.res.peak_bytes_per_sync, per_peer)
                self.res.syncs += 1
            for tr in self.trainers:
                tr.optimizer_step()
            if step % self.sim.eval_every == 0 or step == self.sim.steps:
                self._eval(step, None)
            if self.on_step:
                self.on_step(step)
        self.res.final_loss = self.res.evals[-1][2]
        self._finish()


class OuterRun(_Base):
    """One outer-loop method on M virtual peers (any :class:`SimPeer`), on the virtual clock."""

    def __init__(self, sim: SimConfig, cfg: MethodConfig, peers: Sequence[SimPeer], net: Network, res: RunResult,
                 on_step: Callable[[int], None] | None, frags: Sequence[Fragment]) -> None:
        super().__init__(sim, cfg, peers, net, res, on_step)
        self.frags = list(frags)
        self.outers = [OuterLoop(self.cfg, frags, num_peers=self.m) for _ in range(self.m)]
        self.history: list[tuple[int, str, int, int]] = []  # (step, "send"/"apply", peer, fragment)
        for o, tr in zip(self.outers, self.trainers, strict=True):
            o.init(tr)
        if getattr(self.cfg, "sends_per_window", 1) is None:
            # CoCoDC: N from the (here: configured) bandwidth and step time.
            frag_bytes = max(self.codec.encoded_size(f.numel) for f in frags) * ring_factor(self.m)
            bw = min(self.net.bandwidth) / 8.0
            n = sends_per_window(H=self.cfg.H, P=len(frags), step_time=self.sim.step_time or 0.1,
                                 fragment_bytes=frag_bytes, bandwidth=bw, latency=self.net.latency(range(self.m)))
            for o in self.outers:
                o.set_sends_per_window(n)
            self.res.config["sends_per_window"] = n
        self.in_flight: list[list[Round]] = [[] for _ in range(self.m)]
        self.arrival: dict[Round, float] = {}
        self.collectives: dict[tuple[int, int], _Collective] = {}
        self.tokens_at_send = [[0] * len(frags) for _ in range(self.m)]
        self.corrections: list[float] = []

    def run(self) -> None:
        self._eval(0, self.outers[0].outer_params())
        for step in range(1, self.sim.steps + 1):
            for i in range(self.m):
                self._inner_step(i)
            self._outer(step)
            if step % self.sim.eval_every == 0 and step != self.sim.steps:
                self._eval(step, self.outers[0].outer_params())
            if self.on_step:
                self.on_step(step)
        self._drain()
        self._eval(self.sim.steps, self.outers[0].outer_params())
        self.res.final_loss = self.res.evals[-1][2]
        self.res.mean_correction = sum(self.corrections) / len(self.corrections) if self.corrections else 0.0
        self._finish()

    def _arrived(self, i: int) -> Callable[[Round], bool]:
        return lambda r: r in self.arrival and self.arrival[r] <= self.clock[i]

    def _outer(self, step: int) -> None:
        scores = None
        if self.outers[0].needs_scores(step):
            per_peer = [o.drift_scores(tr, step) for o, tr in zip(self.outers, self.trainers, strict=True)]
            scores = [sum(col) for col in zip(*per_peer, strict=True)]
        pending = set(range(self.m))
        for _ in range(10_000):
            if not pending:
                return
            progressed = False
            for i in sorted(pending):
                plan = self.outers[i].plan(step, self.in_flight[i], scores, is_arrived=self._arrived(i))
                if plan.wait:
                    if all(r in self.arrival for r in plan.wait):
                        t = max(self.arrival[r] for r in plan.wait)
                        self.stall[i] += max(0.0, t - self.clock[i])
                        self.clock[i] = max(self.clock[i], t)
                        progressed = True
                    continue
                if not plan.actions:
                    pending.discard(i)
                    progressed = True
                    continue
                for kind, x in plan.actions:
                    if kind == "send":
                        self._send(i, x, step)
                    else:
                        self._apply(i, x, step)
                progressed = True
            progressed |= self._complete_collectives()
            if not progressed:
                raise RuntimeError(f"simulator: peers cannot make progress at step {step} (schedules disagree)")
        raise RuntimeError("simulator: too many planning passes in one step")

    def _send(self, i: int, fragment: int, step: int) -> None:
        tr = self.trainers[i]
        weight = max(1, tr.tokens_seen - self.tokens_at_send[i][fragment])
        self.tokens_at_send[i][fragment] = tr.tokens_seen
        rnd = self.outers[i].start(fragment, step, tr, weight=weight)
        self.history.append((step, "send", i, fragment))
        self.in_flight[i].append(rnd)
        col = self.collectives.setdefault((fragment, rnd.seq), _Collective())
        col.rounds[i] = rnd
        col.ready = max(col.ready, self.clock[i])

    def _apply(self, i: int, rnd: Round, step: int) -> None:
        rep = self.outers[i].finish(rnd, step, self.trainers[i])
        self.history.append((step, "apply", i, rnd.fragment))
        self.in_flight[i].remove(rnd)
        self.res.max_delay = max(self.res.max_delay, rep.delay)
        if rep.correction_norm:
            self.corrections.append(rep.correction_norm)

    def _complete_collectives(self) -> bool:
        done = [k for k, c in self.collectives.items() if len(c.rounds) == self.m]
        members = list(range(self.m))
        for key in done:
            col = self.collectives.pop(key)
            rounds = [col.rounds[i] for i in members]
            weights = [r.weight for r in rounds]
            ready, sent, phase_bytes = col.ready, 0.0, []
            while rounds[0].payload is not None:
                avg, nbytes = _mean([r.payload for r in rounds], weights, self.codec)  # type: ignore[misc]
                phase_bytes.append(nbytes)
                ready = self.net.transfer(members, nbytes, ready)
                sent += ring_factor(self.m) * nbytes
                for r in rounds:
                    r.receive([a.clone() for a in avg], total_weight=sum(weights), members=self.m)
            for r in rounds:
                self.arrival[r] = ready
            self.res.trace.append((rounds[0].send_step, rounds[0].due, self.outers[0].late_ok, phase_bytes))
            self.res.bytes_sent_per_peer += sent
            self.res.peak_bytes_per_sync = max(self.res.peak_bytes_per_sync, sent)
            self.res.syncs += 1
        return bool(done)

    def _drain(self) -> None:
        """Apply every round still in flight at the end, waiting for it (so θ holds all the work)."""
        self._complete_collectives()
        for i in range(self.m):
            for rnd in sorted(self.in_flight[i], key=lambda r: (r.send_step, r.fragment)):
                t = self.arrival[rnd]
                self.stall[i] += max(0.0, t - self.clock[i])
                self.clock[i] = max(self.clock[i], t)
                self._apply(i, rnd, self.sim.steps)


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
