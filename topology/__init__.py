"""Communication topologies for gossip: graph families, mixing weights and their spectral analysis (numpy only)."""

from topology.catalog import (
    TOPOLOGY_NAMES,
    Topology,
    TopologyCache,
    TopologySpec,
    build_topology,
    schedule_period,
)
from topology.graphs import Graph
from topology.view import MembershipView, PeerRound, peer_round
from topology.weights import WEIGHT_SCHEMES, RowWeights

__all__ = [
    "TOPOLOGY_NAMES",
    "WEIGHT_SCHEMES",
    "Graph",
    "MembershipView",
    "PeerRound",
    "RowWeights",
    "Topology",
    "TopologyCache",
    "TopologySpec",
    "build_topology",
    "peer_round",
    "schedule_period",
]
