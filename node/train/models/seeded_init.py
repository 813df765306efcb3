"""Parameter values drawn from a seed and a parameter's name, bit-identical on every machine.

torch's own RNG is not guaranteed to give the same numbers on every CPU (its normal_ has an AVX2 path)
or torch version, and every node of a swarm must start from the same parameters. So values come from
numpy's PCG64 bit stream, whose raw 64-bit words are fixed by its specification, turned into floats
with exact integer arithmetic and one correctly rounded multiply.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch


def name_seed(seed: int, name: str) -> int:
    """A 128-bit seed for one parameter: independent streams per name, so adding an expert or a
    layer never changes the values of the others."""
    digest = hashlib.blake2b(f"{seed}\x00{name}".encode(), digest_size=16).digest()
    return int.from_bytes(digest, "big")


def seeded_uniform(shape: tuple[int, ...], std: float, seed: int, name: str) -> torch.Tensor:
    """float32 values uniform on [-a, a) with standard deviation `std`, a function of (seed, name) only."""
    count = math.prod(shape)
    raw = np.random.PCG64(name_seed(seed, name)).random_raw(count)
    # 53 random bits m give the exact integer 2m - 2^53 in [-2^53, 2^53); scaling by a power of two
    # times the half-width is the only rounding step.
    centred = (raw >> np.uint64(11)).astype(np.int64) * 2 - (1 << 53)
    half_width = std * math.sqrt(3.0)
    values = centred.astype(np.float64) * (half_width * 2.0**-53)
    return torch.from_numpy(values.astype(np.float32).reshape(shape))
