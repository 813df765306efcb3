"""Fuzz tests for gossip.wire: random, mutated, truncated and hostile frames end in a decoded message or
one of the documented WireError subclasses, and never make the decoder allocate much (tracemalloc)."""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gossip.codecs import Bf16Codec, Fp16Codec, Fp32Codec, Int8Codec, SparseLoCoCodec, TopKCodec
from gossip.errors import BadSchema, FrameTooLarge, Truncated, WireError
from gossip.wire import HEADER_KEYS, Expectation, Message, decode_message, encode_message, read_message

pytestmark = pytest.mark.unit

PEAK_LIMIT = 8 << 20
FIELDS = dict(swarm="s", config_hash="h", sender="p", round=1, step=2, kind="exchange")
CODECS = [Fp32Codec(), Fp16Codec(), Bf16Codec(), Int8Codec(block=16), TopKCodec(0.25),
          TopKCodec(0.25, packed=True, elias_fano=True), SparseLoCoCodec(0.25, 16, 2)]
FUZZ = settings(deadline=None, max_examples=100, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module", autouse=True)
def traced() -> Iterator[None]:
    tracemalloc.start()
    yield
    tracemalloc.stop()


def decode_measured(buf: bytes, expected: Expectation | None = None) -> tuple[Message | WireError, int]:
    """Decode, returning the message or the WireError, and the peak traced allocation above the baseline.

    Any other exception propagates and fails the test.
    """
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        outcome: Message | WireError = decode_message(buf, expected=expected)
    except WireError as exc:
        outcome = exc
    return outcome, tracemalloc.get_traced_memory()[1] - base


def prefix(n: int) -> bytes:
    return n.to_bytes(8, "big")


def frame(body: bytes) -> bytes:
    return prefix(len(body)) + body


def small_model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "w": rng.standard_normal((12, 10)).astype(np.float32),
        "b": rng.standard_normal(7).astype(np.float16),
        "s": np.array(2.5),
        "e": np.zeros((0, 2), np.float32),
    }


VALID = {codec.name: b"".join(encode_message(small_model(), codec, chunk_bytes=97, **FIELDS)) for codec in CODECS}
HEADER_LEN = {name: 8 + int.from_bytes(buf[:8], "big") for name, buf in VALID.items()}

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=25,
)


def assert_only_documented(outcome: Message | WireError, peak: int) -> None:
    assert isinstance(outcome, Message | WireError)
    assert peak < PEAK_LIMIT, f"decoder allocated {peak} bytes"


@FUZZ
@given(st.binary(max_size=3000))
def test_random_bytes(data: bytes) -> None:
    assert_only_documented(*decode_measured(data))


@FUZZ
@given(st.binary(max_size=3000), st.binary(max_size=300))
def test_random_header_body_and_tail(body: bytes, tail: bytes) -> None:
    assert_only_documented(*decode_measured(frame(body) + tail))


@FUZZ
@given(msgpack_values, st.sampled_from(sorted(VALID)))
def test_random_msgpack_header(value: object, codec_name: str) -> None:
    payload = VALID[codec_name][HEADER_LEN[codec_name] :]
    outcome, peak = decode_measured(frame(msgpack.packb(value)) + payload)
    assert_only_documented(outcome, peak)
    assert isinstance(outcome, WireError)  # no random value is a valid header


@FUZZ
@given(
    st.sampled_from(sorted(VALID)),
    st.sampled_from(HEADER_KEYS),
    msgpack_values,
)
def test_one_header_field_replaced(codec_name: str, key: str, value: object) -> None:
    buf = VALID[codec_name]
    header = msgpack.unpackb(buf[8 : HEADER_LEN[codec_name]])
    header[key] = value
    outcome, peak = decode_measured(frame(msgpack.packb(header)) + buf[HEADER_LEN[codec_name] :])
    assert_only_documented(outcome, peak)


@FUZZ
@given(
    st.sampled_from(sorted(VALID)),
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=8),
    st.integers(0, 3),
)
def test_mutated_messages(codec_name: str, edits: list[tuple[int, int]], how: int) -> None:
    buf = bytearray(VALID[codec_name])
    for pos, byte in edits:
        pos %= len(buf)
        if how == 0:
            buf[pos] = byte
        elif how == 1:
            buf.insert(pos, byte)
        elif how == 2:
            del buf[pos]
        else:
            buf[pos] ^= 1 << (byte % 8)
    outcome, peak = decode_measured(bytes(buf), Expectation.for_tensors("s", "h", small_model()))
    assert_only_documented(outcome, peak)


@pytest.mark.parametrize("codec_name", sorted(VALID))
def test_every_truncation_is_truncated(codec_name: str) -> None:
    buf = VALID[codec_name]
    for cut in range(len(buf)):
        outcome, peak = decode_measured(buf[:cut])
        assert isinstance(outcome, Truncated), (cut, outcome)
        assert peak < PEAK_LIMIT


