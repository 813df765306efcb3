"""The C allocator's setting for a training node: model-sized arrays are mapped and unmapped one by one,
so what a sync or a checkpoint frees goes back to the system (docs/training.md, "Memory per parameter")."""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Mapping

# glibc's mallopt parameter (malloc.h)
M_MMAP_THRESHOLD = -3
# Arrays from this size on get their own mapping. glibc's default threshold starts at 128 KiB but rises
# to the size of any mapped block that is freed (up to 32 MiB), after which a model's tensors come from
# the heap, where a freed one between live ones is never returned: a DiLoCo node's peak grew by about
# half its memory model that way. Below 1 MiB (activations of small batches, wire chunks, metadata)
# the heap stays.
MMAP_THRESHOLD_BYTES = 1 << 20
# what sets the threshold from outside, which is then left alone
ENV_SETTINGS = ("MALLOC_MMAP_THRESHOLD_",)
TUNABLE = "glibc.malloc.mmap_threshold"


def bound_allocator_slack(env: Mapping[str, str], device_type: str) -> bool:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD_BYTES on a node that trains on `device_type` "cuda",
    unless `env` sets one; whether it was set (False off glibc: musl and other C libraries keep their
    own behaviour).

    Not on a CPU node: there the trainer's own tensors (gradients, activations) would be mapped afresh
    every step, which cost about 15% of an 85M model's step (docs/training.md); a CUDA node's host
    memory holds the gossip buffers, allocated once a round, and is what bounds the model it can take."""
    if device_type != "cuda":
        return False
    if any(name in env for name in ENV_SETTINGS) or TUNABLE in env.get("GLIBC_TUNABLES", ""):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)  # the process's own C library
        if not hasattr(libc, "gnu_get_libc_version"):
            return False
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False


__all__ = ["MMAP_THRESHOLD_BYTES", "bound_allocator_slack"]
