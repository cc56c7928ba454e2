"""Streaming a part of the all-reduce in chunks: encode ahead while sending, decode while receiving.

A part larger than ``chunk`` values travels as one message header followed by one frame per chunk
(:func:`p2ptrain.collective.butterfly.chunk_bounds`), each chunk encoded on its own; its payload is the
concatenation of the chunks' payloads. The sender encodes the next chunk in a worker thread while the
previous one is on the wire (:func:`encode_ahead`); an owner sending its averaged part to every member
encodes it once for all of them (:class:`EncodedStream`); a receiver decodes each chunk as it arrives
(:func:`receive_chunks`) and refuses a stream that does not match its header (:class:`Refused`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any

import torch

from ..collective.butterfly import MIN_CHUNK, chunk_bounds
from ..collective.codecs import Codec
from .transport import RoundFailed

__all__ = ["EncodedStream", "Progress", "Refused", "Slot", "chunked_size", "decode_chunked", "encode_ahead", "receive_chunks"]



#: Told of each chunk as it is decoded, in the worker thread: (chunk index, its payload, its decoded values).
OnChunk = Callable[[int, bytes, torch.Tensor], None]


def decode_into(codec: Codec, data: bytes, out: torch.Tensor, on_chunk: OnChunk | None = None, index: int = 0) -> None:
    """Decode ``data`` into ``out`` (a 1-D float32 view), in the caller's thread: run it in a worker, so that the
    copy of a 1 MB chunk does not hold the event loop (ValueError as ``codec.decode``); then tell ``on_chunk``."""
    codec.decode_into(data, out)
    if on_chunk is not None:
        on_chunk(index, data, out)


class Slot:
    """Where a streamed result decodes to: its part's range of the all-reduce's output, so that no buffer of its own
    is made and copied at the assembly (net/allreduce.py). The run closes it before it assembles: a chunk's decode
    still in its worker thread then (a stream cut off mid-round) finishes first, and none writes after it: the
    stream decodes the rest into a buffer of its own."""

    def __init__(self, view: torch.Tensor) -> None:
        self.view = view
        self._lock = threading.Lock()
        self._open = True

    def write(self, codec: Codec, data: bytes, a: int, b: int, on_chunk: OnChunk | None, index: int) -> bool:
        """Decode chunk ``index`` (values ``a:b``) into the view, in the caller's (worker) thread; False, writing
        nothing, once the slot is closed."""
        with self._lock:
            if not self._open:
                return False
            decode_into(codec, data, self.view[a:b], on_chunk, index)
            return True

    def close(self) -> None:
        """No write after this returns (it waits for one in progress: a chunk's decode, a millisecond or so)."""
        with self._lock:
            self._open = False

class Refused(ValueError):
    """A streamed payload that does not fit what its header announced (the sender gets a strike)."""


def chunked_size(codec: Codec, numel: int, chunk: Any) -> int:
    """Payload bytes of ``numel`` values: one payload (``chunk`` None) or concatenated chunks' payloads.
    Refused if ``chunk`` is not a whole number of at least MIN_CHUNK values."""
    if chunk is None:
        return codec.encoded_size(numel)
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < MIN_CHUNK:
        raise Refused(f"chunk of {chunk!r} values")
    return sum(codec.encoded_size(b - a) for a, b in chunk_bounds(numel, chunk))


def decode_chunked(codec: Codec, data: bytes, numel: int, chunk: int | None) -> torch.Tensor:
    """Decode a whole payload (ValueError on a bad one), chunk by chunk if it was encoded so."""
    if chunk is None:
        return codec.decode(data, numel)
    out, pos = torch.empty(numel, dtype=torch.float32), 0
    view = memoryview(data)
    for a, b in chunk_bounds(numel, chunk):
        n = codec.encoded_size(b - a)
        out[a:b] = codec.decode(view[pos:pos + n], b - a)
        pos += n
    return out


def _encode(codec: Codec, x: torch.Tensor, on_encoded: Callable[[int, bytes], None] | None, index: int) -> bytes:
    data = codec.encode(x)
    if on_encoded is not None:
        on_encoded(index, data)
    return data


async def encode_ahead(codec: Codec, x: torch.Tensor, bounds: list[tuple[int, int]],
                       on_encoded: Callable[[int, bytes], None] | None = None) -> AsyncGenerator[bytes, None]:
    """The payloads of ``x``'s chunks in order, each encoded in a worker thread while the previous one is sent
    (``on_encoded(index, payload)`` runs in that thread too, after each: e.g. hashing it, net/pieces.GridShas).

    Close it (``contextlib.aclosing``) when stopping early: the encoding ahead is then abandoned, and
    nothing in the event loop waits for it (its thread finishes one chunk on its own). Errors of the
    codec (ValueError for values it cannot encode) are raised to the reader.
    """
    if not bounds:
        return
    loop = asyncio.get_running_loop()

    def start(i: int) -> asyncio.Future[bytes]:
        a, b = bounds[i]
        # A plain executor future, not a task: closing this generator cancels it, and nothing is left.
        return loop.run_in_executor(None, _encode, codec, x[a:b], on_encoded, i)

    nxt = start(0)
    try:
        for i in range(len(bounds)):
            data = await nxt
            if i + 1 < len(bounds):
                nxt = start(i + 1)
            yield data
    finally:
        nxt.cancel()


class EncodedStream:
    """One tensor encoded chunk by chunk, once, for several readers: each reader (:meth:`chunks`) gets the
    payloads in order as soon as they are encoded, while :meth:`produce` goes on.

    The producer also decodes every payload into :attr:`decoded`: every member, the owner included, uses
    the decoded values, so that lossy codecs agree everywhere.
    """

    def __init__(self, codec: Codec, x: torch.Tensor, chunk: int, decoded: torch.Tensor | None = None) -> None:
        self.codec, self.x = codec, x
        self.bounds = chunk_bounds(x.numel(), chunk)
        self.payloads: list[bytes] = []
        # ``decoded``: where the decoded values go (a range of the run's output), else a buffer of their own
        self.decoded = torch.empty(x.numel(), dtype=torch.float32) if decoded is None else decoded
        self.failed: BaseException | None = None
        self.on_chunk: OnChunk | None = None  # told of each chunk once decoded (verification's tallies)
        self._stopped = False  # the producer returned, failed or was cancelled
        self._tick = asyncio.Event()

    def _wake(self) -> None:
        # Every reader waits on the event of its time; a new one for the next wait, so none misses a wake.
        self._tick.set()
        self._tick = asyncio.Event()

    async def produce(self) -> None:
        """Encode and decode every chunk, waking the readers at each. If it fails or is cancelled, the
        readers get RoundFailed and the error (or the cancellation) is raised here."""
        try:
            await self._fill()
        except BaseException as e:
            self.failed = e
            raise
        finally:
            self._stopped = True
            self._wake()

    async def _fill(self) -> None:
        """Append every chunk's payload to :attr:`payloads` (waking the readers) and its values to :attr:`decoded`."""
        async with aclosing(encode_ahead(self.codec, self.x, self.bounds)) as chunks:
            async for data in chunks:
                a, b = self.bounds[len(self.payloads)]
                self.payloads.append(data)
                self._wake()
                await asyncio.to_thread(decode_into, self.codec, data, self.decoded[a:b], self.on_chunk,
                                        len(self.payloads) - 1)

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """The payloads in order, each as soon as it is encoded. RoundFailed if the producer stopped first.
        Not bounded in time by itself: the reader's own call timeout bounds it."""
        i = 0
        while i < len(self.bounds):
            if i < len(self.payloads):
                yield self.payloads[i]
                i += 1
            elif self._stopped:
                raise RoundFailed(f"encoding our part failed: {self.failed!r}")
            else:
                await self._tick.wait()


class Progress:
    """How much of a streamed payload has arrived, for a reader that uses it before it is whole (the owner's
    pipelined mean, net/pipelined.py): ``values`` fills from the front, ``ready`` values of it decoded;
    ``failed`` once the stream broke or was refused. ``tick()`` runs after every change."""

    def __init__(self, numel: int, tick: Callable[[], None]) -> None:
        self.values = torch.empty(numel, dtype=torch.float32)
        self.ready, self.failed, self.tick = 0, False, tick


async def receive_chunks(msg: dict[str, Any], codec: Codec, numel: int, progress: Progress | None = None,
                         on_chunk: OnChunk | None = None, *, keep: bool = True,
                         into: Slot | None = None) -> tuple[torch.Tensor, list[bytes]]:
    """Decode a streamed payload chunk by chunk as it arrives: (values, the chunks' payloads; [] unless ``keep``).

    ``msg`` is the header (``chunk``, ``chunks``) with an async generator of the chunk frames' payloads in
    ``_frames`` (each read bounded in size and time by the stream layer). Refused if the chunking or a chunk's size does
    not match the header, or a chunk does not decode; the frames are closed either way. ``progress`` (if any)
    receives the values as they are decoded, and is marked failed if the stream does not end whole; ``into`` (if
    any, and no ``progress``): where they are decoded (:class:`Slot`). ``keep``: whether the payloads are kept (a
    plain contribution's are not: its values are all the owner uses).
    """
    try:
        chunk, count, frames = msg["chunk"], msg["chunks"], msg.get("_frames")
        chunked_size(codec, numel, chunk)  # Refused for a bad chunk size
        bounds = chunk_bounds(numel, chunk)
        if frames is None or count != len(bounds):
            raise Refused(f"{count!r} chunks announced for {numel} values in chunks of {chunk}")
        if into is not None and (progress is not None or into.view.numel() != numel or not keep):
            raise ValueError("a slot takes a whole result of its size, its payloads kept")
        return await _receive(frames, codec, numel, bounds, progress, on_chunk, keep, into)
    except BaseException:
        if progress is not None:
            progress.failed = True
            progress.tick()
        raise


async def _receive(frames: AsyncGenerator[bytes, None], codec: Codec, numel: int, bounds: list[tuple[int, int]],
                   progress: Progress | None, on_chunk: OnChunk | None, keep: bool,
                   into: Slot | None) -> tuple[torch.Tensor, list[bytes]]:
    if progress is not None:
        out = progress.values
    elif into is not None:
        out = into.view
    else:
        out = torch.empty(numel, dtype=torch.float32)
    pieces: list[bytes] = []
    got = 0
    async with aclosing(frames) as it:
        async for data in it:
            a, b = bounds[got]
            if len(data) != codec.encoded_size(b - a):
                raise Refused(f"chunk {got} of {len(data)} bytes for {b - a} values")
            try:
                if into is None:
                    await asyncio.to_thread(decode_into, codec, data, out[a:b], on_chunk, got)
                elif not await asyncio.to_thread(into.write, codec, data, a, b, on_chunk, got):
                    # The slot closed (our run assembled without this result): the rest goes to a buffer of its own,
                    # the chunks before it decoded there again (rare: a result later than its run).
                    out, into = torch.empty(numel, dtype=torch.float32), None
                    for i, piece in enumerate(pieces):
                        await asyncio.to_thread(decode_into, codec, piece, out[bounds[i][0]:bounds[i][1]])
                    await asyncio.to_thread(decode_into, codec, data, out[a:b], on_chunk, got)
            except ValueError as e:
                raise Refused(f"undecodable chunk {got} ({e})") from None
            got += 1
            if keep:
                pieces.append(data)
            if progress is not None:
                progress.ready = b
                progress.tick()
            if got == len(bounds):
                break
    if got != len(bounds):
        raise Refused(f"{got} of {len(bounds)} chunks arrived")
    return out, pieces

