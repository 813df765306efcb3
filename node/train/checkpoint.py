"""Atomic checkpoints that survive crashes, full disks and corruption, in safetensors.

A save writes a temporary file, fsyncs it, keeps the previous checkpoint as `<name>.prev` and
renames the new one into place, fsyncing the directory after each rename (`save_checkpoint`): a
process killed at any instant leaves at least one complete checkpoint, the new one or the previous. A
load that finds the newest file truncated or corrupt falls back to the previous one. A failed save
leaves both files as they were.

Layout (docs/training.md, "Checkpoints"): a safetensors file whose tensors are the named arrays, and
whose metadata holds `murmur.meta` (the meta values as one JSON object, so ints and floats keep their
type) and `murmur.sha256` (a digest over every tensor's name, dtype, shape and bytes, so a flipped
bit is found: safetensors itself has no checksum). Checkpoints written by murmur before 0.2 are
`.npz` files (numpy zip, CRC-checked); they are still read, from the path given or, when a
`.safetensors` path does not exist, from the `.npz` beside it.

A checkpoint belongs to one swarm config (its `config_hash` meta). A node that runs another config
moves it aside as `<name>-<hash[:16]><suffix>` (with its `.prev`) instead of overwriting it, and moves
it back when it runs that config again (`switch_checkpoint`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from node.train.durable import fsync_directory, remove_stale_temporaries, temporary_name, writing

logger = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.safetensors"  # in a node's data directory (before 0.2: checkpoint.npz, still read)
SWARM_AVERAGE_FILE = "swarm-average.safetensors"  # beside it: the swarm-average model
META_KEY = "murmur.meta"
DIGEST_KEY = "murmur.sha256"
LEGACY_SUFFIX = ".npz"
_ZIP_MAGIC = b"PK\x03\x04"

MetaValue = str | int | float


@dataclass(frozen=True)
class Checkpoint:
    tensors: dict[str, np.ndarray]
    meta: dict[str, MetaValue]


class CheckpointUnreadable(Exception):
    """Neither the checkpoint nor its previous copy could be read."""


class CheckpointCorrupt(ValueError):
    """A checkpoint's content does not match the digest it was written with."""


def previous_path(path: Path) -> Path:
    return path.with_name(path.name + ".prev")


def _raw(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array without a copy (an empty or 0-d one too)."""
    return array.reshape(-1).view(np.uint8).data


def _update_digest(digest: hashlib._Hash, name: str, array: np.ndarray) -> None:
    array = np.require(array, requirements="C")
    digest.update(f"{name}\x00{array.dtype.str}\x00{array.shape}\x00".encode())
    digest.update(_raw(array))


def tensors_digest(tensors: Mapping[str, np.ndarray]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        _update_digest(digest, name, tensors[name])
    return digest.hexdigest()


# numpy dtype -> safetensors dtype name
_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32", "int16": "I16",
           "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def write_safetensors(f: BinaryIO, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> None:
    """Stream `tensors` to `f` in the safetensors format (read back by `safetensors` itself).

    safetensors' own writer either builds the whole file in memory (`save`) or reports a full disk as
    an opaque SafetensorError (`save_file`); this writes tensor by tensor and lets OSError through."""
    arrays = {name: np.require(t, requirements="C") for name, t in sorted(tensors.items())}
    entries: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, array in arrays.items():
        if array.dtype.name not in _DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {array.dtype}, which safetensors does not store")
        entries[name] = {"dtype": _DTYPES[array.dtype.name], "shape": list(array.shape),
                         "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned
    f.write(struct.pack("<Q", len(header)))
    f.write(header)
    for array in arrays.values():
        f.write(_raw(array))


# Files this process wrote and fsynced, or read whole with a matching digest: path -> (device, inode,
# size, mtime). A file that still has that signature is complete without being read again.
_complete_files: dict[str, tuple[int, int, int, int]] = {}


def _signature(path: Path) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _remember_complete(path: Path) -> None:
    signature = _signature(path)
    if signature is not None:
        _complete_files[str(path.absolute())] = signature


def _verify_file(path: Path) -> None:
    """Raise (ValueError, OSError...) unless `path` is a complete checkpoint whose digest matches;
    reads one tensor at a time."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == _ZIP_MAGIC:
        _read_npz(path)
        return
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            header = f.metadata() or {}
            if DIGEST_KEY not in header or META_KEY not in header:
                raise ValueError("not a murmur checkpoint")
            digest = hashlib.sha256()
            for name in sorted(f.keys()):
                _update_digest(digest, name, f.get_tensor(name))
    except SafetensorError as exc:
        raise ValueError(f"not a readable safetensors file: {exc}") from None
    if digest.hexdigest() != header[DIGEST_KEY]:
        raise CheckpointCorrupt("the tensors do not match the digest they were written with")


def is_complete(path: Path) -> bool:
    """Whether `path` is a complete, loadable checkpoint (known from this process's own write or read,
    else read and checked against its digest)."""
    signature = _signature(path)
    if signature is None:
        return False
    if _complete_files.get(str(path.absolute())) == signature:
        return True
    try:
        _verify_file(path)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError, json.JSONDecodeError):
        return False
    _complete_files[str(path.absolute())] = signature
    return True


