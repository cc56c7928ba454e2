"""What every kind of swarm peer shares: its life (connect, pace, sync, loop, leave), its services on the
network loop (heartbeat, state service, round runner), its counters and metrics.

The compute thread (the caller of :meth:`PeerBase.run`) takes inner steps and does every mutation of
parameters and outer state, in program order. The network lives on a :class:`~p2ptrain.sync.NetLoop`; the two
meet only through ``NetLoop.submit`` and ``NetLoop.call`` (bounded waits). A peer is a context manager: leaving
the ``with`` block closes it (leave the swarm, stop the services, stop the loop it owns).

**Pacing (heterogeneous peers).** Rounds are paced by time, not by each peer's own step count: the swarm
shares a step duration ``step_seconds`` (published in the DHT by the first peer), and the *logical step* is
``⌊wall time / step_seconds⌋``. Every method's schedule (H, offsets, τ, CoCoDC's slots) runs on logical steps,
so all peers reach a round at the same moment whatever their speed; each contributes what it computed since
its last sync, weighted by its tokens. A peer 3× slower than the rest takes fewer inner steps per round and
never makes the others wait beyond the method's own waiting. (``clock="steps"`` paces by this peer's own
inner steps instead: see :class:`~p2ptrain.peer.config.PeerConfig`.)

Why it is long: it is one state machine (connect, pace, sync, loop, leave) whose steps share the peer's
fields; what can stand alone already does (the link, the replica, the collective, the checks and signals of
:mod:`.vitals`), and the rest would only pass those fields back and forth.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import torch

from ..algo.configs import MethodConfig
from ..collective.codecs import get_codec
from ..metrics import PeerMetrics
from ..net.region import AUTO
from ..net.transport import PeerInfo, Transport
from ..peer_checkpoint import PeerCheckpoints, resumable_digest
from ..sync import NetLoop, RoundRunner
from ..trainer import Trainer
from .collective import SwarmCollective
from .config import PeerConfig, PeerState, PeerSummary
from .link import SwarmLink
from .overlap import while_training
from .startup import StartupClock
from .vitals import SharingWatch, check_model, measured_pacing, model_fingerprint

__all__ = ["PeerBase"]

log = logging.getLogger(__name__)


class PeerBase:
    """The run lifecycle of a swarm peer; :class:`~p2ptrain.peer.outer.Peer` and
    :class:`~p2ptrain.peer.ddp.DDPPeer` add what their kind does at each step."""

    kind: ClassVar[str] = ""
    #: Whether this kind keeps outer state (θ per fragment), i.e. its checkpoints have an ``outer`` part.
    has_outer_loop: ClassVar[bool] = False

    def __init__(self, cfg: PeerConfig, method: MethodConfig, trainer: Trainer,
                 transport: Callable[[], Awaitable[Transport]], *, net: NetLoop | None = None,
                 on_status: Callable[[dict[str, Any]], None] | None = None, seed: int = 0,
                 metrics: PeerMetrics | None = None) -> None:
        self.cfg, self.method, self.trainer = cfg, method, trainer
        self.region = "" if cfg.region == AUTO else cfg.region  # the region announced (``auto``: measured at connect)
        self._own_net = net is None
        self.net = net or NetLoop()
        self.on_status, self.metrics, self.seed = on_status, metrics, seed
        device = getattr(trainer, "device", None)
        # On a GPU the codec quantises there (only the packed payload comes back to the host).
        self.codec = get_codec(method.codec, device if device is not None and device.type == "cuda" else None)
        self.state = PeerState.NEW
        self.link = SwarmLink(cfg, self.net, self.codec, method.timeout, transport)
        self.collective: SwarmCollective | None = None  # the rounds' side of the thread seam, once connected
        self.lock = threading.Lock()  # guards parameters and outer state against the state service (loop thread)
        self.last_lstep = -1
        self.compute = 0.0
        self.catchup_stall = 0.0
        self.outer_seconds = 0.0  # compute-thread time in the outer loop (sends, applies), waits excluded
        self.last_loss = math.nan
        self.loss_log: list[tuple[float, int, float]] = []  # (unix time, inner step, train loss)
        # (unix time, inner step, val loss of θ, eval seconds so far) every ``eval_every`` steps
        self.val_log: list[tuple[float, int, float, float]] = []
        self.eval_seconds = 0.0
        self.loop_seconds = 0.0  # wall time of the inner-step loop (without start-up and the final drain)
        self.drain_seconds = 0.0
        self.loop_started = math.nan  # unix time the inner-step loop started
        self._t_start: float | None = None
        self._stop = threading.Event()
        self._bytes_seen = (0, 0)
        self._warm_until = 0.0
        self.sharing = SharingWatch()  # whether this peer shares rounds with any other, and saying so
        self.checkpoints = (PeerCheckpoints(cfg.checkpoint_dir, cfg.checkpoint_every, cfg.keep_checkpoints,
                                            seconds=cfg.checkpoint_seconds) if cfg.checkpoint_dir else None)
        self.resume_state: dict[str, Any] | None = None  # set by PeerCheckpoints.restore before start()
        self.synced_from: str | None = None  # the peer whose state this one took at start, if any
        # Set by a driver that decides the pacing for several namespaces (p2ptrain.staged): publish
        # step_seconds as given instead of taking this namespace's published value.
        self.fixed_pacing = False
        #: Whether this peer takes its own inner steps (False: a driver steps several peers' shared model, staged.py).
        self.own_steps = True
        self.announce_extra: dict[str, Any] = {}  # more fields of this peer's announcement (its stage)
        self.connect_steps = 0  # inner steps a resumed peer took while it connected
        self.model_fingerprint = model_fingerprint(trainer.model)

    # ------------------------------------------------------------------ what each kind adds
    def _init_state(self, resumed: dict[str, Any] | None) -> None:
        """Set up the method's state at start (from a checkpoint's state when resuming)."""

    def _provide(self, name: str) -> bytes | None:
        """State other peers may ask for (called in the network loop's worker thread)."""
        return None

    def _take_state(self, state: dict[str, Any], source: str, keep_progress: bool, catch_up: bool = True) -> None:
        """Take a downloaded ``outer`` state (ValueError/KeyError if it does not fit). ``catch_up``: also take θ
        after the source's rounds that were in flight (where the kind has such rounds)."""

    def step(self) -> None:
        """One iteration of the compute loop."""
        raise NotImplementedError

    def drain(self) -> None:
        """Finish what is in flight before leaving."""

    def theta(self) -> dict[str, torch.Tensor]:
        """The parameters this peer's run produces (evaluation, summary)."""
        return {n: p.detach().float().clone() for n, p in self.trainer.params.items()}

    def checkpoint_state(self) -> dict[str, Any]:
        """This kind's part of a checkpoint (see :mod:`p2ptrain.peer_checkpoint`)."""
        return {"outer": None, "applied": 0, "tokens_at_send": []}

    def restore(self, state: dict[str, Any]) -> None:
        """Put a checkpoint's state into a peer that has not started (the outer state is taken at start)."""
        self.trainer.load_state_dict(state["trainer"])
        self.resume_state = state

    @property
    def applied(self) -> int:
        return 0

    @property
    def repairs(self) -> int:
        return 0

    @property
    def stuck(self) -> int:
        """Rounds the compute thread aborted: their own timeouts never fired."""
        return self.collective.stuck if self.collective is not None else 0

    @property
    def stall(self) -> float:
        """Seconds the compute thread waited: for rounds, slot decisions, and catching up."""
        return self.catchup_stall + (self.collective.stall if self.collective is not None else 0.0)

    def _wait_limit(self) -> float:
        """Seconds the compute thread waits for one round before aborting it as stuck."""
        return self.cfg.join_timeout + self.method.timeout * 3

    # ------------------------------------------------------------------ identity & clock
    @property
    def transport(self) -> Transport | None:
        return self.link.transport

    @property
    def runner(self) -> RoundRunner | None:
        return self.link.runner

    @property
    def transport_factory(self) -> Callable[[], Awaitable[Transport]]:
        return self.link.factory

    @transport_factory.setter
    def transport_factory(self, factory: Callable[[], Awaitable[Transport]]) -> None:
        self.link.factory = factory

    @property
    def step_seconds(self) -> float | None:
        return self.link.step_seconds

    @step_seconds.setter
    def step_seconds(self, value: float | None) -> None:
        self.link.step_seconds = value

    @property
    def peer_id(self) -> str:
        assert self.transport is not None
        return self.transport.peer_id

    @property
    def started(self) -> bool:
        return self.state is PeerState.STARTED

    def logical_step(self, now: float | None = None) -> int:
        if self.cfg.clock == "steps":
            return self.trainer.step_count
        assert self.step_seconds is not None
        return int((time.time() if now is None else now) / self.step_seconds)

    def request_stop(self) -> None:
        """Ask the compute loop to leave at its next step (thread-safe; used by signal handlers)."""
        self._stop.set()

    def __enter__(self) -> PeerBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ lifecycle
    def connect(self) -> None:
        """Connect (retrying is the transport's job) and start the background services (idempotent)."""
        if self.transport is not None:
            return
        self.link.connect(provide=self._provide, on_round=self._on_round, info=self._info, on_live=self._live_view)
        assert self.runner is not None and self.transport is not None
        if self.metrics is not None:
            self.metrics.watch_traffic(self.transport.traffic)
        if self.cfg.region == AUTO:
            self.region = self.link.measure_region(self.cfg.region_near)
            self.link.announce_now(self._info())  # peers measuring next take our name from the announcement
        self.collective = SwarmCollective(
            self.net, self.runner, peer_id=self.transport.peer_id, codec=self.codec,
            join_timeout=self.cfg.join_timeout, wait_limit=self._wait_limit(), step_seconds=lambda: self.step_seconds,
            region=self.region)
        self.state = PeerState.CONNECTED
        self._connected()

    def _connected(self) -> None:
        """Hook: the transport and runner exist."""

    def published_step_seconds(self) -> float | None:
        """The pacing this namespace published (the smallest peer id's), or None (after :meth:`connect`)."""
        return self.link.published_step_seconds()

    def start(self) -> None:
        """Connect, start the background services, agree on the pacing, and take the swarm's state if it
        has one; log where the start-up time went (:mod:`.startup`)."""
        clock = StartupClock()
        resumed = self.resume_state
        if resumed is not None:  # (what was restored, before any step: the checkpoint's own digest)
            digest = resumable_digest(self.trainer.state_dict(), resumed["outer"])
            log.info("event=resumed step=%d state=%s", self.trainer.step_count, digest)
        if (resumed is not None and self.has_outer_loop and self.own_steps and self.cfg.train_while_connecting
                and not self.lockstep):
            clock.notes["trained"] = self._connect_training()
        else:
            self.connect()
            self._check_model()
        clock.mark("connect")
        self.link.agree_pacing(fixed=self.fixed_pacing, measure=self._measure_pacing)
        clock.mark("pacing")
        self.last_lstep = self.logical_step()
        self.compute = 0.0  # steps taken to measure the pacing are start-up, not the loop's compute
        self._init_state(resumed)
        if resumed is not None:
            assert self.runner is not None
            for k, v in resumed["peer"]["rounds"].items():
                setattr(self.runner.stats, k, int(v))
            self.resume_state = None
        if self.cfg.sync_on_join:
            # A resumed peer keeps its local progress and own state where the swarm's θ still fits it. The source's
            # rounds in flight are not waited for here: a peer trains on this state only through its warm-up, and
            # then takes the swarm's state again with its progress (Peer.after_step), waiting for those rounds then.
            # Waited for here too, they held joiners idle for up to 42 s in churn (the source's rounds in flight
            # until applied, τ steps and more) before their first step.
            self.sync_from_swarm(keep_progress=resumed is not None, catch_up=False)
        clock.mark("state")
        self.link.announce_now(self._info())
        clock.report()
        self._warm_until = time.monotonic() + float(self.cfg.warmup or 0.0)
        self.state = PeerState.STARTED
        self._on_started()

    def _on_started(self) -> None:
        """Hook: the peer is paced and synced."""

    def _connect_training(self) -> float:
        """Connect and check the model on a thread of its own while this one trains the checkpoint's model: a
        resumed peer's progress is its own until it takes the swarm's state (rebased onto it then, as the
        checkpoint's progress is), so the seconds the daemon, the DHT and the first heartbeat take (10-20 s a
        restart in churn on a loaded machine) are not a GPU idle. A failed connect or model check raises here,
        once the thread has ended (both are bounded by the transport's own timeouts). Returns the seconds trained."""
        def bring_up() -> None:
            self.connect()
            self._check_model()

        steps, computed = self.trainer.step_count, self.compute
        while_training(bring_up, self.overlap_step, "p2ptrain-connect")
        self.connect_steps = self.trainer.step_count - steps
        log.info("event=trained_while_connecting steps=%d seconds=%.1f", self.connect_steps, self.compute - computed)
        return self.compute - computed

    def overlap_step(self) -> None:
        """An inner step while network work runs beside the training (:func:`.overlap.while_training`): none past
        the run's last step, or once asked to stop (a short wait instead)."""
        if self.trainer.step_count < self.cfg.steps and not self._stop.is_set():
            self._inner_step()
        else:
            time.sleep(0.25 * (self.step_seconds or 0.2))

    def _check_model(self) -> None:
        """Refuse to join a run of another model, before any inner step (see :func:`.vitals.check_model`)."""
        check_model(self.model_fingerprint, self.link.others(), self.cfg.run_id)

    def _measure_pacing(self) -> float:
        """Nobody paces the run yet: real inner steps (kept: they are training) give the step time, see
        :func:`measured_pacing`."""
        times = []
        for _ in range(4):
            t0 = time.perf_counter()
            self._inner_step()
            times.append(time.perf_counter() - t0)
        seconds, warning = measured_pacing(times)
        if warning:
            log.warning("event=pacing_measured step_seconds=%s %s", seconds, warning)
        return seconds

    def _live_view(self, live: int) -> None:
        """The heartbeat saw ``live`` peers of the run, this one included (called on the loop thread)."""
        if self.collective is not None:
            self.collective.members = live
        if self.metrics is not None:
            self.metrics.live_peers.set(live)

    def _round_label(self, rnd: Any) -> str:
        return str(rnd.fragment)

    def _on_round(self, rnd: Any, last: Any) -> None:
        """A round arrived or failed (called on the loop thread)."""
        if self.metrics is None or self.runner is None:
            return
        outcome = "failed" if not rnd.arrived else ("partial" if last is not None and last.partial else "complete")
        self._bytes_seen = self.metrics.round_done(self._round_label(rnd), outcome, self.runner.stats,
                                                   self.codec.name, self._bytes_seen)

    def _info(self) -> PeerInfo:
        st = self.runner.stats if self.runner else None
        tps = self.trainer.tokens_seen / self.compute if self.compute > 0 else 0.0
        return PeerInfo(peer_id=self.peer_id, region=self.region, step=self.trainer.step_count,
                        logical_step=self.last_lstep, tokens_per_second=tps, bandwidth=st.bandwidth if st else 0.0,
                        loss=self.last_loss, method=self.method.name,
                        extra={"rounds": st.complete + st.partial if st else 0, "in_flight": st.in_flight if st else 0,
                               "model": self.model_fingerprint, **self.announce_extra})

    def sync_from_swarm(self, keep_progress: bool = False, catch_up: bool = True) -> None:
        """Take the swarm's state, downloaded chunked and hash-verified from the first live peer that
        delivers it whole (most advanced first). ``keep_progress``: keep local progress and own state where
        the swarm's still fits; ``catch_up``: take θ after the source's rounds then in flight as well (see
        :meth:`_take_state`)."""
        source = self.link.take_state("outer", lambda state, src: self._take_state(state, src, keep_progress,
                                                                                   catch_up))
        if source is not None:
            self.synced_from = source

    def fetch(self, peer: str, name: str) -> bytes:
        """Download state ``name`` from ``peer`` (RoundFailed/TimeoutError when it has none or is gone)."""
        return self.link.fetch(peer, name)

    def download(self, sources: list[str], name: str) -> tuple[str, bytes]:
        """State ``name`` from the first of ``sources`` that delivers it, the next asked too while the first are
        silent (``cfg.hedge``): (source, bytes); RoundFailed when none does."""
        return self.link.download(sources, name)

    def close(self) -> None:
        """Leave the swarm and stop the network (idempotent)."""
        if self.state is PeerState.CLOSED:
            return
        if self.checkpoints is not None:
            self.checkpoints.close()  # the write in progress finishes (a crash mid-write keeps the older ones)
        self.link.close()
        self._closed()
        if self._own_net:
            self.net.close()
        self.state = PeerState.CLOSED

    def _closed(self) -> None:
        """Hook: the services stopped (release what the kind owns)."""

    # ------------------------------------------------------------------ the compute loop
    def run(self) -> PeerSummary:
        """Train until ``cfg.steps`` inner steps (or :meth:`request_stop`), then drain and summarise."""
        t0 = time.perf_counter()
        try:
            if self.state is not PeerState.STARTED:
                self.start()
            self.begin_loop()
            self.eval_theta()
            while self.trainer.step_count < self.cfg.steps and not self._stop.is_set():
                self.step()
                if self.cfg.eval_every and self.trainer.step_count % self.cfg.eval_every == 0:
                    self.eval_theta()
                self._status()
            self.end_loop()
            if self.checkpoints is not None:
                self.checkpoints.save(self, "leave")
            return self.summary(time.perf_counter() - t0)
        finally:
            self.close()

    @property
    def lockstep(self) -> bool:
        """Whether this peer's rounds follow its own inner steps (``clock="steps"``; data parallel always): it
        then waits out its warm-up before the first step, so that every peer sees it before a round forms."""
        return self.cfg.clock == "steps"

    def begin_loop(self, t: float | None = None) -> None:
        """The inner-step loop starts now (or at ``t``, perf_counter): its time and compute count from here."""
        if self.lockstep:
            time.sleep(max(0.0, self._warm_until - time.monotonic()))
        self._t_start = time.perf_counter() if t is None else t
        self.loop_started = time.time()
        self.sharing.restart()

    def end_loop(self) -> None:
        """The inner-step loop is over: record its time, then (a leave by signal) send the unsent progress, and
        drain what is in flight."""
        assert self._t_start is not None
        self.loop_seconds = time.perf_counter() - self._t_start
        t_drain = time.perf_counter()
        if self._stop.is_set() and self.cfg.leave_flush > 0:
            self.flush()
        self.drain()
        if self._stop.is_set():
            self.bequeath()
        self.drain_seconds = time.perf_counter() - t_drain

    def flush(self) -> None:
        """Hook: a leave by signal, before the drain: send what this peer trained and no round carries yet."""

    def bequeath(self) -> None:
        """Hook: a leave by signal, after the drain: hand what no round carried to a peer that stays."""

    @property
    def stopping(self) -> bool:
        """Whether this peer was asked to leave (:meth:`request_stop`)."""
        return self._stop.is_set()

    def eval_theta(self) -> None:
        """Validation loss of θ now (``eval_every``), logged with the time; not counted as compute."""
        if not self.cfg.eval_every:
            return
        t0 = time.perf_counter()
        with self.lock:
            loss = self.trainer.evaluate(self._eval_params()).loss
        self.trainer.model.train()
        self.eval_seconds += time.perf_counter() - t0
        self.val_log.append((time.time(), self.trainer.step_count, loss, self.eval_seconds))

    def _eval_params(self) -> dict[str, torch.Tensor] | None:
        return None

    def _inner_step(self) -> None:
        st = self.trainer.step()
        seconds = st.seconds
        if seconds < self.cfg.min_step_seconds:
            time.sleep(self.cfg.min_step_seconds - seconds)
            seconds = self.cfg.min_step_seconds
        self.record_step(st.loss, st.tokens, seconds)

    def record_step(self, loss: float, tokens: int, seconds: float) -> None:
        """Count an inner step taken (here, or by a driver that steps several peers' shared model)."""
        self.compute += seconds
        self.last_loss = loss
        self.loss_log.append((time.time(), self.trainer.step_count, loss))
        if self.metrics is not None:
            elapsed = time.perf_counter() - self._t_start if self._t_start is not None else None
            self.metrics.step_done(tokens, loss, self.trainer.tokens_seen, self.compute, elapsed)

    def sharing_nothing(self) -> float:
        """Seconds this peer has shared no round with another peer, once that is longer than every fragment
        syncing twice (at least 30 s; 0.0 before that): its θ is then its own training only."""
        if self.runner is None or self._t_start is None:
            return 0.0
        return self.sharing.quiet(self.runner.stats.last_shared, 2.0 * self.method.H * (self.step_seconds or 1.0))

    def _say_if_sharing_nothing(self) -> float:
        """Log (a warning when other peers are live) and set the metric if this peer shares nothing."""
        quiet = self.sharing_nothing()
        if self.metrics is not None:
            self.metrics.sharing_nothing.set(quiet)
        if self.runner is not None:
            self.sharing.say(quiet, self.collective.members if self.collective is not None else 1, self.runner.stats)
        return quiet

    def _status(self) -> None:
        if self.runner is None:
            return
        quiet = self._say_if_sharing_nothing()
        if self.on_status is None:
            return
        st = self.runner.stats
        self.on_status({"step": self.trainer.step_count, "loss": self.last_loss,
                        "tokens_per_second": self.trainer.tokens_seen / self.compute if self.compute else 0.0,
                        "rounds": st.complete + st.partial, "failed": st.failed, "in_flight": st.in_flight,
                        "logical_step": self.last_lstep, "sharing_nothing": quiet})

    def _applied_digests(self) -> dict[str, tuple[str, list[torch.Tensor]]]:
        return {}

    def summary(self, wall: float) -> PeerSummary:
        st = self.runner.stats if self.runner else None
        return PeerSummary(
            peer_id=self.peer_id, steps=self.trainer.step_count, wall_seconds=wall, compute_seconds=self.compute,
            stall_seconds=self.stall, rounds_complete=st.complete if st else 0, rounds_partial=st.partial if st else 0,
            rounds_failed=st.failed if st else 0, rounds_applied=self.applied, repairs=self.repairs,
            bytes_sent=st.bytes_sent if st else 0, bytes_received=st.bytes_received if st else 0,
            final_train_loss=self.last_loss, outer_params=self.theta(), applied=self._applied_digests(),
            loop_seconds=self.loop_seconds, drain_seconds=self.drain_seconds, stuck_rounds=self.stuck,
            abandoned_rounds=self.collective.abandoned if self.collective is not None else 0,
            eval_seconds=self.eval_seconds, outer_seconds=self.outer_seconds,
            rounds_shared=st.shared if st else 0)
