"""`--data`: a directory or glob of text, jsonl or parquet shards, streamed (never loaded whole) and read by
each peer in a disjoint, deterministic part per epoch (the shard plan, docs/training.md "Data").

- A **unit** is a byte range of a text or jsonl file (a line belongs to the unit it starts in) or one
  row group of a parquet file. The unit size is a function of the files' total size only, so peers
  with the same files cut the same units.
- **Validation** is the first units in the order of a hash of (file, index) that hold a twentieth of
  the data (bytes; row groups for parquet), at least one unless there is only one: the same on every
  peer, never trained on.
- **Epoch e** orders the training units by a hash of (e, unit) and gives unit i to the peer of rank
  i mod n among the n training peers of the membership view (peers sorted by id, as the topology's
  ranks). Peers with the same view read disjoint units, so no sample is read twice in an epoch;
  together they read every training unit once.
- A peer streams its units in a background thread: it reads records (a text unit is one text; a
  jsonl line or a parquet row is one record, its `--text-field`), tokenizes them in batches (the
  `tokenizers` Rust threads, off the event loop and off the training thread) and packs the tokens,
  documents separated by EOS, into windows of context + 1 tokens that the training step takes in order.
- A malformed jsonl line or a record without the text field is skipped: one log line and one count
  (`data_bad_record`, `data_missing_field`), and reading goes on.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

import numpy as np
import torch

from node.train.tokenizer import TextTokenizer

logger = logging.getLogger("murmur.data")

TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
MIN_UNIT_BYTES = 16 << 10
MAX_UNIT_BYTES = 4 << 20
UNITS_PER_DATASET = 512  # unit size ~ total / this, within the bounds above
VAL_EVERY = 20  # validation holds at least 1/VAL_EVERY of the data
MAX_VAL_TOKENS = 1 << 20
TOKENIZE_BATCH = 256  # records per encode_batch call
QUEUE_CHUNKS = 8  # tokenized chunks buffered ahead of the training step
LOGGED_SKIPS = 20  # per kind; later skips are counted only


class DataInvalid(ValueError):
    """--data names nothing usable (one line, says why)."""


class FileKind(StrEnum):
    TEXT = "text"
    JSONL = "jsonl"
    PARQUET = "parquet"


class SkipKind(StrEnum):
    """Why a record was skipped: the status error counter it is counted as."""

    BAD_RECORD = "data_bad_record"  # a jsonl line that is not a JSON object, or not UTF-8
    MISSING_FIELD = "data_missing_field"  # a record without the text field, or with a non-string one


@dataclass(frozen=True)
class DataFile:
    path: Path
    name: str  # relative to the --data root, the key units are hashed by
    kind: FileKind
    size: int  # bytes; rows groups for parquet are read from its footer


@dataclass(frozen=True, order=True)
class Unit:
    """A part of one file: bytes [start, end) of a text/jsonl file, or row group `start` of a parquet file."""

    file: int  # index into the dataset's files
    index: int  # the unit's number within its file
    start: int
    end: int


def _kind(path: Path) -> FileKind | None:
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        return FileKind.TEXT
    if suffix in JSONL_SUFFIXES:
        return FileKind.JSONL
    if suffix in PARQUET_SUFFIXES:
        return FileKind.PARQUET
    return None


def resolve_files(spec: Path) -> list[DataFile]:
    """The shard files --data names: a file, every file of a known kind under a directory (recursively),
    or the matches of a glob; sorted by name."""
    text = str(spec)
    if spec.is_file():
        root, paths = spec.parent, [spec]
    elif spec.is_dir():
        root, paths = spec, [p for p in spec.rglob("*") if p.is_file()]
    elif glob.has_magic(text):
        prefix = min((text.split(c)[0] for c in "*?["), key=len)
        root, paths = Path(os.path.dirname(prefix)), [Path(p) for p in glob.glob(text, recursive=True)]
        paths = [p for p in paths if p.is_file()]
    else:
        raise DataInvalid(f"--data {spec}: no such file, directory or glob match")
    files = []
    for path in sorted(paths):
        kind = _kind(path)
        if kind is None:
            continue
        try:
            name = str(path.relative_to(root))
        except ValueError:
            name = str(path)
        files.append(DataFile(path, name, kind, path.stat().st_size))
    if not files:
        raise DataInvalid(f"--data {spec}: no {', '.join(TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES)} files")
    return files


def unit_bytes(files: Sequence[DataFile]) -> int:
    total = sum(f.size for f in files if f.kind is not FileKind.PARQUET)
    return min(MAX_UNIT_BYTES, max(MIN_UNIT_BYTES, total // UNITS_PER_DATASET))


def cut_units(files: Sequence[DataFile]) -> list[Unit]:
    """Every unit of the dataset, in file order."""
    size = unit_bytes(files)
    units = []
    for i, f in enumerate(files):
        if f.kind is FileKind.PARQUET:
            import pyarrow.parquet as pq

            groups = pq.ParquetFile(f.path).num_row_groups
            units += [Unit(i, g, g, g + 1) for g in range(groups)]
        else:
            count = max(1, -(-f.size // size))
            units += [Unit(i, k, k * size, min(f.size, (k + 1) * size)) for k in range(count)]
    return units


def _hash(*parts: object) -> int:
    text = "\x00".join(str(p) for p in parts)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@dataclass(frozen=True)
class ShardPlan:
    """The dataset cut into units, and which are validation; `units_for` is a peer's part of an epoch."""

    files: tuple[DataFile, ...]
    train: tuple[Unit, ...]
    val: tuple[Unit, ...]

    @classmethod
    def of(cls, files: Sequence[DataFile]) -> ShardPlan:
        units = cut_units(files)
        by_hash = sorted(units, key=lambda u: (_hash("val", files[u.file].name, u.index), u))
        total, chosen, val = sum(u.end - u.start for u in units), 0, list[Unit]()
        for unit in by_hash[:-1]:  # at least one unit is left to train on
            if val and chosen * VAL_EVERY >= total:
                break
            val.append(unit)
            chosen += unit.end - unit.start
        taken = set(val)
        train = [u for u in units if u not in taken]
        return cls(tuple(files), tuple(train), tuple(sorted(val)))

    def epoch_order(self, epoch: int) -> list[Unit]:
        return sorted(self.train, key=lambda u: (_hash("epoch", epoch, self.files[u.file].name, u.index), u))

    def units_for(self, peer_id: str, members: Sequence[str], epoch: int) -> list[Unit]:
        """Peer `peer_id`'s units of `epoch` among `members` (it is one of them; sorted by id for ranks)."""
        ranks = sorted(set(members) | {peer_id})
        rank, n = ranks.index(peer_id), len(ranks)
        return [u for i, u in enumerate(self.epoch_order(epoch)) if i % n == rank]


