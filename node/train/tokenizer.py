"""Tokenizers: byte-level BPE trained with `tokenizers` on local files (`murmur tokenizer train`), an
existing `tokenizer.json` (`--tokenizer PATH`), or murmur's one-token-per-byte default.

A swarm's tokenizer is part of its config: the founder publishes its sha256, vocabulary size and byte
length (`TokenizerSpec`); a joiner uses a file with that hash (its own `--tokenizer`, or one cached
under its data directory by hash) or fetches it from a peer (node.runtime.tokenizer).
`tokenizers` is imported only when a BPE tokenizer is used.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Protocol

import msgspec

EOS = "<|endoftext|>"  # the one special token: id 0, between documents
MAX_TOKENIZER_BYTES = 32 << 20  # a tokenizer.json of a 250k-token vocabulary is ~20 MB
MAX_VOCAB = 1 << 21
CACHE_DIR = "tokenizers"  # under the node's data directory: <sha256>.json


class TokenizerInvalid(ValueError):
    """A tokenizer file that cannot be used (one line, says why)."""


class TokenizerSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The swarm config's tokenizer entry: which file every peer must tokenize with (bounds checked
    by `from_doc`, as the entry comes from the network)."""

    sha256: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
    vocab_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_VOCAB)]
    bytes: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENIZER_BYTES)]

    def to_doc(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "vocab_size": self.vocab_size, "bytes": self.bytes}

    @classmethod
    def from_doc(cls, doc: object) -> TokenizerSpec:
        try:
            return msgspec.convert(doc, cls)
        except msgspec.ValidationError as exc:
            raise TokenizerInvalid(f"the swarm's tokenizer entry is invalid: {exc}") from None


class TextTokenizer(Protocol):
    """What the data pipeline needs of a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int | None: ...  # appended after each document; None: documents are joined by "\n"

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...


class ByteTokenizer:
    """One token per UTF-8 byte (vocabulary 256): the embedded models' tokenizer."""

    vocab_size = 256
    eos_id = None

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]


class BpeTokenizer:
    """A `tokenizers.Tokenizer` from a tokenizer.json; encode_batch runs in Rust threads, without the GIL."""

    def __init__(self, data: bytes) -> None:
        from tokenizers import Tokenizer

        try:
            self._tokenizer = Tokenizer.from_str(data.decode("utf-8"))
        except Exception as exc:  # tokenizers raises its own Exception type for a malformed file
            raise TokenizerInvalid(f"not a tokenizer.json: {str(exc).splitlines()[0] if str(exc) else exc}") from None
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._tokenizer.token_to_id(EOS)

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids)))


def spec_of(data: bytes) -> TokenizerSpec:
    """The config entry of a tokenizer file's bytes (parses it, so a broken file is refused here)."""
    if len(data) > MAX_TOKENIZER_BYTES:
        raise TokenizerInvalid(f"the tokenizer file has {len(data)} bytes, more than {MAX_TOKENIZER_BYTES}")
    return TokenizerSpec(hashlib.sha256(data).hexdigest(), BpeTokenizer(data).vocab_size, len(data))


def read_tokenizer_file(path: Path) -> bytes:
    try:
        size = path.stat().st_size
        if size > MAX_TOKENIZER_BYTES:
            raise TokenizerInvalid(f"{path} has {size} bytes, more than a tokenizer's {MAX_TOKENIZER_BYTES}")
        return path.read_bytes()
    except OSError as exc:
        raise TokenizerInvalid(f"cannot read the tokenizer {path}: {exc.strerror or exc}") from None


def cache_path(data_dir: Path, sha256: str) -> Path:
    return data_dir / CACHE_DIR / f"{sha256}.json"


def store_in_cache(data_dir: Path, data: bytes) -> Path:
    """Keep a swarm's tokenizer under the data directory by hash, atomically (for restarts and for
    serving it to joiners)."""
    path = cache_path(data_dir, hashlib.sha256(data).hexdigest())
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as tmp:
        tmp.write(data)
    os.replace(tmp.name, path)
    return path


def find_local(spec: TokenizerSpec, data_dir: Path, own: Path | None) -> bytes | None:
    """The swarm's tokenizer from this node's own --tokenizer file or its cache, if either has that hash."""
    for path in (own, cache_path(data_dir, spec.sha256)):
        if path is None or not path.is_file():
            continue
        data = read_tokenizer_file(path)
        if hashlib.sha256(data).hexdigest() == spec.sha256:
            return data
    return None


def train_bpe(texts: Iterable[str], vocab_size: int, out: Path, min_frequency: int = 2) -> TokenizerSpec:
    """Train a byte-level BPE of `vocab_size` tokens (EOS at id 0, then the 256 byte tokens) on `texts`
    and write its tokenizer.json to `out` atomically."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise TokenizerInvalid(f"--vocab {vocab_size} is too small: a byte-level BPE needs at least "
                               f"{len(alphabet) + 1} tokens (EOS and the 256 bytes)")
    if vocab_size > MAX_VOCAB:
        raise TokenizerInvalid(f"--vocab {vocab_size} is larger than {MAX_VOCAB}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS],
                                  initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    data = tokenizer.to_str().encode("utf-8")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out.parent, prefix=out.name, suffix=".tmp", delete=False) as tmp:
        tmp.write(data)
    os.replace(tmp.name, out)
    return spec_of(data)


def _byte_to_char() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (the characters of `tokenizers`' ByteLevel alphabet)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), ord("\u00ff") + 1)]
    shifted = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(shifted)}}


def byte_tokenizer_json() -> bytes:
    """The byte tokenizer (ByteTokenizer: id = UTF-8 byte, 256 ids, no special token) as a `tokenizers`
    tokenizer.json, for tools that load one (`murmur export`): a ByteLevel pre-tokenizer without its
    split regex turns the text into one stand-in character per byte, and a BPE without merges gives each
    stand-in its byte's id; the ByteLevel decoder turns ids back into the bytes' text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: b for b, char in _byte_to_char().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer.to_str().encode("utf-8")


@dataclass(frozen=True)
class SwarmTokenizer:
    """The tokenizer a node trains with: the swarm's BPE file (bytes) or the byte tokenizer (None)."""

    data: bytes | None

    def load(self) -> TextTokenizer:
        return BpeTokenizer(self.data) if self.data is not None else ByteTokenizer()


__all__ = [
    "EOS",
    "MAX_TOKENIZER_BYTES",
    "BpeTokenizer",
    "ByteTokenizer",
    "SwarmTokenizer",
    "TextTokenizer",
    "TokenizerInvalid",
    "TokenizerSpec",
    "byte_tokenizer_json",
    "cache_path",
    "find_local",
    "read_tokenizer_file",
    "spec_of",
    "store_in_cache",
    "train_bpe",
]
