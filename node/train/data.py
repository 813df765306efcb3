"""Training data: a byte-level tokenizer, the embedded story corpus (generated, never downloaded),
user corpora, per-peer shards and reproducible batches.

The embedded corpus is generated from a seed with numpy's PCG64 raw 64-bit words and integer/float
arithmetic fixed by IEEE 754, so it is bit-identical on every machine, Python and numpy version; its
recipe is versioned by CORPUS_VERSION. It is English-like short stories with structure beyond byte
frequencies: a vocabulary with Zipf-like word frequencies, sentence templates, a/an agreement,
counting, and names, a refrain and a title object that recur throughout a story.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

VOCAB_SIZE = 256
# Bump when the generator's output changes: cached corpora and swarm configs name the version.
CORPUS_VERSION = 1
DEFAULT_CORPUS_BYTES = 4_000_000
DEFAULT_VAL_FRACTION = 0.05
DEFAULT_NUM_SHARDS = 16

T = TypeVar("T")


# ---------------------------------------------------------------------------------------------------
# Tokenizer: one token per byte.


def encode(text: str | bytes) -> torch.Tensor:
    """UTF-8 bytes of `text` (or the bytes themselves) as a 1-D long tensor of values 0..255."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).astype(np.int64))


def decode_bytes(tokens: torch.Tensor | Sequence[int]) -> bytes:
    values = torch.as_tensor(tokens).reshape(-1)
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= VOCAB_SIZE):
        raise ValueError(f"token ids must be in 0..{VOCAB_SIZE - 1}")
    return bytes(values.to(torch.uint8).tolist())


def decode(tokens: torch.Tensor | Sequence[int]) -> str:
    """Text of the tokens; byte sequences that are not valid UTF-8 (a model's samples) become U+FFFD."""
    return decode_bytes(tokens).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------------
# The embedded corpus.


@dataclass(frozen=True)
class _Words:
    """Words with Zipf-like weights 1/(rank+1), as cumulative sums for inverse-CDF sampling."""

    words: tuple[str, ...]
    cumulative: tuple[float, ...]

    @classmethod
    def zipf(cls, text: str) -> _Words:
        words = tuple(text.split())
        cumulative, total = [], 0.0
        for rank in range(len(words)):
            total += 1.0 / (rank + 1)
            cumulative.append(total)
        return cls(words, tuple(cumulative))


_NAMES = _Words.zipf(
    "Mira Tobin Ada Felix Nora Owen Lina Hugo Iris Milo Clara Jonas Vera Theo Elsa Ravi Maya Oscar June "
    "Pablo Rosa Ivan Lena Omar Greta Kofi Alma Bruno Tessa Emil Sofia Arlo Wren Nils Hana Otto Lucia Dev "
    "Ingrid Kai Mabel Rufus Zara Silas Petra Anton Yara Basil"
)
_PLACES = _Words.zipf(
    "garden river forest market village kitchen harbour library meadow castle bakery valley school "
    "station orchard bridge island tower farm lighthouse cave workshop square mill"
)
_OBJECTS = _Words.zipf(
    "lantern map key box boat kite letter basket clock drum ring coat book bell hat cup feather stone "
    "ladder compass apple candle rope shell"
)
_NOUNS = _Words.zipf(
    "bird cat dog tree house door window flower road hill cloud song horse fish friend gift story "
    "storm cake field wall star light fire egg owl engine umbrella island orange"
)
_ADJECTIVES = _Words.zipf(
    "little old red small green quiet bright happy dark warm cold blue tall strange gentle heavy "
    "golden brave silver tiny round empty ancient odd"
)
_VERBS = _Words.zipf(
    "found carried opened painted fixed watched followed lost hid cleaned counted shared pushed "
    "closed built mended washed lifted dropped"
)
_ADVERBS = _Words.zipf("slowly quickly softly happily quietly carefully loudly suddenly gladly")
_FEELINGS = _Words.zipf("happy tired glad sleepy hungry proud curious calm afraid surprised")
_REFRAINS = (
    "One step and then another",
    "The sun will come back tomorrow",
    "Home is where the lantern glows",
    "Slow and steady wins the day",
    "Every road leads somewhere",
    "We share what we find",
    "Look twice and listen once",
    "Small hands can do big things",
    "The river always remembers",
    "Nothing is lost that is looked for",
    "A friend in need is a friend indeed",
    "Keep the fire warm and the door open",
)
_ENDINGS = (
    "went home and slept until morning",
    "laughed and sang all the way home",
    "never forgot that day",
    "kept it safe for many years",
    "shared supper with everyone in the village",
    "wrote it all down in a small blue book",
)
_NUMBERS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve")


