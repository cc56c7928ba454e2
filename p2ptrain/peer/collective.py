"""A swarm peer's collective: the driver's rounds on the real round runner, across the thread seam.

The driver runs on the compute thread; rounds run on the network loop (:class:`~p2ptrain.sync.NetLoop`,
:class:`~p2ptrain.sync.RoundRunner`). :class:`SwarmCollective` is the one place where the two meet for the
outer loop: a launch is a ``submit`` to the loop, a wait is a bounded wait on the round's completion event, a
slot negotiation is a future whose decision the leader makes on its own loop thread with the driver's
:class:`~p2ptrain.algo.slots.SlotLeader`. Every wait has a limit: a round that outlives its own timeouts is
aborted here and counted as stuck; one that a leaving peer's drain limit cuts short first is counted as
abandoned (the peer left mid-round, as a dead member does; the others end it without it).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from ..algo.priority import sends_per_window
from ..algo.rounds import Round
from ..algo.slots import SlotLeader
from ..collective.codecs import Codec
from ..driver import RoundRequest, SlotOutcome, SlotRequest
from ..net.transport import Decision, Group, JoinRequest
from ..sync import NetLoop, RoundRunner

__all__ = ["SwarmCollective"]

log = logging.getLogger(__name__)


class _GroupPending:
    """A slot negotiation on the network loop; its result is the group the slot's leader formed."""

    def __init__(self, fut: concurrent.futures.Future[Group]) -> None:
        self.fut = fut

    def done(self) -> bool:
        return self.fut.done()

    def result(self) -> SlotOutcome:
        group = self.fut.result(timeout=0)
        return SlotOutcome(group.fragment, group.schedule, group, group.leader, len(group.members))


class SwarmCollective:
    """The :class:`~p2ptrain.driver.Collective` of a swarm peer.

    Args:
        net, runner: the network loop and the round runner on it.
        peer_id: this peer's id (its join requests carry it).
        region: the region this peer announces (its join requests carry it: hierarchical rounds, net/hierarchy.py).
        codec: the wire codec (for CoCoDC's N: bytes per fragment on the wire).
        join_timeout: seconds a slot's group may take to form.
        wait_limit: seconds the compute thread waits for one round before it aborts it as stuck (beyond the
            round's own timeouts, which normally end it first), scaled as the runner stretches them.
        step_seconds: the swarm's step duration now (for CoCoDC's N).
    """

    #: Seconds between two looks at the runner's timeout scale while a wait goes on.
    RECHECK = 1.0

    def __init__(self, net: NetLoop, runner: RoundRunner, *, peer_id: str, codec: Codec, join_timeout: float,
                 wait_limit: float, step_seconds: Callable[[], float | None], region: str = "") -> None:
        self.net, self.runner, self.peer_id, self.codec, self.region = net, runner, peer_id, codec, region
        self.join_timeout, self.wait_limit, self._step_seconds = join_timeout, wait_limit, step_seconds
        self._done: weakref.WeakKeyDictionary[Round, threading.Event] = weakref.WeakKeyDictionary()
        self.members = 1  # the live view's size, refreshed by the peer's heartbeat
        self.stall = 0.0  # seconds the compute thread waited for rounds
        self.stuck = 0  # rounds aborted here: their own timeouts never fired
        self.abandoned = 0  # rounds still within their own limits when the leave's drain limit (deadline) ended
        self.deadline: float | None = None  # perf_counter time every wait ends by (leaving: the drain's limit)

    def launch(self, rnd: Round, request: RoundRequest) -> None:
        target: Group | JoinRequest
        if request.group is not None:
            target = request.group
        else:
            target = JoinRequest(key=request.key, peer_id=self.peer_id, weight=rnd.weight, fragment=request.fragment,
                                 step=request.step, signature=request.signature, region=self.region)
        done = self._done[rnd] = threading.Event()
        self.net.submit(self.runner.launch(rnd, target, fingerprint=request.fingerprint,
                                           fingerprint_of=rnd.theta if request.check_theta else None, done=done))

    def arrived(self, rnd: Round) -> bool:
        return rnd.arrived

    def ended(self, rnd: Round) -> bool:
        """Whether ``rnd``'s run here is over (arrived or failed): :meth:`wait` would not wait for it."""
        ev = self._done.get(rnd)
        return ev is None or ev.is_set()

    def wait(self, rounds: Sequence[Round]) -> bool:
        t0 = time.perf_counter()
        for r in rounds:
            ev = self._done.get(r)
            if ev is None:
                continue
            end = self._wait_one(ev, t0)
            if end == "ended":
                continue
            if end == "leaving":
                log.warning("event=round_abandoned key=%s reason=the leave's drain limit came before the round's own",
                            r.key)
                self.abandoned += 1
            else:
                log.warning("event=round_timeout key=%s%s", r.key, "" if self.deadline is None else " when=leaving")
                self.stuck += 1
            r.abort()
        self.stall += time.perf_counter() - t0
        return True

    def _wait_one(self, ev: threading.Event, t0: float) -> str:
        """Wait for one round from ``t0`` (perf_counter) on, until ``wait_limit`` times the runner's timeout scale
        as it is *now*: a round whose phases start after the wait did, on a link the runner stretched its
        timeout for, is given the longer time (read once at the start, the wait gave up after the old limit
        while the round went on, then aborted it). ``"ended"``, or why the wait stopped first: ``"limit"`` (the
        round outlived its own limit: stuck) or ``"leaving"`` (the drain's deadline came first)."""
        while True:
            own = t0 + self.wait_limit * self.runner.timeout_scale  # rounds on a slow link are given longer (sync.py)
            end = own if self.deadline is None else min(own, self.deadline)
            left = end - time.perf_counter()
            if left <= 0:
                if ev.is_set():
                    return "ended"
                return "leaving" if end < own else "limit"
            if ev.wait(min(left, self.RECHECK)):
                return "ended"

    def negotiate(self, request: SlotRequest, leader: SlotLeader) -> _GroupPending:
        req = JoinRequest(key=request.key, peer_id=self.peer_id, weight=1.0, fragment=None, scores=request.scores,
                          busy=request.busy, last_sent=request.last_sent, step=request.step, sends=request.sends,
                          region=self.region)

        def decide(views: Sequence[JoinRequest]) -> Decision:  # on the loop thread, when this peer leads
            return Decision(*leader.decide(views))

        return _GroupPending(self.net.submit(self.runner.negotiate(req, decide)))

    def settle(self, pending: Any) -> bool:
        t0 = time.perf_counter()
        try:
            pending.fut.result(timeout=self.join_timeout + 5)
        except Exception as e:  # the driver skips a slot that formed no group
            log.debug("event=slot_failed reason=%s", e)
        self.stall += time.perf_counter() - t0
        return True

    def expected_members(self) -> int:
        return max(1, self.members)

    def proposed_sends(self, H: int, P: int, numels: Sequence[int]) -> int | None:
        bw, step_seconds = self.runner.stats.bandwidth, self._step_seconds()
        if bw <= 0 or not step_seconds:
            return None
        frag_bytes = max(self.codec.encoded_size(n) for n in numels)
        return sends_per_window(H=H, P=P, step_time=step_seconds, fragment_bytes=frag_bytes, bandwidth=bw)
