"""Mailboxes of the all-reduce: what arrives for each (round, phase), filed by the stream handlers.

A member's mailbox of one (round, phase) holds the contributions other members sent to the part it
owns (``part`` messages) and the averaged parts their owners sent back (``result`` messages, or
relayed on request: ``getpart``). Messages may arrive before this member's own all-reduce of that
phase starts; they wait here. Every message is checked before it is filed: sizes against the codec
and the announced limits before anything is decoded, the weight, and a streamed payload against its
header; a message that does not fit is refused with a strike against its sender.

With verified aggregation (net/verify.py) a contribution must carry its contributor's signature over its
commitment (checked before it is filed); the owner keeps it, payload and signature, as *evidence* to show
any member that asks (``evidence``), until the mailbox is collected. Members' ``check`` messages and the
commitments they announce of their own shares (``own`` in their ``part`` messages) are filed here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..collective.butterfly import MIN_CHUNK
from ..collective.codecs import get_codec
from .chunks import Progress, Refused, Slot, receive_chunks
from .claims import INLINE_SLICE, Entry, Evidence, commitment, parse_checks
from .guard import Guard
from .identity import verify_signature
from .parts import wire_result
from .pieces import GridShas, contribution_shas, raw_shas
from .tally import ChunkTally

__all__ = ["Contribution", "Mailbox", "Mailboxes"]

#: Most contributions one slice request may name (a group's members but the asker; groups are bounded well below).
MAX_SLICES = 256

#: A member's contribution to a part: (part index, values, weight, its fingerprint of θ or None).
Contribution = tuple[int, torch.Tensor, float, list[float] | None]


@dataclass
class Inflow:
    """A streamed contribution while it arrives: its header's part, weight, size and fingerprint, and how
    much of it is decoded (``progress``). It becomes a :data:`Contribution` once whole (and, with verified
    aggregation, signed)."""

    part: int
    weight: float
    numel: int
    fp: list[float] | None
    progress: Progress


@dataclass
class Mailbox:
    """Frames that arrived for one (round, phase): contributions to our part, and results of parts."""

    contribs: dict[str, Contribution] = field(default_factory=dict)
    inflows: dict[str, Inflow] = field(default_factory=dict)  # streamed contributions, from their header on
    unreachable: set[str] = field(default_factory=set)  # members our sends could not reach
    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    evidence: dict[str, Evidence] = field(default_factory=dict)  # signed contributions to our part, kept
    own_commits: dict[str, bytes] = field(default_factory=dict)  # member -> hash of its own share's commitment
    checks: dict[str, dict[int, Entry]] = field(default_factory=dict)  # member -> its claims, by part
    # member -> (part, digest, the owner's signature on it) of each result it proved wrong
    verdicts: dict[str, list[tuple[int, bytes, bytes | None]]] = field(default_factory=dict)
    judged: dict[str, set[int]] = field(default_factory=dict)  # member -> the parts its verdict says it judged
    # (our part's index, the group's members in order), set by our verified all-reduce: the evidence goes once each
    # other member said it has judged our part and none proved it wrong (None: kept until ``evidence_until``), and
    # the results once each said it judged every part but its own (it holds them all: no relay is asked of us)
    own_part: tuple[int, tuple[str, ...]] | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    created: float = field(default_factory=time.monotonic)
    finished: float | None = None  # when our all-reduce of this (round, phase) returned or failed
    evidence_until: float | None = None  # when the evidence is dropped (None: with the mailbox)
    # (part, sender, result header, numel) -> a tally that the result's chunks are told to as they are decoded
    # (net/tally.py), set by our verified all-reduce of this phase once it runs; None: no tallies
    make_tally: Callable[[int, str, dict[str, Any], int], ChunkTally | None] | None = None
    # (part, sender, numel) -> where a streamed result decodes to (its range of our run's output), set by our
    # all-reduce of this phase once it runs; None: a buffer of its own
    result_slot: Callable[[int, str, int], Slot | None] | None = None

    def poke(self) -> None:
        self.changed.set()

    def judged_by_all(self) -> bool:
        """Whether every other member said it has judged our part and none proved it wrong: nobody asks for our
        evidence any more (a member with a late result of it judges it after its verdict, which then does not
        name our part)."""
        if self.own_part is None:
            return False
        j, members = self.own_part
        return all(j in self.judged.get(m, ()) for i, m in enumerate(members) if i != j) and \
            not any(p == j for said in self.verdicts.values() for p, _, _ in said)

    def everyone_holds_all(self) -> bool:
        """Whether every other member said it has judged every part but its own: each holds every part, and none
        will ask us to relay one."""
        if self.own_part is None:
            return False
        me, members = self.own_part
        return all(set(range(len(members))) - {i} <= self.judged.get(m, set()) for i, m in enumerate(members)
                   if i != me)

    def release_results(self) -> None:
        """After our run, once every member holds every part: the results' wire chunks go (a fragment's size, less
        a part, kept for a minute for relays that nobody will ask for: a 1B model's fragment is ~1 GB of fp32)."""
        if self.finished is not None and self.results and self.everyone_holds_all():
            self.results.clear()

    async def wait_until(self, ready: Callable[[], bool], deadline: float) -> bool:
        """Wait until ``ready()`` holds (checked after every arrival) or ``deadline`` (monotonic) passes;
        whether it holds."""
        while True:
            self.changed.clear()
            if ready():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):  # (not wait_for: no task of its own for every wake-up)
                    await self.changed.wait()

    async def wait(self, deadline: float) -> None:
        """Wait until something arrives or ``deadline`` (monotonic) passes, whichever comes first."""
        self.changed.clear()
        left = deadline - time.monotonic()
        if left > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self.changed.wait()

    def close(self, evidence_until: float | None = None) -> None:
        """Our all-reduce of this phase ended: the contributions are spent. The parts' results stay, so that
        a member that missed one can still fetch it from us (a relay), until the mailbox is collected; the
        evidence stays until ``evidence_until`` (monotonic: the end of the other members' judging)."""
        self.finished = time.monotonic()
        self.contribs.clear()
        self.inflows.clear()
        self.evidence_until = evidence_until
        # The decoded values of the results are in the run's output now: a relay sends a result's wire form, so the
        # results keep only that (a round of a whole model kept its decoded parts, the model's size again in fp32,
        # for the minute the mailbox lives). The verified run's tallies go with it.
        for res in self.results.values():
            res.pop("_tensor", None)
        self.make_tally = None
        self.result_slot = None
        self.release_results()


