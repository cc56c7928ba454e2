"""Hierarchical rounds by region and bounded cells: a fragment crosses the slow inter-region link once per region,
and no step of a round involves more than a bounded number of peers.

A flat butterfly over k peers in R regions sends each member's share to every owner in the other regions: with n
peers a region, about n fragments leave each region per round; and it opens k(k−1) streams and waits for the
slowest of k. Here a round's members are put in *cells* (a region's members; a region larger than the maximum group
size G is split into balanced groups of at most G, drawn afresh each round from the round key:
:func:`p2ptrain.algo.grouping.split_groups`), and the round runs in three steps over the same transport (any
:class:`~p2ptrain.net.transport.Transport`):

1. **inside the cell**: the cell's members all-reduce the fragment (their weighted mean M_c, total weight W_c);
2. **across cells**: the fragment is cut into S shards (S = the largest cell's size); shard s of M_c is
   all-reduced, with weight W_c, by one member of each cell, its *carrier* (member ``s mod n_c`` of the cell's
   sorted members), so every member carries 1/n of its cell's cross-cell bytes and a cell sends about one
   fragment out per round;
3. **back inside the cell**: each carrier offers the shard's result, encoded, and the cell's other members fetch
   it. Every carrier of shard s (one per cell) holds the same bytes (the butterfly gives every member the same
   result, and encoding is deterministic), so each member checks what it fetched from its cell's carrier against
   the digest a carrier of another cell offers: a carrier that lies to its cell makes that cell's round fail; it
   cannot poison it.

The result is the same weighted mean as the flat round: Σ_c W_c M_c / Σ_c W_c = Σ_i w_i x_i / Σ_i w_i (in float
arithmetic, to rounding: tests/net/test_hierarchy.py checks it against a float64 reference). So, unlike averaging
in small groups that only mix over rounds, every member ends every round with the same θ: the θ agreement the
methods rely on holds swarm-wide, not per group. A member takes part in a cell of at most G and in the shard groups
of its carried shards (one member per cell): O(G + k/G) peers, not k. Robust aggregations and the norm bound apply
inside each step: within a cell to members' contributions, across cells to the cells' means (a cell's mean is one
contribution there); a trimmed mean of cells is not the trimmed mean of peers.

Failures: a member whose cell step fails fails the round (as in a flat round); a shard whose carrier in this cell
never offers it is fetched from another cell's carrier (cross-cell bytes, but the same values); a shard no carrier
delivers fails the round. In a round of two cells, a shard's carrier that falls silent is stood in for by the next
member of its cell, which holds the same cell mean (net/standin.py): one frozen or dead member no longer fails the
round for everyone. A shard averaged without some cell (its carrier dropped) makes the round partial: every
member still ends with the same bytes for it, and that cell's members are told where their Δ is in no average
(``ReduceResult.missing``), so that their method keeps that progress for the next round instead of merging it
away. A cell whose θ loses a shard's vote across cells repairs onto the winners' θ when a strict majority of the
cells beat it; when the vote is closer (a tie among the cells heard, one cut off), its members fail the round
rather than apply it onto a θ the winners do not hold.

Why it is long: the three steps share one round's state (the cell's mean, the shards' offers, who was outvoted on
which shard), and the rules that keep every member on one θ under faults are read together here; fetching a shard
with its witness is a function of its own (``_shard_bytes``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import struct
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..algo.grouping import split_groups
from ..collective.butterfly import part_bounds
from ..collective.codecs import Codec
from .digest import hexdigest
from .groups import fingerprints_match
from .parts import print_problem, union
from .polling import answer, first_of, poll
from .standin import carry_shard, cells_by_member, partner_standin, stand_in, standin_group, standin_of
from .transport import Group, ReduceResult, RoundFailed, Transport
from .wire import FrameError, decode_message, encode_message

__all__ = ["Plan", "allreduce", "cells_of", "decline_round", "hierarchical_allreduce", "plan_for"]

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<dI")  # a shard offer: the shard's total weight (float64), its number of contributors
OFFER_TTL = 300.0  # seconds a carrier serves its shard (members that were slow still find it)
#: The step budgets, as shares of the round's timeout from its start: the cell's all-reduce ends by LOCAL_SHARE,
#: the shards' across cells by CROSS_SHARE, and the rest is for members to fetch the shards. Each step ends partial
#: without a member that does not answer in its budget, so a frozen or departed carrier costs one step's budget
#: and the round still ends for everyone else (with the whole remaining time for the cross step, a carrier frozen
#: mid-round made the others offer their shards only at the deadline: no member fetched them in time).
LOCAL_SHARE = 0.35
CROSS_SHARE = 0.85
#: Seconds without any answer from a member's cell carrier (not even "not yet"), counted once another cell's carrier
#: has offered the shard, after which the member fetches it from another cell's carrier (net/polling.py: a live
#: carrier answers every poll within 250 ms, and one sending the shard reports every chunk of 4 MiB).
SILENT = 10.0
#: ... in a round whose timeout is short, SILENT_SHARE of it, but at least MIN_SILENT s (a live carrier on a loaded
#: machine answers within ~1 s): with phase timeouts of 10–17 s (5 × the recent phases), members waited 10 s for a
#: frozen carrier out of the 85 % of the round the cross step may take, and a stand-in (net/standin.py) that waits
#: as long would step in too late. Taking a live but slow carrier for silent costs cross-cell bytes, never θ.
SILENT_SHARE = 0.15
MIN_SILENT = 2.0


def silence(timeout: float) -> float:
    """Seconds without an answer after which a round of ``timeout`` s takes a carrier for silent."""
    return min(SILENT, max(MIN_SILENT, SILENT_SHARE * timeout))


@dataclass(frozen=True)
class Plan:
    """One member's view of a hierarchical round: its cell's group, the shards, who carries which.

    A *cell* is a region's members, or, when a region has more than the maximum group size, one of the bounded
    groups it is split into (:func:`p2ptrain.algo.grouping.split_groups`, drawn afresh each round)."""

    region: str
    local: Group  # this member's cell (steps 1 and 3)
    shards: int  # S
    carriers: dict[int, tuple[str, ...]]  # shard -> its carriers, one per cell (sorted: the step-2 group)
    holder: dict[int, str]  # shard -> its carrier in this member's cell
    carried: tuple[int, ...]  # the shards this member carries across
    smallest: int = 1  # the smallest cell's size (the same for every member: what the round's timeout is sized by)
    # member -> its cell's members (a silent carrier's stand-in is one of them: net/standin.py)
    cell_of: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def shard_group(self, group: Group, s: int) -> Group:
        members = self.carriers[s]
        return Group(f"{group.key}#s{s}", members, min(members), group.fragment, group.signature, group.schedule)


def cells_of(group: Group, max_group: int | None = None) -> list[tuple[str, tuple[str, ...]]]:
    """The group's cells as (region, sorted members): one per region, a region larger than ``max_group`` split
    into balanced bounded groups that change with the round key."""
    by_region: dict[str, list[str]] = {}
    for m, r in group.region_of().items():
        by_region.setdefault(r, []).append(m)
    cells: list[tuple[str, tuple[str, ...]]] = []
    for region in sorted(by_region):
        members = sorted(by_region[region])
        if max_group is not None and len(members) > max_group:
            cells += [(region, g) for g in split_groups(members, max_group, f"{group.key}/{region}")]
        else:
            cells.append((region, tuple(members)))
    return cells


def plan_for(group: Group, me: str, max_group: int | None = None) -> Plan | None:
    """The hierarchical plan of ``group`` as ``me`` sees it, or None when a flat round does as well: one cell,
    or no cell with two members (every member then crosses anyway). ``max_group``: the largest cell (None: a
    region is one cell, however large)."""
    if max_group is not None and max_group < 2:
        raise ValueError(f"the maximum group size must be at least 2, got {max_group}")
    cells = cells_of(group, max_group)
    if len(cells) < 2 or max(len(ms) for _, ms in cells) < 2 or me not in group.members:
        return None
    mine = next((r, ms) for r, ms in cells if me in ms)
    shards = max(len(ms) for _, ms in cells)
    carriers = {s: tuple(sorted(ms[s % len(ms)] for _, ms in cells)) for s in range(shards)}
    region, local = mine
    holder = {s: local[s % len(local)] for s in range(shards)}
    # The cell's key names it by a digest of its region (free-form text) and its first member.
    tag = zlib.crc32(f"{region}\0{local[0]}".encode()) & 0xFFFFFFFF
    local_group = Group(f"{group.key}@c{tag:08x}", local, min(local), group.fragment, group.signature,
                        group.schedule)
    return Plan(region, local_group, shards, carriers, holder, tuple(s for s in range(shards) if holder[s] == me),
                min(len(ms) for _, ms in cells), cells_by_member([ms for _, ms in cells]))


def _offer_name(group: Group, phase: int, s: int) -> str:
    return f"hier/{group.key}/{phase}/s{s}"


def _mark_name(group: Group, phase: int, s: int) -> str:
    """The marker a silent carrier's stand-in offers for shard ``s`` (net/standin.py); not under the shard's own
    names, which a carrier whose carry failed declines by prefix."""
    return f"hier/{group.key}/{phase}/in/s{s}"


def _witnesses(plan: Plan, s: int, holder: str) -> list[str]:
    """Who may offer shard ``s``'s digest besides ``holder``: its other carriers, and, for a shard of two carriers,
    the other one's stand-in (which offers it only when it stood in: net/standin.py)."""
    others = [c for c in plan.carriers[s] if c != holder]
    sub = standin_of(plan.carriers[s], plan.cell_of, others[0]) if len(others) == 1 else None
    return others + ([sub] if sub is not None and sub != holder else [])


