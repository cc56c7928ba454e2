"""A stand-in for a hierarchical shard's carrier that went silent, in a round of two cells.

With two cells (two regions, or one region cut off from a third), every shard crosses between two carriers, one a
cell, and the butterfly of two cannot tell a partner that froze or died from one on the other side of a cut: a
part heard from one of two is left out (net/parts.py), so one silent carrier fails its shard, and the shard fails
the round for every member (churn benchmark: every round that failed everywhere had a region cut in it, and
during a cut the quorum group holds two cells; a freeze or a kill of any of its members then failed the round).

But after step 1 every member of a cell holds the same bytes of its cell's mean: another member of the silent
carrier's cell can carry its shard. So, only for shards of two carriers:

* the silent carrier's *stand-in* (the next member of its cell, :func:`standin_of`) notices the silence while it
  fetches the shard from it (no answer at all for :func:`~p2ptrain.net.hierarchy.silence` seconds, as its other
  members do), offers a marker (``hier/<key>/<phase>/in/s<s>``) and runs the shard's cross step in the carrier's
  place (the group ``<key>#s<s>~<carrier>``, with the cell's mean, weight and θ print, as the carrier would have);
* the other carrier, while its own cross step runs, watches the stand-in's marker from that silence into
  its carry (once a second; a round whose cross step ends sooner never asks) and, once it is offered, runs the
  stand-in's group as well. It keeps whichever of the two steps ends with a result first; if its own failed, it
  waits for the marker until its cross step's budget ends.

Why it cannot fork θ: either step averages the same two cell means with the same weights, in the same butterfly,
each part owned on the same side (an owner averages a raw share of its own and a decoded one of the other's, and
every member uses the owner's decoded result), so the silent carrier, had it finished after all, holds the same
bytes as the stand-in's step gives (on the same float arithmetic; the cross-checks of the shard's digest between
the cells catch the rest). A stand-in is only called in when its cell mate is silent to it; the other carrier only
runs the stand-in's group once its marker is offered, so a carrier that is alive and answers is never replaced by its cell.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

import torch

from ..collective.codecs import Codec
from .allreduce import _settled
from .groups import fingerprints_match
from .transport import Declined, Group, ReduceResult, RoundFailed, Transport
from .wire import FrameError, decode_message, encode_message

__all__ = ["STEP", "VOID", "carry_shard", "cells_by_member", "partner_standin", "stand_in", "standin_group",
           "standin_of", "void_marker"]

log = logging.getLogger(__name__)

WATCH_EVERY = 1.0  # seconds between a carrier's asks for its partner's stand-in's marker
STEP, VOID = b"1", b"0"  # the marker: the stand-in steps in; its cell's mean lacks the shard (nothing to carry)


def void_marker(fingerprint: Sequence[float] | None) -> bytes:
    """The marker of a cell whose mean lacks the shard, with the print of the cell's θ: the other carrier offers its
    cell's mean alone only onto the same θ (on two θ, a round of two cells settles which one by their carriers'
    vote; taken alone, the other cell's θ went on while this one failed, and the swarm repaired it away after:
    churn_standin, two rounds applied by one cell of five or six members and 580 k tokens dropped)."""
    return VOID + encode_message({"print": None if fingerprint is None else [float(v) for v in fingerprint]})


def _same_theta(marker: bytes, fingerprint: Sequence[float] | None) -> bool:
    """Whether a void ``marker``'s print is ``fingerprint`` (both None: nobody votes)."""
    try:
        theirs = decode_message(marker[1:], max_size=64 * 1024).get("print")
    except FrameError:
        return False
    if theirs is None or fingerprint is None:
        return theirs is None and fingerprint is None
    return (isinstance(theirs, list) and all(isinstance(v, float | int) and not isinstance(v, bool) for v in theirs)
            and fingerprints_match([float(v) for v in theirs], fingerprint))


def cells_by_member(cells: Sequence[Sequence[str]]) -> dict[str, tuple[str, ...]]:
    """Each member: its cell's members, sorted."""
    return {m: ms for ms in (tuple(sorted(c)) for c in cells) for m in ms}


