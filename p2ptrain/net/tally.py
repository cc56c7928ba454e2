"""Verification's sums over one result, chunk by chunk as it arrives (net/audit.py uses them once it is whole).

A member checks each part's result against the contributors' sketches (net/verify.py), and claims a sketch of its
own contribution to each part, all under keys bound to each chunk of the result (claims.chunk_keys). Summed after
the transfer, that work held every verified round up for seconds of CPU on a 64 MB fragment; summed here, in the
worker thread that decodes each chunk as it arrives, it overlaps the transfer. What is summed does not depend on
what arrives later: per chunk its hash and seed, the sketch of the result's values and of this member's own
contribution, and the parts of the error bound that do not need the contributors' largest magnitude (the cap
``|v| + largest`` applies only where ``e0 > |v| + largest``: if the largest ``e0 − |v|`` is within it, the sum
of ``e0²`` is the bound's; if not, the judge computes it whole, as before).

A tally is for one result as one sender sent it (its header, hashed); the audit uses it only for the result it
holds, and only when every chunk came through it. Anything else (a relay, a replaced result, chunks of another
size) is summed whole, as before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..collective.butterfly import chunk_bounds
from ..collective.codec_base import Codec
from ..collective.sketch import BUCKETS, add_chunks, seed
from .claims import result_bounds, result_header
from .digest import digest

__all__ = ["F32_ROUND", "ChunkTally", "Tallies"]

F32_ROUND = 2.0**-24  # the mean is summed in float64 and rounded once to float32

#: Our contribution to a part, chunk ``c`` = values [lo, hi) as the part's owner decoded them; None if not known.
Mine = Callable[[int, int, int], torch.Tensor | None]


class ChunkTally:
    """The sums of one result of ``part`` (``numel`` values, header ``res``) from ``sender``, chunk by chunk.

    ``judge``: sum the result's own statistics (a part this member did not own); ``mine``: this member's
    contribution to the part, to sketch under each chunk's key (None: it made none, or it is summed whole)."""

    def __init__(self, *, run: str, key: str, phase: int, part: int, sender: str, res: Mapping[str, Any], numel: int,
                 codec: Codec, judge: bool, mine: Mine | None) -> None:
        self.run, self.key, self.phase, self.part, self.sender = run, key, phase, part, sender
        self.numel, self.codec, self.judge, self.mine = numel, codec, judge, mine
        self.head = result_header(res)
        self.bounds = result_bounds(res, numel)
        n = len(self.bounds)
        self.shas: list[bytes | None] = [None] * n
        self.keys: list[tuple[int, int, bytes] | None] = [None] * n
        self.result = torch.zeros(BUCKETS, dtype=torch.float64)  # sketch of the result's values
        self.e0_sq = 0.0  # Σ e0², e0 = the codec's bound + float32 rounding of the mean
        self.over = float("-inf")  # max(|v| − e0): a value beyond every contribution's range shows here
        self.slack = float("-inf")  # max(e0 − |v|): where the cap |v| + largest could bind
        self.abs_sum = 0.0  # Σ |v|
        self.mine_sketch: torch.Tensor | None = torch.zeros(BUCKETS, dtype=torch.float64) if mine else None
        self.mine_inf = 0.0  # our contribution's largest magnitude
        self.done = 0
        self.broken = False
        self._lock = threading.Lock()

    def matches(self, sender: str, res: Mapping[str, Any]) -> bool:
        """Whether this tally is of ``res`` (the result the audit holds, from ``sender``) and whole."""
        return (self.sender == sender and not self.broken and self.done == len(self.bounds)
                and result_header(res) == self.head)

    def _lossless_sums(self, values: torch.Tensor) -> None:
        """The error bound's sums of a chunk of a codec without error (fp32): e0 = |v|·2^-24, so they follow from
        Σ|v|, the extremes of |v| and Σ v², with the same values as the general sums in :meth:`feed` (|v|·(1 − 2^-24)
        and v² of a float32 v are exact in float64, and scaling by 2^-48 is exact), in half of its passes over
        float64 copies of the chunk (a 64 MB round between two peers: 8 M values a member judges)."""
        absv = values.abs()
        self.abs_sum += float(absv.sum(dtype=torch.float64))
        low, high = torch.aminmax(absv)
        keep = 1.0 - F32_ROUND
        self.over = max(self.over, float(high) * keep)  # max(|v| − e0)
        self.slack = max(self.slack, -float(low) * keep)  # max(e0 − |v|)
        d = values.to(torch.float64)
        self.e0_sq += float(torch.dot(d, d)) * F32_ROUND**2

    def feed(self, c: int, piece: bytes, values: torch.Tensor) -> None:
        """Chunk ``c`` arrived: its payload and its decoded values (run it in a worker thread). A chunk that does
        not fit the header's chunks leaves the tally broken (the audit then sums the result whole)."""
        with self._lock:
            if self.broken or not 0 <= c < len(self.bounds) or self.shas[c] is not None:
                self.broken = True
                return
            lo, hi = self.bounds[c]
            if values.numel() != hi - lo:
                self.broken = True
                return
            sha = digest(piece)
            k = seed(self.run, self.key, self.phase, self.part, self.head, c, sha)
            x = self.mine(c, lo, hi) if self.mine is not None and self.mine_sketch is not None else None
            if x is not None and x.numel() != hi - lo:
                x = None
            if self.mine_sketch is not None and x is None:
                self.mine_sketch = None  # (our contribution to this chunk is not known: it is summed whole)
            # One sign stream for the result's sketch and our contribution's (the same key and place).
            add_chunks([*([(self.result, values)] if self.judge else []),
                        *([(self.mine_sketch, x)] if self.mine_sketch is not None and x is not None else [])],
                       k, lo, self.numel)
            if self.judge and hi > lo and self.codec.lossless and values.dtype == torch.float32:
                self._lossless_sums(values)
            elif self.judge:
                absv = values.abs().to(torch.float64)
                e0 = self.codec.error_bound(values).to(torch.float64).add_(absv, alpha=F32_ROUND)
                if hi > lo:  # (one pass for the extremes, a dot for Σ e0²: the chunk's float64 copies are few)
                    self.abs_sum += float(absv.sum())
                    low, high = torch.aminmax(absv.sub_(e0))  # |v| − e0, in place of |v| (summed above)
                    self.over = max(self.over, float(high))
                    self.slack = max(self.slack, float(-low))
                    self.e0_sq += float(torch.dot(e0, e0))
            if x is not None and x.numel() and self.mine_sketch is not None:
                self.mine_inf = max(self.mine_inf, float(x.abs().max()))
            self.shas[c], self.keys[c] = sha, (lo, hi, k)
            self.done += 1


