"""The checkpoint writer of murmur 0.1 (node/train/checkpoint.py before checkpoints moved to
safetensors), kept verbatim so tests can make the .npz files that older nodes left on disk."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np


def previous_path(path: Path) -> Path:
    return path.with_name(path.name + ".prev")


def save_npz_checkpoint(path: Path, tensors: Mapping[str, np.ndarray], meta: Mapping[str, str | int | float]) -> None:
    """Write atomically; raises OSError (e.g. disk full) with the old checkpoints untouched."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    arrays = {f"t/{name}": np.ascontiguousarray(t) for name, t in tensors.items()}
    arrays.update({f"m/{k}": np.asarray(v) for k, v in meta.items()})
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            os.replace(path, previous_path(path))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