# ---- reading records -----------------------------------------------------------------------------------


@dataclass
class SkipCounter:
    """Skipped records by kind; one log line each for the first LOGGED_SKIPS of a kind."""

    count: Callable[[str], None] | None = None
    counts: dict[str, int] = field(default_factory=dict)

    def skip(self, kind: SkipKind, where: str, why: str) -> None:
        seen = self.counts.get(kind, 0) + 1
        self.counts[kind] = seen
        if self.count is not None:
            self.count(str(kind))
        if seen <= LOGGED_SKIPS:
            tail = "; further ones are counted, not logged" if seen == LOGGED_SKIPS else ""
            logger.warning("data: skipped %s at %s: %s%s", kind, where, why, tail)


def _lines(path: Path, start: int, end: int) -> Iterator[tuple[int, bytes]]:
    """(offset, line) of every line that starts in [start, end)."""
    with open(path, "rb") as f:
        if start > 0:
            f.seek(start - 1)
            if f.read(1) != b"\n":
                f.readline()  # the line in progress belongs to the unit before
        position = f.tell()
        while position < end:
            line = f.readline()
            if not line:
                return
            yield position, line
            position += len(line)


def read_records(plan: ShardPlan, unit: Unit, text_field: str, skips: SkipCounter) -> Iterator[str]:
    """The texts of one unit, in order; bad records skipped and counted."""
    data = plan.files[unit.file]
    if data.kind is FileKind.TEXT:
        chunk = b"".join(line for _, line in _lines(data.path, unit.start, unit.end))
        if chunk:
            yield chunk.decode("utf-8", errors="replace")
        return
    if data.kind is FileKind.JSONL:
        for offset, line in _lines(data.path, unit.start, unit.end):
            if not line.strip():
                continue
            where = f"{data.name} byte {offset}"
            try:
                record = json.loads(line)
            except (ValueError, UnicodeDecodeError) as exc:
                skips.skip(SkipKind.BAD_RECORD, where, f"not JSON ({str(exc)[:80]})")
                continue
            if not isinstance(record, dict):
                skips.skip(SkipKind.BAD_RECORD, where, f"a JSON {type(record).__name__}, not an object")
                continue
            text = record.get(text_field)
            if not isinstance(text, str):
                skips.skip(SkipKind.MISSING_FIELD, where, f"no string field {text_field!r}")
                continue
            yield text
        return
    import pyarrow.parquet as pq

    table = pq.ParquetFile(data.path).read_row_group(unit.start, columns=None)
    if text_field not in table.column_names:
        skips.skip(SkipKind.MISSING_FIELD, f"{data.name} row group {unit.start}",
                   f"no column {text_field!r} (columns: {', '.join(table.column_names[:8])})")
        return
    for row, text in enumerate(table.column(text_field).to_pylist()):
        if not isinstance(text, str):
            skips.skip(SkipKind.MISSING_FIELD, f"{data.name} row group {unit.start} row {row}",
                       f"field {text_field!r} is {type(text).__name__}, not a string")
            continue
        yield text


