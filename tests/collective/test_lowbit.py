"""The 2-bit codecs (``2bit``, ``topk2``, ``topk2:0.03``): byte counts, hand-computed payloads, a float64
reference, idempotence (what error feedback relies on), error bounds and hostile payloads."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2ptrain.collective.codecs import get_codec
from p2ptrain.collective.lowbit import TopK2Codec, pack_bits, two_levels, unpack_bits

SPARSE = ["topk2", "topk2:0.03"]
LOWBIT = ["1bit", "2bit", *SPARSE]
HYP = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _data(n: int, seed: int, kind: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen, dtype=torch.float64)
    if kind == 1:  # heavy tails
        x = x * torch.exp(3.0 * torch.randn(n, generator=gen, dtype=torch.float64))
    elif kind == 2:  # mostly zeros: blocks with fewer nonzeros than slots
        x = x * (torch.rand(n, generator=gen, dtype=torch.float64) < 0.003)
    return x.to(torch.float32)


def _size(name: str, n: int) -> int:
    if name == "1bit":
        return 2 * math.ceil(n / 256) + math.ceil(n / 8)
    if name == "2bit":
        return 2 * math.ceil(n / 128) + math.ceil(n / 4)
    k, low = {"topk2": (10, 6), "topk2:0.03": (31, 5)}[name]  # low bits: ⌊log2(1024 / K)⌋
    nb = math.ceil(n / 1024)
    last = n - (nb - 1) * 1024 if nb else 0
    s = (nb - 1) * k + min(k, last) if nb else 0
    high = (nb - 1) * (k + 1024 // 2**low) + min(k, last) + math.ceil(last / 2**low) if nb else 0
    return 4 * nb + math.ceil(low * s / 8) + math.ceil(high / 8) + math.ceil(s / 4)


def _bits_to_bytes(bits: list[int]) -> bytes:
    """LSB first, zero padding (a plain loop: the reference of pack_bits for a list of 0/1)."""
    out = bytearray(math.ceil(len(bits) / 8))
    for i, b in enumerate(bits):
        out[i // 8] |= b << (i % 8)
    return bytes(out)


def elias_fano(blocks: list[tuple[int, list[int]]], low: int) -> bytes:
    """The index section of a topk2 payload for ``blocks`` of (length, indices), by hand: every index's low ``low``
    bits (LSB first), then each block's high bitvector (slot j sets bit (i_j >> low) + j), each section padded to a
    byte. The indices are taken as given (sorted or not): the decoder must judge them."""
    lows = [(i >> b) & 1 for _, idx in blocks for i in idx for b in range(low)]
    highs: list[int] = []
    for length, idx in blocks:
        vec = [0] * (len(idx) + math.ceil(length / 2**low))
        for j, i in enumerate(idx):
            vec[(i >> low) + j] = 1
        highs += vec
    return _bits_to_bytes(lows) + _bits_to_bytes(highs)


@pytest.mark.parametrize("name", LOWBIT)
@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 9, 10, 11, 127, 128, 129, 1023, 1024, 1025, 3000, 5000])
def test_byte_counts(name: str, n: int) -> None:
    codec = get_codec(name)
    assert codec.encoded_size(n) == _size(name, n)
    assert len(codec.encode(_data(n, n))) == _size(name, n)


def test_payload_ratios() -> None:
    n = 1 << 20
    assert 4 * n / get_codec("topk2").encoded_size(n) > 237  # (10·(6 + 3) + 16 + 32) bits per 1024 values
    assert 4 * n / get_codec("topk2:0.03").encoded_size(n) > 105  # (31·(5 + 3) + 32 + 32)
    assert 4 * n / get_codec("2bit").encoded_size(n) > 15


def test_two_bit_hand_computed() -> None:
    """absmax 3 (bf16 0x4040); |x| >= 2 codes the high level: 3 → +3, -1 → -1, 0.5 → +1, -2.5 → -3."""
    codec = get_codec("2bit")
    x = torch.tensor([3.0, -1.0, 0.5, -2.5])
    data = codec.encode(x)
    # codes 0b01, 0b10, 0b00, 0b11, first in the low bits: 1 + 2·4 + 0·16 + 3·64 = 201
    assert data == bytes([0x40, 0x40, 201])
    assert codec.decode(data, 4).tolist() == [3.0, -1.0, 1.0, -3.0]


def test_topk2_hand_computed() -> None:
    """A block of 12 values keeps min(10, 12) = 10; the two smallest magnitudes decode to 0. The levels, by
    2-means from (1, 8): split at 4.5, the sides {1, 1.5, 2, 3, 4} and {4.5, 5, 6, 7, 8} average 2.3 and 6.1
    (6.1 >= 8/2); split again at 4.2: the same sides, done. In bfloat16 (7 mantissa bits) 2.296875 and 6.09375;
    magnitudes >= (2.296875 + 6.09375)/2 = 4.1953125 code hi."""
    codec = get_codec("topk2")
    x = torch.tensor([0.0, 8.0, -1.0, 2.0, -5.0, 0.25, 4.0, -7.0, 1.5, 3.0, -6.0, 4.5])
    out = codec.decode(codec.encode(x), 12)
    lo, hi = 2.296875, 6.09375
    assert out.tolist() == [0.0, hi, -lo, lo, -hi, 0.0, lo, -hi, lo, lo, -hi, hi]
    data = codec.encode(x)
    header = torch.frombuffer(bytearray(data[:4]), dtype=torch.int16).view(torch.bfloat16).float().tolist()
    assert header == [lo, hi]
    # indices 1, 2, 3, 4, 6, 7, 8, 9, 10, 11: low 6 bits are the indices themselves (60 bits: 8 bytes); all high
    # parts 0, so slot j sets bit j of an 11-bit vector (10 slots + ⌈12 / 64⌉ bucket): 0x3FF (2 bytes)
    idx, clean = unpack_bits(torch.frombuffer(bytearray(data[4:4 + 8]), dtype=torch.uint8), 10, 6)
    assert clean and idx.tolist() == [1, 2, 3, 4, 6, 7, 8, 9, 10, 11]
    assert data[12:14] == bytes([0xFF, 0x03]) and len(data) == 4 + 8 + 2 + 3
    assert data[4:14] == elias_fano([(12, [1, 2, 3, 4, 6, 7, 8, 9, 10, 11])], 6)


def _reference_topk2(x: torch.Tensor, k: int) -> torch.Tensor:
    """float64 reference of topk2's decode, block by block (no packing)."""
    x64 = x.double()
    out = torch.zeros_like(x64)
    for a in range(0, x.numel(), 1024):
        blk = x64[a : a + 1024]
        kk = min(k, blk.numel())
        order = sorted(range(blk.numel()), key=lambda i: (-abs(float(blk[i])), i))[:kk]
        mags = [abs(float(blk[i])) for i in order]
        lo, hi = min(mags), max(mags)
        for _ in range(4):  # 2-means from (smallest, largest), the upper level at least half the largest
            up = [m for m in mags if 2 * m >= lo + hi]
            down = [m for m in mags if 2 * m < lo + hi]
            hi = max(sum(up) / len(up), max(mags) / 2)
            lo = sum(down) / len(down) if down else hi
        lo = float(torch.tensor(lo).float().bfloat16().double())
        hi = float(torch.tensor(hi).float().bfloat16().double())
        for i in order:
            m = abs(float(blk[i]))
            level = hi if (lo == hi and hi > 0) or (hi > lo and 2 * m >= lo + hi) else lo
            out[a + i] = -level if float(blk[i]) < 0 else level
    return out


