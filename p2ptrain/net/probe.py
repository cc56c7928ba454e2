"""A first measure of the links to the members of a round, before its first phase: :func:`probe_links`.

A round's timeout follows the slowest link's measured rate (sync.py), but nothing has been measured before the
first round: it got the method's fixed timeout, and on a slow link between regions its parts could not cross in
time. 4 peers in 2 regions at 20 Mbit/s (`bench/utilization.py --between-rate 20mbit`): diloco's first round
failed on every peer after its cross-region sends timed out, its ~100 MB on the wire for nothing (1.81× the
payload in that run). A probe of a few hundred kB to a few members the meter knows nothing of, over the path the
round will use (after a tiny exchange that opens it), gives the meter a rate to start from: low rather than high
(a short transfer is slowed by TCP's slow start), so the first timeout errs long. The round's own transfers
replace it (:meth:`~p2ptrain.net.bandwidth.LinkMeter.seed`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from .bandwidth import LinkMeter
from .transport import RoundFailed

__all__ = ["PROBE_BYTES", "PROBE_PEERS", "on_probe", "probe_links"]

log = logging.getLogger(__name__)

#: Bytes of one probe: enough to be more than latency on a fast link, little next to a fragment.
PROBE_BYTES = 512 * 1024
#: Members probed at most per round (those the meter knows nothing of, drawn at random): the round waits on
#: its slowest link, and a few draws find a slow one in a group of regions without costing O(k) probes.
PROBE_PEERS = 8

Call = Callable[..., Awaitable[tuple[dict[str, Any], float]]]


async def on_probe(sender: str, msg: dict[str, Any]) -> dict[str, Any]:
    """Answer a probe: its bytes are read and dropped. A probe larger than :data:`PROBE_BYTES` is refused."""
    data = msg.get("data")
    if not isinstance(data, bytes) or len(data) > PROBE_BYTES:
        return {"error": f"a probe carries at most {PROBE_BYTES} bytes"}
    return {"ok": True}


async def probe_links(call: Call, links: LinkMeter, peers: Sequence[str], *, timeout: float,
                      nbytes: int = PROBE_BYTES, most: int = PROBE_PEERS) -> int:
    """Probe up to ``most`` of ``peers`` whose link ``links`` has not measured, all at once, each within
    ``timeout`` seconds; seed the meter with what each took (a probe cut off by its timeout counts as having
    taken all of it). The number of links seeded."""
    unknown = [p for p in peers if not links.known(p)]
    if not unknown:
        return 0
    chosen = random.sample(unknown, min(most, len(unknown)))
    deadline = time.monotonic() + timeout

    async def one(peer: str) -> bool:
        try:
            await call(peer, "probe", {"data": b""}, timeout=max(0.1, deadline - time.monotonic()))  # opens the path
            t0 = time.monotonic()
            reply, _ = await call(peer, "probe", {"data": bytes(nbytes)}, timeout=max(0.1, deadline - t0))
            if not reply.get("ok"):
                return False
            links.seed(peer, nbytes, time.monotonic() - t0)
        except (RoundFailed, TimeoutError) as e:
            if time.monotonic() < deadline:
                log.info("event=probe_failed peer=%s reason=%s", peer[-8:], e)
                return False  # refused or unreachable: the round finds out for itself
            links.seed(peer, nbytes, timeout)  # still going at the deadline: slower than that
        return True

    return sum(await asyncio.gather(*(one(p) for p in chosen)))
