"""Tensor codecs for the wire: how one flat float tensor becomes bytes and back (fp32, fp16, bf16, int8, top-k,
SparseLoCo).

Every codec takes a numpy array of float32, float16 or float64 (other dtypes raise `TypeError`),
encodes it flat in C order, and decodes into a fresh, writable, flat array of the dtype asked for.
Multi-byte values on the wire are little-endian. Encoding refuses NaN, infinity and values the
codec cannot represent (`NonFiniteValues`); decoding checks everything a hostile peer could send
and raises `NonFiniteValues` (or `BadSchema` for a malformed top-k/int8 layout) instead of ever
returning a non-finite value. float64 sources are rounded to float32 first: every codec carries
float32 precision at most.

Layouts and error bounds (x a source value, x^ its decoded value; "float32 source" also covers float16):

- ``fp32``: n float32 (4n bytes). Exact for float32/float16 sources.
- ``fp16``: n IEEE binary16 (2n bytes), round to nearest even. |x - x^| <= 2^-11 |x| + 2^-25.
  |x| > 65504 raises `NonFiniteValues` rather than becoming infinity.
- ``bf16``: n bfloat16 (2n bytes: the high half of the float32, round to nearest even).
  |x - x^| <= 2^-8 |x| + 2^-134. |x| >= 3.3961e38 (which would round to infinity) raises, and for
  float16 tensors |x| >= 65408 (which would round to 65536, beyond float16) raises.
- ``int8`` (option ``block``, default 256): the scales of ceil(n / block) blocks as float32, then n
  int8 values (4 ceil(n/block) + n bytes). A block's scale is s = max|x| / 127, values are
  round(x / s); |x - x^| <= s (1/2 + 2^-14) (the 2^-14 covers float32 rounding). A block whose
  max|x| < 2^-100 is sent with s = 0 (all zeros; error below 2^-100). For float16 tensors the
  decoded value is then rounded to float16 (another 2^-11 |x^| + 2^-25).
- ``topk`` (option ``ratio`` in (0, 1]): k = min(n, max(1, ceil(ratio * n))) for n > 0 (0 for
  n = 0) entries of largest magnitude: k uint32 indices, strictly increasing, then their k float32
  values (8k bytes). Unsent entries decode as 0. The decoder accepts any k <= n (8k bytes) so
  a sender may send fewer; it requires indices strictly increasing and < n, and n < 2^32.
  Top-k alone drops what it does not send; `ErrorFeedback` keeps that residual on the sender.
- ``sparseloco`` (options ``ratio`` in (0, 1], ``chunk`` in [1, 2^20] default 4096, ``bits`` in [1, 8]
  default 2): per chunk of ``chunk`` elements (the last may be shorter) its k = min(c, max(1, ceil(ratio c)))
  entries of largest magnitude; the chunks' float32 scales (the largest kept |x|), then each chunk's
  in-chunk offsets Elias-Fano coded (unary high parts, then floor(log2(c / k)) low bits each), then one
  ``bits``-bit code per kept value (a sign bit and a level l; x^ = +-(l + 1) / 2^(bits-1) of the scale).
  The size is fixed by n and the options; the decoder refuses a count of offsets other than k per chunk,
  offsets out of the chunk or not increasing (BadSchema) and a non-finite scale (NonFiniteValues).
  Sound only on differences with `ErrorFeedback` (about 0.2 bits per element at 2%, 4096, 2 bits).

fp32, fp16 and bf16 are `ElementwiseCodec`s: any run of whole elements decodes on its own
(`decode_into`), which lets the wire decoder decode a tensor chunk by chunk as it arrives.

Modules: `base` (the `Codec` protocol, shared checks), `kernels` (block and thread spans, range
checks, float16/bfloat16 casts), `floats` (fp32, fp16, bf16), `int8`, `topk`, `sparseloco`,
`error_feedback`, `registry` (the codecs by name). Import from `gossip.codecs`; importing it does not import torch.
"""

from gossip.codecs.base import Buffer, Codec, OptionValue
from gossip.codecs.error_feedback import ErrorFeedback
from gossip.codecs.floats import Bf16Codec, ElementwiseCodec, Fp16Codec, Fp32Codec
from gossip.codecs.int8 import Int8Codec
from gossip.codecs.kernels import WIRE_DTYPES, bfloat16_bits, dtype_name
from gossip.codecs.registry import CODEC_TYPES, SPARSE_CODECS, STATE_CODECS, codec_from_wire, get_codec
from gossip.codecs.sparseloco import SparseLoCoCodec
from gossip.codecs.topk import DEFAULT_TOPK_RATIO, TopKCodec

__all__ = [
    "CODEC_TYPES",
    "DEFAULT_TOPK_RATIO",
    "SPARSE_CODECS",
    "STATE_CODECS",
    "WIRE_DTYPES",
    "Bf16Codec",
    "Buffer",
    "Codec",
    "ElementwiseCodec",
    "ErrorFeedback",
    "Fp16Codec",
    "Fp32Codec",
    "Int8Codec",
    "OptionValue",
    "SparseLoCoCodec",
    "TopKCodec",
    "bfloat16_bits",
    "codec_from_wire",
    "dtype_name",
    "get_codec",
]
