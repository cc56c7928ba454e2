"""Wire codecs of ``p2ptrain.collective.codecs``: byte counts, failures, error bounds against float64 references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from p2ptrain.collective.codecs import CODECS, Codec, get_codec

NAMES = ["fp32", "fp16", "bf16", "uint8", "fp8", "e3m0"]
LOWBIT = ["1bit", "2bit", "topk2", "topk2:0.03", "topk2g4:0.03"]  # behind error feedback: test_lowbit.py, test_grouped.py
F32_MAX = float(torch.finfo(torch.float32).max)
TINY = 1e-37  # absolute slack for subnormal inputs, far below any value that matters

# The autouse seeding fixture is harmless here: every test draws its data from explicit generators.
HYP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _size_formula(name: str, n: int) -> int:
    """The documented payload size of each codec for ``n`` values."""
    return {
        "fp32": 4 * n,
        "fp16": 2 * n,
        "bf16": 2 * n,
        "uint8": n + 8 * math.ceil(n / 1024),
        "fp8": n + 4 * math.ceil(n / 256),
        "e3m0": math.ceil(n / 2) + 4 * math.ceil(n / 64),
    }[name]


def _data(n: int, seed: int, log_scale: float = 0.0, offset: float = 0.0, kind: int = 0) -> torch.Tensor:
    """Reproducible float32 test vectors of several shapes of distribution (normal, heavy-tailed, sparse)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen, dtype=torch.float64)
    if kind == 1:  # heavy tails: a few values orders of magnitude above the rest
        x = x * torch.exp(3.0 * torch.randn(n, generator=gen, dtype=torch.float64))
    elif kind == 2:  # mostly zeros
        x = x * (torch.rand(n, generator=gen, dtype=torch.float64) < 0.1)
    return (x * 10.0**log_scale + offset).to(torch.float32)


finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
data_params = st.tuples(
    st.integers(1, 3000),  # n: several blocks of every codec
    st.integers(0, 2**31 - 1),  # seed
    st.floats(-30.0, 30.0),  # log10 of the magnitude
    st.sampled_from([0.0, 1.0, -1e3]),  # offset
    st.integers(0, 2),  # distribution kind
)


def _vector(params: tuple[int, int, float, float, int]) -> torch.Tensor:
    n, seed, log_scale, offset, kind = params
    return _data(n, seed, log_scale, offset * 10.0**log_scale, kind)


def _roundtrip(name: str, x: torch.Tensor) -> torch.Tensor:
    codec = get_codec(name)
    return codec.decode(codec.encode(x), x.numel())


# ----------------------------------------------------------------------------------------------------------
# Registry and byte counts
# ----------------------------------------------------------------------------------------------------------


def test_registry_names_and_unknown_codec() -> None:
    assert sorted(CODECS) == sorted(NAMES + LOWBIT)
    for name in NAMES + LOWBIT:
        codec = get_codec(name)
        assert isinstance(codec, Codec) and codec.name == name
    with pytest.raises(ValueError, match="unknown codec 'fp4'") as info:
        get_codec("fp4")
    for name in NAMES:
        assert name in str(info.value)


@pytest.mark.parametrize("name", NAMES)
@HYP
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**31 - 1))
@example(n=1, seed=0)
@example(n=2, seed=0)
@example(n=63, seed=0)
@example(n=64, seed=0)
@example(n=65, seed=0)
@example(n=255, seed=0)
@example(n=256, seed=0)
@example(n=257, seed=0)
@example(n=1023, seed=0)
@example(n=1024, seed=0)
@example(n=1025, seed=0)
def test_exact_byte_count(name: str, n: int, seed: int) -> None:
    codec = get_codec(name)
    x = _data(n, seed)
    data = codec.encode(x)
    assert isinstance(data, bytes)
    assert len(data) == codec.encoded_size(n) == _size_formula(name, n)
    y = codec.decode(data, n)
    assert y.dtype == torch.float32 and y.device.type == "cpu" and y.shape == (n,)


@pytest.mark.parametrize("name", NAMES)
def test_empty_tensor(name: str) -> None:
    codec = get_codec(name)
    assert codec.encoded_size(0) == 0
    assert codec.encode(torch.zeros(0)) == b""
    assert codec.decode(b"", 0).shape == (0,)


