"""What verified aggregation sends (net/verify.py): signed commitments, evidence, claims and their wire form.

A contributor signs a *commitment* to each contribution it sends (run, round, phase, part, weight, size, codec,
chunking and the payload's hash, net/pieces.py: one piece can be shown and checked on its own) with the key behind
its peer id (net/identity.py); the part's owner keeps the payload and signature as :class:`Evidence` and shows all
of it (a dispute) or the pieces that cover a slice of the part (:class:`Slice`: a random audit). After the all-gather
each member sends its *claims* (:class:`Entry`, one per part it contributed to) in a check message. Sketches travel
as 32 little-endian float64 values.

Why it is long: every message verification sends is defined here with its checks on the way in (a field a liar
chose must cost the reader nothing it did not agree to: sizes, chunkings, path lengths), next to the commitments
they are checked against; how pieces are cut and hashed is in net/pieces.py and net/merkle.py.
"""
from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..collective.butterfly import MIN_CHUNK
from ..collective.codec_base import Codec, all_finite
from ..collective.codecs import get_codec
from ..collective.sketch import BUCKETS, Key, clipped, seed, sketch
from .chunks import decode_chunked
from .digest import digest as payload_digest
from .identity import Identity, verify_signature
from .merkle import MAX_DEPTH, MerkleTree, root_from_path
from .pieces import (
    AUDIT_GRAIN,
    RAW,
    byte_range,
    check_shown,
    codec_of,
    contribution_shas,
    grid_size,
    hash_grid,
    payload_shas,
    piece_bounds,
    raw_bytes,
    raw_shas,
)
from .transport import RoundFailed
from .wire import SCHEMA_ERRORS, encode_message

__all__ = [
    "INLINE_SLICE",
    "Entry",
    "Evidence",
    "Fetched",
    "Slice",
    "chunk_keys",
    "commitment",
    "entry_for",
    "fetch_evidence",
    "fetch_slice",
    "fetch_slices",
    "parse_checks",
    "result_bounds",
    "result_commitment",
    "result_digest",
    "result_header",
    "result_pieces",
    "result_shas",
    "sign_contribution",
    "sketch_bytes",
]

_SKETCH_BYTES = 8 * BUCKETS
#: Pieces a slice may show: an audit's slice lies inside one grain, which a contributor's smallest chunks cut in this many.
MAX_SHOWN = AUDIT_GRAIN // MIN_CHUNK + 1


def commitment(run: str, key: str, phase: int, part: int, weight: float, numel: int, codec: str,
               chunk: int | None, sha: bytes) -> bytes:
    """The bytes a contributor signs for its contribution to ``part`` (its payload's :func:`payload_sha` is
    ``sha``)."""
    return encode_message({"t": "p2ptrain/contribution/3", "run": run, "key": key, "phase": int(phase),
                           "part": int(part), "w": float(weight), "numel": int(numel), "codec": codec,
                           "chunk": chunk, "h": sha})


def result_commitment(run: str, key: str, phase: int, part: int, digest: bytes) -> bytes:
    """The bytes a part's owner signs for its result (its :func:`result_digest`): two different signed results of
    one part prove that the owner told members different things."""
    return encode_message({"t": "p2ptrain/result/1", "run": run, "key": key, "phase": int(phase), "part": int(part),
                           "d": digest})


def result_pieces(res: Mapping[str, Any]) -> list[bytes]:
    """A stored result's payload: its chunks' payloads (streamed), or its one payload."""
    pieces = res.get("_pieces")
    if pieces is not None:
        return list(pieces)
    data = res.get("data")
    return [data] if isinstance(data, bytes) else []


def result_header(res: Mapping[str, Any]) -> bytes:
    """SHA-256 of a result's header: what it says before its payload (its contributors and total among it)."""
    header = [res.get("key"), res.get("phase"), res.get("part"), res.get("numel"), res.get("codec"),
              res.get("chunk"), sorted(str(p) for p in res.get("contributors") or []), res.get("total"),
              res.get("tau", 0.0)]
    return hashlib.sha256(encode_message({"h": header})).digest()


def result_bounds(res: Mapping[str, Any], numel: int) -> list[tuple[int, int]]:
    """The chunks a result's payload is cut into (one, unless it names its ``chunk`` size)."""
    return piece_bounds(numel, res.get("chunk"))