def save_checkpoint(path: Path, tensors: Mapping[str, np.ndarray], meta: Mapping[str, MetaValue]) -> None:
    """Write atomically; raises OSError (e.g. disk full) with the old checkpoints untouched.

    The switch never leaves the directory without a complete checkpoint, whenever the process dies:
    1. the new one is written to `.<name>.<pid>.tmp` and fsynced (the old files untouched);
    2. the current file, if complete, is renamed to `.prev` (replacing the older one) and the directory
       fsynced: `.prev` is now complete; a torn or corrupt current file is not, so `.prev` stays;
    3. the temporary is renamed to `<name>` and the directory fsynced.
    A kill between 2 and 3 leaves only `.prev`, which `load_checkpoint` falls back to. Temporaries of
    a killed save are removed by the next one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    tmp = path.with_name(temporary_name(path))
    arrays = {name: np.require(t, requirements="C") for name, t in tensors.items()}
    header = {META_KEY: json.dumps(dict(meta)), DIGEST_KEY: tensors_digest(arrays)}
    with writing(tmp):
        _switch(path, tmp, arrays, header)


def _switch(path: Path, tmp: Path, arrays: Mapping[str, np.ndarray], header: Mapping[str, str]) -> None:
    try:
        with open(tmp, "wb") as f:
            write_safetensors(f, arrays, header)
            f.flush()
            os.fsync(f.fileno())
        if is_complete(path):
            os.replace(path, previous_path(path))
            fsync_directory(path.parent)
        elif path.exists():
            logger.warning("checkpoint %s is unreadable; it is replaced and %s kept", path, previous_path(path).name)
        os.replace(tmp, path)
        fsync_directory(path.parent)
        _remember_complete(path)
    finally:
        tmp.unlink(missing_ok=True)


def _read_npz(path: Path) -> Checkpoint:
    with np.load(path, allow_pickle=False) as data:
        tensors = {k[2:]: data[k] for k in data.files if k.startswith("t/")}
        meta = {k[2:]: data[k].item() for k in data.files if k.startswith("m/")}
    return Checkpoint(tensors, meta)


def _read_safetensors(path: Path) -> Checkpoint:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            header = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open is not a Mapping
    except SafetensorError as exc:
        raise ValueError(f"not a readable safetensors file: {exc}") from None
    if DIGEST_KEY not in header or META_KEY not in header:
        raise ValueError("not a murmur checkpoint: its metadata has no murmur.meta or murmur.sha256")
    if tensors_digest(tensors) != header[DIGEST_KEY]:
        raise CheckpointCorrupt("the tensors do not match the digest they were written with")
    meta = json.loads(header[META_KEY])
    if not isinstance(meta, dict):
        raise ValueError("murmur.meta is not a JSON object")
    return Checkpoint(tensors, meta)


def read_checkpoint_file(path: Path) -> Checkpoint:
    """One file, safetensors or a legacy npz (told apart by content); ValueError/OSError if unreadable."""
    with open(path, "rb") as f:
        magic = f.read(4)
    return _read_npz(path) if magic == _ZIP_MAGIC else _read_safetensors(path)


def kept_path(path: Path, config_hash: str) -> Path:
    """Where the checkpoint of config `config_hash` waits while another config runs."""
    return path.with_name(f"{path.stem}-{config_hash[:16]}{path.suffix}")


def _file_meta(path: Path) -> dict[str, MetaValue]:
    """A checkpoint file's meta without reading its tensors; ValueError/OSError if unreadable."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == _ZIP_MAGIC:
        with np.load(path, allow_pickle=False) as data:
            return {k[2:]: data[k].item() for k in data.files if k.startswith("m/")}
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            header = f.metadata() or {}
    except SafetensorError as exc:
        raise ValueError(f"not a readable safetensors file: {exc}") from None
    meta = json.loads(header.get(META_KEY, "null"))
    if not isinstance(meta, dict):
        raise ValueError("not a murmur checkpoint")
    return meta


