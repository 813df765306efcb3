"""Tests for gossip.wire: message round trips through every codec, exact sizes, streaming decode, and one
test per refusal path with the specific exception a receiver counts."""

from __future__ import annotations

import asyncio
import threading

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gossip import errors
from gossip.codecs import Bf16Codec, Fp16Codec, Fp32Codec, Int8Codec, SparseLoCoCodec, TopKCodec, get_codec
from gossip.errors import (
    WIRE_ERROR_KINDS,
    BadSchema,
    FrameTooLarge,
    ManifestMismatch,
    NonFiniteValues,
    Truncated,
    UnknownCodec,
    VersionMismatch,
    WireError,
    WrongSwarm,
)
from gossip.wire import (
    HEADER_KEYS,
    Expectation,
    MessageDecoder,
    TensorSpec,
    WireLimits,
    decode_message,
    encode_message,
    encode_tensors,
    iter_message,
    message_nbytes,
    parse_header,
    read_message,
)

pytestmark = pytest.mark.unit

FIELDS = dict(swarm="tiny-moe", config_hash="c0ffee", sender="12D3KooWpeer", round=3, step=120, kind="exchange")
CODECS = [Fp32Codec(), Fp16Codec(), Bf16Codec(), Int8Codec(block=8), TopKCodec(0.3),
          TopKCodec(0.3, packed=True, elias_fano=True), SparseLoCoCodec(0.3, 16, 2)]


def prefix(n: int) -> bytes:
    return n.to_bytes(8, "big")


def frame(body: bytes) -> bytes:
    return prefix(len(body)) + body


def message(tensors, codec=Fp32Codec(), **overrides) -> bytes:
    fields = {**FIELDS, **overrides}
    return b"".join(encode_message(tensors, codec, **fields))


def header_dict(**changes) -> dict:
    """A valid header for one float32 tensor "w" of shape [2, 3], fp32, with `changes` applied."""
    base = {
        "v": 1,
        "swarm": "tiny-moe",
        "config_hash": "c0ffee",
        "sender": "12D3KooWpeer",
        "round": 3,
        "step": 120,
        "kind": "exchange",
        "codec": "fp32",
        "codec_opts": {},
        "manifest": [["w", "float32", [2, 3], 24]],
        "meta": {},
    }
    base.update(changes)
    return base


def raw_message(header: dict, *chunks: bytes) -> bytes:
    return frame(msgpack.packb(header)) + b"".join(frame(c) for c in chunks)


PAYLOAD_24 = np.arange(6, dtype="<f4").tobytes()


def model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "embed.weight": rng.standard_normal((50, 16)).astype(np.float32),
        "layer0.ln.bias": np.zeros(16, np.float32),
        "temperature": np.array(0.7, np.float32),
        "experts.0.w": rng.standard_normal((16, 24)).astype(np.float16),
        "empty": np.zeros((0, 3), np.float64),
        "head.w": rng.standard_normal((16, 5)),
    }


tensor_dicts = st.dictionaries(
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12),
    st.sampled_from([np.float32, np.float16, np.float64]).flatmap(
        lambda dt: hnp.arrays(
            dt,
            hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=9),
            elements=st.floats(-1000, 1000, width=np.dtype(dt).itemsize * 8),
        )
    ),
    max_size=5,
)