def result_shas(res: Mapping[str, Any], numel: int, codec: Codec) -> list[bytes]:
    """The digest of each chunk's payload of a stored result, however it came (streamed chunk by chunk, or joined
    into one payload by a relay); [] if its payload does not fit its chunks (the checks refuse it anyway)."""
    return payload_shas(result_pieces(res), numel, codec, res.get("chunk"))


def result_digest(res: Mapping[str, Any], shas: Sequence[bytes]) -> bytes:
    """What a member's claims about one part name and its owner signs: the result's header and the hashes of its
    chunks' payloads (:func:`result_shas`)."""
    return hashlib.sha256(result_header(res) + b"".join(shas)).digest()


def chunk_keys(run: str, key: str, phase: int, part: int, res: Mapping[str, Any], shas: Sequence[bytes],
               numel: int) -> list[tuple[int, int, bytes]]:
    """The sketch key of a part (collective/sketch.py): per chunk of the result, a seed bound to the result's
    header and to that chunk's payload, which its owner chose before it could know the signs. Each chunk can then
    be sketched as it arrives."""
    head = result_header(res)
    return [(a, b, seed(run, key, phase, part, head, c, sha))
            for c, ((a, b), sha) in enumerate(zip(result_bounds(res, numel), shas, strict=True))]


def sketch_bytes(t: torch.Tensor) -> bytes:
    """A sketch on the wire: its float64 values, little-endian."""
    return struct.pack(f"<{BUCKETS}d", *t.tolist())


#: The most values of an audit's slice shown (by its owner) and checked (by an auditor of two or three contributors)
#: on the event loop: its pieces' bytes, paths and an aggregate of a few Ki values cost less there than a worker
#: thread's round trip under load (2 peers, 1 MB: a slice of 1 Ki values).
INLINE_SLICE = 1 << 14


@dataclass
class Evidence:
    """A member's signed contribution to a part, as the part's owner keeps it to show to whoever asks.

    ``pieces``: the payload as it came (a streamed one's chunk payloads; never joined until shown), or
    ``raw``: an owner's own share, kept as the float32 tensor it is (its bytes are made only when shown);
    ``shas``: its chunks' SHA-256s (computed once; from the bytes themselves for evidence from the wire)."""

    pieces: tuple[bytes, ...]
    weight: float
    numel: int
    codec: str  # a codec's name, or RAW
    chunk: int | None
    sig: bytes
    pk: bytes = b""  # an RSA signer's public key (an Ed25519 id holds its own)
    shas: list[bytes] = field(default_factory=list)
    raw: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not self.shas:
            self.shas = raw_shas(self.raw, self.chunk) if self.raw is not None else \
                contribution_shas(self.pieces, self.numel, self.codec, self.chunk)
        self._tree: MerkleTree | None = None

    @property
    def tree(self) -> MerkleTree:
        """The Merkle tree over its pieces, hashed once: an owner shows a slice of each contribution to every
        auditor of its part (8 members: 49 slices a round), and the commitment names its root."""
        if self._tree is None or self._tree.size != len(self.shas):
            self._tree = MerkleTree(self.shas)  # (two threads may hash it at once: the same tree)
        return self._tree

    @property
    def hashed(self) -> bool:
        """Whether its tree is hashed already (:attr:`tree` costs nothing more)."""
        return self._tree is not None and self._tree.size == len(self.shas)

    @property
    def sha(self) -> bytes:
        return self.tree.root

    @property
    def data(self) -> bytes:
        if self.raw is not None:
            return raw_bytes(self.raw)
        return self.pieces[0] if len(self.pieces) == 1 else b"".join(self.pieces)

    def commit(self, run: str, key: str, phase: int, part: int) -> bytes:
        return commitment(run, key, phase, part, self.weight, self.numel, self.codec, self.chunk, self.sha)

    def signed_by(self, peer: str, run: str, key: str, phase: int, part: int) -> bool:
        return verify_signature(peer, self.commit(run, key, phase, part), self.sig, self.pk)

    def values(self) -> torch.Tensor:
        """The contribution as its owner used it (ValueError if it does not decode)."""
        if self.raw is not None:
            return self.raw
        if self.codec == RAW:
            if len(self.data) != 4 * self.numel:
                raise ValueError(f"raw share of {len(self.data)} bytes for {self.numel} values")
            x = torch.frombuffer(bytearray(self.data), dtype=torch.float32).clone()
            if not all_finite(x):
                raise ValueError("raw share with non-finite values")
            return x
        return decode_chunked(get_codec(self.codec), self.data, self.numel, self.chunk)

    def to_wire(self) -> dict[str, Any]:
        return {"data": self.data, "w": self.weight, "numel": self.numel, "codec": self.codec, "chunk": self.chunk,
                "sig": self.sig, "pk": self.pk}

    def slice_wire(self, lo: int, hi: int) -> dict[str, Any]:
        """What shows values ``lo:hi`` of this contribution (:class:`Slice`): the pieces (:func:`hash_grid`) that
        cover them, each with its Merkle path, and the signature (ValueError for a range outside it)."""
        if not 0 <= lo < hi <= self.numel:
            raise ValueError(f"values {lo}:{hi} of a contribution of {self.numel}")
        codec = codec_of(self.codec)
        bounds = hash_grid(self.numel, codec, self.chunk)
        first = next(i for i, (_, b) in enumerate(bounds) if b > lo)
        last = next(i for i, (_, b) in enumerate(bounds) if b >= hi)
        if self.raw is not None:
            data = [raw_bytes(self.raw[a:b]) for a, b in bounds[first : last + 1]]
        elif len(self.pieces) == len(bounds):
            data = list(self.pieces[first : last + 1])
        else:  # stored in other pieces (chunks, or one payload from the wire): cut the bytes out
            at = sum(codec.encoded_size(b - a) for a, b in bounds[:first])
            data = []
            for a, b in bounds[first : last + 1]:
                n = codec.encoded_size(b - a)
                data.append(byte_range(self.pieces, at, at + n))
                at += n
        return {"w": self.weight, "numel": self.numel, "codec": self.codec, "chunk": self.chunk, "sig": self.sig,
                "pk": self.pk, "first": first, "data": data,
                "paths": self.tree.paths(range(first, last + 1))}

    @classmethod
    def from_wire(cls, m: Mapping[str, Any], numel: int | None = None) -> Evidence:
        """SCHEMA_ERRORS for anything malformed, or of another size than ``numel`` values (if given)."""
        data, sig, pk, chunk = m["data"], m["sig"], m.get("pk", b""), m.get("chunk")
        if not (isinstance(data, bytes) and isinstance(sig, bytes) and isinstance(pk, bytes)):
            raise TypeError("evidence fields must be bytes")
        # every piece's payload has a byte at least (ValueError for an unknown codec)
        check_shown(chunk, m["numel"], numel, len(data) + 1, str(m["codec"]))
        return cls((data,), float(m["w"]), int(m["numel"]), str(m["codec"]), chunk, sig, pk)


