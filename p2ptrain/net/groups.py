"""Group forming, shared by every transport: the rules (pure functions) and one round's forming (:class:`Forming`).

A round's group is formed by its leader, the smallest live peer id: it collects the members' join
requests and closes the group once every live peer joined (checked again on a fresh view of who is
live) or the join window, counted from the first join, expired, whichever comes first. A group is
closed once: a join that arrives later is refused, and a join that was still looking at who is live
when another one closed the group takes that group instead of closing it again.

Quorum: a group that holds no more than half of the peers its leader saw live when it closed (and of the peers
its members count beyond their views, see :meth:`Forming.reported`) averages
nothing (every joiner gets RoundFailed, the progress stays in θ − θ_i). Two leaders whose views of who is
live disagree can each close a group for one round key; both applying would fork θ, and two disjoint
groups cannot each hold more than half of one view. A cut-off minority (a region partitioned away) waits
instead of training a θ of its own. A group short of its quorum when the window ends stays open a little longer
(:data:`GRACE`) for peers that are only late, and closes as soon as the quorum is there.

Merging: views that disagree (a DHT read during a partition, a peer that joined a moment ago) can give one round
two leaders, each short of its quorum though their groups together hold one (the churn benchmark: 6 + 6 joiners of
17 counted, twice 7 + 7 of 15). A leader whose window ends short of its quorum tells the live peers that did not
join it that it leads the round (:attr:`Forming.on_short`). Another leader of that round answers
(:meth:`Forming.told`): the larger of the two :meth:`moves <Forming.move>` its group to the smaller (its joiners get
:class:`~.transport.Moved` and join there), unless it may not: a group moves only while short of its own quorum and
when none of its joiners found the other leader unreachable; then the other one moves if it may. The group that moves
sends whom it counted, and the merged group must hold a quorum of that as well (a three-way split must not apply
twice): the quorum rule itself is unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence

from .transport import MAX_ID, MAX_KNOWN, Decide, Decision, Group, JoinRequest, Moved, RoundFailed, StateMismatch

log = logging.getLogger(__name__)

__all__ = ["GRACE", "Forming", "LiveView", "agreed_fragment", "agreed_print", "alone_check", "close_group", "fingerprints_match",
           "half_or_less", "leader_of", "majority_fingerprint", "members_by_signature", "membership_check", "peer_ids",
           "quorum_problem", "unseen_check", "versioned"]

#: Seconds (at most the join window itself) a leader keeps a group open after its join window while the group
#: holds no quorum of who is live: the members it lacks may only be late (a compute thread held by the round
#: before, a peer just woken). Closed at once, it fails for every joiner (churn benchmark: in 4 of the 10 rounds
#: that failed everywhere, the largest group and the peers that came after it closed would have made a quorum).
#: It closes as soon as the quorum is there; joiners' own waits bound it too (they ask for window + 10 s).
GRACE = 4.0

#: Who is live now (this peer included); ``fresh=True`` asks for a view read just now, not a cached one.
LiveView = Callable[[bool], Awaitable[Collection[str]]]


class Forming:
    """One round's group while its leader forms it: the requests, the first join's time, the decisions
    offered, the closed event and the group once closed.

    ``window`` is the join window in seconds; ``clock`` the monotonic clock the deadlines are on.
    """

    def __init__(self, key: str, window: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.key, self.window, self.clock = key, window, clock
        self.requests: dict[str, JoinRequest] = {}
        self.decides: dict[str, Decide] = {}  # by joiner: the closing leader's own is used
        self.first = 0.0
        self.created = clock()
        self.closed = asyncio.Event()
        self.group: Group | None = None
        self.refusal: str | None = None  # why the closed group averages nothing (no quorum), or None
        self.moved: str | None = None  # the smaller leader this round's group moved to (see the module docstring)
        #: Called once when the window ends short of the quorum (the grace begins): the leader says it leads.
        self.on_short: Callable[[], None] | None = None
        self._told = False
        self.expected: set[str] = set()  # joiners of a group that moved here, on their way (the grace waits for them)
        self.counted: set[str] = set()  # whom the quorum counted when the group was last looked at
        self.merged_counted: set[str] = set()  # whom the leaders of groups that moved here counted
        self.extra_grace = 0.0  # seconds added to the grace once a group moves here

    def join(self, request: JoinRequest, decide: Decide | None = None) -> None:
        """Record a join request (and the decision rule its peer offers, used if that peer closes as
        the leader). RoundFailed if the group is already closed: a late joiner is not a member. A member that
        asks again with its first request's ticket (our reply to its first join was lost) is answered with its
        group, as the others are."""
        if self.group is not None:
            first = self.requests.get(request.peer_id)
            if (request.ticket and first is not None and first.ticket == request.ticket
                    and request.peer_id in self.group.members):
                return
            raise RoundFailed(f"round {self.key}: the group closed before {request.peer_id[-8:]} joined")
        if self.moved is not None:
            raise Moved(self.key, self.moved)
        if not self.requests:
            self.first = self.clock()
        self.requests[request.peer_id] = request
        if decide is not None:
            self.decides[request.peer_id] = decide

    def reported(self, leader: str | None = None) -> set[str]:
        """The peers the joiners count toward a quorum beyond their views (``JoinRequest.known``: a region gone
        dark), that the leader counts too: a leader that joined while its region was cut off never saw the
        others, and alone would find a quorum in its region (measured: a cut region applied a round of its own,
        led by a peer that had joined it during the cut). An id counts when two joiners name it, or the only
        joiner besides the leader: one peer naming made-up ids cannot keep a larger group from its quorum."""
        others = [r for p, r in self.requests.items() if p != leader]
        counts = Counter(p for r in others for p in set(r.known))
        need = min(2, len(others))
        return {p for p, n in counts.items() if n >= need} if need else set()

    def everyone_joined(self, live: Collection[str]) -> bool:
        return set(live) <= set(self.requests)

    def window_left(self) -> float:
        """Seconds until the join window (from the first join) expires; 0 once it has."""
        return max(0.0, self.first + self.window - self.clock())

    def grace_left(self) -> float:
        """Seconds of the grace after the window (:data:`GRACE` of it at most, more once a group moved here) still
        left; 0 once spent."""
        return max(0.0, self.first + self.window + min(self.window, GRACE) + self.extra_grace - self.clock())

    def _counted(self, live: Collection[str], leader: str | None,
                 known: Callable[[], Collection[str]] | None) -> set[str]:
        """Whom the quorum counts: ``live``, the peers ``known()`` (seen lately), those the joiners report, and those
        the leaders of groups that moved here counted (a merged group must hold a quorum of every view it joins)."""
        return set(live) | set(known() if known is not None else ()) | self.reported(leader) | self.merged_counted

    # ------------------------------------------------------------------ merging (see the module docstring)
    def skipped(self) -> set[str]:
        """The leaders our joiners found unreachable this round: never a leader to move our group to."""
        return {p for r in self.requests.values() for p in r.skipped}

    def may_move_to(self, leader: str) -> bool:
        """Whether our group may move to ``leader``: still forming, short of its quorum, and no joiner of ours
        found ``leader`` unreachable (it would not follow the move)."""
        return (self.group is None and self.moved is None and leader not in self.skipped()
                and self.short_of_quorum(self.counted))

    def expect(self, joiners: Collection[str], counted: Collection[str]) -> None:
        """A group moves here: wait for its ``joiners`` (a grace longer once), and count whom its leader counted."""
        if joiners and not self.extra_grace:
            self.extra_grace = min(self.window, GRACE)
        self.expected |= set(joiners)
        self.merged_counted |= set(counted)

    def told(self, me: str, teller: str, joiners: Collection[str], counted: Collection[str],
             skipped: Collection[str]) -> dict[str, object]:
        """``teller`` leads this round too (its group short of its quorum, its ``joiners``, whom it ``counted``, the
        leaders its joiners ``skipped``): our reply. The smaller of us leads, unless the other cannot move (it holds
        a quorum, or a joiner of its found the smaller unreachable): we move (and say whom we sent), or stay and say
        so (and wait for its joiners if it will move here)."""
        if self.group is not None or self.moved is not None:
            return {"ok": True}
        if teller < me and self.may_move_to(teller):
            self.move(teller)
            return {"ok": True, "joiners": sorted(self.requests), "counted": sorted(self.counted)}
        if me not in set(skipped):  # the teller will move here (it is short, and its joiners can reach us)
            self.expect(joiners, counted)
        return {"leader": me, "stay": True}

    def answered(self, peer: str, reply: Mapping[str, object]) -> None:
        """``peer``'s reply to our saying we lead this round (see :meth:`told`)."""
        if reply.get("leader") == peer and reply.get("stay") and self.may_move_to(peer):
            self.move(peer)
        elif isinstance(reply.get("joiners"), list):
            self.expect(peer_ids(reply.get("joiners")), peer_ids(reply.get("counted")))

    def short_of_quorum(self, live: Collection[str], drop: Collection[str] = ()) -> bool:
        """Whether the group, closed now, would hold no quorum of ``live`` (see :func:`quorum_problem`)."""
        alive = set(self.requests) - set(drop)
        return quorum_problem(self.key, alive, set(live) - set(drop)) is not None

    def move(self, leader: str) -> bool:
        """Send this round's joiners (waiting or still to come) to ``leader``, another one forming the same round;
        False if the group has closed or moved already."""
        if self.group is not None or self.moved is not None:
            return False
        self.moved = leader
        log.info("event=group_moved key=%s to=%s joined=%d", self.key, leader[-8:], len(self.requests))
        self.closed.set()
        return True

    def close(self, leader: str | None = None, *, drop: Collection[str] = (),
              live: Collection[str] | None = None) -> Group:
        """Close the group once (every later call returns the same group): the members of the most common
        signature among the requests not in ``drop``, led by ``leader`` (by default the smallest of them),
        with the fragment they proposed or the one ``leader``'s decision rule picks. ``live``: who the
        leader sees live as it closes; the group is refused (:attr:`refusal`) if it has no quorum of them."""
        assert self.moved is None, "a group that moved does not close"
        if self.group is None:
            alive = {p: r for p, r in self.requests.items() if p not in drop}
            if leader is None:
                members = members_by_signature(alive)
                leader = leader_of(members) if members else ""
            self.group = close_group(self.key, alive, leader, self.decides.get(leader))
            if live is not None:
                self.refusal = quorum_problem(self.key, alive, set(live) - set(drop))
            # One line per group a leader closes: the churn benchmark's logs then show how a round split (which
            # leaders, how many joined each, of how many counted live).
            log.info("event=group_closed key=%s leader=%s joined=%d members=%d counted=%d late_s=%.1f quorum=%s",
                     self.key, leader[-8:], len(alive), len(self.group.members),
                     len(set(live or ()) | set(alive)), max(0.0, self.clock() - self.first - self.window),
                     self.refusal is None)
            self.closed.set()
        return self.group

    async def until_closed(self, live: LiveView, *, leader: str | None = None, drop: Collection[str] = (),
                           deadline: float = math.inf, poll: float = math.inf,
                           known: Callable[[], Collection[str]] | None = None) -> Group:
        """Wait for the group to close, closing it (see :meth:`close`) as soon as it is due: every live peer
        joined, the join window expired, or ``deadline`` (on ``clock``) passed. Who is live is looked at
        again at least every ``poll`` seconds. Never waits past the window or the deadline. RoundFailed
        (for every caller alike) if the group closed without a quorum of who was live (and of ``known()``:
        peers seen live lately whose announcements expired, see SwarmConfig.quorum_memory)."""
        while self.group is None and self.moved is None:
            now_live = await live(False)
            # Everyone in view joined: close at once (on a fresh view only), unless that holds no quorum of whom we
            # count (the view lacks peers the joiners know of): then wait out the window and the grace for them, or
            # for a merge.
            if self.everyone_joined(now_live) and not self.short_of_quorum(self._counted(now_live, leader, known), drop):
                now_live = await live(True)
            if self.group is not None or self.moved is not None:
                break  # closed (or moved) by another join while we looked at who is live: never close twice
            counted = self.counted = self._counted(now_live, leader, known)
            short = self.short_of_quorum(counted, drop)
            due = (self.everyone_joined(now_live) and not short) or self.clock() >= deadline or (
                self.window_left() <= 0 and (self.grace_left() <= 0 or not (short or self.expected - set(self.requests))))
            if due:
                self.close(leader, drop=drop, live=counted)
                break
            if short and self.window_left() <= 0 and not self._told and self.on_short is not None:
                self._told = True  # short of the quorum as the grace begins
                self.on_short()
            try:
                await asyncio.wait_for(self.closed.wait(), min(poll, self.window_left() or self.grace_left(),
                                                               max(0.0, deadline - self.clock())))
            except TimeoutError:
                pass
        if self.moved is not None:
            raise Moved(self.key, self.moved)
        if self.refusal is not None:
            raise RoundFailed(self.refusal)
        assert self.group is not None
        return self.group