def standin_of(carriers: Sequence[str], cell_of: dict[str, tuple[str, ...]], replaced: str) -> str | None:
    """Who stands in for ``replaced``, one of a shard's two ``carriers``: the next member of its cell (sorted,
    cyclic) that sorts on the same side of the other carrier as ``replaced`` does, so that each of the shard's two
    parts keeps its owner's side (an owner averages its own share raw and the other's decoded: with the owners
    swapped, a lossy codec's result would differ from the replaced carrier's). None: the shard has more carriers,
    or no member of the cell fits."""
    if len(carriers) != 2 or replaced not in carriers:
        return None
    (other,) = [c for c in carriers if c != replaced]
    ms = cell_of.get(replaced, ())
    if replaced not in ms:
        return None
    i = ms.index(replaced)
    return next((m for m in ms[i + 1:] + ms[:i] if (m < other) == (replaced < other)), None)


def standin_group(carriers: Sequence[str], cell_of: dict[str, tuple[str, ...]], group: Group, s: int,
                  replaced: str) -> Group | None:
    """Shard ``s``'s cross-step group with ``replaced`` carried by its stand-in (:func:`standin_of`); None when it
    has none."""
    sub = standin_of(carriers, cell_of, replaced)
    if sub is None:
        return None
    members = tuple(sorted([c for c in carriers if c != replaced] + [sub]))
    return Group(f"{group.key}#s{s}~{replaced[-12:]}", members, min(members), group.fragment, group.signature,
                 group.schedule)


def partner_standin(carriers: Sequence[str], cell_of: dict[str, tuple[str, ...]],
                    me: str) -> tuple[str, str] | None:
    """(the other carrier, its stand-in) of a shard of two carriers that ``me`` carries; None otherwise."""
    if len(carriers) != 2 or me not in carriers:
        return None
    (partner,) = [c for c in carriers if c != me]
    sub = standin_of(carriers, cell_of, partner)
    return None if sub is None else (partner, sub)