def tokenize_unit(plan: ShardPlan, unit: Unit, text_field: str, tokenizer: TextTokenizer,
                  skips: SkipCounter) -> Iterator[np.ndarray]:
    """One unit's tokens, TOKENIZE_BATCH records at a time, each document followed by EOS (or "\\n")."""
    separator = [tokenizer.eos_id] if tokenizer.eos_id is not None else tokenizer.encode_batch(["\n"])[0]
    pending: list[str] = []

    def flush() -> np.ndarray:
        ids = [token for encoded in tokenizer.encode_batch(pending) for token in (*encoded, *separator)]
        pending.clear()
        return np.asarray(ids, dtype=np.int64)

    for text in read_records(plan, unit, text_field, skips):
        pending.append(text)
        if len(pending) >= TOKENIZE_BATCH:
            yield flush()
    if pending:
        yield flush()


# ---- the stream a trainer takes batches from ---------------------------------------------------------------


@dataclass(frozen=True)
class StreamPosition:
    """Where a peer's stream is: the epoch, and the number of the unit (in this peer's part of the epoch)
    that the training step took tokens from last; a stream started there re-reads that one unit."""

    epoch: int = 0
    units_done: int = 0


class ShardStream:
    """A peer's training batches and the shared validation batches of one dataset (see the module
    docstring). The reader thread starts at the first batch asked for, so the epoch's plan uses the
    membership view of training time (`set_members`); `close()` stops it."""

    def __init__(self, plan: ShardPlan, tokenizer: TextTokenizer, peer_id: str, text_field: str = "text",
                 count: Callable[[str], None] | None = None, start: StreamPosition = StreamPosition()) -> None:
        self.plan = plan
        self.tokenizer = tokenizer
        self.peer_id = peer_id
        self.text_field = text_field
        self.skips = SkipCounter(count)
        self._members: tuple[str, ...] = (peer_id,)
        self._members_lock = threading.Lock()
        self._queue: queue.Queue[tuple[int, int, np.ndarray] | BaseException] = queue.Queue(QUEUE_CHUNKS)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = start
        self._buffer = np.zeros(0, np.int64)
        self._tags: list[tuple[int, int, int]] = []  # (end offset in the buffer, epoch, unit) of queued chunks
        self.position = start
        self.epoch_units: dict[int, list[Unit]] = {}  # this peer's part of each epoch it started (tests, status)
        self._val_tokens: torch.Tensor | None = None

    # -- membership and position

    def set_members(self, members: Sequence[str]) -> None:
        """The training peers of the current view; read when an epoch starts."""
        with self._members_lock:
            self._members = tuple(sorted(set(members) | {self.peer_id}))

    def members(self) -> tuple[str, ...]:
        with self._members_lock:
            return self._members

    # -- validation

    def val_tokens(self) -> torch.Tensor:
        """The validation units' tokens (the first MAX_VAL_TOKENS), the same on every peer."""
        if self._val_tokens is None:
            skips = self.skips  # every peer reads these, and counts what it skips
            parts, total = [], 0
            for unit in self.plan.val:
                for tokens in tokenize_unit(self.plan, unit, self.text_field, self.tokenizer, skips):
                    parts.append(tokens)
                    total += tokens.size
                if total >= MAX_VAL_TOKENS:
                    break
            joined = np.concatenate(parts)[:MAX_VAL_TOKENS] if parts else np.zeros(0, np.int64)
            self._val_tokens = torch.from_numpy(joined)
        return self._val_tokens

    # -- training batches

    def _read(self) -> None:
        epoch, skip = self._start.epoch, self._start.units_done
        try:
            while not self._stop.is_set():
                units = self.plan.units_for(self.peer_id, self.members(), epoch)
                self.epoch_units[epoch] = units
                for number, unit in enumerate(units):
                    if number < skip:
                        continue
                    for tokens in tokenize_unit(self.plan, unit, self.text_field, self.tokenizer, self.skips):
                        if not self._put((epoch, number, tokens)):
                            return
                    if self._stop.is_set():
                        return
                if not units:
                    logger.warning("data: this peer has no training unit in epoch %d (%d units, %d peers)", epoch,
                                   len(self.plan.train), len(self.members()))
                    if not self._put((epoch, 0, np.zeros(0, np.int64))):
                        return
                epoch, skip = epoch + 1, 0
        except BaseException as exc:  # handed to the training step, which raises it there
            self._put(exc)

    def _put(self, item: tuple[int, int, np.ndarray] | BaseException) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _take(self, count: int) -> np.ndarray:
        if self._thread is None:
            self._thread = threading.Thread(target=self._read, name=f"data-{self.peer_id[:12]}", daemon=True)
            self._thread.start()
        empty_epochs = 0
        while self._buffer.size < count:
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                if self._stop.is_set():
                    raise DataInvalid("the data stream is closed") from None
                continue
            if isinstance(item, BaseException):
                raise item
            epoch, unit, tokens = item
            if tokens.size == 0:
                empty_epochs += 1
                if empty_epochs > 2:
                    raise DataInvalid("this peer's part of the data holds no tokens (too few units for the peers?)")
                continue
            self._buffer = np.concatenate([self._buffer, tokens])
            self._tags.append((self._buffer.size, epoch, unit))
        out, self._buffer = self._buffer[:count], self._buffer[count:]
        done = [tag for tag in self._tags if tag[0] <= count]
        self._tags = [(end - count, e, u) for end, e, u in self._tags if end > count]
        if done:
            _, epoch, unit = done[-1]
            self.position = StreamPosition(epoch, unit)  # a resumed stream re-reads the unit it was in
        return out

    def train_batch(self, batch_size: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next `batch_size` windows of context + 1 tokens: x and y = x shifted by one token."""
        windows = torch.from_numpy(self._take(batch_size * (context + 1)).copy()).view(batch_size, context + 1)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)


def open_dataset(spec: Path) -> ShardPlan:
    """Blocking (lists files, reads parquet footers): call in a thread."""
    return ShardPlan.of(resolve_files(spec))


__all__ = [
    "DataInvalid",
    "FileKind",
    "ShardPlan",
    "ShardStream",
    "SkipKind",
    "StreamPosition",
    "Unit",
    "open_dataset",
    "read_records",
    "resolve_files",
    "tokenize_unit",
]