@settings(deadline=None, max_examples=60)
@given(tensor_dicts, st.sampled_from(CODECS), st.integers(1, 700), st.integers(0, 2**40))
def test_round_trip_through_every_codec(tensors, codec, chunk_bytes: int, step: int) -> None:
    meta = {"lr": 0.001, "tag": "x", "flag": True, "none": None, "n": -5}
    parts = encode_message(tensors, codec, chunk_bytes=chunk_bytes, meta=meta, **{**FIELDS, "step": step})
    buf = b"".join(parts)
    # the size helper agrees byte for byte, from arrays or from specs alone
    fields = {**FIELDS, "step": step}
    assert len(buf) == message_nbytes(tensors, codec, chunk_bytes=chunk_bytes, meta=meta, **fields)
    specs = [TensorSpec(n, str(t.dtype), t.shape) for n, t in tensors.items()]
    assert len(buf) == message_nbytes(specs, codec, chunk_bytes=chunk_bytes, meta=meta, **fields)
    msg = decode_message(buf, expected=Expectation.for_tensors("tiny-moe", "c0ffee", tensors, {codec.name}))
    h = msg.header
    got = (h.swarm, h.config_hash, h.sender, h.round, h.step, h.kind)
    assert got == ("tiny-moe", "c0ffee", "12D3KooWpeer", 3, step, "exchange")
    assert h.codec == codec.name and dict(h.codec_opts) == codec.options() and dict(h.meta) == meta
    assert list(msg.tensors) == list(tensors)
    for name, x in tensors.items():
        got = msg.tensors[name]
        assert got.dtype == x.dtype and got.shape == x.shape
        expected = codec.decode(bytes(codec.encode(x)), x.size, x.dtype).reshape(x.shape)
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_chunks_are_full_except_the_last_and_bounded(codec) -> None:
    tensors = model()
    parts = encode_message(tensors, codec, chunk_bytes=1000, **FIELDS)
    buf = b"".join(parts)
    pos = 8 + int.from_bytes(buf[:8], "big")
    sizes = []
    while pos < len(buf):
        n = int.from_bytes(buf[pos : pos + 8], "big")
        sizes.append(n)
        pos += 8 + n
    assert pos == len(buf)
    assert all(s == 1000 for s in sizes[:-1]) and 0 < sizes[-1] <= 1000
    assert sum(sizes) == sum(codec.encoded_nbytes(t.size) for t in tensors.values())


def test_fp32_payload_chunks_are_views_of_the_tensor() -> None:
    big = np.arange(300_000, dtype=np.float32)
    parts = encode_message({"w": big}, Fp32Codec(), **FIELDS)
    views = [p for p in parts if isinstance(p, memoryview)]
    assert views and all(np.shares_memory(np.frombuffer(v, np.uint8), big) for v in views)


def test_message_without_payload_is_one_frame() -> None:
    tensors = {"empty": np.zeros((0,), np.float32), "nothing": np.zeros((3, 0), np.float16)}
    parts = encode_message(tensors, Int8Codec(), **FIELDS)
    assert len(parts) == 1
    msg = decode_message(b"".join(parts))
    assert msg.tensors["nothing"].shape == (3, 0) and msg.tensors["empty"].dtype == np.float32


@settings(deadline=None, max_examples=30)
@given(st.sampled_from(CODECS), st.lists(st.integers(1, 5000), min_size=1, max_size=40))
def test_decoder_accepts_any_split_and_reads_no_further(codec, cuts: list[int]) -> None:
    buf = message(model(), codec, chunk_bytes=777)
    decoder = MessageDecoder()
    pos = 0
    for cut in cuts:
        if decoder.done:
            break
        piece = bytearray(buf[pos : pos + cut])  # mutable input: the decoder must copy what it keeps
        decoder.feed(piece)
        piece[:] = b"\xff" * len(piece)
        pos += len(piece)
    while not decoder.done:
        n = decoder.bytes_needed()
        assert n > 0
        decoder.feed(buf[pos : pos + n])
        pos += n
    assert pos == len(buf) and decoder.bytes_needed() == 0
    reference = decode_message(buf)
    for name, value in reference.tensors.items():
        np.testing.assert_array_equal(decoder.result().tensors[name], value)


