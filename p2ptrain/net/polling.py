"""Asking peers for bytes they offer by name (a hierarchical round's shards, their digests and vote notes): until
they offer them, until they cannot be reached, or until they say they never will.

A carrier that is frozen, cut off or gone gives no answer, and one whose round ended without the shard (its carry
failed, or its own round failed before it began) used to answer "not yet" until the asker's deadline: its cell's
members waited most of the round for it before asking another cell's carrier, one after the other, each until the
deadline again (churn benchmark: rounds that failed on "no carrier delivered it" took 67 s, median, against 17 s
for an applied round, and held the compute thread meanwhile). Now a peer whose round ended declines its names
(:class:`~p2ptrain.net.transport.Declined`, see :meth:`p2ptrain.net.offers.Offers.end`), and :func:`first_of` asks
several peers, starting the next one when the ones asked so far are silent for a while or have declined.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from .transport import Answered, Declined, RoundFailed, Transport, Unreachable

__all__ = ["STAGGER", "UNREACHABLE_TRIES", "answer", "first_of", "poll"]

#: A peer whose dial failed this many times in a row is not asked again in this round (it left or its host is
#: gone: a carrier that left right after its round was polled until the round's deadline, the testbed at 20 Mbit/s).
UNREACHABLE_TRIES = 3

#: Seconds :func:`first_of` waits on the peers asked so far before it asks the next one as well. A peer that
#: answers late costs its bytes twice at most (both transfers run); one that never answers costs this, not the
#: round's remaining time.
STAGGER = 5.0


async def poll(transport: Transport, peer: str, name: str, deadline: float,
               heard: Callable[[], None] | None = None) -> bytes:
    """Fetch ``name`` from ``peer``, asking again (20 ms, doubling to 250 ms) until it is offered or ``deadline``
    (monotonic) passes, the peer could not be reached :data:`UNREACHABLE_TRIES` times in a row, or it declines
    (its round ended without the name): RoundFailed (Declined for the last). ``heard`` is called whenever the peer
    shows it is alive: an answer ("not yet" too), or a chunk of the transfer."""
    wait, last, unreachable = 0.02, "nothing asked", 0
    progress = None if heard is None else (lambda done, total: heard())
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RoundFailed(f"{name}: {peer[-8:]} did not offer it in time ({last})")
        try:
            return await transport.fetch_state(peer, name, timeout=left, progress=progress)
        except Declined:
            raise
        except Answered as e:
            last, unreachable = str(e), 0
            if heard is not None:
                heard()
        except Unreachable as e:
            last, unreachable = str(e), unreachable + 1
            if unreachable >= UNREACHABLE_TRIES:
                raise RoundFailed(f"{name}: {peer[-8:]} cannot be reached ({last})") from None
        except (RoundFailed, TimeoutError, ConnectionError, OSError) as e:
            last, unreachable = str(e), 0
        await asyncio.sleep(min(wait, max(0.0, deadline - time.monotonic())))
        wait = min(0.25, wait * 2)


async def answer(transport: Transport, peer: str, name: str, deadline: float,
                 heard: Callable[[], None] | None = None) -> bytes | RoundFailed:
    """:func:`poll`, with silence as an answer (never raises: a TaskGroup that owns it only awaits it)."""
    try:
        return await poll(transport, peer, name, deadline, heard)
    except RoundFailed as e:
        return e


async def first_of(transport: Transport, peers: Sequence[str], name: str, deadline: float, *,
                   stagger: float = STAGGER) -> tuple[str, bytes]:
    """``name`` from whichever of ``peers`` offers it first, as (peer, bytes): the first is asked, and the next
    one as well once every peer asked so far has declined, could not be reached, gave up, or said nothing for
    ``stagger`` seconds (the peers that are still asked go on). RoundFailed when none delivers by ``deadline``."""
    waiting = list(peers)
    asked: dict[asyncio.Task[bytes | RoundFailed], str] = {}
    errors: list[str] = []
    async with asyncio.TaskGroup() as tg:  # (answer() never raises: the group owns the asks and awaits them)
        try:
            while waiting or asked:
                if waiting:
                    peer = waiting.pop(0)
                    asked[tg.create_task(answer(transport, peer, name, deadline))] = peer
                done, _ = await asyncio.wait(asked, timeout=stagger if waiting else None,
                                             return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    peer, got = asked.pop(task), task.result()
                    if isinstance(got, bytes):
                        return peer, got
                    errors.append(str(got))
        finally:
            for task in asked:
                task.cancel()
    raise RoundFailed(f"{name}: no carrier delivered it ({'; '.join(errors) or 'nobody to ask'})")
