"""Build a topology by name with options: the one entry point used by the CLI, the config and the node.

A `Topology` holds the graphs of one period (one graph for static families), their mixing weights,
and the figures that describe it (degree, rho, spectral gap).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from topology import graphs, spectral
from topology.weights import RowWeights, check_scheme, mixing_matrix, row_weights

# name -> (default weight scheme, time-varying?)
FAMILIES: dict[str, tuple[str, bool]] = {
    "ring": ("metropolis-hastings", False),
    "torus": ("metropolis-hastings", False),
    "complete": ("metropolis-hastings", False),
    "star": ("metropolis-hastings", False),
    "static-exp": ("uniform", False),
    "one-peer-exp": ("uniform", True),
    "hypercube": ("metropolis-hastings", True),
    "random-regular": ("metropolis-hastings", False),
    "custom": ("metropolis-hastings", False),
}
TOPOLOGY_NAMES = tuple(FAMILIES)


@dataclass(frozen=True)
class TopologySpec:
    """What a config or the CLI says about the topology; independent of the number of peers."""

    name: str
    weights: str | None = None  # None: the family's default scheme
    degree: int = 4  # random-regular
    seed: int = 0  # random-regular
    rows: int | None = None  # torus; None: the most square factorisation
    edges: tuple[tuple[int, int], ...] = ()  # custom
    directed: bool = False  # custom

    def __post_init__(self) -> None:
        if self.name not in FAMILIES:
            raise ValueError(f"unknown topology {self.name!r}; choose one of {', '.join(TOPOLOGY_NAMES)}")
        if self.name == "custom" and not self.edges:
            raise ValueError("the custom topology needs an edge list")

    @property
    def weight_scheme(self) -> str:
        return self.weights or FAMILIES[self.name][0]

    @property
    def time_varying(self) -> bool:
        return FAMILIES[self.name][1]


def _period_graphs(spec: TopologySpec, n: int) -> tuple[graphs.Graph, ...]:
    match spec.name:
        case "ring":
            return (graphs.ring(n),)
        case "torus":
            return (graphs.torus(n, spec.rows),)
        case "complete":
            return (graphs.complete(n),)
        case "star":
            return (graphs.star(n),)
        case "static-exp":
            return (graphs.static_exponential(n),)
        case "one-peer-exp":
            return tuple(graphs.one_peer_exponential(n, t) for t in range(graphs.exponential_period(n)))
        case "hypercube":
            return tuple(graphs.hypercube_pairing(n, t) for t in range(graphs.exponential_period(n)))
        case "random-regular":
            return (graphs.random_regular(n, spec.degree, spec.seed),)
        case "custom":
            return (graphs.custom(n, spec.edges, spec.directed),)
    raise AssertionError(spec.name)  # pragma: no cover - __post_init__ rejects unknown names


@dataclass(frozen=True)
class Topology:
    """A topology over n ranks: graphs and weights for every round, and its spectral figures."""

    spec: TopologySpec
    n: int
    period_graphs: tuple[graphs.Graph, ...] = field(repr=False)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def period(self) -> int:
        return len(self.period_graphs)

    def graph(self, round_index: int) -> graphs.Graph:
        return self.period_graphs[round_index % self.period]

    def row(self, rank: int, round_index: int) -> RowWeights:
        """The weights `rank` mixes with in `round_index`: all a node needs for one round."""
        return row_weights(self.graph(round_index), self.spec.weight_scheme, rank)

    def mixing_matrix(self, round_index: int) -> np.ndarray:
        return mixing_matrix(self.graph(round_index), self.spec.weight_scheme)

    def period_matrix(self) -> np.ndarray:
        """The product of one period's mixing matrices (the single W for static families)."""
        return spectral.period_product([self.mixing_matrix(t) for t in range(self.period)])

    @property
    def degree(self) -> int:
        """Most neighbours any rank mixes with in one round."""
        return max(g.max_degree for g in self.period_graphs)

    @cached_property
    def rho(self) -> float:
        """Per-round contraction factor: rho(W), or rho(period product)^(1/period) for schedules."""
        if self.n == 1:
            return 0.0
        period_rho = spectral.rho(self.period_matrix())
        # a schedule that averages exactly leaves float noise (~1e-16), whose p-th root is not small
        return 0.0 if period_rho < 1e-12 else period_rho ** (1.0 / self.period)

    @property
    def spectral_gap(self) -> float:
        return 1.0 - self.rho

    def is_doubly_stochastic(self) -> bool:
        return all(spectral.is_doubly_stochastic(self.mixing_matrix(t)) for t in range(self.period))

    def describe(self) -> dict[str, object]:
        """The `murmur topology --json` object."""
        return {
            "name": self.name,
            "n": self.n,
            "degree": self.degree,
            "rho": self.rho,
            "spectral_gap": self.spectral_gap,
            "period": self.period,
            "weights": self.spec.weight_scheme,
            "time_varying": self.spec.time_varying,
        }


def build_topology(spec: TopologySpec | str, n: int, **options: object) -> Topology:
    """`build_topology("ring", 8)` or `build_topology(TopologySpec("random-regular", degree=6), 64)`."""
    if isinstance(spec, str):
        spec = TopologySpec(spec, **options)  # type: ignore[arg-type]
    elif options:
        raise TypeError("pass options either in the TopologySpec or as keywords, not both")
    if n < 1:
        raise ValueError(f"a topology needs at least 1 peer, got {n}")
    period_graphs = _period_graphs(spec, n)
    for g in period_graphs:
        check_scheme(spec.weight_scheme, g)
    return Topology(spec, n, period_graphs)


def schedule_period(spec: TopologySpec, n: int) -> int:
    """Rounds after which the family's graphs over n ranks repeat (1 for static families), without
    building them."""
    return graphs.exponential_period(n) if spec.time_varying else 1


class TopologyCache:
    """The topologies of one spec for the last few swarm sizes (least recently used dropped): a view
    whose size keeps changing rebuilds no more than that, and holds no more than that many graphs."""

    def __init__(self, spec: TopologySpec | str, capacity: int = 4) -> None:
        self.spec = spec if isinstance(spec, TopologySpec) else TopologySpec(spec)
        self._capacity = capacity
        self._built: OrderedDict[int, Topology] = OrderedDict()

    def get(self, n: int) -> Topology:
        topology = self._built.get(n)
        if topology is None:
            topology = self._built[n] = build_topology(self.spec, n)
            while len(self._built) > self._capacity:
                self._built.popitem(last=False)
        self._built.move_to_end(n)
        return topology