class ByteStream:
    """read_exactly over a buffer: raises asyncio.IncompleteReadError at EOF, like StreamReader.readexactly."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos, self.asks = data, 0, []

    async def read_exactly(self, n: int) -> bytes:
        self.asks.append(n)
        chunk = self.data[self.pos : self.pos + n]
        self.pos += len(chunk)
        if len(chunk) < n:
            raise asyncio.IncompleteReadError(chunk, n)
        return chunk


def test_read_message_reads_exactly_one_message() -> None:
    first = message(model(), Fp16Codec(), chunk_bytes=4096)
    second = message({"x": np.ones(3, np.float32)}, round=4)
    stream = ByteStream(first + second)
    msg1 = asyncio.run(read_message(stream.read_exactly, timeout=10))
    assert stream.pos == len(first) and max(stream.asks) <= 4096
    msg2 = asyncio.run(read_message(stream.read_exactly, timeout=10))
    assert msg1.header.round == 3 and msg2.header.round == 4
    np.testing.assert_array_equal(msg2.tensors["x"], [1, 1, 1])


@pytest.mark.parametrize("cut", [0, 5, 8, 20, -5000, -1])
def test_stream_ending_early_is_truncated(cut: int) -> None:
    buf = message(model(), Fp32Codec(), chunk_bytes=2048)
    with pytest.raises(Truncated):
        asyncio.run(read_message(ByteStream(buf[:cut]).read_exactly, timeout=10))
    with pytest.raises(Truncated):
        decode_message(buf[:cut])


def test_stream_closed_connection_is_truncated() -> None:
    from gossip.transport import StreamClosed

    async def closed(n: int) -> bytes:
        raise StreamClosed("peer went away")

    async def short(n: int) -> bytes:
        return b"\x00" * (n - 1)

    with pytest.raises(Truncated):
        asyncio.run(read_message(closed, timeout=10))
    with pytest.raises(Truncated, match="asked for 8"):
        asyncio.run(read_message(short, timeout=10))


def test_error_kinds_are_the_documented_labels() -> None:
    expected = {
        errors.FrameTooLarge: "too_large",
        errors.BadSchema: "bad_schema",
        errors.UnknownCodec: "unknown_codec",
        errors.ManifestMismatch: "manifest_mismatch",
        errors.NonFiniteValues: "non_finite",
        errors.OutOfRange: "out_of_range",
        errors.Truncated: "truncated",
        errors.WrongSwarm: "wrong_swarm",
        errors.VersionMismatch: "bad_version",
        errors.NotMember: "not_member",
    }
    for cls, kind in expected.items():
        assert issubclass(cls, WireError) and cls.kind == kind
    assert set(WIRE_ERROR_KINDS) == set(expected.values())


# --- one test per refusal ------------------------------------------------------------------------


def test_header_length_is_refused_before_the_body_arrives() -> None:
    decoder = MessageDecoder()
    with pytest.raises(FrameTooLarge, match="header frame of 4611686018427387904 bytes"):
        decoder.feed(prefix(2**62))
    with pytest.raises(FrameTooLarge):  # a failed decoder stays failed
        decoder.feed(b"\x00")
    with pytest.raises(FrameTooLarge):
        decode_message(prefix(5000) + b"\x80" * 5000, WireLimits(max_header_bytes=4096))


def test_chunk_lengths_are_checked_against_limits_and_manifest() -> None:
    head = frame(msgpack.packb(header_dict()))
    with pytest.raises(FrameTooLarge, match="payload chunk of 4611686018427387904"):
        decode_message(head + prefix(2**62))
    with pytest.raises(FrameTooLarge):
        decode_message(raw_message(header_dict(), PAYLOAD_24), WireLimits(max_chunk_bytes=16))
    with pytest.raises(ManifestMismatch, match="leaves only 24"):
        decode_message(raw_message(header_dict(), PAYLOAD_24 + b"\x00\x00\x00\x00"))
    with pytest.raises(ManifestMismatch, match="leaves only 4"):
        decode_message(raw_message(header_dict(), PAYLOAD_24[:20], PAYLOAD_24[:8]))
    with pytest.raises(BadSchema, match="empty payload chunk"):
        decode_message(raw_message(header_dict(), b"", PAYLOAD_24))
    ok = decode_message(raw_message(header_dict(), PAYLOAD_24[:5], PAYLOAD_24[5:]))
    np.testing.assert_array_equal(ok.tensors["w"], np.arange(6).reshape(2, 3))


def test_bytes_after_the_message_are_refused() -> None:
    with pytest.raises(BadSchema, match="3 bytes after the end"):
        decode_message(raw_message(header_dict(), PAYLOAD_24) + b"abc")


@pytest.mark.parametrize(
    "body, match",
    [
        (b"", "empty header frame"),
        (b"\xc1", "not a valid msgpack"),
        (b"\x93\x01\x02\x03", "must be a msgpack map"),
        (msgpack.packb(header_dict()) + b"\x00", "not a valid msgpack"),
        (b"\x82\xa1v\x01\xa1v\x01", "repeats a key"),
        (b"\x81\x01\x02", "not a valid msgpack"),  # integer map key
        (b"\x81\xa1v\xc7\x01\x05a", "not a valid msgpack"),  # ext type
    ],
)
def test_malformed_header_bytes_are_bad_schema(body: bytes, match: str) -> None:
    with pytest.raises(BadSchema, match=match):
        decode_message(frame(body))


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"v": "1"}, "protocol version"),
        ({"v": True}, "protocol version"),
        ({"extra": 1}, "unknown keys 'extra'"),
        ({"swarm": ""}, "'swarm' is empty"),
        ({"sender": 5}, "'sender' must be a string"),
        ({"round": -1}, "'round' must be an integer"),
        ({"step": 2**63}, "'step' must be an integer"),
        ({"step": True}, "'step' must be an integer"),
        ({"round": 1.0}, "'round' must be an integer"),
        ({"codec_opts": []}, "'codec_opts' must be a map"),
        ({"codec_opts": {"block": 4}}, "takes no options"),
        ({"manifest": {}}, "'manifest' must be a list"),
        ({"manifest": [["w", "float32", [2, 3]]]}, r"\[name, dtype, shape, nbytes\]"),
        ({"manifest": [["w", "int32", [2, 3], 24]]}, "dtype 'int32' is not one of"),
        ({"manifest": [["w", "float32", [2, -3], 24]]}, "a dimension must be"),
        ({"manifest": [["w", "float32", "23", 24]]}, "shape must be a list"),
        ({"manifest": [["w", "float32", [6], 24], ["w", "float32", [], 4]]}, "name appears twice"),
        ({"manifest": [["", "float32", [6], 24]]}, "name is empty"),
        ({"meta": {"x": [1, 2]}}, "meta 'x' must be"),
        ({"meta": []}, "'meta' must be a map"),
    ],
)
def test_header_schema_errors(changes: dict, match: str) -> None:
    with pytest.raises(BadSchema, match=match):
        decode_message(raw_message(header_dict(**changes), PAYLOAD_24))


def test_missing_header_key_is_bad_schema() -> None:
    for key in HEADER_KEYS[1:]:
        header = header_dict()
        del header[key]
        with pytest.raises(BadSchema, match=f"missing {key}"):
            decode_message(raw_message(header, PAYLOAD_24))


def test_other_protocol_version_is_version_mismatch() -> None:
    with pytest.raises(VersionMismatch, match="protocol version 2"):
        decode_message(raw_message(header_dict(v=2, whatever_v2_adds=1), PAYLOAD_24))


def test_limits_on_header_contents_are_frame_too_large() -> None:
    limits = WireLimits(max_tensors=2, max_ndim=3, max_name_len=12, max_meta_entries=1, max_meta_value_len=20)
    cases = [
        ({"meta": {"m": "x" * 21}}, "meta 'm' is 21 bytes long, over max_meta_value_len"),
        ({"manifest": [["a", "float32", [1], 4]] * 3}, "3 tensors, over max_tensors"),
        ({"manifest": [["w", "float32", [1, 1, 1, 6], 24]]}, "4 dimensions, over max_ndim"),
        ({"manifest": [["a_longer_name", "float32", [6], 24]]}, "13 bytes long, over max_name_len"),
        ({"sender": "p" * 13}, "over max_name_len"),
        ({"meta": {"é" * 7: 1}}, "14 bytes long, over max_name_len"),
        ({"meta": {"a": 1, "b": 2}}, "2 entries, over max_meta_entries"),
    ]
    for changes, match in cases:
        with pytest.raises(FrameTooLarge, match=match):
            decode_message(raw_message(header_dict(**changes), PAYLOAD_24), limits)


def test_declared_sizes_beyond_the_limits_are_refused() -> None:
    big = header_dict(manifest=[["w", "float32", [10**6], 4 * 10**6]])
    with pytest.raises(FrameTooLarge, match="max_payload_bytes"):
        decode_message(raw_message(big), WireLimits(max_payload_bytes=10**6))
    # top-k sends few bytes for a huge tensor: the decoded size is bounded separately
    sparse = header_dict(codec="topk", codec_opts={"ratio": 0.5}, manifest=[["w", "float64", [10**9], 8]])
    with pytest.raises(FrameTooLarge, match="max_decoded_bytes"):
        decode_message(raw_message(sparse, b"\x00" * 8))
    # a shape whose product overflows any fixed-width integer is still just a wrong size
    with pytest.raises(ManifestMismatch, match="0 bytes on the wire"):
        decode_message(raw_message(header_dict(manifest=[["w", "float32", [2**62] * 4, 0]])))
    with pytest.raises(ManifestMismatch):
        topk = header_dict(codec="topk", codec_opts={"ratio": 1}, manifest=[["w", "float32", [2**62] * 4, 8]])
        decode_message(raw_message(topk))


def test_unknown_or_unaccepted_codec() -> None:
    with pytest.raises(UnknownCodec, match="'zstd'"):
        decode_message(raw_message(header_dict(codec="zstd"), PAYLOAD_24))
    buf = message({"w": np.ones(6, np.float32)}, TopKCodec(0.5))
    with pytest.raises(UnknownCodec, match="not accepted here"):
        decode_message(buf, expected=Expectation("tiny-moe", "c0ffee", allowed_codecs=frozenset({"fp16", "fp32"})))


def test_manifest_sizes_must_match_the_codec() -> None:
    expected = "manifest entry 0 'w': 20 bytes on the wire, but fp32 encodes 6 elements in 24"
    with pytest.raises(ManifestMismatch, match=expected):
        decode_message(raw_message(header_dict(manifest=[["w", "float32", [2, 3], 20]]), PAYLOAD_24[:20]))
    int8 = header_dict(codec="int8", codec_opts={"block": 4}, manifest=[["w", "float32", [6], 6]])
    with pytest.raises(ManifestMismatch, match="int8 encodes 6 elements in 14"):
        decode_message(raw_message(int8, b"\x00" * 6))
    topk = header_dict(codec="topk", codec_opts={"ratio": 0.5}, manifest=[["w", "float32", [2, 3], 12]])
    with pytest.raises(ManifestMismatch):  # not a whole number of (index, value) pairs
        decode_message(raw_message(topk, b"\x00" * 12))


def test_expected_manifest_is_matched_exactly() -> None:
    local = {"layer.w": np.zeros((4, 6), np.float32), "layer.b": np.zeros(6, np.float32)}
    expect = Expectation.for_tensors("tiny-moe", "c0ffee", local)
    w, b = np.zeros((4, 6), np.float32), np.zeros(6, np.float32)
    cases = [
        ({"layer.w": w[:, :5], "layer.b": b}, r"manifest entry 0 'layer.w': shape \[4, 5\] != expected \[4, 6\]"),
        ({"layer.w": w.astype(np.float16), "layer.b": b}, "dtype float16 != expected float32"),
        ({"layer.b": b, "layer.w": w}, "name 'layer.b' != expected 'layer.w'"),
        ({"layer.w": w}, "1 tensors, expected 2"),
        ({**local, "extra": np.zeros(1, np.float32)}, "3 tensors, expected 2"),
    ]
    for tensors, match in cases:
        with pytest.raises(ManifestMismatch, match=match):
            decode_message(message(tensors), expected=expect)
    decode_message(message(local), expected=expect)


def test_wrong_swarm_or_config() -> None:
    buf = message({"w": np.ones(2, np.float32)})
    with pytest.raises(WrongSwarm, match="swarm 'tiny-moe', expected 'other'"):
        decode_message(buf, expected=Expectation("other", "c0ffee"))
    with pytest.raises(WrongSwarm, match="config hash 'c0ffee', expected 'beef'"):
        decode_message(buf, expected=Expectation("tiny-moe", "beef"))


def test_non_finite_payload_names_the_tensor() -> None:
    bad = np.arange(6, dtype="<f4")
    bad[4] = np.nan
    with pytest.raises(NonFiniteValues, match="manifest entry 0 'w': element 4"):
        decode_message(raw_message(header_dict(), bad.tobytes()))
    inf_half = np.array([0x3C00, 0x7C00, 0, 0, 0, 0], "<u2").tobytes()
    fp16 = header_dict(codec="fp16", manifest=[["w", "float32", [2, 3], 12]])
    with pytest.raises(NonFiniteValues, match="'w'"):
        decode_message(raw_message(fp16, inf_half))
    unordered = np.array([3, 1], "<u4").tobytes() + np.ones(2, "<f4").tobytes()
    topk = header_dict(codec="topk", codec_opts={"ratio": 0.5}, manifest=[["w", "float32", [2, 3], 16]])
    with pytest.raises(BadSchema, match="manifest entry 0 'w': top-k indices"):
        decode_message(raw_message(topk, unordered))


def test_encoder_refuses_what_a_receiver_would_refuse() -> None:
    with pytest.raises(NonFiniteValues, match="tensor 'w'"):
        encode_message({"w": np.array([1.0, np.inf], np.float32)}, Fp32Codec(), **FIELDS)
    with pytest.raises(FrameTooLarge, match="max_name_len"):
        encode_message({"w": np.ones(1, np.float32)}, Fp32Codec(), **{**FIELDS, "sender": "x" * 300})
    with pytest.raises(BadSchema, match="'kind' is empty"):
        encode_message({"w": np.ones(1, np.float32)}, Fp32Codec(), **{**FIELDS, "kind": ""})
    with pytest.raises(BadSchema, match="meta"):
        encode_message({"w": np.ones(1, np.float32)}, Fp32Codec(), meta={"bad": [1]}, **FIELDS)
    with pytest.raises(FrameTooLarge, match="max_tensors"):
        tensors = {f"t{i}": np.ones(1, np.float32) for i in range(5)}
        encode_message(tensors, Fp32Codec(), limits=WireLimits(max_tensors=4), **FIELDS)
    with pytest.raises(TypeError, match="cannot go on the wire"):
        encode_message({"w": np.ones(2, np.int64)}, Fp32Codec(), **FIELDS)
    with pytest.raises(ValueError, match="chunk_bytes"):
        encode_message({"w": np.ones(2, np.float32)}, Fp32Codec(), chunk_bytes=8 << 20, **FIELDS)


def test_message_nbytes_accepts_shape_dtype_pairs_and_default_fields() -> None:
    codec = get_codec("fp16")
    by_pairs = message_nbytes({"params": ((1000,), "float32")}, codec)
    by_array = message_nbytes({"params": np.zeros(1000, np.float32)}, codec)
    assert by_pairs == by_array
    real = b"".join(
        encode_message(
            {"params": np.zeros(1000, np.float32)},
            codec,
            swarm="murmur",
            config_hash="0" * 64,
            sender="12D3KooW" + "0" * 44,
            round=0,
            step=0,
            kind="exchange",
        )
    )
    assert by_pairs == len(real)


# --- large payloads: decoded chunk by chunk, off the event loop ------------------------------------


def large_model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {
        "a": rng.standard_normal(800_001).astype(np.float32),  # ~3 MiB in fp32, odd length
        "b": rng.standard_normal((3, 5)).astype(np.float16),
        "c": rng.standard_normal(700_000).astype(np.float64),
    }


@pytest.mark.parametrize("codec", [Fp32Codec(), Fp16Codec(), Bf16Codec(), Int8Codec()], ids=lambda c: c.name)
def test_large_message_read_from_a_stream_decodes_exactly(codec, monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = large_model()
    # chunks of an odd size end in the middle of elements
    buf = b"".join(encode_message(tensors, codec, chunk_bytes=(1 << 20) + 3, **FIELDS))
    batches: list[tuple[int, bool]] = []  # (bytes, decoded on the event loop's thread)
    original = MessageDecoder.decode_queued

    def spy(self, pieces):
        batches.append((sum(len(p) for p, _ in pieces), threading.get_ident() == loop_thread))
        return original(self, pieces)

    monkeypatch.setattr(MessageDecoder, "decode_queued", spy)
    loop_thread = threading.get_ident()  # asyncio.run runs the loop on this thread
    msg = asyncio.run(read_message(ByteStream(buf).read_exactly, timeout=30))
    for name, x in tensors.items():
        expected = codec.decode(bytes(codec.encode(x)), x.size, x.dtype).reshape(x.shape)
        assert msg.tensors[name].dtype == x.dtype
        np.testing.assert_array_equal(msg.tensors[name], expected)
    # every batch of a megabyte or more was decoded by a worker thread, not the event loop
    large = [on_loop for nbytes, on_loop in batches if nbytes >= 1 << 20]
    assert large and not any(large)


def test_bad_value_late_in_a_large_stream_is_refused() -> None:
    x = np.ones(2_000_000, np.float32)
    x[1_999_990] = np.nan
    body = x.tobytes()
    header = header_dict(manifest=[["w", "float32", [x.size], len(body)]])
    chunks = [body[i : i + (1 << 20)] for i in range(0, len(body), 1 << 20)]
    with pytest.raises(NonFiniteValues, match="manifest entry 0 'w': element 1999990 is nan"):
        asyncio.run(read_message(ByteStream(raw_message(header, *chunks)).read_exactly, timeout=30))


def test_feed_without_decoding_queues_a_copy_of_mutable_input() -> None:
    tensors = model()
    buf = message(tensors, Fp16Codec(), chunk_bytes=50)
    decoder = MessageDecoder()
    piece = bytearray(buf)
    decoder.feed(piece, decode=False)
    piece[:] = b"\xff" * len(piece)  # the caller reuses its buffer before the payload is decoded
    assert decoder.bytes_needed() == 0 and not decoder.done
    decoder.decode_queued(decoder.take_queued())
    assert decoder.done
    for name, value in decode_message(buf).tensors.items():
        np.testing.assert_array_equal(decoder.result().tensors[name], value)


def test_timeout_with_a_batch_being_decoded_is_a_timeout() -> None:
    x = np.ones(3 << 20, np.float32)  # 12 MiB: several batches go to the worker before the stall
    buf = message({"w": x})
    stalled_at = len(buf) // 2

    async def read_exactly(n: int) -> bytes:
        if stream.pos + n > stalled_at:
            await asyncio.sleep(3600)  # a peer that stops sending halfway
        return await stream.read_exactly(n)

    stream = ByteStream(buf)
    with pytest.raises(TimeoutError):
        asyncio.run(read_message(read_exactly, timeout=1.0))
    assert stream.pos > 2 << 20


# The header frame body the hand-checked encoder (gossip/wire.py before the msgspec schema, commit
# 9a9f615) wrote for `_CAPTURED_ARGS`: old and new nodes must read each other's headers.
_CAPTURED_HEADER = bytes.fromhex(
    "8ba17601a5737761726da874696e792d6d6f65ab636f6e6669675f68617368a6633066666565a673656e646572ac3132"
    "44334b6f6f5770656572a5726f756e6403a47374657078a46b696e64a865786368616e6765a5636f646563a4696e7438"
    "aa636f6465635f6f70747381a5626c6f636b04a86d616e69666573749294a177a7666c6f617433329202030e94a162a7"
    "666c6f61743136910000a46d65746185a6657870657274a3652e31a763757272656e74c3a16ec0a178cb3ff800000000"
    "0000a16bfe"
)
_CAPTURED_META = {"expert": "e.1", "current": True, "n": None, "x": 1.5, "k": -2}


def test_header_bytes_are_those_the_hand_checked_encoder_wrote() -> None:
    tensors = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(0, np.float16)}
    head = bytes(encode_message(tensors, Int8Codec(block=4), meta=_CAPTURED_META, **FIELDS)[0])
    assert head[8:] == _CAPTURED_HEADER
    assert parse_header(_CAPTURED_HEADER)[0].meta == _CAPTURED_META


@settings(max_examples=50, deadline=None)
@given(
    tensor_dicts,
    st.dictionaries(
        st.text(min_size=1, max_size=8),
        st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8),
        max_size=4,
    ),
)
def test_header_bytes_are_the_msgpack_map_of_its_fields(tensors: dict, meta: dict) -> None:
    """The Struct encodes as msgpack.packb of the same map did: keys in HEADER_KEYS order, same forms."""
    from gossip.wire.header import pack_header

    header = decode_message(message(tensors, Int8Codec(block=8), meta=meta)).header
    as_map = {
        "v": header.version, "swarm": header.swarm, "config_hash": header.config_hash, "sender": header.sender,
        "round": header.round, "step": header.step, "kind": header.kind, "codec": header.codec,
        "codec_opts": dict(header.codec_opts), "manifest": [[e.name, e.dtype, list(e.shape), e.nbytes]
                                                            for e in header.manifest],
        "meta": dict(header.meta),
    }  # fmt: skip
    assert list(as_map) == list(HEADER_KEYS)
    assert pack_header(header) == msgpack.packb(as_map, use_bin_type=True)


def test_declared_dtypes_are_the_wire_dtypes() -> None:
    from typing import get_args

    from gossip.codecs import WIRE_DTYPES
    from gossip.wire.header import WireDtype

    assert get_args(WireDtype) == tuple(WIRE_DTYPES)


def test_schema_errors_name_the_field_at_fault() -> None:
    cases = [
        ({"codec_opts": {"": 1}}, "a codec_opts key is empty"),
        ({"codec_opts": {"ratio": "x"}}, "codec option 'ratio' must be a number"),
        ({"meta": {"": 1}}, "a meta key is empty"),
        ({"manifest": [["w", 5, [2, 3], 24]]}, "manifest entry 0: dtype must be a string"),
        ({"manifest": [["w", "float32", [2, 3], -1]]}, "manifest entry 0: nbytes must be an integer"),
        ({"manifest": [["w", "float32", [2, 3], 24, 0]]}, r"\[name, dtype, shape, nbytes\]"),
    ]
    for changes, match in cases:
        with pytest.raises(BadSchema, match=match):
            decode_message(raw_message(header_dict(**changes), PAYLOAD_24))


def test_a_meta_value_may_be_longer_than_a_name_up_to_its_own_bound() -> None:
    """A membership certificate (~360 bytes) travels in meta: its values have their own, larger bound."""
    limits = WireLimits(max_name_len=12, max_meta_value_len=20)
    message = decode_message(raw_message(header_dict(meta={"m": "x" * 20}), PAYLOAD_24), limits)
    assert message.header.meta == {"m": "x" * 20}


def test_expectation_checks_the_sender_then_admission_before_the_payload() -> None:
    """The sender must be the stream's peer and be admitted; both are refused from the header alone."""
    admitted: list[str] = []

    def admit(header) -> None:
        admitted.append(header.sender)
        if header.sender != "12D3KooWpeer":
            raise errors.NotMember(f"{header.sender} proves no membership")

    raw = raw_message(header_dict(), PAYLOAD_24)
    header_only = raw[: len(raw) - len(PAYLOAD_24) - 8]  # no payload: a refusal must come from the header
    expect = Expectation("tiny-moe", "c0ffee", sender="12D3KooWother")
    with pytest.raises(BadSchema, match="names sender 12D3KooWpeer, but the stream comes from 12D3KooWother"):
        decode_message(header_only, expected=expect)
    with pytest.raises(errors.NotMember, match="proves no membership"):
        decode_message(raw_message(header_dict(sender="12D3KooWother"), PAYLOAD_24)[: len(header_only) + 2],
                       expected=Expectation("tiny-moe", "c0ffee", sender="12D3KooWother", admit=admit))
    assert decode_message(raw, expected=Expectation("tiny-moe", "c0ffee", sender="12D3KooWpeer", admit=admit))
    assert admitted == ["12D3KooWother", "12D3KooWpeer"]