def peer_ids(value: object) -> set[str]:
    """The peer ids in a peer's list (at most MAX_KNOWN; anything that is not a string of MAX_ID at most is dropped)."""
    return ({p for p in value[:MAX_KNOWN] if isinstance(p, str) and len(p) <= MAX_ID} if isinstance(value, list)
            else set())


def half_or_less(count: int, of: int) -> bool:
    """Whether ``count`` of ``of`` is no majority (``of`` > 1): a group, or a part, that could be one side of a
    cut whose other side holds as much (the quorum, and the parts rules of net/parts.py and net/memory.py)."""
    return of > 1 and 2 * count <= of


def quorum_problem(key: str, joined: Collection[str], live: Collection[str]) -> str | None:
    """Why a group of the peers that ``joined`` a round must not average, or None: it holds no more than
    half of everyone the leader knows to be live (``live`` ∪ ``joined``). See the module docstring."""
    everyone = set(live) | set(joined)
    if half_or_less(len(set(joined)), len(everyone)):
        return (f"round {key}: no quorum: {len(set(joined))} of {len(everyone)} live peers joined (a group must "
                f"hold more than half, or two groups could apply one round)")
    return None


def leader_of(live: Sequence[str]) -> str:
    """The round leader: the smallest live peer id (every peer computes the same from the same view)."""
    if not live:
        raise ValueError("no live peers")
    return min(live)


