"""The murmur wire format (protocol `/murmur/gossip/1`): framing, header schema, validation, chunked payload.

Frames
    Every frame is an 8-byte big-endian unsigned length N followed by N bytes of body.

Message
    One header frame, then payload chunk frames::

        [N_h][header: msgpack map, N_h bytes]  [N_1][chunk 1] ... [N_m][chunk m]

    The payload is the encoded tensors concatenated in manifest order, cut into chunks of at most
    `chunk_bytes` (default 1 MiB; every chunk but the last is full when `encode_message` writes it,
    but a receiver accepts any sizes). Chunk bodies are raw bytes, not msgpack. The chunk lengths
    must add up exactly to the sum of the manifest's byte lengths; a message whose tensors encode
    to zero bytes has no chunk frames. Nothing follows the last chunk within the message.

Header (a msgpack map with exactly these keys; any other key is a schema error; declared as
    `gossip.wire.header.Header`, a msgspec Struct, and validated by msgspec, then against `WireLimits`)
    ``v``           int, protocol version, 1
    ``swarm``       str, swarm name
    ``config_hash`` str, hash of the swarm's training config
    ``sender``      str, sender's peer id
    ``round``       int >= 0
    ``step``        int >= 0
    ``kind``        str, what the message is for, e.g. "exchange", "reply", "params"
    ``codec``       str, one of fp32, fp16, bf16, int8, topk, sparseloco (see `gossip.codecs` for layouts)
    ``codec_opts``  map str -> int/float, e.g. {"block": 256} or {"ratio": 0.01}; {} for none
    ``manifest``    list of [name: str, dtype: "float32"|"float16"|"float64", shape: list of int >= 0,
                    nbytes: int, the tensor's encoded length on the wire]
    ``meta``        map str -> None/bool/int/float/str, for extensions (bounded by `WireLimits`); the
                    keys murmur's protocols use are listed under "Meta keys" below
    Strings are UTF-8, non-empty and at most `max_name_len` bytes (meta's string values: at most
    `max_meta_value_len`); ints are below 2^63; map keys are unique. Tensor names are unique. Decoded
    tensors come back in the manifest's dtype and shape.

Meta keys
    ``error``       str, in a ``reject``: why (a `gossip.errors` kind or a refusal such as "late")
    ``current``     true, in a ``pull`` outside any round (a joiner's download): answer with the current tensors
    ``from``        int, with ``current``: answer with the current tensors from this manifest index on (a
                    download resumed where another donor's broke off); not an index of ours: BadSchema
    ``until``       int, with ``current``: ... and only the tensors before this index (a joiner's spot check);
                    ``from`` and ``until`` must make a non-empty range of the answerer's tensors
    ``codec``       str, with ``current``: answer in this codec, one that carries every element (fp32, fp16,
                    bf16, int8; default fp32): a DiLoCo joiner's outer momentum, in int8
    ``expert``, ``version``, ``hash``   the SPES fetch protocol's (gossip.spes.fetch)
    ``proof``       str, in a swarm admitting by key: the sender's HMAC-SHA256 (hex) under the swarm key of
                    (swarm, config_hash, sender, round, kind) (node.net.admission)
    ``member``      str, in an allowlist swarm: the sender's membership certificate from the founder,
                    "EXPIRES.SIGNATURE" (node.net.admission)
    Every message of a key or allowlist swarm carries its sender's proof; a receiver checks it with the
    header, before any payload, and refuses a sender it does not admit (NotMember, "not_member").

Validation (receiver), in this order, each failure its own `gossip.errors` exception:
    1. header length prefix against `max_header_bytes` before reading the body (FrameTooLarge);
    2. msgpack with per-container limits, so a declared array of 10^9 items is refused without
       allocating (FrameTooLarge), malformed bytes or duplicate keys (BadSchema);
    3. version (VersionMismatch), then keys, types and ranges (BadSchema; a `WireLimits` bound,
       such as too many tensors, dims or meta entries or too long a name: FrameTooLarge);
    4. codec known (UnknownCodec) and its options valid (BadSchema);
    5. manifest: every entry's nbytes is what the codec needs for its shape (ManifestMismatch),
       total payload <= `max_payload_bytes` and decoded size <= `max_decoded_bytes` (FrameTooLarge);
    6. against the receiver's `Expectation`, if any: sender equal to the stream's authenticated peer
       (BadSchema), swarm and config hash (WrongSwarm), sender admitted to the swarm (NotMember), codec
       allowed (UnknownCodec), manifest equal to the local model's names, dtypes, shapes
       (ManifestMismatch);
    7. each chunk length: non-zero (BadSchema), <= `max_chunk_bytes` (FrameTooLarge), <= what the
       manifest has left (ManifestMismatch);
    8. each tensor as soon as its bytes are in: codec layout (BadSchema) and finite values
       (NonFiniteValues). A stream or buffer that ends early raises Truncated; bytes after the
       message (in `decode_message`) are BadSchema.
    The decoder allocates only in proportion to bytes actually received, never from a declared
    length alone: an fp32/fp16/bf16 tensor's output array is allocated once an eighth of its bytes
    have arrived (so at most 8x the decoded size of what was received) and then filled chunk by
    chunk as the bytes arrive; int8 and top-k tensors are kept as received and decoded once
    complete. The one other amplification is a decoded tensor (a top-k tensor of n elements arrives
    in as little as 8 bytes), bounded by `max_decoded_bytes`. A node passes an `Expectation` with
    its model's manifest, which fixes every size before any payload is read.
"""
from gossip.wire.decode import Message, MessageDecoder, ValuesSink, decode_message
from gossip.wire.encode import EncodedTensors, encode_message, encode_tensors, iter_message, message_nbytes
from gossip.wire.frames import DEFAULT_CHUNK_BYTES, PREFIX_BYTES
from gossip.wire.header import (
    DEFAULT_LIMITS,
    HEADER_KEYS,
    PROTOCOL_VERSION,
    Admit,
    Expectation,
    Header,
    HeaderFields,
    ManifestEntry,
    MetaValue,
    TensorSpec,
    WireLimits,
    check_expectation,
    parse_header,
    tensor_specs,
)
from gossip.wire.reader import MessageReader, read_message

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_LIMITS",
    "HEADER_KEYS",
    "PREFIX_BYTES",
    "PROTOCOL_VERSION",
    "Admit",
    "EncodedTensors",
    "Expectation",
    "Header",
    "HeaderFields",
    "ManifestEntry",
    "Message",
    "MessageDecoder",
    "MessageReader",
    "MetaValue",
    "TensorSpec",
    "ValuesSink",
    "WireLimits",
    "check_expectation",
    "decode_message",
    "encode_message",
    "encode_tensors",
    "iter_message",
    "message_nbytes",
    "parse_header",
    "read_message",
    "tensor_specs",
]
