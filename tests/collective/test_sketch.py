"""Sketches of contributions and the codecs' error bounds: what the check of a part owner's average stands on."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

from p2ptrain.collective.aggregate import CLIP_TOL, centered_clip, weighted_mean
from p2ptrain.collective.codecs import CODECS, get_codec
from p2ptrain.collective.sketch import BUCKETS, KAPPA, clipped, mean_residual, passes, seed, sketch


def _inputs(n: int, g: torch.Generator) -> list[torch.Tensor]:
    base = torch.randn(n, generator=g)
    spiky = base.clone()
    spiky[:: max(1, n // 5)] *= 1000.0
    sparse = torch.where(torch.rand(n, generator=g) < 0.9, torch.zeros(n), base)
    return [base, base * 1e-6, spiky, sparse, torch.zeros(n), torch.full((n,), 3.0)]


@pytest.mark.parametrize("name", sorted(CODECS))
def test_every_decoded_value_is_within_its_error_bound(name: str) -> None:
    codec = get_codec(name)
    g = torch.Generator().manual_seed(0)
    for n in (1, 63, 64, 1000, 4097):
        for x in _inputs(n, g):
            d = codec.decode(codec.encode(x), n)
            bound = codec.error_bound(d)
            assert bound.shape == d.shape and bool((bound >= 0).all())
            err = (x.double() - d.double()).abs()
            assert bool((err <= bound.double() + 1e-30).all()), (name, n, float((err - bound.double()).max()))


def test_a_sketch_is_linear_and_the_same_for_the_same_seed() -> None:
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(1001, generator=g), torch.randn(1001, generator=g)
    k = seed("run", "r1", 0, 3, b"digest")
    sa, sb = sketch(a, k), sketch(b, k)
    assert sa.shape == (BUCKETS,) and sa.dtype == torch.float64
    assert torch.allclose(sketch(0.25 * a + 0.75 * b, k), 0.25 * sa + 0.75 * sb, atol=1e-9)
    assert torch.equal(sketch(a, k), sa)
    assert not torch.allclose(sketch(a, seed("run", "r1", 0, 3, b"other")), sa)
    # By hand: one sign bit per value (low bit first) from SHAKE-256 of the key; buckets of ceil(5/2) = 3 values.
    byte = hashlib.shake_256(k).digest(1)[0]
    sign = [1.0 - 2.0 * ((byte >> i) & 1) for i in range(5)]
    s = sketch(torch.arange(1, 6, dtype=torch.float32), k, buckets=2)
    assert s.tolist() == [sign[0] * 1 + sign[1] * 2 + sign[2] * 3, sign[3] * 4 + sign[4] * 5]
    assert sketch(torch.zeros(0), k).abs().sum() == 0
    # Per chunk: [0, 2) and [2, 5) with seeds of their own; the buckets stay those of the whole vector.
    k1, k2 = seed("c", 1), seed("c", 2)
    b1, b2 = hashlib.shake_256(k1).digest(1)[0], hashlib.shake_256(k2).digest(1)[0]
    s1 = [1.0 - 2.0 * ((b1 >> i) & 1) for i in range(2)]
    s2 = [1.0 - 2.0 * ((b2 >> i) & 1) for i in range(3)]
    s = sketch(torch.arange(1, 6, dtype=torch.float32), [(0, 2, k1), (2, 5, k2)], buckets=2)
    assert s.tolist() == [s1[0] * 1 + s1[1] * 2 + s2[0] * 3, s2[1] * 4 + s2[2] * 5]
    assert torch.equal(sketch(a, [(0, 1001, k)]), sa)  # one chunk under the seed: the seed's own sketch
    with pytest.raises(ValueError):
        sketch(a, [(0, 2000, k)])


@pytest.mark.parametrize("name", ["fp32", "fp16", "uint8", "e3m0"])
def test_an_honest_mean_passes_and_a_lie_above_the_codec_error_fails(name: str) -> None:
    codec = get_codec(name)
    g = torch.Generator().manual_seed(2)
    n, k = 5000, 5
    xs = [codec.decode(codec.encode(torch.randn(n, generator=g) + 1.0), n) for _ in range(k)]
    ws = [1.0, 2.0, 1.0, 0.5, 1.5]
    m = weighted_mean(xs, ws)
    honest = codec.decode(codec.encode(m), n)
    bound_sq = float(codec.error_bound(honest).double().pow(2).sum() + (honest.double() * 2.0**-24).pow(2).sum())
    for trial in range(20):
        key = seed("run", trial)
        sk = [(w, sketch(x, key)) for w, x in zip(ws, xs, strict=True)]
        res = mean_residual(sketch(honest, key), sk)
        assert passes(res, bound_sq, float(m.abs().sum())), (name, trial)
        lie_size = 3.0 * KAPPA * math.sqrt(bound_sq) + 0.1 * float(m.norm())
        for lie in (-m, 99 * m, torch.randn(n, generator=g) * lie_size / math.sqrt(n)):
            bad = codec.decode(codec.encode(m + lie), n)
            bad_sq = float(codec.error_bound(bad).double().pow(2).sum() + (bad.double() * 2.0**-24).pow(2).sum())
            if (bad - honest).norm() > 2 * KAPPA * math.sqrt(max(bound_sq, bad_sq)):
                assert not passes(mean_residual(sketch(bad, key), sk), bad_sq, float(m.abs().sum())), (name, trial)


def test_the_clipped_pulls_of_a_converged_centered_clip_cancel() -> None:
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(300, generator=g, dtype=torch.float64) for _ in range(4)] + [100 * torch.ones(300, dtype=torch.float64)]
    ws = [1.0] * 5
    v = centered_clip(xs, ws, tau=5.0)  # iterates until a step is below CLIP_TOL·τ
    pull = sum(clipped(x, v, 5.0) for x in xs) / 5
    assert float(pull.norm()) <= 2 * CLIP_TOL * 5.0
    key = seed("clip")
    res = sum(sketch(clipped(x, v, 5.0), key) for x in xs) / 5
    assert passes(res, (2 * CLIP_TOL * 5.0) ** 2, 1.0)
    assert not passes(sum(sketch(clipped(x, v + 0.5, 5.0), key) for x in xs) / 5, (2 * CLIP_TOL * 5.0) ** 2, 1.0)


def _sketch_by_hand(x: torch.Tensor, key: bytes, buckets: int = BUCKETS) -> torch.Tensor:
    """The sketch's definition, value by value in float64: bit k of SHAKE-256(key) (low bit first) signs x_k."""
    flat = x.reshape(-1).double().tolist()
    n = len(flat)
    bits = hashlib.shake_256(key).digest((n + 7) // 8)
    size = -(-n // buckets) if n else 1
    out = [0.0] * buckets
    for k, v in enumerate(flat):
        out[k // size] += (1.0 - 2.0 * ((bits[k // 8] >> (k % 8)) & 1)) * v
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("slab", [1 << 22, 64, 9])
def test_the_vectorised_sketch_is_its_definition(slab: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever slabs the sums are taken in (odd bucket sizes start a slab inside a byte of sign bits)."""
    import p2ptrain.collective.sketch as module

    monkeypatch.setattr(module, "_SLAB", slab)
    g = torch.Generator().manual_seed(3)
    for n in (0, 1, 7, 31, 32, 33, 1000, 4099, 20_011):
        x = torch.randn(n, generator=g)
        want = _sketch_by_hand(x, b"key")
        assert torch.allclose(sketch(x, b"key"), want, rtol=1e-12, atol=1e-9), n
        assert torch.allclose(sketch(x.double(), b"key"), want, rtol=1e-12, atol=1e-9), n


@pytest.mark.parametrize("slab", [1 << 22, 64, 9])
def test_a_sketch_by_chunks_is_its_definition(slab: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks that start and end inside buckets (a streamed part's, each under its own seed), summed a chunk at a
    time as they arrive: value j of chunk [lo, hi) is signed by bit j − lo of that chunk's seed."""
    import p2ptrain.collective.sketch as module

    monkeypatch.setattr(module, "_SLAB", slab)
    g = torch.Generator().manual_seed(5)
    for n, step in ((1000, 7), (4099, 300), (20_011, 1024), (33, 5), (64, 64)):
        x = torch.randn(n, generator=g)
        key = [(lo, min(n, lo + step), f"c{lo}".encode()) for lo in range(0, n, step)]
        size = -(-n // BUCKETS)
        want = [0.0] * BUCKETS
        for lo, hi, k in key:
            bits = hashlib.shake_256(k).digest((hi - lo + 7) // 8)
            for j in range(lo, hi):
                want[j // size] += (1.0 - 2.0 * ((bits[(j - lo) // 8] >> ((j - lo) % 8)) & 1)) * float(x[j])
        ref = torch.tensor(want, dtype=torch.float64)
        by_arrival = torch.zeros(BUCKETS, dtype=torch.float64)
        for lo, hi, k in reversed(key):  # in any order, as chunks come
            module.add_chunk(by_arrival, x[lo:hi], k, lo, n)
        for got in (sketch(x, key), sketch(x.double(), key), by_arrival):
            assert torch.allclose(got, ref, rtol=1e-12, atol=1e-9), (n, step)


def test_several_vectors_under_one_sign_stream_are_each_their_own_sketch() -> None:
    """A result's chunk and our contribution to it share their key and place (net/tally.py): summed together,
    each sketch is the one it would be alone (float32 and float64 values), and vectors of different lengths are
    refused."""
    import p2ptrain.collective.sketch as module

    g = torch.Generator().manual_seed(7)
    n, lo, hi = 4099, 1000, 3001
    a, b = torch.randn(n, generator=g), torch.randn(n, generator=g).double()
    together = [torch.zeros(BUCKETS, dtype=torch.float64) for _ in range(2)]
    module.add_chunks([(together[0], a[lo:hi]), (together[1], b[lo:hi])], b"k", lo, n)
    for got, x in zip(together, (a, b), strict=True):
        alone = torch.zeros(BUCKETS, dtype=torch.float64)
        module.add_chunk(alone, x[lo:hi], b"k", lo, n)
        assert torch.equal(got, alone)
        assert got.abs().sum() > 0
    with pytest.raises(ValueError):
        module.add_chunks([(together[0], a[lo:hi]), (together[1], b[lo:hi + 1])], b"k", lo, n)