@dataclass
class Slice:
    """Values ``lo:hi`` of a member's signed contribution as the owner shows them for a random audit: the pieces
    (:func:`hash_grid`) covering them (``first``: the first's index), each with its Merkle path (net/merkle.py: the
    root they lead to is what the contributor signed), the signature. :meth:`values` checks that every piece leads
    to the same root; :meth:`signed_by`, that the root is the one signed."""

    weight: float
    numel: int
    codec: str
    chunk: int | None
    sig: bytes
    pk: bytes
    paths: list[list[bytes]]
    first: int
    pieces: list[bytes]

    @property
    def sha(self) -> bytes:
        """The root the first piece and its path lead to (ValueError if they do not fit the grid)."""
        n = grid_size(self.numel, self.codec, self.chunk)
        return root_from_path(payload_digest(self.pieces[0]), self.first, n, self.paths[0])

    def commit(self, run: str, key: str, phase: int, part: int) -> bytes:
        return commitment(run, key, phase, part, self.weight, self.numel, self.codec, self.chunk, self.sha)

    def signed_by(self, peer: str, run: str, key: str, phase: int, part: int) -> bool:
        try:
            return verify_signature(peer, self.commit(run, key, phase, part), self.sig, self.pk)
        except ValueError:  # a path that does not fit the grid
            return False

    def values(self, lo: int, hi: int) -> torch.Tensor:
        """Values ``lo:hi`` (ValueError if the pieces shown do not cover them, do not all lead to one root, or do
        not decode)."""
        bounds = hash_grid(self.numel, self.codec, self.chunk)
        if not 0 <= self.first or self.first + len(self.pieces) > len(bounds) or not self.pieces:
            raise ValueError("the chunks shown are not chunks of the contribution")
        a, b = bounds[self.first][0], bounds[self.first + len(self.pieces) - 1][1]
        if not a <= lo < hi <= b:
            raise ValueError(f"chunks of values {a}:{b} shown for values {lo}:{hi}")
        top, codec, out = self.sha, codec_of(self.codec), []
        for i, (p, path) in enumerate(zip(self.pieces, self.paths, strict=True), self.first):
            if root_from_path(payload_digest(p), i, len(bounds), path) != top:
                raise ValueError(f"chunk {i} is not one the signed root names")
            ca, cb = bounds[i]
            out.append(codec.decode(p, cb - ca))
        x = torch.cat(out)[lo - a : hi - a]
        if not all_finite(x):
            raise ValueError("a contribution with non-finite values")
        return x

    @classmethod
    def from_wire(cls, m: Mapping[str, Any], numel: int) -> Slice:
        """SCHEMA_ERRORS for anything malformed, or of another size than ``numel`` values."""
        sig, pk, chunk, paths, data = m["sig"], m.get("pk", b""), m.get("chunk"), m["paths"], m["data"]
        # (chunks of MIN_CHUNK values at least: the grid is as long as the part we know allows, whatever is shown)
        most = numel // MIN_CHUNK + 1 if isinstance(numel, int) else 0  # (a slice of an unknown size: refused)
        check_shown(chunk, m["numel"], numel, most, str(m["codec"]))
        if not (isinstance(sig, bytes) and isinstance(pk, bytes) and isinstance(paths, list)
                and isinstance(data, list) and 0 < len(data) == len(paths) <= MAX_SHOWN
                and all(isinstance(path, list) and len(path) <= MAX_DEPTH
                        and all(isinstance(h, bytes) and len(h) == 32 for h in path) for path in paths)
                and all(isinstance(p, bytes) for p in data)):
            raise TypeError("a slice of a contribution: signature, paths of 32-byte hashes and payloads")
        first = m["first"]
        if not isinstance(first, int) or isinstance(first, bool):
            raise TypeError("first must be an integer")
        return cls(float(m["w"]), numel, str(m["codec"]), chunk, sig, pk, paths, first, data)


