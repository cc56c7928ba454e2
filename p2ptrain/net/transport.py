"""The Transport contract: how a peer forms a group for a round and all-reduces with it.

Two implementations share one contract test suite: :mod:`p2ptrain.net.memory`
(an in-process swarm that can delay, drop and partition) and
:mod:`p2ptrain.net.swarm` (hivemind's libp2p DHT and streams).

A round is named by a swarm-unique ``key``. Every peer that reaches it calls
:meth:`Transport.form_group` with a :class:`JoinRequest`; the round's leader (a
deterministic choice among the live peers, no coordinator) closes the group when
every live peer has joined or its join window expires, and decides the fragment
when the peers left that to it (CoCoDC: summed drift scores). Then each member
calls :meth:`Transport.allreduce` once per phase. Members that fail or time out
are dropped; the others average among themselves with renormalised weights and
the result says so (``partial``). Every network wait has a timeout.
"""

from __future__ import annotations

import abc
import enum
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..collective.codecs import Codec
from .hedged import hedged_download
from .offers import Offers

__all__ = [
    "Answered",
    "Decide",
    "Decision",
    "Declined",
    "Dropped",
    "Group",
    "Inherit",
    "JoinRequest",
    "Moved",
    "PeerInfo",
    "ReduceResult",
    "RoundFailed",
    "StateMismatch",
    "StateProvider",
    "Transport",
    "TransportState",
    "Unreachable",
    "positive",
]


#: An heir's answer to a bequest (Transport.serve_bequests): (sender, the state it downloaded) -> None when taken,
#: or why not.
Inherit = Callable[[str, bytes], Awaitable[str | None]]


class RoundFailed(RuntimeError):
    """A round could not complete at all (no group, or nothing averaged): the caller aborts it."""


class Unreachable(RoundFailed):
    """The peer could not be reached at all: its dial failed (it left, or its host is gone), or a partition blocks
    it. Unlike an answer that says "not yet", asking again soon is unlikely to help."""


class Dropped(RoundFailed):
    """The peer's side closed the exchange before a byte of its answer (over libp2p: its daemon took the stream, then
    it ended): the peer is there, but this message was not answered. Unlike :class:`Unreachable`, it says nothing of
    whether the peer can be reached."""


class Answered(RoundFailed):
    """The peer answered a request with an error (e.g. "not offered yet"): it is alive and reachable."""


class Declined(Answered):
    """The peer answered that it does not have what was asked and never will (the round it belonged to ended there
    without it: :meth:`Offers.end`). Unlike "not yet", asking it again cannot help."""


class Moved(RoundFailed):
    """The round's group formed here moved to a smaller leader forming the same round (``leader``): join it there."""

    def __init__(self, key: str, leader: str) -> None:
        super().__init__(f"round {key}: the group moved to {leader[-8:]}")
        self.leader = leader


class StateMismatch(RoundFailed):
    """This peer's round state (e.g. its low-rank ranks) differs from the group's: it must resync."""


#: At most this many unreachable leaders named in one join request (a longer list is cut, not trusted further).
MAX_SKIPPED = 16
#: At most this many peers a join request says it counts toward the quorum beyond the view, each id this long.
MAX_KNOWN, MAX_ID = 4096, 128


