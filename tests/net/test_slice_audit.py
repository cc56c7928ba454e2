"""Random audits of a slice of a part (net/claims.py ``Slice``, net/verify.py ``Judge.audit``): a contribution's
commitment names its chunks' hashes, so that the owner can show the chunks covering a few values and an auditor
can check them against the contributor's signature alone; a slice that was not signed, not hashed, or does not
cover the values asked is refused, and the slice's aggregate is checked as exactly as the whole part's."""

from __future__ import annotations

import asyncio

import blake3
import pytest
import torch

from p2ptrain.collective.butterfly import chunk_bounds
from p2ptrain.collective.codecs import get_codec
from p2ptrain.net import pieces as pieces_mod
from p2ptrain.net.claims import Evidence, Slice, sign_contribution
from p2ptrain.net.identity import Identity
from p2ptrain.net.pieces import AUDIT_GRAIN, RAW, grid_size, hash_grid, payload_sha, raw_shas, root
from p2ptrain.net.verify import Judge

G = AUDIT_GRAIN
N, CHUNK = 3 * G + 5000, 16 * 1024
RUN, KEY = "run", "r0"


@pytest.fixture(autouse=True)
def _large_part_grain(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grain of a part of 1 Mi values and more (AUDIT_GRAIN), on parts small enough for a unit test: a smaller
    part's own grain (pieces.audit_grain) is tested in tests/net/test_piece_hashes.py."""
    monkeypatch.setattr(pieces_mod, "GRAIN_PIECES", 1)
    assert pieces_mod.audit_grain(N) == G


def _values(seed: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(seed))


def _evidence(ident: Identity, x: torch.Tensor, codec: str, chunk: int | None, joined: bool = False) -> Evidence:
    """A contribution as the owner keeps it: streamed chunk by chunk, or joined into one payload."""
    c = get_codec(codec)
    bounds = chunk_bounds(N, chunk) if chunk else [(0, N)]
    pieces = [c.encode(x[a:b]) for a, b in bounds]
    sig, _ = sign_contribution(ident, RUN, KEY, 0, 0, 1.5, N, codec, chunk, payload_sha(pieces, N, c, chunk))
    return Evidence((b"".join(pieces),) if joined else tuple(pieces), 1.5, N, codec, chunk, sig, ident.public)


@pytest.mark.parametrize("how", ["streamed", "joined", "unchunked"])
@pytest.mark.parametrize("codec", ["fp32", "e3m0"])
def test_a_slice_shows_the_signed_values_and_nothing_else(how: str, codec: str) -> None:
    """fp32 (its bytes in value order) is hashed in pieces of AUDIT_GRAIN values whatever its chunks; e3m0 (block
    headers first) in its chunks. A slice shows exactly the pieces that cover it."""
    ident = Identity.generate()
    x = _values(0)
    chunk = None if how == "unchunked" else CHUNK
    ev = _evidence(ident, x, codec, chunk, joined=how == "joined")
    assert ev.signed_by(ident.peer_id, RUN, KEY, 0, 0)
    whole = ev.values()
    c = get_codec(codec)
    grid = hash_grid(N, c, chunk)
    step = min(G, chunk or G) if codec == "fp32" else chunk  # (fp32's chunks here are smaller than the grain)
    assert grid == (chunk_bounds(N, step) if step else [(0, N)])
    for lo, hi in [(0, 1024), (G, G + 1024), (N - 1000, N), (1000, 1100), (G - 10, G + 10), (0, N)]:
        wire = ev.slice_wire(lo, hi)
        sl = Slice.from_wire(wire, N)
        assert sl.signed_by(ident.peer_id, RUN, KEY, 0, 0)
        assert torch.equal(sl.values(lo, hi), whole[lo:hi])
        cover = [(a, b) for a, b in grid if a < hi and b > lo]
        assert [len(d) for d in wire["data"]] == [c.encoded_size(b - a) for a, b in cover]  # those pieces only
        if cover[-1][1] < N:  # values the pieces shown do not cover
            with pytest.raises(ValueError, match="shown for"):
                sl.values(lo, cover[-1][1] + 1)
    with pytest.raises(ValueError):
        ev.slice_wire(10, 10)
    with pytest.raises(ValueError):
        ev.slice_wire(0, N + 1)


def test_an_owner_own_raw_share_is_shown_by_the_slice_as_signed() -> None:
    ident = Identity.generate()
    x = _values(1)
    shas = raw_shas(x, 1 << 18)
    assert shas == [blake3.blake3(get_codec("fp32").encode(x[a:b])).digest() for a, b in chunk_bounds(N, G)]
    assert len(raw_shas(x, 1024)) == -(-N // 1024)  # chunks smaller than the grain: pieces of a chunk
    sig, _ = sign_contribution(ident, RUN, KEY, 0, 0, 2.0, N, RAW, 1 << 18, root(shas))
    ev = Evidence((), 2.0, N, RAW, 1 << 18, sig, ident.public, shas=shas, raw=x)
    wire = ev.slice_wire(2 * G, 3 * G)
    assert [len(d) for d in wire["data"]] == [4 * G]  # the slice, not the part
    sl = Slice.from_wire(wire, N)
    assert sl.signed_by(ident.peer_id, RUN, KEY, 0, 0) and torch.equal(sl.values(2 * G, 3 * G), x[2 * G : 3 * G])
    # the whole of it, as a dispute fetches it, is the same commitment
    assert Evidence.from_wire(ev.to_wire(), N).signed_by(ident.peer_id, RUN, KEY, 0, 0)


def test_pieces_in_value_order_start_at_each_chunk_so_that_an_audit_slice_is_one_piece() -> None:
    """Chunks of G + 4096 values (not a multiple of the grain): the pieces restart at each chunk's start, where an
    audit draws its slices (from each result chunk's start, net/audit.py), so a slice costs one piece, not two."""
    chunk = G + 4096
    want = [(0, G), (G, chunk), (chunk, chunk + G), (chunk + G, 2 * chunk), (2 * chunk, N)]
    for codec in (RAW, "fp32"):
        assert hash_grid(N, codec, chunk) == want
        assert grid_size(N, codec, chunk) == len(want)
    assert hash_grid(N, "e3m0", chunk) == [(0, chunk), (chunk, 2 * chunk), (2 * chunk, N)]  # block headers: chunks
    assert grid_size(N, "e3m0", chunk) == 3 and grid_size(N, RAW, None) == 4 and grid_size(0, RAW, chunk) == 0
    ident = Identity.generate()
    x = _values(5)
    shas = raw_shas(x, chunk)
    assert shas == [blake3.blake3(get_codec("fp32").encode(x[a:b])).digest() for a, b in want]
    sig, _ = sign_contribution(ident, RUN, KEY, 0, 0, 1.0, N, RAW, chunk, root(shas))
    ev = Evidence((), 1.0, N, RAW, chunk, sig, ident.public, shas=shas, raw=x)
    for lo, hi in [(chunk, chunk + G), (2 * chunk, N)]:  # slices an audit draws
        wire = ev.slice_wire(lo, hi)
        assert [len(d) for d in wire["data"]] == [4 * (hi - lo)]
        sl = Slice.from_wire(wire, N)
        assert sl.signed_by(ident.peer_id, RUN, KEY, 0, 0) and torch.equal(sl.values(lo, hi), x[lo:hi])


def test_a_slice_that_was_not_signed_or_not_hashed_is_refused() -> None:
    ident, other = Identity.generate(), Identity.generate()
    ev = _evidence(ident, _values(2), "fp32", 1 << 18)  # (chunks above the grain: pieces of G values)
    wire = ev.slice_wire(G, 2 * G)
    zeros = get_codec("fp32").encode(torch.zeros(G))
    assert len(wire["paths"]) == 1 and len(wire["paths"][0]) == 2  # 4 pieces of G values: 2 levels above a piece
    assert Slice.from_wire(wire, N).signed_by(ident.peer_id, RUN, KEY, 0, 0)
    # a piece that is not the one hashed: its path leads to another root, which was not signed
    assert not Slice.from_wire({**wire, "data": [zeros]}, N).signed_by(ident.peer_id, RUN, KEY, 0, 0)
    # a path changed, one hash short, one too many, or for another piece
    bent = [wire["paths"][0][0], bytes(32)]
    for paths in ([bent], [wire["paths"][0][:1]], [[*wire["paths"][0], bytes(32)]]):
        assert not Slice.from_wire({**wire, "paths": paths}, N).signed_by(ident.peer_id, RUN, KEY, 0, 0)
    assert not Slice.from_wire({**wire, "first": 0}, N).signed_by(ident.peer_id, RUN, KEY, 0, 0)
    with pytest.raises(ValueError):
        Slice.from_wire({**wire, "paths": [wire["paths"][0][:1]]}, N).values(G, 2 * G)
    # of two pieces shown, one swapped: they do not lead to one root
    two = _evidence(ident, _values(2), "fp32", CHUNK).slice_wire(G - 10, G + 10)
    assert len(two["data"]) == 2
    with pytest.raises(ValueError, match="not one the signed root names"):
        Slice.from_wire({**two, "data": [two["data"][0], get_codec("fp32").encode(torch.zeros(CHUNK))]},
                        N).values(G - 10, G + 10)
    # another member's signature, another weight, another size
    assert not Slice.from_wire(wire, N).signed_by(other.peer_id, RUN, KEY, 0, 0)
    assert not Slice.from_wire({**wire, "w": 3.0}, N).signed_by(ident.peer_id, RUN, KEY, 0, 0)
    with pytest.raises(ValueError):
        Slice.from_wire(wire, N + 1)
    # a chunking that would cost the auditor what the owner chose: tiny chunks, or more pieces than hashes
    with pytest.raises(ValueError):
        Slice.from_wire({**wire, "chunk": 1}, N)
    with pytest.raises(ValueError):
        Slice.from_wire({**wire, "numel": 10**15}, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Evidence.from_wire({**ev.to_wire(), "numel": 10**15})
    with pytest.raises((TypeError, ValueError)):  # a path for each piece shown, of 32-byte hashes
        Slice.from_wire({**wire, "paths": []}, N)
    with pytest.raises((TypeError, ValueError)):
        Slice.from_wire({**wire, "paths": [[b"short"]]}, N)
    with pytest.raises(ValueError):  # pieces past the last one
        Slice.from_wire({**wire, "first": 4}, N).values(3 * G, N)


def _judge(members: list[str], owner_commit: bytes) -> Judge:
    return Judge(run=RUN, key=KEY, phase=0, members=members, codec=get_codec("fp32"), rule="mean",
                 own_commits={members[0]: owner_commit}, checks={}, key_of=lambda j: [])


@pytest.mark.parametrize("held", [False, True], ids=["fetched", "ours held"])
@pytest.mark.parametrize("lie_at", [None, 1024, N - 10])
def test_an_audit_of_a_slice_recomputes_it_exactly(lie_at: int | None, held: bool) -> None:
    """Three contributors (the first the owner, its share raw): the owner's result with a lie of one value; an audit
    of the slice holding it fails, of any other slice passes, and fetches the pieces of each contribution that cover
    the slice (not the one the auditor holds itself: its own)."""
    ids = [Identity.generate() for _ in range(3)]
    members = [i.peer_id for i in ids]
    xs = [_values(10 + k) for k in range(3)]
    ws = [1.0, 2.0, 3.0]
    evs = {}
    for k, (ident, x) in enumerate(zip(ids, xs, strict=True)):
        if k == 0:
            shas = raw_shas(x, CHUNK)
            sig, commit = sign_contribution(ident, RUN, KEY, 0, 0, ws[k], N, RAW, CHUNK, root(shas))
            evs[members[k]] = Evidence((), ws[k], N, RAW, CHUNK, sig, ident.public, shas=shas, raw=x)
            owner_commit = commit
        else:
            evs[members[k]] = _evidence(ident, x, "fp32", CHUNK)
            evs[members[k]].weight = ws[k]
            sig, _ = sign_contribution(ident, RUN, KEY, 0, 0, ws[k], N, "fp32", CHUNK, evs[members[k]].sha)
            evs[members[k]].sig = sig
    want = (sum(w * x.double() for w, x in zip(ws, xs, strict=True)) / sum(ws)).float()
    result = want.clone()
    if lie_at is not None:
        result[lie_at] += 0.01
    res = {"contributors": members, "chunk": CHUNK}
    shown: list[tuple[str, int, int]] = []
    mine = {members[2]: lambda lo, hi: (ws[2], xs[2][lo:hi])} if held else None

    async def fetch(who: str, lo: int, hi: int) -> tuple[Slice | None, int]:
        shown.append((who, lo, hi))
        wire = evs[who].slice_wire(lo, hi)
        return Slice.from_wire(wire, N), sum(map(len, wire["data"]))

    for lo, hi in chunk_bounds(N, CHUNK):
        shown.clear()
        judge = _judge(members, owner_commit)
        why = asyncio.run(judge.audit(0, members[0], res, result, [(lo, hi)], fetch, mine))
        if lie_at is not None and lo <= lie_at < hi:
            assert why is not None and "not the aggregate" in why
        else:
            assert why is None, (lo, why)
        asked = members[:2] if held else members
        assert sorted(shown) == sorted((m, lo, hi) for m in asked)
        assert judge.evidence_bytes == len(asked) * 4 * (hi - lo)  # the slice of each: fp32 and raw, by the piece
    # the owner's own share is not the one it announced: refused before any arithmetic
    judge = _judge(members, b"\0" * 32)
    why = asyncio.run(judge.audit(0, members[0], res, want, [(0, CHUNK)], fetch, mine))
    assert why is not None and "not the one it claimed" in why


@pytest.mark.parametrize("codec", ["fp32", "fp16", "bf16", "uint8", "fp8", "e3m0", "1bit", "2bit", "topk2", "topk2:0.03"])
def test_every_codec_encodes_a_slice_from_a_multiple_of_1024_as_it_does_inside_its_chunk(codec: str) -> None:
    """What lets an audit recompute a slice of a result chunk on its own (AUDIT_GRAIN is a multiple of 1024)."""
    c = get_codec(codec)
    x = torch.randn(5000, generator=torch.Generator().manual_seed(4)) * torch.linspace(0.1, 3, 5000)
    whole = c.decode(c.encode(x), x.numel())
    for lo, hi in [(0, 1024), (1024, 3072), (4096, 5000), (2048, 5000)]:
        assert torch.equal(c.decode(c.encode(x[lo:hi]), hi - lo), whole[lo:hi]), (codec, lo, hi)


def test_an_owner_shows_a_slice_of_every_contribution_asked_for_in_one_exchange() -> None:
    """An audit of a slice fetches it for every other contributor of the part at once (claims.fetch_slices): the
    same signed values one request each would show, None for a contribution the owner does not hold, and a request
    naming more contributions than a group holds is refused."""
    from p2ptrain.net.claims import fetch_slices
    from p2ptrain.net.guard import Guard
    from p2ptrain.net.mailbox import MAX_SLICES, Mailboxes

    idents = [Identity.generate() for _ in range(3)]
    boxes = Mailboxes(Guard(), max_numel=1 << 20, verify=True)
    box = boxes.box(KEY, 0)
    for i, ident in enumerate(idents):
        box.evidence[ident.peer_id] = _evidence(ident, _values(i), "e3m0" if i else "fp32", CHUNK)
    lo, hi = G, G + 1024
    whos = [ident.peer_id for ident in idents] + ["someone-else"]
    calls: list[dict[str, object]] = []

    async def call(owner: str, kind: str, msg: dict[str, object], *, timeout: float) -> tuple[dict[str, object], float]:
        assert kind == "evidence"
        calls.append(msg)
        return await boxes.show_evidence("auditor", msg), 0.0

    got = asyncio.run(fetch_slices(call, "owner", KEY, 0, 0, whos, lo, hi, N, 5.0))
    assert len(calls) == 1 and list(got) == whos
    for ident in idents:
        sl, nbytes = got[ident.peer_id]
        assert sl is not None and sl.signed_by(ident.peer_id, RUN, KEY, 0, 0) and nbytes > 0
        single = Slice.from_wire(box.evidence[ident.peer_id].slice_wire(lo, hi), N)
        assert torch.equal(sl.values(lo, hi), single.values(lo, hi))
        assert torch.equal(sl.values(lo, hi), box.evidence[ident.peer_id].values()[lo:hi])
    assert got["someone-else"] == (None, 0)
    with pytest.raises(TypeError, match="whos"):
        asyncio.run(boxes.show_evidence("auditor", {"key": KEY, "phase": 0, "whos": ["x"] * (MAX_SLICES + 1),
                                                    "lo": lo, "hi": hi}))


@pytest.mark.parametrize("vouched", [False, True], ids=["nobody vouched", "its contributor's claim"])
def test_a_slice_its_contributor_vouched_for_needs_no_signature(vouched: bool) -> None:
    """The pieces of a slice lead to the root its commitment names: a commitment its contributor named to the
    auditor itself (its claim; the owner's announcement of its own share) makes them its, so its signature is not
    checked again (8 members: 7 a slice); one that nobody vouched for must carry a valid signature. Here both
    signatures are broken: with the claims the audit passes, without them it is refused."""
    import hashlib

    from p2ptrain.net.claims import Entry

    ids = [Identity.generate() for _ in range(2)]
    members = [i.peer_id for i in ids]
    xs, ws = [_values(40), _values(41)], [1.0, 2.0]
    own_shas = raw_shas(xs[0], CHUNK)
    _, owner_commit = sign_contribution(ids[0], RUN, KEY, 0, 0, ws[0], N, RAW, CHUNK, root(own_shas))
    evs = {members[0]: Evidence((), ws[0], N, RAW, CHUNK, b"\1" * 64, ids[0].public, shas=own_shas, raw=xs[0]),
           members[1]: _evidence(ids[1], xs[1], "fp32", CHUNK)}
    evs[members[1]].weight = ws[1]
    evs[members[1]].sig = b"\2" * 64  # (not its signature)
    commit1 = hashlib.sha256(evs[members[1]].commit(RUN, KEY, 0, 0)).digest()
    checks = {members[1]: {0: Entry(0, commit1, ws[1], float(xs[1].abs().max()))}} if vouched else {}
    judge = Judge(run=RUN, key=KEY, phase=0, members=members, codec=get_codec("fp32"), rule="mean",
                  own_commits={members[0]: owner_commit} if vouched else {}, checks=checks, key_of=lambda j: [])
    want = (sum(w * x.double() for w, x in zip(ws, xs, strict=True)) / sum(ws)).float()

    async def fetch(who: str, lo: int, hi: int) -> tuple[Slice | None, int]:
        wire = evs[who].slice_wire(lo, hi)
        return Slice.from_wire(wire, N), sum(map(len, wire["data"]))

    why = asyncio.run(judge.audit(0, members[0], {"contributors": members, "chunk": CHUNK}, want, [(0, 1024)],
                                  fetch))
    if vouched:
        assert why is None
    else:
        assert why is not None and "not signed by it" in why
