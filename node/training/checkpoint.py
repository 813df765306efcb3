"""Atomic checkpoints that survive crashes, full disks and corruption, kept per swarm config.

A save writes a temporary file, fsyncs it, keeps the previous checkpoint as `<name>.prev` and
renames the new one into place; a load that finds the newest file truncated or corrupt (zip CRC)
falls back to the previous one. A failed save leaves both files as they were.

A checkpoint belongs to one swarm config (its `config_hash` meta). A node that runs another config
moves it aside as `<name>-<hash[:16]>.npz` (with its `.prev`) instead of overwriting it, and moves it
back when it runs that config again (`switch_checkpoint`).
"""

from __future__ import annotations

import logging
import os
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checkpoint:
    tensors: dict[str, np.ndarray]
    meta: dict[str, str | int | float]


class CheckpointUnreadable(Exception):
    """Neither the checkpoint nor its previous copy could be read."""


def previous_path(path: Path) -> Path:
    return path.with_name(path.name + ".prev")


def save_checkpoint(path: Path, tensors: Mapping[str, np.ndarray], meta: Mapping[str, str | int | float]) -> None:
    """Write atomically; raises OSError (e.g. disk full) with the old checkpoints untouched."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    arrays = {f"t/{name}": np.ascontiguousarray(t) for name, t in tensors.items()}
    arrays.update({f"m/{k}": np.asarray(v) for k, v in meta.items()})
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]  # the stub reads ** as its allow_pickle flag
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            os.replace(path, previous_path(path))
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        tmp.unlink(missing_ok=True)


def _read(path: Path) -> Checkpoint:
    with np.load(path, allow_pickle=False) as data:
        tensors = {k[2:]: data[k] for k in data.files if k.startswith("t/")}
        meta = {k[2:]: data[k].item() for k in data.files if k.startswith("m/")}
    return Checkpoint(tensors, meta)


def kept_path(path: Path, config_hash: str) -> Path:
    """Where the checkpoint of config `config_hash` waits while another config runs."""
    return path.with_name(f"{path.stem}-{config_hash[:16]}{path.suffix}")


def read_meta(path: Path) -> dict[str, str | int | float] | None:
    """The meta of the newest readable of `path` and its previous copy, without reading the tensors."""
    for candidate in (path, previous_path(path)):
        if not candidate.exists():
            continue
        try:
            with np.load(candidate, allow_pickle=False) as data:
                return {k[2:]: data[k].item() for k in data.files if k.startswith("m/")}
        except (OSError, ValueError, zipfile.BadZipFile, EOFError):
            continue
    return None


def _move(source: Path, target: Path) -> None:
    for a, b in ((source, target), (previous_path(source), previous_path(target))):
        if a.exists():
            os.replace(a, b)
        elif b.exists():
            b.unlink()  # a stale previous copy must not pass for the moved checkpoint's


def switch_checkpoint(path: Path, config_hash: str) -> str | None:
    """Make `path` the checkpoint of config `config_hash`: a checkpoint of another config there moves to
    `kept_path` under its own hash, and the one kept for `config_hash` (if any) comes back. Returns what
    it did, in words, or None."""
    done = []
    meta = read_meta(path)
    other = str(meta.get("config_hash", "")) if meta is not None else ""
    if other and other != config_hash:
        _move(path, kept_path(path, other))
        done.append(f"kept the checkpoint of config {other[:12]} as {kept_path(path, other).name}")
    kept = kept_path(path, config_hash)
    if not path.exists() and not previous_path(path).exists() and kept.exists():
        _move(kept, path)
        done.append(f"took back the checkpoint kept for config {config_hash[:12]}")
    return "; ".join(done) or None


def kept_metas(path: Path) -> list[dict[str, str | int | float]]:
    """The metas of the checkpoint at `path` and of every checkpoint kept beside it for another config."""
    metas = [read_meta(p) for p in (path, *sorted(path.parent.glob(f"{path.stem}-*{path.suffix}")))]
    return [m for m in metas if m is not None]


def load_checkpoint(path: Path) -> Checkpoint | None:
    """The newest readable checkpoint, None if there is none; CheckpointUnreadable if all are broken."""
    candidates = [p for p in (path, previous_path(path)) if p.exists()]
    if not candidates:
        return None
    for candidate in candidates:
        try:
            return _read(candidate)
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
            logger.warning("checkpoint %s is unreadable (%s); trying the previous one", candidate, exc)
    raise CheckpointUnreadable(f"no readable checkpoint among {', '.join(map(str, candidates))}")
