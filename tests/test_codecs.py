"""Tests for gossip.codecs: round trips and stated error bounds per codec and dtype, malformed payloads,
the codec registry, and top-k error feedback conserving what it has not sent yet."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gossip.codecs import (
    CODEC_TYPES,
    Bf16Codec,
    ErrorFeedback,
    Fp16Codec,
    Fp32Codec,
    Int8Codec,
    TopKCodec,
    bfloat16_bits,
    codec_from_wire,
    get_codec,
    kernels,
)
from gossip.errors import BadSchema, NonFiniteValues, UnknownCodec

pytestmark = pytest.mark.unit

DTYPES = [np.float32, np.float16, np.float64]
FLOAT32_MAX = float(np.finfo(np.float32).max)
BF16_LIMIT = 3.3961e38  # values from here on would round to bfloat16 infinity
SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=7)


def finite_arrays(dtype: type, limit: float, shape: st.SearchStrategy = SHAPES) -> st.SearchStrategy[np.ndarray]:
    width = np.dtype(dtype).itemsize * 8
    bound = np.asarray(min(limit, float(np.finfo(dtype).max)), dtype)  # representable in dtype, not above limit
    if float(bound) > limit:
        bound = np.nextafter(bound, dtype(0))
    bound = float(bound)
    elements = st.floats(-bound, bound, allow_nan=False, allow_infinity=False, width=width)
    return hnp.arrays(dtype, shape, elements=elements)


def roundtrip(codec, x: np.ndarray) -> np.ndarray:
    encoded = codec.encode(x)
    assert len(encoded) == codec.encoded_nbytes(x.size)
    out = codec.decode(bytes(encoded), x.size, x.dtype)
    assert out.dtype == x.dtype and out.shape == (x.size,)
    return out.reshape(x.shape)


def as_f64(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def bf16_reference(x32: np.ndarray) -> np.ndarray:
    """Round to nearest bfloat16, ties to even, from the definition: pick the nearer of the two neighbours."""
    u = x32.reshape(-1).view(np.uint32).astype(np.uint64)
    low = (u >> 16).astype(np.uint32)
    high = low + 1
    as_float = lambda bits: (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)  # noqa: E731
    x = x32.reshape(-1).astype(np.float64)
    d_low, d_high = np.abs(x - as_float(low)), np.abs(as_float(high) - x)
    pick_high = (d_high < d_low) | ((d_high == d_low) & (low % 2 == 1))
    return np.where(pick_high, high, low).astype(np.uint16)


@settings(deadline=None, max_examples=60)
@given(st.sampled_from(DTYPES).flatmap(lambda dt: finite_arrays(dt, FLOAT32_MAX)))
def test_fp32_is_exact_up_to_float32(x: np.ndarray) -> None:
    out = roundtrip(Fp32Codec(), x)
    np.testing.assert_array_equal(out, x.astype(np.float32).astype(x.dtype))


@settings(deadline=None, max_examples=80)
@given(st.sampled_from(DTYPES).flatmap(lambda dt: finite_arrays(dt, 65504.0)))
def test_fp16_rounds_to_nearest_even_within_bound(x: np.ndarray) -> None:
    out = roundtrip(Fp16Codec(), x)
    x32 = x.astype(np.float32)
    # bit-identical to numpy's own float32 -> float16 cast (round to nearest even)
    np.testing.assert_array_equal(out.astype(np.float16).view(np.uint16), x32.astype(np.float16).view(np.uint16))
    err = np.abs(as_f64(out) - as_f64(x))
    bound = 2.0**-11 * np.abs(as_f64(x)) + 2.0**-25 + 2.0**-24 * np.abs(as_f64(x)) * (x.dtype == np.float64)
    assert np.all(err <= bound)


@settings(deadline=None, max_examples=80)
@given(st.sampled_from(DTYPES).flatmap(lambda dt: finite_arrays(dt, 65407.0 if dt == np.float16 else 3.39e38)))
def test_bf16_rounds_to_nearest_even_within_bound(x: np.ndarray) -> None:
    out = roundtrip(Bf16Codec(), x)
    x32 = x.astype(np.float32)
    np.testing.assert_array_equal(out.astype(np.float32).reshape(-1).view(np.uint32) >> 16, bf16_reference(x32))
    err = np.abs(as_f64(out) - as_f64(x))
    bound = 2.0**-8 * np.abs(as_f64(x)) + 2.0**-134 + 2.0**-24 * np.abs(as_f64(x)) * (x.dtype == np.float64)
    assert np.all(err <= bound)


int8_cases = st.tuples(
    st.sampled_from(DTYPES).flatmap(
        lambda dt: finite_arrays(dt, FLOAT32_MAX / 2, hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=40))
    ),
    st.sampled_from([1, 3, 16, 256]),
)


@settings(deadline=None, max_examples=80)
@given(int8_cases)
def test_int8_blockwise_error_bound(case: tuple[np.ndarray, int]) -> None:
    x, block = case
    codec = Int8Codec(block=block)
    encoded = bytes(codec.encode(x))
    out = codec.decode(encoded, x.size, x.dtype)
    nblocks = -(-x.size // block)
    scales = np.frombuffer(encoded, "<f4", count=nblocks).astype(np.float64)
    flat = as_f64(x.reshape(-1))
    for b in range(nblocks):
        span = slice(b * block, (b + 1) * block)
        amax = np.abs(flat[span]).max()
        err = np.abs(as_f64(out[span]) - flat[span])
        if amax < 2.0**-100:
            assert scales[b] == 0 and np.all(err < 2.0**-100)
        else:
            assert scales[b] == pytest.approx(amax / 127, rel=2e-7)
            bound = scales[b] * (0.5 + 2.0**-14) + 2.0**-24 * amax * (x.dtype == np.float64)
            if x.dtype == np.float16:  # the decoded value is rounded once more, into the float16 tensor
                bound = bound + 2.0**-11 * np.abs(as_f64(out[span])) + 2.0**-25
            assert np.all(err <= bound)


@settings(deadline=None, max_examples=80)
@given(st.sampled_from(DTYPES).flatmap(lambda dt: finite_arrays(dt, FLOAT32_MAX)), st.sampled_from([0.01, 0.2, 0.5, 1.0]))
def test_topk_sends_the_largest_entries_exactly(x: np.ndarray, ratio: float) -> None:
    codec = TopKCodec(ratio)
    out = roundtrip(codec, x).reshape(-1)
    x32 = x.astype(np.float32).astype(x.dtype).reshape(-1)
    k = codec.k(x.size)
    assert k == (0 if x.size == 0 else min(x.size, max(1, math.ceil(ratio * x.size))))
    sent = np.zeros(x.size, bool)
    sent[np.frombuffer(bytes(codec.encode(x)), "<u4", count=k)] = True
    assert sent.sum() == k
    np.testing.assert_array_equal(out[sent], x32[sent])
    assert not np.any(out[~sent])
    if 0 < k < x.size:
        assert np.abs(x32[sent]).min() >= np.abs(x32[~sent]).max()


def test_fp16_refuses_values_beyond_its_range() -> None:
    codec = Fp16Codec()
    np.testing.assert_array_equal(roundtrip(codec, np.array([65504.0, -65504.0], np.float32)), [65504.0, -65504.0])
    for bad in (65504.5, -70000.0, 1e30, np.inf, np.nan):
        x = np.zeros(300000, np.float32)
        x[123456] = bad
        with pytest.raises(NonFiniteValues, match="element 123456"):
            codec.encode(x)


def test_fp16_keeps_subnormals_exact_across_blocks() -> None:
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(400000) * rng.choice([1e-9, 1e-6, 1e-4, 1.0, 1e3], 400000)).astype(np.float32)
    bits = np.frombuffer(bytes(Fp16Codec().encode(x)), np.uint16)
    np.testing.assert_array_equal(bits, x.astype(np.float16).view(np.uint16))


def test_bf16_refuses_overflow_and_non_finite() -> None:
    for bad in (3.4e38, -3.4e38, np.inf, np.nan):
        with pytest.raises(NonFiniteValues):
            Bf16Codec().encode(np.array([1.0, bad], np.float32))
    # 65504 is a float16, but its nearest bfloat16 (65536) is not: a float16 tensor could not take it back
    with pytest.raises(NonFiniteValues):
        Bf16Codec().encode(np.array([65504.0], np.float16))
    assert Bf16Codec().decode(bytes(Bf16Codec().encode(np.array([65376.0], np.float16))), 1, np.float16)[0] == 65280
    assert float(Bf16Codec().decode(bytes(Bf16Codec().encode(np.array([3.39e38], np.float32))), 1)[0]) < np.inf


def test_bfloat16_bits_keeps_nan_and_rounds_ties_to_even() -> None:
    # 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0);
    # 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): rounds up
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8, 3.4e38, -np.inf], np.float32)
    np.testing.assert_array_equal(bfloat16_bits(x), [0x3F80, 0x3F82, 0x7F80, 0xFF80])
    nan_with_low_payload = np.array([0x7F800001, 0xFF800001, 0x7FC00000], np.uint32).view(np.float32)
    back = (bfloat16_bits(nan_with_low_payload).astype(np.uint32) << 16).view(np.float32)
    assert np.isnan(back).all()


@pytest.mark.parametrize("codec", [Fp32Codec(), Fp16Codec(), Bf16Codec(), Int8Codec(), TopKCodec(0.5)])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_encoding_refuses_non_finite_input(codec, bad: float) -> None:
    for dtype in DTYPES:
        x = np.arange(1000, dtype=dtype)
        x[777] = bad
        with pytest.raises(NonFiniteValues):
            codec.encode(x)


@pytest.mark.parametrize("codec", [Fp32Codec(), Bf16Codec(), Int8Codec(), TopKCodec(0.5)])
def test_float64_beyond_float32_range_is_refused(codec) -> None:
    with pytest.raises(NonFiniteValues):
        codec.encode(np.array([1.0, 1e39], np.float64))


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.uint16, np.bool_, np.complex64])
def test_non_float_dtypes_are_rejected(dtype) -> None:
    for codec in (Fp32Codec(), Fp16Codec(), Int8Codec(), TopKCodec(0.5)):
        with pytest.raises(TypeError, match="float32, float16 or float64"):
            codec.encode(np.zeros(4, dtype))


@pytest.mark.parametrize("codec", [Fp32Codec(), Fp16Codec(), Bf16Codec(), Int8Codec(), TopKCodec(0.5)])
def test_decoded_arrays_are_fresh_and_writable(codec) -> None:
    x = np.linspace(-1, 1, 1000, dtype=np.float32)
    buf = bytes(codec.encode(x))
    out = codec.decode(buf, x.size)
    assert out.flags.writeable and out.flags.owndata
    out[:] = 7
    np.testing.assert_array_equal(codec.decode(buf, x.size), roundtrip(codec, x))


def test_payloads_with_non_finite_values_are_refused() -> None:
    with pytest.raises(NonFiniteValues):
        Fp32Codec().decode(np.array([1, np.nan], "<f4").tobytes(), 2)
    with pytest.raises(NonFiniteValues, match="element 1"):
        Fp16Codec().decode(np.array([0x3C00, 0x7C00], "<u2").tobytes(), 2)  # 1.0, +inf
    with pytest.raises(NonFiniteValues):
        Fp16Codec().decode(np.array([0xFE00], "<u2").tobytes(), 1, np.float16)  # NaN
    with pytest.raises(NonFiniteValues):
        Bf16Codec().decode(np.array([0x3F80, 0xFF80], "<u2").tobytes(), 2)  # 1.0, -inf
    # finite in float32, but not representable in a float16 tensor
    with pytest.raises(NonFiniteValues, match="float16"):
        Fp32Codec().decode(np.array([1e5], "<f4").tobytes(), 1, np.float16)


def test_int8_payload_scales_are_checked() -> None:
    codec = Int8Codec(block=2)
    values = np.array([127, -127, 5], np.int8).tobytes()

    def payload(*scales: float) -> bytes:
        return np.array(scales, "<f4").tobytes() + values

    np.testing.assert_allclose(codec.decode(payload(0.5, 2.0), 3), [63.5, -63.5, 10.0])
    with pytest.raises(NonFiniteValues):
        codec.decode(payload(np.nan, 1.0), 3)
    with pytest.raises(NonFiniteValues):
        codec.decode(payload(1.0, np.inf), 3)
    with pytest.raises(NonFiniteValues, match="overflow"):
        codec.decode(payload(1.0, 3e36), 3)
    with pytest.raises(BadSchema, match="negative"):
        codec.decode(payload(-1.0, 1.0), 3)
    with pytest.raises(BadSchema):
        codec.decode(payload(1.0, 1.0)[:-1], 3)


def test_int8_sends_tiny_blocks_as_zeros() -> None:
    x = np.array([1e-35, -3e-36, 0.0, 0.0, 1.0, -0.5], np.float32)
    out = Int8Codec(block=2).decode(bytes(Int8Codec(block=2).encode(x)), 6)
    np.testing.assert_allclose(out, [0, 0, 0, 0, 1.0, -0.5], atol=1 / 254)


def test_topk_payload_is_checked() -> None:
    codec = TopKCodec(0.5)

    def payload(idx: list[int], vals: list[float]) -> bytes:
        return np.array(idx, "<u4").tobytes() + np.array(vals, "<f4").tobytes()

    np.testing.assert_array_equal(codec.decode(payload([1, 3], [2.0, -1.0]), 4), [0, 2, 0, -1])
    np.testing.assert_array_equal(codec.decode(payload([2], [5.0]), 4), [0, 0, 5, 0])  # fewer than k is fine
    with pytest.raises(BadSchema, match="strictly increasing"):
        codec.decode(payload([3, 1], [1.0, 1.0]), 4)
    with pytest.raises(BadSchema, match="strictly increasing"):
        codec.decode(payload([1, 1], [1.0, 1.0]), 4)
    with pytest.raises(BadSchema, match="out of range"):
        codec.decode(payload([1, 4], [1.0, 1.0]), 4)
    with pytest.raises(NonFiniteValues):
        codec.decode(payload([1, 2], [1.0, np.inf]), 4)
    with pytest.raises(BadSchema):
        codec.decode(payload([1], [1.0])[:-1], 4)
    assert not codec.accepts_nbytes(4, 40) and not codec.accepts_nbytes(4, 12) and codec.accepts_nbytes(4, 0)


@settings(deadline=None, max_examples=60)
@given(st.sampled_from(DTYPES).flatmap(lambda dt: finite_arrays(dt, 1e30)), st.sampled_from([0.01, 0.2, 1.0]))
def test_packed_topk_sends_the_same_entries_rounded_to_int8_in_3_bytes_each(x: np.ndarray, ratio: float) -> None:
    packed, plain = TopKCodec(ratio, packed=True), TopKCodec(ratio)
    encoded = packed.encode(x)
    k = packed.k(x.size)
    assert len(encoded) == packed.encoded_nbytes(x.size) == 4 * -(-x.size // 65536) + 4 + 3 * k
    out = packed.decode(bytes(encoded), x.size, np.float32)
    exact = plain.decode(bytes(plain.encode(x)), x.size, np.float32)
    assert not np.any(out[exact == 0])  # nothing beyond the top-k entries
    if k:  # each kept entry within half an int8 step of max |kept| / 127
        step = np.abs(exact).max() / 127
        assert np.all(np.abs(out.astype(np.float64) - exact) <= step * (0.5 + 1e-6) + 1e-30)


def test_packed_topk_payload_is_checked() -> None:
    codec, n = TopKCodec(0.5, packed=True), 70000  # two blocks of 2^16

    def payload(counts: list[int], scale: float, offsets: list[int], values: list[int]) -> bytes:
        return (np.array(counts, "<u4").tobytes() + np.array([scale], "<f4").tobytes()
                + np.array(offsets, "<u2").tobytes() + np.array(values, np.int8).tobytes())

    out = codec.decode(payload([1, 1], 0.5, [7, 3], [2, -4]), n)
    assert out[7] == 1.0 and out[65536 + 3] == -2.0 and np.count_nonzero(out) == 2
    with pytest.raises(BadSchema, match="add up"):
        codec.decode(payload([2, 1], 0.5, [7, 3], [2, -4]), n)
    with pytest.raises(BadSchema, match="strictly increasing"):
        codec.decode(payload([2, 0], 0.5, [7, 3], [2, -4]), n)
    with pytest.raises(BadSchema, match="out of range"):
        codec.decode(payload([0, 2], 0.5, [3, 5000], [2, -4]), n)
    for scale in (float("nan"), float("inf"), -1.0):
        with pytest.raises(BadSchema, match="scale"):
            codec.decode(payload([1, 1], scale, [7, 3], [2, -4]), n)
    assert not codec.accepts_nbytes(n, 4 * 2 + 4 + 3 * 1 + 1) and not codec.accepts_nbytes(n, 4)


@settings(deadline=None, max_examples=80)
@given(st.sampled_from(DTYPES).flatmap(lambda dt: finite_arrays(dt, 1e30)),
       st.sampled_from([0.001, 0.01, 0.02, 0.3, 1.0]))
def test_elias_fano_topk_decodes_to_the_packed_layouts_tensor_in_fewer_bytes(x: np.ndarray, ratio: float) -> None:
    elias_fano, packed = TopKCodec(ratio, packed=True, elias_fano=True), TopKCodec(ratio, packed=True)
    encoded = elias_fano.encode(x)
    k, n = elias_fano.k(x.size), x.size
    low = max(0, (n // k).bit_length() - 1) if k else 0
    unary_bits = k + ((n - 1) >> low) + 1 if n else 0
    assert len(encoded) == elias_fano.encoded_nbytes(n) == 4 + -(-unary_bits // 8) + -(-k * low // 8) + k
    out = elias_fano.decode(bytes(encoded), n, np.float32)
    assert np.array_equal(out, packed.decode(bytes(packed.encode(x)), n, np.float32))
    assert elias_fano.accepts_nbytes(n, len(encoded)) and not elias_fano.accepts_nbytes(n, len(encoded) + 1)


def test_elias_fano_topk_bytes_per_entry_at_the_ratios_compressed_gossip_uses() -> None:
    n = 870_656  # the default dense model
    for ratio, most in ((0.01, 2.1), (0.02, 1.95), (0.05, 1.8)):
        codec = TopKCodec(ratio, packed=True, elias_fano=True)
        assert codec.encoded_nbytes(n) / codec.k(n) <= most
        assert codec.encoded_nbytes(n) < 0.7 * TopKCodec(ratio, packed=True).encoded_nbytes(n)


def test_elias_fano_topk_payload_is_checked() -> None:
    codec, n = TopKCodec(0.25, packed=True, elias_fano=True), 7  # k = 2, 1 low bit, 6 high-part bits

    def payload(scale: float, unary: list[int], low: list[int], values: list[int]) -> bytes:
        bits = np.packbits(np.array(unary + [0] * (6 - len(unary)), np.uint8), bitorder="little").tobytes()
        low_bits = np.packbits(np.array(low, np.uint8), bitorder="little").tobytes()
        return np.array([scale], "<f4").tobytes() + bits + low_bits + np.array(values, np.int8).tobytes()

    # indices 1 (high part 0, low bit 1) and 6 (high part 3, low bit 0): set bits at 0 + 0 and 3 + 1
    out = codec.decode(payload(0.5, [1, 0, 0, 0, 1], [1, 0], [2, -4]), n)
    assert out[1] == 1.0 and out[6] == -2.0 and np.count_nonzero(out) == 2
    with pytest.raises(BadSchema, match="high parts"):
        codec.decode(payload(0.5, [1, 1, 1], [1, 0], [2, -4]), n)
    with pytest.raises(BadSchema, match="strictly increasing"):
        codec.decode(payload(0.5, [1, 1], [1, 1], [2, -4]), n)
    with pytest.raises(BadSchema, match="out of range"):
        codec.decode(payload(0.5, [1, 0, 0, 0, 1], [1, 1], [2, -4]), n)
    for scale in (float("nan"), float("inf"), -1.0):
        with pytest.raises(BadSchema, match="scale"):
            codec.decode(payload(scale, [1, 0, 0, 0, 1], [1, 0], [2, -4]), n)
    with pytest.raises(BadSchema):
        codec.decode(payload(0.5, [1, 0, 0, 0, 1], [1, 0], [2, -4])[:-1], n)
    with pytest.raises(BadSchema, match="needs 'packed'"):
        codec_from_wire("topk", {"ratio": 0.25, "elias_fano": 1})
    with pytest.raises(ValueError, match="packed"):
        TopKCodec(0.25, elias_fano=True)


def test_registry_names_options_and_errors() -> None:
    assert set(CODEC_TYPES) == {"fp32", "fp16", "bf16", "int8", "topk", "sparseloco"}
    for codec in (Fp32Codec(), Fp16Codec(), Bf16Codec(), Int8Codec(block=64), TopKCodec(0.01),
                  TopKCodec(0.01, packed=True), TopKCodec(0.01, packed=True, elias_fano=True)):
        assert codec_from_wire(codec.name, codec.options()) == codec
    assert TopKCodec(0.01).options() == {"ratio": 0.01}  # unpacked: the options (and config hashes) of before
    assert TopKCodec(0.01, packed=True).options() == {"ratio": 0.01, "packed": 1}
    assert get_codec("int8", block=128) == Int8Codec(128)
    assert get_codec("int8") == Int8Codec(256)
    assert get_codec("topk", ratio=0.1) == TopKCodec(0.1)
    # local configuration errors are ValueErrors; a peer naming an unknown codec is a WireError
    for name, options in (("zstd", {}), ("topk", {}), ("int8", {"block": 0}), ("fp16", {"block": 4})):
        with pytest.raises(ValueError, match="codec|block"):
            get_codec(name, **options)
    with pytest.raises(UnknownCodec, match="'zstd'"):
        codec_from_wire("zstd", {})
    bad_options = [
        ("fp16", {"block": 4}),
        ("int8", {"block": 0}),
        ("int8", {"block": 2.5}),
        ("int8", {"block": True}),
        ("int8", {"blocks": 4}),
        ("topk", {}),
        ("topk", {"ratio": 0.0}),
        ("topk", {"ratio": 1.5}),
        ("topk", {"ratio": float("nan")}),
        ("topk", {"ratio": "0.1"}),
        ("topk", {"ratio": 0.1, "packed": 2}),
        ("topk", {"ratio": 0.1, "packed": True}),
        ("topk", {"ratio": 0.1, "packed": 1.0}),
    ]
    for name, options in bad_options:
        with pytest.raises(BadSchema):
            codec_from_wire(name, options)
    with pytest.raises(ValueError):
        TopKCodec(0)
    with pytest.raises(ValueError):
        Int8Codec(block=-1)


@settings(deadline=None, max_examples=40)
@given(
    st.sampled_from([np.float32, np.float64]),
    st.integers(1, 300),
    st.sampled_from([0.01, 0.05, 0.3]),
    st.integers(0, 2**32 - 1),
)
def test_error_feedback_conserves_the_sum_over_100_steps(dtype, n: int, ratio: float, seed: int) -> None:
    # integer-valued inputs keep every sum exact in floating point, so conservation is checked exactly
    rng = np.random.default_rng(seed)
    feedback = ErrorFeedback(TopKCodec(ratio))
    codec = feedback.codec
    total_in = np.zeros(n, np.float64)
    total_sent = np.zeros(n, np.float64)
    for _ in range(100):
        x = rng.integers(-1000, 1001, n).astype(dtype)
        sent = feedback.compress("w", x)
        assert sent.dtype == x.dtype and sent.shape == x.shape
        assert np.count_nonzero(sent) <= codec.k(n)
        # what the receiver decodes is exactly what compress returned
        np.testing.assert_array_equal(codec.decode(bytes(codec.encode(sent)), n, dtype), sent)
        total_in += x
        total_sent += sent
    np.testing.assert_array_equal(total_sent + feedback.residual("w"), total_in)


def test_error_feedback_on_real_valued_float32_and_float16() -> None:
    rng = np.random.default_rng(7)
    for dtype, rtol in ((np.float32, 1e-5), (np.float16, 1e-2)):
        feedback = ErrorFeedback(TopKCodec(0.02))
        total_in = np.zeros((40, 25))
        total_sent = np.zeros((40, 25))
        for _ in range(100):
            x = rng.standard_normal((40, 25)).astype(dtype)
            sent = feedback.compress("layer.w", x)
            total_in += x
            total_sent += sent
        residual = feedback.residual("layer.w").reshape(40, 25)
        np.testing.assert_allclose(total_sent + residual, total_in, atol=rtol * 100)


def test_error_feedback_keeps_residuals_per_name_and_resets() -> None:
    feedback = ErrorFeedback(TopKCodec(0.25))
    a = np.array([4.0, 3.0, 2.0, 1.0], np.float32)
    np.testing.assert_array_equal(feedback.compress("a", a), [4, 0, 0, 0])
    np.testing.assert_array_equal(feedback.compress("b", -a), [-4, 0, 0, 0])
    np.testing.assert_array_equal(feedback.compress("a", np.zeros(4, np.float32)), [0, 3, 0, 0])
    np.testing.assert_array_equal(feedback.residual("a"), [0, 0, 2, 1])
    np.testing.assert_array_equal(feedback.residual("b"), [0, -3, -2, -1])
    feedback.reset("a")
    assert feedback.residual("a") is None and feedback.residual("b") is not None
    with pytest.raises(ValueError, match="elements"):
        feedback.compress("b", np.zeros(5, np.float32))
    with pytest.raises(NonFiniteValues):
        feedback.compress("c", np.array([1.0, np.nan], np.float32))
    assert feedback.residual("c") is None
    feedback.reset()
    assert feedback.residual("b") is None


# --- large arrays: spans on parallel threads, and decoding piece by piece ------------------------


@pytest.fixture
def small_spans(monkeypatch: pytest.MonkeyPatch) -> int:
    """Make every array of more than 2 x 4096 elements split into up to 4 threads, whatever the machine."""
    monkeypatch.setattr(kernels, "_PARALLEL_MIN", 4096)
    monkeypatch.setattr(kernels, "_thread_budget", lambda: 4)
    return 4096


def sequential(monkeypatch: pytest.MonkeyPatch, fn):
    with monkeypatch.context() as m:
        m.setattr(kernels, "_MAX_THREADS", 1)
        return fn()


def spanning_values(n: int, dtype: type = np.float32) -> np.ndarray:
    """Normal values, float16-subnormal ones, zeros and rounding ties, spread over every span."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal(n).astype(np.float32) * np.float32(100)
    x[::97] = rng.uniform(-6e-5, 6e-5, x[::97].size).astype(np.float32)  # float16 subnormal range
    x[::101] = 0.0
    x[5::103] = np.float32(1 + 2**-11)  # a float16 tie: rounds to even
    return x.astype(dtype)