async def _marked(transport: Transport, peers: Sequence[str], name: str, start: float, end: float) -> bytes | None:
    """The marker ``name`` once one of ``peers`` offers it by ``end`` (monotonic), each asked on its own once a
    :data:`WATCH_EVERY` from ``start`` (a silent one holds up no other); None if none does, or all decline (their
    rounds ended without it)."""
    async def one(peer: str) -> bytes | None:
        await asyncio.sleep(max(0.0, start - time.monotonic()))
        while (left := end - time.monotonic()) > 0:
            try:
                got = await transport.fetch_state(peer, name, timeout=min(left, 5.0))
                return got if got == STEP or got[:1] == VOID else None
            except Declined:
                return None
            except (RoundFailed, TimeoutError, ConnectionError, OSError):
                pass  # not yet, or not reached: asked again
            await asyncio.sleep(max(0.0, min(WATCH_EVERY, end - time.monotonic())))
        return None

    async with asyncio.TaskGroup() as tg:  # (one() never raises: the group owns the asks and awaits them)
        asks = {tg.create_task(one(p)) for p in peers}
        try:
            while asks:
                done, asks = await asyncio.wait(asks, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    if t.result() is not None:
                        return t.result()
        finally:
            for t in asks:
                t.cancel()
    return None


async def carry_shard(transport: Transport, own: Group, alt: Group | None, watch_on: Sequence[str], mark: str,
                      phase: int, values: torch.Tensor, weight: float, codec: Codec, *, start: float, silent: float,
                      end: float, fingerprint: Sequence[float] | None) -> tuple[ReduceResult, str]:
    """A carrier's cross step of one shard: with its shard group ``own``; and, in a round of two cells, as
    ``watch_on`` (the other carrier's stand-in) says with ``mark`` (watched from ``start +
    silent``): with the stand-in's group ``alt`` too once the stand-in steps in, or with our cell's mean alone once
    it says its cell's mean lacks the shard. Returns the first result and where from: ``own`` (our group),
    ``standin`` (the stand-in's), ``void`` (our cell's mean alone: the other cell's members keep their progress on
    the shard); raises the carrier's own failure when neither
    gives one by ``end`` (or, once its own step failed, when no marker came within about two ``silent`` of that)."""
    def step(group: Group) -> Awaitable[ReduceResult]:
        return transport.allreduce(group, phase, [values], weight, codec, timeout=max(0.1, end - time.monotonic()),
                                   fingerprint=fingerprint)

    if not watch_on:
        return await step(own), "own"
    async with asyncio.TaskGroup() as tg:  # (every child returns its error: the group only owns and awaits them)
        mine = tg.create_task(_settled(step(own)))
        watch = tg.create_task(_marked(transport, watch_on, mark, start + silent - WATCH_EVERY, end))
        theirs: asyncio.Task[ReduceResult | Exception] | None = None
        # Our own step failed: the marker is waited for only as long as a stand-in takes to notice the silence
        # (our cell's members wait on our "not yet" meanwhile, where they used to be told at once that we have none)
        give_up: float | None = None
        try:
            while True:
                for t, from_sub in ((mine, False), (theirs, True)):
                    if t is not None and t.done() and isinstance(t.result(), ReduceResult):
                        if from_sub and alt is not None:
                            log.info("event=standin_carried key=%s", alt.key)
                        return t.result(), "standin" if from_sub else "own"  # type: ignore[return-value]
                if theirs is None and watch.done() and watch.result() is not None \
                        and watch.result()[:1] == VOID and _same_theta(watch.result(), fingerprint):
                    # The other cell has nothing for this shard (its carrier died before step 1, whose part of it
                    # nobody averaged), and it says so: the shard is our cell's mean alone, offered by us only.
                    log.info("event=standin_void key=%s", own.key)
                    return ReduceResult([values.detach().float().clone()], float(weight), own.members,
                                        (transport.peer_id,), partial=True,
                                        agreed=None if fingerprint is None else tuple(float(v) for v in fingerprint)
                                        ), "void"
                if theirs is None and alt is not None and watch.done() and watch.result() == STEP:
                    log.info("event=standin_joined key=%s", alt.key)
                    theirs = tg.create_task(_settled(step(alt)))
                    continue
                if theirs is None and mine.done():
                    if give_up is None:
                        give_up = max(time.monotonic(), start + silent) + silent + 2 * WATCH_EVERY
                    if watch.done() or time.monotonic() >= give_up:
                        break
                waiting = {t for t in (mine, watch, theirs) if t is not None and not t.done()}
                if not waiting:
                    break
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED,
                                   timeout=None if give_up is None or theirs is not None
                                   else max(0.0, give_up - time.monotonic()))
        finally:
            for t in (mine, watch, theirs):
                if t is not None:
                    t.cancel()
    failed = mine.result()
    assert isinstance(failed, Exception)
    raise failed


async def stand_in(transport: Transport, group: Group, mark: str, phase: int, values: torch.Tensor, weight: float,
                   codec: Codec, *, silent_since: Callable[[], float], silent: float, end: float,
                   fingerprint: Sequence[float] | None, offer: Callable[[ReduceResult], Awaitable[None]],
                   void: bool = False) -> None:
    """A stand-in's side: once its cell mate, the carrier, has been silent for ``silent`` seconds
    (``silent_since()``: when it last answered), offer ``mark`` and run the carrier's cross step in ``group``
    with the cell's ``values``; ``offer`` is given its result (to serve its digest). ``void``: the cell's mean
    lacks (some of) the shard: say so in the marker instead, and carry nothing. Never raises."""
    while time.monotonic() - silent_since() < silent:
        if time.monotonic() >= end - 1.0:
            return  # too late to step in
        await asyncio.sleep(0.25)
    transport.offers.put(mark, void_marker(fingerprint) if void else STEP, ttl=300.0)
    log.info("event=standin key=%s void=%s", group.key, void)
    if void:
        return
    try:
        res = await transport.allreduce(group, phase, [values], weight, codec,
                                        timeout=max(0.1, end - time.monotonic()), fingerprint=fingerprint)
        await offer(res)
    except Exception as e:  # (RoundFailed, a transport's errors: the other carrier fails as it would without us)
        log.info("event=standin_failed key=%s reason=%s: %s", group.key, type(e).__name__, e)
