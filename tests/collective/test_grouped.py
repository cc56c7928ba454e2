"""The grouped sparse 2-bit codec (``topk2g4:F``, collective/grouped.py): byte counts by hand, a float64 reference,
idempotence and the error bound (what error feedback and verification rely on), and hostile payloads."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2ptrain.collective.codecs import get_codec, is_codec
from p2ptrain.collective.lowbit import pack_bits

from .test_lowbit import _data, elias_fano

HYP = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
NAMES = ["topk2g4:0.03", "topk2g4:0.01"]


def _size(k: int, n: int) -> int:
    """Bytes by hand: per block of 256 groups (1024 values) the header, low bits, high bitvector and 2-bit codes."""
    low = (256 // k).bit_length() - 1
    m = math.ceil(n / 4)
    nb = math.ceil(m / 256)
    last = m - (nb - 1) * 256
    s = (nb - 1) * k + min(k, last)
    high = (nb - 1) * (k + 256 // 2**low) + min(k, last) + math.ceil(last / 2**low)
    return 4 * nb + math.ceil(low * s / 8) + math.ceil(high / 8) + math.ceil(4 * s / 4)


def test_byte_counts_and_the_ratio_against_topk2() -> None:
    assert is_codec("topk2g4:0.03") and is_codec("topk2g4:0.2") and not is_codec("topk2g4:0.7")
    for name, k in (("topk2g4:0.03", 8), ("topk2g4:0.01", 3)):
        codec = get_codec(name)
        assert type(codec).slots() == k
        for n in (1, 4, 5, 1023, 1024, 1025, 5000, 262_145):
            assert codec.encoded_size(n) == _size(k, n) == len(codec.encode(torch.randn(n)))
    n = 1 << 20  # 3%: (8 groups × (5 + 2 + 4·2) + 32) bits per 1024 values, against topk2:0.03's 312
    assert get_codec("topk2:0.03").encoded_size(n) / get_codec("topk2g4:0.03").encoded_size(n) > 2.0


def _reference(x: torch.Tensor, k: int) -> torch.Tensor:
    """float64 reference of the decode, group by group (no packing)."""
    n = x.numel()
    x64 = torch.cat([x.double(), torch.zeros(-n % 4, dtype=torch.float64)])
    out = torch.zeros_like(x64)
    groups = x64.numel() // 4
    for b0 in range(0, groups, 256):
        gs = range(b0, min(groups, b0 + 256))
        score = {g: sum(abs(float(v)) for v in x64[4 * g : 4 * g + 4]) for g in gs}
        chosen = sorted(gs, key=lambda g: (-score[g], g))[: min(k, len(gs))]
        mags = [abs(float(x64[4 * g + j])) for g in chosen for j in range(4)]
        hi = float(torch.tensor(max(mags)).float().bfloat16().double())
        under = [m for m in mags if 0 < m and 2 * m < hi]
        mean = torch.tensor([sum(under) / len(under) if under else 0.0], dtype=torch.float32)
        lo = float(mean.view(torch.int32).bitwise_and(-65536).view(torch.float32))  # bfloat16, toward zero
        for g in chosen:
            for j in range(4):
                v = float(x64[4 * g + j])
                level = hi if hi > 0 and 2 * abs(v) >= hi else lo
                out[4 * g + j] = -level if v < 0 else level
    return out[:n]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_a_float64_reference(seed: int) -> None:
    codec = get_codec("topk2g4:0.03")
    x = _data(2500, seed)
    got = codec.decode(codec.encode(x), x.numel()).double()
    assert torch.equal(got, _reference(x, 8))


@pytest.mark.parametrize("name", NAMES)
@HYP
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**31 - 1), kind=st.integers(0, 2))
def test_idempotent_and_within_the_error_bound(name: str, n: int, seed: int, kind: int) -> None:
    codec = get_codec(name)
    x = _data(n, seed, kind)
    y = codec.decode(codec.encode(x), n)
    assert torch.equal(codec.decode(codec.encode(y), n), y)
    assert ((x.double() - y.double()).abs() <= codec.error_bound(y).double()).all()
    assert int((y != 0).sum()) <= 4 * type(codec).slots() * math.ceil(math.ceil(n / 4) / 256)


def _payload(lo: float, hi: float, groups: list[int], codes: list[int], n: int = 13, extra: bytes = b"") -> bytes:
    """A one-block topk2g4:0.03 payload for ``n`` values built by hand (8 slots; 4 codes a slot)."""
    header = torch.tensor([lo, hi], dtype=torch.bfloat16).view(torch.int16)
    return (header.numpy().tobytes() + elias_fano([(math.ceil(n / 4), groups)], 5)
            + pack_bits(torch.tensor(codes), 2).numpy().tobytes() + extra)


def test_a_hand_built_payload_decodes_and_hostile_ones_are_refused() -> None:
    codec = get_codec("topk2g4:0.03")
    # 13 values are 4 groups: fewer than 8 slots, so all 4 are sent (16 codes, 3 past the last value)
    codes = [1, 0, 2, 3] + [0] * 4 + [1] * 4 + [3, 0, 0, 0]
    out = codec.decode(_payload(0.5, 2.0, [0, 1, 2, 3], codes), 13)
    assert out.tolist() == [2.0, 0.5, -0.5, -2.0] + [0.5] * 4 + [2.0] * 4 + [-2.0]
    for groups, why in (([0, 1, 2, 4], "outside its block"), ([0, 1, 1, 3], "strictly increasing"),
                        ([1, 0, 2, 3], "strictly increasing")):
        with pytest.raises(ValueError, match=why):
            codec.decode(_payload(0.5, 2.0, groups, codes), 13)
    for lo, hi in ((1.0, 2.0), (3.0, 2.0), (-0.5, 2.0), (0.5, 0.0), (float("nan"), 2.0), (0.0, float("inf"))):
        with pytest.raises(ValueError, match="header"):
            codec.decode(_payload(lo, hi, [0, 1, 2, 3], codes), 13)
    with pytest.raises(ValueError, match="padding past"):
        codec.decode(_payload(0.5, 2.0, [0, 1, 2, 3], [*codes[:13], 1, 0, 0]), 13)
    with pytest.raises(ValueError, match="must be"):  # a longer payload: an oversized index set
        codec.decode(_payload(0.5, 2.0, [0, 1, 2, 3], codes, extra=b"\0"), 13)
