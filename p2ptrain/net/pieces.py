"""How a payload is cut into pieces and hashed (net/claims.py's commitments name the result): a contributor signs
the Merkle root of its pieces' digests (:func:`root`; BLAKE3, net/digest.py), so that the owner can show one piece
with its path and an auditor check it against the signature alone (claims.Slice). A payload whose bytes are its
values in order (fp32, fp16, bf16, an owner's raw share) is hashed in pieces of :func:`audit_grain` values from each
chunk's start; a codec with block headers first, in its chunks. Results are hashed in their chunks
(:func:`payload_shas`), as they arrive.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ..collective.butterfly import MIN_CHUNK, chunk_bounds
from ..collective.codec_base import Codec
from ..collective.codecs import get_codec
from .digest import digest, hasher
from .merkle import merkle_root

__all__ = [
    "AUDIT_GRAIN",
    "MIN_GRAIN",
    "RAW",
    "GridShas",
    "audit_grain",
    "byte_range",
    "check_shown",
    "chunk_shas",
    "codec_of",
    "contribution_shas",
    "grid_size",
    "hash_grid",
    "payload_sha",
    "payload_shas",
    "piece_bounds",
    "raw_bytes",
    "raw_shas",
    "root",
]

#: The codec name of an owner's own share of its part: float32 values as they are (never encoded).
RAW = "raw"
#: Values per random audit's slice (net/audit.py), and per hashed piece of an owner's raw share, for a part of 1 Mi
#: values and more (:func:`audit_grain`: a smaller part's grain is smaller): a multiple of every codec's block (1024),
#: so that a slice's average goes through the codec as it does inside its chunk. An audit fetches the slice of the raw
#: share (32 kB: its pieces start at each chunk's start, as the audits' slices do; with its Merkle path) and the chunk
#: of each other contribution that covers it. 8 Ki values: a lie spread over a fraction f of a part's values is in a
#: slice with probability 1 − (1 − f)^8192 (0.9997 for f = 0.1%), one in a contiguous run with about f (as at any
#: grain); the slice of 32 Ki values it was cost 4× the bytes (6% of the wire of a 4-bit round of the small preset
#: between 2 regions, bench/results/README.md).
AUDIT_GRAIN = 1 << 13
#: The smallest grain (a small part's): one codec block.
MIN_GRAIN = 1 << 10
#: Pieces a part of fewer than AUDIT_GRAIN × GRAIN_PIECES values is cut into at least (see :func:`audit_grain`).
GRAIN_PIECES = 128


def audit_grain(numel: int) -> int:
    """Values per audited slice and hashed piece of a part of ``numel`` values: AUDIT_GRAIN for a part of 1 Mi values
    and more, else the power of two that cuts it into GRAIN_PIECES pieces at least, MIN_GRAIN at the least. Why: an
    audit's slice is fetched after the result is whole, on every member's critical path, and a small round has no
    bulk to hide it behind: 2 peers × 1 MB on 100 Mbit/s links (bench/results/README.md, issue 18), 32 kB slices
    took 3–12 ms to come and the round 0.77 of the link, 4 kB ones 2–3 ms and 0.855 (without audits 0.859). The
    catch probability per slice does not depend on the grain (see AUDIT_GRAIN); a large part keeps 8 Ki values,
    whose Merkle tree over a 1B model's fragment stays at tens of thousands of leaves. Every member derives the same
    grain from the part's size alone."""
    grain = AUDIT_GRAIN
    while grain > MIN_GRAIN and grain * GRAIN_PIECES > numel:
        grain //= 2
    return grain


def raw_bytes(t: torch.Tensor) -> bytes:
    """A raw share's payload: its float32 values, little-endian (the fp32 codec's layout)."""
    return get_codec("fp32").encode(t)


def raw_shas(t: torch.Tensor, chunk: int | None) -> list[bytes]:
    """The digest of each piece (:func:`hash_grid`) of :func:`raw_bytes` of ``t``, without copying ``t`` on a
    little-endian host; a large share in two threads (hashlib lets go of the GIL): it is hashed before our first
    part leaves (net/allreduce.py): 35–60 ms for a 32 MB share on one core with SHA-256, about a quarter of that now."""
    bounds = hash_grid(t.numel(), RAW, chunk)
    if sys.byteorder != "little":
        data = raw_bytes(t)
        return [digest(data[4 * a : 4 * b]) for a, b in bounds]
    view = memoryview(t.detach().float().contiguous().cpu().numpy().data).cast("B")
    return _in_two(lambda part: [digest(view[4 * a : 4 * b]) for a, b in part], bounds,
                   4 * t.numel())


