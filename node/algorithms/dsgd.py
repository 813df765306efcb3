"""D-SGD and overlapped DAdam: a Trainer and a GossipPeer as one node of decentralized training.

`GossipTrainer` combines them (update rules in gossip.optimizers, docs/training.md); `DsgdAlgorithm` runs
it inside the daemon's loop, a round after every H-th step."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from gossip.exchange import GossipPeer
from gossip.optimizers import consensus_distance
from node.swarm.algorithm import PlanFor, RoundReport, StepReport
from node.swarm.contribution import ContributionScorer
from node.swarm.loop import TrainingStatus
from node.swarm.peers import SwarmRecord
from node.swarm.recipe import TrainingRecipe
from node.swarm.swarm_eval import Average
from node.train.trainer import Trainer


class GossipTrainer:
    """A Trainer and a GossipPeer as one node of decentralized training.

    D-SGD (adapt, then combine): a local step, then a round on the new values, whose mix becomes x.
    DAdam (overlapped): the round exchanges x_t while the worker thread computes g(x_t) and the Adam
    direction; then x_{t+1} = mix(x_t) - lr * direction. This object must be the only writer of the
    peer's tensors: run_round installs its mix only when nothing was installed during the round, and
    the mix is read back from the peer afterwards.
    """

    def __init__(self, trainer: Trainer, peer: GossipPeer) -> None:
        self.trainer = trainer
        self.peer = peer

    async def step(self, round_index: int | None = None, plan_for: PlanFor | None = None) -> StepReport:
        """One optimizer step; with a `round_index`, also gossip round `round_index`, whose plan
        `plan_for` gives (awaited after this peer's tensors for the round are offered)."""
        started = time.perf_counter()
        if round_index is None:
            stats = await self.trainer.train_step()
            return StepReport(stats, time.perf_counter() - started)
        if plan_for is None:
            raise ValueError("a step with a round needs plan_for")
        if self.trainer.config.optimizer.algorithm == "dadam":
            await self._offer()
            async with asyncio.TaskGroup() as group:
                mixing = group.create_task(self._mix(round_index, plan_for))
                computing = group.create_task(self.trainer.compute_update())
            await self.trainer.apply_update(self.peer.tensors)
            stats, report = computing.result(), mixing.result()
        else:
            stats = await self.trainer.train_step()
            await self._offer()
            report = await self._mix(round_index, plan_for)
            await self.trainer.load_tensors(self.peer.tensors)
        return StepReport(stats, time.perf_counter() - started, report)

    async def next_step(self, plan_for: PlanFor) -> StepReport:
        """The next step of the schedule: a round after every `local_steps`-th, numbered step // local_steps
        (every node of a swarm that starts together agrees on the numbering)."""
        step, optimizer = self.trainer.step, self.trainer.config.optimizer
        return await self.step(step // optimizer.local_steps if optimizer.mixes_after(step) else None, plan_for)

    async def _offer(self) -> None:
        """Make the current parameters the peer's tensors: what this round sends and mixes."""
        self.peer.set_tensors(await self.trainer.tensors(), step=self.trainer.step)

    async def _mix(self, round_index: int, plan_for: PlanFor) -> RoundReport:
        """Run the round on the offered tensors; the peer holds their mix afterwards."""
        plan = await plan_for(round_index)
        own = self.peer.tensors
        outcome = await self.peer.run_round(round_index, plan)
        distance = await asyncio.to_thread(consensus_distance, own, self.peer.tensors, plan.self_weight,
                                           plan.in_weights, outcome.mixed_with)
        return RoundReport(round_index, outcome, distance)


class DsgdAlgorithm:
    """D-SGD or DAdam in the daemon (node.swarm.algorithm.Algorithm): the main gossip peer runs the rounds."""

    rejoins_when_left_behind = False
    average: Average | None = None

    def __init__(self, trainer: Trainer, peer: GossipPeer, recipe: TrainingRecipe) -> None:
        self.trainer = trainer
        self.peer = peer
        self.recipe = recipe
        self.gossip = GossipTrainer(trainer, peer)

    async def start(self) -> None:
        pass

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        yield

    async def step(self, plan_for: PlanFor) -> StepReport:
        """One step, with a gossip round after every H-th (the trainer steps with the recipe's optimizer)."""
        return await self.gossip.next_step(plan_for)

    async def rejoin(self, swarm_step: int, margin: int, catch_up: Callable[[], Awaitable[None]]) -> bool:
        before = self.trainer.step
        await catch_up()
        return self.trainer.step > before + margin

    def score_with(self, scorer: ContributionScorer) -> bool:
        self.peer.judge = scorer  # the main peer's rounds mix parameters: scored as they are
        return True

    async def record_refusals(self, view: Sequence[SwarmRecord], step: int) -> dict[str, str]:
        return {}

    async def adopt_download(self, sources: Sequence[SwarmRecord]) -> None:
        pass

    async def moved_to(self, step: int) -> None:
        pass

    async def publish_final(self) -> None:
        """DAdam's peer holds the last mix before its update: offer the final parameters instead."""
        self.peer.set_tensors(await self.trainer.tensors(), step=self.trainer.step)

    async def adopt_merged(self, merged: dict[str, Any]) -> None:
        await self.trainer.load_tensors(merged)

    async def state(self) -> dict[str, Any]:
        return await self.trainer.state()

    def checkpoint_meta(self) -> dict[str, str]:
        return {}

    def show(self, status: TrainingStatus) -> None:
        pass

    def sections(self) -> dict[str, dict[str, Any]]:
        return {}

    def traffic(self) -> tuple[int, int]:
        return 0, 0

    def errors(self) -> dict[str, int]:
        return {}

    def skipped(self) -> dict[str, int]:
        return {}  # the main peer's rounds, counted there


__all__ = ["DsgdAlgorithm", "GossipTrainer"]
