"""Verification's sums made chunk by chunk as a result arrives (net/tally.py) equal the ones made whole after it
(net/verify.py): the same sketch, error bound and verdict, for an honest mean and for a lie, in several codecs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from p2ptrain.collective.butterfly import chunk_bounds
from p2ptrain.collective.codecs import get_codec
from p2ptrain.collective.sketch import sketch
from p2ptrain.net.claims import chunk_keys, result_shas
from p2ptrain.net.tally import ChunkTally
from p2ptrain.net.verify import Judge, error_bound

CHUNK = 1000
N = 3500  # four chunks, the last one short


def _result(codec_name: str, lie: bool) -> tuple[dict[str, Any], torch.Tensor, list[bytes], list[torch.Tensor]]:
    """(result header, its decoded values, its chunks' payloads, the contributions) of a weighted mean of 3."""
    codec = get_codec(codec_name)
    g = torch.Generator().manual_seed(5)
    xs = [codec.decode(codec.encode(torch.randn(N, generator=g) + 0.5), N) for _ in range(3)]
    ws = [1.0, 2.0, 3.0]
    avg = sum(x.double() * w for x, w in zip(xs, ws, strict=True)) / sum(ws)
    if lie:
        avg = avg + 0.05 * torch.randn(N, generator=g, dtype=torch.float64)
    pieces = [codec.encode(avg[a:b].float()) for a, b in chunk_bounds(N, CHUNK)]
    values = torch.cat([codec.decode(p, b - a) for p, (a, b) in zip(pieces, chunk_bounds(N, CHUNK), strict=True)])
    res = {"key": "r", "phase": 0, "part": 1, "numel": N, "codec": codec_name, "chunk": CHUNK,
           "contributors": ["a", "b", "c"], "total": sum(ws), "_pieces": pieces}
    return res, values, pieces, xs


def _fed(codec_name: str, lie: bool, judge: bool) -> tuple[ChunkTally, dict[str, Any], torch.Tensor, list[torch.Tensor]]:
    """(a tally fed every chunk of the result in turn, the result's header, its values, the contributions): the
    first contribution is ours."""
    codec = get_codec(codec_name)
    res, values, pieces, xs = _result(codec_name, lie)
    mine = xs[0]
    tally = ChunkTally(run="run", key="r", phase=0, part=1, sender="o", res=res, numel=N, codec=codec, judge=judge,
                       mine=lambda c, lo, hi: mine[lo:hi])
    for c, ((a, b), p) in enumerate(zip(chunk_bounds(N, CHUNK), pieces, strict=True)):
        tally.feed(c, p, values[a:b])
    return tally, res, values, xs


@pytest.mark.parametrize("codec_name", ["fp32", "e3m0", "uint8"])
@pytest.mark.parametrize("lie", [False, True])
def test_sums_made_as_chunks_arrive_are_the_whole_ones(codec_name: str, lie: bool) -> None:
    codec = get_codec(codec_name)
    tally, res, values, xs = _fed(codec_name, lie, judge=True)
    mine = xs[0]
    assert tally.matches("o", res) and not tally.matches("x", res)
    shas = result_shas(res, N, codec)
    keys = chunk_keys("run", "r", 0, 1, res, shas, N)
    assert tally.shas == shas and tally.keys == keys
    assert torch.allclose(tally.result, sketch(values, keys), rtol=1e-12, atol=1e-9)
    assert tally.mine_sketch is not None
    assert torch.allclose(tally.mine_sketch, sketch(mine, keys), rtol=1e-12, atol=1e-9)
    assert tally.mine_inf == float(mine.abs().max())
    largest = max(float(x.abs().max()) for x in xs)
    eps = error_bound(values, codec, CHUNK, largest)
    assert tally.slack <= largest  # the cap |v| + largest does not bind for these
    assert tally.e0_sq == pytest.approx(float(eps.pow(2).sum()), rel=1e-9)
    assert tally.abs_sum == pytest.approx(float(values.abs().double().sum()), rel=1e-12)
    # The judge's verdict, with the sums and without: the same (and a lie above the codec's rounding fails either
    # way; 4-bit rounding hides this one from sketches, which is what the audits are for).
    judge = Judge(run="run", key="r", phase=0, members=["a", "b", "c", "o"], codec=codec, rule="mean",
                  own_commits={}, checks={}, key_of=lambda part: keys)
    claims = {p: (w, float(x.abs().max()), sketch(x, keys), None)
              for p, x, w in zip(["a", "b", "c"], xs, [1.0, 2.0, 3.0], strict=True)}
    whole = judge.test(res, values, claims, keys)
    summed = judge.test(res, values, claims, keys, tally)
    assert (whole is None) == (summed is None), (whole, summed)
    if codec_name != "e3m0":
        assert (whole is None) == (not lie), whole


def test_a_chunk_that_does_not_fit_leaves_the_tally_unused() -> None:
    codec = get_codec("fp32")
    res, values, pieces, _ = _result("fp32", False)
    tally = ChunkTally(run="run", key="r", phase=0, part=1, sender="o", res=res, numel=N, codec=codec, judge=True,
                       mine=None)
    tally.feed(0, pieces[0], values[:CHUNK])
    tally.feed(0, pieces[0], values[:CHUNK])  # the same chunk twice
    assert tally.broken and not tally.matches("o", res)
    short = ChunkTally(run="run", key="r", phase=0, part=1, sender="o", res=res, numel=N, codec=codec, judge=True,
                       mine=None)
    short.feed(1, pieces[1], values[:10])  # values of another size than the chunk's
    assert short.broken
    missing = ChunkTally(run="run", key="r", phase=0, part=1, sender="o", res=res, numel=N, codec=codec, judge=True,
                         mine=None)
    missing.feed(0, pieces[0], values[:CHUNK])
    assert not missing.matches("o", res)  # not whole


def test_our_share_of_another_part_is_sketched_from_the_payloads_we_sent() -> None:
    """With a lossy codec, our contribution to another member's part is what our sent chunks decode to: the tally
    sketches it from the payloads of our send (not encoded a second time), and knows nothing without them."""
    from p2ptrain.net.tally import Tallies

    codec = get_codec("e3m0")
    res, values, pieces, _ = _result("e3m0", False)
    res = {**res, "part": 0}
    g = torch.Generator().manual_seed(9)
    flat = torch.randn(2 * N, generator=g)
    bounds = [(0, N), (N, 2 * N)]  # part 0 is the other member's, part 1 ours

    def tallies() -> Tallies:
        return Tallies(run="run", key="r", phase=0, me=1, members=["o", "me"], bounds=bounds, codec=codec,
                       flat=flat, own=flat[N:], chunk=CHUNK, honest=True)

    ours = [codec.encode(flat[a:b]) for a, b in chunk_bounds(N, CHUNK)]  # our share of part 0, as sent
    t = tallies()
    sent: list[bytes] = []
    t.sending(0, sent)
    tally = t.make(0, "o", res, N)
    assert tally is not None
    for c, ((a, b), p) in enumerate(zip(chunk_bounds(N, CHUNK), pieces, strict=True)):
        sent.append(ours[c])  # our chunk c is out before the owner can average chunk c
        tally.feed(c, p, values[a:b])
    keys = chunk_keys("run", "r", 0, 0, res, result_shas(res, N, codec), N)
    told = torch.cat([codec.decode(o, b - a) for o, (a, b) in zip(ours, chunk_bounds(N, CHUNK), strict=True)])
    assert tally.mine_sketch is not None
    assert torch.allclose(tally.mine_sketch, sketch(told, keys), rtol=1e-12, atol=1e-9)
    assert tally.mine_inf == float(told.abs().max())
    # without the payloads of our send (not registered) the tally has no sketch of ours: the audit sums it whole
    blind = tallies().make(0, "o", res, N)
    assert blind is not None and blind.mine is None


class _ZeroBoundFP32(type(get_codec("fp32"))):  # type: ignore[misc]
    """fp32 with its zero error bound spelled out: not :attr:`lossless`, so the tally takes its general sums."""

    def error_bound(self, decoded: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(decoded)


@pytest.mark.parametrize("lie", [False, True])
def test_a_lossless_codecs_sums_are_the_general_ones(lie: bool) -> None:
    """fp32's sums come from Σ|v|, the extremes of |v| and Σ v² (net/tally.py ``_lossless_sums``): the same values
    as the general sums over e0 = |v|·2^-24, bit for bit where they are exact."""
    res, values, pieces, _ = _result("fp32", lie)
    values = values.clone()
    values[7] = -values.abs().max() * 3  # the largest magnitude is a negative value
    values[11] = 0.0  # and the smallest is 0
    tallies = []
    for codec in (get_codec("fp32"), _ZeroBoundFP32()):
        tally = ChunkTally(run="run", key="r", phase=0, part=1, sender="o", res=res, numel=N, codec=codec,
                           judge=True, mine=None)
        for c, ((a, b), p) in enumerate(zip(chunk_bounds(N, CHUNK), pieces, strict=True)):
            tally.feed(c, p, values[a:b])
        tallies.append(tally)
    fast, general = tallies
    assert get_codec("fp32").lossless and not _ZeroBoundFP32().lossless and not get_codec("e3m0").lossless
    assert fast.over == general.over and fast.slack == general.slack and fast.e0_sq == general.e0_sq
    assert fast.abs_sum == pytest.approx(general.abs_sum, rel=1e-15)
    assert fast.over == pytest.approx(float(values.abs().max()), rel=1e-6) and fast.slack == 0.0
    assert torch.equal(fast.result, general.result)


@pytest.mark.parametrize("codec_name", ["fp32", "e3m0"])
def test_our_own_part_is_sketched_without_judging_it(codec_name: str) -> None:
    """Our own part's result is not judged by us (we made it): its tally sketches our share alone, from the same
    sign stream the result's chunks were keyed with, and sums nothing of the result."""
    tally, res, _, xs = _fed(codec_name, False, judge=False)
    mine = xs[0]
    keys = chunk_keys("run", "r", 0, 1, res, result_shas(res, N, get_codec(codec_name)), N)
    assert tally.mine_sketch is not None
    assert torch.allclose(tally.mine_sketch, sketch(mine, keys), rtol=1e-12, atol=1e-9)
    assert tally.mine_inf == float(mine.abs().max())
    assert not tally.result.any() and tally.abs_sum == 0.0 and tally.e0_sq == 0.0
