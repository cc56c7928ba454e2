"""A census of the peer's live Python objects, logged now and then: what grows in a long run (a diagnostic, off by
default; ``P2PTRAIN_CENSUS_SECONDS=120`` turns it on).

Resident memory says that a peer grows, not what grows. Every ``every`` seconds this logs the number of asyncio tasks
on the network loop and the object types whose count changed the most since the first census (``event=census``):
a kind of object that is never released shows as a count that only climbs. The walk over every object takes the GIL
for tens of milliseconds to a few hundred on a large process; it runs on a worker thread, so the network loop only
pauses as any other thread's work would pause it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
from collections import Counter

__all__ = ["ENV", "census_every", "count_types", "grown", "run_census"]

log = logging.getLogger(__name__)
ENV = "P2PTRAIN_CENSUS_SECONDS"


def census_every(env: dict[str, str] | None = None) -> float:
    """Seconds between two censuses from ``P2PTRAIN_CENSUS_SECONDS`` (0: off). ValueError for a value that is
    not a non-negative number."""
    raw = (os.environ if env is None else env).get(ENV, "").strip()
    if not raw:
        return 0.0
    try:
        every = float(raw)
    except ValueError:
        raise ValueError(f"{ENV} must be a number of seconds, got {raw!r}") from None
    if not every >= 0:
        raise ValueError(f"{ENV} must be at least 0, got {raw!r}")
    return every


def count_types() -> Counter[str]:
    """How many live objects the garbage collector tracks, by qualified type name."""
    return Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())


def grown(first: Counter[str], now: Counter[str], top: int = 12) -> list[tuple[str, int]]:
    """The ``top`` types whose count changed the most from ``first`` to ``now`` (largest growth first)."""
    change = {k: now.get(k, 0) - first.get(k, 0) for k in set(first) | set(now)}
    return sorted(((k, d) for k, d in change.items() if d), key=lambda kd: (-abs(kd[1]), kd[0]))[:top]


async def run_census(every: float) -> None:
    """Log a census every ``every`` seconds until cancelled (its owner's TaskGroup cancels it)."""
    first: Counter[str] | None = None
    while True:
        now = await asyncio.to_thread(count_types)
        first = first if first is not None else now
        change = " ".join(f"{k}:{d:+d}" for k, d in grown(first, now))
        log.info("event=census tasks=%d objects=%d grown=%s", len(asyncio.all_tasks()), sum(now.values()),
                 change or "-")
        await asyncio.sleep(every)
