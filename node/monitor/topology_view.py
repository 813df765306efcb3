"""The current round's gossip graph as the monitor shows it: every peer in view, the participants' edges with
their mixing weights, and the topology's rho.

It is computed in a worker thread and reused while its inputs stay the same: a dense n x n matrix and its
eigenvalues do not belong on the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any

from topology import MembershipView, Topology, TopologyCache, TopologySpec, schedule_period


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


class RoundGraphCache:
    """`round_graph` for the monitor, off the event loop: `refresh` computes it in a worker thread (one
    at a time) when its inputs changed since the last one (the view, the round's members, this node,
    the topology, the round's place in the schedule), and `latest` answers from the last result."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._graph: dict[str, Any] | None = None
        self._topologies: TopologyCache | None = None  # used in the worker thread only
        self._lock = asyncio.Lock()
        self.computed = 0  # graphs computed so far

    def latest(self, round_index: int) -> dict[str, Any] | None:
        """The last graph computed, for `round_index`; None before the first."""
        return None if self._graph is None else {**self._graph, "round": round_index}

    async def refresh(self, view_ids: Sequence[str], members: MembershipView, spec: TopologySpec | None, me: str,
                      round_index: int) -> None:
        place = round_index % schedule_period(spec, members.n) if spec is not None and members.n else 0
        key = (tuple(view_ids), members.peer_ids, spec, me, place)
        async with self._lock:
            if key == self._key:
                return
            self._graph = await asyncio.to_thread(self._compute, tuple(view_ids), members, spec, me, round_index)
            self._key = key
            self.computed += 1

    def _compute(self, view_ids: tuple[str, ...], members: MembershipView, spec: TopologySpec | None, me: str,
                 round_index: int) -> dict[str, Any]:
        topology = None
        if spec is not None and members.n:
            if self._topologies is None or self._topologies.spec != spec:
                self._topologies = TopologyCache(spec)
            topology = self._topologies.get(members.n)
            _ = topology.rho  # its eigenvalues, here in the worker thread (a cached property)
        return round_graph(view_ids, members, topology, me, round_index)