def decline_round(transport: Transport, key: str, phase: int | None = None) -> None:
    """The round ``key`` (or one phase of it) ended here: the shards, digests and notes of it this peer does not
    offer by now are declined to whoever asks (net/polling.py), so that its cell's members ask another cell's
    carrier at once rather than at 3/4 of their time (a carrier whose own round failed before it began, e.g.
    frozen through its join; or whose carry failed)."""
    transport.offers.end(f"hier/{key}/" if phase is None else f"hier/{key}/{phase}/", ttl=OFFER_TTL)


async def _shard_bytes(transport: Transport, plan: Plan, group: Group, phase: int, s: int, me: str,
                       deadline: float, crossed_by: float = 0.0, heard: list[float] | None = None,
                       silent: float | None = None) -> tuple[bytes, int, str]:
    """Shard ``s``'s offer as this member's region's carrier serves it, checked against a carrier of another
    region (the digest of its offer); from another region's carrier when ours declines it, stays silent for
    ``silent`` s (:data:`SILENT` by default) once a witness answered, or does not deliver by 3/4 of the time left
    (or halfway from ``crossed_by``, when the cross step ends at the latest, to the deadline if that is later).
    Returns (offer, bytes fetched, where from: ``h`` our cell's carrier, checked; ``u`` our cell's carrier, with no
    other cell's digest to check it against; ``o:<id>`` another cell's carrier). RoundFailed if carriers disagree or
    none delivers. ``heard[0]`` (if given) is kept at when our cell's carrier last showed it is alive."""
    name = _offer_name(group, phase, s)
    holder = plan.holder[s]
    silent = SILENT if silent is None else silent
    others = [c for c in plan.carriers[s] if c != holder]
    if holder != me:  # (when we are the carrier, our own carry failed: only other regions have it)
        start = zlib.crc32(me.encode()) % len(others)  # spread the digest requests over the carriers
        witnesses = others[start:] + others[:start] + _witnesses(plan, s, holder)[len(others):]
        t0 = time.monotonic()
        ours = max(t0 + 0.75 * (deadline - t0), crossed_by + 0.5 * (deadline - crossed_by))

        if heard is None:
            heard = [t0]  # when our carrier last showed it is alive (an answer, "not yet" too, or a chunk)

        def alive() -> None:
            heard[0] = time.monotonic()

        async with asyncio.TaskGroup() as tg:  # (answer() never raises: the group only owns and awaits them)
            hold = tg.create_task(answer(transport, holder, name, ours, alive))
            # (delivered: our carrier is not silent however long the digest takes; a stand-in must not step in)
            hold.add_done_callback(lambda t: heard.__setitem__(0, math.inf) if not t.cancelled()
                                   and isinstance(t.result(), bytes) else None)
            check = tg.create_task(answer(transport, witnesses[0], name + "#sha", ours))
            # Our carrier and the witness offer at about the same time (their shard's step ended for both): once
            # one has answered, the other is given three times as long again (at least 5 s: the shard's transfer
            # from a busy carrier), not the whole round's time: a carrier or witness that died is replaced without
            # waiting for the deadline. Replacing a live but slow carrier costs the shard's bytes across cells.
            # Our carrier silent for ``silent`` s by then (no answer at all, not even "not yet": frozen or cut off) is
            # not waited for: churn, members waited ~3/4 of the round for a frozen carrier and then had too little
            # time left to fetch the shard from another cell's carrier, which held it all along.
            await asyncio.wait({hold, check}, return_when=asyncio.FIRST_COMPLETED)
            if not (hold.done() and isinstance(hold.result(), RoundFailed)):  # (ours declined: no digest needed)
                end = time.monotonic() + max(5.0, 3.0 * (time.monotonic() - t0))
                while not hold.done() and (now := time.monotonic()) < end and now - heard[0] < silent:
                    await asyncio.wait({hold}, timeout=min(0.25, end - now))
                if hold.done() and not check.done() and len(witnesses) == len(others):
                    # (with the other carrier's stand-in among the witnesses, a silent carrier's digest is not
                    # waited for alone: first_of below asks the stand-in too)
                    await asyncio.wait({check}, timeout=max(0.0, end - time.monotonic()))
            late = RoundFailed(f"{name}: no answer in time")
            data = hold.result() if hold.done() else late
            digest = check.result() if check.done() else late
            hold.cancel()
            check.cancel()
        if isinstance(data, bytes):
            if not isinstance(digest, bytes):
                # No other region's digest yet: ask every witness until our time for the shard is up, not 2 s more.
                # A witness that is late is no witness that is gone: a cell that applied its carrier's shard
                # unchecked, 8 s before the other regions' carriers (which held other bytes) answered, forked θ
                # (churn_views, f2.L598568460). A dead witness declines or cannot be dialled at once.
                try:
                    _, digest = await first_of(transport, witnesses, name + "#sha", ours, stagger=0.5)
                except RoundFailed as e:
                    digest = e
            if not isinstance(digest, bytes):  # no other region answers: nothing to check against
                log.warning("event=shard_unchecked name=%s holder=%s", name, holder[-8:])
                return data, len(data), "u"
            if hexdigest(data).encode() != digest:
                raise RoundFailed(f"{name}: the region's carrier {holder[-8:]} and another region's disagree on it")
            return data, len(data) + len(digest), "h"
    if holder != me:
        log.info("event=shard_from_other_cell name=%s holder=%s", name, holder[-8:])
    # Our cell's carrier is gone, late or declined: the same bytes from across the cells, the next carrier asked as
    # well while those asked are silent (polling.first_of): a carrier cut off with its cell used to be asked until
    # the deadline before the next one was.
    other, data = await first_of(transport, others, name, deadline)
    return data, len(data), "o:" + other


