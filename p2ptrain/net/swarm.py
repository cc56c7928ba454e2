"""The real swarm: hivemind's libp2p daemon and Kademlia DHT, our own protocols on its streams.

* **Discovery and membership** live in the DHT under the run id: every peer stores
  its announcement (region, step, throughput, bandwidth, multiaddrs) as a subkey of
  ``<run>.peers`` with an expiry, refreshed by heartbeat; the live peers are the
  unexpired subkeys. ``<run>.meta`` holds the shared pacing.
* **Groups** are formed per round by a leader, the smallest live peer id: members
  send ``join`` on a libp2p stream and the leader answers, once every live peer
  joined or its window expired, with the sorted member list (and, for CoCoDC, the
  fragment it chose from everyone's drift scores). An unreachable leader is
  skipped for the next one.
* **All-reduce** is our own butterfly over libp2p streams with msgpack frames, not
  hivemind's ``AllReduceRunner``: we need our codecs (4-bit E3M0, fp8, low-rank
  phases), weights renormalised over the members that actually contributed, an
  explicit record of who did (a dead peer's share must not silently stay
  un-averaged), a fingerprint of every member's θ so a divergent replica is
  excluded and repaired, and bounded reads of everything that arrives. A missing
  part is fetched from any member that has it; if nobody has it, that slice of the
  pseudo-gradient is zero this round on every survivor alike.

Every network wait has a timeout; background tasks belong to the transport's
TaskGroup and end with :meth:`HivemindTransport.aclose`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..collective.butterfly import chunk_bounds, part_bounds
from ..collective.codecs import Codec, get_codec
from ..faults import corrupt_payload
from .auth import MAC_FIELD
from .bandwidth import LinkMeter
from .chunks import Refused, chunked_size, decode_chunked, encode_ahead, receive_chunks
from .daemon import SwarmConfig, SwarmError, start_p2p
from .groups import Forming, alone_check, leader_of, majority_fingerprint, membership_check
from .guard import Guard
from .state_transfer import StateServer, fetch_chunked
from .streams import ChunkSource, Streams
from .transport import Decide, Group, JoinRequest, PeerInfo, ReduceResult, RoundFailed, StateProvider, Transport
from .wire import SCHEMA_ERRORS

__all__ = ["HivemindTransport", "SwarmConfig", "SwarmError", "start_p2p"]

log = logging.getLogger(__name__)


def _payload_len(res: dict[str, Any]) -> int:
    pieces = res.get("_pieces")
    if pieces is not None:
        return sum(len(p) for p in pieces)
    data = res.get("data")
    return len(data) if isinstance(data, bytes) else 0


def _wire_result(res: dict[str, Any]) -> dict[str, Any]:
    """A stored result as one message (a streamed one with its chunks' payloads joined), for relaying."""
    out = {k: v for k, v in res.items() if not k.startswith("_")}
    if res.get("_pieces") is not None:
        out["data"] = b"".join(res["_pieces"])
    out.pop("chunks", None)
    return out


@dataclass
class _Mailbox:
    """Frames that arrived for one (round, phase): contributions to our part, and results of parts."""

    contribs: dict[str, tuple[int, torch.Tensor, float, list[float] | None]] = field(default_factory=dict)
    unreachable: set[str] = field(default_factory=set)  # members our sends could not reach
    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    created: float = field(default_factory=time.monotonic)
    finished: float | None = None  # when our all-reduce of this (round, phase) returned or failed

    def poke(self) -> None:
        self.changed.set()

    async def wait(self, deadline: float) -> None:
        self.changed.clear()
        left = deadline - time.monotonic()
        if left > 0:
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except TimeoutError:
                pass


class HivemindTransport(Transport):
    """A :class:`Transport` over hivemind's P2P daemon and DHT (create with :meth:`create`)."""

    def __init__(self, cfg: SwarmConfig, p2p: Any, node: Any) -> None:
        self.cfg, self.p2p, self.node = cfg, p2p, node
        self.peer_id = str(p2p.peer_id)
        self._forming: dict[str, Forming] = {}
        self._mail: dict[tuple[str, int], _Mailbox] = {}
        self._live: list[PeerInfo] = []
        self._live_at = 0.0
        self._maddrs: dict[str, list[str]] = {}
        self._states = StateServer(cfg.state_chunk)
        self.guard = Guard(cfg.guard)
        self.blocked: set[str] = set()  # fault injection: peers this one cannot reach (a partition)
        self.links = LinkMeter()
        self._left: set[str] = set()  # peers whose last announcement is a departure
        self._tasks: asyncio.TaskGroup | None = None
        self._runner: asyncio.Task[None] | None = None
        self.streams = Streams(cfg, p2p, self.guard, lambda peer: peer in self.blocked, self._addresses)
        self._stop = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    async def create(cls, cfg: SwarmConfig) -> HivemindTransport:
        p2p, node = await start_p2p(cfg)
        self = cls(cfg, p2p, node)
        for kind, handler in (("join", self._on_join), ("part", self._on_part), ("result", self._on_result),
                              ("getpart", self._on_getpart), ("state", self._on_state)):
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
        """Stop background tasks, the DHT node and the daemon."""
        self._stop.set()
        if self._runner is not None:
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)
        try:
            await asyncio.wait_for(self.node.shutdown(), 10)
        except (TimeoutError, Exception) as e:
            log.debug("event=dht_shutdown reason=%s", e)
        try:
            await asyncio.wait_for(self.p2p.shutdown(), 10)
        except (TimeoutError, Exception) as e:
            log.debug("event=p2p_shutdown reason=%s", e)

    async def visible_maddrs(self) -> list[str]:
        return [str(a) for a in await self.p2p.get_visible_maddrs()]

    # ------------------------------------------------------------------ DHT records
    def _key(self, what: str) -> str:
        return f"p2ptrain.{self.cfg.run_id}.{what}"

    async def announce(self, info: PeerInfo) -> None:
        from hivemind.utils import get_dht_time

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
        return bool(await self.node.store(self._key(what), value, expiration, subkey=self.peer_id))

    async def _records(self, what: str) -> dict[str, tuple[dict[str, Any], float]]:
        from hivemind.utils import get_dht_time

        found = await self.node.get(self._key(what), latest=True)
        if found is None or not isinstance(found.value, dict):
            return {}
        now, out = get_dht_time(), {}
        for sub, item in found.value.items():
            value, exp = item.value, item.expiration_time
            if not (exp > now and isinstance(value, dict) and isinstance(sub, str)):
                continue
            key = self.cfg.swarm_key
            if key is not None:
                if not key.verify(value, self._key(what), sub):
                    continue  # not from a member of this private swarm
                value = {k: v for k, v in value.items() if k != MAC_FIELD}
            out[sub] = (value, exp)
        return out

    async def peers(self) -> list[PeerInfo]:
        infos = []
        for sub, (value, exp) in (await self._records("peers")).items():
            if value.get("left"):
                self._left.add(sub)
                continue
            if value.get("peer") != sub or sub in self.blocked:
                continue
            self._left.discard(sub)
            try:
                info = PeerInfo.from_wire(value, expires=exp)
            except (KeyError, TypeError, ValueError):
                continue
            infos.append(info)
            self._maddrs[info.peer_id] = info.maddrs
        self._live, self._live_at = infos, time.monotonic()
        return sorted(infos, key=lambda i: i.peer_id)

    async def _live_ids(self, max_age: float = 1.0) -> list[str]:
        if time.monotonic() - self._live_at > max_age:
            try:
                await asyncio.wait_for(self.peers(), 5)
            except TimeoutError:
                pass
        return sorted({i.peer_id for i in self._live} | {self.peer_id})

    async def publish_meta(self, meta: dict[str, Any]) -> None:
        from hivemind.utils import get_dht_time

        await self._store("meta", dict(meta), get_dht_time() + self.cfg.ttl)

    async def get_meta(self) -> dict[str, dict[str, Any]]:
        return {p: v for p, (v, _) in (await self._records("meta")).items()}

    async def _recontact(self) -> None:
        """Re-ping known peers and bootstrap nodes now and then: after a network split heals, the DHT
        does not find its lost half by itself."""
        from hivemind.p2p import PeerID
        from hivemind.utils.multiaddr import Multiaddr

        while True:
            await asyncio.sleep(self.cfg.recontact_every)
            targets: dict[str, list[str]] = dict(self._maddrs)
            for maddr in self.cfg.initial_peers:
                try:
                    targets.setdefault(Multiaddr(maddr)["p2p"], []).append(maddr)
                except Exception:
                    continue
            for peer, addrs in targets.items():
                if peer == self.peer_id:
                    continue
                try:
                    pid = PeerID.from_base58(peer)
                    if addrs:
                        await asyncio.wait_for(self.p2p._client.connect(pid, [Multiaddr(a) for a in addrs]), 5)
                    await asyncio.wait_for(self.node.protocol.call_ping(pid), 5)
                except Exception as e:
                    log.debug("event=recontact_failed peer=%s reason=%s", peer, e)

    async def _addresses(self, peer: str) -> list[str]:
        """The multiaddrs ``peer`` announced (the DHT is read again if we know none)."""
        if not self._maddrs.get(peer):
            try:
                await asyncio.wait_for(self.peers(), 5)
            except TimeoutError:
                return []
        return list(self._maddrs.get(peer, []))

    # ------------------------------------------------------------------ streams
    async def _call(self, peer: str, kind: str, msg: dict[str, Any], *, timeout: float,
                    chunks: ChunkSource | None = None) -> tuple[dict[str, Any], float]:
        """One request/response with ``peer`` (see streams.Streams.call); RoundFailed if it fails."""
        return await self.streams.call(peer, kind, msg, timeout=timeout, chunks=chunks)

    # ------------------------------------------------------------------ groups
    async def form_group(self, request: JoinRequest, decide: Decide | None, *, timeout: float) -> Group:
        deadline = time.monotonic() + timeout
        skipped: set[str] = set()
        while time.monotonic() < deadline:
            candidates = [p for p in await self._live_ids() if p not in skipped]
            if not candidates:
                break
            leader = leader_of(candidates)
            if leader == self.peer_id:
                group = await self._lead(request, decide, deadline)
            else:
                try:
                    reply, _ = await self._call(leader, "join", request.to_wire(),
                                                timeout=min(deadline - time.monotonic(), self.cfg.join_window + 10))
                except RoundFailed as e:
                    log.info("event=leader_unreachable leader=%s reason=%s", leader[-8:], e)
                    skipped.add(leader)
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
            return group
        raise RoundFailed(f"round {request.key}: no group within {timeout:.1f} s")

    async def _lead(self, request: JoinRequest, decide: Decide | None, deadline: float) -> Group:
        """As the round's leader, take ``request`` and return the group once it is closed (see groups.Forming).
        RoundFailed if the group closed before this request came."""
        self._gc()
        f = self._forming.get(request.key)
        if f is None:
            f = self._forming[request.key] = Forming(request.key, self.cfg.join_window)
        f.join(request, decide)

        async def live(fresh: bool) -> list[str]:
            return await self._live_ids(max_age=0.2) if fresh else await self._live_ids()

        return await f.until_closed(live, leader=self.peer_id, deadline=deadline, poll=0.1)

    async def _on_join(self, sender: str, msg: dict[str, Any]) -> dict[str, Any]:
        req = JoinRequest.from_wire(msg)
        if req.peer_id != sender:
            return {"error": "peer id does not match the stream's peer"}
        try:
            group = await self._lead(req, None, time.monotonic() + self.cfg.join_window + 5)
        except RoundFailed as e:
            return {"error": str(e)}
        return {"group": group.to_wire()}

    def _gc(self, max_age: float = 600.0, after_finish: float = 60.0) -> None:
        """Forget groups and mailboxes of old rounds: a mailbox ``after_finish`` seconds after our
        all-reduce of it ended (until then our averaged part can still be fetched by a member that missed
        it), any other after ``max_age`` (a round that never ran here, late frames)."""
        now = time.monotonic()
        for k in [k for k, f in self._forming.items() if now - f.created > max_age]:
            del self._forming[k]
        for k in [k for k, m in self._mail.items()
                  if now - m.created > max_age or (m.finished is not None and now - m.finished > after_finish)]:
            del self._mail[k]

    # ------------------------------------------------------------------ all-reduce
    def _gone(self, key: str, phase: int) -> set[str]:
        """Members not worth waiting for: our sends to them failed, or they announced their departure.
        (A member merely missing from our DHT view is still waited for: views are eventually consistent.)"""
        box = self._mail.get((key, phase))
        return (box.unreachable if box else set()) | self._left

    def _box(self, key: str, phase: int) -> _Mailbox:
        return self._mail.setdefault((key, phase), _Mailbox())

    async def _on_part(self, sender: str, msg: dict[str, Any]) -> dict[str, Any]:
        codec = get_codec(str(msg["codec"]))
        numel = int(msg["numel"])
        if numel < 0 or numel > self.cfg.max_message:
            return {"error": "bad size"}
        streamed = "chunks" in msg
        data = None if streamed else msg["data"]
        if not streamed and (not isinstance(data, bytes) or len(data) != codec.encoded_size(numel)):
            self.guard.strike(sender, f"part payload of {len(data) if isinstance(data, bytes) else '?'} bytes "
                                      f"for {numel} values")
            return {"error": "payload size does not match"}
        if (reason := self.guard.bad_weight(msg["weight"])) is not None:
            self.guard.strike(sender, reason)
            return {"error": reason}
        if streamed:
            try:
                x, _ = await receive_chunks(msg, codec, numel)
            except Refused as e:
                self.guard.strike(sender, f"streamed part: {e}")
                return {"error": "streamed part does not match its header"}
        else:
            assert isinstance(data, bytes)
            try:
                x = await asyncio.to_thread(codec.decode, data, numel)
            except ValueError as e:
                self.guard.strike(sender, f"undecodable part ({e})")
                return {"error": "undecodable part"}
        fp = msg.get("fp")
        box = self._box(str(msg["key"]), int(msg["phase"]))
        box.contribs[sender] = (int(msg["part"]), x, float(msg["weight"]), None if fp is None else [float(v) for v in fp])
        box.poke()
        return {"ok": True}

    async def _on_result(self, sender: str, msg: dict[str, Any]) -> dict[str, Any]:
        box = self._box(str(msg["key"]), int(msg["phase"]))
        part = int(msg["part"])
        res = {k: v for k, v in msg.items() if not (isinstance(k, str) and k.startswith("_"))}
        if "chunks" in msg:  # streamed: decoded as it arrives; the metadata is checked when assembling
            numel = msg["numel"]
            if not isinstance(numel, int) or not 0 <= numel <= self.cfg.max_message:
                return {"error": "bad size"}
            try:
                x, pieces = await receive_chunks(msg, get_codec(str(msg["codec"])), numel)
            except Refused as e:
                self.guard.strike(sender, f"streamed result: {e}")
                return {"error": "streamed result does not match its header"}
            res |= {"_tensor": x, "_pieces": pieces}
        box.results.setdefault(part, {**res, "_from": sender})
        box.poke()
        return {"ok": True}

    async def _on_getpart(self, sender: str, msg: dict[str, Any]) -> dict[str, Any]:
        box = self._mail.get((str(msg["key"]), int(msg["phase"])))
        res = None if box is None else box.results.get(int(msg["part"]))
        return {"result": _wire_result(res)} if res is not None else {"error": "no such part here"}

    async def allreduce(self, group: Group, phase: int, tensors: Sequence[torch.Tensor], weight: float,
                        codec: Codec, *, timeout: float, fingerprint: Sequence[float] | None = None) -> ReduceResult:
        try:
            return await self._allreduce(group, phase, tensors, weight, codec, timeout=timeout,
                                         fingerprint=fingerprint)
        finally:
            # The contributions to our part are spent; the parts' results stay so that a member that
            # missed one can still fetch it from us (a relay), until the mailbox is collected (_gc).
            box = self._mail.get((group.key, phase))
            if box is not None:
                box.finished = time.monotonic()
                box.contribs.clear()
            self._gc()  # also on members that never lead a round (only leaders collected before)

    async def _allreduce(self, group: Group, phase: int, tensors: Sequence[torch.Tensor], weight: float,
                         codec: Codec, *, timeout: float, fingerprint: Sequence[float] | None = None) -> ReduceResult:
        t0 = time.monotonic()
        members = list(group.members)
        me = members.index(self.peer_id)
        if len(tensors) == 1:  # no copy of a lone fp32 tensor: it is only read
            flat = tensors[0].detach().reshape(-1).float().cpu()
        else:
            flat = torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors]) if tensors else torch.zeros(0)
        bounds = part_bounds(flat.numel(), len(members))
        box = self._box(group.key, phase)
        fp = None if fingerprint is None else [float(v) for v in fingerprint]
        sent = received = 0
        chunk = self.cfg.chunk_values

        # 1. reduce-scatter: our share of part j goes to its owner j
        async def send_part(j: int) -> int:
            try:
                return await _send_part(j)
            except RoundFailed:
                box.unreachable.add(members[j])  # a dead owner: nobody averages its part this round
                box.poke()
                raise

        async def _send_part(j: int) -> int:
            lo, hi = bounds[j]
            mine = flat[lo:hi]
            msg = {"key": group.key, "phase": phase, "part": j, "weight": float(weight), "fp": fp,
                   "codec": codec.name, "numel": hi - lo}
            call_timeout = max(0.1, t0 + timeout * 0.5 - time.monotonic())
            if self.cfg.faults.corrupt is None and hi - lo > chunk:  # streamed: encoding, transfer, decoding overlap
                cb = chunk_bounds(hi - lo, chunk)
                msg |= {"chunk": chunk, "chunks": len(cb)}
                size = chunked_size(codec, hi - lo, chunk)
                reply, seconds = await self._call(members[j], "part", msg, timeout=call_timeout,
                                                  chunks=lambda: encode_ahead(codec, mine, cb))
            else:
                if self.cfg.faults.corrupt is None:
                    data = await asyncio.to_thread(codec.encode, mine)
                else:  # fault injection: what a broken or hostile peer would put on the wire
                    data, mine = corrupt_payload(codec, mine, self.cfg.faults.corrupt)
                msg |= {"numel": mine.numel(), "data": data}
                size = len(data)
                reply, seconds = await self._call(members[j], "part", msg, timeout=call_timeout)
            if "error" in reply:
                raise RoundFailed(f"part {j}: {reply['error']}")
            self.links.update(members[j], size, seconds)
            return size

        lo, hi = bounds[me]
        box.contribs[self.peer_id] = (me, flat[lo:hi].clone(), float(weight), fp)
        sends = [asyncio.create_task(send_part(j)) for j in range(len(members)) if j != me]

        if sends:
            await asyncio.wait(sends, timeout=max(0.0, t0 + timeout * 0.5 - time.monotonic()))
            self.cfg.faults.in_allreduce()  # tests only: a peer dying mid all-reduce
        # 2. collect the contributions to our own part (until everyone or half the timeout)
        gather_deadline = t0 + timeout * 0.5
        while (missing := set(members) - set(box.contribs)) and time.monotonic() < gather_deadline:
            if missing <= self._gone(group.key, phase):
                break  # every missing member is unreachable or has left: do not wait for them
            await box.wait(min(gather_deadline, time.monotonic() + 0.5))
        # Only members' contributions to *our* part, of our part's size, count.
        contribs = {p: c for p, c in box.contribs.items() if p in members and c[0] == me}
        for p in [p for p, c in contribs.items() if c[1].numel() != hi - lo]:
            # Not a strike: members whose views of the round differ (e.g. two leaders chose different
            # fragments for one slot) send honest parts of other sizes. Dropped, never summed.
            log.info("event=part_dropped key=%s peer=%s reason=%d values, expected %d", group.key, p,
                     contribs[p][1].numel(), hi - lo)
            del contribs[p]
        prints = {p: c[3] for p, c in contribs.items() if c[3] is not None}
        agree = majority_fingerprint(prints) if prints else set(contribs)
        use = sorted(p for p in contribs if p in agree)
        own_result: dict[str, Any] | None = None
        if use:
            try:
                avg, total, use = self.guard.aggregate({p: (contribs[p][1], contribs[p][2]) for p in use},
                                                       me=self.peer_id)
            except ValueError:
                use = []
        produce: asyncio.Task[None] | None = None
        encoded: list[asyncio.Future[bytes]] = []
        if use:
            own_result = {"key": group.key, "phase": phase, "part": me, "contributors": use, "total": total,
                          "agree": sorted(agree), "numel": hi - lo, "codec": codec.name}
            if hi - lo > chunk:  # streamed to every member while it is being encoded
                cb = chunk_bounds(hi - lo, chunk)
                own_result |= {"chunk": chunk, "chunks": len(cb)}
                loop = asyncio.get_running_loop()
                encoded = [loop.create_future() for _ in cb]
                result = own_result

                async def produce_chunks() -> None:
                    # Every member, this one included, uses the decoded payload: lossy codecs agree everywhere.
                    own, pieces = torch.empty(hi - lo, dtype=torch.float32), []
                    try:
                        async for data in encode_ahead(codec, avg, cb):
                            encoded[len(pieces)].set_result(data)
                            a, b = cb[len(pieces)]
                            own[a:b] = await asyncio.to_thread(codec.decode, data, b - a)
                            pieces.append(data)
                    except BaseException as e:
                        for f in encoded:
                            if not f.done():
                                f.set_exception(RoundFailed(f"encoding our part failed: {e!r}"))
                        raise
                    box.results[me] = {**result, "_tensor": own, "_pieces": pieces}
                    box.poke()

                produce = asyncio.create_task(produce_chunks())
            else:
                own_result["data"] = await asyncio.to_thread(codec.encode, avg)
                box.results[me] = own_result

        try:
            async def encoded_chunks() -> AsyncIterator[bytes]:
                for f in encoded:
                    yield await asyncio.shield(f)

            # 3. all-gather: our averaged part to every other member
            async def send_result(j: int) -> int:
                assert own_result is not None
                size = chunked_size(codec, hi - lo, own_result.get("chunk"))
                reply, seconds = await self._call(members[j], "result", own_result,
                                                  timeout=max(0.1, t0 + timeout * 0.8 - time.monotonic()),
                                                  chunks=encoded_chunks if encoded else None)
                self.links.update(members[j], size, seconds)
                return size if reply.get("ok") else 0

            results_out = [asyncio.create_task(send_result(j)) for j in range(len(members)) if j != me and own_result]
            for done in await asyncio.gather(*sends, return_exceptions=True):
                if isinstance(done, int):
                    sent += done
                else:
                    log.info("event=part_send_failed key=%s reason=%s", group.key, done)

            # 4. wait for the other parts, then ask around for what is still missing
            result_deadline = t0 + timeout * 0.8
            while len(box.results) < len(members) and time.monotonic() < result_deadline:
                owners = {members[j] for j in range(len(members)) if j not in box.results}
                if owners <= self._gone(group.key, phase):
                    break  # the owners still missing are unreachable or left; ask the others below
                await box.wait(min(result_deadline, time.monotonic() + 0.5))
            for j in range(len(members)):
                if j in box.results:
                    continue
                for other in members:
                    if other in (self.peer_id, members[j]) or time.monotonic() > t0 + timeout:
                        continue
                    try:
                        reply, _ = await self._call(other, "getpart", {"key": group.key, "phase": phase, "part": j},
                                                    timeout=max(0.1, t0 + timeout - time.monotonic()))
                    except RoundFailed:
                        continue
                    if isinstance(reply.get("result"), dict):
                        relayed = {k: v for k, v in reply["result"].items() if not (isinstance(k, str) and k.startswith("_"))}
                        box.results[j] = {**relayed, "_from": other}  # relayed by a member
                        break
            for done in await asyncio.gather(*results_out, return_exceptions=True):
                if isinstance(done, int):
                    sent += done
            if produce is not None:
                await asyncio.gather(produce, return_exceptions=True)
        finally:
            if produce is not None and not produce.done():
                produce.cancel()
                await asyncio.gather(produce, return_exceptions=True)

        # 5. assemble; a part nobody could average is zero on every survivor
        out = torch.zeros(flat.numel(), dtype=torch.float32)
        contributors: set[str] | None = None
        partial, divergent, total_weight = False, False, 0.0
        for j, (a, b) in enumerate(bounds):
            res = box.results.get(j)
            if res is None:
                partial = True
                continue
            numel = res.get("numel")
            data, decoded = res.get("data"), res.get("_tensor")
            if res.get("_from", self.peer_id) not in members:
                partial = True  # a result from outside the group is never used
                continue
            if numel != b - a or res.get("codec") != codec.name:
                partial = True  # an owner whose view of the round differs (see above): not used, no strike
                continue
            try:
                size = chunked_size(codec, b - a, res.get("chunk"))
            except Refused:
                size = -1
            if ((decoded is None and (not isinstance(data, bytes) or len(data) != size))
                    or (decoded is not None and decoded.numel() != b - a)
                    or not isinstance(res.get("contributors"), list) or not isinstance(res.get("agree"), list)
                    or self.guard.bad_weight(res.get("total")) is not None):
                if members[j] != self.peer_id:
                    self.guard.strike(members[j], f"averaged part {j} is malformed")
                partial = True
                continue
            if decoded is not None:  # streamed: decoded chunk by chunk as it arrived
                part = decoded
            else:
                part = await asyncio.to_thread(decode_chunked, codec, data, b - a, res.get("chunk"))
            if (reason := self.guard.bad_values(part)) is not None:
                self.guard.strike(members[j], f"averaged part {j}: {reason}")
                partial = True
                continue
            out[a:b] = part
            if j != me:
                received += _payload_len(res)
            who = {str(p) for p in res["contributors"]}
            contributors = who if contributors is None else contributors & who
            partial |= len(who) < len(members)
            if fingerprint is not None and self.peer_id not in {str(p) for p in res["agree"]}:
                divergent = True
            if j == me or total_weight == 0.0:
                total_weight = float(res["total"])
        if contributors is None or not contributors:
            raise RoundFailed(f"round {group.key} phase {phase}: no part could be averaged")
        pieces, offset = [], 0
        for t in tensors:
            pieces.append(out[offset : offset + t.numel()].view(t.shape).to(t.device))
            offset += t.numel()
        return ReduceResult(pieces, total_weight, group.members, tuple(sorted(contributors)), partial=partial,
                            bytes_sent=sent, bytes_received=received, seconds=time.monotonic() - t0,
                            divergent=divergent)

    # ------------------------------------------------------------------ state
    def serve_state(self, provider: StateProvider) -> None:
        self._states.provider = provider

    async def _on_state(self, sender: str, msg: dict[str, Any]) -> dict[str, Any]:
        return await self._states.handle(msg)

    async def fetch_state(self, peer_id: str, name: str, *, timeout: float,
                          progress: Callable[[int, int], None] | None = None) -> bytes:
        async def call(msg: dict[str, Any]) -> dict[str, Any]:
            return (await self._call(peer_id, "state", msg, timeout=timeout))[0]

        return await fetch_chunked(call, name, max_bytes=self.cfg.max_state, progress=progress)