def read_meta(path: Path) -> dict[str, MetaValue] | None:
    """The meta of the newest readable of `path` and its previous copy (None if neither is)."""
    for candidate in (path, previous_path(path)):
        if candidate.exists():
            try:
                return _file_meta(candidate)
            except (OSError, ValueError, zipfile.BadZipFile, EOFError, json.JSONDecodeError):
                continue
    return None


def _move(source: Path, target: Path) -> None:
    for a, b in ((source, target), (previous_path(source), previous_path(target))):
        if a.exists():
            os.replace(a, b)
        elif b.exists():
            b.unlink()  # a stale previous copy must not pass for the moved checkpoint's


def switch_checkpoint(path: Path, config_hash: str) -> str | None:
    """Make `path` (or the legacy `.npz` beside it) the checkpoint of config `config_hash`: a checkpoint
    of another config there moves to `kept_path` under its own hash, and the one kept for
    `config_hash` (if any) comes back. Returns what it did, in words, or None."""
    done = []
    places = [path] if path.suffix == LEGACY_SUFFIX else [path, path.with_suffix(LEGACY_SUFFIX)]
    for place in places:
        meta = read_meta(place)
        other = str(meta.get("config_hash", "")) if meta is not None else ""
        if other and other != config_hash:
            _move(place, kept_path(place, other))
            done.append(f"kept the checkpoint of config {other[:12]} as {kept_path(place, other).name}")
    if not any(p.exists() or previous_path(p).exists() for p in places):
        for place in places:
            if kept_path(place, config_hash).exists():
                _move(kept_path(place, config_hash), place)
                done.append(f"took back the checkpoint kept for config {config_hash[:12]}")
                break
    return "; ".join(done) or None


def kept_metas(path: Path) -> list[dict[str, MetaValue]]:
    """The metas of the checkpoint at `path` (or its legacy `.npz`) and of every one kept beside it for
    another config."""
    suffixes = [path.suffix] if path.suffix == LEGACY_SUFFIX else [path.suffix, LEGACY_SUFFIX]
    files = [path.with_suffix(s) for s in suffixes]
    for suffix in suffixes:
        files += sorted(path.parent.glob(f"{path.stem}-*{suffix}"))
    metas = [read_meta(p) for p in files]
    return [m for m in metas if m is not None]


def load_checkpoint(path: Path) -> Checkpoint | None:
    """The newest readable checkpoint, None if there is none; CheckpointUnreadable if all are broken.
    A `.safetensors` path that has neither file nor `.prev` falls back to a legacy `.npz` beside it."""
    candidates = [p for p in (path, previous_path(path)) if p.exists()]
    if not candidates and path.suffix != LEGACY_SUFFIX:
        legacy = path.with_suffix(LEGACY_SUFFIX)
        candidates = [p for p in (legacy, previous_path(legacy)) if p.exists()]
    if not candidates:
        return None
    for candidate in candidates:
        try:
            checkpoint = read_checkpoint_file(candidate)
        except (OSError, ValueError, zipfile.BadZipFile, EOFError, json.JSONDecodeError) as exc:
            logger.warning("checkpoint %s is unreadable (%s); trying the previous one", candidate, exc)
            continue
        _remember_complete(candidate)
        return checkpoint
    raise CheckpointUnreadable(f"no readable checkpoint among {', '.join(map(str, candidates))}")
