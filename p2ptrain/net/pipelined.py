"""An owner's plain mean of its part, chunk by chunk as the contributions arrive: :class:`PipelinedMean`.

Without it an owner waits for every contribution to its part to be whole, averages, and only then starts
sending the average back: the all-gather waits for the slowest contribution's last byte, and the link
idles between the two phases. With it, the contributors are fixed from the parts' headers (which arrive
first), and chunk ``[a, b)`` of the average is computed and sent as soon as every contributor's stream
has delivered its values up to ``b``, while later chunks still arrive.

Only for the plain weighted mean with no norm bound: it is coordinate-wise, so a chunk's mean is final
once its coordinates are in, and it is computed exactly as the whole part's (collective/aggregate.py,
the contributors in sorted order), so a member that checks the result (net/verify.py) recomputes the same
values. Robust rules and the norm bound need whole contributions and keep the whole-part path.

The last chunk is produced only once every contribution is whole and filed (with verified aggregation:
signed by its contributor), so no member can hold a complete average that used a contribution the owner
cannot show. If a contributor's stream breaks, is refused, or stalls past the deadline, :meth:`produce`
raises :class:`Unpipelined`: the owner abandons the streams of this average (a member never files an
incomplete one) and falls back to the whole-part path with the contributions that did arrive whole.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..collective.aggregate import weighted_mean
from ..collective.butterfly import chunk_bounds
from ..collective.codecs import Codec
from .chunks import EncodedStream, Progress
from .mailbox import Mailbox

__all__ = ["PipelinedMean", "Source", "Unpipelined"]


class Unpipelined(RuntimeError):
    """A contribution did not arrive whole and valid in time: fall back to whole parts."""


@dataclass(frozen=True)
class Source:
    """One contribution to the mean: its values as they arrive, and its weight."""

    member: str
    progress: Progress
    weight: float


def whole(values: torch.Tensor) -> Progress:
    """A contribution already whole (the owner's own share, or one sent in one message)."""
    p = Progress(0, lambda: None)
    p.values, p.ready = values, values.numel()
    return p


class PipelinedMean(EncodedStream):
    """The weighted mean of ``sources`` (sorted by member, as Guard.aggregate sums them), encoded chunk by
    chunk into :attr:`payloads` as each chunk's coordinates are in, for several readers (:meth:`chunks`).

    ``box``: the mailbox the contributions arrive in (its ``poke`` wakes the producer); ``filed``: the
    contributions whole and filed, by member (``box.contribs``); ``deadline`` (monotonic): when to give up;
    ``decoded``: where the average's decoded values go (the run's output), else a buffer of their own.
    """

    def __init__(self, codec: Codec, numel: int, chunk: int, sources: Sequence[Source], box: Mailbox,
                 filed: Mapping[str, object], deadline: float, decoded: torch.Tensor | None = None) -> None:
        super().__init__(codec, torch.empty(0), chunk)
        self.bounds = chunk_bounds(numel, chunk)
        self.decoded = torch.empty(numel, dtype=torch.float32) if decoded is None else decoded
        self.sources = sorted(sources, key=lambda s: s.member)
        self.box, self.filed, self.deadline = box, filed, deadline

    def _broken(self) -> str | None:
        bad = [s.member for s in self.sources if s.progress.failed]
        return f"the contribution of {', '.join(m[-8:] for m in bad)} broke off" if bad else None

    async def _until(self, ready: int, last: bool) -> None:
        def arrived() -> bool:
            if self._broken() is not None:
                return True
            if last:
                return all(s.member in self.filed for s in self.sources)
            return all(s.progress.ready >= ready for s in self.sources)

        if not await self.box.wait_until(arrived, self.deadline):
            late = [s.member[-8:] for s in self.sources if s.progress.ready < ready or s.member not in self.filed]
            raise Unpipelined(f"the contributions of {', '.join(late)} were not in by the deadline")
        if (reason := self._broken()) is not None:
            raise Unpipelined(reason)

    def _chunk(self, i: int, a: int, b: int) -> bytes:
        """Average, encode and decode chunk ``i`` into :attr:`decoded` (in a worker thread: the copies of a 1 MB
        chunk do not hold the event loop), and tell :attr:`on_chunk`."""
        avg = weighted_mean([s.progress.values[a:b] for s in self.sources], [s.weight for s in self.sources])
        data = self.codec.encode(avg)
        self.decoded[a:b] = self.codec.decode(data, b - a)
        if self.on_chunk is not None:
            self.on_chunk(i, data, self.decoded[a:b])
        return data

    async def _fill(self) -> None:
        """Average, encode and decode every chunk as its coordinates arrive (:meth:`produce` wakes the readers
        at each). Unpipelined if a contribution breaks off or is late; the readers then get RoundFailed."""
        for i, (a, b) in enumerate(self.bounds):
            await self._until(b, last=i == len(self.bounds) - 1)
            data = await asyncio.to_thread(self._chunk, i, a, b)
            self.payloads.append(data)
            self._wake()