def test_hostile_headers_that_trip_python_itself_are_refused_as_malformed() -> None:
    """Each of these once escaped the decoder as a plain Python error, which the callers that catch only
    WireError (SPES fetches, DiLoCo's momentum fetch, the swarm evaluation) did not catch."""
    # an empty tensor whose other dimension no array can span: numpy's reshape raised ValueError
    with pytest.raises(FrameTooLarge, match="spans"):
        decode_message(raw_message(header_dict(manifest=[["w", "float32", [2**62, 0], 0]])))
    # a value nested a thousand lists deep: the error message's repr ran out of stack
    body = msgpack.packb(header_dict(round="DEEP")).replace(msgpack.packb("DEEP"), b"\x91" * 1000 + b"\x01")
    with pytest.raises(BadSchema):
        decode_message(frame(body) + frame(PAYLOAD_24))
    # whatever else a header trips inside an admission check is refused the same way
    def trips(header) -> None:
        raise TypeError("unsupported operand types")

    with pytest.raises(BadSchema, match="malformed header"):
        decode_message(raw_message(header_dict(), PAYLOAD_24),
                       expected=Expectation("tiny-moe", "c0ffee", sender="12D3KooWpeer", admit=trips))


@pytest.mark.parametrize("codec", [Fp32Codec(), Bf16Codec(), Int8Codec(block=64), TopKCodec(ratio=0.1)],
                         ids=lambda c: c.name)
def test_tensors_kept_encoded_send_the_same_message_in_the_wire_size(codec):
    rng = np.random.default_rng(5)
    tensors = {"a": rng.standard_normal((33, 17)).astype(np.float32), "b": rng.standard_normal(3000).astype(np.float32),
               "empty": np.zeros(0, np.float32)}
    kept = encode_tensors(tensors, codec, chunk_bytes=1000)  # tensors cut in pieces, as a message encodes them
    whole = b"".join(bytes(b) for b in encode_message(tensors, codec, chunk_bytes=1000, **FIELDS))
    assert b"".join(bytes(b) for b in iter_message(kept, codec, chunk_bytes=1000, **FIELDS)) == whole
    assert message_nbytes(kept, codec, chunk_bytes=1000, **FIELDS) == len(whole)
    assert kept.nbytes == sum(codec.encoded_nbytes(t.size) for t in tensors.values())
    with pytest.raises(ValueError, match="cannot be sent"):
        iter_message(kept, get_codec("fp16"), **FIELDS)
    tensors["b"][7] = np.nan
    with pytest.raises(NonFiniteValues):
        encode_tensors(tensors, codec)