@pytest.mark.parametrize("name", SPARSE)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_topk2_matches_a_float64_reference(name: str, seed: int) -> None:
    codec = get_codec(name)
    x = _data(2500, seed)
    got = codec.decode(codec.encode(x), x.numel()).double()
    assert torch.equal(got, _reference_topk2(x, type(codec).slots()))


def test_one_bit_hand_computed() -> None:
    """Two blocks (256 + 3 values): the first all ±2 but one 0 (mean |x| = 510/256 = 1.9921875, exact in bfloat16),
    the last [-1, 0.5, 4.5] (mean 2.0); signs LSB first, 1 for a negative value (0 codes +s)."""
    codec = get_codec("1bit")
    first = [2.0 if i % 3 else -2.0 for i in range(256)]
    first[5] = 0.0
    x = torch.tensor([*first, -1.0, 0.5, 4.5])
    data = codec.encode(x)
    assert len(data) == 2 * 2 + math.ceil(259 / 8)
    header = torch.frombuffer(bytearray(data[:4]), dtype=torch.int16).view(torch.bfloat16).float().tolist()
    assert header == [1.9921875, 2.0]
    assert data[4:] == _bits_to_bytes([1 if v < 0 else 0 for v in x.tolist()])
    out = codec.decode(data, 259).tolist()
    assert out == [-1.9921875 if v < 0 else 1.9921875 for v in first] + [-2.0, 2.0, 2.0]


