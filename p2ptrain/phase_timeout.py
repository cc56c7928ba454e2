"""How long one phase of a round may take: :class:`PhaseTimeout`, and the terms a peer proposes for it.

A fixed timeout below a slow link's transfer time aborts every round half-way and sends it again (the wire then
carries several times the payload); one far above the rounds' time holds every member of a round that lost one for
most of it. So a phase's timeout follows the measured link and the recent rounds. It is the same at every member of
a round: each proposes its *terms* (a budget and a link rate) when it joins, the leader closes the group with the
median of each (net/groups.py ``close_group``), and each member sizes the phase by those.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence

import torch

from .collective.codecs import Codec
from .net.transport import Group

__all__ = ["PhaseTimeout"]

log = logging.getLogger(__name__)


class PhaseTimeout:
    """One peer's phase timeouts: its record of recent phases, the stretch after phases that ran into their
    deadline, and its slowest link's rate (``link_rate``: bytes/s, 0 before any is measured)."""

    #: A phase may take this many times its expected transfer time at the measured bandwidth.
    SLACK = 3.0
    #: ... and at most this many times the method's timeout (a frozen member must not hold rounds forever).
    MAX_STRETCH = 8.0
    #: Bytes/s a link is assumed to carry before any is measured (10 Mbit/s: a slow WAN link). Without it the first
    #: round of a large fragment between regions got the method's timeout whatever its size: 4 peers in 2 regions at
    #: 20 Mbit/s cut the first diloco round's cross-region shards off half-way, every time (the bytes sent for
    #: nothing were most of the wire). A faster link ends the round early; a dead member holds it longer, once.
    FIRST_RATE = 10e6 / 8
    #: Once rounds have completed, a phase's timeout is at most this many times the slowest of the recent
    #: complete ones (never under :data:`QUICK_FLOOR` seconds, never over the method's): a member that froze or
    #: died holds a round for about half its timeout, and 60 s for rounds that take 2 stalled every peer in it
    #: for half a minute at each fault.
    QUICK = 5.0
    QUICK_FLOOR = 10.0

    def __init__(self, round_timeout: float, codec: Codec, link_rate: Callable[[], float]) -> None:
        self.round_timeout, self.codec, self.link_rate = round_timeout, codec, link_rate
        self.stretch = 1.0  # doubled after a phase that ran into its deadline, halved after one well inside it
        self.quick: collections.deque[float] = collections.deque(maxlen=16)  # seconds of recent complete phases
        self.scale = 1.0  # the last phase's timeout over the method's (the peer's waits scale with it)

    def terms(self) -> tuple[float | None, float | None]:
        """What this peer proposes for a round's phase timeout, as (budget in seconds, rate in bytes/s).

        The budget: the method's timeout, cut to :data:`QUICK` times the slowest recent complete phase (at least
        :data:`QUICK_FLOOR`) once there is a record of them, times the stretch after phases that ran into their
        deadline. The rate: the slowest link's measured rate, or :data:`FIRST_RATE` before any is measured, over
        the stretch (a stretched timeout covers the transfer time too). Either is None while this peer has no word
        of its own to add to the method's timeout and :data:`FIRST_RATE` (no record, nothing measured, no stretch).

        The round's leader closes its group with the median budget and rate proposed (net/groups.py
        ``close_group``), so that every member's deadlines are the same: each used its own, and a peer that had
        just started (no record: the method's whole timeout) waited for a shard, and applied the round, that the
        others (5 × their recent phases: 17 s) had given up on: a round applied by 2–5 of 15 members, a θ the
        majority had to repair away (churn benchmark, churn_bequest2: 10 such rounds, f3.L598627070)."""
        stretched = self.stretch > 1.0
        budget = None
        if len(self.quick) >= 3 or stretched:
            base = self.round_timeout
            if len(self.quick) >= 3:
                base = min(base, max(self.QUICK_FLOOR, self.QUICK * max(self.quick)))
            budget = min(base * self.stretch, self.MAX_STRETCH * self.round_timeout)
        measured = self.link_rate()
        rate = (measured or self.FIRST_RATE) / self.stretch if measured > 0 or stretched else None
        return budget, rate

    def timeout_for(self, payload: Sequence[torch.Tensor], members: int, group: Group | None = None) -> float:
        """Seconds one phase of ``members`` may take to all-reduce ``payload``: the budget, or :data:`SLACK` times
        the expected transfer (each member sends and receives 2/k of the payload over each link, at the rate) if
        that is longer; at most :data:`MAX_STRETCH` times the method's timeout and at least the method's or
        :data:`QUICK_FLOOR`, whichever is less. The budget and rate are ``group``'s, the terms its leader closed
        it with (the method's timeout and :data:`FIRST_RATE` where it has none), or, without a group, this peer's
        own (:meth:`terms`)."""
        budget, rate = (group.budget, group.rate) if group is not None else self.terms()
        high = self.MAX_STRETCH * self.round_timeout
        # (a leader's terms are held to the bounds every member would hold its own to: what it says can only
        # choose inside them, and every member then uses the same value)
        budget = min(max(budget or self.round_timeout, min(self.round_timeout, self.QUICK_FLOOR)), high)
        need = 0.0
        if members > 1:  # (the per-link meters count sends cut off by a timeout too)
            nbytes = self.codec.encoded_size(sum(t.numel() for t in payload))
            need = self.SLACK * 2.0 * nbytes / members / (rate or self.FIRST_RATE)
        timeout = min(max(budget, need), high)
        self.scale = max(1.0, timeout / self.round_timeout)
        return timeout

    def took(self, seconds: float, timeout: float, *, late: bool) -> None:
        """A phase ended after ``seconds`` of its ``timeout``; ``late``: it failed or lost members.

        A late phase stretches the timeout only while no link has been measured: once one has, the timeout follows
        the slowest link's measured rate (:meth:`timeout_for`; a send cut off by its deadline is measured too), and a
        phase that ran into its deadline on a measured link waited for a member that froze, died or was cut off,
        not for bytes. Stretched for those (churn benchmark: up to 8×, 240 s), every later round that lost a member
        held its peers, and their compute threads (which wait in proportion), for minutes."""
        if late and seconds >= 0.45 * timeout and self.link_rate() <= 0:  # the link may be slower than assumed
            self.stretch = min(self.MAX_STRETCH, 2.0 * self.stretch)
            log.info("event=round_timeout_stretched seconds=%.1f timeout=%.1f stretch=%g", seconds, timeout,
                     self.stretch)
        elif not late and seconds < 0.25 * timeout:
            self.stretch = max(1.0, self.stretch / 2.0)
        if not late:
            self.quick.append(seconds)
