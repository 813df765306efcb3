"""Mixing weights for a graph: Metropolis-Hastings, uniform and max-degree.

`row_weights` gives one rank's weights without building the n x n matrix (what a node needs);
`mixing_matrix` stacks the rows (what analysis and the simulator need).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from topology.graphs import Graph

WEIGHT_SCHEMES = ("metropolis-hastings", "uniform", "max-degree")


@dataclass(frozen=True)
class RowWeights:
    """One rank's mixing weights for one round: x_i <- self_weight * x_i + sum_j w_j * x_j."""

    self_weight: float
    neighbours: tuple[tuple[int, float], ...]

    def as_dict(self) -> dict[int, float]:
        return dict(self.neighbours)


def check_scheme(scheme: str, graph: Graph) -> None:
    if scheme not in WEIGHT_SCHEMES:
        raise ValueError(f"unknown weight scheme {scheme!r}; choose one of {', '.join(WEIGHT_SCHEMES)}")
    if scheme == "metropolis-hastings" and not graph.is_symmetric():
        raise ValueError("metropolis-hastings weights need an undirected graph; use 'uniform' for directed ones")


def row_weights(graph: Graph, scheme: str, rank: int, max_degree: int | None = None) -> RowWeights:
    """One rank's weights. Unchecked for speed (a node asks every round): `check_scheme` once first."""
    if max_degree is None:
        max_degree = graph.max_degree
    nbrs = graph.in_neighbours[rank]
    d_i = len(nbrs)
    if scheme == "metropolis-hastings":
        w = tuple((j, 1.0 / (1 + max(d_i, graph.in_degree(j)))) for j in nbrs)
    elif scheme == "uniform":
        w = tuple((j, 1.0 / (1 + d_i)) for j in nbrs)
    else:
        w = tuple((j, 1.0 / (1 + max_degree)) for j in nbrs)
    return RowWeights(1.0 - sum(x for _, x in w), w)


def mixing_matrix(graph: Graph, scheme: str) -> np.ndarray:
    """W with W[i, j] the weight rank i gives rank j's value (rows sum to 1)."""
    check_scheme(scheme, graph)
    w = np.zeros((graph.n, graph.n))
    max_degree = graph.max_degree
    for i in range(graph.n):
        row = row_weights(graph, scheme, i, max_degree)
        w[i, i] = row.self_weight
        for j, x in row.neighbours:
            w[i, j] = x
    return w