@dataclass
class JoinRequest:
    """What a peer brings to a round's leader.

    ``fragment`` is the fragment the peer's fixed schedule sends, or None to let the
    leader decide from ``scores`` (drift per fragment), ``busy`` (fragments in flight)
    and ``last_sent`` (step of each fragment's last send, -1 for never). ``sends`` is
    the sends per window this peer's link could carry (CoCoDC's N, for the leader to agree on).
    """

    key: str
    peer_id: str
    weight: float
    fragment: int | None = None
    scores: list[float] | None = None
    busy: list[int] = field(default_factory=list)
    last_sent: list[int] = field(default_factory=list)
    step: int = 0
    abstain: bool = False  # "I am here but sit this round out": counts as joined, is not a member
    signature: str = ""  # the shape of what this peer will send (e.g. low-rank ranks): must match the group's
    sends: int | None = None
    region: str = ""  # the region the peer announces (hierarchical rounds group members by it)
    skipped: tuple[str, ...] = ()  # leaders this peer found unreachable for this round (not to be named again)
    # peers this one counts toward a quorum beyond the live view (a region gone dark: net/groups.py): a leader
    # that joined while its region was cut off never saw the others, its members did
    known: tuple[str, ...] = ()
    # one form_group call's own nonce: the leader answers a member that asks again with the same ticket (its
    # first reply was lost) with its group; a new call for a closed round (another ticket) is refused
    ticket: str = ""
    # what this peer proposes for the round's phase timeout (phase_timeout.PhaseTimeout.terms): its budget in seconds (None:
    # no record of its own yet) and its slowest link's measured rate in bytes/s (None: none measured); the leader
    # closes the group with the median of each, so that every member has the same deadlines
    budget: float | None = None
    rate: float | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"key": self.key, "peer": self.peer_id, "weight": self.weight, "fragment": self.fragment,
                "scores": self.scores, "busy": self.busy, "last_sent": self.last_sent, "step": self.step,
                "abstain": self.abstain, "sig": self.signature, "sends": self.sends, "region": self.region,
                "skipped": list(self.skipped), "known": list(self.known), "ticket": self.ticket,
                "budget": self.budget, "rate": self.rate}

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> JoinRequest:
        return cls(key=str(m["key"]), peer_id=str(m["peer"]), weight=float(m["weight"]),
                   fragment=None if m.get("fragment") is None else int(m["fragment"]),
                   scores=None if m.get("scores") is None else [float(x) for x in m["scores"]],
                   busy=[int(x) for x in m.get("busy", [])], last_sent=[int(x) for x in m.get("last_sent", [])],
                   step=int(m.get("step", 0)), abstain=bool(m.get("abstain", False)), signature=str(m.get("sig", "")),
                   sends=None if m.get("sends") is None else int(m["sends"]), region=str(m.get("region", "")),
                   skipped=tuple(str(p) for p in m.get("skipped", ())[:MAX_SKIPPED]),
                   known=tuple(str(p)[:MAX_ID] for p in _listed(m.get("known"))[:MAX_KNOWN]),
                   ticket=str(m.get("ticket", ""))[:MAX_ID], budget=positive(m.get("budget")),
                   rate=positive(m.get("rate")))


def _listed(v: Any) -> list[Any]:
    """``v`` if it is a list (a wire field that should be one), else empty."""
    return v if isinstance(v, list) else []


def positive(v: Any) -> float | None:
    """``v`` as a float if it is a finite positive number (a wire field), else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if math.isfinite(f) and f > 0 else None


@dataclass(frozen=True)
class Decision:
    """A round leader's decision: the fragment (None: nothing to send) and, optionally, a schedule
    ``(N, from_step)``: CoCoDC's sends per window from logical step ``from_step`` on."""

    fragment: int | None
    schedule: tuple[int, int] | None = None


#: The leader's decision from all members' requests: a Decision, or just the fragment.
Decide = Callable[[Sequence[JoinRequest]], "int | Decision | None"]
#: Serves named state (e.g. "outer", "before:f1.L40") as bytes; None when it has none.
StateProvider = Callable[[str], "bytes | None"]


@dataclass(frozen=True)
class Group:
    """A formed round: sorted members, its leader, the agreed fragment and schedule (see Decision), the
    region each member announced (``regions[i]`` is ``members[i]``'s; empty when nobody said), and the terms of its
    phase timeout: the median of the budgets and of the link rates its members proposed (JoinRequest; None when
    none did)."""

    key: str
    members: tuple[str, ...]
    leader: str
    fragment: int | None
    signature: str = ""
    schedule: tuple[int, int] | None = None
    regions: tuple[str, ...] = ()
    budget: float | None = None
    rate: float | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"key": self.key, "members": list(self.members), "leader": self.leader, "fragment": self.fragment,
                "sig": self.signature, "schedule": None if self.schedule is None else list(self.schedule),
                "regions": list(self.regions), "budget": self.budget, "rate": self.rate}

    @classmethod
    def from_wire(cls, g: dict[str, Any]) -> Group:
        sched = g.get("schedule")
        if sched is not None:
            n, start = (int(x) for x in sched)  # ValueError/TypeError unless exactly two integers
            if n < 1 or start < 0:
                raise ValueError(f"schedule {sched!r}: N must be positive and its first step non-negative")
            sched = (n, start)
        return cls(str(g["key"]), tuple(str(m) for m in g["members"]), str(g["leader"]),
                   None if g.get("fragment") is None else int(g["fragment"]), str(g.get("sig", "")), sched,
                   tuple(str(r) for r in g.get("regions", ())), positive(g.get("budget")), positive(g.get("rate")))

    def __post_init__(self) -> None:
        if list(self.members) != sorted(set(self.members)):
            raise ValueError("group members must be sorted and unique")
        if self.regions and len(self.regions) != len(self.members):
            raise ValueError(f"a group of {len(self.members)} members came with {len(self.regions)} regions")

    def region_of(self) -> dict[str, str]:
        """Each member's region ('' for all when the group carries none)."""
        return dict(zip(self.members, self.regions or ("",) * len(self.members), strict=True))