@pytest.mark.parametrize("codec", [Fp32Codec(), Fp16Codec(), Bf16Codec(), Int8Codec(block=100)], ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", DTYPES)
def test_threaded_spans_give_the_same_bytes_and_values(codec, dtype, small_spans, monkeypatch) -> None:
    x = spanning_values(4 * small_spans + 333, dtype)
    encoded = bytes(codec.encode(x))
    assert encoded == bytes(sequential(monkeypatch, lambda: codec.encode(x)))
    for out_dtype in DTYPES:
        one = sequential(monkeypatch, lambda: codec.decode(encoded, x.size, out_dtype))
        np.testing.assert_array_equal(codec.decode(encoded, x.size, out_dtype), one)


def test_threaded_fp16_matches_numpy_rounding(small_spans) -> None:
    x = spanning_values(4 * small_spans + 5)
    bits = np.frombuffer(bytes(Fp16Codec().encode(x)), "<u2")
    np.testing.assert_array_equal(bits, x.astype(np.float16).view(np.uint16))
    back = Fp16Codec().decode(bits.tobytes(), x.size)
    np.testing.assert_array_equal(back, x.astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("codec", [Fp32Codec(), Fp16Codec(), Bf16Codec(), Int8Codec()], ids=lambda c: c.name)
def test_threaded_spans_report_the_first_bad_element(codec, small_spans) -> None:
    x = spanning_values(4 * small_spans + 7)
    x[3 * small_spans + 10] = np.inf  # in the last span
    x[2 * small_spans + 3] = np.nan  # in an earlier one: this is the one named
    with pytest.raises(NonFiniteValues, match=f"element {2 * small_spans + 3}\\b"):
        codec.encode(x)


def test_threaded_decode_reports_the_first_bad_element(small_spans) -> None:
    x = spanning_values(4 * small_spans)
    payload = np.frombuffer(bytes(Fp32Codec().encode(x)), "<f4").copy()
    payload[[3 * small_spans + 1, small_spans + 2]] = np.nan
    with pytest.raises(NonFiniteValues, match=f"element {small_spans + 2}\\b"):
        Fp32Codec().decode(payload.tobytes(), x.size)
    halves = x.astype(np.float16).view(np.uint16).copy()
    halves[2 * small_spans + 9] = 0x7C00  # +inf
    with pytest.raises(NonFiniteValues, match=f"element {2 * small_spans + 9} is a float16 infinity"):
        Fp16Codec().decode(halves.tobytes(), x.size)


@settings(deadline=None, max_examples=40)
@given(
    st.sampled_from([Fp32Codec(), Fp16Codec(), Bf16Codec()]),
    st.sampled_from(DTYPES),
    st.lists(st.integers(0, 60), min_size=1, max_size=8),
)
def test_decode_into_any_split_of_whole_elements_equals_decode(codec, dtype, cuts: list[int]) -> None:
    x = spanning_values(257, np.float32)
    encoded = bytes(codec.encode(x))
    whole = codec.decode(encoded, x.size, dtype)
    out = np.full(x.size, 7, dtype)
    bounds = sorted({0, x.size, *(min(c * 5, x.size) for c in cuts)})
    k = codec.element_nbytes
    for lo, hi in zip(bounds, bounds[1:]):
        codec.decode_into(encoded[lo * k : hi * k], out[lo:hi], lo)
    np.testing.assert_array_equal(out, whole)


def test_decode_into_names_elements_by_their_index_in_the_tensor() -> None:
    payload = np.zeros(10, "<f4")
    payload[3] = np.inf
    out = np.empty(10, np.float32)
    with pytest.raises(NonFiniteValues, match="element 1003 is inf"):
        Fp32Codec().decode_into(payload.tobytes(), out, offset=1000)
    with pytest.raises(ValueError, match="do not fill"):
        Fp32Codec().decode_into(payload.tobytes(), out[:9])
    with pytest.raises(TypeError, match="int32"):
        Fp32Codec().decode_into(payload.tobytes(), np.empty(10, np.int32))
