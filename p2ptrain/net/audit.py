"""A member's side of verified aggregation in one butterfly run (the checks themselves: net/verify.py).

:class:`Audit` signs this member's contributions as they leave, keeps what it needs to make its claims
about them, makes its check message once the results are in, and judges every part it did not own: it
fills in claims that are missing with evidence from the part's owner, runs the checks, settles disputes,
and says per part whether to use the result, replace it with its own recomputation or leave it out.

Why it is long: signing, claiming, judging and reconciling share one round's state (what we sent, the results we
hold and their digests, the verdicts); the checks themselves are in net/verify.py, the sums made as the results
arrive in net/tally.py, the wire forms in net/claims.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..collective.codec_base import all_finite
from ..collective.codecs import Codec
from .chunks import decode_chunked
from .claims import (
    Entry,
    Evidence,
    Fetched,
    chunk_keys,
    entry_for,
    fetch_evidence,
    fetch_slice,
    fetch_slices,
    result_bounds,
    result_commitment,
    result_digest,
    result_header,
    result_shas,
    sign_contribution,
    sketch_bytes,
)
from .guard import Guard
from .identity import Identity, verify_signature
from .mailbox import MAX_SLICES, Mailbox
from .parts import result_problem
from .pieces import RAW, audit_grain, payload_sha, piece_bounds, raw_shas, root
from .tally import ChunkTally, Tallies
from .verify import Judge, Verdict

__all__ = ["Audit", "AuditStats"]

log = logging.getLogger(__name__)

@dataclass
class AuditStats:
    """What verification cost this member in one phase: bytes of checks sent and evidence received, seconds
    from the results being in to every part judged, parts replaced or left out, liars found."""

    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    replaced: int = 0
    skipped: int = 0
    audits: int = 0
    tallied: int = 0  # parts judged with the sums made as their chunks arrived (net/tally.py)
    liars: list[str] = field(default_factory=list)


@dataclass
class _Sent:
    pieces: list[bytes]
    commit: bytes
    chunk: int | None
    values: torch.Tensor | None = None  # what the pieces decode to, if known without decoding


class Audit:
    """Verified aggregation for one member's run of one (round, phase).

    ``call(peer, kind, msg, timeout=...)`` talks to a member. ``audit_rate``: how many slices of each part
    (pieces.audit_grain values) the group audits exactly per round, on average, whatever the checks said: each member
    that judges a part audits ``audit_rate / (members − 1)`` random slices of it (the fraction by a draw), drawn
    on its own after the result came (the owner cannot know who will, nor which slices). An audit fetches every
    other contributor's signed values of the slice (each contribution's commitment names the hashes of its pieces:
    the piece that covers the slice, claims.hash_grid) and aggregates them again, which catches what sketches
    cannot: a lie within a lossy codec's rounding, and an owner that passes its lie off as its own share (whose
    commitment it announced with its parts, before its result left). A lie in a fraction f of a part is caught with
    probability about f per audited slice: the likelier, the more of the part it moves. An audit that fails begins a dispute over the whole part (Judge.settle).
    CenteredClip is not coordinate-wise: its audits are of the whole part.
    """

    def __init__(self, *, run: str, key: str, phase: int, me: str, members: Sequence[str],
                 bounds: Sequence[tuple[int, int]], codec: Codec, rule: str, weight: float, identity: Identity,
                 box: Mailbox, guard: Guard, call: Callable[..., Awaitable[tuple[dict[str, Any], float]]],
                 audit_rate: float = 0.0) -> None:
        self.run, self.key, self.phase, self.me_id = run, key, phase, me
        self.members, self.me = list(members), list(members).index(me)
        self.bounds, self.codec, self.rule, self.weight = bounds, codec, rule, float(weight)
        self.identity, self.box, self.guard, self.call = identity, box, guard, call
        self.sent: dict[int, _Sent] = {}
        # Parts we proved wrong and recomputed: the digest of what we held, and its owner's signature on it.
        self.replaced: dict[int, tuple[bytes, Any]] = {}
        # Parts we could neither use nor prove wrong (their owner fell silent): part -> why. The others use them
        # (they drew no audit of them), so we must not apply without them: the run fails here (ButterflyRun.run).
        self.unsettled: dict[int, str] = {}
        # part -> (the result object, its digest, its chunks' hashes)
        self._digests: dict[int, tuple[Any, bytes, list[bytes]]] = {}
        self.judged: set[int] = set()  # parts judge_all took up (only these may be assembled)
        self._osig: tuple[bytes, list[bytes], int, bytes] | None = None  # (header, pieces, how many, signature)
        self._own_payloads: list[bytes] | None = None  # our result's chunks, as its tally is fed them
        self._decoded: dict[int, tuple[Any, torch.Tensor]] = {}  # part -> (the result object, its values)
        self._finite: dict[int, tuple[Any, bool]] = {}  # part -> (the result object, whether its values are finite)
        self.own_commit = b""
        self.tallies: Tallies | None = None  # the sums of each result as it arrives, once the run registers
        self.stats = AuditStats()
        self.audit_per_part = max(0.0, audit_rate) / max(1, len(self.members) - 1)  # slices, on average
        self._draw = random.Random(int.from_bytes(os.urandom(8), "big"))
        self._slices: dict[int, list[tuple[int, int]]] = {}  # part -> the slices our audit of it drew
        # (part, lo, hi) -> the slice of every other contributor, prefetched in one exchange with the part's owner
        self._fetches: dict[tuple[int, int, int], asyncio.Task[dict[str, tuple[Any, int]]]] = {}
        # our part's evidence goes once every other member has judged it (Mailbox.judged_by_all)
        box.own_part = (self.me, tuple(self.members))

    # ------------------------------------------------------------------ signing what leaves
    def sign_own(self, own: torch.Tensor, chunk: int) -> bytes:
        """Keep our own share of our part as signed evidence (the tensor itself: its bytes are made only if it is
        shown; hashed in pieces of audit_grain values from each of our ``chunk``s start: what an audit's slice
        fetches); the hash of its commitment, to announce."""
        ev = Evidence((), self.weight, own.numel(), RAW, chunk, b"", self.identity.public, shas=raw_shas(own, chunk),
                      raw=own)
        ev.sig, self.own_commit = sign_contribution(self.identity, self.run, self.key, self.phase, self.me,
                                                    self.weight, own.numel(), RAW, chunk, ev.sha)  # (its tree, hashed)
        self.box.evidence[self.me_id] = ev
        return self.own_commit

    def sign(self, part: int, pieces: list[bytes], numel: int, chunk: int | None,
             values: torch.Tensor | None = None, shas: list[bytes] | None = None) -> dict[str, bytes]:
        """Sign our contribution to ``part`` (its payload ``pieces``, all of them written; ``values``: what they
        decode to, when known without decoding: a lossless codec; ``shas``: their contribution_shas, when hashed
        as they were encoded): the fields that carry the signature."""
        if not shas and not pieces and values is not None and self.codec.name == "fp32":
            shas = raw_shas(values, chunk)  # (fp32's payloads are not kept: they are the values' bytes)
        digest = root(shas) if shas else payload_sha(pieces, numel, self.codec, chunk)
        sig, commit = sign_contribution(self.identity, self.run, self.key, self.phase, part, self.weight, numel,
                                        self.codec.name, chunk, digest)
        self.sent[part] = _Sent(pieces, commit, chunk, values)
        return {"sig": sig, "pk": self.identity.public}

    def sign_result(self, res: dict[str, Any], pieces: list[bytes]) -> bytes:
        """Our signature over our part's result (its header and its chunks' payloads ``pieces``). Its chunks'
        hashes come from our own result's tally when it holds them all (made as each chunk was encoded), and the
        signature of a result is made once: every member's trailer asks for it, and hashing a 32 MB result on the
        event loop cost 35–90 ms each time, after its last chunk."""
        head = result_header(res)
        got = self._osig
        if got is not None and got[0] == head and got[1] is pieces and got[2] == len(pieces):
            return got[3]
        a, b = self.bounds[self.me]
        tally = None
        if self.tallies is not None and pieces is self._own_payloads:  # (a lie's stream is not the tally's)
            tally = self.tallies.of(self.me, {**res, "_from": self.me_id})
        if tally is not None and len(pieces) == len(tally.shas):
            shas = [s for s in tally.shas if s is not None]
        else:
            shas = result_shas({**res, "_pieces": pieces}, b - a, self.codec)
        sig = self.identity.sign(result_commitment(self.run, self.key, self.phase, self.me, result_digest(res, shas)))
        self._osig = (head, pieces, len(pieces), sig)
        return sig

    # ------------------------------------------------------------------ sums as the results arrive
    def register(self, flat: torch.Tensor, own: torch.Tensor, chunk: int, honest: bool) -> None:
        """Sum verification's work on each result chunk by chunk as it is decoded (net/tally.py, see
        :class:`Tallies`)."""
        self.tallies = Tallies(run=self.run, key=self.key, phase=self.phase, me=self.me, members=self.members,
                               bounds=self.bounds, codec=self.codec, flat=flat, own=own, chunk=chunk, honest=honest)
        self.box.make_tally = self.tallies.make

    def sending(self, part: int, pieces: list[bytes]) -> None:
        """The list our share of ``part`` is encoded into as it is sent (its tallies sketch it from there)."""
        if self.tallies is not None:
            self.tallies.sending(part, pieces)

    def own_stream(self, res: dict[str, Any], numel: int,
                   payloads: list[bytes]) -> Callable[[int, bytes, torch.Tensor], None] | None:
        """What our own part's result chunks (encoded into ``payloads``) are told to as they are produced (its
        tally's feed)."""
        if self.tallies is None:
            return None
        self._own_payloads = payloads
        tally = self.tallies.make(self.me, self.me_id, res, numel)
        return None if tally is None else tally.feed

    def _tally(self, j: int) -> ChunkTally | None:
        """The tally of the result of part ``j`` we hold, if every chunk of it came through one."""
        res = self.box.results.get(j)
        return None if res is None or self.tallies is None else self.tallies.of(j, res)

    def _signed(self, j: int, digest: bytes, osig: Any) -> bool:
        """Whether ``osig`` is part ``j``'s owner's signature over a result of digest ``digest``."""
        return isinstance(osig, bytes) and verify_signature(
            self.members[j], result_commitment(self.run, self.key, self.phase, j, digest), osig)

    # ------------------------------------------------------------------ our claims
    def _result(self, part: int) -> tuple[bytes, torch.Tensor] | None:
        """(digest, decoded values) of the result of ``part`` we hold, if it can be used (decoded once)."""
        res = self.box.results.get(part)
        if res is None:
            return None
        a, b = self.bounds[part]
        if result_problem(res, part, b - a, self.codec, self.members, self.me_id) is not None:
            return None
        values = res.get("_tensor")
        cached = self._decoded.get(part)
        if values is None and cached is not None and cached[0] is res:
            values = cached[1]
        if values is None:
            pieces = [p for p in (res.get("_pieces") or [res.get("data")]) if isinstance(p, bytes)]
            try:
                values = decode_chunked(self.codec, pieces[0] if len(pieces) == 1 else b"".join(pieces), b - a,
                                        res.get("chunk"))
            except ValueError:
                return None
            # Kept here, not in the result: our own result is also the message we send to every member.
            self._decoded[part] = (res, values)
        finite = self._finite.get(part)
        if finite is None or finite[0] is not res:  # checked once per result object
            finite = self._finite[part] = (res, all_finite(values))
        if not finite[1]:
            return None
        return self._digest(part), values

    def entries(self, own: torch.Tensor, parts: Sequence[int] | None = None) -> list[Entry]:
        """Our claims about each part we contributed to, or about ``parts`` of them (our own share of our part is
        ``own``)."""
        out = []
        for j in range(len(self.members)) if parts is None else parts:
            tally = self._tally(j)
            res = self.box.results.get(j, {})
            if (j == self.me or j in self.sent) and tally is not None and tally.mine_sketch is not None \
                    and not (self.rule == "centered-clip" and float(res.get("tau", 0.0)) > 0) \
                    and self._result(j) is not None:  # summed as the result arrived (net/tally.py)
                commit = self.own_commit if j == self.me else self.sent[j].commit
                out.append(Entry(j, commit, self.weight, tally.mine_inf, self._digest(j), tally.mine_sketch.clone()))
                continue
            if j == self.me:
                values, commit = own, self.own_commit
            elif j in self.sent:
                a, b = self.bounds[j]
                s = self.sent[j]
                try:
                    values = s.values if s.values is not None else \
                        decode_chunked(self.codec, b"".join(s.pieces), b - a, s.chunk)
                except ValueError:
                    continue  # what we sent does not decode (a corrupt update of our own, tests): no claim
                commit = s.commit
            else:
                continue
            held = self._result(j)
            if held is None:
                out.append(entry_for(j, values, commit, self.weight, None, None, None, 0.0, self.rule))
            else:
                digest, result = held
                out.append(entry_for(j, values, commit, self.weight, self._key(j), digest, result,
                                     float(res.get("tau", 0.0)), self.rule))
        return out

    def message(self, entries: list[Entry], frame: bool) -> dict[str, Any]:
        """Our check message (``frame``: fault injection, sketches that lie about our contributions)."""
        wire = []
        for e in entries:
            w = e.to_wire()
            for k in ("s", "c"):
                t = getattr(e, k)
                if t is not None:
                    w[k] = sketch_bytes(t * (-3.0 if frame else 1.0))
            wire.append(w)
        return {"key": self.key, "phase": self.phase, "members": len(self.members), "entries": wire}

    # ------------------------------------------------------------------ judging the others' parts
    def _judge(self) -> Judge:
        return Judge(run=self.run, key=self.key, phase=self.phase, members=self.members, codec=self.codec,
                     rule=self.rule, own_commits=self.box.own_commits, checks=self.box.checks, key_of=self._key)

    async def judge_all(self, until: float) -> None:
        """Judge every part we hold a result of and did not own, then act on the verdicts: a replaced result
        is swapped for our recomputation, a skipped one dropped (the assembly leaves it zero), every proven
        liar banned."""
        t0 = time.monotonic()
        judge = self._judge()
        parts = self.unjudged()
        self.judged.update(parts)
        verdicts = await asyncio.gather(*(self._judge_part(judge, j, until) for j in parts))
        self._act(parts, verdicts)
        self.stats.bytes_received += judge.evidence_bytes
        self.stats.seconds += time.monotonic() - t0

    def unjudged(self) -> list[int]:
        """The parts we hold a result of, did not own and have not judged (a result may come while we judge)."""
        return [j for j in range(len(self.members)) if j != self.me and j in self.box.results and j not in self.judged]

    def verdict_message(self) -> dict[str, Any]:
        """The parts we proved wrong, each with the digest of the result we held, for every member (they check
        them in turn: :meth:`reconcile`), and the parts we have judged: an owner whose part every other member has
        judged, and none proved wrong, lets its evidence go (Mailboxes.accept_verdict)."""
        return {"key": self.key, "phase": self.phase,
                "replaced": [[j, d, o] for j, (d, o) in sorted(self.replaced.items())], "judged": sorted(self.judged)}

    async def reconcile(self, until: float) -> None:
        """Other members proved parts wrong that we used (an audit drew them, or their copy of the result was
        another): we settle those parts ourselves, from the owners' evidence, so that every honest member ends
        with the same values. An accusation that does not hold is a strike against whoever made it."""
        t0 = time.monotonic()
        accused: dict[int, set[str]] = {}
        for member, parts in self.box.verdicts.items():
            if member not in self.members or member == self.me_id:
                continue
            for j, digest, osig in parts:
                if not (0 <= j < len(self.members)) or j == self.me or j in self.replaced or j not in self.box.results:
                    continue
                ours = self._digest(j)
                if digest == ours:  # proved wrong about the result we hold: we check it ourselves
                    accused.setdefault(j, set()).add(member)
                elif self._signed(j, digest, osig) and self._signed(j, ours, self.box.results[j].get("osig")):
                    # The owner signed two different results of one part: it told members different things.
                    # Ours passed our checks; the owner is banned.
                    owner = self.members[j]
                    if not self.guard.is_banned(owner):
                        self.guard.ban(owner, f"signed two different results of part {j} in round {self.key}")
                        self.stats.liars.append(owner)
        parts = sorted(j for j in accused if j in self.box.results)
        if not parts:
            return
        judge = self._judge()

        async def settle(j: int) -> Verdict:
            who = ",".join(sorted(p[-8:] for p in accused[j]))
            return await self._settle_part(judge, j, until, f"proved wrong by {who}")

        verdicts = await asyncio.gather(*(settle(j) for j in parts))
        self.judged.update(parts)  # settled here from the owner's evidence: as judged
        self._act(parts, verdicts)
        for j, v in zip(parts, verdicts, strict=True):
            if v.action == "use" and not v.liars:
                for p in accused[j]:
                    self.guard.strike(p, f"a false accusation of part {j} in round {self.key}")
        self.stats.bytes_received += judge.evidence_bytes
        self.stats.seconds += time.monotonic() - t0

    def _act(self, parts: list[int], verdicts: list[Verdict]) -> None:
        for j, v in zip(parts, verdicts, strict=True):
            owner = self.members[j]
            if v.action != "use" or v.liars:
                log.warning("event=verified part=%d owner=%s key=%s phase=%d action=%s liars=%s reason=%s", j,
                            owner[-8:], self.key, self.phase, v.action, ",".join(p[-8:] for p in v.liars) or "-",
                            v.reason)
            if v.action == "replace":
                assert v.values is not None
                held = self.box.results[j]
                self.replaced[j] = (self._digest(j), held.get("osig"))
                self.box.results[j] = {**held, "_tensor": v.values, "_pieces": None, "data": None}
                self.stats.replaced += 1
            elif v.action == "skip":
                self.box.results.pop(j, None)
                self.stats.skipped += 1
                if not v.liars:
                    self.unsettled[j] = v.reason
            for p in v.liars:
                if p != self.me_id and not self.guard.is_banned(p):
                    self.guard.ban(p, f"lied in round {self.key} phase {self.phase} ({v.reason})")
                    self.stats.liars.append(p)

    async def _judge_part(self, judge: Judge, j: int, until: float) -> Verdict:
        owner = self.members[j]
        res = self.box.results[j]
        a, b = self.bounds[j]
        direct = res.get("_from", owner) == owner

        async def fetch(who: str) -> Fetched:
            return await fetch_evidence(self.call, owner, self.key, self.phase, j, who,
                                        max(0.1, until - time.monotonic()), b - a)

        problem = result_problem(res, j, b - a, self.codec, self.members, self.me_id)
        if problem is not None and not problem[1]:
            return Verdict("use")  # honest views of the round that differ: the assembly leaves it out
        contributors = res.get("contributors")
        if not isinstance(contributors, list) or not set(map(str, contributors)) <= set(self.members) \
                or len(set(map(str, contributors))) != len(contributors):
            return Verdict("skip", "the result names contributors outside the group, or twice",
                           liars=(owner,) if direct else ())
        held = self._result(j)
        digest = self._digest(j)
        if held is None:
            return await judge.settle(j, owner, res, digest, None, fetch, "a malformed or non-finite result", direct)
        if not self._signed(j, digest, res.get("osig")):
            return await judge.settle(j, owner, res, digest, None, fetch, "a result its owner did not sign", direct)
        _, values = held
        claims, missing = judge.claims(j, digest, [str(p) for p in contributors])
        key = self._key(j)
        sketches = {p: (e.weight, e.inf, e.s, e.c) for p, e in claims.items()}
        if missing:
            evidence, stop = await judge.evidence(j, owner, missing, fetch)
            if stop is not None:
                return Verdict("skip", f"claims missing ({len(missing)}); {stop.reason}", liars=stop.liars)
            for p, ev in evidence.items():
                try:
                    x = await asyncio.to_thread(ev.values)
                except ValueError:
                    return Verdict("skip", f"{p[-8:]}'s signed contribution does not decode", liars=(owner,))
                e = await asyncio.to_thread(entry_for, j, x, b"", ev.weight, key, digest, values,
                                            float(res.get("tau", 0.0)), self.rule)
                sketches[p] = (ev.weight, e.inf, e.s, e.c)  # type: ignore[assignment]
        tally = self._tally(j)
        pre = tally if tally is not None and tally.judge else None
        self.stats.tallied += pre is not None
        if judge.summed(pre, sketches, self.rule):  # type: ignore[arg-type]
            why = judge.test(res, values, sketches, key, pre)  # type: ignore[arg-type]
        else:
            why = await asyncio.to_thread(judge.test, res, values, sketches, key, pre)  # type: ignore[arg-type]
        mine = self.box.checks.get(owner, {}).get(j)
        if why is None and direct and mine is not None and mine.digest is not None and mine.digest != digest:
            # An honest owner holds exactly the result it sends: its claims about another one are a dispute.
            why = "the owner's claims are about another result than the one it sent"
        if why is None:
            why = await self._audit(judge, j, res, values, until)
            if why is None:
                return Verdict("use")
        return await judge.settle(j, owner, res, digest, values, fetch, why, direct)

    def prefetch(self, tg: asyncio.TaskGroup, until: float) -> None:
        """Draw our random audits of every part whose result we hold (on our own, as :meth:`_audit` would) and
        start fetching their slices now, as tasks of ``tg``: the owners show them while the claims are exchanged,
        and :meth:`_audit` judges them once the claims are in (a slice is checked against its contributor's claim).
        2 peers, 1 MB: the audit's round trip to the owner came after the claims, 5–10 ms of a 0.1 s round."""
        if self.rule == "centered-clip":
            return  # its audits are of the whole part (a dispute), nothing to fetch ahead
        for j in range(len(self.members)):
            res = self.box.results.get(j)
            if j == self.me or j in self._slices or res is None or self._result(j) is None:
                continue
            slices = self._slices[j] = self._draw_slices(j, res)
            whos = [str(p) for p in res.get("contributors") or [] if not (str(p) == self.me_id and j in self.sent)]
            for lo, hi in slices:
                if whos and len(whos) <= MAX_SLICES:
                    self._fetches[(j, lo, hi)] = tg.create_task(self._fetch_slices(j, whos, lo, hi, until))

    def _draws(self) -> int:
        """How many audits of a part we make this round: the rate's whole part, and one more by a draw."""
        r = self.audit_per_part
        return int(r) + (self._draw.random() < r - int(r))

    def _draw_slices(self, j: int, res: dict[str, Any]) -> list[tuple[int, int]]:
        """Our random draw of the slices of part ``j`` to audit (none with probability 1 − the rate's fraction)."""
        n = self._draws()
        if n == 0:
            return []
        a, b = self.bounds[j]
        # slices of the part's grain from each chunk's start (a multiple of every codec's block: the slice's
        # average is encoded as it is inside its chunk)
        g = audit_grain(b - a)
        grains = [(s, min(s + g, hi)) for lo, hi in result_bounds(res, b - a) for s in range(lo, hi, g)]
        return sorted(self._draw.sample(grains, min(n, len(grains))))

    async def _fetch_slices(self, j: int, whos: list[str], lo: int, hi: int, until: float
                            ) -> dict[str, tuple[Any, int]]:
        a, b = self.bounds[j]
        return await fetch_slices(self.call, self.members[j], self.key, self.phase, j, whos, lo, hi, b - a,
                                  max(0.1, until - time.monotonic()))

    async def _fetch_slice(self, j: int, who: str, lo: int, hi: int, until: float) -> tuple[Any, int]:
        a, b = self.bounds[j]
        return await fetch_slice(self.call, self.members[j], self.key, self.phase, j, who, lo, hi, b - a,
                                 max(0.1, until - time.monotonic()))

    async def _audit(self, judge: Judge, j: int, res: dict[str, Any], values: torch.Tensor, until: float
                     ) -> str | None:
        """Our random audit of part ``j`` (see the class): why it failed, or None (also when none was drawn). Its
        slices were drawn, and their fetches started, by :meth:`prefetch` when it saw this result."""
        if self.rule == "centered-clip":  # not coordinate-wise: an audit is of the whole part (a dispute)
            if self._draws() == 0:
                return None
            self.stats.audits += 1
            return "a random audit (of the whole part: CenteredClip)"
        slices = self._slices.get(j)
        if slices is None:
            slices = self._slices[j] = self._draw_slices(j, res)
        if not slices:
            return None
        self.stats.audits += len(slices)

        async def fetch(who: str, lo: int, hi: int) -> tuple[Any, int]:
            ahead = self._fetches.get((j, lo, hi))
            got = None if ahead is None else (await ahead).get(who)
            return got if got is not None else await self._fetch_slice(j, who, lo, hi, until)

        held = {self.me_id: lambda lo, hi: (self.weight, self._sent_values(j, lo, hi))} if j in self.sent else None
        why = await judge.audit(j, self.members[j], res, values, slices, fetch, held)
        return None if why is None else f"a random audit: {why}"

    def _sent_values(self, j: int, lo: int, hi: int) -> torch.Tensor:
        """Values ``lo:hi`` of our contribution to part ``j`` as we sent it (decoded: what the owner averaged)."""
        s = self.sent[j]
        if s.values is not None:
            return s.values[lo:hi]
        a, b = self.bounds[j]
        bounds = piece_bounds(b - a, s.chunk)  # the chunks we encoded it in
        if len(s.pieces) != len(bounds):
            return decode_chunked(self.codec, b"".join(s.pieces), b - a, s.chunk)[lo:hi]
        out = []
        for (ca, cb), piece in zip(bounds, s.pieces, strict=True):
            if ca < hi and cb > lo:
                out.append(self.codec.decode(piece, cb - ca)[max(lo, ca) - ca : min(hi, cb) - ca])
        return torch.cat(out)

    def _hashes(self, j: int) -> tuple[bytes, list[bytes]]:
        """(digest, the chunks' hashes) of the result of part ``j`` we hold (hashed once per result object)."""
        res = self.box.results.get(j, {})
        cached = self._digests.get(j)
        if cached is not None and cached[0] is res:
            return cached[1], cached[2]
        a, b = self.bounds[j]
        tally = self._tally(j)
        shas = [s for s in tally.shas if s is not None] if tally is not None else result_shas(res, b - a, self.codec)
        digest = result_digest(res, shas)
        self._digests[j] = (res, digest, shas)
        return digest, shas

    def _digest(self, j: int) -> bytes:
        return self._hashes(j)[0]

    def _key(self, j: int) -> list[tuple[int, int, bytes]]:
        """The sketch key of part ``j``, from the result of it we hold (claims.chunk_keys)."""
        tally = self._tally(j)
        if tally is not None:
            return [k for k in tally.keys if k is not None]
        a, b = self.bounds[j]
        return chunk_keys(self.run, self.key, self.phase, j, self.box.results.get(j, {}), self._hashes(j)[1], b - a)

    async def _settle_part(self, judge: Judge, j: int, until: float, why: str) -> Verdict:
        """A dispute over part ``j`` begun for ``why``: the owner's evidence decides (see Judge.settle)."""
        owner = self.members[j]
        res = self.box.results[j]
        held = self._result(j)

        a, b = self.bounds[j]

        async def fetch(who: str) -> Fetched:
            return await fetch_evidence(self.call, owner, self.key, self.phase, j, who,
                                        max(0.1, until - time.monotonic()), b - a)

        return await judge.settle(j, owner, res, self._digest(j), None if held is None else held[1],
                                  fetch, why, res.get("_from", owner) == owner)
