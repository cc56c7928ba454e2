"""An in-process swarm: every peer's transport shares one :class:`MemorySwarm` on one event loop.

Used by tests and by the contract suite. It follows the same rules as the real
swarm (leader = smallest live peer, join window, drop-and-renormalise on failure,
fingerprint majority) and can inject faults: a delay per peer, a dead peer (its
messages vanish), and partitions (peers on different sides never meet).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..collective.butterfly import butterfly_mean, ring_factor
from ..collective.codecs import Codec
from ..faults import corrupt_update
from .groups import Forming, agreed_print, alone_check, half_or_less, majority_fingerprint, membership_check
from .guard import Guard, GuardConfig
from .offers import Offers
from .transport import (
    Answered,
    Decide,
    Declined,
    Group,
    Inherit,
    JoinRequest,
    PeerInfo,
    ReduceResult,
    RoundFailed,
    StateProvider,
    Transport,
    Unreachable,
)

__all__ = ["MemorySwarm", "MemoryTransport"]


@dataclass
class _Phase:
    contribs: dict[str, tuple[list[torch.Tensor], float, Sequence[float] | None]] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: tuple[list[torch.Tensor], float, tuple[str, ...], set[str]] | None = None
    agreed: tuple[float, ...] | None = None  # the majority's fingerprint


class MemorySwarm:
    """Shared state of an in-process swarm (one event loop)."""

    def __init__(self, *, join_window: float = 1.0, ttl: float = 5.0, guard: GuardConfig | None = None) -> None:
        self.join_window, self.ttl = join_window, ttl
        self.guard = Guard(guard)  # one for the whole swarm: every reduction happens once, here
        self.corrupt: dict[str, str] = {}  # peer -> kind of broken update it sends (faults.CORRUPTIONS)
        self.infos: dict[str, PeerInfo] = {}
        self.forming: dict[tuple[int, str], Forming] = {}
        self.phases: dict[tuple[int, str, int], _Phase] = {}
        self.dead: set[str] = set()
        self.delay: dict[str, float] = {}
        self.side: dict[str, int] = {}
        self.providers: dict[str, StateProvider] = {}
        self.heirs: dict[str, Inherit] = {}  # by peer: what it does with a bequest (serve_bequests)
        self.offers: dict[str, Offers] = {}  # by peer: what its transport offers beside its provider

    # -- faults ------------------------------------------------------------------------
    def kill(self, peer: str) -> None:
        """The peer vanishes: its announcement and any further messages are gone."""
        self.dead.add(peer)
        self.infos.pop(peer, None)

    def partition(self, *sides: Sequence[str]) -> None:
        """Split the swarm: peers on different sides cannot see or reach each other."""
        self.side = {p: i for i, s in enumerate(sides) for p in s}

    def heal(self) -> None:
        self.side = {}

    def transport(self, peer_id: str) -> MemoryTransport:
        return MemoryTransport(self, peer_id)

    # -- helpers -------------------------------------------------------------------------
    def live(self, side: int) -> list[str]:
        now = time.monotonic()
        return sorted(p for p, i in self.infos.items()
                      if i.expires > now and p not in self.dead and self.side.get(p, 0) == side)

    def known(self) -> list[str]:
        """Every live peer on any side: a partition does not make a peer forgotten (a round's quorum is
        counted of them, as a swarm peer's quorum_memory does for a cut that lasts less than it)."""
        now = time.monotonic()
        return sorted(p for p, i in self.infos.items() if i.expires > now and p not in self.dead)


class MemoryTransport(Transport):
    def __init__(self, swarm: MemorySwarm, peer_id: str) -> None:
        self.swarm, self.peer_id = swarm, peer_id
        self.offers = swarm.offers.setdefault(peer_id, Offers())

    @property
    def _side(self) -> int:
        return self.swarm.side.get(self.peer_id, 0)

    async def _lag(self) -> None:
        if self.peer_id in self.swarm.dead:
            await asyncio.sleep(3600)  # a dead peer's calls never return (the caller's timeout fires)
        d = self.swarm.delay.get(self.peer_id, 0.0)
        if d:
            await asyncio.sleep(d)

    async def announce(self, info: PeerInfo) -> None:
        await self._lag()
        info.expires = time.monotonic() + self.swarm.ttl
        self.swarm.infos[self.peer_id] = info

    async def peers(self) -> list[PeerInfo]:
        now, infos = time.monotonic(), [self.swarm.infos[p] for p in self.swarm.live(self._side)]
        for i in infos:
            i.last_seen = max(0.0, now - (i.expires - self.swarm.ttl))
        return infos

    async def leave(self) -> None:
        self.swarm.infos.pop(self.peer_id, None)

    def serve_state(self, provider: StateProvider) -> None:
        self.swarm.providers[self.peer_id] = provider

    def serve_bequests(self, accept: Inherit) -> None:
        self.swarm.heirs[self.peer_id] = accept

    async def bequeath(self, peer_id: str, name: str, *, timeout: float) -> str | None:
        await self._lag()
        sw = self.swarm
        accept = sw.heirs.get(peer_id)
        if peer_id in sw.dead or sw.side.get(peer_id, 0) != self._side:
            await asyncio.sleep(timeout)
            raise Unreachable(f"bequest: peer {peer_id} cannot be reached")
        if accept is None:
            return "no heir here"
        try:
            data = await sw.transport(peer_id).fetch_state(self.peer_id, name, timeout=timeout)
        except RoundFailed as e:
            return f"download: {e}"
        return await accept(self.peer_id, data)

    async def fetch_state(self, peer_id: str, name: str, *, timeout: float,
                          progress: Callable[[int, int], None] | None = None) -> bytes:
        await self._lag()
        sw = self.swarm
        offers = sw.offers.get(peer_id)
        if peer_id in sw.dead or sw.side.get(peer_id, 0) != self._side or (peer_id not in sw.providers
                                                                             and offers is None):
            await asyncio.sleep(timeout)
            raise RoundFailed(f"state {name!r}: peer {peer_id} did not answer")
        offered = offers.get(name) if offers is not None else None
        provider = sw.providers.get(peer_id)
        data = offered[0] if offered is not None else provider(name) if provider is not None else None
        if data is None:
            if offers is not None and offers.declines(name):
                raise Declined(f"state {name!r}: peer {peer_id} ended its round without it")
            raise Answered(f"state {name!r}: peer {peer_id} has none")
        if offered is not None and offers is not None:
            offers.fetched(name)
        if progress is not None:
            progress(len(data), len(data))
        return data

    async def form_group(self, request: JoinRequest, decide: Decide | None, *, timeout: float) -> Group:
        async def _form() -> Group:
            await self._lag()
            sw, side = self.swarm, self._side
            f = sw.forming.get((side, request.key))
            if f is None:
                f = sw.forming[(side, request.key)] = Forming(request.key, sw.join_window)
            f.join(request, decide)

            async def live(fresh: bool) -> set[str]:
                return set(sw.live(side)) | {self.peer_id}

            # A dead peer's request is void: the group closes without it, led by the smallest member left.
            group = await f.until_closed(live, drop=sw.dead, known=sw.known)
            membership_check(group, request)
            alone_check(group, self.peer_id, sw.live(side))
            return group

        try:
            return await asyncio.wait_for(_form(), timeout)
        except TimeoutError:
            raise RoundFailed(f"round {request.key}: no group within {timeout:.1f} s") from None

    async def allreduce(self, group: Group, phase: int, tensors: Sequence[torch.Tensor], weight: float,
                        codec: Codec, *, timeout: float, fingerprint: Sequence[float] | None = None) -> ReduceResult:
        t0 = time.monotonic()
        sw = self.swarm
        key = (self._side, group.key, phase)
        ph = sw.phases.setdefault(key, _Phase())
        await self._lag()
        mine = [t.detach().float().cpu().clone() for t in tensors]
        if self.peer_id in sw.corrupt:
            flat = torch.cat([t.reshape(-1) for t in mine]) if mine else torch.zeros(0)
            mode = sw.corrupt[self.peer_id]
            mine = [flat[: flat.numel() // 2] if mode == "truncate" else corrupt_update(flat, mode)]
        ph.contribs[self.peer_id] = (mine, float(weight), fingerprint)
        expected = set(group.members)
        deadline = t0 + timeout
        while ph.result is None:
            present = {p for p in ph.contribs if p not in sw.dead}
            gone = sw.dead | (expected - set(sw.live(self._side)))  # dead, left, or expired: not waited for
            if expected - gone <= present or time.monotonic() >= deadline:
                self._reduce(ph, group, codec)
                break
            try:
                await asyncio.wait_for(ph.done.wait(), max(0.0, min(0.05, deadline - time.monotonic())))
            except TimeoutError:
                pass
        assert ph.result is not None
        avg, total, contributors, agree = ph.result
        if not contributors:
            raise RoundFailed(f"round {group.key} phase {phase}: nothing averaged")
        heard = {p for p in ph.contribs if p in group.members and p not in sw.dead}
        if half_or_less(len(heard), len(group.members)):
            # As a butterfly's member does (net/parts.py): a phase heard from half of its group or less may be one
            # side of a cut, whose other side may apply an average of its own. (A hierarchical round's cross step
            # between two regions, cut mid-round, ended on each side with that side's shard: a fork.)
            raise RoundFailed(f"round {group.key} phase {phase}: heard from {len(heard)} of {len(group.members)} "
                              f"(half or less: the other side of a cut may hold the others)")
        n = sum(t.numel() for t in tensors)
        nbytes = int(ring_factor(len(contributors)) * codec.encoded_size(n))
        device = tensors[0].device if tensors else torch.device("cpu")
        return ReduceResult([a.to(device) for a in avg], total, group.members, contributors,
                            partial=len(contributors) < len(group.members), bytes_sent=nbytes, bytes_received=nbytes,
                            seconds=time.monotonic() - t0, divergent=self.peer_id not in agree, agreed=ph.agreed,
                            missing=() if self.peer_id in contributors or not n else ((0, n),))

    def _reduce(self, ph: _Phase, group: Group, codec: Codec) -> None:
        present = {p: c for p, c in ph.contribs.items() if p not in self.swarm.dead and p in group.members}
        prints = {p: c[2] for p, c in present.items() if c[2] is not None}
        agree = majority_fingerprint(prints) if prints else set(present)
        ph.agreed = agreed_print(prints, agree)
        use = sorted(p for p in present if p in agree)
        result: tuple[list[torch.Tensor], float, tuple[str, ...], set[str]] = ([], 0.0, (), agree)
        if use:
            guard = self.swarm.guard
            flats = {p: torch.cat([t.reshape(-1) for t in present[p][0]]) if present[p][0] else torch.zeros(0)
                     for p in use}
            numel = Counter(f.numel() for f in flats.values()).most_common(1)[0][0]
            # Other sizes are dropped without a strike: an honest member whose view of the round differs
            # sends those too (see net/parts.py).
            sizes = [p for p in use if flats[p].numel() == numel]
            # The guard's checks (weights, finite values, norm bound) on whole contributions; then what a
            # butterfly of the accepted members computes, part by part (collective.butterfly).
            try:
                _, total, used, _ = guard.aggregate({p: (flats[p], present[p][1]) for p in sizes})
            except ValueError:
                used = []
            if used:
                out = butterfly_mean([flats[p] for p in used], [present[p][1] for p in used], codec,
                                     how=guard.cfg.aggregation)
                shapes, offset, pieces = [t.shape for t in present[used[0]][0]], 0, []
                for shape in shapes:
                    n = int(torch.Size(shape).numel())
                    pieces.append(out[offset : offset + n].view(shape))
                    offset += n
                result = (pieces, total, tuple(used), agree)
        ph.result = result  # once, complete: a member waiting for it must never see half of it
        ph.done.set()