def agreed_fragment(requests: Sequence[JoinRequest]) -> int | None:
    """The fragment a fixed schedule sends: what the members proposed (the most common, ties to the
    smallest), or None if none proposed one."""
    proposed = [r.fragment for r in requests if r.fragment is not None]
    if not proposed:
        return None
    counts = Counter(proposed)
    best = max(counts.values())
    return min(f for f, c in counts.items() if c == best)


def close_group(key: str, requests: Mapping[str, JoinRequest], leader: str, decide: Decide | None) -> Group:
    """The group a leader closes from the requests it holds: the members of the most common signature,
    the fragment they proposed, else the one ``decide`` picks (with the schedule it may set); the terms of its
    timeout: the median of the budgets and of the link rates the members proposed (phase_timeout.PhaseTimeout.terms:
    every member's deadlines are then the same). The median, not the largest budget and the slowest rate: one
    member whose meter saw its sends cut off by a partition (a rate far below its link's) held every round of the
    group it was in to 80 s and more (churn, f1.L598629010), and one that lies could hold them to the bound."""
    members = tuple(members_by_signature(requests))
    reqs = [requests[m] for m in members]
    decision = Decision(agreed_fragment(reqs))
    if decision.fragment is None and decide is not None and reqs:
        try:
            d = decide(reqs)
        except Exception:  # the leader's own failure: the group closes without a fragment (this slot sends
            log.exception("event=decide_failed key=%s", key)  # nothing) rather than striking its joiners
            d = Decision(None)
        decision = d if isinstance(d, Decision) else Decision(d)
    budgets = [r.budget for r in reqs if r.budget is not None]
    rates = [r.rate for r in reqs if r.rate is not None]
    return Group(key, members, leader, decision.fragment, reqs[0].signature if reqs else "", decision.schedule,
                 tuple(r.region for r in reqs) if any(r.region for r in reqs) else (),
                 statistics.median(budgets) if budgets else None, statistics.median(rates) if rates else None)


