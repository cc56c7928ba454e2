"""A peer of a staged run: one swarm member per stage group it holds, over one inner loop.

In a run of ``S_run`` stage groups (:mod:`p2ptrain.stages`) every group is its own
swarm namespace. A process that holds groups ``[a, b)`` — all of them for a
one-process peer, its own for a pipeline stage process — runs one
:class:`~p2ptrain.peer.Peer` per group: its own transport and libp2p identity,
announcement, fragments, rounds and outer state for that group's slice of the
model, exactly like any other member of that namespace. (One transport per
namespace rather than one joining several: every namespace keeps its own group
formation, trust state and round keys untouched, and a whole-model peer looks to
namespace k like any stage-k process.) The peers share the process's network loop
and its trainer, through :class:`StageView` (the group's parameters only).

**Pacing.** Stage group 0's namespace is the run's pacing authority: the
driver takes its published ``step_seconds`` (else the ``--step-seconds`` given,
else three measured steps) and gives it to every namespace it joins, so a peer's
groups share one logical clock. The processes of a pipelined peer agree on it
(and on the data stream) through the process group, step in lockstep and stop
after the same step (:class:`~p2ptrain.pipeline.PipelineTrainer`).

Failure: a stage process that dies makes the others' next collective fail (gloo
or nccl error, or the process group's timeout); the launcher then stops them all.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from .algo.methods import DDPConfig, MethodConfig
from .metrics import PeerMetrics
from .net.transport import Transport
from .peer import Peer, PeerConfig, PeerSummary
from .stages import StagePlan, StageRange
from .sync import NetLoop
from .trainer import Trainer

__all__ = ["StageView", "StagedPeer", "data_rank", "require_outer_method"]

log = logging.getLogger(__name__)


class _UnitsView:
    """The units and parameters of some stage groups of a model (what fragments are made from)."""

    def __init__(self, model: Any, units: Sequence[str]) -> None:
        self._units = [(u, names) for u, names in model.units() if u in units]
        missing = set(units) - {u for u, _ in self._units}
        if missing:
            raise ValueError(f"the model has no units {sorted(missing)}")
        names = {n for _, ns in self._units for n in ns}
        self._params = [(n, p) for n, p in model.named_parameters() if n in names]

    def units(self) -> list[tuple[str, list[str]]]:
        return list(self._units)

    def named_parameters(self) -> Any:
        return iter(self._params)


class StageView:
    """One stage group's view of a process's trainer: its parameters, snapshots and counters.

    The outer loop of the group's namespace sees only these parameters. Inner steps are taken by the
    driver on the whole trainer (``step`` here is an error), and so are checkpoints.
    """

    def __init__(self, trainer: Trainer, units: Sequence[str]) -> None:
        self.base = trainer
        self.model = _UnitsView(trainer.model, units)
        self.params = dict(self.model.named_parameters())
        self.device = trainer.device

    @property
    def step_count(self) -> int:
        return self.base.step_count

    @property
    def tokens_seen(self) -> int:
        return self.base.tokens_seen

    def snapshot(self, names: Sequence[str]) -> list[torch.Tensor]:
        return self.base.snapshot(names)

    def apply_outer(self, names: Sequence[str], values: Sequence[torch.Tensor]) -> None:
        self.base.apply_outer(names, values)

    def step(self) -> Any:
        raise RuntimeError("a stage view does not step: the staged driver steps the whole trainer")

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("checkpoints of staged peers are not supported (see p2ptrain.staged)")


def require_outer_method(method: MethodConfig) -> None:
    """Raise ValueError for ``ddp``: a staged run syncs each stage group's fragments in its own namespace."""
    if isinstance(method, DDPConfig):
        raise ValueError("ddp all-reduces whole gradients every step: a staged run (S_run > 1 or a "
                         "pipelined peer) needs an outer-loop method (diloco, streaming, cocodc, ...)")


def data_rank(peer_id: str) -> int:
    """A data-stream rank from a peer's identity: every peer draws its own batches."""
    return int.from_bytes(hashlib.sha1(peer_id.encode()).digest()[:4], "big")


