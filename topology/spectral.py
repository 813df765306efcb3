"""Spectral analysis of mixing matrices: stochasticity checks, rho = ||W - 11^T/n||_2, spectral gap.

rho bounds how fast gossip contracts: ||W x - mean|| <= rho * ||x - mean|| for doubly stochastic W.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def averaging_matrix(n: int) -> np.ndarray:
    return np.full((n, n), 1.0 / n)


def is_row_stochastic(w: np.ndarray, atol: float = 1e-12) -> bool:
    return bool(np.all(w >= 0) and np.allclose(w.sum(axis=1), 1.0, rtol=0, atol=atol))


def is_doubly_stochastic(w: np.ndarray, atol: float = 1e-12) -> bool:
    return is_row_stochastic(w, atol) and bool(np.allclose(w.sum(axis=0), 1.0, rtol=0, atol=atol))


def is_symmetric(w: np.ndarray, atol: float = 1e-12) -> bool:
    return bool(np.allclose(w, w.T, rtol=0, atol=atol))


def rho(w: np.ndarray) -> float:
    """Spectral norm of W - 11^T/n (symmetric W takes the cheaper eigenvalue route)."""
    deviation = w - averaging_matrix(w.shape[0])
    if is_symmetric(w):
        return float(np.max(np.abs(np.linalg.eigvalsh(deviation)), initial=0.0))
    return float(np.linalg.norm(deviation, 2))


def spectral_gap(w: np.ndarray) -> float:
    return 1.0 - rho(w)


def period_product(matrices: Sequence[np.ndarray]) -> np.ndarray:
    """W_{p-1} ... W_1 W_0: the mixing of one whole period of a time-varying schedule (round 0 first)."""
    product = np.eye(matrices[0].shape[0])
    for w in matrices:
        product = w @ product
    return product