class Tallies:
    """The tallies of one member's run of one (round, phase): one per result as a sender sends it.

    ``flat``: our whole vector (``bounds`` cut it into the parts, ``me`` is ours); ``own``: our share of our part;
    ``chunk``: the values per chunk we stream our parts in; ``honest``: what we send is ``flat`` through the
    codec (no fault injected), so our contributions can be sketched as the results come."""

    def __init__(self, *, run: str, key: str, phase: int, me: int, members: Sequence[str],
                 bounds: Sequence[tuple[int, int]], codec: Codec, flat: torch.Tensor, own: torch.Tensor, chunk: int,
                 honest: bool) -> None:
        self.run, self.key, self.phase, self.me, self.members = run, key, phase, me, list(members)
        self.bounds, self.codec, self.flat, self.own, self.chunk, self.honest = bounds, codec, flat, own, chunk, honest
        self._tallies: dict[tuple[int, str], ChunkTally] = {}
        self._sending: dict[int, list[bytes]] = {}  # part -> the payloads of our share of it, as they are sent

    def sending(self, part: int, pieces: list[bytes]) -> None:
        """The list our share of ``part`` is encoded into, chunk by chunk as it is sent: its owner averages chunk
        ``c`` only once our chunk ``c`` is in, so the list holds it by the time that chunk's result arrives."""
        self._sending[part] = pieces

    def make(self, part: int, sender: str, res: dict[str, Any], numel: int) -> ChunkTally | None:
        """A tally for a result of ``part`` from ``sender`` about to arrive (None if it does not fit the round)."""
        if not 0 <= part < len(self.members) or numel != self.bounds[part][1] - self.bounds[part][0]:
            return None
        tally = ChunkTally(run=self.run, key=self.key, phase=self.phase, part=part, sender=sender, res=res,
                           numel=numel, codec=self.codec, judge=part != self.me, mine=self._mine(part, res, numel))
        self._tallies[(part, sender)] = tally
        return tally

    def of(self, part: int, res: Mapping[str, Any]) -> ChunkTally | None:
        """The tally of ``res`` (the result of ``part`` a member holds), if every chunk of it came through one."""
        sender = str(res.get("_from", self.members[part]))
        tally = self._tallies.get((part, sender))
        return tally if tally is not None and tally.matches(sender, res) else None

    def _mine(self, part: int, res: Mapping[str, Any], numel: int) -> Mine | None:
        """Our contribution to ``part`` chunk by chunk, as its owner decoded it, if we know it in the result's
        chunks: our own share of our part as it is; our share of another's part as we sent it, when we sent it in
        the chunks the result comes in (fp32: the values themselves; else our own payload of that chunk, decoded:
        not encoded a second time)."""
        if part == self.me:
            own = self.own
            return lambda c, lo, hi: own[lo:hi]
        if not self.honest:
            return None
        sent = chunk_bounds(numel, self.chunk) if numel > self.chunk else [(0, numel)] if numel else []
        if result_bounds(res, numel) != sent:
            return None
        a, codec, flat = self.bounds[part][0], self.codec, self.flat
        if codec.name == "fp32":
            return lambda c, lo, hi: flat[a + lo : a + hi]
        pieces = self._sending.get(part)
        if pieces is None:
            return None

        def mine(c: int, lo: int, hi: int) -> torch.Tensor | None:
            piece = pieces[c] if c < len(pieces) else None  # (a retried send refills the list from the start)
            return None if piece is None or len(piece) != codec.encoded_size(hi - lo) else codec.decode(piece, hi - lo)

        return mine