#: The scale of a fingerprint's version element (:func:`versioned`): 2⁻⁶⁰ (exact for integers below 2⁵³), so that
#: any two versions differ by far less than :func:`fingerprints_match`'s absolute tolerance.
VERSION_SCALE = 2.0 ** -60


def versioned(version: int, print_: Sequence[float]) -> list[float]:
    """A fingerprint of θ led by θ's version (the send step of the last round applied into it), as −version·2⁻⁶⁰.

    The element never decides whether two prints match (two versions differ by less than 1e-9, the absolute
    tolerance), only which of two versions of θ an even vote picks (:func:`majority_fingerprint` breaks ties by the
    prints' order, the smallest first: the highest version). Broken by the θ's sums alone, the tie went either way:
    a cell of members that had been cut off while two rounds of a fragment were applied everywhere else met a
    cell that had applied them, with the third region cut off, and the stale θ won (churn benchmark,
    churn_bequest2, f1.L598627330: two rounds applied by 11 of 16 peers repaired away)."""
    return [-float(version) * VERSION_SCALE, *(float(v) for v in print_)]


def fingerprints_match(a: Sequence[float], b: Sequence[float], rtol: float = 1e-5) -> bool:
    """Chunk sums of two copies of θ agree within ``rtol`` of their magnitude (robust to last-bit
    differences between devices, not to real divergence)."""
    if len(a) != len(b):
        return False
    return all(abs(x - y) <= rtol * (abs(x) + abs(y) + 1e-12) + 1e-9 for x, y in zip(a, b, strict=True))


