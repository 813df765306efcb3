"""SPES's expert-merging warm-up: each owned expert moves toward its most similar experts of its
layer, bit-identically on every machine.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

MERGE_NEIGHBOURS = 4  # an expert moves toward the mean of this many most similar experts of its layer


def _exact_dot(a: np.ndarray, b: np.ndarray) -> float:
    # float32 * float32 is exact in float64, and fsum rounds the sum once, correctly: the same
    # inputs give the same bits on every IEEE machine, whatever BLAS or SIMD width numpy uses.
    return math.fsum(np.multiply(a, b, dtype=np.float64).tolist())


def _flat_first(first_matrices: Sequence[np.ndarray]) -> list[np.ndarray]:
    flat = [np.ascontiguousarray(m, dtype=np.float32).reshape(-1) for m in first_matrices]
    if len({f.size for f in flat}) > 1:
        raise ValueError("experts of one layer must have first matrices of one size")
    return flat


def _cosine(dot: float, norm_a: float, norm_b: float) -> float:
    denominator = norm_a * norm_b
    return dot / denominator if denominator > 0 else 0.0


def expert_similarity(first_matrices: Sequence[np.ndarray], exact: bool = False) -> np.ndarray:
    """Cosine similarity between the flattened first matrices of a layer's experts (E x E, float64;
    0 for a zero matrix). With `exact`, every dot product is correctly rounded (bit-identical on
    every machine, but orders of magnitude slower: docs/benchmarks.md, "Small costs behind constants");
    otherwise one float64 matrix product, whose summation error is at most about size * 2^-53 in cosine
    (Cauchy-Schwarz bounds the sum of |products|)."""
    flat = _flat_first(first_matrices)
    count = len(flat)
    if exact:
        exact_norms = [math.sqrt(_exact_dot(f, f)) for f in flat]
        exact_sim = np.eye(count, dtype=np.float64)
        for i in range(count):
            for j in range(i + 1, count):
                exact_sim[i, j] = exact_sim[j, i] = _cosine(_exact_dot(flat[i], flat[j]), exact_norms[i], exact_norms[j])
        return exact_sim
    stacked = np.array(flat, dtype=np.float64)
    gram = stacked @ stacked.T
    norms = np.sqrt(np.diag(gram))
    outer = np.outer(norms, norms)
    sim: np.ndarray = np.divide(gram, outer, out=np.zeros_like(gram), where=outer > 0)
    np.fill_diagonal(sim, 1.0)
    return sim


def _ranked(row: Sequence[float], i: int) -> list[int]:
    """The other experts, most similar first, ties by index."""
    return sorted((j for j in range(len(row)) if j != i), key=lambda j: (-row[j], j))


def merge_partners(first_matrices: Sequence[np.ndarray], neighbours: int = MERGE_NEIGHBOURS) -> list[tuple[int, ...]]:
    """For each expert, the `neighbours` other experts of its layer most similar to it (ties: lower
    index first), sorted by index; fewer when the layer has fewer other experts.

    The choice is the same on every machine: the fast cosines decide wherever the gap at the
    top-k boundary is wider than their error bound (with a wide margin); a row with a closer call
    is recomputed with correctly rounded dot products. The merged values depend on nothing else.
    """
    flat = _flat_first(first_matrices)
    count = len(flat)
    margin = 1e-8 + 8 * (flat[0].size if flat else 0) * 2.0**-53
    fast = expert_similarity(flat)
    exact_norms: list[float] | None = None
    out = []
    for i in range(count):
        order = _ranked(fast[i], i)
        if len(order) > neighbours and fast[i, order[neighbours - 1]] - fast[i, order[neighbours]] <= margin:
            if exact_norms is None:
                exact_norms = [math.sqrt(_exact_dot(f, f)) for f in flat]
            row = [1.0 if j == i else _cosine(_exact_dot(flat[i], flat[j]), exact_norms[i], exact_norms[j])
                   for j in range(count)]
            order = _ranked(row, i)
        out.append(tuple(sorted(order[:neighbours])))
    return out


def merge_layer(experts: Sequence[Sequence[np.ndarray]], alpha: float, neighbours: int = MERGE_NEIGHBOURS,
                only: Iterable[int] | None = None) -> dict[int, list[np.ndarray]]:
    """One warm-up merge of a layer: expert i becomes x_i + alpha * (mean of its partners - x_i),
    tensor by tensor, from the values before the merge (all experts move at once).

    `experts[i]` lists expert i's tensors, its first matrix first (similarity is measured on it).
    `only` limits which experts are computed (a node computes the ones it owns); the result maps
    expert index -> new float32 tensors. Element-wise float64 arithmetic in a fixed order and a
    machine-independent choice of partners make the result bit-identical wherever the inputs are.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"merge alpha must be in [0, 1], got {alpha!r}")
    partners = merge_partners([tensors[0] for tensors in experts], neighbours)
    chosen = range(len(experts)) if only is None else sorted(set(only))
    merged = {}
    for i in chosen:
        new = []
        for t, x in enumerate(experts[i]):
            own = np.asarray(x, dtype=np.float64)
            if not partners[i] or alpha == 0.0:
                new.append(np.array(x, dtype=np.float32, copy=True))
                continue
            total = np.zeros_like(own)
            for j in partners[i]:
                total += np.asarray(experts[j][t], dtype=np.float64)
            mean = total / len(partners[i])
            new.append((own + alpha * (mean - own)).astype(np.float32))
        merged[i] = new
    return merged


