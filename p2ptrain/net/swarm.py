"""The real swarm: hivemind's libp2p daemon and Kademlia DHT, our own protocols on its streams.

* **Discovery and membership** live in the DHT under the run id: every peer stores
  its announcement (region, step, throughput, bandwidth, multiaddrs) as a subkey of
  ``<run>.peers`` with an expiry, refreshed by heartbeat; the live peers are the
  unexpired subkeys; the shared pacing rides on the announcements (peer/link.py).
* **Groups** are formed per round by a leader, the smallest live peer id: members
  send ``join`` on a libp2p stream and the leader answers, once every live peer
  joined or its window expired, with the sorted member list (and, for CoCoDC, the
  fragment it chose from everyone's drift scores). An unreachable leader (its
  hello unanswered within :data:`LEADER_PROBE`, or its join failed) is skipped
  for the next one.
* **All-reduce** is our own butterfly over libp2p streams with msgpack frames, not
  hivemind's ``AllReduceRunner``: we need our codecs (4-bit E3M0, fp8, low-rank
  phases), weights renormalised over the members that actually contributed, an
  explicit record of who did (a dead peer's share must not silently stay
  un-averaged), a fingerprint of every member's θ so a divergent replica is
  excluded and repaired, and bounded reads of everything that arrives. A missing
  part is fetched from any member that has it; if nobody has it, that slice of the
  pseudo-gradient is zero this round on every survivor alike.

The pieces live in modules of their own: the daemon and the config (net/daemon.py),
the stream protocols (net/streams.py), group forming (net/groups.py), the
all-reduce (net/allreduce.py, with net/mailbox.py, net/chunks.py, net/parts.py).
Every network wait has a timeout; background tasks belong to the transport's
TaskGroup and end with :meth:`HivemindTransport.aclose`; an all-reduce's tasks
belong to its run and end with it.

Why it is long: it is the one class that implements the whole Transport contract on the real network
(lifecycle, discovery, groups, all-reduce, state, recontact); each part is a few lines that call
into the modules above.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import secrets
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import torch

from ..collective.butterfly import part_bounds, stream_chunk
from ..collective.codecs import Codec
from .allreduce import ButterflyRun
from .audit import Audit
from .auth import MAC_FIELD
from .bandwidth import LinkMeter
from .contacts import Addresses, Contacts
from .daemon import SwarmConfig, SwarmError, dial, start_p2p
from .direct import Direct
from .groups import Forming, alone_check, leader_of, membership_check, peer_ids, unseen_check
from .guard import Guard
from .identity import Identity
from .mailbox import Mailbox, Mailboxes
from .offers import Offers
from .state_transfer import StateServer, fetch_chunked
from .streams import ChunkSource, Streams, Trailer
from .transport import (
    MAX_KNOWN,
    MAX_SKIPPED,
    Decide,
    Dropped,
    Group,
    Inherit,
    JoinRequest,
    Moved,
    PeerInfo,
    ReduceResult,
    RoundFailed,
    StateProvider,
    Transport,
    TransportState,
)
from .wire import SCHEMA_ERRORS

__all__ = ["HivemindTransport", "SwarmConfig", "SwarmError", "start_p2p"]

#: Seconds an heir waits for each answer while it downloads a bequest (a leaver's will: net/transport.py).
BEQUEST_WAIT = 30.0

log = logging.getLogger(__name__)

#: Re-pings of known peers in flight at once (a sweep over dozens of peers takes seconds, not minutes).
RECONTACT_AT_ONCE = 8

#: Seconds a joiner waits for the leader to answer a hello before it sends its join. A join is answered only when
#: the group closes (the window, maybe a grace), so its timeout (window + 10 s) cannot tell a leader that waits for
#: joiners from one that is frozen or cut off: a joiner spent that whole timeout on it and came to the next leader
#: after its group had closed (the churn benchmark: joins that timed out on a stopped or partitioned leader).
LEADER_PROBE = 3.0

#: Redirects a joiner follows in one round (a leader that names a smaller one, a group that moved: net/groups.py).
MAX_HOPS = 3

#: Live peers that did not join a leader short of its quorum that it tells it leads the round: the smallest ids
#: (a peer leads when its id is the smallest its view shows, so the other leaders of a round are among them).
#: Bounded so that a leader cut off with a minority does not send a message to every peer of a large swarm a round.
MAX_TOLD = 16

#: Seconds a caller waits for a read of who is live (a DHT get, up to :data:`VIEW_READ` s) before it goes on with the
#: view it has; the read goes on and updates the view for later callers. A join's handler waited for its own read,
#: up to 5 s, before it looked at the group: after a region cut, reads were slow, and the churn benchmark saw 9 of 18
#: joiners come "after the group closed", their answers all within 0.1 s of the close (round f0.L598567560).
VIEW_WAIT = 1.0
#: Seconds one read of who is live may take (then the view stays as it was).
VIEW_READ = 5.0
#: A view older than this (or none yet: a peer that just started) is waited for, up to VIEW_READ, not VIEW_WAIT.
VIEW_STALE = 10.0
#: A read slower than this is logged (``event=view_read_slow``).
VIEW_SLOW = 2.0
#: Seconds a closing transport waits for its all-reduces' deliveries still on their way (each is bounded by its round).
DELIVERY_GRACE = 10.0


class HivemindTransport(Transport):
    """A :class:`Transport` over hivemind's P2P daemon and DHT (create with :meth:`create`)."""

    def __init__(self, cfg: SwarmConfig, p2p: Any, node: Any, identity: Identity | None = None) -> None:
        self.cfg, self.p2p, self.node, self.identity = cfg, p2p, node, identity
        self.peer_id = str(p2p.peer_id)
        self.offers = Offers()
        self._forming: dict[str, Forming] = {}
        self._live: list[PeerInfo] = []
        self._region = ""  # the region this peer announces
        self._seen_at: dict[str, tuple[float, str]] = {}  # peer -> (when a view last showed it live, its region)
        self._live_at = -math.inf  # never read yet (monotonic() starts near 0 after a boot)
        self._born = time.monotonic()  # a peer that never saw another waits this long alone (groups.unseen_check)
        self._reading: asyncio.Task[None] | None = None  # the read of who is live in progress (one at a time)
        self._maddrs = Addresses(cfg.forget_after)
        self._states = StateServer(cfg.state_chunk, offers=self.offers)
        self._inherit: Inherit | None = None  # what we do with a bequest (serve_bequests)
        self.guard = Guard(cfg.guard)
        self.blocked: set[str] = set()  # fault injection: peers this one cannot reach (a partition)
        self.links = LinkMeter()
        self._left: set[str] = set()  # peers whose last announcement is a departure
        self._contacts = Contacts(cfg.ttl)  # peers heard from directly (after a split, the DHT lags: net/contacts.py)
        self.outsider_said = False  # told the user once that the run's records are keyed otherwise
        self.mailboxes = Mailboxes(self.guard, cfg.max_message, run_id=cfg.run_id, verify=cfg.verify)
        self.streams = Streams(cfg, p2p, self.guard, lambda peer: peer in self.blocked, self._addresses)
        if cfg.direct:
            host, port = cfg.direct_listen()
            self.streams.direct = Direct(self.peer_id, host=host, port=port, announce=cfg.direct_announce,
                                         ask=self.streams.ask_direct, addresses=self._addresses,
                                         listen=not cfg.client_mode, congestion=cfg.direct_congestion)
        self._tasks: asyncio.TaskGroup | None = None
        self._deliveries: set[asyncio.Task[Any]] = set()  # all-reduce sends that outlive their run (_deliver)
        self._runner: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    async def create(cls, cfg: SwarmConfig) -> HivemindTransport:
        """Start the daemon and the DHT node (SwarmError if the swarm cannot be joined), serve our protocols
        and start the background tasks."""
        p2p, node, identity = await start_p2p(cfg)
        self = cls(cfg, p2p, node, identity)
        if self.streams.direct is not None:
            try:
                await self.streams.direct.start()
            except OSError as e:  # the port is taken or not ours: libp2p for everything
                log.warning("event=direct_unavailable reason=%s", e)
                self.streams.direct = None
        await self.streams.serve_direct()
        for kind, handler in (("join", self._on_join), ("part", self._on_part), ("result", self._on_result),
                              ("getpart", self._on_getpart), ("state", self._on_state),
                              ("check", self.mailboxes.accept_check), ("evidence", self.mailboxes.show_evidence),
                              ("verdict", self.mailboxes.accept_verdict), ("hello", self._on_hello),
                              ("lead", self._on_lead), ("bequest", self._on_bequest)):
            await self.streams.serve(kind, handler)
        started = asyncio.Event()
        self._runner = asyncio.create_task(self._background(started))
        await started.wait()
        return self

    async def _background(self, started: asyncio.Event) -> None:
        async with asyncio.TaskGroup() as tg:
            self._tasks = tg
            tg.create_task(self._recontact())
            started.set()
            await self._stop.wait()
            raise asyncio.CancelledError  # leave the TaskGroup: cancels and awaits its tasks

    async def aclose(self) -> None:
        """Stop background tasks, the DHT node and the daemon (idempotent)."""
        if self.state is TransportState.CLOSED:
            return
        self.state = TransportState.CLOSED
        if self._deliveries:
            # What our finished all-reduces still owe the others (our results, claims, verdicts): a graceful close
            # lets them arrive (each is bounded by its round's deadlines) before the task group is cancelled.
            await asyncio.wait(set(self._deliveries), timeout=DELIVERY_GRACE)
        self._stop.set()
        if self._runner is not None:
            self._runner.cancel()
            # Bounded (3.11's wait_for can swallow a cancellation): the node and daemon go down regardless.
            done, _ = await asyncio.wait({self._runner}, timeout=10)
            if not done:
                log.warning("event=transport_close status=background_tasks_still_running")
        if self.streams.direct is not None:
            await self.streams.direct.aclose()
        try:
            await asyncio.wait_for(self.node.shutdown(), 10)
        except (TimeoutError, Exception) as e:
            log.debug("event=dht_shutdown reason=%s", e)
        try:
            await asyncio.wait_for(self.p2p.shutdown(), 10)
        except (TimeoutError, Exception) as e:
            log.debug("event=p2p_shutdown reason=%s", e)

    async def visible_maddrs(self) -> list[str]:
        return [str(a) for a in await asyncio.wait_for(self.p2p.get_visible_maddrs(), self.cfg.dht_timeout)]

    # ------------------------------------------------------------------ DHT records
    def _key(self, what: str) -> str:
        return f"p2ptrain.{self.cfg.run_id}.{what}"

    async def announce(self, info: PeerInfo) -> None:
        from hivemind.utils import get_dht_time

        self._region = info.region
        if not info.maddrs:
            info.maddrs = await self.visible_maddrs()
        ok = await self._store("peers", info.to_wire(), get_dht_time() + self.cfg.ttl)
        if not ok:
            log.debug("event=announce_not_stored")

    async def leave(self) -> None:
        from hivemind.utils import get_dht_time

        # A DHT cannot delete: a short-lived tombstone replaces the announcement.
        await self._store("peers", {"peer": self.peer_id, "left": True}, get_dht_time() + self.cfg.ttl)

    async def _store(self, what: str, value: dict[str, Any], expiration: float) -> bool:
        """Store our record (our peer id is the subkey), tagged with the swarm key if there is one."""
        if self.cfg.swarm_key is not None:
            value = self.cfg.swarm_key.seal(value, self._key(what), self.peer_id)
        return bool(await asyncio.wait_for(self.node.store(self._key(what), value, expiration, subkey=self.peer_id),
                                           self.cfg.dht_timeout))

    async def _records(self, what: str) -> dict[str, tuple[dict[str, Any], float]]:
        from hivemind.utils import get_dht_time

        found = await asyncio.wait_for(self.node.get(self._key(what), latest=True), self.cfg.dht_timeout)
        if found is None or not isinstance(found.value, dict):
            return {}
        now, out, foreign = get_dht_time(), {}, []
        for sub, item in found.value.items():
            value, exp = item.value, item.expiration_time
            if not (exp > now and isinstance(value, dict) and isinstance(sub, str)):
                continue
            key = self.cfg.swarm_key
            if key is not None:
                if not key.verify(value, self._key(what), sub):
                    foreign.append(sub)
                    continue  # not from a member of this private swarm
                value = {k: v for k, v in value.items() if k != MAC_FIELD}
            elif MAC_FIELD in value:
                foreign.append(sub)
                continue  # a private swarm's record: nothing its members accept can come from this peer
            out[sub] = (value, exp)
        if foreign and not out.keys() - {self.peer_id}:
            self._say_outsider(what, len(foreign))
        return out

    def _say_outsider(self, what: str, n: int) -> None:
        """Once: this peer sees records of its run that it cannot take (another swarm key, or a key where it
        has none) and none that it can: the swarm will refuse it. Nothing of any key is shown."""
        if self.outsider_said:
            return
        self.outsider_said = True
        if self.cfg.swarm_key is None:
            why = "the run is private (its records carry a swarm key's tag): join with --swarm-key and the run's key file"
        else:
            why = (f"they are not tagged with this peer's swarm key (fingerprint {self.cfg.swarm_key.fingerprint}): "
                   "the run uses another key, or none; check --swarm-key")
        log.warning("event=swarm_refuses_this_peer run=%s records=%d kind=%s: %s", self.cfg.run_id, n, what, why)

    async def peers(self) -> list[PeerInfo]:
        from hivemind.utils import get_dht_time

        infos, now = [], get_dht_time()
        for sub, (value, exp) in (await self._records("peers")).items():
            if value.get("left"):
                self._left.add(sub)
                self._maddrs.forget(sub)
                continue
            if value.get("peer") != sub or sub in self.blocked:
                continue
            self._left.discard(sub)
            try:
                info = PeerInfo.from_wire(value, expires=exp)
            except (KeyError, TypeError, ValueError):
                continue
            info.last_seen = max(0.0, now - (exp - self.cfg.ttl))
            infos.append(info)
            self._maddrs.seen(info.peer_id, info.maddrs)
        self._live, self._live_at = infos, time.monotonic()
        for i in infos:
            self._seen_at[i.peer_id] = (self._live_at, i.region)
        return sorted(infos, key=lambda i: i.peer_id)

    def _known(self) -> set[str]:
        """Whom a round's quorum is counted of, beside the current view: the peers seen live within the last
        ``quorum_memory`` seconds (not departed, not banned) of every other region of which the view shows no more
        than half of those. A region gone dark is a cut (its peers still count: the side without a majority waits),
        and so is one the view shows a few peers of: inside a cut, the DHT still returns the records that happen to
        be stored on its side (churn_late f2.L598569180: a cut region counted 5 live peers, its own and one or two
        of the others, held 3 of them, a quorum, and applied the round as the majority did). A peer gone from a
        region the view still shows most of most likely died (a killed peer restarted under a new id must not count
        twice). A peer that announced no region counts for the whole ``quorum_memory``."""
        now, memory = time.monotonic(), self.cfg.quorum_memory
        for p in [p for p, (t, _) in self._seen_at.items() if now - t > memory or p in self._left]:
            del self._seen_at[p]
        in_view = {i.peer_id for i in self._live}
        recent: dict[str, set[str]] = {}
        for p, (_, region) in self._seen_at.items():
            recent.setdefault(region, set()).add(p)
        dark = {r for r, ps in recent.items()
                if not r or (r != self._region and 2 * len(ps & in_view) <= len(ps))}
        return {p for r in dark for p in recent[r] if not self.guard.is_banned(p)}

    async def _live_ids(self, max_age: float = 1.0, wait: float = VIEW_WAIT) -> list[str]:
        """Who is live: the view when it is younger than ``max_age`` s, else after a read of it (shared by every
        caller meanwhile, awaited at most ``wait`` s: :data:`VIEW_WAIT`), with the peers heard from directly."""
        if time.monotonic() - self._live_at > max_age:
            if self._reading is None or self._reading.done():
                self._reading = self._spawn(self._read_view())
            if self._reading is None:  # no background tasks (not started, or closing): read here
                await self._read_view()
            else:
                if time.monotonic() - self._live_at > VIEW_STALE:  # never read, or long ago: nothing to go on
                    wait = VIEW_READ
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self._reading), wait)
        # A banned peer neither leads nor is waited for: its messages are dropped unread.
        heard = self._contacts.live() - self._left - self.blocked
        return sorted({p for p in {i.peer_id for i in self._live} | heard if not self.guard.is_banned(p)}
                      | {self.peer_id})

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
        """``coro`` as a task of the transport's task group (None, and ``coro`` closed, once it is closing)."""
        task = self._adopt(coro)
        if task is None:
            coro.close()
        return task

    def _adopt(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any] | None:
        """``coro`` as a task of the transport's task group, or None (``coro`` untouched: the caller owns it) once
        it is closing: an all-reduce's deliveries (net/allreduce.py), which may outlive the run."""
        if self._tasks is None:
            return None
        try:
            return self._tasks.create_task(coro)
        except RuntimeError:  # the transport is closing
            return None

    def _deliver(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any] | None:
        """An all-reduce's delivery (net/allreduce.py) as a task of the transport's group, waited for by
        :meth:`aclose` (at most DELIVERY_GRACE seconds); None once the transport is closing."""
        task = self._adopt(coro)
        if task is not None:
            self._deliveries.add(task)
            task.add_done_callback(self._deliveries.discard)
        return task

    async def _read_view(self) -> None:
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(self.peers(), VIEW_READ)
        except TimeoutError:
            pass
        except Exception as e:  # a background task of the transport's: the view stays as it was
            log.info("event=view_read_failed reason=%s: %s", type(e).__name__, e)
        if (seconds := time.monotonic() - t0) > VIEW_SLOW:
            log.info("event=view_read_slow seconds=%.1f", seconds)

    async def _recontact(self) -> None:
        """Re-ping known peers and bootstrap nodes now and then: after a network split heals, the DHT
        does not find its lost half by itself."""
        from hivemind.utils.multiaddr import Multiaddr

        while not self._stop.is_set():  # (checked too: a swallowed cancellation must not keep it looping)
            await asyncio.sleep(self.cfg.recontact_every)
            targets = self._maddrs.current()  # copies: the known addresses stay as they are
            for maddr in self.cfg.initial_peers:
                try:
                    targets.setdefault(Multiaddr(maddr)["p2p"], []).append(maddr)
                except Exception:
                    continue
            targets.pop(self.peer_id, None)
            gate = asyncio.Semaphore(RECONTACT_AT_ONCE)
            # At once (a few at a time), not one after the other: a sweep takes seconds, not 5 s per dead peer.
            await asyncio.gather(*(self._ping(p, a, gate) for p, a in targets.items()))

    async def _ping(self, peer: str, addrs: list[str], gate: asyncio.Semaphore) -> None:
        """Dial ``peer`` at ``addrs`` and ping it (5 s at most; a failure is only logged)."""
        from hivemind.p2p import PeerID

        async with gate:
            if self._stop.is_set():
                return
            try:
                async with asyncio.timeout(5):
                    if addrs:
                        await dial(self.p2p, peer, addrs)
                    await self.node.protocol.call_ping(PeerID.from_base58(peer))
            except Exception as e:
                log.debug("event=recontact_failed peer=%s reason=%s", peer, e)

    async def _addresses(self, peer: str) -> list[str]:
        """The multiaddrs ``peer`` announced (the DHT is read again if we know none)."""
        if not self._maddrs.get(peer):
            try:
                await asyncio.wait_for(self.peers(), 5)
            except TimeoutError:
                return []
        return self._maddrs.get(peer)

    # ------------------------------------------------------------------ streams
    def traffic(self) -> dict[str, dict[str, int]]:
        return self.streams.traffic.snapshot()

    async def _call(self, peer: str, kind: str, msg: dict[str, Any], *, timeout: float,
                    chunks: ChunkSource | None = None, trailer: Trailer | None = None,
                    sent: Callable[[], None] | None = None) -> tuple[dict[str, Any], float]:
        """One request/response with ``peer`` (see streams.Streams.call); RoundFailed if it fails."""
        return await self.streams.call(peer, kind, msg, timeout=timeout, chunks=chunks, trailer=trailer, sent=sent)

    # ------------------------------------------------------------------ groups
    async def form_group(self, request: JoinRequest, decide: Decide | None, *, timeout: float) -> Group:
        deadline = time.monotonic() + timeout
        if not request.ticket:  # this call's own: a join asked again after a lost reply is known by it
            request = dataclasses.replace(request, ticket=secrets.token_hex(8))
        skipped: set[str] = set()
        hinted: str | None = None  # a leader another peer named: one our view did not show yet
        hops = 0
        while time.monotonic() < deadline:
            if hinted is None:
                candidates = [p for p in await self._live_ids() if p not in skipped]
                if not candidates:
                    break
                leader = leader_of(candidates)
            else:  # a leader another peer named (or our group moved to): no new look at who is live first
                leader = hinted
            if leader == self.peer_id:
                try:
                    group = await self._lead(request, decide, deadline)
                except Moved as e:
                    if hops >= MAX_HOPS or e.leader in skipped:
                        raise
                    hinted, hops = e.leader, hops + 1
                    continue
            else:
                try:
                    try:
                        await self._call(leader, "hello", {"key": "hello"},
                                         timeout=max(0.1, min(LEADER_PROBE, deadline - time.monotonic())))
                    except Dropped as e:
                        # Its daemon took the stream and it ended unanswered, twice (streams.ASKED_AGAIN_KINDS): not
                        # a peer out of reach. The join says (bench/link.py, 4 and 8 peers: a joiner that skipped a
                        # live leader so failed its round alone, and the leader waited out its window for it).
                        log.info("event=hello_dropped leader=%s reason=%s", leader[-8:], e)
                    self._hand_over(request.key, leader)
                    # Name the leaders we found unreachable: a peer whose view still shows one of them as the
                    # smallest would otherwise send us back to it (when the smallest peer dies, the next one's
                    # own join may not have found that out yet).
                    wire = dataclasses.replace(request, skipped=tuple(sorted(skipped))[:MAX_SKIPPED],
                                               known=tuple(sorted(self._known()))[:MAX_KNOWN]).to_wire()
                    wait = min(deadline - time.monotonic(), self.cfg.join_window + 10)
                    asked = time.monotonic()
                    try:
                        reply, _ = await self._call(leader, "join", wire, timeout=wait)
                    except RoundFailed as e:
                        if time.monotonic() - asked >= wait - 1.0:
                            raise  # unanswered for the whole wait: frozen, or cut off
                        # It answered the hello and the join failed early: it may hold our join and have closed
                        # its group with us in it, its reply lost on the way (under load, link_4_8_hashed and
                        # link_256: we went on to the next peer, which led a group of us alone, and the others
                        # waited for our part until their gather deadline). Ask once more: a member asking again
                        # is answered with its group.
                        log.info("event=join_retry leader=%s reason=%s", leader[-8:], e)
                        reply, _ = await self._call(leader, "join", wire, timeout=max(0.1, min(
                            deadline - time.monotonic(), self.cfg.join_window + 10)))
                except RoundFailed as e:
                    log.info("event=leader_unreachable leader=%s reason=%s", leader[-8:], e)
                    if leader == hinted:  # the leader the others follow is out of our reach: sit this one out
                        raise RoundFailed(f"round {request.key}: the leader {leader[-8:]} is unreachable") from None
                    skipped.add(leader)
                    continue
                redirect = reply.get("leader")
                if isinstance(redirect, str) and hops < MAX_HOPS and redirect not in skipped | {leader, self.peer_id}:
                    # Its view shows a smaller live peer ours does not (yet), or its group moved there: follow it.
                    hinted, hops = redirect, hops + 1
                    continue
                if "error" in reply:
                    raise RoundFailed(f"round {request.key}: leader says {reply['error']}")
                try:
                    group = Group.from_wire(reply["group"])
                except SCHEMA_ERRORS as e:
                    self.guard.strike(leader, f"malformed group ({type(e).__name__}: {e})")
                    raise RoundFailed(f"round {request.key}: the leader's group is malformed") from None
            membership_check(group, request)
            alone_check(group, self.peer_id, await self._live_ids())
            if group.members == (self.peer_id,):  # alone: has this peer ever seen its run? (not read otherwise)
                unseen_check(group, self.peer_id, set(self._seen_at) | self._contacts.live(),
                             bool(self.cfg.initial_peers), time.monotonic() - self._born, self.cfg.quorum_memory)
            return group
        raise RoundFailed(f"round {request.key}: no group within {timeout:.1f} s")

    def _hand_over(self, key: str, leader: str) -> None:
        """We join ``leader``'s group of round ``key`` (it answered our hello): peers that joined us for it (their
        views lacked ``leader``, and so did ours when they came) follow us there at once (groups.Forming.move). Kept
        here, they waited out our window, and ``leader``'s group, closed at the end of its own window with a quorum,
        was gone when ours said it leads the round too: they failed ("no quorum: 1 of 8 live peers joined", three
        times in one run of bench/link.py with 8 peers under load), and the others waited a whole window for them."""
        f = self._forming.get(key)
        if f is not None and f.requests and self.peer_id not in f.requests and leader not in f.skipped():
            f.move(leader)

    async def _lead(self, request: JoinRequest, decide: Decide | None, deadline: float) -> Group:
        """As the round's leader, take ``request`` and return the group once it is closed (see groups.Forming).
        RoundFailed if the group closed before this request came."""
        self._gc()
        f = self._forming.get(request.key)
        if f is None:
            f = self._forming[request.key] = Forming(request.key, self.cfg.join_window)
        f.join(request, decide)
        if f.on_short is None and self._tasks is not None:
            def short() -> None:
                self._spawn(self._say_we_lead(f))  # (closing: no one to tell)

            f.on_short = short

        async def live(fresh: bool) -> list[str]:
            return await self._live_ids(max_age=0.2) if fresh else await self._live_ids()

        try:
            return await f.until_closed(live, leader=self.peer_id, deadline=deadline, poll=0.1, known=self._known)
        finally:
            # Tell live peers that did not join who leads: once a round (from the leader's own join; every
            # joiner's request passes here too, and k of them each scanning the view would be O(k²) a round).
            if f.group is not None and self._tasks is not None and request.peer_id == self.peer_id:
                absent = {i.peer_id for i in self._live} - set(f.requests) - {self.peer_id} - self.blocked
                for p in self._contacts.to_greet(absent):
                    self._tasks.create_task(self._hello(p))

    async def _say_we_lead(self, f: Forming) -> None:
        """Our group of ``f.key`` is short of its quorum as its window ends: tell the smallest live peers that did
        not join (:data:`MAX_TOLD`, all at once) that we lead it; another leader of the round moves its group here or
        says it stays, and ours may move there (net/groups.py: "Merging", :meth:`Forming.told`)."""
        try:
            # The view as it is (a DHT read takes seconds), and the peers that reached us lately.
            live = set(await self._live_ids(max_age=math.inf)) | (self._contacts.live() - self._left)
            absent = sorted(live - set(f.requests) - {self.peer_id} - self.blocked)[:MAX_TOLD]
            msg = {"key": f.key, "joiners": sorted(f.requests)[:MAX_KNOWN], "counted": sorted(f.counted)[:MAX_KNOWN],
                   "skipped": sorted(f.skipped())[:MAX_KNOWN]}

            async def tell(peer: str) -> None:
                try:
                    reply, _ = await self._call(peer, "lead", msg, timeout=min(1.0, self.cfg.join_window))
                except RoundFailed:
                    return
                f.answered(peer, reply)

            await asyncio.gather(*(tell(p) for p in absent))
        except Exception:  # a background task of the transport's: a failure here must not end the others
            log.exception("event=say_we_lead_failed key=%s", f.key)

    async def _on_lead(self, sender: str, msg: dict[str, Any]) -> dict[str, Any]:
        """``sender`` leads round ``msg["key"]`` too (see :meth:`_say_we_lead`): :meth:`Forming.told` answers."""
        f = self._forming.get(msg.get("key")) if isinstance(msg.get("key"), str) else None
        if f is None:
            return {"ok": True}
        return f.told(self.peer_id, sender, peer_ids(msg.get("joiners")), peer_ids(msg.get("counted")),
                      peer_ids(msg.get("skipped")))

    async def _hello(self, peer: str) -> None:
        try:
            await self._call(peer, "hello", {"key": "hello"}, timeout=min(5.0, self.cfg.ttl))
        except RoundFailed as e:
            log.debug("event=hello_failed peer=%s reason=%s", peer[-8:], e)

    async def rtt(self, peer: str, *, tries: int = 3, timeout: float = 5.0, gap: float = 0.0) -> float | None:
        best: float | None = None
        deadline = time.monotonic() + timeout
        for i in range(tries):
            if i and gap > 0:
                await asyncio.sleep(min(gap, max(0.0, deadline - time.monotonic())))
            try:
                _, seconds = await self._call(peer, "hello", {"key": "hello"},
                                              timeout=max(0.1, deadline - time.monotonic()))
            except RoundFailed:
                break
            best = seconds if best is None else min(best, seconds)
        return best

    async def _on_hello(self, sender: str, msg: dict[str, Any]) -> dict[str, Any]:
        self._contacts.heard(sender)
        return {"ok": True}

    async def _on_join(self, sender: str, msg: dict[str, Any]) -> dict[str, Any]:
        req = JoinRequest.from_wire(msg)
        if req.peer_id != sender:
            return {"error": "peer id does not match the stream's peer"}
        self._contacts.heard(sender)
        if req.key not in self._forming:  # (forming it: we lead already, and a read of the view would only delay it)
            live = [p for p in await self._live_ids() if p not in req.skipped] or [self.peer_id]
            if req.key not in self._forming and (smaller := leader_of(live)) != self.peer_id:
                # The joiner's view lacks a smaller live peer ours shows: we would lead a second group for this
                # round key. Name the leader instead (our own form_group found it unreachable if we lead already;
                # one the joiner found unreachable is not named: we lead if we are the next, as the quorum allows).
                return {"error": f"not the leader of round {req.key}", "leader": smaller}
        try:
            group = await self._lead(req, None, time.monotonic() + self.cfg.join_window + 5)
        except Moved as e:
            return {"error": str(e), "leader": e.leader}
        except RoundFailed as e:
            return {"error": str(e)}
        return {"group": group.to_wire()}

    def _gc(self, max_age: float = 600.0, after_finish: float = 60.0) -> None:
        """Forget groups of old rounds, and mailboxes ``after_finish`` seconds after our all-reduce of them
        ended or ``max_age`` after they were made (see mailbox.Mailboxes.collect)."""
        now = time.monotonic()
        for k in [k for k, f in self._forming.items() if now - f.created > max_age]:
            del self._forming[k]
        self.mailboxes.collect(max_age, after_finish)

    # ------------------------------------------------------------------ all-reduce
    @property
    def _mail(self) -> dict[tuple[str, int], Mailbox]:
        """The mailbox of every (round, phase) this peer holds."""
        return self.mailboxes.boxes

    def _gone(self, key: str, phase: int) -> set[str]:
        """Members not worth waiting for: our sends to them failed, they announced their departure, or we
        banned them (their messages are dropped unread).
        (A member merely missing from our DHT view is still waited for: views are eventually consistent.)"""
        return self.mailboxes.unreachable(key, phase) | self._left | self.guard.banned

    async def _on_part(self, sender: str, msg: dict[str, Any]) -> dict[str, Any]:
        return await self.mailboxes.accept_part(sender, msg)

    async def _on_result(self, sender: str, msg: dict[str, Any]) -> dict[str, Any]:
        return await self.mailboxes.accept_result(sender, msg)

    async def _on_getpart(self, sender: str, msg: dict[str, Any]) -> dict[str, Any]:
        return await self.mailboxes.relay(sender, msg)

    async def allreduce(self, group: Group, phase: int, tensors: Sequence[torch.Tensor], weight: float,
                        codec: Codec, *, timeout: float, fingerprint: Sequence[float] | None = None) -> ReduceResult:
        box = self.mailboxes.box(group.key, phase)
        audit = None
        if self.cfg.verify and self.identity is not None:
            audit = Audit(run=self.cfg.run_id, key=group.key, phase=phase, me=self.peer_id, members=group.members,
                          bounds=part_bounds(sum(t.numel() for t in tensors), len(group.members)), codec=codec,
                          rule=self.guard.cfg.aggregation, weight=weight, identity=self.identity, box=box,
                          guard=self.guard, call=self._call, audit_rate=self.cfg.audit_rate)
        run = ButterflyRun(group=group, phase=phase, me=self.peer_id, tensors=tensors, weight=weight, codec=codec,
                           timeout=timeout, fingerprint=fingerprint, box=box, call=self._call,
                           gone=lambda: self._gone(group.key, phase), guard=self.guard, links=self.links,
                           chunk=stream_chunk(-(-sum(t.numel() for t in tensors) // len(group.members)),
                                              self.cfg.chunk_values), faults=self.cfg.faults, audit=audit,
                           pipeline=self.cfg.pipeline, deliver=self._deliver)
        try:
            return await run.run()
        finally:
            # The contributions to our part are spent; the parts' results stay so that a member that
            # missed one can still fetch it from us (a relay), until the mailbox is collected (_gc).
            # Members judge until their own deadline (they started about when we did): our evidence lives as long.
            self.mailboxes.boxes.get((group.key, phase), box).close(evidence_until=run.t0 + timeout + 5.0)
            self._gc()  # also on members that never lead a round (only leaders collected before)

    # ------------------------------------------------------------------ state
    def serve_state(self, provider: StateProvider) -> None:
        self._states.provider = provider

    async def _on_state(self, sender: str, msg: dict[str, Any]) -> dict[str, Any]:
        return await self._states.handle(msg)

    def serve_bequests(self, accept: Inherit) -> None:
        self._inherit = accept

    async def _on_bequest(self, sender: str, msg: dict[str, Any]) -> dict[str, Any]:
        """A leaving peer asks us to download its bequest (the state it names) and take it."""
        name = msg.get("name")
        if self._inherit is None or not isinstance(name, str) or not name.startswith("bequest"):
            return {"ok": False, "why": "no heir here" if self._inherit is None else "not a bequest"}
        try:
            data = await self.fetch_state(sender, name, timeout=BEQUEST_WAIT)
        except RoundFailed as e:
            return {"ok": False, "why": f"download: {e}"}
        try:
            why = await self._inherit(sender, data)
        except Exception as e:  # ours, not the sender's: answered, not struck as a malformed message
            log.warning("event=bequest_failed sender=%s reason=%s: %s", sender[-8:], type(e).__name__, e)
            return {"ok": False, "why": f"the heir failed ({type(e).__name__})"}
        return {"ok": why is None, "why": why or ""}

    async def bequeath(self, peer_id: str, name: str, *, timeout: float) -> str | None:
        reply, _ = await self._call(peer_id, "bequest", {"name": name}, timeout=timeout)
        return None if reply.get("ok") else str(reply.get("why", "refused"))

    async def fetch_state(self, peer_id: str, name: str, *, timeout: float,
                          progress: Callable[[int, int], None] | None = None) -> bytes:
        async def call(msg: dict[str, Any]) -> dict[str, Any]:
            return (await self._call(peer_id, "state", msg, timeout=timeout))[0]

        return await fetch_chunked(call, name, max_bytes=self.cfg.max_state, progress=progress)
