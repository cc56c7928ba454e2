"""Splitting a member's tensors into the butterfly's parts and assembling the averaged parts again (pure).

The flat vector of every member's tensors is cut into one contiguous part per member
(:func:`p2ptrain.collective.butterfly.part_bounds`). An owner averages the contributions to its part
that fit (:func:`select_contributions`); every member then assembles the averaged parts it received
(:class:`Assembly`), after checking each (:func:`result_problem`). A part nobody could average is zero
on every survivor alike, and the result says it is partial.

A part averaged from no more than half of the group's members is left out too (zero, partial), on every
member that holds it alike (it depends only on the part's own result): a group cut in two mid-round would
otherwise apply two different averages, one on each side (each side's parts hold only its own side's
contributions), and fork θ. A side with no part of more than half the group applies nothing.
For the same reason a member that holds no more than half of the parts applies nothing (RoundFailed): cut
after the owners averaged, each side holds its own owners' parts. (A member that died leaves k − 1 of k.)
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..collective.codecs import Codec
from .chunks import Refused, chunked_size
from .groups import agreed_print, fingerprints_match, half_or_less, majority_fingerprint
from .guard import Guard
from .transport import Group, ReduceResult, RoundFailed

__all__ = ["Assembly", "Selection", "flatten", "group_tag", "payload_len", "result_problem", "select_contributions", "unflatten",
           "wire_result"]


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' values as one flat fp32 CPU vector (a lone fp32 CPU tensor is not copied: it is only read)."""
    if len(tensors) == 1:
        return tensors[0].detach().reshape(-1).float().cpu()
    return torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors]) if tensors else torch.zeros(0)


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` cut back into tensors of the shapes and devices of ``like``."""
    pieces, offset = [], 0
    for t in like:
        pieces.append(flat[offset : offset + t.numel()].view(t.shape).to(t.device))
        offset += t.numel()
    return pieces


@dataclass
class Selection:
    """The contributions to one part that an owner aggregates.

    ``use``: peer -> (values, weight) of the members whose fingerprint agrees with the majority;
    ``agree``: the members of that majority; ``dropped``: peer -> size of a contribution of another size.
    """

    use: dict[str, tuple[torch.Tensor, float]]
    agree: set[str]
    dropped: dict[str, int] = field(default_factory=dict)
    heard: set[str] = field(default_factory=set)  # every member whose contribution fits, voted out or not
    agreed: tuple[float, ...] | None = None  # the majority's fingerprint (None: nobody sent one)


def select_contributions(contribs: Mapping[str, tuple[int, torch.Tensor, float, Sequence[float] | None]],
                         members: Sequence[str], part: int, numel: int) -> Selection:
    """Only members' contributions to ``part``, of ``numel`` values, count; of those, the ones whose
    fingerprint of θ agrees with the majority's (all of them if nobody sent one)."""
    mine = {p: c for p, c in contribs.items() if p in members and c[0] == part}
    # Not a strike: members whose views of the round differ (e.g. two leaders chose different fragments
    # for one slot) send honest parts of other sizes. Dropped, never summed.
    dropped = {p: c[1].numel() for p, c in mine.items() if c[1].numel() != numel}
    fits = {p: c for p, c in mine.items() if p not in dropped}
    prints = {p: c[3] for p, c in fits.items() if c[3] is not None}
    agree = majority_fingerprint(prints) if prints else set(fits)
    use = {p: (fits[p][1], fits[p][2]) for p in sorted(fits) if p in agree}
    return Selection(use, agree, dropped, set(fits), agreed_print(prints, agree))


def payload_len(res: Mapping[str, Any]) -> int:
    """Bytes of a stored result's payload (its chunks' payloads if it was streamed)."""
    pieces = res.get("_pieces")
    if pieces is not None:
        return sum(len(p) for p in pieces)
    data = res.get("data")
    return len(data) if isinstance(data, bytes) else 0


def wire_result(res: Mapping[str, Any]) -> dict[str, Any]:
    """A stored result as one message (a streamed one with its chunks' payloads joined), for relaying."""
    out = {k: v for k, v in res.items() if not k.startswith("_")}
    if res.get("_pieces") is not None:
        out["data"] = b"".join(res["_pieces"])
    out.pop("chunks", None)
    return out


def group_tag(members: Sequence[str]) -> str:
    """A short digest of a group's members, sent with each part's result: a member whose group under the same round
    key is another one (its view went stale, e.g. a peer frozen mid-round and thawed) tells an owner's honest result
    for the other group from a lie about who contributed."""
    return hashlib.sha256("\n".join(sorted(members)).encode()).hexdigest()[:16]


def result_problem(res: Mapping[str, Any], part: int, numel: int, codec: Codec, members: Sequence[str],
                   me: str) -> tuple[str, bool] | None:
    """Why the stored result of ``part`` (``numel`` values) cannot be used, and whether that is its owner's
    fault (a strike); None if it can be decoded and used."""
    if res.get("_from", me) not in members:
        return "a result from outside the group is never used", False
    tag = res.get("group")
    if tag is not None and not isinstance(tag, str):
        return f"averaged part {part} is malformed", True
    if tag is not None and tag != group_tag(members):
        return "an owner whose group differs from ours", False  # honest: another group formed under the key
    if res.get("numel") != numel or res.get("codec") != codec.name:
        return "an owner whose view of the round differs", False  # honest (see select_contributions)
    data, decoded = res.get("data"), res.get("_tensor")
    try:
        size = chunked_size(codec, numel, res.get("chunk"))
    except Refused:
        size = -1
    if ((decoded is None and (not isinstance(data, bytes) or len(data) != size))
            or (decoded is not None and decoded.numel() != numel)
            or not isinstance(res.get("contributors"), list) or not isinstance(res.get("agree"), list)
            or Guard.bad_weight(res.get("total")) is not None or print_problem(res.get("print"))):
        return f"averaged part {part} is malformed", True
    return None


#: Most values a fingerprint may have on the wire (``sync.fingerprint`` sends 16).
MAX_PRINT = 256


def print_problem(value: Any) -> bool:
    """Whether a result's ``print`` (the majority's fingerprint, optional) is malformed."""
    if value is None:
        return False
    return (not isinstance(value, list) or len(value) > MAX_PRINT
            or not all(isinstance(v, float | int) and not isinstance(v, bool) and math.isfinite(v) for v in value))


def gaps(held: Sequence[tuple[int, int]], numel: int) -> tuple[tuple[int, int], ...]:
    """The [lo, hi) ranges of ``[0, numel)`` that no range of ``held`` covers, in order (merged)."""
    out, end = [], 0
    for lo, hi in sorted(held):
        if lo > end:
            out.append((end, lo))
        end = max(end, hi)
    if numel > end:
        out.append((end, numel))
    return tuple(out)


def union(ranges: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """``ranges`` sorted, empty ones dropped, and those that overlap or touch merged."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(r for r in ranges if r[1] > r[0]):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


class Assembly:
    """One member's average, assembled part by part from the owners' results.

    ``me`` is this member's index in ``members``; ``check_agree``: this member sent a fingerprint, so a
    result whose majority does not include it says this member's θ diverged.
    """

    def __init__(self, numel: int, members: Sequence[str], me: int, *, check_agree: bool,
                 fingerprint: Sequence[float] | None = None, out: torch.Tensor | None = None) -> None:
        self.members, self.me, self.check_agree = tuple(members), me, check_agree
        self.fp = None if fingerprint is None else tuple(float(v) for v in fingerprint)
        # ``out``: where to assemble (``numel`` float32 values), e.g. the buffer the results were decoded into as
        # they came (net/allreduce.py): a part already in place is not copied. Parts not used are zeroed in
        # result() (zeros of a 64 MB fragment cost ~90 ms of a loaded CPU for values that are all written over).
        if out is not None and (out.numel() != numel or out.dtype != torch.float32 or out.dim() != 1):
            raise ValueError(f"an output of {out.numel()} {out.dtype} values for {numel} float32 values")
        self.out = torch.empty(numel, dtype=torch.float32) if out is None else out
        self.filled: list[tuple[int, int]] = []
        self.mine: list[tuple[int, int]] = []  # the parts used whose average holds our share
        self.coverage: dict[str, int] = {}  # member -> values (of the parts used) that hold its share
        self.covered = 0  # values of the parts used
        self.partial, self.divergent = False, False
        self.total_weight, self.received = 0.0, 0
        self.minority = 0  # parts left out: averaged from no more than half of the group
        self.used = 0  # parts used
        self.prints: Counter[tuple[float, ...]] = Counter()  # the majority's fingerprint, as each part's owner saw it

    def skip(self) -> None:
        """A part is missing or unusable: it stays zero and the result is partial."""
        self.partial = True

    def add(self, part: int, lo: int, hi: int, values: torch.Tensor, res: Mapping[str, Any]) -> None:
        """Use the decoded, checked result ``res`` of ``part`` (``values`` at ``[lo, hi)``), unless no more than
        half of the group contributed to it (see the module docstring: then it is skipped)."""
        if part != self.me:
            self.received += payload_len(res)
        who = {str(p) for p in res["contributors"]} & set(self.members)
        # Who the owner heard from: a member voted out (its θ diverged) was reached, so it is not on the other side
        # of a cut; a tie between two versions of θ is then settled by the vote, not by failing every round.
        said = res.get("heard")
        heard = who | ({str(p) for p in said} & set(self.members) if isinstance(said, list) else set())
        if half_or_less(len(heard), len(self.members)):
            self.minority += 1
            self.skip()
            return
        if hi > lo and values.data_ptr() != self.out[lo:hi].data_ptr():  # (a result decoded in place is there)
            self.out[lo:hi] = values
        self.filled.append((lo, hi))
        self.used += 1
        size = max(1, hi - lo)  # an empty part (more members than values) still counts once
        self.covered += size
        for p in who:
            self.coverage[p] = self.coverage.get(p, 0) + size
        self.partial |= len(who) < len(self.members)
        me = self.members[self.me]
        if me in who:
            self.mine.append((lo, hi))
        if self.check_agree and me not in {str(p) for p in res["agree"]} and (
                me in heard or self.fp is None or not isinstance(res.get("print"), list | tuple)
                or print_problem(res["print"]) or not fingerprints_match(self.fp, res["print"])):
            # Voted out: the owner heard our share and left it out for our θ. A share that never reached the owner
            # (late, cut off) says nothing of our θ: only our fingerprint against the majority's print does. Taken
            # for a vote, a hierarchical carrier's share that missed one part's owner made its cell "outvoted": its
            # members repaired onto the θ they held and applied with their tokens sent again, while their cell's
            # mean was in the shard's other parts (churn_accounts, f2.L598606140: 232 k tokens counted twice).
            self.divergent = True
        # The largest total of the parts used, the same at every member that used the same parts (our own part's
        # total, as it was, differs between members when owners heard different contributors: a hierarchical
        # shard's carriers then put different totals in their offers' headers, and members refused the shard
        # as if a carrier had lied).
        self.total_weight = max(self.total_weight, float(res["total"]))
        if res.get("print") is not None:
            self.prints[tuple(float(v) for v in res["print"])] += 1

    def result(self, group: Group, phase: int, like: Sequence[torch.Tensor], *, sent: int,
               seconds: float) -> ReduceResult:
        """The phase's outcome, in tensors shaped like ``like``. RoundFailed if no part could be averaged.

        Its contributors are the members whose share is in more than half of the values averaged: parts may
        differ in who they hold (an owner that gave up on a late member, or a hostile owner that claims only
        itself), and one part must not empty the round's record of who took part."""
        if half_or_less(self.used, len(self.members)):
            raise RoundFailed(f"round {group.key} phase {phase}: only {self.used} of {len(self.members)} parts "
                              f"(half or less: the other side of a cut may hold the others)")
        for lo, hi in gaps(self.filled, self.out.numel()):  # a part left out is zero
            self.out[lo:hi] = 0.0
        contributors = {p for p, n in self.coverage.items() if 2 * n > self.covered}
        if not contributors:
            why = f" ({self.minority} averaged from half the group or less)" if self.minority else ""
            raise RoundFailed(f"round {group.key} phase {phase}: no part could be averaged{why}")
        return ReduceResult(unflatten(self.out, like), self.total_weight, group.members,
                            tuple(sorted(contributors)), partial=self.partial, bytes_sent=sent,
                            bytes_received=self.received, seconds=seconds, divergent=self.divergent,
                            agreed=min(self.prints, key=lambda p: (-self.prints[p], p)) if self.prints else None,
                            missing=gaps(self.mine, self.out.numel()))
