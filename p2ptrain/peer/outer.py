"""A swarm peer of an outer-loop method (diloco, streaming, eager, cocodc, dilocox): the compute loop.

After every inner step the peer moves its :class:`~p2ptrain.driver.OuterDriver` through the logical steps
that passed (the swarm's shared clock, :mod:`p2ptrain.peer.base`), over a
:class:`~p2ptrain.peer.collective.SwarmCollective`. Its replica's state for the rest of the swarm (versions,
state service, catch-up, repair) is a :class:`~p2ptrain.peer.replica.ReplicaState`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch

from ..algo.bequest import Bequest
from ..algo.configs import DDPConfig
from ..algo.fragments import make_fragments, model_units
from ..algo.outer_loop import OuterLoop
from ..algo.rounds import ApplyReport, Round
from ..driver import DriverHooks, OuterDriver
from . import bequest
from .base import PeerBase
from .replica import ReplicaState

__all__ = ["Peer", "steps_to_advance"]

log = logging.getLogger(__name__)


def steps_to_advance(last: int, now: Callable[[], int], max_behind: int) -> Iterator[int]:
    """The logical steps an outer loop at ``last`` advances through, up to the clock's ``now()`` (``now()``
    itself again when the clock did not move). A step more than ``max_behind`` behind the clock as it comes up
    is skipped (its sends could meet no group: the others sent theirs long ago), so that a peer whose rounds
    kept it waiting catches up with the swarm's clock instead of sending ever older round keys. It resumes at
    the last multiple of ``max_behind`` (the same grid on every peer of the run): peers that fell behind
    together resume on the same step and send the same round keys from there. The rounds it has in flight are
    applied at the next step it does take (a round is due at or after its step), before that step's sends
    (:class:`~p2ptrain.driver.OuterDriver`: sent first, a round would carry θ from before them)."""
    target = now()
    if target <= last:
        yield target
        return
    step = last + 1
    while step <= target:
        clock = now()
        if step < clock - max_behind:
            step = clock - clock % max(1, max_behind)  # > clock - max_behind, on the common grid
            target = max(target, step)
        yield step
        step += 1


class _Hooks(DriverHooks):
    def __init__(self, peer: Peer) -> None:
        self.peer = peer

    def after_send(self, rnd: Round) -> None:
        self.peer.replica.record_send(rnd)

    def repair(self, rnd: Round, taking: Callable[[], None]) -> bool:
        p = self.peer  # training while it fetches, if its steps are its own and do not drive its clock
        idle = p.overlap_step if p.own_steps and not p.lockstep else None
        return p.replica.repair(rnd, p.peer_id, p.download, taking, idle)

    def after_apply(self, rnd: Round, report: ApplyReport | None) -> None:
        p = self.peer
        p.replica.record_apply(rnd)
        if p.checkpoints is not None:
            p.checkpoints.count()  # saved after the step (the lock is held here)
        if p.metrics is not None and report is not None:
            p.metrics.staleness.observe(report.delay)
            if report.correction_norm:
                p.metrics.correction.set(report.correction_norm)


class Peer(PeerBase):
    """One peer of a swarm running an outer-loop method (any transport). ``ddp`` is :class:`DDPPeer`'s."""

    kind: ClassVar[str] = "outer"
    has_outer_loop: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if isinstance(self.method, DDPConfig):
            raise ValueError("ddp has no outer loop: run it as a DDPPeer (p2ptrain.peer.make_peer picks the kind)")
        self.frags = make_fragments(model_units(self.trainer.model), self.method.fragments,
                                    self.method.fragment_mode)  # type: ignore[arg-type]
        self.outer = OuterLoop(self.method, self.frags, seed=self.seed)
        self.replica = ReplicaState(self.outer, self.trainer, self.frags, self.lock, self._rounds_in_flight)
        self.driver: OuterDriver | None = None
        self.start_digests: list[str] = []  # digest of θ per fragment when start() returned
        self._synced_after_warmup = False
        self._applied_before = 0  # rounds applied before this run (resumed from a checkpoint)
        self._tokens_resumed: list[int] | None = None
        self.estate: bytes | None = None  # our will while we leave, served as the state ``bequest``
        self._bequests_resumed: list[Bequest] = []
        self._unseen_resumed: dict[str, Any] = {}

    @property
    def keep_applied(self) -> bool:
        return self.replica.keep_applied

    @keep_applied.setter
    def keep_applied(self, value: bool) -> None:
        self.replica.keep_applied = value

    def _rounds_in_flight(self) -> list[Round]:
        return list(self.driver.in_flight) if self.driver is not None else []

    # ------------------------------------------------------------------ what this kind adds to the lifecycle
    def _init_state(self, resumed: dict[str, Any] | None) -> None:
        assert self.collective is not None and self.step_seconds is not None
        with self.lock:
            self.outer.init(self.trainer)
            if resumed is not None:
                self.outer.load_state_dict(resumed["outer"])
        # A slot's decision reaches every member within two join windows (and a second of slack).
        lag = 1 if self.cfg.clock == "steps" else math.ceil((2 * self.cfg.join_window + 1.0) / self.step_seconds)
        # A send later than that meets no group either: a peer that far behind the clock skips ahead.
        self.max_behind = 10**9 if self.cfg.clock == "steps" else lag
        self.driver = OuterDriver(self.outer, self.trainer, self.collective, hooks=_Hooks(self), lock=self.lock,
                                  negotiate_at_slot=self.cfg.clock == "steps", slot_lag=lag)
        if self._tokens_resumed is not None and len(self._tokens_resumed) == len(self.driver.tokens_at_send):
            self.driver.tokens_at_send = list(self._tokens_resumed)
        for b in self._bequests_resumed:  # (a checkpoint of this run: the fragments are the same)
            self.driver.inherit(b)
        if resumed is not None:  # (the checkpoint's local model: the one the start may have trained on since)
            model = resumed["trainer"]["model"]
            with self.lock:
                self.driver.resume_unseen(self._unseen_resumed, lambda f: [model[n] for n in self.frags[f].names],
                                          int(resumed["trainer"]["tokens_seen"]))

    def _on_started(self) -> None:
        with self.lock:
            self.start_digests = self.replica.theta_digests()

    def _provide(self, name: str) -> bytes | None:
        if name == bequest.NAME:
            return self.estate
        return self.replica.provide(name)

    def _connected(self) -> None:
        self.link.serve_bequests(bequest.serve(self))

    def bequeath(self) -> None:
        bequest.bequeath(self)

    def _take_state(self, state: dict[str, Any], source: str, keep_progress: bool, catch_up: bool = True) -> None:
        held: dict[int, list[torch.Tensor]] = {}
        if self.driver is not None:
            with self.lock:
                if keep_progress:
                    for f, u in self.driver.unseen.counted_in(state.get("made"), self.peer_id).items():
                        held[f] = u.delta
                        self.driver.counted(f, u, source)
                else:  # the local progress is dropped: a held round's Δ is in it no more
                    self.driver.unseen.clear()
        self.replica.take(state, keep_progress, held)
        if not catch_up:
            with self.lock:
                self.replica.behind = {int(f) for f, _ in state.get("pending", [])}
            log.info("event=catch_up_deferred pending=%d", len(state.get("pending", [])))
            return
        t0, computed, steps = time.perf_counter(), self.compute, self.trainer.step_count
        # While the source's rounds are not applied yet, a peer that keeps its progress trains instead of waiting
        # (after its warm-up the wait was 17 s a start on average in churn, up to 90 s), if its steps are its own.
        self.replica.catch_up(source, state.get("pending", []), keep_progress, self.fetch,
                              deadline=time.monotonic() + self.method.timeout + self.cfg.join_timeout,
                              poll=0.25 * (self.step_seconds or 0.2),
                              idle=self.overlap_step if self.own_steps else None)
        stall = max(0.0, time.perf_counter() - t0 - (self.compute - computed))
        self.catchup_stall += stall
        if state.get("pending"):
            log.info("event=catch_up_done seconds=%.1f stall=%.1f steps=%d", time.perf_counter() - t0, stall,
                     self.trainer.step_count - steps)

    def checkpoint_state(self) -> dict[str, Any]:
        d = self.driver
        return {"outer": self.outer.state_dict() if self.outer.initialized else None,
                "applied": self.applied,
                "tokens_at_send": list(d.tokens_at_send) if d is not None else [0] * len(self.frags),
                # leavers' progress this peer holds for its next rounds (called under the lock: inherit waits)
                "bequests": [{"fragment": b.fragment, "tokens": b.tokens, "source": b.source, "d": b.displacement}
                             for bs in (d.bequests.values() if d is not None else ()) for b in bs],
                # rounds whose outcome a peer resumed from this checkpoint will not see: their Δ and tokens marks,
                # so that it learns from the state it takes whether they counted (p2ptrain/algo/unseen.py)
                "unseen": d.unseen_record() if d is not None else {}}

    def restore(self, state: dict[str, Any]) -> None:
        super().restore(state)
        counters = state["peer"]
        self._applied_before = int(counters["applied"])
        self.replica.repairs = int(counters["repairs"])
        self._tokens_resumed = [int(x) for x in counters["tokens_at_send"]]
        self._bequests_resumed = [Bequest(int(b["fragment"]), list(b["d"]), int(b["tokens"]), str(b["source"]))
                                  for b in counters.get("bequests", [])]
        self._unseen_resumed = counters.get("unseen") or {}

    @property
    def applied(self) -> int:
        return self._applied_before + (self.driver.applied if self.driver is not None else 0)

    @property
    def repairs(self) -> int:
        return self.replica.repairs

    @property
    def in_flight(self) -> list[Round]:
        return self._rounds_in_flight()

    @property
    def served_digests(self) -> list[list[str]]:
        return self.replica.served_digests

    @property
    def applied_log(self) -> dict[str, tuple[str, list[torch.Tensor]]]:
        return self.replica.digests()

    @property
    def history(self) -> list[tuple[str, tuple[str, ...], bool]]:
        return self.replica.history

    def theta(self) -> dict[str, torch.Tensor]:
        return dict(self.outer.outer_params()) if self.outer.initialized else super().theta()

    def _eval_params(self) -> dict[str, torch.Tensor] | None:
        return dict(self.outer.outer_params())

    def _applied_digests(self) -> dict[str, tuple[str, list[torch.Tensor]]]:
        return self.replica.digests()

    def _closed(self) -> None:
        self.replica.close()

    # ------------------------------------------------------------------ the compute loop
    def step(self) -> None:
        self._inner_step()
        self.after_step()

    def after_step(self) -> None:
        """The outer loop's part after an inner step (taken here, or by a staged driver): every logical step
        that passed since the last call."""
        assert self.driver is not None and self.runner is not None
        lstep = self.logical_step()
        if time.monotonic() < self._warm_until:
            # Until the swarm has had time to see our announcement (and we theirs), a round could form
            # from views that disagree on who is live and split into groups: train locally meanwhile.
            self.last_lstep = max(self.last_lstep, lstep)
            return
        if self.runner.needs_resync.is_set():
            self.runner.needs_resync.clear()
            log.warning("event=resync reason=round state differs from the swarm's")
            self.sync_from_swarm(keep_progress=True)
        if not self._synced_after_warmup:
            # The swarm moved on while we warmed up (rounds applied, low-rank ranks adapted): take its
            # outer state again, keeping the local progress made since the first sync.
            self._synced_after_warmup = True
            if self.cfg.sync_on_join:
                self.sync_from_swarm(keep_progress=True)
            with self.lock:  # (a round sent after our checkpoint has ended by now: its word came, or never will)
                self.driver.unseen.since_checkpoint.clear()
        assert self.collective is not None
        t0, waited, computed = time.perf_counter(), self.collective.stall, self.compute
        done = self.last_lstep
        for step in steps_to_advance(done, self.logical_step, self.max_behind):
            if step > done + 1:
                log.info("event=steps_skipped first=%d last=%d reason=behind the swarm's clock", done + 1, step - 1)
            self.driver.advance(step)
            done = lstep = max(done, step)
        # (less the inner steps a repair took while it fetched: compute, counted as such)
        self.outer_seconds += time.perf_counter() - t0 - (self.collective.stall - waited) - (self.compute - computed)
        self.last_lstep = max(self.last_lstep, lstep)
        if self.checkpoints is not None:
            self.checkpoints.save_if_due(self)

    def flush(self) -> None:
        """A leave by signal: the swarm's clock followed until every fragment has sent the progress no round
        carries yet (each at its own slot, so within H logical steps), at most ``leave_flush`` seconds. Without
        it a leaving peer's last ~H/2 steps of work never reach θ. It keeps training meanwhile (up to
        ``--steps``): a step taken before a fragment's last send reaches that fragment's θ, so about half of
        what it trains in the flush is kept, where idling kept none (the rest stays in its leave checkpoint).
        Not for a peer paced by its own steps (``clock="steps"``: its clock stops with its steps), nor in its
        warm-up (it has sent nothing yet)."""
        if self.driver is None or self.lockstep or self.step_seconds is None or time.monotonic() < self._warm_until:
            return
        left = self.driver.unsent()
        if not left:
            return
        t0, history = time.monotonic(), self.driver.stats.history
        deadline, mark = t0 + self.cfg.leave_flush, len(history)
        log.info("event=leave_flush fragments=%s budget=%.0f step=%d", ",".join(map(str, left)), self.cfg.leave_flush,
                 self.trainer.step_count)
        while left and time.monotonic() < deadline:
            if self.trainer.step_count < self.cfg.steps:
                self._inner_step()
                self._status()
            else:
                wake = (self.logical_step() + 1) * self.step_seconds  # the next logical step, on the swarm's clock
                time.sleep(max(0.0, min(wake - time.time(), deadline - time.monotonic())) + 0.001)
            self.after_step()
            # one send per fragment: a round that fails gives its tokens back, and a peer left alone must not
            # wait out the whole budget for rounds that cannot form
            sent = {f for _, kind, f in history[mark:] if kind == "send"}
            left = [f for f in self.driver.unsent() if f not in sent]
        log.info("event=leave_flushed seconds=%.1f unsent=%s step=%d", time.monotonic() - t0,
                 ",".join(map(str, left)) or "none", self.trainer.step_count)

    def drain(self) -> None:
        """Apply what is still in flight (waiting at most ``drain_timeout`` in all), training while it is not in
        (see :meth:`_train_while_in_flight`)."""
        if self.driver is None or self.collective is None:
            return
        self.collective.deadline = time.perf_counter() + self.cfg.drain_timeout
        try:
            self._train_while_in_flight(self.collective.deadline)
            self.driver.drain(max(self.last_lstep, self.logical_step()))
        finally:
            self.collective.deadline = None

    def _train_while_in_flight(self, deadline: float) -> None:
        """Inner steps (up to ``--steps``) while a round this peer sent has not ended: a leave's drain after its
        flush waited about 10 s so in churn, idle. What they train no round carries: it goes with the leave's
        bequest to a peer that stays (or into its leave checkpoint). Not for a peer whose steps are not its own
        or drive its clock."""
        if not self.own_steps or self.lockstep:
            return
        assert self.driver is not None and self.collective is not None
        steps = self.trainer.step_count
        while (self.trainer.step_count < self.cfg.steps and time.perf_counter() < deadline
               and any(not self.collective.ended(r) for r in self.driver.in_flight if r.live)):
            self._inner_step()
        if self.trainer.step_count > steps:
            log.info("event=trained_while_draining steps=%d", self.trainer.step_count - steps)