@dataclass
class ReduceResult:
    """One phase's outcome at one member."""

    tensors: list[torch.Tensor]
    total_weight: float
    members: tuple[str, ...]
    contributors: tuple[str, ...]  # whose share is in the average (every part)
    partial: bool  # someone was dropped, or a part fell back to zero
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    divergent: bool = False  # this peer's outer parameters disagreed with the majority's
    # the fingerprint of the majority's θ (None: nobody sent one): a divergent peer's repair takes θ only from a
    # source whose θ has it, never from another divergent one
    agreed: tuple[float, ...] | None = None
    verify_bytes: int = 0  # of it, what verified aggregation cost: claims sent and evidence received
    verify_seconds: float = 0.0  # from the results being in to every part judged
    liars: tuple[str, ...] = ()  # members proven to have lied in this phase (banned)
    verify_tallied: int = 0  # parts whose checks were summed as their chunks arrived (net/tally.py)
    verify_audits: int = 0  # chunks of parts this member audited exactly (a random draw: it fetched their contributions)
    # seconds from the phase's start to each step's end (butterfly: "sent", "gathered", "aggregated",
    # "results", "relays", "verified", "results_out"), to see where a round's time goes
    timeline: dict[str, float] = field(default_factory=dict)
    # [lo, hi) ranges of the phase's values (its tensors flattened and concatenated) whose average does not hold
    # this member's share (a part that left it out or was left out itself, a shard its cell's mean never reached),
    # though it may be a contributor elsewhere: what it sent there is in no average, and its method keeps that
    # progress for the next round (OuterLoop.finish ``keep``) instead of merging it away
    missing: tuple[tuple[int, int], ...] = ()


@dataclass
class PeerInfo:
    """One peer's announcement (refreshed by heartbeat, expires on its own)."""

    peer_id: str
    region: str = ""
    step: int = 0
    logical_step: int = 0
    tokens_per_second: float = 0.0
    bandwidth: float = 0.0  # bytes/s, measured
    loss: float = float("nan")
    maddrs: list[str] = field(default_factory=list)
    expires: float = 0.0
    method: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    last_seen: float = 0.0  # seconds since this announcement was made (set by the transport that read it)

    def to_wire(self) -> dict[str, Any]:
        return {"peer": self.peer_id, "region": self.region, "step": self.step, "lstep": self.logical_step,
                "tps": self.tokens_per_second, "bw": self.bandwidth, "loss": self.loss, "maddrs": self.maddrs,
                "method": self.method, "extra": self.extra}

    @classmethod
    def from_wire(cls, m: dict[str, Any], expires: float = 0.0) -> PeerInfo:
        return cls(peer_id=str(m["peer"]), region=str(m.get("region", "")), step=int(m.get("step", 0)),
                   logical_step=int(m.get("lstep", 0)), tokens_per_second=float(m.get("tps", 0.0)),
                   bandwidth=float(m.get("bw", 0.0)), loss=float(m.get("loss", float("nan"))),
                   maddrs=[str(a) for a in m.get("maddrs", [])], expires=expires, method=str(m.get("method", "")),
                   extra=dict(m.get("extra", {})))


class TransportState(enum.Enum):
    """A transport is OPEN from its creation (connected, serving) until :meth:`Transport.aclose`: CLOSED."""

    OPEN = "open"
    CLOSED = "closed"