@dataclass
class Entry:
    """One member's claim about its contribution to one part, in its check message."""

    part: int
    commit: bytes  # SHA-256 of its signed commitment
    weight: float
    inf: float  # the contribution's largest magnitude
    digest: bytes | None = None  # of the result it holds for this part: its sketches are under that seed
    s: torch.Tensor | None = None  # sketch of the contribution
    c: torch.Tensor | None = None  # sketch of its clipped pull at the result (CenteredClip)

    def to_wire(self) -> dict[str, Any]:
        return {"part": self.part, "commit": self.commit, "w": self.weight, "inf": self.inf, "d": self.digest,
                "s": None if self.s is None else sketch_bytes(self.s),
                "c": None if self.c is None else sketch_bytes(self.c)}

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Entry:
        """SCHEMA_ERRORS for anything malformed (the stream layer strikes the sender)."""
        sketches = []
        for k in ("s", "c"):
            v = m.get(k)
            if v is not None and (not isinstance(v, bytes) or len(v) != _SKETCH_BYTES):
                raise ValueError(f"sketch {k} of {len(v) if isinstance(v, bytes) else '?'} bytes")
            if v is None:
                sketches.append(None)
                continue
            values = struct.unpack(f"<{BUCKETS}d", v)
            # (checked on the floats, not the tensor: torch's test of 32 values cost 30 µs, 8 members took 112 a round)
            if not all(map(math.isfinite, values)):
                raise ValueError("non-finite sketch")
            sketches.append(torch.tensor(values, dtype=torch.float64))
        commit, digest = m["commit"], m.get("d")
        if not isinstance(commit, bytes) or (digest is not None and not isinstance(digest, bytes)):
            raise TypeError("commit and digest must be bytes")
        weight, inf = float(m["w"]), float(m["inf"])
        if not (math.isfinite(weight) and weight > 0 and math.isfinite(inf) and inf >= 0):
            raise ValueError("weight and magnitude must be finite, positive")
        return cls(int(m["part"]), commit, weight, inf, digest, sketches[0], sketches[1])


def entry_for(part: int, values: torch.Tensor, commit_hash: bytes, weight: float, key: Key | None,
              digest: bytes | None, result: torch.Tensor | None, tau: float, rule: str) -> Entry:
    """Our claim about our contribution ``values`` to ``part``, sketched under ``key`` (the seed of the result
    ``result`` of digest ``digest`` we hold), or without sketches if we hold no result of that part."""
    inf = float(values.abs().max()) if values.numel() else 0.0
    if key is None or result is None:
        return Entry(part, commit_hash, weight, inf)
    c = sketch(clipped(values, result, tau), key) if rule == "centered-clip" and tau > 0 else None
    return Entry(part, commit_hash, weight, inf, digest, sketch(values, key), c)


