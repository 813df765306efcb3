"""Communication graphs over ranks 0..n-1: the families of DESIGN.md, one function each.

A `Graph` lists, for every rank, the ranks whose values it mixes in (its in-neighbours). Graphs of
time-varying schedules are built per round; the period bookkeeping lives in `topology.catalog`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Graph:
    """Directed in-neighbour lists: rank i mixes in the values of `in_neighbours[i]` (never i itself)."""

    n: int
    in_neighbours: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"a graph needs at least 1 rank, got n={self.n}")
        if len(self.in_neighbours) != self.n:
            raise ValueError(f"{len(self.in_neighbours)} neighbour lists for n={self.n} ranks")
        for i, nbrs in enumerate(self.in_neighbours):
            if len(set(nbrs)) != len(nbrs) or any(j == i or not 0 <= j < self.n for j in nbrs):
                raise ValueError(f"rank {i}: neighbours {nbrs} must be distinct ranks in [0, {self.n}) other than {i}")

    def in_degree(self, rank: int) -> int:
        return len(self.in_neighbours[rank])

    def out_neighbours(self, rank: int) -> tuple[int, ...]:
        """The ranks that mix in `rank`'s value, i.e. whom `rank` must send to."""
        return tuple(i for i, nbrs in enumerate(self.in_neighbours) if rank in nbrs)

    @property
    def max_degree(self) -> int:
        return max((len(nbrs) for nbrs in self.in_neighbours), default=0)

    def is_symmetric(self) -> bool:
        # an adjacency matrix, not a set of edge tuples: the complete graph of 1024 ranks has a million edges
        adjacency = np.zeros((self.n, self.n), dtype=bool)
        for i, nbrs in enumerate(self.in_neighbours):
            adjacency[i, np.fromiter(nbrs, dtype=np.intp, count=len(nbrs))] = True
        return bool((adjacency == adjacency.T).all())

    def edges(self) -> frozenset[tuple[int, int]]:
        """Directed edges (j, i): the value of j flows to i."""
        return frozenset((j, i) for i, nbrs in enumerate(self.in_neighbours) for j in nbrs)


def _from_sets(n: int, neighbour_sets: Iterable[Iterable[int]]) -> Graph:
    return Graph(n, tuple(tuple(sorted({j for j in nbrs} - {i})) for i, nbrs in enumerate(neighbour_sets)))


def _log2_ceil(n: int) -> int:
    return max(1, math.ceil(math.log2(n))) if n > 1 else 0


def ring(n: int) -> Graph:
    return _from_sets(n, ({(i - 1) % n, (i + 1) % n} for i in range(n)))


def torus_shape(n: int, rows: int | None = None) -> tuple[int, int]:
    """rows x cols = n with rows the largest divisor of n not above sqrt(n), unless rows is given."""
    if rows is None:
        rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    if rows < 1 or n % rows:
        raise ValueError(f"torus rows={rows} does not divide n={n}")
    return rows, n // rows


def torus(n: int, rows: int | None = None) -> Graph:
    """2-D torus (wrap-around grid); a side of length 1 or 2 collapses duplicate neighbours."""
    r, c = torus_shape(n, rows)

    def nbrs(i: int) -> set[int]:
        y, x = divmod(i, c)
        return {((y - 1) % r) * c + x, ((y + 1) % r) * c + x, y * c + (x - 1) % c, y * c + (x + 1) % c}

    return _from_sets(n, (nbrs(i) for i in range(n)))


def complete(n: int) -> Graph:
    return _from_sets(n, (range(n) for _ in range(n)))


def star(n: int, center: int = 0) -> Graph:
    if not 0 <= center < n:
        raise ValueError(f"star center {center} is not a rank in [0, {n})")
    return _from_sets(n, (range(n) if i == center else {center} for i in range(n)))


def static_exponential(n: int) -> Graph:
    """Rank i mixes in ranks i + 2^k (mod n) for k < ceil(log2 n): directed, degree ceil(log2 n)."""
    offsets = [2**k for k in range(_log2_ceil(n))]
    return _from_sets(n, ({(i + o) % n for o in offsets} for i in range(n)))


def exponential_period(n: int) -> int:
    """Rounds in one period of the one-peer exponential and hypercube schedules."""
    return max(1, _log2_ceil(n))