class Mailboxes:
    """Every (round, phase)'s mailbox at one peer, the handlers that fill them, and their collection.

    ``max_numel`` bounds the values a message may announce (checked before anything is allocated).
    The handlers answer ``{"ok": True}``, ``{"error": ...}`` or, for ``getpart``, ``{"result": ...}``; a
    message that does not fit its schema raises one of wire.SCHEMA_ERRORS (the stream layer strikes).
    """

    def __init__(self, guard: Guard, max_numel: int, *, run_id: str = "", verify: bool = False) -> None:
        self.guard, self.max_numel, self.run_id, self.verify = guard, max_numel, run_id, verify
        self.boxes: dict[tuple[str, int], Mailbox] = {}

    def box(self, key: str, phase: int) -> Mailbox:
        return self.boxes.setdefault((key, phase), Mailbox())

    def collect(self, max_age: float = 600.0, after_finish: float = 60.0) -> None:
        """Forget a mailbox ``after_finish`` seconds after our all-reduce of it ended (until then our
        averaged part can still be fetched by a member that missed it), any other after ``max_age`` (a
        round that never ran here, late frames)."""
        now = time.monotonic()
        for k in [k for k, m in self.boxes.items()
                  if now - m.created > max_age or (m.finished is not None and now - m.finished > after_finish)]:
            del self.boxes[k]
        for m in self.boxes.values():  # signed contributions are big: kept only while members may ask for them
            if m.evidence_until is not None and now > m.evidence_until and m.evidence:
                m.evidence.clear()

    def unreachable(self, key: str, phase: int) -> set[str]:
        """Members our sends of this (round, phase) could not reach."""
        box = self.boxes.get((key, phase))
        return set(box.unreachable) if box else set()

    async def accept_part(self, sender: str, msg: dict[str, Any]) -> dict[str, Any]:
        """File ``sender``'s contribution to a part we own, decoded (chunk by chunk if streamed)."""
        codec = get_codec(str(msg["codec"]))
        numel = int(msg["numel"])
        if numel < 0 or numel > self.max_numel:
            return {"error": "bad size"}
        streamed = "chunks" in msg
        data = None if streamed else msg["data"]
        if not streamed and (not isinstance(data, bytes) or len(data) != codec.encoded_size(numel)):
            self.guard.strike(sender, f"part payload of {len(data) if isinstance(data, bytes) else '?'} bytes "
                                      f"for {numel} values")
            return {"error": "payload size does not match"}
        if (reason := self.guard.bad_weight(msg["weight"])) is not None:
            self.guard.strike(sender, reason)
            return {"error": reason}
        fp = msg.get("fp")
        fp = None if fp is None else [float(v) for v in fp]
        key, phase, part = str(msg["key"]), int(msg["phase"]), int(msg["part"])
        box = self.box(key, phase)
        progress, grid = None, None
        if streamed:
            held = box.inflows.get(sender)
            if sender in box.contribs or (held is not None and not held.progress.failed):
                # One contribution per member and phase: an owner may be averaging the first one already.
                return {"error": "a contribution of this member to this phase is already here"}
            progress = Progress(numel, box.poke)
            box.inflows[sender] = Inflow(part, float(msg["weight"]), numel, fp, progress)
            box.poke()
            chunk = msg.get("chunk")
            # what its signature names, hashed as each chunk is decoded
            if self.verify and isinstance(chunk, int) and not isinstance(chunk, bool) and chunk >= MIN_CHUNK:
                grid = GridShas(codec, numel, chunk)
            # The payloads are kept only as a lossy codec's evidence: a plain owner uses the values alone, and a
            # lossless (fp32) payload is the values' bytes, shown from the values themselves (Evidence.raw).
            keep = self.verify and codec.name != "fp32"
            try:
                x, pieces = await receive_chunks(msg, codec, numel, progress, keep=keep,
                                                 on_chunk=None if grid is None else lambda i, data, _: grid.add(i, data))
            except Refused as e:
                self.guard.strike(sender, f"streamed part: {e}")
                return {"error": "streamed part does not match its header"}
        else:
            assert isinstance(data, bytes)
            pieces = [data]
            try:
                x = await asyncio.to_thread(codec.decode, data, numel)
            except ValueError as e:
                self.guard.strike(sender, f"undecodable part ({e})")
                return {"error": "undecodable part"}
        if self.verify:
            signed = (await msg["_trailer"]()) if streamed and "_trailer" in msg else msg
            sig, pk, own = signed.get("sig"), signed.get("pk", b""), signed.get("own", msg.get("own"))
            chunk = msg.get("chunk") if streamed else None
            shas = None if grid is None else grid.shas()
            raw = x if streamed and codec.name == "fp32" else None  # (its payloads were not kept)
            if shas is None:
                shas = await asyncio.to_thread(contribution_shas, pieces, numel, codec, chunk) if raw is None else \
                    await asyncio.to_thread(raw_shas, raw, chunk)  # (fp32's pieces are a raw share's)
            ev = Evidence(tuple(pieces), float(msg["weight"]), numel, codec.name, chunk,
                          sig if isinstance(sig, bytes) else b"", pk if isinstance(pk, bytes) else b"", shas=shas,
                          raw=raw)
            c = commitment(self.run_id, key, phase, part, ev.weight, numel, codec.name, chunk, ev.sha)  # (its tree:
            # hashed once, here, for the check and for every slice of it an auditor asks for)
            if not (isinstance(sig, bytes) and isinstance(pk, bytes) and verify_signature(sender, c, sig, pk)):
                self.guard.strike(sender, "part without a valid signature of its sender")
                if progress is not None:  # an owner that averaged it as it came must not use it
                    progress.failed = True
                    box.poke()
                return {"error": "part without a valid signature"}
            box.evidence[sender] = ev
            if isinstance(own, bytes) and len(own) == 32:
                box.own_commits.setdefault(sender, own)
        box.contribs[sender] = (part, x, float(msg["weight"]), fp)
        box.poke()
        return {"ok": True}

    async def accept_result(self, sender: str, msg: dict[str, Any]) -> dict[str, Any]:
        """File a part's averaged result as its owner sent it (the first one for a part stays). A streamed
        one is decoded as it arrives; its metadata is checked when the all-reduce assembles it."""
        box = self.box(str(msg["key"]), int(msg["phase"]))
        part = int(msg["part"])
        res = {k: v for k, v in msg.items() if not (isinstance(k, str) and k.startswith("_"))}
        if "chunks" in msg:
            numel = msg["numel"]
            if not isinstance(numel, int) or not 0 <= numel <= self.max_numel:
                return {"error": "bad size"}
            make, slot_of = box.make_tally, box.result_slot
            tally = make(part, sender, res, numel) if make is not None and part not in box.results else None
            slot = slot_of(part, sender, numel) if slot_of is not None and part not in box.results else None
            try:
                x, pieces = await receive_chunks(msg, get_codec(str(msg["codec"])), numel,
                                                 on_chunk=None if tally is None else tally.feed, into=slot)
            except Refused as e:
                self.guard.strike(sender, f"streamed result: {e}")
                return {"error": "streamed result does not match its header"}
            res |= {"_tensor": x, "_pieces": pieces}
            if "_trailer" in msg:  # the owner's signature over the result, once all of it is known
                osig = (await msg["_trailer"]()).get("osig")
                if isinstance(osig, bytes):
                    res["osig"] = osig
        filed = box.results.setdefault(part, {**res, "_from": sender})
        if box.finished is not None:  # after our run: only its wire form is served (close() kept no decoded result)
            filed.pop("_tensor", None)
        box.poke()
        return {"ok": True}

    async def relay(self, sender: str, msg: dict[str, Any]) -> dict[str, Any]:
        """A part's result we hold, for a member that missed it (as one message). Without it, whether we
        still expect it (``expects``: our all-reduce of that phase has not ended and the part's ``owner``,
        when named, is not unreachable for us): the asker then tries again rather than giving the part up."""
        box = self.boxes.get((str(msg["key"]), int(msg["phase"])))
        res = None if box is None else box.results.get(int(msg["part"]))
        if res is not None:
            return {"result": wire_result(res)}
        owner = msg.get("owner")
        expects = box is not None and box.finished is None and owner not in box.unreachable
        return {"error": "no such part here", "expects": expects}

    async def accept_check(self, sender: str, msg: dict[str, Any]) -> dict[str, Any]:
        """File a member's claims about its contributions (net/verify.py); the first one of a sender stays."""
        box = self.box(str(msg["key"]), int(msg["phase"]))
        members = int(msg["members"])
        if not 0 < members <= 1 << 16:
            raise ValueError(f"a group of {members} members")
        entries = parse_checks(msg, members, max_entries=members)
        box.checks.setdefault(sender, entries)
        box.poke()
        return {"ok": True}

    async def accept_verdict(self, sender: str, msg: dict[str, Any]) -> dict[str, Any]:
        """File the parts a member proved wrong (its first word on a round stays)."""
        parts = msg["replaced"]
        if not isinstance(parts, list) or len(parts) > 1 << 16 or not all(
                isinstance(p, list) and len(p) == 3 and isinstance(p[0], int) and isinstance(p[1], bytes)
                and (p[2] is None or isinstance(p[2], bytes)) for p in parts):
            raise ValueError("replaced must be a list of [part, digest, the owner's signature or None]")
        judged = msg.get("judged", [])  # (absent from a peer of before: its word never lets our evidence go)
        if not isinstance(judged, list) or len(judged) > 1 << 16 or not all(
                isinstance(j, int) and not isinstance(j, bool) for j in judged):
            raise ValueError("judged must be a list of part indices")
        box = self.box(str(msg["key"]), int(msg["phase"]))
        if sender not in box.verdicts:
            box.verdicts[sender] = [(int(j), bytes(d), o) for j, d, o in parts]
            box.judged[sender] = set(judged)
        if box.evidence and box.judged_by_all():
            # Judged by every other member, proved wrong by none: at a 1B model's fragment the evidence is the
            # part's every contribution (GBs), which the round's deadline held while rounds went on.
            box.evidence.clear()
        box.release_results()
        box.poke()
        return {"ok": True}

    async def show_evidence(self, sender: str, msg: dict[str, Any]) -> dict[str, Any]:
        """A member's signed contribution to our part, for a member that checks our result: all of it, or the
        chunks that cover values ``lo:hi`` of it (a random audit's slice)."""
        box = self.boxes.get((str(msg["key"]), int(msg["phase"])))
        lo, hi = msg.get("lo"), msg.get("hi")
        whos = msg.get("whos")
        if whos is not None:  # a slice of several contributions at once (claims.fetch_slices): None for one not here
            if not (isinstance(whos, list) and 0 < len(whos) <= MAX_SLICES and isinstance(lo, int)
                    and isinstance(hi, int)):
                raise TypeError("whos must be a short list, lo and hi integers")
            evs = [None if box is None else box.evidence.get(str(w)) for w in whos]

            def show() -> list[dict[str, Any] | None]:
                return [None if ev is None else ev.slice_wire(lo, hi) for ev in evs]

            if all(ev is None or ev.hashed for ev in evs) and 0 <= hi - lo <= INLINE_SLICE:
                return {"evidence": show()}  # a few pieces' bytes and paths: less than a worker thread's round trip
            return {"evidence": await asyncio.to_thread(show)}
        ev = None if box is None else box.evidence.get(str(msg["who"]))
        if ev is None:
            return {"error": "no such contribution here"}
        if lo is None and hi is None:
            return {"evidence": ev.to_wire()}
        if not (isinstance(lo, int) and isinstance(hi, int)):
            raise TypeError("lo and hi must be integers")
        return {"evidence": await asyncio.to_thread(ev.slice_wire, lo, hi)}
