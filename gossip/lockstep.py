"""A lock-step round planner for in-process swarms (the tests and the benchmarks, over gossip.memory).

Round r of every peer starts together, as the daemon's shared round clock makes it, over one fixed
membership view. node.algorithms.lockstep drives nodes' steps with it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from topology import MembershipView, PeerRound, build_topology, peer_round


class Lockstep:
    """Plans for `ids` over `topology`. `plan_for(peer)` and `published` share one barrier (every peer
    waits for every other at each round and each publication); `fragment_plan_for(peer)` waits per
    (fragment, round), as DiLoCo's fragments sync independently."""

    def __init__(self, ids: Sequence[str], topology: str = "complete") -> None:
        self.ids = list(ids)
        self.view = MembershipView.of(self.ids)
        self.topo = build_topology(topology, self.view.n)
        self.barrier = asyncio.Barrier(len(self.ids))
        self._barriers: dict[tuple[int, int], asyncio.Barrier] = {}

    def plan(self, peer_id: str, round_index: int) -> PeerRound:
        """`peer_id`'s neighbours and weights in round `round_index`, without waiting."""
        return peer_round(self.topo, self.view, peer_id, round_index)

    def plan_for(self, peer_id: str) -> Callable[[int], Awaitable[PeerRound]]:
        async def plan(round_index: int) -> PeerRound:
            await self.barrier.wait()
            return self.plan(peer_id, round_index)
        return plan

    def fragment_plan_for(self, peer_id: str) -> Callable[[int, int], Awaitable[PeerRound]]:
        async def plan(fragment: int, round_index: int) -> PeerRound:
            await self._barriers.setdefault((fragment, round_index), asyncio.Barrier(len(self.ids))).wait()
            return self.plan(peer_id, round_index)
        return plan

    async def published(self, sync_index: int) -> None:
        """SPES: every peer's expert records are published before anyone reads the directory."""
        await self.barrier.wait()