# ----------------------------------------------------------------------------------------------------------
# Failures: bad input, bad payloads
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_raises(name: str, bad: float) -> None:
    x = torch.randn(300)
    x[137] = bad
    with pytest.raises(ValueError, match=r"^non-finite values cannot be encoded$"):
        get_codec(name).encode(x)


@pytest.mark.parametrize("name", NAMES)
def test_float64_beyond_float32_range_raises(name: str) -> None:
    with pytest.raises(ValueError, match="non-finite"):
        get_codec(name).encode(torch.tensor([1.0, 1e300], dtype=torch.float64))


@pytest.mark.parametrize("name", NAMES)
def test_bad_input_types_and_shapes(name: str) -> None:
    codec = get_codec(name)
    with pytest.raises(ValueError, match="1-D"):
        codec.encode(torch.randn(4, 4))
    with pytest.raises(ValueError, match="1-D"):
        codec.encode(torch.tensor(1.0))
    with pytest.raises(TypeError):
        codec.encode(torch.arange(10))
    with pytest.raises(TypeError):
        codec.encode([1.0, 2.0])  # type: ignore[arg-type]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", [1, 64, 65, 1000, 1025])
def test_wrong_length_payload_raises(name: str, n: int) -> None:
    codec = get_codec(name)
    data = codec.encode(_data(n, 1))
    for bad in (data[:-1], data + b"\x00", b"", data[: len(data) // 2]):
        with pytest.raises(ValueError, match="bytes"):
            codec.decode(bad, n)
    if codec.encoded_size(n + 1) != len(data):  # e3m0: n = 2k-1 and 2k share a size (the pad nibble)
        with pytest.raises(ValueError, match="bytes"):
            codec.decode(data, n + 1)  # claims more values than were sent: must not read past the payload
    with pytest.raises(ValueError, match="bytes"):
        codec.decode(data, n + 1024)
    with pytest.raises(ValueError, match="numel"):
        codec.decode(data, -1)


@pytest.mark.parametrize("name", NAMES)
def test_decode_accepts_any_bytes_like(name: str) -> None:
    codec = get_codec(name)
    x = _data(100, 2)
    data = codec.encode(x)
    expected = codec.decode(data, 100)
    assert torch.equal(codec.decode(bytearray(data), 100), expected)
    assert torch.equal(codec.decode(memoryview(data), 100), expected)


def _f32_bytes(values: list[float]) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def test_payloads_that_decode_to_non_finite_values_raise() -> None:
    with pytest.raises(ValueError, match="non-finite"):
        get_codec("fp32").decode(_f32_bytes([1.0, math.nan]), 2)
    with pytest.raises(ValueError, match="non-finite"):
        get_codec("fp16").decode(np.asarray([1.0, np.inf], dtype="<f2").tobytes(), 2)
    with pytest.raises(ValueError, match="non-finite"):
        get_codec("fp8").decode(_f32_bytes([1.0]) + bytes([0x7F]), 1)  # e4m3fn NaN code
    with pytest.raises(ValueError, match="scale"):
        get_codec("fp8").decode(_f32_bytes([-1.0]) + bytes([0x38]), 1)
    with pytest.raises(ValueError, match="scale"):
        get_codec("fp8").decode(_f32_bytes([math.inf]) + bytes([0x38]), 1)
    with pytest.raises(ValueError, match="scale"):
        get_codec("e3m0").decode(_f32_bytes([math.nan]) + bytes([0x07]), 1)
    with pytest.raises(ValueError, match="scale"):
        get_codec("e3m0").decode(_f32_bytes([-2.0]) + bytes([0x07]), 1)
    with pytest.raises(ValueError, match="header"):
        get_codec("uint8").decode(_f32_bytes([2.0, 1.0]) + bytes([7]), 1)  # min > max
    with pytest.raises(ValueError, match="header"):
        get_codec("uint8").decode(_f32_bytes([0.0, math.inf]) + bytes([7]), 1)


# ----------------------------------------------------------------------------------------------------------
# Error bounds (float64 references)
# ----------------------------------------------------------------------------------------------------------


@HYP
@given(arrays(np.float32, st.integers(1, 300), elements=finite_f32))
def test_fp32_is_exact(values: np.ndarray) -> None:
    x = torch.from_numpy(values)
    y = _roundtrip("fp32", x)
    assert torch.equal(y.view(torch.int32), x.view(torch.int32))  # bit-exact, including -0.0 and subnormals


@pytest.mark.parametrize(
    ("name", "rel", "lo", "hi"), [("fp16", 2.0**-11, 2.0**-14, 65504.0), ("bf16", 2.0**-8, 1e-37, 1e38)]
)
@HYP
@given(data=st.data())
def test_half_precision_relative_error(name: str, rel: float, lo: float, hi: float, data: st.DataObject) -> None:
    """Round to nearest with p significant bits: relative error <= 2^-p within the normal range."""
    mag = data.draw(arrays(np.float64, st.integers(1, 300), elements=st.floats(math.log(lo), math.log(hi))))
    sign = data.draw(arrays(np.bool_, mag.shape))
    x = torch.from_numpy(np.where(sign, -1.0, 1.0) * np.exp(mag)).to(torch.float32)
    x = x.clamp(-hi, hi)  # exp(log(hi)) may land a hair outside the range
    x64 = x.double()
    err = (_roundtrip(name, x).double() - x64).abs()
    assert bool((err <= rel * x64.abs()).all())


def test_half_precision_saturates_instead_of_overflowing() -> None:
    y = _roundtrip("fp16", torch.tensor([1e6, -1e6, 70000.0]))
    assert y.tolist() == [65504.0, -65504.0, 65504.0]
    bf16_max = float(torch.finfo(torch.bfloat16).max)
    y = _roundtrip("bf16", torch.tensor([F32_MAX, -F32_MAX]))
    assert y.tolist() == [bf16_max, -bf16_max]


def _blocks(x: torch.Tensor, size: int) -> list[torch.Tensor]:
    return list(torch.split(x, size))


def _check_uint8(x: torch.Tensor) -> None:
    y = _roundtrip("uint8", x)
    for xb, yb in zip(_blocks(x.double(), 1024), _blocks(y.double(), 1024), strict=True):
        lo, hi = xb.min(), xb.max()
        # step/2 for the rounding, plus a few float32 ulps of the block's magnitude for the arithmetic.
        bound = (hi - lo) / 510 + 2.0**-20 * (torch.maximum(lo.abs(), hi.abs()) + (hi - lo)) + TINY
        assert bool(((xb - yb).abs() <= bound).all())
        if bool(lo == hi):
            assert torch.equal(xb, yb)  # a constant block decodes exactly


@HYP
@given(data_params)
@example((1025, 7, 0.0, 0.0, 0))
@example((3000, 8, 0.0, 1.0, 1))
def test_uint8_error_bound(params: tuple[int, int, float, float, int]) -> None:
    _check_uint8(_vector(params))


@HYP
@given(arrays(np.float32, st.integers(1, 2100), elements=finite_f32))
def test_uint8_error_bound_any_floats(values: np.ndarray) -> None:
    _check_uint8(torch.from_numpy(values))


def test_uint8_constant_and_extreme_blocks() -> None:
    x = torch.cat([torch.full((1024,), 3.7), torch.randn(1024), torch.full((5,), -2.5e-3)])
    y = _roundtrip("uint8", x)
    assert torch.equal(y[:1024], x[:1024]) and torch.equal(y[2048:], x[2048:])
    x = torch.tensor([-F32_MAX, F32_MAX, 0.0, 1.0])  # max - min overflows float32: still finite and bounded
    _check_uint8(x)
    assert _roundtrip("uint8", x)[:2].tolist() == [-F32_MAX, F32_MAX]


def _check_fp8(x: torch.Tensor) -> None:
    y = _roundtrip("fp8", x)
    for xb, yb in zip(_blocks(x.double(), 256), _blocks(y.double(), 256), strict=True):
        scale = xb.abs().max() / 448
        # e4m3 keeps 3 mantissa bits: half an ulp is <= 2^-4 of the (scaled) value in the normal range, and
        # half the subnormal spacing 2^-9 (i.e. scale * 2^-10) below it; the factor absorbs float32 rounding of
        # x / scale, of the scale itself and of the decode product.
        bound = (2.0**-4 * xb.abs() + scale * 2.0**-10) * (1 + 2.0**-18) + TINY
        assert bool(((xb - yb).abs() <= bound).all())


@HYP
@given(data_params)
@example((257, 3, 0.0, 0.0, 2))
def test_fp8_error_bound(params: tuple[int, int, float, float, int]) -> None:
    _check_fp8(_vector(params))


@HYP
@given(arrays(np.float32, st.integers(1, 600), elements=finite_f32))
def test_fp8_error_bound_any_floats(values: np.ndarray) -> None:
    _check_fp8(torch.from_numpy(values))


def test_fp8_zero_rows_and_saturation() -> None:
    x = torch.cat([torch.zeros(256), torch.randn(256), torch.zeros(3)])
    y = _roundtrip("fp8", x)
    assert bool(torch.isfinite(y).all())
    assert torch.equal(y[:256], x[:256]) and torch.equal(y[512:], x[512:])
    assert torch.equal(_roundtrip("fp8", torch.zeros(1000)), torch.zeros(1000))
    # The row's absmax maps onto e4m3's top value 448 and comes back (nearly) unchanged, even at float32's max.
    y = _roundtrip("fp8", torch.tensor([F32_MAX, -1.0, 0.5]))
    assert y[0].item() == pytest.approx(F32_MAX, rel=1e-6) and bool(torch.isfinite(y).all())


E3M0_LEVELS = [0.0] + [2.0 ** (k - 7) for k in range(1, 8)]  # magnitudes of codes 0..7, times the block scale


def _e3m0_reference(x: torch.Tensor) -> torch.Tensor:
    """Nearest level by brute force in float64 (ties to the larger magnitude), block by block.

    The scaled value is computed as the codec does, by one correctly rounded float32 division, so the reference
    checks the level selection (and not float32 division).
    """
    levels = torch.tensor(E3M0_LEVELS, dtype=torch.float64)
    out = []
    for xb in _blocks(x, 64):
        scale = xb.abs().max()
        v = (xb / scale if scale > 0 else xb).double()  # float32 division, then exact widening
        dist = (v.abs().unsqueeze(1) - levels).abs()  # (len, 8)
        # argmin picks the first minimum; scanning from the top level down breaks ties towards the larger one.
        k = 7 - dist.flip(1).argmin(dim=1)
        out.append(torch.sign(v) * levels[k] * scale.double())
    return torch.cat(out)


def _check_e3m0(x: torch.Tensor) -> None:
    y = _roundtrip("e3m0", x)
    assert torch.equal(y.double(), _e3m0_reference(x))
    for xb, yb in zip(_blocks(x.double(), 64), _blocks(y.double(), 64), strict=True):
        scale = xb.abs().max()
        # Every value is 0 or +-scale * 2^j, j in -6..0.
        ratio = (yb.abs() / scale) if scale > 0 else yb.abs()
        assert bool(torch.isin(ratio, torch.tensor(E3M0_LEVELS, dtype=torch.float64)).all()) or scale < 1e-30
        # Nearest power of two in the linear domain: the worst case sits on a midpoint 1.5 * 2^j, error 2^(j-1),
        # a third of the value; below the smallest level 2^-6 the error is at most half of it, scale * 2^-7.
        bound = torch.maximum(xb.abs() / 3, scale * 2.0**-7) * (1 + 2.0**-20) + TINY
        assert bool(((xb - yb).abs() <= bound).all())


@HYP
@given(data_params)
@example((1, 0, 0.0, 0.0, 0))
@example((63, 0, 0.0, 0.0, 0))
@example((65, 0, 0.0, 0.0, 2))
def test_e3m0_levels_and_error_bound(params: tuple[int, int, float, float, int]) -> None:
    _check_e3m0(_vector(params))


@HYP
@given(arrays(np.float32, st.integers(1, 200), elements=finite_f32))
def test_e3m0_any_floats(values: np.ndarray) -> None:
    _check_e3m0(torch.from_numpy(values))


def test_e3m0_rounding_cases() -> None:
    s = 2.0**-7  # half the smallest level, for scale 1
    cases = {
        1.0: 1.0,
        0.75: 1.0,  # midpoint between 0.5 and 1: ties away from zero
        0.7499: 0.5,
        0.3: 0.25,
        0.375: 0.5,
        -0.6: -0.5,
        -0.8: -1.0,
        3 * s: 2.0**-5,  # midpoint 1.5 * 2^-6
        1.49 * 2 * s: 2.0**-6,
        1.5 * s: 2.0**-6,  # between 0 and 2^-6, nearer the level
        s: 2.0**-6,  # exactly half the smallest level: tie away from zero
        0.99 * s: 0.0,
        -0.5 * s: 0.0,  # no negative zero either
        0.0: 0.0,
    }
    x = torch.tensor(list(cases), dtype=torch.float32)
    y = _roundtrip("e3m0", x)
    assert y.tolist() == pytest.approx([torch.tensor(v, dtype=torch.float32).item() for v in cases.values()], abs=0)
    assert not bool(torch.signbit(y[y == 0]).any())
    # Zero blocks and an odd count with a short last block.
    x = torch.cat([torch.zeros(64), torch.tensor([0.5, -2.0, 1e-3])])
    y = _roundtrip("e3m0", x)
    assert y.tolist() == [0.0] * 64 + [0.5, -2.0, 0.0]


# ----------------------------------------------------------------------------------------------------------
# Bit stability and idempotence
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_decode_is_deterministic_and_accepts_other_dtypes(name: str) -> None:
    codec = get_codec(name)
    x = _data(3001, 5, kind=1)
    data = codec.encode(x)
    assert torch.equal(codec.decode(data, x.numel()), codec.decode(data, x.numel()))
    assert codec.encode(x) == data
    assert codec.encode(x.double()) == data  # float64 -> float32 is exact for float32-valued input
    for dtype in (torch.float16, torch.bfloat16):
        xd = x.to(dtype)
        assert codec.encode(xd) == codec.encode(xd.float())
    strided = x[::3]  # a non-contiguous view encodes like its contiguous copy
    assert codec.encode(strided) == codec.encode(strided.clone())


@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16", "e3m0"])
@HYP
@given(params=data_params)
def test_reencoding_a_decoded_payload_is_exact(name: str, params: tuple[int, int, float, float, int]) -> None:
    """Decoded values are representable: the same bytes come back.

    e3m0: the block absmax decodes to exactly the scale (code 7 = scale * 2^0) and every other value to
    scale * 2^j, so re-encoding finds the same scale and codes (for scales in float32's normal range).
    """
    codec = get_codec(name)
    x = _vector(params)
    data = codec.encode(x)
    assert codec.encode(codec.decode(data, x.numel())) == data


@HYP
@given(params=data_params)
def test_fp8_reencoding_keeps_codes(params: tuple[int, int, float, float, int]) -> None:
    """The codes survive re-encoding but a row scale may move by one float32 ulp.

    Re-encoding computes the scale as (448 * scale) / 448, which differs from scale in the last bit for about
    one float32 value in nine; the e4m3 codes are unaffected because an ulp is far below e4m3's spacing.
    """
    codec = get_codec("fp8")
    x = _vector(params)
    rows = math.ceil(x.numel() / 256)
    data = codec.encode(x)
    y = codec.decode(data, x.numel())
    again = codec.encode(y)
    assert again[4 * rows :] == data[4 * rows :]
    s0 = np.frombuffer(data, dtype="<f4", count=rows)
    s1 = np.frombuffer(again, dtype="<f4", count=rows)
    assert np.all(np.abs(s1.astype(np.float64) - s0) <= 2.0**-23 * s0)


def test_uint8_reencoding_is_exact_for_well_conditioned_blocks() -> None:
    """min and max decode exactly, so the same headers come back; the codes do too whenever a quantisation
    step is far above the float32 rounding of the decoded values (blocks not nearly constant relative to their
    magnitude), as here. A block like [1000, 1000 + 1e-5] does not meet that condition."""
    codec = get_codec("uint8")
    for seed in range(5):
        x = _data(5000, seed, kind=seed % 3)
        data = codec.encode(x)
        assert codec.encode(codec.decode(data, x.numel())) == data




def test_stream_chunks_cut_parts_into_pieces_at_block_boundaries() -> None:
    """A part is cut into about 16 chunks (never below 16 Ki values, never above the most), each a multiple of
    1024 values: every codec's block divides it, so a part encoded chunk by chunk decodes as encoded whole."""
    from p2ptrain.collective.butterfly import chunk_bounds, stream_chunk

    assert stream_chunk(100) == 1 << 14 and stream_chunk(8_000_000) == 1 << 18
    assert stream_chunk(524_288) == 32_768 and stream_chunk(524_288, 1024) == 1024
    for part in (20_000, 131_072, 524_289, 3_000_001):
        c = stream_chunk(part)
        assert c % 1024 == 0 and (part <= c or len(chunk_bounds(part, c)) <= 17)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(300_000, generator=g)
    c = stream_chunk(x.numel())
    for name in CODECS:
        codec = get_codec(name)
        whole = codec.decode(codec.encode(x), x.numel())
        pieces = torch.cat([codec.decode(codec.encode(x[a:b]), b - a) for a, b in chunk_bounds(x.numel(), c)])
        assert torch.equal(whole, pieces), name