def one_peer_exponential(n: int, round_index: int) -> Graph:
    """Round t: rank i mixes in rank i + 2^(t mod ceil(log2 n)) (mod n); one in- and one out-neighbour."""
    if n == 1:
        return Graph(1, ((),))
    offset = 2 ** (round_index % exponential_period(n))
    return _from_sets(n, ({(i + offset) % n} for i in range(n)))


def hypercube_pairing(n: int, round_index: int) -> Graph:
    """Round t: rank i pairs with i XOR 2^(t mod ceil(log2 n)); a rank whose partner is >= n sits out."""
    if n == 1:
        return Graph(1, ((),))
    bit = 2 ** (round_index % exponential_period(n))
    return _from_sets(n, ({i ^ bit} if (i ^ bit) < n else set() for i in range(n)))


def _is_connected(adjacency: list[set[int]]) -> bool:
    seen, frontier = {0}, [0]
    while frontier:
        nxt = [j for i in frontier for j in adjacency[i] if j not in seen]
        seen.update(nxt)
        frontier = nxt
    return len(seen) == len(adjacency)


def effective_regular_degree(n: int, degree: int) -> int:
    """The degree a random regular graph over n ranks really gets: capped at n-1, even n*d."""
    if degree < 2:
        raise ValueError(f"random-regular degree must be >= 2 (a 1-regular graph is disconnected), got {degree}")
    d = min(degree, n - 1)
    if (n * d) % 2:
        d -= 1
    return d


def random_regular(n: int, degree: int, seed: int) -> Graph:
    """A connected random d-regular graph, the same for the same (n, degree, seed) on every machine.

    Starts from a circulant d-regular graph and applies seeded double-edge swaps (which keep every
    degree), retrying until connected. The degree is adjusted by `effective_regular_degree`.
    """
    d = effective_regular_degree(n, degree)
    if d <= 1:
        return complete(n)
    rng = np.random.default_rng(seed)
    if d == 2:
        order = rng.permutation(n).tolist()
        return _from_sets(n, _ring_sets(order))
    for _ in range(50):
        adjacency = _circulant_sets(n, d)
        edges = sorted({(min(i, j), max(i, j)) for i in range(n) for j in adjacency[i]})
        for _ in range(10 * len(edges)):
            a, b = rng.choice(len(edges), size=2, replace=False)
            (u, v), (x, y) = edges[a], edges[b]
            if rng.random() < 0.5:
                x, y = y, x
            if len({u, v, x, y}) < 4 or y in adjacency[u] or x in adjacency[v]:
                continue
            for p, q in ((u, v), (x, y)):
                adjacency[p].discard(q)
                adjacency[q].discard(p)
            for p, q in ((u, y), (v, x)):
                adjacency[p].add(q)
                adjacency[q].add(p)
            edges[a], edges[b] = (min(u, y), max(u, y)), (min(v, x), max(v, x))
        if _is_connected(adjacency):
            return _from_sets(n, adjacency)
    raise RuntimeError(f"no connected {d}-regular graph on {n} ranks found")  # pragma: no cover


def _ring_sets(order: list[int]) -> list[set[int]]:
    n = len(order)
    sets: list[set[int]] = [set() for _ in range(n)]
    for k, i in enumerate(order):
        sets[i] |= {order[(k - 1) % n], order[(k + 1) % n]}
    return sets


def _circulant_sets(n: int, d: int) -> list[set[int]]:
    """i ~ i +- 1..d//2, plus the antipode i + n/2 when d is odd (n is then even)."""
    sets = [{(i + s) % n for s in range(1, d // 2 + 1)} | {(i - s) % n for s in range(1, d // 2 + 1)} for i in range(n)]
    if d % 2:
        for i in range(n):
            sets[i].add((i + n // 2) % n)
    return sets


def custom(n: int, edges: Iterable[tuple[int, int]], directed: bool = False) -> Graph:
    """A graph from an edge list over ranks; undirected unless `directed` ((j, i): j's value flows to i)."""
    sets: list[set[int]] = [set() for _ in range(n)]
    for edge in edges:
        j, i = edge
        if not (0 <= i < n and 0 <= j < n) or i == j:
            raise ValueError(f"edge {edge}: ranks must be distinct and in [0, {n})")
        sets[i].add(j)
        if not directed:
            sets[j].add(i)
    undirected = [s | {i for i in range(n) if k in sets[i]} for k, s in enumerate(sets)]
    if not _is_connected(undirected):
        raise ValueError(f"the custom edge list does not connect all {n} ranks")
    return _from_sets(n, sets)
