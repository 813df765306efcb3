"""The in-process swarm's one loop, for the tests and the benchmarks: every node steps through the
per-step method the daemon's Algorithm (node.swarm.algorithm) wraps, with its plans from one
gossip.lockstep.Lockstep over the in-memory transport (gossip.memory).

- GossipTrainer.next_step, as DsgdAlgorithm.step: a gossip round after every H-th step;
- SpesNode.step, as SpesAlgorithm.step: a sync after every S-th step, the records published by every
  peer before any reads them;
- DilocoTrainer.step, as DilocoAlgorithm.step: each fragment's k-th sync starts together on every peer."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any, overload

from gossip.lockstep import Lockstep
from node.algorithms.diloco.trainer import DilocoStepReport, DilocoTrainer
from node.algorithms.dsgd import GossipTrainer
from node.algorithms.spes.node import SpesNode, SpesStepReport
from node.swarm.algorithm import StepReport

InProcessNode = GossipTrainer | SpesNode | DilocoTrainer


def one_step(node: InProcessNode, lockstep: Lockstep, last: int | None = None) -> Awaitable[Any]:
    """`node`'s next step, planned by `lockstep`. DiLoCo: the step that reaches trainer step `last` is
    the budget's final one (every sync lands, the trainer ends on the anchor)."""
    if isinstance(node, GossipTrainer):
        return node.next_step(lockstep.plan_for(node.peer.peer_id))
    if isinstance(node, SpesNode):
        return node.step(lockstep.plan_for(node.peer_id), lockstep.published)
    return node.step(lockstep.fragment_plan_for(node.trainer.peer_id), final=node.trainer.step + 1 == last)


@overload
async def drive(nodes: Sequence[GossipTrainer], steps: int, lockstep: Lockstep, *,
                last: int | None = None) -> list[list[StepReport]]: ...
@overload
async def drive(nodes: Sequence[SpesNode], steps: int, lockstep: Lockstep, *,
                last: int | None = None) -> list[list[SpesStepReport]]: ...
@overload
async def drive(nodes: Sequence[DilocoTrainer], steps: int, lockstep: Lockstep, *,
                last: int | None = None) -> list[list[DilocoStepReport]]: ...
async def drive(nodes: Sequence[InProcessNode], steps: int, lockstep: Lockstep, *,
                last: int | None = None) -> list[list[Any]]:
    """`steps` steps of every node at once, each node's in order; each node's reports. `lockstep`
    covers `nodes` (its barriers wait for every one of them)."""
    async def run(node: InProcessNode) -> list[Any]:
        return [await one_step(node, lockstep, last) for _ in range(steps)]

    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(run(node)) for node in nodes]
    return [task.result() for task in tasks]


__all__ = ["InProcessNode", "drive", "one_step"]