def majority_fingerprint(prints: Mapping[str, Sequence[float]]) -> set[str]:
    """The peers whose fingerprint agrees with the largest agreeing set (ties: the set whose θ's fingerprint sorts
    first, so that every vote between the same versions of θ picks the same one, whoever casts it: the shards of a
    hierarchical round are voted by different carriers). Peers outside it hold a divergent θ and must not
    contribute."""
    peers = sorted(prints)
    best: set[str] = set()
    best_print: tuple[float, ...] = ()
    for p in peers:
        same = {q for q in peers if fingerprints_match(prints[p], prints[q])}
        mine = tuple(float(v) for v in prints[min(same)])
        if len(same) > len(best) or (len(same) == len(best) and same != best and mine < best_print):
            best, best_print = same, mine
    return best


def agreed_print(prints: Mapping[str, Sequence[float]], agree: set[str]) -> tuple[float, ...] | None:
    """The fingerprint of the majority's θ (:func:`majority_fingerprint`'s ``agree``), None without prints."""
    voters = sorted(agree & set(prints))
    return tuple(float(v) for v in prints[voters[0]]) if voters else None


def alone_check(group: Group, me: str, live: Sequence[str]) -> None:
    """A group of one while other peers are alive means the others met elsewhere (or we could not
    reach them): averaging with ourselves would move our θ away from theirs. Raise RoundFailed; the
    progress stays in θ − θ_i and goes into the next round."""
    if group.members == (me,) and set(live) - {me}:
        raise RoundFailed(f"round {group.key}: alone in the group while {len(set(live) - {me})} other peers are live")


def unseen_check(group: Group, me: str, seen: Collection[str], pointed: bool, age: float, memory: float) -> None:
    """A group of one from a peer that joined through initial peers (``pointed``) and has ``seen`` no other peer
    of its run in its ``age`` seconds, less than ``memory`` (``quorum_memory``): its swarm may be behind a cut it
    cannot tell from an empty swarm, since it never saw the others go dark (measured: churn_outvoted_cell
    f3.L598583870, a peer that finished its start-up inside a cut region applied two rounds alone, 1 of 1 live,
    while the rest applied the same keys with another θ). Raise RoundFailed; its progress goes into its next round,
    and after ``memory`` seconds alone it trains as the first peer of a new swarm."""
    if group.members == (me,) and pointed and not set(seen) - {me} and age < memory:
        raise RoundFailed(f"round {group.key}: alone, and no other peer of the run seen in the {age:.0f} s since "
                          f"joining through --initial-peers (a cut may hide them): waiting up to {memory:.0f} s")


def members_by_signature(requests: Mapping[str, JoinRequest]) -> list[str]:
    """The joined (non-abstaining) peers whose signature is the most common one (ties: the signature
    of the smallest peer id). Peers with another signature would send payloads of other shapes."""
    live = {p: r for p, r in requests.items() if not r.abstain}
    if not live:
        return []
    counts = Counter(r.signature for r in live.values())
    best = max(counts.values())
    sig = next(live[p].signature for p in sorted(live) if counts[live[p].signature] == best)
    return sorted(p for p, r in live.items() if r.signature == sig)


def membership_check(group: Group, request: JoinRequest) -> None:
    """RoundFailed for a joiner left out of the group; StateMismatch if it was left out for its signature."""
    if request.peer_id in group.members or request.abstain:
        return
    if group.signature and request.signature != group.signature:
        raise StateMismatch(f"round {group.key}: our round state differs from the group's; resync")
    raise RoundFailed(f"round {group.key}: not a member of the group")
