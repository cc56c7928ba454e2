"""Verified aggregation: every member checks every part's average against what its contributors sent.

In the butterfly a part's owner averages the members' contributions and sends the average back; a guard on
what it *receives* is half a guard. Here, after the all-gather, each member sends every other member one
*check* message: for each part it contributed to, the digest of the owner's result it holds, the hash of
its signed contribution, its weight, its contribution's largest magnitude and a sketch of it
(collective/sketch.py) under a seed fixed by that result. A member then checks each part it did not own:

1. the result's contributors and total weight against the contributors' own claims;
2. no value beyond the largest magnitude any contributor sent (a mean, a trimmed mean and CenteredClip all
   stay inside the contributions' range);
3. the sketch of the result against the weighted sum of the contributors' sketches (the mean), or BTARD's
   test that the clipped pulls cancel at the result (CenteredClip), within the codec's error bound.

Every contribution travels with its contributor's signature (net/identity.py) over a commitment (run,
round, phase, part, weight, size, codec and the payload's SHA-256), and every member announces the hash of
the commitment of its own share of its own part with its share of every other part, before its result leaves:
whatever it shows an auditor as its own share must be that one. (When it made that commitment is not proven: an
owner that sent its parts late may have chosen its own share after seeing the others' contributions, which makes
it a contributor that saw the others first, bounded by the aggregation rule as any contribution is.) When a
check fails (or a contributor's claim is missing), the member asks the owner for the signed contributions
(*evidence*) and decides by itself who lied:

* evidence the owner cannot show, or that is not signed by the member it names: the owner lied;
* a signed contribution that contradicts what its contributor claimed in its check: that contributor lied;
* otherwise the member recomputes the aggregate from the evidence; if it differs from the owner's result
  beyond the codec's rounding, the owner lied, and the member uses its own recomputation (what an honest
  owner would have sent); if not, the result stands.

A proven liar is banned at once (the guard), by every member that saw the proof. Trimmed means are checked
by 1 and 2 and by evidence when a claim is missing; their sketch test needs the per-coordinate order, which
a sketch does not keep (a lie within the contributions' range is not caught). An owner can always present
its own share as it likes: it is one contribution among the others, which is what the aggregation rule
is there to bound.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..collective.aggregate import aggregate
from ..collective.butterfly import chunk_bounds
from ..collective.codecs import Codec
from ..collective.sketch import BUCKETS, Key, mean_residual, passes, sketch
from .claims import INLINE_SLICE, Entry, Evidence, Fetched, Slice
from .pieces import RAW
from .tally import F32_ROUND, ChunkTally

__all__ = ["FetchEvidence", "FetchSlice", "Judge", "Verdict", "error_bound"]

log = logging.getLogger(__name__)


def error_bound(values: torch.Tensor, codec: Codec, chunk: int | None, largest: float,
                absv: torch.Tensor | None = None) -> torch.Tensor:
    """How far each value of a decoded result may be from the exact aggregate (the codec's rounding, chunk by
    chunk, and float32's), capped by what a value inside the contributions' range could be off by.
    ``absv``: ``|values|`` in float64, if the caller has it already."""
    n = values.numel()
    if absv is None:
        absv = values.abs().to(torch.float64)
    if chunk is None or codec.elementwise_bound:  # one call: the bound of a value does not depend on its chunk
        eps = codec.error_bound(values).to(torch.float64)
    else:
        eps = torch.empty(n, dtype=torch.float64)
        for a, b in chunk_bounds(n, chunk):
            eps[a:b] = codec.error_bound(values[a:b]).to(torch.float64)
    eps.add_(absv, alpha=F32_ROUND)
    return torch.minimum(eps, absv + largest)


@dataclass
class Verdict:
    """What to do with one part's result: ``use`` it, ``replace`` it with ``values`` (recomputed from the
    evidence), or ``skip`` it (the round is partial); ``liars``: members proven to have lied."""

    action: str
    reason: str = ""
    values: torch.Tensor | None = None
    liars: tuple[str, ...] = ()


#: Fetches one member's signed contribution to the part from the part's owner.
FetchEvidence = Callable[[str], Awaitable[Fetched]]
#: Fetches values lo:hi of one member's signed contribution to the part from the part's owner: (slice, bytes).
FetchSlice = Callable[[str, int, int], Awaitable[tuple[Slice | None, int]]]


class Judge:
    """One member's judgement of the parts of one (round, phase).

    ``run``, ``key``, ``phase``: what commitments and seeds are bound to; ``members``: the group; ``codec``:
    the round's; ``rule``: the aggregation; ``own_commits``: member -> the hash of the commitment of its own
    share of its own part, as it announced it; ``checks``: member -> its entries by part.
    """

    def __init__(self, *, run: str, key: str, phase: int, members: Sequence[str], codec: Codec, rule: str,
                 own_commits: Mapping[str, bytes], checks: Mapping[str, Mapping[int, Entry]],
                 key_of: Callable[[int], Key]) -> None:
        self.run, self.key, self.phase, self.members = run, key, phase, list(members)
        self.codec, self.rule, self.own_commits, self.checks = codec, rule, own_commits, checks
        self.key_of = key_of  # part -> the sketch key of the result of it we hold (claims.chunk_keys)
        self.evidence_bytes = 0

    # ------------------------------------------------------------------ the checks
    def claims(self, part: int, digest: bytes, contributors: Sequence[str]) -> tuple[dict[str, Entry], list[str]]:
        """The contributors' usable claims about ``part`` (sketched under this result's seed), and the
        contributors whose claim is missing or was made under another result (their evidence is needed)."""
        usable, missing = {}, []
        for p in contributors:
            e = self.checks.get(p, {}).get(part)
            if e is not None and e.digest == digest and e.s is not None \
                    and (self.rule != "centered-clip" or e.c is not None):
                usable[p] = e
            else:
                missing.append(p)
        return usable, missing

    @staticmethod
    def summed(pre: ChunkTally | None, sketches: Mapping[str, tuple[float, float, torch.Tensor, torch.Tensor | None]],
               rule: str) -> bool:
        """Whether :meth:`test` of a mean needs nothing but ``pre``'s sums and the sketches (a few hundred floats: run
        it on the event loop, not in a worker thread, whose round trip cost more under load)."""
        largest = max((m for _, m, _, _ in sketches.values()), default=0.0)
        return rule == "mean" and pre is not None and pre.slack <= largest

    def test(self, res: Mapping[str, Any], values: torch.Tensor, sketches: Mapping[str, tuple[float, float,
             torch.Tensor, torch.Tensor | None]], key: Key, pre: ChunkTally | None = None) -> str | None:
        """Why the result ``values`` of ``res`` fails the checks against the contributors' (weight, magnitude,
        sketch, clipped sketch), or None if it passes. ``pre``: the result's sums made as it arrived (its sketch
        and error bound; net/tally.py), used where they are exact."""
        total = math.fsum(w for w, _, _, _ in sketches.values())
        claimed = float(res["total"])
        if not math.isclose(total, claimed, rel_tol=1e-9, abs_tol=1e-12):
            return f"total weight {claimed:.6g}, the contributors' weights sum to {total:.6g}"
        largest = max((m for _, m, _, _ in sketches.values()), default=0.0)
        claimed_abs = sum(float(s.abs().sum()) for _, _, s, _ in sketches.values())
        if pre is not None and pre.slack <= largest:  # summed as the result arrived (net/tally.py)
            # max(|v| − min(e0, |v| + L)) = max(|v| − e0, −L); and min(e0, |v| + L) = e0 wherever e0 − |v| <= L
            if values.numel() and pre.over - largest * (1 + 1e-6) > 0:
                return f"a value beyond every contribution's range (by {pre.over - largest * (1 + 1e-6):.3g})"
            bound_sq, scale, result_sketch = pre.e0_sq, pre.abs_sum + claimed_abs, pre.result
        else:
            absv = values.abs().to(torch.float64)
            eps = error_bound(values, self.codec, res.get("chunk"), largest, absv)
            over = absv - eps - largest * (1 + 1e-6)
            if values.numel() and float(over.max()) > 0:
                return f"a value beyond every contribution's range (by {float(over.max()):.3g})"
            bound_sq = float(eps.pow(2).sum())
            scale = float(absv.sum()) + claimed_abs
            result_sketch = sketch(values, key) if self.rule == "mean" else None
        if self.rule == "mean":
            assert result_sketch is not None
            residual = mean_residual(result_sketch, [(w, s) for w, _, s, _ in sketches.values()])
            if not passes(residual, bound_sq, scale):
                return f"the sketch is {float(residual.norm()):.3g} off the contributions' (allowed {math.sqrt(bound_sq):.3g})"
        elif self.rule == "centered-clip":
            tau = float(res.get("tau", 0.0))
            pull = torch.zeros(BUCKETS, dtype=torch.float64)
            for w, _, _, c in sketches.values():
                assert c is not None
                pull += (w / total) * c
            # At the fixed point the pulls cancel, up to the owner's stopping rule and the codec's rounding.
            allowed = (math.sqrt(bound_sq) + 2e-4 * tau) ** 2
            if not passes(pull, allowed, scale + tau):
                return f"the clipped pulls sum to {float(pull.norm()):.3g} (allowed {math.sqrt(allowed):.3g})"
        return None

    # ------------------------------------------------------------------ disputes
    def _check_evidence(self, who: str, part: int, owner: str, ev: Evidence) -> str | None:
        """Why ``ev`` is not a valid signed contribution of ``who`` to ``part``, or None."""
        if not ev.signed_by(who, self.run, self.key, self.phase, part):
            return f"the contribution it shows for {who[-8:]} is not signed by it"
        if (ev.codec == RAW) != (who == owner):
            return f"the contribution it shows for {who[-8:]} is of the wrong kind ({ev.codec})"
        return None

    async def evidence(self, part: int, owner: str, who: Sequence[str], fetch: FetchEvidence
                       ) -> tuple[dict[str, Evidence], Verdict | None]:
        """Every member's of ``who`` signed contribution to ``part``, from its owner; or a verdict to skip the
        part (the owner is gone or has none: no one is blamed; it showed a forged one: it lied)."""
        fetched = await asyncio.gather(*(fetch(p) for p in who))
        out: dict[str, Evidence] = {}
        for p, f in zip(who, fetched, strict=True):
            self.evidence_bytes += f.nbytes
            if f.evidence is None:
                said = "has none" if f.answered else "did not answer"
                return out, Verdict("skip", f"the owner {said} of {p[-8:]}'s signed contribution")
            why = self._check_evidence(p, part, owner, f.evidence)
            if why is not None:
                return out, Verdict("skip", why, liars=(owner,))
            out[p] = f.evidence
        return out, None

    async def settle(self, part: int, owner: str, res: Mapping[str, Any], digest: bytes,
                     values: torch.Tensor | None, fetch: FetchEvidence, first: str, blame: bool) -> Verdict:
        """A dispute over ``part`` (``first``: why it began): fetch every contributor's signed contribution
        from the owner, find who lied and, if the result is wrong, recompute it. ``blame``: the result came
        from the owner itself (a relayed one may carry a lie its relayer could not see)."""
        contributors = [str(p) for p in res.get("contributors") or []]
        evidence, stop = await self.evidence(part, owner, contributors, fetch)
        if stop is not None:
            return Verdict("skip", f"{first}; {stop.reason}", liars=stop.liars)
        liars: list[str] = []
        xs: dict[str, torch.Tensor] = {}
        for p, ev in evidence.items():
            commit = hashlib.sha256(ev.commit(self.run, self.key, self.phase, part)).digest()
            claim = self.checks.get(p, {}).get(part)
            announced = self.own_commits.get(p) if p == owner else None
            if announced is not None and announced != commit:
                return Verdict("skip", f"{first}; the owner's own share is not the one it announced", liars=(owner,))
            try:
                xs[p] = await asyncio.to_thread(ev.values)
            except ValueError as e:  # the owner took it: it could not have decoded it either
                return Verdict("skip", f"{first}; {p[-8:]}'s signed contribution does not decode ({e})",
                               liars=(owner,))
            if claim is not None and claim.commit != commit:
                liars.append(p)  # it signed one contribution and claims another
            elif claim is not None and claim.digest == digest and claim.s is not None:
                mine = await asyncio.to_thread(sketch, xs[p], self.key_of(part))
                if not passes(mine - claim.s, 0.0, float(mine.abs().sum()) + float(claim.s.abs().sum())):
                    liars.append(p)  # its sketch is not the sketch of what it signed
        if not xs:
            return Verdict("skip", f"{first}; the result names no contributor", liars=(owner,) if blame else ())
        honest = await asyncio.to_thread(self._recompute, xs, evidence, res)
        if values is not None and honest.shape == values.shape:
            largest = max(float(x.abs().max()) if x.numel() else 0.0 for x in xs.values())
            if self.same(values, honest, error_bound(honest, self.codec, res.get("chunk"), largest)):
                return Verdict("use", f"{first}; the owner's result holds", liars=tuple(liars))
        return Verdict("replace", f"{first}; the result is not the aggregate of what was sent",
                       values=honest, liars=(*liars, owner) if blame else tuple(liars))

    async def audit(self, part: int, owner: str, res: Mapping[str, Any], values: torch.Tensor,
                    slices: Sequence[tuple[int, int]], fetch: FetchSlice,
                    held: Mapping[str, Callable[[int, int], tuple[float, torch.Tensor]]] | None = None) -> str | None:
        """A random audit of the result ``values`` of ``part`` on ``slices`` (values lo:hi, each inside one chunk
        of the result, from its start or a multiple of 1024 after it): every contributor's signed contribution to
        them, shown by the owner, aggregated again exactly as an honest owner would. ``held``: contributions the
        auditor holds itself (its own: what it signed is what it sent), by contributor, giving (weight, values
        lo:hi); not fetched. Why the result fails it (a dispute follows: :meth:`settle` fetches everything and
        decides who lied), or None if it holds. Each slice costs the pieces of each contribution that cover it,
        not the part."""
        contributors = [str(p) for p in res.get("contributors") or []]
        if not contributors:
            return "the result names no contributor"
        held = held or {}
        asked = [(p, a, b) for a, b in slices for p in contributors if p not in held]
        got = await asyncio.gather(*(fetch(p, a, b) for p, a, b in asked))
        self.evidence_bytes += sum(n for _, n in got)
        shown = {k: sl for k, (sl, _) in zip(asked, got, strict=True)}
        for a, b in slices:
            pieces = [(p, held[p] if p in held else shown[(p, a, b)]) for p in contributors]
            if b - a <= INLINE_SLICE and len(pieces) <= 3:  # a signature or two and a few Ki values: on the loop
                why = self._audit_slice(part, owner, res, values, a, b, pieces)
            else:
                why = await asyncio.to_thread(self._audit_slice, part, owner, res, values, a, b, pieces)
            if why is not None:
                return why
        return None

    def _audit_slice(self, part: int, owner: str, res: Mapping[str, Any], values: torch.Tensor, lo: int, hi: int,
                     shown: Sequence[tuple[str, Slice | Callable[[int, int], tuple[float, torch.Tensor]] | None]]
                     ) -> str | None:
        xs, ws = [], []
        for p, sl in shown:
            if callable(sl):  # our own: not fetched
                try:
                    w, x = sl(lo, hi)
                except ValueError as e:  # (fault injection: we sent a payload that does not decode)
                    return f"our own contribution's values {lo}:{hi}: {e}"
                xs.append(x)
                ws.append(w)
                continue
            if sl is None:
                return f"the owner did not show {p[-8:]}'s values {lo}:{hi}"
            if (sl.codec == RAW) != (p == owner):
                return f"the values it shows for {p[-8:]} are of the wrong kind ({sl.codec})"
            commit = hashlib.sha256(sl.commit(self.run, self.key, self.phase, part)).digest()
            announced = self.own_commits.get(p) if p == owner else None
            claim = self.checks.get(p, {}).get(part)
            if (announced is not None and announced != commit) or (claim is not None and claim.commit != commit):
                return f"{p[-8:]}'s signed contribution is not the one it claimed"
            # The pieces lead to the root the commitment names (Slice.values checks every path): a commitment that
            # its contributor named to us itself (its claim, or the owner's announcement of its own share, each
            # from that member's own stream; the one this slice has, by the check above) needs no signature to be
            # its. One no member vouched for must be signed (8 members: 7 signatures a slice, a fifth of an audit).
            if claim is None and announced is None and not sl.signed_by(p, self.run, self.key, self.phase, part):
                return f"the values it shows for {p[-8:]} are not signed by it"
            try:
                xs.append(sl.values(lo, hi))
            except ValueError as e:
                return f"{p[-8:]}'s values {lo}:{hi}: {e}"
            ws.append(sl.weight)
        avg = aggregate(xs, ws, self.rule).float()
        honest = self.codec.decode(self.codec.encode(avg), hi - lo)
        largest = max(float(x.abs().max()) if x.numel() else 0.0 for x in xs)
        if self.same(values[lo:hi], honest, error_bound(honest, self.codec, None, largest)):
            return None
        return f"values {lo}:{hi} are not the aggregate of what was sent"

    def same(self, values: torch.Tensor, honest: torch.Tensor, eps: torch.Tensor) -> bool:
        """Whether the owner's result is our recomputation of it. The mean is the same arithmetic in the same
        order on both sides: every value within a few float32 ulps, but for a handful (≤ 1e-4 of them) that
        a last-bit difference of float64 sums moved across a codec level. CenteredClip's norms and medians are
        reductions whose order may differ between machines: within twice the codec's error bound."""
        diff = (values.to(torch.float64) - honest.to(torch.float64)).abs()
        loose = diff <= 2 * eps + 1e-30
        if self.rule != "mean":
            return bool(loose.all())
        tight = diff <= 4 * torch.finfo(torch.float32).eps * honest.abs().to(torch.float64) + 1e-30
        off = int((~tight).sum())
        return off <= max(1, values.numel() // 10_000) and bool(loose.all())

    def _recompute(self, xs: Mapping[str, torch.Tensor], evidence: Mapping[str, Evidence],
                   res: Mapping[str, Any]) -> torch.Tensor:
        """What an honest owner sends for these contributions: the aggregate, through the codec."""
        use = sorted(xs)
        ws = [evidence[p].weight for p in use]
        tau = float(res.get("tau", 0.0))
        avg = aggregate([xs[p] for p in use], ws, self.rule, tau=tau if tau > 0 else None).float()
        chunk = res.get("chunk")
        bounds = chunk_bounds(avg.numel(), chunk) if chunk is not None else [(0, avg.numel())]
        out = torch.empty_like(avg)
        for a, b in bounds:
            out[a:b] = self.codec.decode(self.codec.encode(avg[a:b]), b - a)
        return out


