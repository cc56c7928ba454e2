"""A claim's wire form (net/claims.py ``Entry``): its sketches come back exactly, and a sketch that is not 32 finite
float64 values is refused (the stream layer strikes its sender)."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from p2ptrain.collective.sketch import BUCKETS
from p2ptrain.net.claims import Entry


def _entry(s: torch.Tensor | None, c: torch.Tensor | None = None) -> Entry:
    return Entry(part=3, commit=b"c" * 32, weight=2.0, inf=1.5, digest=b"d" * 32, s=s, c=c)


def test_a_claim_comes_back_as_it_was_sent() -> None:
    s = torch.randn(BUCKETS, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 1e300
    c = torch.full((BUCKETS,), -0.0, dtype=torch.float64)
    back = Entry.from_wire(_entry(s, c).to_wire())
    assert back.part == 3 and back.weight == 2.0 and back.inf == 1.5 and back.digest == b"d" * 32
    assert back.s is not None and back.c is not None and back.s.dtype == torch.float64
    assert torch.equal(back.s, s) and torch.equal(back.c, c)
    assert Entry.from_wire(_entry(None).to_wire()).s is None


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("field", ["s", "c"])
def test_a_sketch_that_is_not_finite_is_refused(bad: float, field: str) -> None:
    wire = _entry(torch.zeros(BUCKETS, dtype=torch.float64), torch.zeros(BUCKETS, dtype=torch.float64)).to_wire()
    values = [0.0] * BUCKETS
    values[BUCKETS - 1] = bad
    wire[field] = struct.pack(f"<{BUCKETS}d", *values)
    with pytest.raises(ValueError, match="non-finite"):
        Entry.from_wire(wire)


def test_a_sketch_of_another_size_is_refused() -> None:
    wire = _entry(torch.zeros(BUCKETS, dtype=torch.float64)).to_wire()
    wire["s"] = wire["s"][:-8]
    with pytest.raises(ValueError, match="bytes"):
        Entry.from_wire(wire)


def test_evidence_hashes_its_tree_once_for_its_commitment_and_every_slice() -> None:
    """An owner shows a slice of each contribution to every auditor of its part: the Merkle tree over its pieces is
    hashed once (for the commitment's root), and every slice's paths come from it."""
    from p2ptrain.net.claims import Evidence, Slice
    from p2ptrain.net.merkle import merkle_paths, merkle_root
    from p2ptrain.net.pieces import RAW

    own = torch.randn(1 << 17, generator=torch.Generator().manual_seed(1))
    ev = Evidence((), 1.0, own.numel(), RAW, 1 << 14, b"s" * 64, b"", raw=own)
    assert not ev.hashed
    assert ev.sha == merkle_root(ev.shas) and ev.hashed
    tree = ev.tree
    for lo, hi in [(0, 1024), (5 * 1024, 6 * 1024), (own.numel() - 1024, own.numel())]:
        wire = ev.slice_wire(lo, hi)
        first = wire["first"]
        assert wire["paths"] == merkle_paths(ev.shas, range(first, first + len(wire["data"])))
        shown = Slice.from_wire(wire, own.numel())
        assert torch.equal(shown.values(lo, hi), own[lo:hi])
    assert ev.tree is tree  # (not hashed again)