class _Draws:
    """Random choices from PCG64's raw 64-bit words only: numpy fixes that stream, while its Generator
    methods (integers, choice) may change between numpy versions."""

    def __init__(self, seed: int) -> None:
        self._bits = np.random.PCG64(seed)
        self._buffer: list[int] = []

    def _word(self) -> int:
        if not self._buffer:
            self._buffer = self._bits.random_raw(4096).tolist()[::-1]
        return self._buffer.pop()

    def below(self, n: int) -> int:
        # The modulo bias is below n / 2**64: invisible in a corpus of millions of draws.
        return self._word() % n

    def pick(self, options: Sequence[T]) -> T:
        return options[self.below(len(options))]

    def word(self, words: _Words) -> str:
        # The top 53 bits as an exact float in [0, 1), scaled by one correctly rounded multiply.
        target = (self._word() >> 11) * 2.0**-53 * words.cumulative[-1]
        return words.words[min(bisect.bisect_right(words.cumulative, target), len(words.words) - 1)]

    def distinct_words(self, words: _Words, count: int) -> list[str]:
        chosen: list[str] = []
        while len(chosen) < count:
            word = self.word(words)
            if word not in chosen:
                chosen.append(word)
        return chosen


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _sentence(draws: _Draws, cast: list[str], place: str, title: str, refrain: str) -> str:
    a, b = draws.pick(cast), draws.pick(cast)
    while b == a:
        b = draws.pick(cast)
    kind = draws.below(9)
    if kind == 0:
        return f"{a} walked to the {draws.word(_PLACES)} and then back to the {place}."
    if kind == 1:
        return f"{a} saw {b} near the {draws.word(_ADJECTIVES)} {draws.word(_NOUNS)}."
    if kind == 2:
        adjective = draws.word(_ADJECTIVES)
        return f"{a} gave {b} {_article(adjective)} {adjective} {draws.word(_NOUNS)}."
    if kind == 3:
        return f'"{refrain}," said {a}.'
    if kind == 4:
        return f"{a} and {b} {draws.word(_VERBS)} the {draws.word(_NOUNS)} in the {place}."
    if kind == 5:
        return f"When {a} {draws.word(_VERBS)} the {draws.word(_NOUNS)}, {b} smiled {draws.word(_ADVERBS)}."
    if kind == 6:
        count = 1 + draws.below(len(_NUMBERS) - 2)  # from "two", so the noun is always plural
        noun = draws.word(_NOUNS)
        return f"{a} had {_NUMBERS[count]} {noun}s, and {b} had {_NUMBERS[count + 1]}."
    if kind == 7:
        return f"{a} was {draws.word(_FEELINGS)} because the {title} was still in the {place}."
    noun = draws.word(_NOUNS)
    return f"{a} {draws.word(_VERBS)} {_article(noun)} {noun}, and {b} {draws.word(_VERBS)} the {title}."


def _story(draws: _Draws, number: int) -> str:
    cast = draws.distinct_words(_NAMES, 2 + draws.below(2))
    place = draws.word(_PLACES)
    title = f"{draws.word(_ADJECTIVES)} {draws.word(_OBJECTS)}"
    refrain = draws.pick(_REFRAINS)
    hero = cast[0]
    lines = [
        f"Story {number}: {hero} and the {title}.",
        f"{hero} lived near the {place} with {' and '.join(cast[1:])}.",
        f"One day {hero} found the {title}.",
    ]
    lines += [_sentence(draws, cast, place, title, refrain) for _ in range(3 + draws.below(8))]
    lines.append(f'"{refrain}," said {hero} at last.')
    lines.append(f"In the end, {hero} {draws.pick(_ENDINGS)}. That is the story of {hero} and the {title}.")
    return " ".join(lines) + "\n\n"


def synthetic_text(seed: int = 0, size_bytes: int = DEFAULT_CORPUS_BYTES) -> bytes:
    """Whole stories until at least `size_bytes` bytes of ASCII text; identical everywhere for a seed."""
    draws = _Draws(seed)
    stories: list[str] = []
    total = 0
    while total < size_bytes:
        stories.append(_story(draws, len(stories) + 1))
        total += len(stories[-1])
    return "".join(stories).encode("ascii")


# ---------------------------------------------------------------------------------------------------
# Corpora and their train/validation split.


@dataclass(frozen=True, eq=False)
class Corpus:
    """Byte tokens (uint8) of a training and a fixed validation part, and a digest of the whole text so
    nodes can check that they hold the same corpus."""

    train: torch.Tensor
    val: torch.Tensor
    source: str
    digest: str