class Transport(abc.ABC):
    """One peer's view of the swarm (see the module docstring). An async context manager: ``async with``
    closes it (:meth:`aclose`, idempotent)."""

    peer_id: str
    state: TransportState = TransportState.OPEN
    #: Bytes served by name beside the state provider's, fetched with :meth:`fetch_state` (a round's shard).
    offers: Offers

    async def __aenter__(self) -> Transport:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def serve_wanted(self, limit: float) -> float:
        """Before a graceful close: keep serving what this peer offers that is still wanted (the shards it carried
        for its cell in a round: :class:`Offers`) until it was fetched or its round's deadline passed, at most
        ``limit`` seconds. Returns the seconds waited."""
        return await self.offers.served(limit)

    async def aclose(self) -> None:
        """Stop everything the transport runs (background tasks, connections); then it is CLOSED."""
        self.state = TransportState.CLOSED

    def traffic(self) -> dict[str, dict[str, int]]:
        """Bytes of this peer's messages so far, ``{kind: {"sent": …, "received": …}}`` (net/traffic.py); empty when
        this transport does not count them (in-memory)."""
        return {}

    async def rtt(self, peer: str, *, tries: int = 3, timeout: float = 5.0, gap: float = 0.0) -> float | None:
        """Round-trip time to ``peer`` in seconds (the fastest of ``tries`` small requests, ``gap`` seconds
        apart), or None when this transport cannot tell (in-memory) or the peer does not answer within
        ``timeout``."""
        return None

    @abc.abstractmethod
    async def form_group(self, request: JoinRequest, decide: Decide | None, *, timeout: float) -> Group:
        """Join round ``request.key``; returns the group once the leader closes it. RoundFailed if this
        peer is not in it (too late, leader unreachable) or ``timeout`` passes. An abstaining request
        counts as joined (the group need not wait for it) and gets the group without being a member."""

    @abc.abstractmethod
    async def allreduce(self, group: Group, phase: int, tensors: Sequence[torch.Tensor], weight: float,
                        codec: Codec, *, timeout: float, fingerprint: Sequence[float] | None = None) -> ReduceResult:
        """Weighted mean of every member's ``tensors`` (fp32 sums, ``codec`` on the wire). Members that fail
        are dropped; RoundFailed only if nothing at all could be averaged."""

    @abc.abstractmethod
    async def announce(self, info: PeerInfo) -> None:
        """Publish (refresh) this peer's announcement."""

    @abc.abstractmethod
    async def peers(self) -> list[PeerInfo]:
        """The live peers of the run (unexpired announcements), this one included."""

    @abc.abstractmethod
    async def leave(self) -> None:
        """Withdraw this peer's announcement (a graceful departure)."""

    @abc.abstractmethod
    def serve_state(self, provider: StateProvider) -> None:
        """Answer other peers' state requests with ``provider(name)`` (bytes, or None if unknown).
        The provider is called on the loop thread and must be thread-safe."""

    @abc.abstractmethod
    def serve_bequests(self, accept: Inherit) -> None:
        """Take what leaving peers bequeath to this one (:meth:`bequeath`): ``accept(sender, data)`` is called on
        the loop with the state downloaded from the sender, and says None when it took it, or why it did not."""

    @abc.abstractmethod
    async def bequeath(self, peer_id: str, name: str, *, timeout: float) -> str | None:
        """Ask ``peer_id`` to download our state ``name`` (served by our provider) as its bequest: None when it
        took it, or why it did not; RoundFailed when it cannot be reached or does not answer in ``timeout``."""

    @abc.abstractmethod
    async def fetch_state(self, peer_id: str, name: str, *, timeout: float,
                          progress: Callable[[int, int], None] | None = None) -> bytes:
        """Download the state called ``name`` from ``peer_id`` (chunked and verified where the transport
        crosses a network; ``timeout`` bounds each wait); RoundFailed if it has none, does not answer,
        dies mid-transfer or sends bytes that do not match the hash it announced."""

    async def download_state(self, sources: Sequence[str], name: str, *, timeout: float,
                             progress: Callable[[int, int], None] | None = None,
                             hedge: float | None = None) -> tuple[str, bytes]:
        """Download ``name`` from the first of ``sources`` that delivers it whole: (source, bytes).
        A source that fails mid-transfer is skipped and the download starts again from the next. ``hedge``: seconds
        without a first chunk after which the next source is asked as well (:mod:`p2ptrain.net.hedged`); None:
        one at a time."""
        async def one(peer: str, seen: Callable[[int, int], None]) -> bytes:
            return await self.fetch_state(peer, name, timeout=timeout, progress=seen)

        return await hedged_download(one, sources, hedge=hedge, failure=RoundFailed, progress=progress,
                                     what=f"state {name!r}")


