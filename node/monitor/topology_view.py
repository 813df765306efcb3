"""The current round's gossip graph as the monitor shows it: every peer in view, the participants'
edges with their mixing weights, and the topology's rho."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from topology import MembershipView, Topology


def round_graph(view_ids: Iterable[str], members: MembershipView, topology: Topology | None, me: str,
                round_index: int) -> dict[str, Any]:
    """`/api/topology`'s object. Edges (source -> target) mean target mixes in source's value with
    weight W[target, source]; peers in view that do not take part in this round have no rank."""
    if topology is not None and topology.n != members.n:
        raise ValueError(f"topology over {topology.n} ranks for {members.n} participants")
    ranks = {peer: rank for rank, peer in enumerate(members.peer_ids)}
    nodes = [{"peer_id": peer, "rank": ranks.get(peer), "self": peer == me}
             for peer in sorted({*view_ids, *members.peer_ids, me})]
    edges: list[dict[str, Any]] = []
    self_weight = None
    if topology is not None and members.n:
        w = topology.mixing_matrix(round_index)
        for source, target in sorted(topology.graph(round_index).edges()):
            edges.append({"source": members.peer_ids[source], "target": members.peer_ids[target],
                          "weight": float(w[target, source])})
        if me in ranks:
            self_weight = float(w[ranks[me], ranks[me]])
    return {
        "round": round_index,
        "topology": topology.name if topology is not None else None,
        "weights": topology.spec.weight_scheme if topology is not None else None,
        "time_varying": topology.spec.time_varying if topology is not None else None,
        "rho": topology.rho if topology is not None else None,
        "spectral_gap": topology.spectral_gap if topology is not None else None,
        "self": me,
        "self_weight": self_weight,
        "nodes": nodes,
        "edges": edges,
    }