def split_train_val(text: bytes, val_fraction: float = DEFAULT_VAL_FRACTION) -> tuple[bytes, bytes]:
    """The last `val_fraction` of the text is validation, cut at the next paragraph (else line) break
    so no story or line is split between the two."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    cut = int(len(text) * (1.0 - val_fraction))
    for separator in (b"\n\n", b"\n"):
        found = text.find(separator, cut)
        if found != -1 and found + len(separator) < len(text):
            cut = found + len(separator)
            break
    return text[:cut], text[cut:]


def corpus_from_text(text: bytes, source: str, val_fraction: float = DEFAULT_VAL_FRACTION) -> Corpus:
    train, val = split_train_val(text, val_fraction)
    if not train or not val:
        raise ValueError(f"corpus {source} is too small to split into training and validation parts")
    return Corpus(
        train=torch.frombuffer(bytearray(train), dtype=torch.uint8),
        val=torch.frombuffer(bytearray(val), dtype=torch.uint8),
        source=source,
        digest=hashlib.sha256(text).hexdigest(),
    )


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as tmp:
        tmp.write(data)
    os.replace(tmp.name, path)


def embedded_corpus(
    data_dir: Path | None = None,
    seed: int = 0,
    size_bytes: int = DEFAULT_CORPUS_BYTES,
    val_fraction: float = DEFAULT_VAL_FRACTION,
) -> Corpus:
    """The generated story corpus, cached as a text file under `data_dir` when one is given."""
    name = f"murmur-corpus-v{CORPUS_VERSION}-seed{seed}-{size_bytes}.txt"
    cached = data_dir / name if data_dir is not None else None
    if cached is not None and cached.is_file():
        text = cached.read_bytes()
    else:
        text = synthetic_text(seed, size_bytes)
        if cached is not None:
            _write_atomically(cached, text)
    return corpus_from_text(text, f"embedded:{name}", val_fraction)


def directory_corpus(directory: Path, val_fraction: float = DEFAULT_VAL_FRACTION) -> Corpus:
    """A user corpus: every *.txt file directly in `directory`, in sorted name order, joined by newlines."""
    if not directory.is_dir():
        raise ValueError(f"data directory {directory} does not exist or is not a directory")
    files = sorted(directory.glob("*.txt"))
    if not files:
        raise ValueError(f"data directory {directory} has no *.txt files")
    text = b"\n".join(path.read_bytes() for path in files)
    return corpus_from_text(text, f"dir:{directory}", val_fraction)


def load_corpus(data: Path | None = None, data_dir: Path | None = None, seed: int = 0) -> Corpus:
    """A directory of *.txt files held in memory when given (library use: the daemon streams --data
    through node.train.shards), else the embedded corpus (cached under the node's data dir)."""
    return directory_corpus(data) if data is not None else embedded_corpus(data_dir, seed)


# ---------------------------------------------------------------------------------------------------
# Shards and batches.


def _hash_to_int(*parts: object) -> int:
    text = "\x00".join(str(part) for part in parts)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def shard_index(peer_id: str, num_shards: int = DEFAULT_NUM_SHARDS) -> int:
    """The shard a peer reads: a hash of its peer id, so it needs no coordination and survives
    restarts. Two peers can land on the same shard; their batches still differ (see batch_seed)."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    return _hash_to_int("shard", peer_id) % num_shards


def shard(tokens: torch.Tensor, index: int, num_shards: int) -> torch.Tensor:
    """Contiguous part `index` of `num_shards` near-equal parts (a view, not a copy)."""
    if not 0 <= index < num_shards:
        raise ValueError(f"shard index {index} is not in 0..{num_shards - 1}")
    length = tokens.shape[0]
    return tokens[index * length // num_shards : (index + 1) * length // num_shards]


def peer_shard(corpus: Corpus, peer_id: str, num_shards: int = DEFAULT_NUM_SHARDS) -> torch.Tensor:
    return shard(corpus.train, shard_index(peer_id, num_shards), num_shards)


def batch_seed(peer_id: str, step: int) -> int:
    """A torch seed per (peer, step): batches are reproducible, and differ between peers and steps."""
    return _hash_to_int("batch", peer_id, step) >> 1  # torch seeds are signed 64-bit


def sample_batch(
    tokens: torch.Tensor, batch_size: int, context: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch_size` random windows: x of shape (batch, context) and y = x shifted by one byte (long)."""
    starts_available = tokens.shape[0] - context
    if starts_available < 1:
        raise ValueError(f"{tokens.shape[0]} tokens are too few for a context of {context}")
    starts = torch.randint(starts_available, (batch_size,), generator=generator)
    windows = tokens[starts[:, None] + torch.arange(context + 1)].long()
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def training_batch(
    tokens: torch.Tensor, peer_id: str, step: int, batch_size: int, context: int
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch_seed(peer_id, step))
    return sample_batch(tokens, batch_size, context, generator)


def validation_batches(
    tokens: torch.Tensor, batch_size: int, context: int, max_batches: int | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive non-overlapping windows from the start of `tokens`: the same batches on every node."""
    starts = torch.arange(0, tokens.shape[0] - context, context)
    if starts.numel() == 0:
        raise ValueError(f"{tokens.shape[0]} tokens are too few for a context of {context}")
    for number, batch_starts in enumerate(torch.split(starts, batch_size)):
        if max_batches is not None and number >= max_batches:
            return
        windows = tokens[batch_starts[:, None] + torch.arange(context + 1)].long()
        yield windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def unigram_loss(tokens: torch.Tensor | bytes) -> float:
    """Entropy in nats of the byte distribution of `tokens`: the loss of the best model that ignores
    context, which a model trained on the corpus must beat."""
    values = np.frombuffer(tokens, dtype=np.uint8) if isinstance(tokens, bytes) else tokens.cpu().numpy()
    counts = np.bincount(values.reshape(-1), minlength=VOCAB_SIZE).astype(np.float64)
    probabilities = counts[counts > 0] / counts.sum()
    return float(-(probabilities * np.log(probabilities)).sum())