class StagedPeer:
    """Stage groups ``held`` of a run, as one swarm member per group over one inner loop.

    ``transport(group, namespace, more_initial_peers)`` makes the transport factory of one stage group's
    namespace. With a pipeline
    (``held.world > 1``) the trainer must be a :class:`~p2ptrain.pipeline.PipelineTrainer` and every
    stage process of the peer runs its own StagedPeer; they meet in the trainer's collectives.
    """

    def __init__(self, cfg: PeerConfig, method: MethodConfig, trainer: Trainer, plan: StagePlan, held: StageRange,
                 transport: Callable[[int, str, list[str]], Callable[[], Awaitable[Transport]]], *,
                 metrics: PeerMetrics | None = None, seed: int = 0) -> None:
        require_outer_method(method)
        if cfg.checkpoint_dir:
            raise ValueError("checkpoints of staged peers (S_run > 1 or --pipeline-stages > 1) are not supported "
                             "yet: run without --checkpoint-dir/--resume (a late joiner takes θ from the swarm)")
        self.cfg, self.method, self.trainer, self.plan, self.held = cfg, method, trainer, plan, held
        self.pipelined = held.world > 1
        self.net = NetLoop()
        self._stop = threading.Event()
        self.on_status: Callable[[dict[str, Any]], None] | None = None
        self.peers: list[Peer] = []
        for i, g in enumerate(held.groups):
            ns = plan.namespace(cfg.run_id, g)
            view = StageView(trainer, plan.groups[g])
            peer = Peer(replace(cfg, run_id=ns), method, view, transport(g, ns, []), net=self.net,  # type: ignore[arg-type]
                        metrics=metrics if i == 0 else None, seed=seed)
            peer.fixed_pacing = True
            peer.own_steps = False  # (its inner steps are the pipeline's, taken by this driver for every stage)
            peer.announce_extra = {"stage": g, "stages": plan.stages, "pipeline_rank": held.rank,
                                   "pipeline_stages": held.world}
            self.peers.append(peer)
        self._transport = transport
        self.step_seconds: float | None = None
        self.loop_seconds = 0.0

    def request_stop(self) -> None:
        """Leave after the current step (thread-safe; a pipelined peer's stages all stop after the same one)."""
        self._stop.set()

    # ------------------------------------------------------------------ agreement between stage processes
    def _from_rank0(self, value: float) -> float:
        if not self.pipelined:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64, device=getattr(self.trainer, "comm_device", "cpu"))
        dist.broadcast(t, src=0)
        return float(t[0])

    def _object_from_rank0(self, value: Any) -> Any:
        if not self.pipelined:
            return value
        import torch.distributed as dist

        box: list[Any] = [value]
        dist.broadcast_object_list(box, src=0, device=getattr(self.trainer, "comm_device", None))
        return box[0]

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Connect every namespace, agree on the pacing (group 0's) and start every member."""
        # Every namespace transport of this peer (all its processes) bootstraps from the first one of
        # pipeline rank 0, so they form one DHT even when this peer starts the swarm (no initial peers).
        addrs: list[str] = []
        if self.held.rank == 0:
            first = self.peers[0]
            first.connect()
            assert first.transport is not None
            if hasattr(first.transport, "visible_maddrs"):
                addrs = self.net.call(first.transport.visible_maddrs(), 10)
        addrs = self._object_from_rank0(addrs)
        for g, p in zip(self.held.groups, self.peers, strict=True):
            if p.transport is None:
                p.transport_factory = self._transport(g, p.cfg.run_id, list(addrs))
                p.connect()
        found = self.peers[0].published_step_seconds() if self.held.first == 0 else None
        s = self._from_rank0(found or self.cfg.step_seconds or 0.0)
        if s <= 0:  # nobody paces this run yet: measure three real steps (together, in a pipeline)
            t0 = time.perf_counter()
            for _ in range(3):
                self._step()
            s = self._from_rank0(round(max(0.01, (time.perf_counter() - t0) / 3), 3))
        self.step_seconds = s
        for p in self.peers:
            p.step_seconds = s
            p.start()
        # Every stage process of one peer reads the same batches: the stream of pipeline rank 0's identity.
        self.identity = str(self._object_from_rank0(self.peers[0].peer_id))

    def _step(self) -> tuple[Any, bool]:
        stop = self._stop.is_set()
        if self.pipelined:
            st = self.trainer.step(stop=stop)  # type: ignore[call-arg]
            stop = bool(self.trainer.stop_agreed)  # type: ignore[attr-defined]
        else:
            st = self.trainer.step()
        seconds = st.seconds
        if seconds < self.cfg.min_step_seconds:
            time.sleep(self.cfg.min_step_seconds - seconds)
            seconds = self.cfg.min_step_seconds
        for p in self.peers:
            p.record_step(st.loss, st.tokens, seconds)
        return st, stop

    def run(self) -> list[PeerSummary]:
        """Train until ``cfg.steps`` inner steps (or a stop request), then drain every namespace and summarise."""
        t0 = time.perf_counter()
        try:
            if not self.peers[0].started:
                self.start()
            t_loop = time.perf_counter()
            for p in self.peers:
                p.begin_loop(t_loop)
            while self.trainer.step_count < self.cfg.steps:
                st, stop = self._step()
                for p in self.peers:
                    p.after_step()
                if self.on_status is not None:
                    p0 = self.peers[0]
                    st0 = p0.runner.stats if p0.runner else None
                    self.on_status({"step": self.trainer.step_count, "loss": st.loss,
                                    "tokens_per_second": self.trainer.tokens_seen / max(p0.compute, 1e-9),
                                    "rounds": sum(q.runner.stats.complete + q.runner.stats.partial
                                                  for q in self.peers if q.runner),
                                    "failed": sum(q.runner.stats.failed for q in self.peers if q.runner),
                                    "in_flight": sum(len(q.in_flight) for q in self.peers),
                                    "logical_step": p0.last_lstep, "bandwidth": st0.bandwidth if st0 else 0.0})
                if stop:
                    break
            self.loop_seconds = time.perf_counter() - t_loop
            out = []
            for p in self.peers:
                p.loop_seconds = self.loop_seconds
                t_drain = time.perf_counter()
                p.drain()
                p.drain_seconds = time.perf_counter() - t_drain
            for p in self.peers:
                out.append(p.summary(time.perf_counter() - t0))
            return out
        finally:
            self.close()

    def close(self) -> None:
        """Leave every namespace and stop the shared network loop (idempotent)."""
        for p in self.peers:
            try:
                p.close()
            except Exception as e:  # one namespace failing to leave must not keep the others in
                log.warning("event=stage_close_failed stage=%s reason=%s", p.cfg.run_id, e)
        self.net.close()