@dataclass
class Fetched:
    """One member's signed contribution as the part's owner showed it: ``evidence`` (None if it did not),
    ``answered`` (the owner replied: it is alive and said it has none), the payload bytes received."""

    evidence: Evidence | None
    answered: bool
    nbytes: int = 0


def parse_checks(msg: Mapping[str, Any], members: int, max_entries: int) -> dict[int, Entry]:
    """A check message's entries by part (SCHEMA_ERRORS if malformed)."""
    entries = msg["entries"]
    if not isinstance(entries, list) or len(entries) > max_entries:
        raise ValueError("entries must be a list of at most one per part")
    out = {}
    for m in entries:
        e = Entry.from_wire(m)
        if not 0 <= e.part < members:
            raise IndexError(f"part {e.part} of {members}")
        out[e.part] = e
    return out


async def fetch_evidence(call: Callable[..., Awaitable[tuple[dict[str, Any], float]]], owner: str, key: str,
                         phase: int, part: int, who: str, timeout: float, numel: int | None = None) -> Fetched:
    """``who``'s signed contribution to ``part`` (of ``numel`` values), as its owner shows it."""
    try:
        reply, _ = await call(owner, "evidence", {"key": key, "phase": phase, "part": part, "who": who},
                              timeout=timeout)
    except RoundFailed:
        return Fetched(None, answered=False)
    ev = reply.get("evidence")
    try:
        return Fetched(Evidence.from_wire(ev, numel), answered=True, nbytes=len(ev["data"])) \
            if isinstance(ev, dict) else Fetched(None, answered=True)
    except SCHEMA_ERRORS:
        return Fetched(None, answered=True)  # answered with something that is not a contribution


def _slice(ev: Any, numel: int) -> tuple[Slice | None, int]:
    try:
        got = Slice.from_wire(ev, numel)
    except SCHEMA_ERRORS:
        return None, 0
    return got, sum(map(len, got.pieces))


async def fetch_slice(call: Callable[..., Awaitable[tuple[dict[str, Any], float]]], owner: str, key: str,
                      phase: int, part: int, who: str, lo: int, hi: int, numel: int, timeout: float
                      ) -> tuple[Slice | None, int]:
    """Values ``lo:hi`` of ``who``'s signed contribution to ``part`` (of ``numel`` values), as its owner shows
    them, and the payload bytes received; (None, …) if it did not, or showed something malformed."""
    try:
        reply, _ = await call(owner, "evidence", {"key": key, "phase": phase, "part": part, "who": who,
                                                  "lo": lo, "hi": hi}, timeout=timeout)
    except RoundFailed:
        return None, 0
    return _slice(reply.get("evidence"), numel)


async def fetch_slices(call: Callable[..., Awaitable[tuple[dict[str, Any], float]]], owner: str, key: str,
                       phase: int, part: int, whos: Sequence[str], lo: int, hi: int, numel: int, timeout: float
                       ) -> dict[str, tuple[Slice | None, int]]:
    """:func:`fetch_slice` of every one of ``whos`` in one exchange with the owner (an audit's slice of a part of
    k members: one round trip where it took k − 1, each of them a message in and out of every member's loop)."""
    try:
        reply, _ = await call(owner, "evidence", {"key": key, "phase": phase, "part": part, "whos": list(whos),
                                                  "lo": lo, "hi": hi}, timeout=timeout)
    except RoundFailed:
        return {w: (None, 0) for w in whos}
    shown = reply.get("evidence")
    if not isinstance(shown, list) or len(shown) != len(whos):
        shown = [None] * len(whos)  # (answered with something else: shown nothing)
    return {w: _slice(ev, numel) for w, ev in zip(whos, shown, strict=True)}


def sign_contribution(identity: Identity, run: str, key: str, phase: int, part: int, weight: float, numel: int,
                      codec: str, chunk: int | None, sha: bytes) -> tuple[bytes, bytes]:
    """(signature, hash) of the commitment to one contribution."""
    c = commitment(run, key, phase, part, weight, numel, codec, chunk, sha)
    return identity.sign(c), hashlib.sha256(c).digest()
