"""A swarm peer: the composition root, and the one place where PyTorch meets the event loop.

The compute thread (the caller of :meth:`Peer.run`) takes inner steps and does
every mutation of parameters and outer state, in program order. The network lives
on a :class:`~p2ptrain.sync.NetLoop`; the two meet only through ``NetLoop.submit``
(start a round in the background) and ``NetLoop.call`` (wait, with a timeout).

**Pacing (heterogeneous peers).** Rounds are paced by time, not by each peer's own
step count: the swarm shares a step duration ``step_seconds`` (published in the
DHT by the first peer), and the *logical step* is ``⌊wall time / step_seconds⌋``.
Every method's schedule (H, offsets, τ, CoCoDC's slots) runs on logical steps, so
all peers reach a round at the same moment whatever their speed; each contributes
what it computed since its last sync, weighted by its tokens (as hivemind's
``target_batch_size`` weights by samples). A peer 3× slower than the rest takes
fewer inner steps per round and never makes the others wait beyond the method's
own waiting (DiLoCo's blocking sync, or a result that is needed before it arrived).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .algo.fragments import make_fragments, model_units
from .algo.methods import DDPConfig, MethodConfig, OuterLoop, Round, RoundState
from .algo.priority import choose_merged, sends_per_window
from .checkpoint import state_from_bytes, state_to_bytes
from .collective.codecs import get_codec
from .metrics import PeerMetrics
from .net.transport import Decision, Group, JoinRequest, PeerInfo, RoundFailed, Transport
from .peer_checkpoint import PeerCheckpoints, resumable_digest
from .sync import NetLoop, RoundRunner, fingerprint, theta_digest
from .trainer import Trainer

__all__ = ["Peer", "PeerConfig", "PeerSummary"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class PeerConfig:
    """A peer's place in a run.

    Attributes:
        run_id: the run's name; peers of one run find each other under it.
        region: a free-form label (announced, shown by ``status``).
        steps: leave cleanly after this many inner steps.
        step_seconds: the swarm's logical step duration (round pacing). None: take the run's
            published value, or (first peer) measure the first inner steps and publish that.
        join_window: seconds a round's leader waits for live peers to join before it closes the group.
        join_timeout: seconds a peer waits for its group to form.
        heartbeat: seconds between announcements; an announcement expires after ``ttl``.
        sync_on_join: a peer that finds a live swarm downloads θ and the outer state first.
        drain_timeout: seconds to wait for rounds still in flight when leaving.
        min_step_seconds: pad every inner step to at least this long (emulates a slower device in
            tests and demos; the padding counts as compute).
        warmup: seconds after joining before taking part in rounds (None: three heartbeats), so that
            every peer's view of who is live includes us before a group can form without us.
        checkpoint_dir: where to write checkpoints (None: none); every ``checkpoint_every`` applied
            rounds (data parallel: steps) and on leave, keeping the last ``keep_checkpoints``.
        eval_every: evaluate θ on the validation set when the loop starts and every this many inner steps
            (0: never during the run), for loss-over-time curves (benchmarks' time to a target loss). The
            time it takes is counted apart (``eval_seconds``), not as compute.
    """

    run_id: str = "p2ptrain"
    region: str = ""
    steps: int = 300
    step_seconds: float | None = None
    join_window: float = 2.0
    join_timeout: float = 30.0
    heartbeat: float = 2.0
    ttl: float = 8.0
    sync_on_join: bool = True
    drain_timeout: float = 60.0
    min_step_seconds: float = 0.0
    warmup: float | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 10
    keep_checkpoints: int = 3
    eval_every: int = 0

    def __post_init__(self) -> None:
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0 (0: no evaluation during the run), got {self.eval_every}")
        if self.warmup is None:
            self.warmup = 3 * self.heartbeat
        if not self.run_id or any(c in self.run_id for c in " /"):
            raise ValueError(f"run id must be a non-empty word without spaces or '/', got {self.run_id!r}")
        if self.steps < 1:
            raise ValueError("steps must be at least 1")
        if self.step_seconds is not None and self.step_seconds <= 0:
            raise ValueError("step_seconds must be positive")
        for name in ("join_window", "join_timeout", "heartbeat", "ttl", "drain_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.ttl <= self.heartbeat:
            raise ValueError("ttl must be longer than the heartbeat period")


@dataclass
class PeerSummary:
    peer_id: str
    steps: int
    wall_seconds: float
    compute_seconds: float
    stall_seconds: float
    rounds_complete: int
    rounds_partial: int
    rounds_failed: int
    rounds_applied: int
    repairs: int
    bytes_sent: int
    bytes_received: int
    final_train_loss: float
    val_loss: float = math.nan
    loop_seconds: float = 0.0  # the inner-step loop alone (no start-up, no final drain)
    drain_seconds: float = 0.0  # waiting for the rounds in flight when leaving
    stuck_rounds: int = 0  # rounds that outlived every timeout of their own and were aborted
    eval_seconds: float = 0.0  # evaluations during the run (``eval_every``), inside loop_seconds
    outer_params: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    applied: dict[str, tuple[str, list[torch.Tensor]]] = field(default_factory=dict, repr=False)

    @property
    def utilization(self) -> float:
        return self.compute_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0


class Peer:
    """One peer of a swarm (any method, any transport)."""

    def __init__(self, cfg: PeerConfig, method: MethodConfig, trainer: Trainer,
                 transport: Callable[[], Awaitable[Transport]], *, net: NetLoop | None = None,
                 on_status: Callable[[dict[str, Any]], None] | None = None, seed: int = 0,
                 metrics: PeerMetrics | None = None) -> None:
        self.cfg, self.method, self.trainer = cfg, method, trainer
        self._make_transport, self._own_net = transport, net is None
        self.net = net or NetLoop()
        self.on_status = on_status
        self.metrics = metrics
        device = getattr(trainer, "device", None)
        # On a GPU the codec quantises there (only the packed payload comes back to the host).
        self.codec = get_codec(method.codec, device if device is not None and device.type == "cuda" else None)
        self.is_ddp = isinstance(method, DDPConfig)
        self.frags = make_fragments(model_units(trainer.model), method.fragments, method.fragment_mode)  # type: ignore[arg-type]
        self.outer: OuterLoop | None = None if self.is_ddp else OuterLoop(method, self.frags, seed=seed)
        self.transport: Transport | None = None
        self.runner: RoundRunner | None = None
        self.in_flight: list[Round] = []
        self.pending_groups: list[tuple[int, Any]] = []  # CoCoDC negotiations: (slot, future of Group)
        self._assigned: dict[int, int] = {}  # as a slot leader: fragment -> slot it was assigned at
        self.lock = threading.Lock()  # guards the outer state against the state provider (loop thread)
        self.before: OrderedDict[str, bytes] = OrderedDict()  # θ^(p), momentum before a round, by key
        self.after: OrderedDict[str, bytes] = OrderedDict()  # θ^(p), momentum after an applied round, by key
        self.tokens_at_send: list[int] = [0] * len(self.frags)
        self.step_seconds = cfg.step_seconds
        self.last_lstep = -1
        self.last_slot = -1  # CoCoDC: the last slot negotiated
        self.compute = self.stall = 0.0
        self.applied = self.repairs = 0
        # θ^(p) after each applied round, by round key: its digest (and a copy when keep_applied, for tests).
        self.applied_log: dict[str, tuple[str, list[torch.Tensor]]] = {}
        self.keep_applied = False
        self.history: list[tuple[str, str, tuple[str, ...], bool]] = []  # (key, digest, contributors, repaired)
        self.last_loss = math.nan
        self._stop = threading.Event()
        self._bytes_seen = (0, 0)
        self._t_start: float | None = None
        self._warm_until = 0.0
        self._synced_after_warmup = False
        self.loop_seconds = 0.0  # wall time of the inner-step loop (without start-up and the final drain)
        self.drain_seconds = 0.0
        self.stuck = 0  # rounds the compute thread had to abort: their own timeouts never fired
        self._service: Any = None
        self._stopping: Any = None
        self.checkpoints = (PeerCheckpoints(cfg.checkpoint_dir, cfg.checkpoint_every, cfg.keep_checkpoints)
                            if cfg.checkpoint_dir else None)
        self.resume_state: dict[str, Any] | None = None  # set by PeerCheckpoints.restore before start()
        self.synced_from: str | None = None  # the peer whose state this one took at start, if any
        self.start_digests: list[str] = []  # digest of θ per fragment when start() returned
        self.served_digests: list[list[str]] = []  # digest of θ per fragment in every outer state served
        self.loss_log: list[tuple[float, int, float]] = []  # (unix time, inner step, train loss)
        # Set by a driver that decides the pacing for several namespaces (p2ptrain.staged): publish
        # step_seconds as given instead of taking this namespace's published value.
        self.fixed_pacing = False
        self.announce_extra: dict[str, Any] = {}  # more fields of this peer's announcement (its stage)
        self._started = False
        # (unix time, inner step, val loss of θ, eval seconds so far) every ``eval_every`` steps
        self.val_log: list[tuple[float, int, float, float]] = []
        self.eval_seconds = 0.0
        self.loop_started = math.nan  # unix time the inner-step loop started

    # ------------------------------------------------------------------ identity & clock
    @property
    def peer_id(self) -> str:
        assert self.transport is not None
        return self.transport.peer_id

    def logical_step(self, now: float | None = None) -> int:
        assert self.step_seconds is not None
        return int((time.time() if now is None else now) / self.step_seconds)

    def theta_digests(self) -> list[str]:
        """Digest of θ^(p) per fragment (call with the lock held)."""
        assert self.outer is not None
        return [theta_digest(self.outer.theta(f.index)) for f in self.frags]

    def request_stop(self) -> None:
        """Ask the compute loop to leave at its next step (thread-safe; used by signal handlers)."""
        self._stop.set()

    # ------------------------------------------------------------------ lifecycle
    def connect(self) -> None:
        """Connect (retrying is the transport's job) and start the background services (idempotent)."""
        if self.transport is not None:
            return
        self.transport = self.net.call(self._make_transport(), timeout=self.cfg.join_timeout + 60)
        self.transport.serve_state(self._provide)
        self.runner = RoundRunner(self.transport, self.codec, join_timeout=self.cfg.join_timeout,
                                  round_timeout=self.method.timeout, on_result=self._on_round)
        self._service = self.net.submit(self._serve())
        self.runner.wait_ready(10)

    def published_step_seconds(self) -> float | None:
        """The pacing this namespace published (the smallest peer id's), or None (after :meth:`connect`)."""
        assert self.transport is not None
        metas = self.net.call(self.transport.get_meta(), timeout=self.cfg.join_timeout)
        published = [metas[p]["step_seconds"] for p in sorted(metas) if "step_seconds" in metas[p]]
        return float(published[0]) if published else None

    def start(self) -> None:
        """Connect, start the background services, agree on the pacing, and take the swarm's state if
        it has one."""
        self.connect()
        self._started = True
        self._agree_pacing()
        self.compute = 0.0  # steps taken to measure the pacing are start-up, not the loop's compute
        resumed = self.resume_state
        if self.outer is not None:
            with self.lock:
                self.outer.init(self.trainer)
                if resumed is not None:
                    self.outer.load_state_dict(resumed["outer"])
        if resumed is not None:
            digest = resumable_digest(self.trainer.state_dict(), None if self.outer is None else self.outer.state_dict())
            log.info("event=resumed step=%d state=%s", self.trainer.step_count, digest)
            st = self.runner.stats
            for k, v in resumed["peer"]["rounds"].items():
                setattr(st, k, int(v))
            self.resume_state = None
        if self.cfg.sync_on_join:
            # A resumed peer keeps its local progress and own state where the swarm's θ still fits it.
            self._sync_from_swarm(keep_progress=resumed is not None)
        if self.outer is not None:
            with self.lock:
                self.start_digests = self.theta_digests()
        self._announce_now()
        self._warm_until = time.monotonic() + float(self.cfg.warmup or 0.0)

    async def _serve(self) -> None:
        import asyncio

        assert self.runner is not None
        self._stopping = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.runner.serve())
            hb = tg.create_task(self._heartbeat())
            await self._stopping.wait()
            hb.cancel()
            await self.runner.stop()

    async def _heartbeat(self) -> None:
        import asyncio

        assert self.transport is not None
        while True:
            try:
                await asyncio.wait_for(self.transport.announce(self._info()), self.cfg.heartbeat * 2)
                if self.metrics is not None:
                    live = await asyncio.wait_for(self.transport.peers(), self.cfg.heartbeat * 2)
                    self.metrics.live_peers.set(len(live))
                if self.step_seconds is not None:
                    await asyncio.wait_for(self.transport.publish_meta({"step_seconds": self.step_seconds}),
                                           self.cfg.heartbeat * 2)
            except (TimeoutError, OSError, RoundFailed) as e:
                log.info("event=heartbeat_failed reason=%s", e)
            await asyncio.sleep(self.cfg.heartbeat)

    def _on_round(self, rnd: Round, last: Any) -> None:
        """A round arrived or failed (called on the loop thread)."""
        m = self.metrics
        if m is None:
            return
        outcome = "failed" if not rnd.arrived else ("partial" if last is not None and last.partial else "complete")
        m.rounds.labels(fragment=str(rnd.fragment), outcome=outcome).inc()
        st = self.runner.stats if self.runner else None
        if st is not None:
            if rnd.arrived and st.seconds:
                m.round_duration.observe(st.seconds[-1])
            m.bandwidth.set(st.bandwidth)
            m.rounds_in_flight.set(st.in_flight)
            m.bytes_sent.labels(codec=self.codec.name).inc(max(0, st.bytes_sent - self._bytes_seen[0]))
            m.bytes_received.labels(codec=self.codec.name).inc(max(0, st.bytes_received - self._bytes_seen[1]))
            self._bytes_seen = (st.bytes_sent, st.bytes_received)

    def _info(self) -> PeerInfo:
        st = self.runner.stats if self.runner else None
        tps = self.trainer.tokens_seen / self.compute if self.compute > 0 else 0.0
        return PeerInfo(peer_id=self.peer_id, region=self.cfg.region, step=self.trainer.step_count,
                        logical_step=self.last_lstep, tokens_per_second=tps, bandwidth=st.bandwidth if st else 0.0,
                        loss=self.last_loss, method=self.method.name,
                        extra={"rounds": st.complete + st.partial if st else 0, "in_flight": len(self.in_flight),
                               **self.announce_extra})

    def _announce_now(self) -> None:
        assert self.transport is not None
        try:
            self.net.call(self.transport.announce(self._info()), timeout=self.cfg.join_timeout)
        except (TimeoutError, OSError, RoundFailed) as e:
            log.warning("event=announce_failed reason=%s", e)

    def _agree_pacing(self) -> None:
        """All peers must share ``step_seconds``: take the published value of the smallest peer id."""
        assert self.transport is not None
        if self.fixed_pacing and self.step_seconds is not None:
            published = []
        else:
            metas = self.net.call(self.transport.get_meta(), timeout=self.cfg.join_timeout)
            published = [metas[p]["step_seconds"] for p in sorted(metas) if "step_seconds" in metas[p]]
        if published:
            if self.step_seconds is not None and abs(published[0] - self.step_seconds) > 1e-9:
                log.warning("event=pacing_override mine=%s swarm=%s", self.step_seconds, published[0])
            self.step_seconds = float(published[0])
        elif self.step_seconds is None:
            t0 = time.perf_counter()
            for _ in range(3):  # measure, and keep the steps: they are real training
                self._inner_step()
            self.step_seconds = round(max(0.01, (time.perf_counter() - t0) / 3), 3)
        self.net.call(self.transport.publish_meta({"step_seconds": self.step_seconds}), timeout=self.cfg.join_timeout)
        self.last_lstep = self.logical_step()

    def _sync_from_swarm(self, keep_progress: bool = False) -> None:
        """Take the swarm's θ and outer state (data parallel: its parameters, AdamW state and step),
        downloaded chunked and hash-verified from the first live peer that delivers it whole.
        ``keep_progress``: local ← θ_new + (local − θ_old), and this peer's own per-fragment state
        (eager's Δ_i, error feedback) is kept where it still fits."""
        assert self.transport is not None
        others = [p for p in self.net.call(self.transport.peers(), self.cfg.join_timeout) if p.peer_id != self.peer_id]
        # Most advanced first (it holds the newest θ), then by id so that joiners agree.
        sources = [i.peer_id for i in sorted(others, key=lambda i: (-i.step, i.peer_id))]
        if not sources:
            return
        last = [0.0]

        def progress(done: int, total: int) -> None:
            if time.monotonic() - last[0] > 2.0 or done == total:
                last[0] = time.monotonic()
                log.info("event=state_download bytes=%d total=%d", done, total)

        while sources:
            try:
                source, raw = self.net.call(self.transport.download_state(
                    sources, "outer", timeout=self.cfg.join_timeout, progress=progress), None)
                state = state_from_bytes(raw, f"state from {source}")
                self._take_state(state, keep_progress)
            except (RoundFailed, TimeoutError) as e:
                log.warning("event=sync_failed reason=%s", e)
                return
            except (ValueError, KeyError) as e:  # a verified download that does not fit: try the others
                log.warning("event=sync_rejected peer=%s reason=%s", source, e)
                sources = sources[sources.index(source) + 1:]
                continue
            self.synced_from = source
            log.info("event=synced_from peer=%s", source)
            if self.outer is not None:
                self._catch_up(source, state.get("pending", []), keep_progress)
            return

    def _catch_up(self, source: str, pending: Sequence[Sequence[Any]], keep_progress: bool) -> None:
        """The state we took did not include the source's rounds then in flight; take θ after each
        of them once the source has applied it, or we would start one round behind the swarm on
        that fragment (bounded wait: a round the source never applies is left to repair)."""
        assert self.transport is not None and self.outer is not None
        deadline = time.monotonic() + self.method.timeout + self.cfg.join_timeout
        t0 = time.perf_counter()
        for fragment, key in pending:
            while time.monotonic() < deadline:
                try:
                    raw = self.net.call(self.transport.fetch_state(source, f"after:{key}",
                                                                   timeout=self.cfg.join_timeout),
                                        self.cfg.join_timeout + 5)
                except RoundFailed:  # not applied yet
                    time.sleep(0.25 * (self.step_seconds or 0.2))
                    continue
                except TimeoutError:
                    return
                st = state_from_bytes(raw, f"θ after {key} from {source}")
                if st.get("gone"):
                    break
                names = self.frags[int(fragment)].names
                with self.lock:
                    old = [t.clone() for t in self.outer.theta(int(fragment))]
                    self.outer.overwrite(int(fragment), st["theta"], st["momentum"])
                    if "round" in st:  # e.g. low-rank ranks adapted in that round: ours would not match the next
                        try:
                            self.outer.take_round_state(int(fragment), st["round"])
                        except (ValueError, KeyError, TypeError) as e:
                            log.warning("event=round_state_refused fragment=%s key=%s reason=%s", fragment, key, e)
                    new = self.outer.theta(int(fragment))
                    if keep_progress:
                        local = self.trainer.snapshot(names)
                        new = [n + (x - o) for n, x, o in zip(new, local, old, strict=True)]
                    self.trainer.apply_outer(names, new)
                log.info("event=caught_up fragment=%s key=%s", fragment, key)
                break
        self.stall += time.perf_counter() - t0

    def _take_state(self, state: dict[str, Any], keep_progress: bool) -> None:
        if self.outer is None:
            self._load_ddp_state(state)
            return
        with self.lock:
            before = {f.index: [t.clone() for t in self.outer.theta(f.index)] for f in self.frags}
            mine = self.outer.state_dict() if keep_progress else None
            self.outer.load_state_dict(state)
            if mine is not None:
                self.outer.keep_own(mine)
            for frag in self.frags:
                new = self.outer.theta(frag.index)
                if keep_progress:  # local ← θ_new + (local − θ_old)
                    local = self.trainer.snapshot(frag.names)
                    new = [n + (x - o) for n, x, o in zip(new, local, before[frag.index], strict=True)]
                self.trainer.apply_outer(frag.names, new)

    def _provide(self, name: str) -> bytes | None:
        """State other peers may ask for (called on the loop thread)."""
        if name == "outer":
            with self.lock:
                if self.outer is not None and not self.outer.initialized:
                    return None  # still starting: nothing to give yet
                if self.outer is None:
                    return state_to_bytes({"params": dict(self.trainer.params), "step": self.trainer.step_count,
                                           "optimizer": self.trainer.optimizer.state_dict()})
                self.served_digests.append(self.theta_digests())
                state = self.outer.shared_state()
                # Rounds this θ does not include yet: the taker fetches θ after each ("after:KEY").
                state["pending"] = [[r.fragment, r.key] for r in list(self.in_flight)
                                    if r.state in (RoundState.AVERAGING, RoundState.ARRIVED)]
                return state_to_bytes(state)
        if self.outer is None:
            return None
        if name.startswith("before:"):
            return self.before.get(name[len("before:"):])
        if name.startswith("after:"):
            key = name[len("after:"):]
            if key in self.after:
                return self.after[key]
            if any(r.key == key for r in list(self.in_flight)):
                return None  # not applied yet: ask again
            return state_to_bytes({"gone": True})  # failed or long gone: θ never included it
        return None
        return None

    def close(self) -> None:
        """Leave the swarm and stop the network (idempotent)."""
        if self.transport is not None:
            try:
                self.net.call(self.transport.leave(), timeout=5)
            except (TimeoutError, OSError, RoundFailed, RuntimeError):
                pass
        if self._stopping is not None:
            self.net.loop.call_soon_threadsafe(self._stopping.set)
            try:
                self._service.result(timeout=15)
            except Exception as e:
                log.warning("event=service_stop reason=%s", e)
            self._stopping = None
        if self.transport is not None and hasattr(self.transport, "aclose"):
            try:
                self.net.call(self.transport.aclose(), timeout=15)  # type: ignore[attr-defined]
            except (TimeoutError, RuntimeError) as e:
                log.warning("event=transport_close reason=%s", e)
        if self._own_net:
            self.net.close()

    # ------------------------------------------------------------------ the compute loop
    def run(self) -> PeerSummary:
        """Train until ``cfg.steps`` inner steps (or :meth:`request_stop`), then drain and summarise."""
        t0 = time.perf_counter()
        try:
            if not self._started:
                self.start()
            self._t_start = time.perf_counter()
            self.loop_started = time.time()
            self._eval_theta()
            if self.is_ddp:
                # Data parallel runs in lockstep from the first step: wait until every peer can see us.
                time.sleep(max(0.0, self._warm_until - time.monotonic()))
            while self.trainer.step_count < self.cfg.steps and not self._stop.is_set():
                if self.is_ddp:
                    self._ddp_step()
                else:
                    self._inner_step()
                    self._outer()
                if self.cfg.eval_every and self.trainer.step_count % self.cfg.eval_every == 0:
                    self._eval_theta()
                self._status()
            self.loop_seconds = time.perf_counter() - self._t_start
            t_drain = time.perf_counter()
            self._drain()
            self.drain_seconds = time.perf_counter() - t_drain
            if self.checkpoints is not None:
                self.checkpoints.save(self, "leave")
            return self._summary(time.perf_counter() - t0)
        finally:
            self.close()

    def _eval_theta(self) -> None:
        """Validation loss of θ now (``eval_every``), logged with the time; not counted as compute."""
        if not self.cfg.eval_every:
            return
        t0 = time.perf_counter()
        with self.lock:
            params = None if self.outer is None else dict(self.outer.outer_params())
            loss = self.trainer.evaluate(params).loss
        self.trainer.model.train()
        self.eval_seconds += time.perf_counter() - t0
        self.val_log.append((time.time(), self.trainer.step_count, loss, self.eval_seconds))

    def _inner_step(self) -> None:
        st = self.trainer.step()
        seconds = st.seconds
        if seconds < self.cfg.min_step_seconds:
            time.sleep(self.cfg.min_step_seconds - seconds)
            seconds = self.cfg.min_step_seconds
        self._account(st, seconds)

    def _account(self, st: Any, seconds: float) -> None:
        """Count an inner step taken (here, or by a driver that steps several peers' shared model)."""
        self.compute += seconds
        self.last_loss = st.loss
        self.loss_log.append((time.time(), self.trainer.step_count, st.loss))
        self._step_metrics(st.tokens, st.loss)

    def _step_metrics(self, tokens: int, loss: float) -> None:
        m = self.metrics
        if m is None:
            return
        m.inner_steps.inc()
        m.tokens.inc(tokens)
        m.train_loss.set(loss)
        if self.compute > 0:
            m.tokens_per_second.set(self.trainer.tokens_seen / self.compute)
        if self._t_start is not None:
            m.utilization.set(self.compute / max(1e-9, time.perf_counter() - self._t_start))

    def _outer(self) -> None:
        assert self.outer is not None
        lstep = self.logical_step()
        if time.monotonic() < self._warm_until:
            # Until the swarm has had time to see our announcement (and we theirs), a round could form
            # from views that disagree on who is live and split into groups: train locally meanwhile.
            self.last_lstep = max(self.last_lstep, lstep)
            return
        if self.runner is not None and self.runner.needs_resync.is_set():
            self.runner.needs_resync.clear()
            log.warning("event=resync reason=round state differs from the swarm's")
            self._sync_from_swarm(keep_progress=True)
        if not self._synced_after_warmup:
            # The swarm moved on while we warmed up (rounds applied, low-rank ranks adapted): take its
            # outer state again, keeping the local progress made since the first sync.
            self._synced_after_warmup = True
            if self.cfg.sync_on_join:
                self._sync_from_swarm(keep_progress=True)
        for step in range(self.last_lstep + 1, lstep + 1) if lstep > self.last_lstep else [lstep]:
            self._plan(step)
            if self.outer.negotiated and step > self.last_slot and self.outer.is_slot(step):
                self.last_slot = step  # once per slot: inner steps faster than the pacing see it again
                self._negotiate(step)
        self.last_lstep = max(self.last_lstep, lstep)
        self._start_negotiated(lstep)

    def _plan(self, step: int) -> None:
        assert self.outer is not None
        for _ in range(1000):
            self.in_flight = [r for r in self.in_flight if r.state in (RoundState.AVERAGING, RoundState.ARRIVED)]
            plan = self.outer.plan(step, self.in_flight, sends=not self.outer.negotiated)
            if plan.wait:
                self._wait(plan.wait)
                continue
            if not plan.actions:
                return
            for kind, x in plan.actions:
                if kind == "send":
                    self._send(x, step, JoinRequest(key=f"f{x}.L{step}", peer_id=self.peer_id, weight=0.0,
                                                    fragment=x, step=step, signature=self.outer.signature(x)))
                else:
                    self._apply(x, step)
        raise RuntimeError(f"outer loop made no progress at step {step}")

    def _wait(self, rounds: Sequence[Round]) -> None:
        limit = self.cfg.join_timeout + self.method.timeout * 3
        t0 = time.perf_counter()
        for r in rounds:
            if not r.done.wait(max(0.0, limit - (time.perf_counter() - t0))):
                log.warning("event=round_timeout key=%s", r.key)
                self.stuck += 1
                r.abort()
        self.stall += time.perf_counter() - t0

    def _send(self, fragment: int, step: int, request: JoinRequest, group: Group | None = None) -> None:
        assert self.outer is not None and self.runner is not None
        weight = max(1, self.trainer.tokens_seen - self.tokens_at_send[fragment])
        self.tokens_at_send[fragment] = self.trainer.tokens_seen
        with self.lock:
            theta = self.outer.theta(fragment)
            print_ = fingerprint(theta) if self.outer.shared_theta else None
            key = group.key if group is not None else request.key
            self.before[key] = state_to_bytes({"theta": theta, "momentum": self.outer.momentum(fragment)})
            while len(self.before) > 4 * len(self.frags) + 4:
                self.before.popitem(last=False)
            rnd = self.outer.start(fragment, step, self.trainer, weight=weight, name=key)
        request.weight = float(weight)
        self.in_flight.append(rnd)
        self.net.submit(self.runner.launch(rnd, group if group is not None else request, print_))

    def _apply(self, rnd: Round, step: int) -> None:
        assert self.outer is not None and self.transport is not None
        if rnd.divergent:
            self._repair(rnd)
        with self.lock:
            rep = self.outer.finish(rnd, step, self.trainer)
            theta = self.outer.theta(rnd.fragment)
            digest = theta_digest(theta)
            self.after[rnd.key] = state_to_bytes({"theta": theta, "momentum": self.outer.momentum(rnd.fragment),
                                                  "round": self.outer.round_state(rnd.fragment)})
            while len(self.after) > 4 * len(self.frags) + 4:
                self.after.popitem(last=False)
            self.applied_log[rnd.key] = (digest, [t.clone() for t in theta] if self.keep_applied else [])
            self.history.append((rnd.key, digest[:8], tuple(c[-4:] for c in rnd.contributors), rnd.divergent))
        self.applied += 1
        self.in_flight.remove(rnd)
        if self.checkpoints is not None:
            self.checkpoints.after_round(self)
        if self.metrics is not None:
            self.metrics.staleness.observe(rep.delay)
            if rep.correction_norm:
                self.metrics.correction.set(rep.correction_norm)

    def _repair(self, rnd: Round) -> None:
        """Our θ^(p) disagreed with the round's majority: take theirs (as it was before the round)."""
        assert self.outer is not None and self.transport is not None
        key = rnd.key
        for peer in rnd.contributors:
            if peer == self.peer_id:
                continue
            try:
                raw = self.net.call(self.transport.fetch_state(peer, f"before:{key}", timeout=self.cfg.join_timeout),
                                    self.cfg.join_timeout + 5)
                st = state_from_bytes(raw, f"θ from {peer}")
                with self.lock:
                    self.outer.overwrite(rnd.fragment, st["theta"], st["momentum"])
                    self.trainer.apply_outer(self.frags[rnd.fragment].names, self.outer.theta(rnd.fragment))
                self.repairs += 1
                log.warning("event=repaired fragment=%d from=%s", rnd.fragment, peer)
                return
            except (RoundFailed, TimeoutError, ValueError, KeyError) as e:
                log.info("event=repair_failed peer=%s reason=%s", peer, e)

    # -- CoCoDC: the leader of each slot picks the fragment from every member's view
    def _negotiate(self, slot: int) -> None:
        assert self.outer is not None and self.runner is not None
        with self.lock:
            scores = self.outer.drift_scores(self.trainer, slot)
        req = JoinRequest(key=f"slot.L{slot}", peer_id=self.peer_id, weight=1.0, fragment=None, scores=scores,
                          busy=self.outer.busy_fragments(self.in_flight), last_sent=self.outer.last_sends(), step=slot,
                          sends=self._proposed_sends())
        self.pending_groups.append((slot, self.net.submit(self.runner.negotiate(req, self._decide))))

    def _decide(self, reqs: Sequence[JoinRequest]) -> Decision:
        """The leader's decision for a slot (runs on the leader's loop thread).

        Negotiations can overlap (a group may take longer to form than the gap between slots), so the
        members' requests may predate rounds the leader has just assigned: a fragment assigned at slot
        s stays busy until every member reports it sent since s and no longer in flight (or H steps pass).

        At a window's first slot the leader also sets N for a later window: the smallest N the
        members' links can carry (the slowest member paces every all-reduce), from the first window
        start that every member will have heard of it by (see :meth:`_schedule_start`).
        """
        step = max(r.step for r in reqs)
        pending = set()
        for f, at in list(self._assigned.items()):
            done = all(f < len(r.last_sent) and r.last_sent[f] >= at and f not in r.busy for r in reqs)
            if done or step - at > self.method.H:
                del self._assigned[f]
            else:
                pending.add(f)
        choice = choose_merged(step=step, H=self.method.H, last_sent=[r.last_sent for r in reqs],
                               busy=[r.busy for r in reqs] + [sorted(pending)], scores=[r.scores for r in reqs])
        if choice is not None:
            self._assigned[choice] = step
        proposals = [r.sends for r in reqs if r.sends is not None]
        if step % self.method.H or not proposals:
            return Decision(choice)
        return Decision(choice, (min(proposals), self._schedule_start(step)))

    def _schedule_start(self, slot: int) -> int:
        """The first window start after ``slot`` that is far enough away for every member to hold the
        slot's group by then: the group closes within a join window of its first request, a member
        that reached the slot late joins within another."""
        assert self.step_seconds is not None
        H = self.method.H
        lag = math.ceil((2 * self.cfg.join_window + 1.0) / self.step_seconds)
        return (slot + max(1, lag) + H - 1) // H * H

    def _start_negotiated(self, step: int) -> None:
        keep = []
        for slot, fut in self.pending_groups:
            if not fut.done():
                keep.append((slot, fut))
                continue
            try:
                group: Group = fut.result()
            except Exception as e:
                log.info("event=slot_skipped slot=%d reason=%s", slot, e)
                continue
            if group.schedule is not None:
                n, start = group.schedule
                if start <= step:
                    log.warning("event=schedule_late slot=%d start=%d step=%d", slot, start, step)
                try:
                    with self.lock:
                        self.outer.schedule_sends(n, start)
                except ValueError as e:  # a leader that does not follow the rule: keep our N
                    log.warning("event=schedule_refused slot=%d leader=%s reason=%s", slot, group.leader, e)
            busy = {r.fragment for r in self.in_flight}
            if group.fragment is None or group.fragment in busy:
                log.info("event=slot_skipped slot=%d leader=%s reason=%s", slot, group.leader[-8:],
                         "nothing to send" if group.fragment is None else f"fragment {group.fragment} busy here")
                continue
            log.info("event=slot_send slot=%d fragment=%d leader=%s members=%d schedule=%s", slot, group.fragment,
                     group.leader[-8:], len(group.members), group.schedule)
            req = JoinRequest(key=group.key, peer_id=self.peer_id, weight=0.0, fragment=group.fragment, step=step)
            self._send(group.fragment, step, req, group=group)
        self.pending_groups = keep

    def _proposed_sends(self) -> int | None:
        """CoCoDC's N that this peer's measured bandwidth and the step time allow (None: N is fixed by the
        config, or nothing was measured yet). The swarm uses the smallest of its members' (``_decide``)."""
        assert self.runner is not None and self.step_seconds is not None
        bw = self.runner.stats.bandwidth
        if bw <= 0 or getattr(self.method, "sends_per_window", 1) is not None:
            return None
        frag_bytes = max(self.codec.encoded_size(f.numel) for f in self.frags)
        return sends_per_window(H=self.method.H, P=len(self.frags), step_time=self.step_seconds,
                                fragment_bytes=frag_bytes, bandwidth=bw)

    # -- data parallel: a blocking gradient all-reduce every inner step
    def _ddp_step(self) -> None:
        """One data-parallel step. Every member's parameters fingerprint rides along; a member whose
        parameters left the majority (it missed a step's group) is excluded and takes the whole trainer
        state (parameters, AdamW moments, step) from a member of the majority before stepping on."""
        assert self.runner is not None and self.transport is not None
        t0 = time.perf_counter()
        self.trainer.model.train()
        loss, tokens = self.trainer.forward_backward()
        self.trainer.tokens_seen += tokens
        t1 = time.perf_counter()
        grads = list(self.trainer.gradients())
        step = self.trainer.step_count
        with self.lock:
            print_ = [float(p.detach().double().sum()) for p in self.trainer.params.values()]
        req = JoinRequest(key=f"g{step}", peer_id=self.peer_id, weight=float(tokens), fragment=0, step=step)
        stats = self.runner.stats

        async def _reduce() -> Any:
            assert self.transport is not None
            try:
                group = await self.transport.form_group(req, None, timeout=self.cfg.join_timeout)
                res = await self.transport.allreduce(group, 0, grads, float(tokens), self.codec,
                                                     timeout=self.method.timeout, fingerprint=print_)
                stats.bytes_sent += res.bytes_sent
                stats.bytes_received += res.bytes_received
                stats.complete += 1
                return res
            except RoundFailed as e:
                log.info("event=ddp_step_missed step=%d reason=%s", step, e)
                stats.failed += 1
                return None

        res = self.net.call(_reduce(), self.cfg.join_timeout + self.method.timeout + 5)
        t2 = time.perf_counter()
        if res is not None and res.divergent:
            self._ddp_repair(res.contributors)
        elif res is not None:
            with self.lock:  # the state provider must not read half-updated parameters
                for g, a in zip(grads, res.tensors, strict=True):
                    g.copy_(a)
                self.trainer.optimizer_step()
        else:
            # We missed this step's group: a lone update would fork our parameters. Drop the gradient;
            # the next step's fingerprint shows whether we must take the swarm's state.
            with self.lock:
                self.trainer.optimizer.zero_grad(set_to_none=True)
                self.trainer.step_count += 1
        self.compute += (t1 - t0) + (time.perf_counter() - t2)
        self.stall += t2 - t1
        self.last_loss = loss
        self.loss_log.append((time.time(), self.trainer.step_count, loss))
        self._step_metrics(tokens, loss)
        if self.checkpoints is not None:
            self.checkpoints.after_round(self)
        if self.metrics is not None:
            self.metrics.rounds.labels(fragment="grad", outcome="complete" if res is not None else "failed").inc()

    def _ddp_repair(self, majority: Sequence[str]) -> None:
        assert self.transport is not None
        for peer in majority:
            if peer == self.peer_id:
                continue
            try:
                raw = self.net.call(self.transport.fetch_state(peer, "outer", timeout=self.cfg.join_timeout),
                                    self.cfg.join_timeout + 5)
                self._load_ddp_state(state_from_bytes(raw, f"state from {peer}"))
                self.repairs += 1
                log.warning("event=repaired what=ddp_state from=%s", peer)
                return
            except (RoundFailed, TimeoutError, ValueError, KeyError) as e:
                log.info("event=repair_failed peer=%s reason=%s", peer, e)

    def _load_ddp_state(self, state: dict[str, Any]) -> None:
        with self.lock:
            names = list(self.trainer.params)
            self.trainer.apply_outer(names, [state["params"][n] for n in names])
            self.trainer.optimizer.load_state_dict(state["optimizer"])
            self.trainer.optimizer.zero_grad(set_to_none=True)
            self.trainer.step_count = int(state["step"])

    # ------------------------------------------------------------------ the end
    def _drain(self) -> None:
        """Apply what is still in flight (waiting at most ``drain_timeout``)."""
        if self.outer is None:
            return
        deadline = time.perf_counter() + self.cfg.drain_timeout
        step = max(self.last_lstep, self.logical_step())
        for rnd in sorted(self.in_flight, key=lambda r: r.send_step):
            if not rnd.done.wait(max(0.0, deadline - time.perf_counter())):
                log.warning("event=round_timeout key=%s when=leaving", rnd.key)
                self.stuck += 1
                rnd.abort()
            if rnd.arrived:
                self._apply(rnd, step)
        self.in_flight = []

    def _status(self) -> None:
        if self.on_status is None or self.runner is None:
            return
        st = self.runner.stats
        self.on_status({"step": self.trainer.step_count, "loss": self.last_loss,
                        "tokens_per_second": self.trainer.tokens_seen / self.compute if self.compute else 0.0,
                        "rounds": st.complete + st.partial, "failed": st.failed, "in_flight": st.in_flight,
                        "logical_step": self.last_lstep})

    def _summary(self, wall: float) -> PeerSummary:
        st = self.runner.stats if self.runner else None
        outer = {} if self.outer is None else {n: t.clone() for n, t in self.outer.outer_params().items()}
        if self.outer is None:
            outer = {n: p.detach().float().clone() for n, p in self.trainer.params.items()}
        return PeerSummary(
            peer_id=self.peer_id, steps=self.trainer.step_count, wall_seconds=wall, compute_seconds=self.compute,
            stall_seconds=self.stall, rounds_complete=st.complete if st else 0, rounds_partial=st.partial if st else 0,
            rounds_failed=st.failed if st else 0, rounds_applied=self.applied, repairs=self.repairs,
            bytes_sent=st.bytes_sent if st else 0, bytes_received=st.bytes_received if st else 0,
            final_train_loss=self.last_loss, outer_params=outer, applied=dict(self.applied_log),
            loop_seconds=self.loop_seconds, drain_seconds=self.drain_seconds, stuck_rounds=self.stuck,
            eval_seconds=self.eval_seconds)
