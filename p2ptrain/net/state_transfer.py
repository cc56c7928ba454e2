"""Chunked, hash-verified state transfer (a late joiner's θ, outer state and counters).

The serving peer snapshots the state once per transfer, publishes its digest (net/digest.py) and size
in the first reply, and serves the same bytes chunk by chunk (so a transfer stays
consistent while the swarm moves on). The receiver checks the announced size against
its limit before allocating, assembles the chunks in order and verifies the hash; a
source that dies or lies mid-transfer fails that download, and the caller tries
another source (:meth:`p2ptrain.net.transport.Transport.download_state`).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from .digest import hexdigest
from .offers import Offers
from .transport import Answered, Declined, RoundFailed, StateProvider

__all__ = ["DEFAULT_CHUNK", "MAX_STATE", "Progress", "StateServer", "fetch_chunked"]

DEFAULT_CHUNK = 4 * 1024 * 1024  # bytes per reply: well under the frame limit, few round trips
MAX_STATE = 64 * 1024**3  # the largest state a receiver accepts (a 1B model with Adam state is ~16 GB)
Progress = Callable[[int, int], None]  # (bytes received so far, total)
Call = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class StateServer:
    """The serving side: snapshots by hash, kept for a while so that a transfer can finish; ``offers`` are
    served first (without a copy: they do not change)."""

    def __init__(self, chunk: int = DEFAULT_CHUNK, keep: int = 4, keep_seconds: float = 300.0,
                 offers: Offers | None = None) -> None:
        if chunk <= 0:
            raise ValueError("state chunk size must be positive")
        self.chunk, self.keep, self.keep_seconds = chunk, keep, keep_seconds
        self.provider: StateProvider | None = None
        self.offers = offers if offers is not None else Offers()
        self._served: OrderedDict[str, tuple[bytes, float]] = OrderedDict()

    def _prune(self) -> None:
        now = time.monotonic()
        for digest in [d for d, (_, t) in self._served.items() if now - t > self.keep_seconds]:
            del self._served[digest]
        while len(self._served) > self.keep:
            self._served.popitem(last=False)

    async def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Answer one request: ``{"name"}`` starts a transfer, ``{"name", "digest", "offset"}`` continues it."""
        name, want, offset = msg.get("name"), msg.get("digest"), msg.get("offset", 0)
        if not isinstance(name, str) or not isinstance(offset, int) or offset < 0:
            return {"error": "bad state request"}
        offered = self.offers.get(name)
        if offered is None and self.offers.declines(name):
            return {"error": f"{name!r} ended here without it", "declined": True}
        from_offer = offered is not None and want in (None, offered[1])
        if offered is not None and from_offer:
            data, digest = offered
        elif want is None:
            if self.provider is None:
                return {"error": "no state here"}
            data = await asyncio.to_thread(self.provider, name)
            if data is None:
                return {"error": "unknown state"}
            digest = await asyncio.to_thread(hexdigest, data)
            self._served[digest] = (data, time.monotonic())
            self._served.move_to_end(digest)
            self._prune()
        elif isinstance(want, str) and want in self._served:
            digest, data = want, self._served[want][0]
        else:
            return {"error": "that state is no longer served"}
        if offset > len(data):
            return {"error": "offset past the end of the state"}
        if from_offer and offset + self.chunk >= len(data):  # the transfer's last reply
            self.offers.fetched(name)
        return {"digest": digest, "size": len(data), "offset": offset, "chunk": data[offset : offset + self.chunk]}


async def fetch_chunked(call: Call, name: str, *, max_bytes: int = MAX_STATE,
                        progress: Progress | None = None) -> bytes:
    """Download the state ``name`` through ``call`` (one request/response with the source, which
    enforces the timeout of each wait); RoundFailed on any error, a size over ``max_bytes``, a
    malformed reply or a hash mismatch."""

    def check(reply: dict[str, Any], offset: int) -> bytes:
        if "error" in reply:
            raise (Declined if reply.get("declined") is True else Answered)(f"state {name!r}: {reply['error']}")
        chunk = reply.get("chunk")
        if not isinstance(chunk, bytes) or reply.get("offset") != offset:
            raise RoundFailed(f"state {name!r}: malformed reply at offset {offset}")
        return chunk

    first = await call({"name": name})
    chunk = check(first, 0)
    size, digest = first.get("size"), first.get("digest")
    if not isinstance(size, int) or not isinstance(digest, str) or not 0 <= size <= max_bytes:
        raise RoundFailed(f"state {name!r}: announced size {size!r} is not acceptable (limit {max_bytes})")
    buf = bytearray(size)
    offset = 0
    while True:
        if (not chunk and offset < size) or offset + len(chunk) > size:
            raise RoundFailed(f"state {name!r}: chunk at {offset} does not fit the announced size {size}")
        buf[offset : offset + len(chunk)] = chunk
        offset += len(chunk)
        if progress is not None:
            progress(offset, size)
        if offset >= size:
            break
        chunk = check(await call({"name": name, "digest": digest, "offset": offset}), offset)
    data = bytes(buf)
    if await asyncio.to_thread(hexdigest, data) != digest:
        raise RoundFailed(f"state {name!r}: hash mismatch (corrupt or lying source)")
    return data
