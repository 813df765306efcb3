"""What every codec is (the `Codec` protocol) and the checks the codecs share: payload sizes and
the options a header may carry."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import ClassVar, Protocol, Self, TypeGuard

import numpy as np
from numpy.typing import DTypeLike

from gossip.errors import BadSchema

Buffer = bytes | bytearray | memoryview
OptionValue = int | float


class Codec(Protocol):
    """How one flat tensor is encoded; `name` and `options()` go into the header."""

    name: ClassVar[str]

    def options(self) -> dict[str, OptionValue]:
        """The codec's options as sent in the header's `codec_opts`."""
        ...

    def encoded_nbytes(self, numel: int) -> int:
        """Exact encoded size of a tensor of `numel` elements, as this codec's encoder produces it."""
        ...

    def accepts_nbytes(self, numel: int, nbytes: int) -> bool:
        """Whether a manifest entry of `numel` elements may occupy `nbytes` on the wire."""
        ...

    def encode(self, x: np.ndarray) -> memoryview:
        """The encoded bytes of x (flat, C order); may share memory with x."""
        ...

    def decode(self, buf: Buffer, numel: int, dtype: DTypeLike = np.float32) -> np.ndarray:
        """A fresh flat array of `numel` finite values in `dtype`; `buf` has an accepted size."""
        ...


def _check_size(name: str, buf: Buffer, expected: int) -> None:
    if len(buf) != expected:
        raise BadSchema(f"{name} payload of {len(buf)} bytes, expected {expected}")


def _check_known_options(name: str, options: Mapping[str, object], known: Collection[str]) -> None:
    unknown = set(options) - set(known)
    if unknown:
        raise BadSchema(f"codec {name!r} got unknown options {sorted(map(str, unknown))}")


def _is_int_in(value: object, lo: int, hi: int) -> TypeGuard[int]:
    # type() rather than isinstance(): a bool is not an integer option
    return type(value) is int and lo <= value <= hi


def _is_ratio(value: object) -> TypeGuard[int | float]:
    """A number in (0, 1] (bools excluded)."""
    return (type(value) is int or type(value) is float) and math.isfinite(value) and 0 < value <= 1


def _ratio_option(name: str, options: Mapping[str, object]) -> float:
    """The required option 'ratio' of a sparse codec's header: a number in (0, 1]."""
    if "ratio" not in options:
        raise BadSchema(f"codec {name!r} needs option 'ratio'")
    ratio = options["ratio"]
    if not _is_ratio(ratio):
        raise BadSchema(f"codec {name!r} option 'ratio' must be a number in (0, 1], got {ratio!r}")
    return float(ratio)


def _int_option(name: str, options: Mapping[str, object], key: str, default: int, lo: int, hi: int) -> int:
    value = options.get(key, default)
    if not _is_int_in(value, lo, hi):
        raise BadSchema(f"codec {name!r} option {key!r} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


class _NoOptions:
    """Codecs without options: a header must carry none."""

    name: ClassVar[str]

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> Self:
        if options:
            raise BadSchema(f"codec {cls.name!r} takes no options, got {sorted(map(str, options))}")
        return cls()

    def options(self) -> dict[str, OptionValue]:
        return {}


class _ExactSize:
    """Fixed-size codecs: the manifest size must be exactly what the encoder produces."""

    def encoded_nbytes(self, numel: int) -> int:
        raise NotImplementedError

    def accepts_nbytes(self, numel: int, nbytes: int) -> bool:
        return nbytes == self.encoded_nbytes(numel)
