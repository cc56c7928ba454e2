"""Hashes made as a payload passes (net/pieces.GridShas, the two-thread raw_shas) against the whole payload's."""

from __future__ import annotations

import blake3
import pytest
import torch

from p2ptrain.collective.butterfly import chunk_bounds
from p2ptrain.collective.codecs import get_codec
from p2ptrain.net import pieces as pieces_mod
from p2ptrain.net.claims import Evidence, Slice, sign_contribution
from p2ptrain.net.identity import Identity
from p2ptrain.net.pieces import (
    AUDIT_GRAIN,
    MIN_GRAIN,
    RAW,
    GridShas,
    audit_grain,
    contribution_shas,
    hash_grid,
    raw_shas,
    root,
)


@pytest.mark.parametrize("codec_name", ["fp32", "e3m0"])
def test_chunks_hashed_as_they_pass_are_the_whole_payloads_pieces(codec_name: str) -> None:
    codec = get_codec(codec_name)
    numel, chunk = 3 * 65536 + 5000, 65536  # a short last chunk
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    payloads = [codec.encode(x[a:b]) for a, b in chunk_bounds(numel, chunk)]
    grid = GridShas(codec, numel, chunk)
    for i in reversed(range(len(payloads))):  # threads may finish out of order
        assert grid.shas() is None
        grid.add(i, payloads[i])
    assert grid.shas() == contribution_shas(payloads, numel, codec, chunk)
    if codec_name == "fp32":  # by hand: pieces of the part's grain from each chunk's start (the whole's, not a chunk's)
        whole = b"".join(payloads)
        g = audit_grain(numel)
        assert g == 1024  # 201,608 values: fewer than 128 pieces of 2048
        bounds = [(s, min(s + g, b)) for a, b in chunk_bounds(numel, chunk) for s in range(a, b, g)]
        assert grid.shas() == [blake3.blake3(whole[4 * a:4 * b]).digest() for a, b in bounds]


def test_a_chunk_that_does_not_fit_leaves_a_hole_and_a_retry_starts_over() -> None:
    codec = get_codec("fp32")
    grid = GridShas(codec, 4096, 1024)
    for i in range(4):
        grid.add(i, bytes(4 * 1024))
    assert grid.shas() is not None
    grid.add(9, bytes(4))  # out of range: ignored
    grid.reset()
    grid.add(0, bytes(4 * 1000))  # too short for its chunk
    for i in range(1, 4):
        grid.add(i, bytes(4 * 1024))
    assert grid.shas() is None


@pytest.mark.parametrize("chunk", [None, 1 << 16])
def test_a_large_raw_share_hashed_in_two_threads_gives_the_same_pieces(chunk: int | None,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(3 << 20, generator=torch.Generator().manual_seed(1))  # 12 MB: over PARALLEL_BYTES
    assert 4 * x.numel() >= pieces_mod.PARALLEL_BYTES
    two = raw_shas(x, chunk)
    monkeypatch.setattr(pieces_mod, "PARALLEL_BYTES", 1 << 62)
    one = raw_shas(x, chunk)
    data = x.numpy().tobytes()
    assert two == one == [blake3.blake3(data[4 * a:4 * b]).digest()
                          for a, b in pieces_mod.hash_grid(x.numel(), RAW, chunk)]


def test_a_part_s_grain_follows_its_size_between_one_block_and_eight() -> None:
    """1 Mi values and more: AUDIT_GRAIN (8 Ki); below, the power of two that cuts the part into 128 pieces at
    least, never under one codec block (1 Ki). By hand: 2 peers × 1 MB (a part of 131,072 values) audit 4 kB slices."""
    assert (AUDIT_GRAIN, MIN_GRAIN) == (8192, 1024)
    for numel, grain in [(0, 1024), (10, 1024), (131_072, 1024), (262_143, 1024), (262_144, 2048),
                         (524_288, 4096), (1_048_575, 4096), (1_048_576, 8192), (64 << 20, 8192)]:
        assert audit_grain(numel) == grain, numel


def test_a_small_part_s_slice_is_its_grain_of_the_signed_share() -> None:
    """An owner's raw share of a small part is hashed, and shown, in pieces of the part's grain: the slice an audit
    fetches of a 2 × 1 MB round is 4 kB (it was 32 kB), and checks against the signature alone."""
    numel, chunk = 131_072, 1 << 18
    x = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    shas = raw_shas(x, chunk)
    assert len(shas) == 128 and hash_grid(numel, RAW, chunk)[5] == (5 * 1024, 6 * 1024)
    ident = Identity.generate()
    sig, _ = sign_contribution(ident, "run", "r0", 0, 0, 1.0, numel, RAW, chunk, root(shas))
    ev = Evidence((), 1.0, numel, RAW, chunk, sig, ident.public, shas=shas, raw=x)
    wire = ev.slice_wire(5 * 1024, 6 * 1024)
    assert [len(d) for d in wire["data"]] == [4096] and len(wire["paths"][0]) == 7  # 128 leaves: 7 levels
    sl = Slice.from_wire(wire, numel)
    assert sl.signed_by(ident.peer_id, "run", "r0", 0, 0)
    assert torch.equal(sl.values(5 * 1024, 6 * 1024), x[5 * 1024 : 6 * 1024])
    forged = {**wire, "data": [get_codec("fp32").encode(x[5 * 1024 : 6 * 1024] + 1e-3)]}
    assert not Slice.from_wire(forged, numel).signed_by(ident.peer_id, "run", "r0", 0, 0)  # another root