#: Bytes below which hashing stays in one thread (a thread's start costs more than it saves).
PARALLEL_BYTES = 4 << 20


def _in_two(hash_all: Callable[[list[tuple[int, int]]], list[bytes]], bounds: list[tuple[int, int]],
            size: int) -> list[bytes]:
    """``hash_all(bounds)``, its second half in a worker thread of its own for ``size`` bytes of at least
    PARALLEL_BYTES (the pool closes before it returns: nothing outlives the call)."""
    if size < PARALLEL_BYTES or len(bounds) < 2:
        return hash_all(bounds)
    half = len(bounds) // 2
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="p2ptrain-hash") as pool:
        tail = pool.submit(hash_all, bounds[half:])
        return hash_all(bounds[:half]) + tail.result()


def chunk_shas(data: bytes, numel: int, codec: str | Codec, grain: int) -> list[bytes]:
    """The :func:`hash_grid` pieces' digests of one chunk's payload of ``numel`` values, in pieces of ``grain`` (the
    whole payload's :func:`audit_grain`): a chunked payload's :func:`contribution_shas` are its chunks' in order
    (every grid starts again at each chunk's start)."""
    return contribution_shas([data], numel, codec, None, grain=grain)


class GridShas:
    """A contribution's :func:`contribution_shas`, made chunk by chunk as its payload passes (:meth:`add` in the
    worker thread that encodes or decodes each chunk), so that signing it or checking its signature at the end
    does not hash it all again: 60 ms of a 32 MB share, on the event loop, once its last chunk was sent."""

    def __init__(self, codec: str | Codec, numel: int, chunk: int | None) -> None:
        self.codec = codec_of(codec)
        self.bounds = piece_bounds(numel, chunk)
        self.grain = audit_grain(numel)
        self.per: list[list[bytes] | None] = [None] * len(self.bounds)

    def reset(self) -> None:
        self.per = [None] * len(self.bounds)

    def add(self, i: int, data: bytes) -> None:
        """Chunk ``i``'s payload (one that does not fit its chunk leaves a hole: :meth:`shas` is then None)."""
        if 0 <= i < len(self.bounds):
            a, b = self.bounds[i]
            if len(data) == self.codec.encoded_size(b - a):
                self.per[i] = chunk_shas(data, b - a, self.codec, self.grain)

    def shas(self) -> list[bytes] | None:
        """Every piece's digest, if every chunk was added; None if one is missing."""
        if any(p is None for p in self.per):
            return None
        return [sha for per in self.per for sha in per or ()]


def _chunk_of(chunk: int | None) -> int | None:
    """``chunk`` if it cuts a payload into chunks (a positive int), else None: the payload is one piece."""
    return chunk if isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 0 else None


def piece_bounds(numel: int, chunk: int | None) -> list[tuple[int, int]]:
    """The chunks a payload of ``numel`` values is cut into (one, when it is not chunked)."""
    if (c := _chunk_of(chunk)) is not None:
        return chunk_bounds(numel, c)
    return [(0, numel)] if numel else []


def codec_of(name: str | Codec) -> Codec:
    """A payload's codec (a raw share has fp32's layout); ValueError for an unknown name."""
    if not isinstance(name, str):
        return name
    return get_codec("fp32" if name == RAW else name)


def hash_grid(numel: int, codec: str | Codec, chunk: int | None) -> list[tuple[int, int]]:
    """The pieces a contribution's payload is hashed in (what an audit's slice fetches at least): for a codec whose
    payload is its values' bytes in order (any range of values is a range of bytes: fp32, a raw share), pieces of
    :func:`audit_grain` values from each chunk's start (the last of a chunk shorter), the grid an audit draws its
    slices on (net/audit.py), so that a slice is one piece; its chunks otherwise (a chunk's block headers come
    first)."""
    return _grid(numel, codec_of(codec), chunk, audit_grain(numel))


