"""One member's butterfly all-reduce of one (round, phase) over the stream protocols: :class:`ButterflyRun`.

1. reduce-scatter: the member sends part j of its flat vector to part j's owner (streamed in chunks
   when large, net/chunks.py), and files its own share of its own part;
2. it collects the contributions to its own part (until every member's came, or the members still
   missing are unreachable or left, or half the timeout passed) and aggregates those that fit, through
   the guard (net/guard.py, net/parts.py);
3. all-gather: it sends its averaged part, encoded once, to every other member;
   (2+3 pipelined, for the plain mean of a streamed part: the contributors are fixed from the parts'
   headers and each chunk of the average is sent as soon as its values are in, net/pipelined.py; a
   contribution that breaks off or is late sends it back to 2 and 3 with whole parts;)
4. it waits for the other parts' results (until 0.8 of the timeout), then asks the other members for
   any still missing (a relay, ``getpart``, until the timeout);
5. with verified aggregation (an ``audit``, net/audit.py; the steps before then end at 0.6 and 0.7 of the
   timeout): it sends every member its claims about its contributions, waits for theirs (until 0.8), and
   judges every part it did not own, settling disputes with the owners' evidence; then it tells every member
   which parts it proved wrong, waits for their word (until 0.9) and settles those parts itself (until the
   timeout), so that what one member's audit found, every member acts on;
6. it assembles what it got (net/parts.py): a part nobody could average is zero and the result partial.

A run owns every task it starts, in one TaskGroup: when the run ends, fails or its caller cancels it,
they are all cancelled and awaited before it returns; but for its *deliveries*, given to the transport's task
group when there is one (``deliver``): the sends of our part's result, our claims and our verdict, which the other
members need after we have all we need (each bounded by the run's deadlines). Waiting for their replies kept a
member 10–25 ms past the moment it held every part (2 peers, 1 MB: the last result it sent was still being
filed at the other end, whose own result had arrived). A send that fails is logged and counted, never
raised: only a run with nothing averaged at all fails (RoundFailed).

Why it is long: the steps are one object's methods because they share its state (the parts' bounds, the
mailbox, the deadlines as fractions of one timeout, and the TaskGroup that owns every send); the pure work
of each step lives elsewhere (net/parts.py, net/pipelined.py, net/chunks.py, net/audit.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Sequence
from contextlib import aclosing
from typing import Any, Protocol, TypeVar

import torch

from ..collective.butterfly import chunk_bounds, part_bounds
from ..collective.codecs import Codec
from ..faults import FaultPlan, corrupt_payload, lie_about
from .audit import Audit
from .bandwidth import LinkMeter
from .chunks import EncodedStream, Slot, chunked_size, decode_chunked, encode_ahead
from .claims import Entry
from .guard import Guard
from .mailbox import Mailbox
from .parts import Assembly, flatten, group_tag, result_problem, select_contributions
from .pieces import GridShas
from .pipelined import PipelinedMean, Source, whole
from .streams import ChunkSource, Trailer
from .transport import Group, ReduceResult, RoundFailed
from .wire import encode_message

__all__ = ["ButterflyRun", "Call", "Deliver"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# Fractions of the run's timeout: contributions are gathered until the first, results until the second,
# relays of missing results until the third; with verification, claims until the fourth and disputes until
# the whole.
GATHER = 0.5
PLAIN = (0.8, 1.0, 1.0)  # RESULTS, RELAYS, CLAIMS
VERIFIED = (0.6, 0.7, 0.8)
VERDICTS = 0.9  # with verification, members' verdicts are waited for until then


class Call(Protocol):
    """One request/response with a peer (streams.Streams.call): (reply, seconds) or RoundFailed."""

    def __call__(self, peer: str, kind: str, msg: dict[str, Any], *, timeout: float,
                 chunks: ChunkSource | None = None,
                 trailer: Trailer | None = None,
                 sent: Callable[[], None] | None = None) -> Awaitable[tuple[dict[str, Any], float]]: ...


#: Starts a send that may outlive the run in a longer-lived task group; None when it cannot (then the run owns it).
Deliver = Callable[[Coroutine[Any, Any, Any]], "asyncio.Task[Any] | None"]


def _handed(tasks: Sequence[asyncio.Task[Any]], size: int) -> int:
    """Payload bytes of sends (each returning its bytes, or an exception): those done that went through, and
    ``size`` for each still on its way (a delivery: it goes on after the run)."""
    total = 0
    for t in tasks:
        if not t.done():
            total += size
        elif not t.cancelled() and isinstance(t.result(), int):
            total += t.result()
    return total


def _went(task: asyncio.Task[Any]) -> bool:
    """Whether a finished send (returning its reply, or the exception it raised) went through."""
    return not task.cancelled() and not isinstance(task.result(), Exception)


async def _settled(aw: Awaitable[T]) -> T | Exception:
    """``aw``'s result, or the exception it raised (a failed send must not tear down its siblings)."""
    try:
        return await aw
    except Exception as e:
        return e


