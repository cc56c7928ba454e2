"""A census of the peer's live Python objects, logged now and then: what grows in a long run (a diagnostic, off by
default; ``P2PTRAIN_CENSUS_SECONDS=120`` turns it on).

Resident memory says that a peer grows, not what grows. Every ``every`` seconds this logs the number of asyncio tasks
on the network loop and the object types whose count changed the most since the first census (``event=census``):
a kind of object that is never released shows as a count that only climbs. It also logs resident memory beside
what the C heap hands out and holds free (glibc's mallinfo2): growth in the free part is fragmentation. The walk over every object takes the GIL
for tens of milliseconds to a few hundred on a large process; it runs on a worker thread, so the network loop only
pauses as any other thread's work would pause it.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
from collections import Counter

__all__ = ["ENV", "census_every", "count_types", "grown", "heap_mb", "run_census"]

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


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_mb() -> tuple[float, float, float] | None:
    """(resident MB, MB the C heap hands out, MB it holds free) of this process, or None where glibc's mallinfo2
    is not there. Resident memory that grows while the heap's live part stays flat is memory freed but not given
    back (fragmentation), not a leak of objects."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        info = libc.mallinfo2()
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, AttributeError, ValueError):
        return None
    mb = 1024.0 * 1024.0
    return rss / mb, (info.uordblks + info.hblkhd) / mb, info.fordblks / mb


async def run_census(every: float) -> None:
    """Log a census every ``every`` seconds until cancelled (its owner's TaskGroup cancels it)."""
    first: Counter[str] | None = None
    while True:
        now = await asyncio.to_thread(count_types)
        first = first if first is not None else now
        change = " ".join(f"{k}:{d:+d}" for k, d in grown(first, now))
        heap = heap_mb()
        mem = "rss_mb=- heap_used_mb=- heap_free_mb=-" if heap is None else \
            f"rss_mb={heap[0]:.1f} heap_used_mb={heap[1]:.1f} heap_free_mb={heap[2]:.1f}"
        log.info("event=census tasks=%d objects=%d %s grown=%s", len(asyncio.all_tasks()), sum(now.values()), mem,
                 change or "-")
        await asyncio.sleep(every)
