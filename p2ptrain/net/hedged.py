"""A state downloaded from the first of several sources that answers.

Asked one at a time, a source that cannot answer (across a region cut, dead, behind a dial backoff) costs its whole
timeout before the next is asked: in churn, an outvoted peer's repair waited 60-70 s when its first two sources
were across a cut. :func:`hedged_download` asks the next source too once ``hedge`` seconds have passed and no
source asked has sent a first chunk, goes on with the first that does and drops the others still silent: the state
crosses the wire once, and a silent source costs ``hedge`` seconds instead of its timeout. A source that fails
(mid-transfer too) passes the download on to the next.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

__all__ = ["Progress", "SourceFetch", "hedged_download"]

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]
#: (source, progress) -> the state's bytes; raises ``failure`` when that source cannot deliver it. Each wait is bounded.
SourceFetch = Callable[[str, Progress], Awaitable[bytes]]


async def hedged_download(fetch: SourceFetch, sources: Sequence[str], *, hedge: float | None,
                          failure: type[Exception], progress: Progress | None = None,
                          what: str = "state") -> tuple[str, bytes]:
    """(source, bytes) from the first of ``sources`` (in order of preference) that delivers them whole.

    ``hedge``: seconds after which, while none of the sources asked has answered (its first chunk), the next is
    asked as well; None asks one at a time. ``failure``: what a source that cannot deliver raises (the
    transport's RoundFailed); raised, naming every source's error, when none delivers. ``progress`` follows the
    source that answered first."""
    if hedge is not None and not hedge > 0:
        raise ValueError(f"hedge must be a positive number of seconds or None, not {hedge!r}")
    waiting = list(sources)
    running: dict[asyncio.Task[bytes | Exception], str] = {}
    answered: set[str] = set()
    leader: list[str] = []  # the first source that answered and has not failed since: progress follows it
    first_chunk = asyncio.Event()
    errors: list[str] = []

    async def attempt(peer: str) -> bytes | Exception:
        def seen(done: int, total: int) -> None:
            if peer not in answered:
                answered.add(peer)
                first_chunk.set()
            if not leader:
                leader.append(peer)
            if progress is not None and leader[0] == peer:
                progress(done, total)

        try:
            return await fetch(peer, seen)
        except failure as e:  # (a value: the group's other tasks go on)
            return e

    def drop(tasks: list[asyncio.Task[bytes | Exception]]) -> None:
        for t in tasks:
            t.cancel()
            running.pop(t, None)

    async with asyncio.TaskGroup() as tg:  # (cancelled tasks are awaited when it ends)
        while waiting or running:
            if not running:
                peer = waiting.pop(0)
                running[tg.create_task(attempt(peer))] = peer
            hedging = hedge if waiting else None
            if any(p in answered for p in running.values()):
                drop([t for t, p in running.items() if p not in answered])  # silent ones: not needed now
                hedging = None
            first_chunk.clear()
            chunk_seen = tg.create_task(first_chunk.wait())
            done, _ = await asyncio.wait([*running, chunk_seen], timeout=hedging, return_when=asyncio.FIRST_COMPLETED)
            chunk_seen.cancel()
            for t in [t for t in done if t is not chunk_seen]:
                peer = running.pop(t)
                got = t.result()
                if not isinstance(got, Exception):
                    drop(list(running))
                    return peer, got
                errors.append(f"{peer[-8:]}: {got}")
                answered.discard(peer)
                if leader == [peer]:
                    leader.clear()
            if not done and waiting:  # ``hedge`` s without a first chunk from any: ask the next source too
                peer = waiting.pop(0)
                log.info("event=download_hedged what=%s silent=%s next=%s", what,
                         ",".join(p[-8:] for p in running.values()), peer[-8:])
                running[tg.create_task(attempt(peer))] = peer
    raise failure(f"{what}: no source delivered it ({'; '.join(errors) or 'no sources'})")
