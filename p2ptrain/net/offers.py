"""Bytes a peer serves for a short while beside its state (no network code: the transports serve them)."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

from .digest import hexdigest

__all__ = ["Offers"]


class Offers:
    """Bytes a peer serves for a short while beside its state provider's (a round's shard that its region
    fetches: :mod:`p2ptrain.net.hierarchy`), with their digest (net/digest.py) computed once. Expired offers are
    dropped on every :meth:`put`; at most ``keep`` are held (the oldest goes first).

    An offer may be *wanted*: by ``wanted`` fetches (whole transfers, counted by the transport: :meth:`fetched`)
    until ``needed_until`` (monotonic, the round's deadline). A peer that leaves gracefully serves what is still
    wanted before it closes (:meth:`pending_until`): a carrier that left right after applying its round took
    its cell's shard with it, and the cell's round failed.

    Names under a prefix that :meth:`end` closed (a round that ended here) and that are not offered are *declined*
    (:meth:`declines`): an asker is told at once that they will never come, instead of "not yet" until its
    deadline."""

    def __init__(self, keep: int = 256) -> None:
        self.keep = keep
        self._held: OrderedDict[str, tuple[bytes, str, float]] = OrderedDict()
        self._wanted: dict[str, tuple[int, float]] = {}  # name -> (fetches still wanted, until when)
        self._fetched: asyncio.Event | None = None  # set on each fetch while :meth:`served` waits
        self._ended: OrderedDict[str, float] = OrderedDict()  # name prefix -> until when its names are declined

    def put(self, name: str, data: bytes, *, ttl: float, wanted: int = 0, needed_until: float = 0.0) -> str:
        """Serve ``data`` as ``name`` for ``ttl`` seconds (wanted by ``wanted`` fetches until ``needed_until``);
        returns its digest (hex, net/digest.py)."""
        now = time.monotonic()
        for n in [n for n, (_, _, until) in self._held.items() if until <= now]:
            del self._held[n]
        digest = hexdigest(data)
        self._held[name] = (data, digest, now + ttl)
        self._held.move_to_end(name)
        while len(self._held) > self.keep:
            self._held.popitem(last=False)
        self._wanted = {n: w for n, w in self._wanted.items() if n in self._held and w[1] > now}
        if wanted > 0 and needed_until > now:
            self._wanted[name] = (wanted, needed_until)
        return digest

    def fetched(self, name: str) -> None:
        """One whole transfer of ``name`` was served."""
        w = self._wanted.get(name)
        if self._fetched is not None:
            self._fetched.set()
        if w is not None:
            if w[0] <= 1:
                del self._wanted[name]
            else:
                self._wanted[name] = (w[0] - 1, w[1])

    def pending_until(self) -> float | None:
        """The latest deadline of an offer still wanted (monotonic), or None."""
        now = time.monotonic()
        live = [until for n, (_, until) in self._wanted.items() if until > now and n in self._held]
        return max(live, default=None)

    def end(self, prefix: str, *, ttl: float) -> None:
        """Every name under ``prefix`` that is not offered by now never will be (the round it belongs to ended
        here, with or without it): decline them for ``ttl`` seconds (at most ``keep`` prefixes are held)."""
        now = time.monotonic()
        for p in [p for p, until in self._ended.items() if until <= now]:
            del self._ended[p]
        self._ended[prefix] = now + ttl
        self._ended.move_to_end(prefix)
        while len(self._ended) > self.keep:
            self._ended.popitem(last=False)

    def declines(self, name: str) -> bool:
        """Whether ``name`` is not offered and lies under a prefix that :meth:`end` closed."""
        if self.get(name) is not None:
            return False
        now = time.monotonic()
        return any(name.startswith(p) and until > now for p, until in self._ended.items())

    def get(self, name: str) -> tuple[bytes, str] | None:
        held = self._held.get(name)
        if held is None or held[2] <= time.monotonic():
            return None
        return held[0], held[1]

    async def served(self, limit: float) -> float:
        """Wait until nothing offered is still wanted (or its deadline passed), at most ``limit`` seconds; the
        seconds waited."""
        t0 = time.monotonic()
        self._fetched = asyncio.Event()
        try:
            while (until := self.pending_until()) is not None:
                left = min(until, t0 + limit) - time.monotonic()
                if left <= 0:
                    break
                self._fetched.clear()
                try:
                    await asyncio.wait_for(self._fetched.wait(), left)
                except TimeoutError:
                    break
        finally:
            self._fetched = None
        return time.monotonic() - t0