def crafted_header(manifest_bytes: bytes) -> bytes:
    """A header body whose 'manifest' value is the given raw msgpack bytes (everything else valid)."""
    marker = "MANIFEST-PLACEHOLDER"
    header = {
        "v": 1, "swarm": "s", "config_hash": "h", "sender": "p", "round": 1, "step": 2,
        "kind": "exchange", "codec": "fp32", "codec_opts": {}, "manifest": marker, "meta": {},
    }  # fmt: skip
    return msgpack.packb(header).replace(msgpack.packb(marker), manifest_bytes)


def valid_header(manifest: list, codec: str = "fp32", opts: dict | None = None) -> bytes:
    header = {
        "v": 1, "swarm": "s", "config_hash": "h", "sender": "p", "round": 1, "step": 2,
        "kind": "exchange", "codec": codec, "codec_opts": opts or {}, "manifest": manifest, "meta": {},
    }  # fmt: skip
    return frame(msgpack.packb(header))


FOUR_GIB = valid_header([["w", "float32", [2**30], 2**32]])
HOSTILE = {
    "prefix 2^62": (prefix(2**62) + b"\x00" * 64, FrameTooLarge),
    "prefix 2^64-1": (prefix(2**64 - 1), FrameTooLarge),
    "manifest of 10^9 tensors": (frame(crafted_header(b"\xdd" + (10**9).to_bytes(4, "big"))), FrameTooLarge),
    "manifest entry with 10^9 dims": (
        frame(crafted_header(b"\x91\x94\xa1w\xa7float32\xdd" + (10**9).to_bytes(4, "big"))),
        FrameTooLarge,
    ),
    "header map of 2^32-1 keys": (frame(b"\xdf\xff\xff\xff\xff"), FrameTooLarge),
    # a declared length longer than the (bounded) header body is just malformed msgpack
    "string of 2^31 bytes": (frame(b"\xdb" + (2**31).to_bytes(4, "big") + b"abc"), BadSchema),
    "binary of 2^31 bytes": (frame(b"\xc6" + (2**31).to_bytes(4, "big") + b"abc"), BadSchema),
    "nesting 100000 deep": (frame(b"\x91" * 100_000 + b"\xc0"), BadSchema),
    "65535 empty arrays": (frame(b"\xdc\xff\xff" + b"\x90" * 65535), BadSchema),
    "4 GiB payload declared, 1 KiB sent": (FOUR_GIB + prefix(1 << 20) + b"\x00" * 1024, Truncated),
    "4 GiB payload declared, chunk prefix 2^62": (FOUR_GIB + prefix(2**62), FrameTooLarge),
    "top-k of 10^9 elements in 8 bytes": (
        valid_header([["w", "float64", [10**9], 8]], "topk", {"ratio": 0.1}) + frame(b"\x00" * 8),
        FrameTooLarge,
    ),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_frames_are_refused_without_allocating(name: str) -> None:
    buf, expected_error = HOSTILE[name]
    outcome, peak = decode_measured(buf)
    assert isinstance(outcome, expected_error), outcome
    assert peak < PEAK_LIMIT, f"{name}: decoder allocated {peak} bytes"


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_streams_are_refused_with_bounded_reads(name: str) -> None:
    buf, expected_error = HOSTILE[name]
    asks: list[int] = []

    async def read_exactly(n: int) -> bytes:
        asks.append(n)
        start = sum(asks[:-1])
        if start + n > len(buf):
            raise EOFError
        return buf[start : start + n]

    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    with pytest.raises(expected_error):
        asyncio.run(read_message(read_exactly, timeout=10))
    assert tracemalloc.get_traced_memory()[1] - base < PEAK_LIMIT
    assert max(asks) <= 4 << 20  # never more than one chunk (max_chunk_bytes) or header at a time


@pytest.mark.parametrize("codec", ["fp32", "fp16"])
@pytest.mark.parametrize("sent_mib", [1, 3, 12])
def test_allocation_follows_the_bytes_that_arrived(codec: str, sent_mib: int) -> None:
    """A peer declaring a 64 MiB tensor and stopping early costs at most 8x what it sent (the output
    array is allocated once an eighth of the tensor has arrived), however much it declared."""
    element = 4 if codec == "fp32" else 2
    numel = (64 << 20) // element
    header = valid_header([["w", "float32", [numel], numel * element]], codec)
    sent = sent_mib << 20
    buf = header + b"".join(frame(bytes(1 << 20)) for _ in range(sent_mib))
    outcome, peak = decode_measured(buf)
    assert isinstance(outcome, Truncated), outcome
    decoded_per_wire_byte = 4 // element  # fp16 decodes into float32: twice its wire size
    assert peak < 8 * sent * decoded_per_wire_byte + (1 << 20), f"{peak} bytes allocated after {sent} sent"
