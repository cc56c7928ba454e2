"""Bytes a peer serves for a short while beside its state (no network code: the transports serve them)."""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict

__all__ = ["Offers"]


class Offers:
    """Bytes a peer serves for a short while beside its state provider's (a round's shard that its region
    fetches: :mod:`p2ptrain.net.hierarchy`), with their SHA-256 computed once. Expired offers are dropped
    on every :meth:`put`; at most ``keep`` are held (the oldest goes first)."""

    def __init__(self, keep: int = 256) -> None:
        self.keep = keep
        self._held: OrderedDict[str, tuple[bytes, str, float]] = OrderedDict()

    def put(self, name: str, data: bytes, *, ttl: float) -> str:
        """Serve ``data`` as ``name`` for ``ttl`` seconds; returns its SHA-256 (hex)."""
        now = time.monotonic()
        for n in [n for n, (_, _, until) in self._held.items() if until <= now]:
            del self._held[n]
        digest = hashlib.sha256(data).hexdigest()
        self._held[name] = (data, digest, now + ttl)
        self._held.move_to_end(name)
        while len(self._held) > self.keep:
            self._held.popitem(last=False)
        return digest

    def get(self, name: str) -> tuple[bytes, str] | None:
        held = self._held.get(name)
        if held is None or held[2] <= time.monotonic():
            return None
        return held[0], held[1]