async def _offer_of(res: ReduceResult, codec: Codec) -> bytes:
    """A shard's offer as a carrier serves it: its total weight and contributors count, then its values encoded."""
    payload = await asyncio.to_thread(codec.encode, res.tensors[0].reshape(-1).float().cpu())
    return _HEADER.pack(res.total_weight, len(res.contributors)) + payload


def _ranges(value: object) -> list[tuple[int, int]]:
    """A note's ``missing`` ranges as (lo, hi) pairs; anything malformed is dropped (a note can only make its
    reader keep more of its own progress, never change an average)."""
    if not isinstance(value, list):
        return []
    return [(int(r[0]), int(r[1])) for r in value[:4096] if isinstance(r, list | tuple) and len(r) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in r) and 0 <= r[0] <= r[1]]


def _within(bounds: tuple[int, int], ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` of a shard (from its start) as ranges of the fragment, clipped to the shard's ``bounds``."""
    lo, hi = bounds
    return [(min(hi, lo + a), min(hi, lo + b)) for a, b in ranges if lo + a < hi]


def _shard_note(offer: bytes) -> str:
    """``contributors:total weight`` of a shard's offer, for the log (``?`` if it is truncated)."""
    if len(offer) < _HEADER.size:
        return "?"
    total, count = _HEADER.unpack_from(offer)
    return f"{count}:{total:.0f}"


async def hierarchical_allreduce(transport: Transport, group: Group, plan: Plan, phase: int,
                                 tensors: Sequence[torch.Tensor], weight: float, codec: Codec, *, timeout: float,
                                 fingerprint: Sequence[float] | None = None) -> ReduceResult:
    """The weighted mean of every member's ``tensors`` in three steps (see the module docstring); the same
    contract as :meth:`Transport.allreduce`. ``timeout`` bounds the whole round."""
    try:
        return await _three_steps(transport, group, plan, phase, tensors, weight, codec, timeout=timeout,
                                  fingerprint=fingerprint)
    finally:
        decline_round(transport, group.key, phase)


async def _three_steps(transport: Transport, group: Group, plan: Plan, phase: int, tensors: Sequence[torch.Tensor],
                       weight: float, codec: Codec, *, timeout: float,
                       fingerprint: Sequence[float] | None) -> ReduceResult:
    t0 = time.monotonic()
    deadline = t0 + timeout
    me = transport.peer_id
    shapes = [t.shape for t in tensors]
    device = tensors[0].device if tensors else torch.device("cpu")
    flat = torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors]) if tensors else torch.zeros(0)
    if len(plan.local.members) == 1:
        # A cell of one: its mean is its member's values (an all-reduce of a group of one encoded, hashed and signed
        # them for nobody: 0.4–0.9 s of CPU for 70 MB on this machine, 4.5 s in a diloco round on the testbed while
        # the other cells' members ran theirs on the same cores). They are encoded when they cross the cells.
        local = ReduceResult(tensors=[flat], total_weight=float(weight), members=plan.local.members,
                             contributors=plan.local.members, partial=False,
                             agreed=None if fingerprint is None else tuple(float(v) for v in fingerprint))
    else:
        local = await transport.allreduce(plan.local, phase, [flat], weight, codec,
                                          timeout=max(0.1, t0 + LOCAL_SHARE * timeout - time.monotonic()),
                                          fingerprint=fingerprint)
    mean = local.tensors[0].reshape(-1).float().cpu()
    bounds = part_bounds(mean.numel(), plan.shards)
    timeline = {"local": time.monotonic() - t0}

    cells = len(plan.carriers[0])  # every shard has one carrier a cell

    def lost(res: ReduceResult) -> bool:
        # Outvoted only by a strict majority of all cells, each voting its cell's θ: at most one θ can win that
        # on any shard, so no cell is outvoted on one shard and the winner on another. Or, of two cells, by the
        # other's in a tie: a shard's step then needs both carriers (a part heard from one of two is left out),
        # and a tie between the same two versions of θ goes the same way on every shard (groups.majority_
        # fingerprint). Ties among more cells: nobody repairs, and the cells that lost fail (tied() below).
        winners = len(res.contributors)
        return res.divergent and (2 * winners > cells or (cells == 2 and winners == 1))

    def tied(res: ReduceResult) -> bool:
        # Our cell's θ lost this shard's vote without a strict majority of the cells against it (a tie among the
        # cells heard, a third cell cut off): nobody repairs, so applying the round here would step our θ while
        # the winners step theirs, two θ from one round. Such a member fails the round instead (its progress rides
        # on the next round, whose vote settles θ; churn benchmark, f3.L598554270).
        return res.divergent and not lost(res)

    # What a carrier votes across cells on behalf of its cell: the cell's θ, the one its members hold once those
    # outvoted at home repair (step 1's majority), not the carrier's own. A carrier outvoted at home used to vote
    # nothing (its own θ is not its cell's): in a cell of several versions of θ most carriers are outvoted, and
    # with no shard voted by two cells, two cells on two θ applied one average onto both (churn_s36_apply,
    # f0.L598576720: 5 replicas on each side).
    cell_print = local.agreed if local.agreed is not None else (None if local.divergent else fingerprint)

    cross_end = t0 + CROSS_SHARE * timeout
    silent = silence(timeout)

    def lacks(s: int) -> bool:
        # whether our cell's mean lacks any of shard s: a part of step 1 nobody averaged is zero (with cells as
        # large as the shards are many, a part of step 1 is a shard); also where only our own share was left out
        return any(lo < bounds[s][1] and bounds[s][0] < hi for lo, hi in local.missing)

    async def carry(s: int) -> tuple[int, ReduceResult, bytes, str]:
        lo, hi = bounds[s]
        # (in a round of two cells, with the other carrier's stand-in too if that one falls silent: net/standin.py)
        partner = partner_standin(plan.carriers[s], plan.cell_of, me)
        res, how = await carry_shard(
            transport, plan.shard_group(group, s),
            None if partner is None else standin_group(plan.carriers[s], plan.cell_of, group, s, partner[0]),
            [partner[1]] if partner is not None else [], _mark_name(group, phase, s), phase,
            mean[lo:hi], local.total_weight, codec, start=time.monotonic(), silent=silent, end=cross_end,
            fingerprint=cell_print)
        offer = await _offer_of(res, codec)
        name = _offer_name(group, phase, s)
        log.info("event=carried name=%s timeline=%s", name,
                 ",".join(f"{k}:{v:.2f}" for k, v in (res.timeline or {}).items()))  # the shard's butterfly, step by step
        # wanted by the cell's other members before the round's deadline: a carrier that leaves serves it first
        digest = transport.offers.put(name, offer, ttl=OFFER_TTL, wanted=len(plan.local.members) - 1,
                                      needed_until=deadline)
        transport.offers.put(name + "#sha", digest.encode(), ttl=OFFER_TTL)
        # The other regions' carriers outvoted this region's θ (this carrier was excluded as divergent): the
        # region's members learn it with the shard, whom to take θ from (not the region's own members), and the
        # fingerprint of the θ that won (what a repair must take).
        # (the winners' print also with a tie: a member outvoted elsewhere may still apply, see below)
        div = {"by": list(res.contributors) if lost(res) else [], "tied": tied(res),
               "print": None if res.agreed is None or not (lost(res) or tied(res)) else list(res.agreed),
               # for the members of other cells that fetch the shard from us: the θ that won its vote, and whose
               "won": None if res.agreed is None else list(res.agreed),
               # (the carrier a stand-in replaced is named too: its cell's mean is in the shard, by its stand-in)
               "winners": list(res.contributors) + ([partner[0]] if how == "standin" and partner is not None
                                                    and partner[1] in res.contributors else []),
               # where in the shard the cell's mean is not in the average (its part left out there): the cell's
               # members keep their progress on those values (OuterLoop.finish ``keep``)
               "missing": [list(r) for r in res.missing]}
        # (wanted as the shard is: a member that fetched the shard from us does not apply without the note)
        transport.offers.put(name + "#div", encode_message(div), ttl=OFFER_TTL, wanted=len(plan.local.members) - 1,
                             needed_until=deadline)
        return s, res, offer, digest

    carried = await asyncio.gather(*(carry(s) for s in plan.carried), return_exceptions=True)
    offers: dict[int, bytes] = {}
    digests: dict[int, str] = {}  # of the shards we carried (their offers' digests, hex)
    crossed: list[ReduceResult] = []
    for s, c in zip(plan.carried, carried, strict=True):
        if isinstance(c, BaseException):  # our carry failed: the others fetch the shard from other regions
            log.info("event=carry_failed name=%s reason=%s: %s", _offer_name(group, phase, s), type(c).__name__, c)
            # Said now, not when our round ends (we may still wait for our own shards until the deadline): the
            # shard, its digest and its note will never be offered here. (The prefix also covers shard s·10+k's
            # names; every carry of ours has ended, so what it declines of them was never offered either.)
            transport.offers.end(_offer_name(group, phase, s), ttl=OFFER_TTL)
            continue
        _, res, offer, digests[s] = c
        offers[s] = offer
        crossed.append(res)
    timeline["across"] = time.monotonic() - t0
    fetched = 0

    outvoted: list[str] = [m for c in carried if not isinstance(c, BaseException) and lost(c[1])
                           for m in c[1].contributors]
    won: list[tuple[float, ...]] = [c[1].agreed for c in carried
                                    if not isinstance(c, BaseException) and lost(c[1]) and c[1].agreed is not None]
    ties: list[tuple[int, tuple[float, ...] | None]] = [(s, c[1].agreed) for s, c in zip(plan.carried, carried,
                                                                                       strict=True)
                                                        if not isinstance(c, BaseException) and tied(c[1])]

    source = dict.fromkeys(offers, "c")  # where each shard came from (carried: c; see _shard_bytes)
    # Where our share is in no average: where the cell's mean left it out, and where a shard's average left out
    # the cell's mean (ReduceResult.missing)
    missing: list[tuple[int, int]] = list(local.missing)
    for s, c in zip(plan.carried, carried, strict=True):
        if not isinstance(c, BaseException):
            missing.extend(_within(bounds[s], c[1].missing))

    async def fetch(s: int) -> None:
        nonlocal fetched
        holder = plan.holder[s]
        name = _offer_name(group, phase, s) + "#div"

        # How our cell's carrier of s came out of the shard's vote: asked for beside the shard (it is offered with
        # it), so that a slow link costs one wait, not two.
        said: bytes | RoundFailed | None = None
        heard = [time.monotonic()]  # when our cell's carrier of s last answered
        # We stand in for it if it falls silent, in a round of two cells (net/standin.py).
        alt = standin_group(plan.carriers[s], plan.cell_of, group, s, holder) \
            if standin_of(plan.carriers[s], plan.cell_of, holder) == me else None
        # Not with a cell mean that lacks any of the shard (a part of step 1 nobody averaged, zero: the carrier that
        # owned it died before step 1, and with cells as large as the shards are many, its part is the shard): its
        # zeros would go in at the cell's whole weight. We say so instead (void), and the other carrier averages
        # the shard from its cell alone; our cell keeps its progress there.
        void = lacks(s)
        async with asyncio.TaskGroup() as tg:  # (no child raises: the group owns and awaits the note's task)
            note = tg.create_task(answer(transport, holder, name, deadline)) if holder != me else None
            helper = None if alt is None else tg.create_task(stand_in(
                transport, alt, _mark_name(group, phase, s), phase, mean[bounds[s][0]:bounds[s][1]],
                local.total_weight, codec, silent_since=lambda: heard[0], silent=silent, end=cross_end,
                fingerprint=cell_print, offer=lambda res: offer_digest(s, res), void=void))
            try:
                got: tuple[bytes, int, str] | RoundFailed = await _shard_bytes(
                    transport, plan, group, phase, s, me, deadline, cross_end, heard, silent)
            except RoundFailed as e:
                got = e
            if helper is not None:
                # The shard came from our cell's carrier after all, or not at all, or from the other cell's carrier
                # before we stepped in: no step of ours in its place is needed. If we stepped in, the other carrier
                # served us the result of our step together (it ended there): ours is given a moment to end too and
                # offer its digest, which that carrier's cell checks its shard against.
                if (not isinstance(got, RoundFailed) and got[2].startswith("o:")
                        and transport.offers.get(_mark_name(group, phase, s)) is not None):
                    await asyncio.wait({helper}, timeout=2.0)
                helper.cancel()
            if note is not None:
                if isinstance(got, RoundFailed) or got[2].startswith("o:"):
                    note.cancel()  # our cell's carrier failed its shard: our cell cast no vote on it
                else:
                    said = await note
        if isinstance(got, RoundFailed):
            raise got
        offers[s], n, source[s] = got
        fetched += n
        if source[s].startswith("o:"):
            await from_other_cell(s, source[s][2:], name)
            source[s] = "o"
            return
        if said is None:
            return
        try:
            if isinstance(said, RoundFailed):
                raise said
            div = decode_message(said, max_size=64 * 1024)
            missing.extend(_within(bounds[s], _ranges(div.get("missing"))))
        except (RoundFailed, FrameError) as e:
            # It served the shard, and the note with it: a member that cannot read the note cannot tell whether
            # its θ lost the vote, and applying a lost round would fork θ.
            raise RoundFailed(f"{name}: our cell's carrier {holder[-8:]} did not say how the shard's vote went "
                              f"({e})") from None
        by, print_ = div.get("by"), div.get("print")
        winner = tuple(float(v) for v in print_) if print_ is not None and not print_problem(print_) else None
        if div.get("tied") is True:
            ties.append((s, winner))
        if isinstance(by, list):
            outvoted.extend(m for m in by if isinstance(m, str) and m in group.members)
        if by and winner is not None:
            won.append(winner)

    async def offer_digest(s: int, res: ReduceResult) -> None:
        # We stood in for our cell's carrier of s: the digest of the shard's offer as a carrier makes it, for the
        # other cell's members to check what their carrier serves against (net/standin.py)
        offer = await _offer_of(res, codec)
        transport.offers.put(_offer_name(group, phase, s) + "#sha", hexdigest(offer).encode(), ttl=OFFER_TTL)

    async def from_other_cell(s: int, other: str, name: str) -> None:
        # Our cell cast no vote on shard s (its carrier failed it): whether our θ is the one that won the shard's
        # vote, only the note of the carrier that served it can say. Applying another θ's round onto ours forks θ:
        # churn benchmark (churn_s33b) f0.L598565000, a member whose cell's carries all failed fetched every shard
        # from other cells and applied them onto a θ two rounds behind theirs.
        try:
            div = decode_message(await poll(transport, other, name, deadline), max_size=64 * 1024)  # name: "…#div"
            if plan.holder[s] not in (div.get("winners") or []):  # our cell's mean never reached the shard
                missing.append(bounds[s])
            winner = div.get("won")
            won_print = tuple(float(v) for v in winner) if winner is not None and not print_problem(winner) else None
        except (RoundFailed, FrameError, TypeError, ValueError) as e:
            raise RoundFailed(f"{name}: {other[-8:]} served it but did not say which θ won its vote ({e})") from None
        ours = local.agreed if local.agreed is not None else (tuple(fingerprint) if fingerprint is not None else None)
        if won_print is None or ours is None or fingerprints_match(ours, won_print):
            return
        by = [m for m in div.get("winners") or [] if isinstance(m, str) and m in group.members]
        if 2 * len(by) <= cells:
            # The θ that "won" the shard is no strict majority of the cells (its vote was partial, or a tie): it
            # may be the minority's, so it alone is no reason to repair onto it (churn_s33c, f2.L598565460: two
            # members repaired onto a shard voted by one carrier alone and forked). Held as a tie: the round fails
            # below unless our cell lost the other shards' votes to this very θ. Then the swarm's θ is that one
            # and repairing onto it is what our cell does anyway (churn_seed12c, f1.L598769290: two cells, our
            # carrier of this shard frozen after its vote, which our cell lost in a tie of two like every other
            # shard's; our members failed the round while the winners applied it, and θ forked).
            ties.append((s, won_print))
            return
        outvoted.extend(by)  # our cell's θ lost: repair onto the winners' θ before applying (as an outvoted cell)
        won.append(won_print)

    async def check_own(s: int) -> None:
        # Our own carried shard, against another cell's carrier of it (as our cell's members check what they fetch
        # from us): a carrier that applied its own bytes while the others hold other bytes was a fork its members
        # could not see (churn_arena2 f2.L598557860). No other carrier answering: unchecked, as for members.
        name = _offer_name(group, phase, s) + "#sha"
        now = time.monotonic()  # (waited for as our members wait for a witness: a late one is not a gone one)
        try:
            other, digest = await first_of(transport, _witnesses(plan, s, me), name,
                                           now + 0.75 * max(0.0, deadline - now), stagger=1.0)
        except RoundFailed:
            log.warning("event=shard_unchecked name=%s holder=%s", name[:-4], me[-8:])
            return
        if digest != digests[s].encode():
            raise RoundFailed(f"{name[:-4]}: our carry and {other[-8:]}'s disagree on it")

    try:
        # (owned: once one shard fails the round, the others' fetches, and any stand-in's step, are cancelled, not
        # left polling until the deadline)
        async with asyncio.TaskGroup() as tg:
            for s in range(plan.shards):
                tg.create_task(check_own(s) if s in offers else fetch(s))
    except BaseExceptionGroup as eg:
        raise eg.exceptions[0] from None
    timeline["gathered"] = time.monotonic() - t0
    # What each shard was and where from, for comparing members' logs after a round: its source, the crc32 of its
    # offer's first 4 KiB (two averages differ from the first values on), its contributors count and its total
    # weight (which cells' tokens it holds: a round's tokens are the largest of these).
    # (and when each step ended, seconds from the round's start: in the cell, across cells, the shards fetched)
    log.info("event=shards key=%s phase=%d local=%d/%d weight=%.0f shards=%s seconds=%s", group.key, phase,
             len(local.contributors), len(plan.local.members), local.total_weight, ",".join(
                 f"s{s}:{source.get(s, '-')}:{zlib.crc32(offers[s][:4096]):08x}:{_shard_note(offers[s])}"
                 for s in sorted(offers)), "/".join(f"{timeline[k]:.2f}" for k in ("local", "across", "gathered")))
    # The θ a repair takes (the most common winner of the shards our cell lost outright), if any.
    target = min(set(won), key=lambda p: (-won.count(p), p)) if outvoted and won else None
    if any(won_tie is None or won_tie != target for _, won_tie in ties):
        # (our own shards are offered already: the other cells still fetch them)
        raise RoundFailed(f"round {group.key}: our cell's θ lost the vote on shard(s) {sorted(s for s, _ in ties)} "
                          f"without a majority of the {cells} cells against it (applying would fork θ)")
    out = torch.empty_like(mean)
    totals: set[float] = set()
    partial = local.partial or any(isinstance(c, BaseException) for c in carried)
    for s, (lo, hi) in enumerate(bounds):
        offer = offers[s]
        if len(offer) < _HEADER.size:
            raise RoundFailed(f"{_offer_name(group, phase, s)}: a truncated offer")
        total, count = _HEADER.unpack_from(offer)
        out[lo:hi] = await asyncio.to_thread(codec.decode, offer[_HEADER.size:], hi - lo)
        totals.add(total)
        partial |= count < cells
    pieces, offset = [], 0
    for shape in shapes:
        n = int(torch.Size(shape).numel())
        pieces.append(out[offset:offset + n].view(shape).to(device))
        offset += n
    served = sum(len(o) * (len(plan.local.members) - 1) for s, o in offers.items() if s in plan.carried)
    crossers = sorted({m for r in crossed for m in r.contributors})
    # Repair tries contributors in order: an outvoted cell's members from the cells that beat it; a member outvoted
    # in its cell from its cell's majority (not a crossed carrier of another cell, whose θ may be another one).
    # Our cell's carriers are named by the cell's step alone: one outvoted at home carries a mean without its Δ,
    # and named (a crossed result names its carriers) it took the round as holding its Δ and dropped its
    # progress and tokens (churn_seed7b, round f2.L598728300: Σ of the appliers' own was 714,240 tokens against
    # the round's 505,344, four carriers outvoted at home).
    # Where our cell's θ lost across cells (outvoted), its mean is in no shard's average: none of its members contributed.
    # Named contributors, they took the round as holding their Δ (rnd.counted): each repaired onto the winners'
    # θ and applied the average, its progress and tokens dropped as if in θ (churn_own_tokens: Σ of the tokens
    # members said were theirs in a round's average was up to 2.4× the round's total weight, in 24 of 53
    # rounds). Not named, each keeps its progress on the winners' θ and its tokens go into its next round
    # (driver: outvoted).
    home = set(plan.local.members)
    named = sorted(set(outvoted)) if outvoted else sorted(local.contributors)
    contributors = tuple(dict.fromkeys([*named, *(m for m in crossers if m not in home)]))
    return ReduceResult(pieces, max(totals) if totals else local.total_weight, group.members, contributors,
                        partial=partial or len(totals) > 1,
                        bytes_sent=local.bytes_sent + sum(r.bytes_sent for r in crossed) + served,
                        bytes_received=local.bytes_received + sum(r.bytes_received for r in crossed) + fetched,
                        seconds=time.monotonic() - t0,
                        divergent=local.divergent or bool(outvoted),
                        agreed=target if outvoted else local.agreed,
                        verify_bytes=local.verify_bytes + sum(r.verify_bytes for r in crossed),
                        liars=tuple(sorted(set(local.liars) | {m for r in crossed for m in r.liars})),
                        timeline={**timeline, "assembled": time.monotonic() - t0},
                        missing=union(missing))


async def allreduce(transport: Transport, group: Group, plan: Plan | None, phase: int, tensors: Sequence[torch.Tensor],
                    weight: float, codec: Codec, *, timeout: float,
                    fingerprint: Sequence[float] | None = None) -> ReduceResult:
    """A round's all-reduce: the flat butterfly when ``plan`` is None (see :func:`plan_for`), else cell by cell."""
    if plan is None:
        return await transport.allreduce(group, phase, tensors, weight, codec, timeout=timeout, fingerprint=fingerprint)
    return await hierarchical_allreduce(transport, group, plan, phase, tensors, weight, codec, timeout=timeout,
                                        fingerprint=fingerprint)
