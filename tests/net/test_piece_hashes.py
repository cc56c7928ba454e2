"""Hashes made as a payload passes (net/pieces.GridShas, the two-thread raw_shas) against the whole payload's."""

from __future__ import annotations

import blake3
import pytest
import torch

from p2ptrain.collective.butterfly import chunk_bounds
from p2ptrain.collective.codecs import get_codec
from p2ptrain.net import pieces as pieces_mod
from p2ptrain.net.pieces import AUDIT_GRAIN, RAW, GridShas, contribution_shas, raw_shas


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
    if codec_name == "fp32":  # by hand: pieces of AUDIT_GRAIN values from each chunk's start
        whole = b"".join(payloads)
        bounds = [(s, min(s + AUDIT_GRAIN, b)) for a, b in chunk_bounds(numel, chunk)
                  for s in range(a, b, AUDIT_GRAIN)]
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