class ButterflyRun:
    """One member's all-reduce of ``tensors`` in ``group``'s phase ``phase`` (create one per call, then
    :meth:`run` it once).

    ``me`` is this member's peer id; ``box`` the mailbox of this (round, phase); ``call`` talks to a
    member; ``gone()`` names the members not worth waiting for (unreachable, or announced their
    departure); ``chunk`` the values per streamed chunk; ``faults`` what this peer breaks on purpose (tests);
    ``audit``: verified aggregation (net/audit.py), or None; ``deliver``: starts the run's deliveries in a task
    group that outlives it (see the module docstring; None: the run owns them and waits for their replies).
    """

    def __init__(self, *, group: Group, phase: int, me: str, tensors: Sequence[torch.Tensor], weight: float,
                 codec: Codec, timeout: float, fingerprint: Sequence[float] | None, box: Mailbox, call: Call,
                 gone: Callable[[], set[str]], guard: Guard, links: LinkMeter, chunk: int, faults: FaultPlan,
                 audit: Audit | None = None, pipeline: bool = True, deliver: Deliver | None = None) -> None:
        self.t0 = time.monotonic()
        self.group, self.phase, self.me_id = group, phase, me
        self.members = list(group.members)
        self.me = self.members.index(me)
        self.tensors, self.weight, self.codec, self.timeout = tensors, float(weight), codec, timeout
        self.fp = None if fingerprint is None else [float(v) for v in fingerprint]
        self.box, self.call, self.gone, self.guard, self.links = box, call, gone, guard, links
        self.chunk, self.faults, self.pipeline, self.deliver = chunk, faults, pipeline, deliver
        self.flat = flatten(tensors)
        self.bounds = part_bounds(self.flat.numel(), len(self.members))
        self.own: dict[str, Any] | None = None  # our averaged part's result message, once aggregated
        self.stream: EncodedStream | None = None  # our averaged part, streamed to every member
        self.lie: dict[str, Any] | None = None  # fault injection: the wrong result a lying owner sends
        self.lie_stream: EncodedStream | None = None  # fault injection: that lie, streamed in chunks
        self.forged: torch.Tensor | None = None  # fault injection: the own share a lying owner claims
        self.audit = audit
        self.results_at, self.relays_at, self.claims_at = VERIFIED if audit is not None else PLAIN
        self.own_commit: bytes | None = None
        self.own_signed: asyncio.Task[bytes] | None = None  # the making of own_commit (verified aggregation)
        self.part_sends: dict[int, asyncio.Task[int | Exception]] = {}  # our share of part j on its way to j
        self.part_left: dict[int, asyncio.Future[None]] = {}  # done once our share of part j has left this host
        self.doubtful: set[int] = set()  # parts missing here that another member may still use (_fetch_missing)
        self.timeline: dict[str, float] = {}
        self.deliveries: list[asyncio.Task[Any]] = []  # sends handed to ``deliver``'s task group
        self.early_claim: asyncio.Task[int | Exception] | None = None  # two members: our own part's claim, sent early
        self.early_entries: list[Entry] = []  # that claim (made once: _verify adds the others to it)
        self.early_made: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # done once early_entries
        # are made (or will not be): a future, not a task of its own

    def _mark(self, step: str) -> None:
        self.timeline[step] = round(time.monotonic() - self.t0, 4)

    def _until(self, fraction: float) -> float:
        return self.t0 + self.timeout * fraction

    def _left(self, fraction: float) -> float:
        return self._until(fraction) - time.monotonic()

    def _delivery(self, tg: asyncio.TaskGroup, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """``coro`` (a send that never raises) as a delivery: a task of the transport's group if it takes it, else
        of the run's ``tg``."""
        task = self.deliver(coro) if self.deliver is not None else None
        if task is None:
            return tg.create_task(coro)
        self.deliveries.append(task)
        return task

    def _others(self) -> list[int]:
        return [j for j in range(len(self.members)) if j != self.me]

    async def run(self) -> ReduceResult:
        """The phase's outcome at this member (see the module docstring). RoundFailed if no part could be
        averaged; cancelling it cancels and awaits every task it started, its deliveries too (a run that returns
        or fails leaves them to end on their own)."""
        try:
            return await self._run()
        except asyncio.CancelledError:
            for t in self.deliveries:
                t.cancel()
            if self.deliveries:
                await asyncio.wait(self.deliveries)
            raise

    async def _run(self) -> ReduceResult:
        lo, hi = self.bounds[self.me]
        own = self.flat[lo:hi].clone()
        self.box.contribs[self.me_id] = (self.me, own, self.weight, self.fp)
        if self.audit is not None:
            # verification's sums of each result, made as its chunks arrive (net/tally.py)
            self.audit.register(self.flat, own, self.chunk, honest=self.faults.corrupt is None)
        # The buffer the parts are assembled in: the results streamed from their owners, and our own part's average,
        # are decoded straight into their ranges of it as they come (its pages are first written there, in the
        # decoding worker threads), so that no result has a buffer of its own to copy at the end.
        self.out = torch.empty(self.flat.numel(), dtype=torch.float32)
        self.slots: dict[int, Slot] = {}
        self.box.result_slot = self._slot
        try:
            sent = await self._exchange()
        except BaseExceptionGroup as eg:
            # Only this run's own steps can fail (its tasks return their errors): raise that error as it is.
            if len(eg.exceptions) == 1:
                raise eg.exceptions[0] from None
            raise
        if self.audit is not None and self.audit.unsettled:
            # A part whose owner fell silent when our audit or missing claims needed its evidence: not proven wrong,
            # so the members that drew no audit of it use it. Leaving it out here would apply another θ than
            # theirs; applying nothing leaves us a round behind, which the next round's vote repairs.
            j, why = min(self.audit.unsettled.items())
            raise RoundFailed(f"round {self.group.key} phase {self.phase}: part {j} could not be verified ({why})")
        return await self._assemble(sent)

    def _slot(self, part: int, sender: str, numel: int) -> Slot | None:
        """Where the result of ``part`` streamed by ``sender`` decodes to: its range of our output, for the first
        stream of it from its owner (a relay or a second stream gets a buffer of its own); None once we assemble."""
        if not 0 <= part < len(self.members) or part == self.me or part in self.slots or self.box.result_slot is None:
            return None
        a, b = self.bounds[part]
        if sender != self.members[part] or numel != b - a:
            return None
        slot = self.slots[part] = Slot(self.out[a:b])
        return slot

    async def _exchange(self) -> int:
        """Steps 1 to 4 in a TaskGroup that owns every task they start; the payload bytes sent."""
        sent = 0
        async with asyncio.TaskGroup() as tg:
            if self.audit is not None:
                # Our own share's commitment, made while our parts leave: it goes in their trailers (or with a part
                # sent whole), not in their headers, which waited for it (2 peers, 1 MB: 2.5 ms before any byte left).
                lo, hi = self.bounds[self.me]
                self.own_signed = tg.create_task(asyncio.to_thread(self.audit.sign_own, self.flat[lo:hi], self.chunk))
            self.part_sends = {j: tg.create_task(_settled(self._send_part(j))) for j in self._others()}
            sends = list(self.part_sends.values())
            results_out = await self._pipelined(tg) if self._pipelinable() else None
            if sends:
                await asyncio.wait(sends, timeout=max(0.0, self._left(GATHER)))
                self.faults.in_allreduce()  # tests only: a peer dying mid all-reduce
            self._mark("sent")
            if results_out is None:  # the whole-part path
                await self._gather()
                self._mark("gathered")
                await self._aggregate(tg)
                self._mark("aggregated")
                results_out = [self._delivery(tg, _settled(self._send_result(j))) for j in self._others() if self.own]
            if self.audit is not None and len(self.members) == 2 and self.own is not None:
                self.early_claim = self._delivery(tg, _settled(self._claim_own_part()))
                self._hold_evidence()
            for done in [await t for t in sends]:
                if isinstance(done, int):
                    sent += done
                else:
                    log.info("event=part_send_failed key=%s reason=%s", self.group.key, done)
            await self._await_results()
            self._mark("results")
            await self._fetch_missing()
            self._mark("relays")
            if self.audit is not None:
                await self._verify(tg)  # its bytes are counted apart (ReduceResult.verify_bytes)
                self._mark("verified")
            if self.deliver is None and results_out:
                await asyncio.wait(results_out)
            if self.own is not None:
                lo, hi = self.bounds[self.me]
                sent += _handed(results_out, chunked_size(self.codec, hi - lo, self.own.get("chunk")))
            self._mark("results_out")
        return sent

    # 1. reduce-scatter
    async def _send_part(self, j: int) -> int:
        """Send our share of part j to its owner; the payload bytes. RoundFailed marks the owner unreachable
        (nobody averages its part this round, and it is not waited for)."""
        try:
            return await self._send_part_to(j)
        except RoundFailed:
            self.box.unreachable.add(self.members[j])
            self.box.poke()
            raise

    async def _send_part_to(self, j: int) -> int:
        lo, hi = self.bounds[j]
        mine = self.flat[lo:hi]
        codec, corrupt = self.codec, self.faults.corrupt
        msg = {"key": self.group.key, "phase": self.phase, "part": j, "weight": self.weight, "fp": self.fp,
               "codec": codec.name, "numel": hi - lo}
        audit = self.audit
        call_timeout = max(0.1, self._left(GATHER))
        left = self.part_left.setdefault(j, asyncio.get_running_loop().create_future())

        def sent() -> None:
            if not left.done():
                left.set_result(None)

        if corrupt is None and hi - lo > self.chunk:  # streamed: encoding, transfer, decoding overlap
            cb = chunk_bounds(hi - lo, self.chunk)
            msg |= {"chunk": self.chunk, "chunks": len(cb)}
            size = chunked_size(codec, hi - lo, self.chunk)
            # The payloads are kept only where verification needs them: a lossy codec's, which our claims sketch and
            # our audits read as the owner decoded them (fp32's are our values' bytes: ``mine`` serves both).
            pieces: list[bytes] = []
            keep = audit is not None and codec.name != "fp32"
            went = [0]  # bytes of the chunks that left, each counted once it has (a retried call starts again)
            grid = None
            if audit is not None:
                audit.sending(j, pieces)
                grid = GridShas(codec, hi - lo, self.chunk)  # what we sign, hashed as each chunk is encoded

            async def source() -> AsyncGenerator[bytes, None]:
                pieces.clear()  # a retried call encodes again
                went[0] = 0
                if grid is not None:
                    grid.reset()
                async with aclosing(encode_ahead(codec, mine, cb, None if grid is None else grid.add)) as chunks:
                    n = 0
                    async for data in chunks:
                        n += 1
                        if keep:
                            pieces.append(data)
                        yield data
                        went[0] += len(data)
                        self.faults.in_stream(n)  # tests only: a peer dying mid-stream
                if audit is not None:
                    await self._own_commit()  # (for the trailer: made long before, as the chunks left)

            trailer = None
            if audit is not None:
                msg["trailer"] = True

                def trailer() -> dict[str, Any]:
                    return {**audit.sign(j, pieces, hi - lo, self.chunk, values=mine if codec.name == "fp32" else None,
                                         shas=None if grid is None else grid.shas()), "own": self.own_commit}

            t0 = time.monotonic()
            try:
                reply, seconds = await self.call(self.members[j], "part", msg, timeout=call_timeout,
                                                 chunks=source, trailer=trailer, sent=sent)
            except RoundFailed:
                # Cut off (a slow link times out before a whole part is through): what did go through is a
                # measure of the link too, so that the next round's timeout can follow it (sync.py).
                self.links.update(self.members[j], went[0], time.monotonic() - t0)
                raise
        else:
            if corrupt is None:
                data = await asyncio.to_thread(codec.encode, mine)
            else:  # fault injection: what a broken or hostile peer would put on the wire
                data, mine = corrupt_payload(codec, mine, corrupt)
            msg |= {"numel": mine.numel(), "data": data}
            if audit is not None:
                msg["own"] = await self._own_commit()
                audit.sending(j, [data])
                lossless = corrupt is None and codec.name == "fp32"
                msg |= audit.sign(j, [data], mine.numel(), None, values=mine if lossless else None)
            size = len(data)
            reply, seconds = await self.call(self.members[j], "part", msg, timeout=call_timeout, sent=sent)
        if "error" in reply:
            raise RoundFailed(f"part {j}: {reply['error']}")
        self.links.update(self.members[j], size, seconds)
        return size

    async def _own_commit(self) -> bytes:
        """The hash of our own share's signed commitment (verified aggregation), announced with our share of every
        other part, before our result leaves: an owner shows the auditors of its part the share it announced
        (net/verify.py)."""
        assert self.own_signed is not None
        self.own_commit = await asyncio.shield(self.own_signed)
        return self.own_commit

    # 2. the contributions to our own part
    async def _gather(self) -> None:
        deadline = self._until(GATHER)
        while (missing := set(self.members) - set(self.box.contribs)) and time.monotonic() < deadline:
            if missing <= self.gone():
                break  # every missing member is unreachable or has left: do not wait for them
            await self.box.wait(min(deadline, time.monotonic() + 0.5))

    async def _aggregate(self, tg: asyncio.TaskGroup) -> None:
        """Aggregate the contributions to our part that fit, into :attr:`own` (None if none was accepted);
        a large part starts being encoded for every member at once (a task of ``tg``)."""
        if self._left(self.results_at) <= 0:
            # Too late to publish (a peer frozen mid-round wakes with every deadline passed): a member whose relay
            # deadline has passed left our part out, and one whose deadlines are later would average it in. Kept
            # from everyone, the part is left out everywhere alike.
            log.info("event=part_withheld key=%s phase=%d reason=averaged after the results deadline",
                     self.group.key, self.phase)
            return
        lo, hi = self.bounds[self.me]
        sel = select_contributions(self.box.contribs, self.members, self.me, hi - lo)
        for p, n in sel.dropped.items():
            log.info("event=part_dropped key=%s peer=%s reason=%d values, expected %d", self.group.key, p, n, hi - lo)
        if not sel.use:
            return
        try:
            avg, total, use, tau = self.guard.aggregate(sel.use, me=self.me_id)
        except ValueError:
            return
        own = {"key": self.group.key, "phase": self.phase, "part": self.me, "contributors": use, "total": total,
               "agree": sorted(sel.agree), "group": group_tag(self.members), "heard": sorted(sel.heard),
               "numel": hi - lo, "codec": self.codec.name}
        if sel.agreed is not None:
            own["print"] = list(sel.agreed)
        if tau > 0:
            own["tau"] = tau  # CenteredClip's radius: members check the result with it
        self.own = own
        faults = self.faults
        if faults.lie is not None and faults.lie != "nan" and not faults.forge and hi - lo > self.chunk:
            # fault injection: a lie streamed in chunks, as an honest large part goes (signed like the truth)
            ls = self.lie_stream = EncodedStream(self.codec, lie_about(avg, faults.lie), self.chunk)
            self.lie = {**own, "chunk": self.chunk, "chunks": len(ls.bounds)}
            tg.create_task(_settled(ls.produce()))
        elif faults.lie is not None:  # fault injection: the average a lying owner sends back
            data, _ = corrupt_payload(self.codec, avg, "nan") if faults.lie == "nan" else \
                (await asyncio.to_thread(self.codec.encode, lie_about(avg, faults.lie)), None)
            self.lie = {**own, "data": data}
            if self.audit is not None:  # signed like the truth: a liar does not give itself away
                self.lie["osig"] = self.audit.sign_result(self.lie, [data])
            if faults.forge and faults.lie != "nan":  # the share that makes the lie add up
                told = await asyncio.to_thread(self.codec.decode, data, hi - lo)
                self.forged = self.flat[lo:hi] + (total / self.weight) * (told - avg)
        if hi - lo > self.chunk and (self.lie is None or self.lie_stream is not None):  # streamed to every member
            stream = self.stream = EncodedStream(self.codec, avg, self.chunk, decoded=self.out[lo:hi])
            own |= {"chunk": self.chunk, "chunks": len(stream.bounds)}
            if self.audit is not None:
                stream.on_chunk = self.audit.own_stream(own, hi - lo, stream.payloads)

            async def produce() -> None:
                await stream.produce()
                # Every member, this one included, uses the decoded payload: lossy codecs agree everywhere.
                mine = {**own, "_tensor": stream.decoded, "_pieces": stream.payloads}
                if self.audit is not None:
                    mine["osig"] = self.audit.sign_result(own, stream.payloads)
                self.box.results[self.me] = mine
                self.box.poke()

            tg.create_task(_settled(produce()))
        else:
            own["data"] = await asyncio.to_thread(self.codec.encode, avg)
            if self.audit is not None:
                own["osig"] = self.audit.sign_result(own, [own["data"]])
            # (A forging liar holds its lie, so that its claims are made under the lie's seed.)
            self.box.results[self.me] = own if self.forged is None else dict(self.lie or own)

    # 2+3. pipelined: the plain mean chunk by chunk as the contributions arrive, sent back at once
    def _pipelinable(self) -> bool:
        lo, hi = self.bounds[self.me]
        cfg = self.guard.cfg
        return (self.pipeline and cfg.aggregation == "mean" and cfg.norm_bound is None and self.faults.lie is None
                and not self.faults.forge and hi - lo > self.chunk and len(self.members) > 1)

    async def _pipelined(self, tg: asyncio.TaskGroup) -> list[asyncio.Task[int | Exception]] | None:
        """Average our part chunk by chunk as the contributions stream in (net/pipelined.py), sending each
        chunk of the average to every member as soon as it is computed; the tasks of those sends, or None
        when it cannot be done so (no other contributor, or one broke off or was late: then nothing of
        this average was filed anywhere, and the caller takes the whole-part path)."""
        lo, hi = self.bounds[self.me]
        box = self.box

        def heard() -> bool:  # every member's header (or whole contribution) is in, or it is not coming
            missing = set(self.members) - set(box.contribs) - set(box.inflows)
            return not missing or missing <= self.gone()

        await box.wait_until(heard, self._until(GATHER))
        self._mark("headers")
        heads: dict[str, Any] = {p: (f.part, f.progress.values, f.weight, f.fp) for p, f in box.inflows.items()
                                 if not f.progress.failed}
        heads |= box.contribs
        sel = select_contributions(heads, self.members, self.me, hi - lo)
        use = [p for p in sel.use if p == self.me_id or not self.guard.is_banned(p)]
        if len(use) < 2:
            return None
        sources = [Source(p, whole(box.contribs[p][1]) if p in box.contribs else box.inflows[p].progress,
                          sel.use[p][1]) for p in use]
        stream = PipelinedMean(self.codec, hi - lo, self.chunk, sources, box, box.contribs, self._until(GATHER),
                               decoded=self.out[lo:hi])
        own = {"key": self.group.key, "phase": self.phase, "part": self.me, "contributors": sorted(use),
               "total": float(sum(s.weight for s in stream.sources)), "agree": sorted(sel.agree),
               "group": group_tag(self.members),
               "heard": sorted(sel.heard), "numel": hi - lo,
               "codec": self.codec.name, "chunk": self.chunk, "chunks": len(stream.bounds)}
        if sel.agreed is not None:
            own["print"] = list(sel.agreed)
        self.own, self.stream = own, stream
        if self.audit is not None:
            stream.on_chunk = self.audit.own_stream(own, hi - lo, stream.payloads)
        producer = tg.create_task(_settled(stream.produce()))
        outs = [self._delivery(tg, _settled(self._send_result(j))) for j in self._others()]
        if (failed := await producer) is None:
            mine = {**own, "_tensor": stream.decoded, "_pieces": stream.payloads}
            if self.audit is not None:
                mine["osig"] = self.audit.sign_result(own, stream.payloads)
            box.results[self.me] = mine
            box.poke()
            self._mark("aggregated")
            return outs
        log.info("event=pipeline_fallback key=%s phase=%d reason=%s", self.group.key, self.phase, failed)
        for t in outs:  # their streams end unfinished: no member files an incomplete average
            t.cancel()
        await asyncio.gather(*outs, return_exceptions=True)
        self.own, self.stream = None, None
        return None

    # 3. all-gather
    async def _send_result(self, j: int) -> int:
        """Send our averaged part to member j; the payload bytes if it took them, else 0."""
        assert self.own is not None
        if self.audit is not None:
            await self._own_commit()  # (our evidence is shown once our result is out: made by then)
        lo, hi = self.bounds[self.me]
        size = chunked_size(self.codec, hi - lo, self.own.get("chunk"))
        msg = self.own
        if self.lie is not None and not (self.faults.lie_to_some and j % 2 == 0):
            msg = self.lie
        trailer = None
        stream, audit = self.stream, self.audit
        if msg is self.lie and self.lie_stream is not None:
            stream = self.lie_stream
        if stream is not None and audit is not None:  # signed once every chunk is known
            signed = msg
            msg = {**msg, "trailer": True}

            def trailer() -> dict[str, Any]:
                return {"osig": audit.sign_result(signed, stream.payloads)}

        chunks, held = (None, [0.0]) if stream is None else self._after_part(j, stream.chunks)
        try:
            reply, seconds = await self.call(self.members[j], "result", msg,
                                             timeout=max(0.1, self._left(self.results_at)),
                                             chunks=chunks, trailer=trailer)
        except RoundFailed:  # not worth waiting for (its result, its claims)
            # ... unless it was our own stream that stopped (a pipelined mean falling back to whole parts when a
            # contribution broke off): that says nothing of the member, whose result we still wait for (marked
            # unreachable, a survivor of a member's death gave up on the other survivor's part: the suite, loaded)
            if stream is None or stream.failed is None:
                self.box.unreachable.add(self.members[j])
                self.box.poke()
            raise
        self.links.update(self.members[j], size, max(1e-6, seconds - held[0]))
        return size if reply.get("ok") else 0

    def _after_part(self, j: int, chunks: ChunkSource) -> tuple[ChunkSource, list[float]]:
        """The chunks of our average for member ``j``, held until our own share of ``j``'s part has left (or
        failed; at most until the gather deadline): on our uplink to ``j`` the contribution ``j`` waits for
        goes first. Sent side by side, the two split the link, and ``j`` averages (and sends its own result)
        only once our share is in: 2 peers, 4 MB, the part arrived after 0.37 s instead of 0.17 s and the round
        took 0.45–0.55 s for an ideal 0.32. Also the seconds held (left out of the link's measure).

        "Left" is the first of: its last byte sent from this host (the direct path's send queue empty: what is still
        in flight is ahead of our result in the link's queue), or ``j``'s reply. The reply alone came late: it
        travels behind ``j``'s own contribution to us, and CUBIC keeps the link's queue full (2 peers, 4 MB: each
        direction idled 27 ms median between its two phases)."""
        part, held = self.part_sends.get(j), [0.0]

        async def source() -> AsyncGenerator[bytes, None]:
            if part is not None and not part.done():
                t0 = time.monotonic()
                left = self.part_left.get(j)
                await asyncio.wait([part] if left is None else [part, left], timeout=max(0.0, self._left(GATHER)),
                                   return_when=asyncio.FIRST_COMPLETED)
                held[0] = time.monotonic() - t0
            async with aclosing(chunks()) as inner:
                async for data in inner:
                    yield data

        return source, held

    # 4. the other parts' results, relayed by any member if their owner's never came
    async def _await_results(self) -> None:
        deadline = self._until(self.results_at)
        while len(self.box.results) < len(self.members) and time.monotonic() < deadline:
            owners = {self.members[j] for j in range(len(self.members)) if j not in self.box.results}
            if owners <= self.gone():
                break  # the owners still missing are unreachable or left; ask the others below
            await self.box.wait(min(deadline, time.monotonic() + 0.5))

    async def _fetch_missing(self) -> None:
        """Ask for the parts whose results never came: their owner first (our send to it may have failed
        while its result to us still goes through), then the other members. A member without the result
        says whether it still expects it; while any does, ask again (until the relay deadline), so that a
        member whose own send failed ends with the result every other member ends with."""
        pause = 0.1
        while missing := [j for j in range(len(self.members)) if j not in self.box.results]:
            answers = await asyncio.gather(*(self._ask_for(j) for j in missing))
            # A part another member may still end with: left out here, it would be in that member's average
            # and zero in ours (two θ from one round). Its owner's own view is not asked for: an owner that
            # none of us hears from holds a minority of the parts unless it heard from us.
            for j, (_, doubt) in zip(missing, answers, strict=True):
                if doubt is not None:  # (None: not asked, the relay deadline had passed: the last word stands)
                    self.doubtful = self.doubtful - {j} | ({j} if doubt else set())
            if not any(expected for expected, _ in answers) or self._left(self.relays_at) <= 0:
                return
            await self.box.wait(min(self._until(self.relays_at), time.monotonic() + pause))
            pause = min(1.0, pause * 2)

    async def _ask_for(self, j: int) -> tuple[bool, bool | None]:
        """One pass over the members for part ``j``'s result (filed if one has it): (whether another member
        still expects it; whether another member may end with it: the owner did not say it has none, and another
        member expects it, or one that has not left or fallen unreachable did not answer; None when the relay
        deadline passed before anyone was asked). An owner that answers without the result has not averaged its
        part: nobody holds it (one that averages it later still forks θ: not ruled out here).

        An owner our send to failed (unreachable) is not asked when other members can be: one cut off or frozen
        answers nothing until the relay deadline, and asked first it kept every member that missed its part waiting
        to that deadline for the other members' word (churn: members of a round with a member cut off mid-round
        ended it at its deadline, with the same partial result they could have had at half of it). Its result, if
        it still sends one, is filed as it arrives; the others are asked again while any of them expects it. An
        owner we banned or that left is still asked first: it answers (a leaving peer serves its results), and members
        that have not banned it yet use its part (left out here, it would fork θ: tests/net/test_bad_updates.py)."""
        owner = self.members[j]
        others = [m for m in self.members if m not in (owner, self.me_id)]
        expected = doubt = owner_has_none = False
        asked = 0
        for other in others if others and owner in self.box.unreachable else [owner, *others]:
            if j in self.box.results:
                return False, False
            is_owner = other == owner
            if self._left(self.relays_at) <= 0:
                return expected, None if asked == 0 else doubt and not owner_has_none
            asked += 1
            try:
                reply, _ = await self.call(other, "getpart",
                                           {"key": self.group.key, "phase": self.phase, "part": j, "owner": owner},
                                           timeout=max(0.1, self._left(self.relays_at)))
            except RoundFailed:
                doubt |= not is_owner and other not in self.gone()
                continue
            if isinstance(reply.get("result"), dict):
                relayed = {k: v for k, v in reply["result"].items() if not (isinstance(k, str) and k.startswith("_"))}
                self.box.results.setdefault(j, {**relayed, "_from": other})  # relayed (or pulled from its owner)
                self.box.poke()
                return False, False
            expects = reply.get("expects") is True
            expected |= expects
            if is_owner:
                owner_has_none = True
            else:
                doubt |= expects
        return expected, doubt and not owner_has_none

    # 5. verified aggregation
    def _own_share(self) -> torch.Tensor:
        """Our share of our own part, as our claims state it (a forging liar's, tests: the share its lie adds up to)."""
        lo, hi = self.bounds[self.me]
        return self.forged if self.forged is not None else self.flat[lo:hi]

    async def _claim_own_part(self) -> int:
        """Two members: our claim about our own part, sent to the other as soon as our result is filed; the bytes
        sent (0 if it was not). The other judges only our part, and of its claims only ours about it counts: the
        one an owner can make once it holds its result (a claim is sketched under the result's digest). Sent
        after the gather, it waited for the other's result to reach us (2 peers, 1 MB: 0–14 ms of a 0.11 s round;
        a hierarchical shard's two carriers: the later carrier's result, seconds across regions). An owner that
        claims early knows less than one that claims after the gather, never more."""
        audit = self.audit
        assert audit is not None
        try:
            if not await self.box.wait_until(lambda: self.me in self.box.results, self._until(self.results_at)):
                return 0
            await self._own_commit()  # (our claim names it)
            entries = self.early_entries = await asyncio.to_thread(audit.entries, self._own_share(), [self.me])
        finally:
            if not self.early_made.done():  # (made, or not to be made: _verify makes the others' claims)
                self.early_made.set_result(None)
        if not entries:
            return 0
        msg = audit.message(entries, frame=self.faults.frame)
        await self.call(self.members[1 - self.me], "check", msg, timeout=max(0.1, self._left(self.claims_at)))
        return len(encode_message(msg))

    def _hold_evidence(self) -> None:
        """Two members: our part's evidence is served until the other says it has judged our part (its verdict,
        sent once it has), at most until the verdicts' deadline, or until it is gone: a delivery, which a graceful
        close waits for and the run does not. Our claim goes early (:meth:`_claim_own_part`), so the other may judge
        our part after our run returned: a close at once left its audits of our part unanswered and failed its
        round (tests/net/test_deliveries.py). Without a transport's task group to hand it to, nothing is held."""
        if self.deliver is None:
            return
        other = self.members[1 - self.me]

        async def hold() -> None:
            await self.box.wait_until(lambda: other in self.box.verdicts or other in self.gone(),
                                      self._until(VERDICTS))

        coro = hold()
        task = self.deliver(coro)
        if task is None:  # the transport is closing: nothing to hold for
            coro.close()
        else:
            self.deliveries.append(task)

    async def _verify(self, tg: asyncio.TaskGroup) -> None:
        """Send our claims to every member (two members: sent early, see :meth:`_claim_own_part`), wait for theirs,
        judge the parts we did not own."""
        audit = self.audit
        assert audit is not None
        audit.prefetch(tg, self._until(VERDICTS))  # our audits' slices, fetched while the claims are exchanged
        await self._own_commit()  # (our claims name it)
        if self.early_claim is not None:  # (its claim is made in a worker thread, as ours below; its reply is not
            # waited for here: 1-3 ms of a 0.1 s round, 2 peers 1 MB; nor a claim that never began: a cancelled task)
            await asyncio.wait([self.early_made, self.early_claim], timeout=max(0.0, self._left(self.claims_at)),
                               return_when=asyncio.FIRST_COMPLETED)
        made = {e.part for e in self.early_entries}  # (our own part's, made early: not sketched twice)
        entries = [*self.early_entries, *await asyncio.to_thread(
            audit.entries, self._own_share(), [j for j in range(len(self.members)) if j not in made])]
        msg = audit.message(entries, frame=self.faults.frame)
        size = len(encode_message(msg))

        def send_claims() -> list[asyncio.Task[Any]]:
            return [self._delivery(tg, _settled(self.call(self.members[j], "check", msg,
                                                          timeout=max(0.1, self._left(self.claims_at)))))
                    for j in self._others()]

        sends = [] if self.early_claim is not None else send_claims()
        audit.box.checks[self.me_id] = {e.part: e for e in entries}
        self._mark("claims_sent")
        deadline = self._until(self.claims_at)
        while (missing := set(self.members) - set(self.box.checks)) and time.monotonic() < deadline:
            if missing <= self.gone():
                break
            await self.box.wait(min(deadline, time.monotonic() + 0.5))
        self._mark("claims_in")
        await audit.judge_all(self._until(VERDICTS))
        self._mark("judged")
        # Verdicts: what one member proved wrong (an audit drew it), every member checks for itself. A member acts
        # on verdicts about the parts it did not own: of two members, each judges only the other's part, so a
        # verdict could only be about its receiver's own part (reconcile skips those) and is not waited for (2 peers,
        # 1 MB: the wait was 8–12 ms of a 0.11 s round); it is sent once we are done judging, as the word that the
        # other may stop holding its evidence (_hold_evidence).
        told: list[asyncio.Task[Any]] = []
        vsize = 0
        if len(self.members) > 2:
            verdict = audit.verdict_message()
            vsize = len(encode_message(verdict))
            told = [self._delivery(tg, _settled(self.call(self.members[j], "verdict", verdict,
                                                          timeout=max(0.1, self._left(VERDICTS)))))
                    for j in self._others()]
            deadline = self._until(VERDICTS)
            while (missing := set(self.members) - set(self.box.verdicts) - {self.me_id}) and \
                    time.monotonic() < deadline:
                if missing <= self.gone():
                    break
                await self.box.wait(min(deadline, time.monotonic() + 0.5))
            self._mark("verdicts_in")
            await audit.reconcile(self._until(1.0))
        if audit.unjudged():
            # A result that came while we judged (a late stream under load): judged now, as the others were. Used
            # unjudged, an owner's lie reached our θ while the other members replaced it (the lying-owner test,
            # once in a full suite beside a benchmark).
            await audit.judge_all(self._until(VERDICTS))
        if self.early_claim is not None:  # two members: we have judged its part, it may stop holding its evidence
            sent = await self.early_claim
            early = sent if isinstance(sent, int) else 0
            audit.stats.bytes_sent += early
            if not early:  # our early claim did not go: the whole message now (the other waits for it)
                sends = send_claims()
            verdict = audit.verdict_message()
            vsize = len(encode_message(verdict))
            told = [self._delivery(tg, _settled(self.call(self.members[1 - self.me], "verdict", verdict,
                                                          timeout=max(0.1, self._left(VERDICTS)))))]
        if self.deliver is None and (sends or told):
            await asyncio.wait([*sends, *told])
        # (a reply is a dict: a send that went through counts its message's size; one on its way counts it too)
        audit.stats.bytes_sent += sum(size for t in sends if not t.done() or _went(t))
        audit.stats.bytes_sent += sum(vsize for t in told if not t.done() or _went(t))

    # 6. assembly
    async def _assemble(self, sent: int) -> ReduceResult:
        self.box.result_slot = None
        for slot in self.slots.values():  # no stream still on its way writes into the output after this
            slot.close()
        out = Assembly(self.flat.numel(), self.members, self.me, check_agree=self.fp is not None, fingerprint=self.fp,
                       out=self.out)
        for j, (a, b) in enumerate(self.bounds):
            res = self.box.results.get(j)
            if res is not None and self.audit is not None and j != self.me and j not in self.audit.judged:
                res = None  # came after our last judging (while the run ended): never used unchecked
            if res is None:
                if j in self.doubtful:
                    raise RoundFailed(f"round {self.group.key} phase {self.phase}: part {j}'s result did not reach "
                                      f"us, and another member may use it (left out here, it would fork θ)")
                out.skip()
                continue
            problem = result_problem(res, j, b - a, self.codec, self.members, self.me_id)
            if problem is not None:
                reason, strike = problem
                if strike and self.members[j] != self.me_id:
                    self.guard.strike(self.members[j], reason)
                out.skip()
                continue
            part = res.get("_tensor")  # streamed: decoded chunk by chunk as it arrived
            if part is None:
                try:
                    part = await asyncio.to_thread(decode_chunked, self.codec, res["data"], b - a, res.get("chunk"))
                except ValueError as e:  # e.g. non-finite values: the codecs refuse them
                    self.guard.strike(res.get("_from", self.members[j]), f"averaged part {j} does not decode ({e})")
                    out.skip()
                    continue
            if (reason := self.guard.bad_values(part)) is not None:
                self.guard.strike(self.members[j], f"averaged part {j}: {reason}")
                out.skip()
                continue
            out.add(j, a, b, part, res)
        result = out.result(self.group, self.phase, self.tensors, sent=sent, seconds=time.monotonic() - self.t0)
        self._mark("assembled")
        result.timeline = dict(self.timeline)
        if self.audit is not None:
            st = self.audit.stats
            result.verify_bytes, result.verify_seconds = st.bytes_sent + st.bytes_received, st.seconds
            result.liars, result.verify_tallied, result.verify_audits = tuple(st.liars), st.tallied, st.audits
        return result
