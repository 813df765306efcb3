"""The codecs by wire name, and the two ways to get one: from a peer's header or from local settings."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from gossip.codecs.base import Codec, OptionValue
from gossip.codecs.floats import Bf16Codec, Fp16Codec, Fp32Codec
from gossip.codecs.int8 import Int8Codec
from gossip.codecs.sparseloco import SparseLoCoCodec
from gossip.codecs.topk import TopKCodec
from gossip.errors import UnknownCodec

CodecType = type[Fp32Codec | Fp16Codec | Bf16Codec | Int8Codec | TopKCodec | SparseLoCoCodec]
CODEC_TYPES: Mapping[str, CodecType] = MappingProxyType(
    {cls.name: cls for cls in (Fp32Codec, Fp16Codec, Bf16Codec, Int8Codec, TopKCodec, SparseLoCoCodec)}
)
# Codecs that carry every element, so they are sound on whole parameter vectors (anchors, SPES's groups,
# plain gossip); top-k and SparseLoCo drop most entries and are sound only on differences (gossip.rules).
STATE_CODECS = (Fp32Codec.name, Fp16Codec.name, Bf16Codec.name, Int8Codec.name)
# Codecs that send a few entries of each tensor: sound on differences with error feedback only, and averaged
# by an all-gather (partial sums would not stay sparse).
SPARSE_CODECS = (TopKCodec.name, SparseLoCoCodec.name)


def codec_from_wire(name: str, options: Mapping[str, object]) -> Codec:
    """The codec a header names; UnknownCodec for an unknown name, BadSchema for bad options."""
    cls = CODEC_TYPES.get(name)
    if cls is None:
        raise UnknownCodec(f"unknown codec {name!r} (known: {', '.join(CODEC_TYPES)})")
    return cls.from_options(options)


def get_codec(name: str, **options: OptionValue) -> Codec:
    """A codec from local configuration, e.g. get_codec("fp16"), get_codec("int8", block=128),
    get_codec("topk", ratio=0.01), get_codec("sparseloco", ratio=0.02, chunk=4096, bits=2); ValueError for an unknown name or bad options.

    (A codec named by a peer's header goes through `codec_from_wire`, which raises WireErrors.)
    """
    cls = CODEC_TYPES.get(name)
    if cls is None:
        raise ValueError(f"unknown codec {name!r}: choose one of {', '.join(CODEC_TYPES)}")
    make: Callable[..., Codec] = cls  # the options are checked by the codec's constructor
    try:
        return make(**options)
    except TypeError as exc:
        raise ValueError(f"bad options for codec {name!r}: {exc}") from None
