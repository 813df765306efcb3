"""Atomic checkpoints that survive crashes, full disks and corruption.

A save writes a temporary file, fsyncs it, keeps the previous checkpoint as `<name>.prev` and
renames the new one into place; a load that finds the newest file truncated or corrupt (zip CRC)
falls back to the previous one. A failed save leaves both files as they were.
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
