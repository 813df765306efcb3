"""Tests for the SparseLoCo codec (gossip.codecs.sparseloco): chunked top-k with low-bit values against an
independent numpy reference, its size in bits per element, hostile payloads refused with the wire's error
kinds, and error feedback conserving the sum of pseudo-gradients."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gossip.codecs import ErrorFeedback, Int8Codec, SparseLoCoCodec, codec_from_wire, get_codec
from gossip.diloco import RoundMessages, round_bytes
from gossip.errors import BadSchema, NonFiniteValues
from gossip.plan import Algorithm, LinkSpec, PlanConfig, gossip_estimate, payload_bytes, specs_for_vectors
from gossip.rules import Knobs, Rule, broken_rules
from gossip.wire import Expectation, decode_message, encode_message, message_nbytes
from topology import TopologySpec

pytestmark = pytest.mark.unit

LINK = LinkSpec(bandwidth_mbit=8.0, latency_ms=10.0, efficiency=1.0)
FIELDS = {"swarm": "s", "config_hash": "c0ffee", "sender": "12D3KooWpeer", "round": 1, "step": 2, "kind": "exchange"}


def reference(x: np.ndarray, ratio: float, chunk: int, bits: int) -> np.ndarray:
    """The tensor the codec should decode, chunk by chunk from the definition, in float64."""
    x = np.asarray(x, np.float64).ravel()
    out = np.zeros_like(x)
    levels = 2 ** (bits - 1)
    for start in range(0, x.size, chunk):
        part = x[start : start + chunk]
        k = min(part.size, max(1, math.ceil(ratio * part.size)))
        keep = np.argsort(-np.abs(part), kind="stable")[:k]
        scale = np.abs(part[keep]).max()
        if scale == 0:
            continue
        level = np.clip(np.rint(np.abs(part[keep]) / scale * levels) - 1, 0, levels - 1)
        out[start + keep] = np.where(part[keep] < 0, -1.0, 1.0) * (level + 1) / levels * scale
    return out


@pytest.mark.parametrize(("n", "ratio", "chunk", "bits"), [
    (0, 0.02, 4096, 2), (1, 0.02, 4096, 2), (4096 * 3 + 77, 0.02, 4096, 2), (5000, 0.03, 1000, 1),
    (3000, 0.01, 512, 4), (700, 0.5, 64, 8), (64, 1.0, 16, 3),
])
def test_round_trip_matches_the_chunked_top_k_reference(n: int, ratio: float, chunk: int, bits: int) -> None:
    codec = SparseLoCoCodec(ratio, chunk, bits)
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32) * 3
    encoded = codec.encode(x)
    assert len(encoded) == codec.encoded_nbytes(n)
    decoded = codec.decode(bytes(encoded), n)
    assert decoded.dtype == np.float32 and decoded.shape == (n,) and decoded.flags.writeable
    np.testing.assert_allclose(decoded, reference(x, ratio, chunk, bits), rtol=1e-6, atol=0)
    assert np.count_nonzero(decoded) == codec.k(n)
    # a decoded message re-encodes to itself: what error feedback hands the exchange crosses the wire unchanged
    np.testing.assert_array_equal(codec.decode(bytes(codec.encode(decoded)), n), decoded)
    for dtype in (np.float16, np.float64):
        assert codec.decode(bytes(encoded), n, dtype).dtype == dtype


def test_bits_per_element_match_the_analytic_size() -> None:
    # 4096-element chunks at 2%: k = 82, offsets split at 5 low bits, 82 + 4095 // 32 + 1 = 210 unary bits;
    # per chunk 32 (scale) + 210 + 82 * 5 (offsets) + 82 * 2 (values) = 816 bits
    codec = get_codec("sparseloco", ratio=0.02, chunk=4096, bits=2)
    n = 8 * 4096  # whole bytes per section
    assert codec.encoded_nbytes(n) * 8 / n == 816 / 4096 == 0.19921875
    assert len(codec.encode(np.ones(n, np.float32))) == codec.encoded_nbytes(n)
    for ratio, chunk, bits in ((0.01, 4096, 2), (0.03, 2048, 1), (0.02, 4096, 4)):
        k = math.ceil(ratio * chunk)
        low = math.floor(math.log2(chunk / k))
        per_chunk = 32 + k + ((chunk - 1) >> low) + 1 + k * low + k * bits
        codec = SparseLoCoCodec(ratio, chunk, bits)
        assert codec.encoded_nbytes(8 * chunk) == per_chunk  # 8 chunks: per_chunk bits x 8 / 8
    # a message is the payload and a header: under 0.21 bits per element for a 1M-element tensor
    codec = SparseLoCoCodec()
    assert message_nbytes({"w": ((1 << 20,), np.float32)}, codec) * 8 / (1 << 20) < 0.21


def test_error_feedback_conserves_the_sum_of_pseudo_gradients() -> None:
    rng = np.random.default_rng(3)
    codec = SparseLoCoCodec(0.02, 512, 2)
    feedback = ErrorFeedback(codec)
    n = 512 * 6 + 100
    total_in = np.zeros(n)
    total_sent = np.zeros(n)
    residual = np.zeros(n)  # the independent computation: the reference codec applied to input + residual
    for _ in range(60):
        x = rng.standard_normal(n)  # float64: the residual is then kept to float64 precision
        sent = feedback.compress("delta", x)
        expected = reference(x + residual, 0.02, 512, 2)
        np.testing.assert_allclose(sent, expected, rtol=1e-6, atol=1e-12)
        residual = x + residual - sent
        assert np.count_nonzero(sent) == codec.k(n)
        total_in += x
        total_sent += sent
    final = feedback.residual("delta")
    assert final is not None
    np.testing.assert_allclose(total_sent + final, total_in, rtol=0, atol=1e-9)
    np.testing.assert_allclose(final, residual, rtol=0, atol=1e-9)
    # the residual stays bounded: error feedback sends what it owes instead of letting it grow with the steps
    assert np.abs(final).max() < 60 * 0.2


def _payload(scales: list[float], index_bits: list[int], value_bits: list[int]) -> bytes:
    return (np.asarray(scales, "<f4").tobytes() + np.packbits(np.asarray(index_bits, np.uint8), bitorder="little")
            .tobytes() + np.packbits(np.asarray(value_bits, np.uint8), bitorder="little").tobytes())


def test_hostile_payloads_are_refused() -> None:
    # chunks of 8 at 25%: k = 2, 2 low bits per offset, 2 + 7 // 4 + 1 = 4 unary bits; 1 bit per value
    codec = SparseLoCoCodec(0.25, 8, 1)
    n = 8
    assert codec.encoded_nbytes(n) == 4 + 1 + 1
    good = _payload([2.0], [1, 1, 0, 0, 1, 0, 0, 1], [0, 1])  # offsets 1 and 2: +2 at 1, -2 at 2
    np.testing.assert_array_equal(codec.decode(good, n), [0, 2, -2, 0, 0, 0, 0, 0])
    with pytest.raises(BadSchema, match="expected 6"):
        codec.decode(good[:-1], n)
    with pytest.raises(BadSchema, match="expected 6"):
        codec.decode(good + b"\0", n)
    with pytest.raises(BadSchema, match="holds 3 offsets"):
        codec.decode(_payload([2.0], [1, 1, 1, 0, 1, 0, 0, 1], [0, 1]), n)
    with pytest.raises(BadSchema, match="holds 1 offsets"):
        codec.decode(_payload([2.0], [1, 0, 0, 0, 1, 0, 0, 1], [0, 1]), n)
    with pytest.raises(BadSchema, match="out of range"):  # high parts 2 and 2: offsets 8 and up
        codec.decode(_payload([2.0], [0, 0, 1, 1, 1, 0, 0, 1], [0, 1]), n)
    with pytest.raises(BadSchema, match="not strictly increasing"):  # offsets 3 then 1
        codec.decode(_payload([2.0], [1, 1, 0, 0, 1, 1, 1, 0], [0, 1]), n)
    with pytest.raises(BadSchema, match="negative"):
        codec.decode(_payload([-2.0], [1, 1, 0, 0, 1, 0, 0, 1], [0, 1]), n)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(NonFiniteValues):
            codec.decode(_payload([bad], [1, 1, 0, 0, 1, 0, 0, 1], [0, 1]), n)
    # the largest finite scale decodes to finite values (a level never exceeds its scale)
    big = float(np.finfo(np.float32).max)
    assert np.isfinite(codec.decode(_payload([big], [1, 1, 0, 0, 1, 0, 0, 1], [0, 1]), n)).all()


def test_options_from_a_header_are_checked_as_wire_errors() -> None:
    codec = SparseLoCoCodec(0.02, 4096, 2)
    assert codec.options() == {"ratio": 0.02, "chunk": 4096, "bits": 2}
    assert codec_from_wire("sparseloco", codec.options()) == codec
    assert codec_from_wire("sparseloco", {"ratio": 0.02}) == codec  # chunk and bits have defaults
    assert get_codec("sparseloco", ratio=0.01, chunk=2048, bits=1) == SparseLoCoCodec(0.01, 2048, 1)
    for options in ({}, {"ratio": 0}, {"ratio": 1.5}, {"ratio": float("nan")}, {"ratio": 0.02, "chunk": 0},
                    {"ratio": 0.02, "chunk": (1 << 20) + 1}, {"ratio": 0.02, "bits": 9}, {"ratio": 0.02, "bits": True},
                    {"ratio": 0.02, "bits": 2.0}, {"ratio": 0.02, "packed": 1}):
        with pytest.raises(BadSchema):
            codec_from_wire("sparseloco", options)
    for kwargs in ({"ratio": 0.0}, {"ratio": 0.02, "chunk": 0}, {"ratio": 0.02, "bits": 0}, {"ratio": 0.02, "x": 1}):
        with pytest.raises(ValueError):
            get_codec("sparseloco", **kwargs)


def test_encoding_refuses_non_finite_values() -> None:
    codec = SparseLoCoCodec(0.5, 4, 2)
    for bad in (np.nan, np.inf):
        x = np.ones(10, np.float32)
        x[7] = bad
        with pytest.raises(NonFiniteValues, match="element 7"):
            codec.encode(x)
    with pytest.raises(NonFiniteValues):
        codec.encode(np.array([1e300], np.float64))


def test_messages_cross_the_wire_and_a_tampered_one_is_refused() -> None:
    codec = SparseLoCoCodec(0.02, 4096, 2)
    rng = np.random.default_rng(1)
    tensors = {"a.w": rng.standard_normal((96, 100)).astype(np.float32), "a.b": rng.standard_normal(33).astype(np.float32)}
    buf = b"".join(encode_message(tensors, codec, **FIELDS))
    assert len(buf) == message_nbytes(tensors, codec, **FIELDS)
    expected = Expectation.for_tensors("s", "c0ffee", tensors, {codec.name})
    msg = decode_message(buf, expected=expected)
    assert dict(msg.header.codec_opts) == codec.options()
    for name, x in tensors.items():
        np.testing.assert_array_equal(msg.tensors[name].ravel(), codec.decode(bytes(codec.encode(x)), x.size))
    # an index section whose unary high parts are all set (far more offsets than k) is refused in decoding
    tampered = bytearray(buf)
    scales = 4 * 3  # "a.w" has 9600 elements: chunks of 4096, 4096 and 1408
    at = buf.index(bytes(codec.encode(tensors["a.w"]))[:32]) + scales
    tampered[at : at + 8] = b"\xff" * 8
    with pytest.raises(BadSchema, match="offsets"):
        decode_message(bytes(tampered), expected=expected)


def test_round_bytes_and_the_plan_count_its_size() -> None:
    codec = SparseLoCoCodec(0.02, 4096, 2)
    sizes = {"w": 1 << 20, "b": 1000}
    specs = {name: ((n,), np.float32) for name, n in sizes.items()}
    exact = codec.encoded_nbytes(1 << 20) + codec.encoded_nbytes(1000)
    assert payload_bytes(specs_for_vectors(sizes), codec) == exact
    # one symmetric exchange opened: a request with tensors, an ack, and the answer with tensors
    full, bare = message_nbytes(specs, codec), message_nbytes({}, codec)
    traffic = round_bytes(specs, codec, RoundMessages(exchanges_asked=1))
    assert (traffic.sent, traffic.received) == (full + bare, full)
    assert exact < full - bare < exact + 200  # the payloads, their manifest entries and chunk prefixes
    # murmur plan's DiLoCo bytes per step: the sparse pseudo-gradients beside the int8 anchors at every sync
    plan = {"specs": specs_for_vectors(sizes), "step_time_s": 0.5, "link": LINK, "peers": 8,
            "topology": TopologySpec("ring"), "algorithm": Algorithm.DILOCO, "local_steps": 100}
    sparse = gossip_estimate(PlanConfig(**plan, codec=codec, anchor_every=0))
    dense = gossip_estimate(PlanConfig(**plan, codec=Int8Codec(), anchor_every=0))
    assert sparse.sent_bytes_per_step < dense.sent_bytes_per_step / 30
    assert sparse.sent_bytes_per_step * 8 / sum(sizes.values()) < 0.01  # bits per parameter per inner step
    with pytest.raises(ValueError, match="anchors are whole parameters"):
        PlanConfig(**plan, codec=codec, anchor_codec=codec)
    # like top-k, it is sound on differences only
    assert Rule.TOPK_ON_WHOLE_PARAMETERS in broken_rules(Knobs(codec="sparseloco"))
    assert not broken_rules(Knobs(codec="sparseloco", diloco=True))
    assert Rule.TOPK_WITH_SPES in broken_rules(Knobs(codec="sparseloco", spes=True))


def _founded(line: str) -> dict:
    import shlex

    from node.cli.main import build_parser, node_config_from_args
    from node.runtime.founding import swarm_document

    args = build_parser().parse_args(["node", *shlex.split(line)])
    return swarm_document(node_config_from_args(args, {}), 1234.5)


def test_a_founder_offers_it_for_diloco_and_joiners_build_the_same_codec_from_the_document() -> None:
    from node.swarm.recipe import SwarmSettings

    document = _founded("--optimizer diloco --local-steps 50 --codec sparseloco --topk-ratio 0.02")
    assert document["gossip"]["codec"] == "sparseloco" and document["gossip"]["topk_ratio"] == 0.02
    assert "topk_packed" not in document["gossip"]
    codec = SwarmSettings.from_doc(document).codec
    assert codec.name == "sparseloco" and codec.options()["ratio"] == 0.02


def test_a_founder_cannot_gossip_whole_parameters_in_it() -> None:
    from node.config import ConfigError

    with pytest.raises(ConfigError, match="sound on differences only"):
        _founded("--optimizer dadam --codec sparseloco")