def _grid(numel: int, codec: Codec, chunk: int | None, grain: int) -> list[tuple[int, int]]:
    if codec.value_bytes:
        return [(s, min(s + grain, b)) for a, b in piece_bounds(numel, chunk) for s in range(a, b, grain)]
    return piece_bounds(numel, chunk)


def grid_size(numel: int, codec: str | Codec, chunk: int | None) -> int:
    """How many pieces :func:`hash_grid` cuts ``numel`` values into (without making them)."""
    c = _chunk_of(chunk)
    if not codec_of(codec).value_bytes:
        return (-(-numel // c) if c else 1) if numel else 0
    grain = audit_grain(numel)
    if c is None:
        return -(-numel // grain)
    full, rest = divmod(numel, c)
    return full * -(-c // grain) + -(-rest // grain)


def _hash_pieces(pieces: Sequence[bytes], sizes: Sequence[int]) -> list[bytes]:
    """The digests of consecutive byte ranges of ``sizes`` across ``pieces`` (never joined); [] if they do not fit."""
    if [len(p) for p in pieces] == list(sizes):
        return [digest(p) for p in pieces]
    if sum(len(p) for p in pieces) != sum(sizes):
        return []
    out, it, cur = [], iter(pieces), memoryview(b"")
    for n in sizes:
        h = hasher()
        while n:
            while not cur:
                cur = memoryview(next(it))
            take = cur[:n]
            h.update(take)
            n -= len(take)
            cur = cur[len(take):]
        out.append(h.digest())
    return out


def byte_range(pieces: Sequence[bytes], start: int, end: int) -> bytes:
    """Bytes ``start:end`` of the concatenation of ``pieces`` (only the pieces they fall in are copied)."""
    out, at = [], 0
    for p in pieces:
        lo, hi = max(start, at), min(end, at + len(p))
        if lo < hi:
            out.append(memoryview(p)[lo - at : hi - at])
        at += len(p)
        if at >= end:
            break
    return b"".join(out)


def payload_shas(pieces: Sequence[bytes], numel: int, codec: str | Codec, chunk: int | None) -> list[bytes]:
    """The digest of each chunk's payload of ``numel`` values encoded by ``codec`` in chunks of ``chunk`` values,
    however the payload came (chunk by chunk, or joined into one); [] if it does not fit its chunks."""
    c = codec_of(codec)
    return _hash_pieces(pieces, [c.encoded_size(b - a) for a, b in piece_bounds(numel, chunk)])


def contribution_shas(pieces: Sequence[bytes], numel: int, codec: str | Codec, chunk: int | None, *,
                      grain: int | None = None) -> list[bytes]:
    """The digest of each piece (:func:`hash_grid`) of a contribution's payload; [] if it does not fit. ``grain``:
    the pieces' size when ``numel`` is a chunk's, not the part's (default: the part's :func:`audit_grain`)."""
    c = codec_of(codec)
    grid = _grid(numel, c, chunk, audit_grain(numel) if grain is None else grain)
    return _hash_pieces(pieces, [c.encoded_size(b - a) for a, b in grid])


def root(shas: Sequence[bytes]) -> bytes:
    """What a commitment names of a payload: the Merkle root of its pieces' digests (net/merkle.py), so that one
    piece can be shown with a path of log2(n) hashes."""
    return merkle_root(shas)


def payload_sha(pieces: Sequence[bytes], numel: int, codec: str | Codec, chunk: int | None) -> bytes:
    """The hash a contributor signs of its payload (:func:`root` of :func:`contribution_shas`)."""
    return root(contribution_shas(pieces, numel, codec, chunk))


def check_shown(chunk: Any, numel: Any, expect: int | None, most: int, codec: str) -> None:
    """Refuse (ValueError) a shown contribution's size and chunking that no honest member sends (another size than
    ``expect`` values, if given; more than ``most`` chunks): hashing it would cost what its sender chose."""
    if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0 or (expect is not None and numel != expect):
        raise ValueError(f"a contribution of {numel!r} values to a part of {expect} values")
    if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < MIN_CHUNK):
        raise ValueError(f"chunk of {chunk!r} values")
    if grid_size(numel, codec, chunk) > most:
        raise ValueError(f"{numel} values in pieces of {chunk}: more pieces than were shown")