def _one_bit_level(blk: list[float], v: float) -> float:
    s = float(torch.tensor(sum(abs(u) for u in blk) / len(blk)).float().bfloat16().double())
    return -s if v < 0 else s


def _two_bit_level(blk: list[float], v: float) -> float:
    s = float(torch.tensor(max(abs(u) for u in blk)).float().bfloat16().double())
    level = s if abs(v) >= s * 2 / 3 else s / 3
    return -level if v < 0 else level


@pytest.mark.parametrize("name,block,level", [("1bit", 256, _one_bit_level), ("2bit", 128, _two_bit_level)])
def test_dense_low_bit_matches_a_float64_reference(name: str, block: int, level: Callable[[list[float], float], float]
                                                   ) -> None:
    codec = get_codec(name)
    x = _data(1000, 3, kind=1)
    got = codec.decode(codec.encode(x), x.numel()).double()
    ref = torch.zeros(1000, dtype=torch.float64)
    for a in range(0, 1000, block):
        blk = x[a : a + block].double().tolist()
        for i, v in enumerate(blk):
            ref[a + i] = level(blk, v)
    assert torch.allclose(got, ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", LOWBIT)
@HYP
@given(n=st.integers(1, 4000), seed=st.integers(0, 2**31 - 1), kind=st.integers(0, 2))
def test_idempotent_and_within_the_error_bound(name: str, n: int, seed: int, kind: int) -> None:
    """decode(encode(y)) == y for a decoded y (so an owner receives exactly what error feedback assumed),
    and |x − decoded| <= error_bound(decoded) against a float64 reference."""
    codec = get_codec(name)
    x = _data(n, seed, kind)
    data = codec.encode(x)
    y = codec.decode(data, n)
    again = codec.encode(y)
    assert torch.equal(codec.decode(again, n), y)
    assert ((x.double() - y.double()).abs() <= codec.error_bound(y).double()).all()


def test_pack_bits_round_trips() -> None:
    for bits in (2, 10):
        for n in (0, 1, 3, 4, 5, 17, 100):
            v = torch.randint(0, 2**bits, (n,))
            packed = pack_bits(v, bits)
            assert packed.numel() == math.ceil(n * bits / 8)
            back, clean = unpack_bits(packed, n, bits)
            assert clean and torch.equal(back, v)


# -- hostile payloads -----------------------------------------------------------------------------------------


def topk2_payload(lo: float, hi: float, indices: list[int], codes: list[int], extra: bytes = b"") -> bytes:
    """A one-block topk2 payload built by hand (whatever the indices: the decoder must judge them)."""
    header = torch.tensor([lo, hi], dtype=torch.bfloat16).view(torch.int16)
    return (header.numpy().tobytes() + elias_fano([(13, indices)], 6)
            + pack_bits(torch.tensor(codes), 2).numpy().tobytes() + extra)


def test_a_hand_built_payload_decodes() -> None:
    data = topk2_payload(1.0, 2.0, [0, 3, 5, 6, 7, 8, 9, 10, 11, 12], [1, 0, 2, 3, 0, 0, 0, 0, 0, 1])
    out = get_codec("topk2").decode(data, 13)
    assert out[:7].tolist() == [2.0, 0.0, 0.0, 1.0, 0.0, -1.0, -2.0]


@pytest.mark.parametrize(("indices", "why"), [
    ([0, 3, 5, 6, 7, 8, 9, 10, 11, 13], "outside its block"),  # 13 is past a 13-value block
    ([0, 3, 3, 6, 7, 8, 9, 10, 11, 12], "strictly increasing"),  # duplicated
    ([0, 5, 3, 6, 7, 8, 9, 10, 11, 12], "strictly increasing"),  # unsorted
])
def test_hostile_index_sets_are_refused(indices: list[int], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        get_codec("topk2").decode(topk2_payload(1.0, 2.0, indices, [0] * 10), 13)


def test_oversized_and_malformed_headers_are_refused() -> None:
    codec = get_codec("topk2")
    good = [0, 3, 5, 6, 7, 8, 9, 10, 11, 12]
    with pytest.raises(ValueError, match="must be"):  # one slot more than the block has: a longer payload
        codec.decode(topk2_payload(1.0, 2.0, [*good, 1], [0] * 11), 13)
    with pytest.raises(ValueError, match="must be"):
        codec.decode(topk2_payload(1.0, 2.0, good, [0] * 10, extra=b"\0"), 13)
    for lo, hi in ((2.0, 1.0), (-1.0, 1.0), (float("nan"), 1.0), (0.0, float("inf"))):
        with pytest.raises(ValueError, match="header"):
            codec.decode(topk2_payload(lo, hi, good, [0] * 10), 13)
    data = bytearray(topk2_payload(1.0, 2.0, good, [0] * 10))
    data[-1] |= 0xF0  # padding bits after the 10 codes (20 bits: 4 padding bits in the last byte)
    with pytest.raises(ValueError, match="padding"):
        codec.decode(bytes(data), 13)


def test_a_high_bitvector_without_one_set_bit_per_slot_is_refused() -> None:
    codec = get_codec("topk2")
    good = topk2_payload(1.0, 2.0, [0, 3, 5, 6, 7, 8, 9, 10, 11, 12], [0] * 10)
    assert codec.decode(good, 13).count_nonzero() == 10
    high = 4 + 8  # the 11-bit high vector: bits 0..9 set (every high part 0), bit 10 clear
    for byte, flip in ((high + 1, 0x04), (high, 0x01)):  # an 11th set bit; a slot without one
        data = bytearray(good)
        data[byte] ^= flip
        with pytest.raises(ValueError, match="one set bit per slot"):
            codec.decode(bytes(data), 13)
    # a high part of 1 (index 64 + low bits) is past a 13-value block
    with pytest.raises(ValueError, match="outside its block"):
        codec.decode(topk2_payload(1.0, 2.0, [0, 3, 5, 6, 7, 8, 9, 10, 11, 64], [0] * 10), 13)


@pytest.mark.parametrize("name", ["1bit", "2bit"])
def test_dense_low_bit_refuses_bad_scales_and_padding(name: str) -> None:
    codec = get_codec(name)
    for s in (-1.0, float("inf"), float("nan")):
        scale = torch.tensor([s], dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
        with pytest.raises(ValueError, match="scale"):
            codec.decode(scale + b"\0", 3)
    # 3 values: 2bit's codes fill 6 bits of the byte, 1bit's signs 3; the top two bits are padding either way
    with pytest.raises(ValueError, match="padding"):
        codec.decode(b"\x40\x40\xc0", 3)
    # scale 3.0; 1bit: signs 1, 0, 1 (all of magnitude 3); 2bit: codes 01, 01, 00 (levels s, s, s/3)
    assert codec.decode(b"\x40\x40\x05", 3).tolist() == ([-3.0, 3.0, -3.0] if name == "1bit" else [3.0, 3.0, 1.0])


def test_slots_of_the_presets() -> None:
    assert TopK2Codec.slots() == 10 and get_codec("topk2:0.03").slots() == 31


@HYP
@given(rows=st.integers(1, 8), k=st.integers(1, 200), seed=st.integers(0, 2**31 - 1), kind=st.integers(0, 2))
def test_two_levels_code_no_worse_than_the_extremes_and_within_hi(rows: int, k: int, seed: int, kind: int) -> None:
    """The 2-means levels never code a row's magnitudes with a larger squared error than its smallest and largest
    did (each of Lloyd's steps lowers it, the floor at half the largest included), and no magnitude is off by more
    than ``hi`` (the codec's error bound)."""
    mags = _data(rows * k, seed, kind).abs().view(rows, k).double()
    lo, hi = two_levels(mags.float())
    lo, hi = lo.double().unsqueeze(1), hi.double().unsqueeze(1)
    mn, mx = mags.amin(dim=1, keepdim=True), mags.amax(dim=1, keepdim=True)

    def sse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        coded = torch.where(2 * mags >= a + b, b, a)
        return ((mags - coded) ** 2).sum(dim=1)

    assert bool((sse(lo, hi) <= sse(mn, mx) * (1 + 1e-5) + 1e-30).all())
    assert bool((lo <= hi).all()) and bool((lo >= mn * (1 - 1e-6)).all()) and bool((hi <= mx * (1 + 1e-6)).all())
    assert bool(((mags - torch.where(2 * mags >= lo + hi, hi, lo)).abs() <= hi * (1 + 1e-6)).all())
