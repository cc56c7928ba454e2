"""Peers known live from direct contact, beside the DHT's view: :class:`Contacts`.

After a network split heals, the DHT can keep showing each side only its own peers for a long while (its
records were stored and are read within each half). With a round quorum (net/groups.py) neither side then
averages. A leader whose group closed without peers its view shows live says hello to them; a peer that gets a
hello, or a join from a peer its view lacks, counts that peer live for one ``ttl``. Their next rounds then
pick the same leader: the views merge by the rounds' own traffic, not only through the DHT.

:class:`Addresses`: the addresses each peer announced, for dialing it again (a stream's dial, the re-pings that
heal a split); a peer not seen live for ``forget_after`` seconds, or that announced its departure, is forgotten.
Kept forever, a swarm under churn re-pinged every id it ever saw (a killed peer restarts under a new one) every
few seconds, one after the other, for as long as it ran.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

__all__ = ["Addresses", "Contacts"]


class Contacts:
    """Peers heard from directly, each live until ``ttl`` seconds after it was last heard; and when each
    was last greeted (a hello at most once per ``ttl`` per peer). ``clock``: monotonic seconds."""

    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl, self.clock = ttl, clock
        self._heard: dict[str, float] = {}
        self._greeted: dict[str, float] = {}

    def heard(self, peer: str) -> None:
        """``peer`` reached us (a hello, a join): it is live for one more ``ttl``."""
        self._heard[peer] = self.clock() + self.ttl

    def live(self) -> set[str]:
        """The peers heard from within the last ``ttl`` (expired ones are forgotten)."""
        now = self.clock()
        for p in [p for p, until in self._heard.items() if until <= now]:
            del self._heard[p]
        return set(self._heard)

    def to_greet(self, peers: Iterable[str]) -> list[str]:
        """Those of ``peers`` not greeted within the last ``ttl``, marked greeted now."""
        now = self.clock()
        out = sorted(p for p in set(peers) if now - self._greeted.get(p, -float("inf")) >= self.ttl)
        for p in out:
            self._greeted[p] = now
        for p in [p for p, t in self._greeted.items() if now - t > 10 * self.ttl]:
            del self._greeted[p]
        return out

    def forget(self, peer: str) -> None:
        """``peer`` left or was banned."""
        self._heard.pop(peer, None)


class Addresses:
    """The addresses each peer announced, and when a view last showed it live. ``clock``: monotonic seconds."""

    def __init__(self, forget_after: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.forget_after, self.clock = forget_after, clock
        self._addrs: dict[str, list[str]] = {}
        self._seen: dict[str, float] = {}

    def seen(self, peer: str, addrs: list[str]) -> None:
        """A view showed ``peer`` live, announcing ``addrs``."""
        self._addrs[peer], self._seen[peer] = list(addrs), self.clock()

    def get(self, peer: str) -> list[str]:
        return list(self._addrs.get(peer, []))

    def forget(self, peer: str) -> None:
        """``peer`` announced its departure (or was banned)."""
        self._addrs.pop(peer, None)
        self._seen.pop(peer, None)

    def current(self) -> dict[str, list[str]]:
        """peer -> addresses (copies) of every peer seen live within ``forget_after``; older ones are forgotten."""
        now = self.clock()
        for p in [p for p, t in self._seen.items() if now - t > self.forget_after]:
            self.forget(p)
        return {p: list(a) for p, a in self._addrs.items()}
