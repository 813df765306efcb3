"""Gossip DiLoCo inside the daemon: a SwarmTraining whose steps run a DilocoTrainer (inner AdamW steps,
per-fragment outer exchanges over the topology of the current view), whose checkpoints carry the outer
state, whose joiners take a peer's outer momentum with its anchor, and whose status shows the outer
loop (outer step, fragments in flight, the sync period)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from gossip.diloco import DilocoConfig, SyncSchedule
from gossip.exchange import ExchangeSettings, GossipPeer
from gossip.transport import Transport
from node.algorithms.diloco.trainer import DilocoTrainer
from node.swarm.joining import plausible_steps, swarm_left_behind
from node.swarm.loop import Connect, Merge, RecordSample, SwarmTraining
from node.swarm.recipe import TrainingRecipe
from node.train.settings import TrainingSettings
from node.train.trainer import RoundReport, StepReport, Trainer
from topology import PeerRound, Topology

if TYPE_CHECKING:
    from node.net.discovery import Discovery
    from node.net.records import PeerRecord

logger = logging.getLogger("murmur.diloco")

# The outer exchanges wait this long at least for a neighbour to reach the same sync (a neighbour a
# few inner steps behind is seconds behind) and for a fragment to cross a slow link.
MIN_OUTER_TIMEOUT_S = 60.0
# How often a node looks whether the swarm left it behind (see DilocoSwarmTraining._skip_ahead_if_left_behind)
LAGGARD_CHECK_S = 5.0


def sync_schedule(recipe: TrainingRecipe) -> SyncSchedule:
    """When each fragment syncs, from the swarm's recipe (every node computes the same)."""
    assert recipe.diloco is not None, "a DiLoCo recipe"
    o = recipe.optimizer
    return SyncSchedule(o.local_steps, recipe.diloco.fragments, o.schedule.lr_at, qsr_alpha=recipe.diloco.qsr_alpha,
                        warmup_steps=o.warmup_steps)


def outer_exchange(exchange: ExchangeSettings) -> ExchangeSettings:
    """The fragments' exchange settings: the swarm's codec (of pseudo-gradients), a longer deadline."""
    return replace(exchange, exchange_timeout_s=max(exchange.exchange_timeout_s, MIN_OUTER_TIMEOUT_S))


class DilocoSwarmTraining(SwarmTraining):
    """SwarmTraining with gossip DiLoCo steps (docs/training.md, "Gossip DiLoCo"). `self.peer` (the main
    gossip peer, fp32) runs no rounds: it serves the anchor to joiners, evaluations and final merges."""

    def __init__(self, trainer: Trainer, peer: GossipPeer, discovery: Discovery, recipe: TrainingRecipe,
                 settings: TrainingSettings, topology_for: Callable[[int], Topology], connect: Connect,
                 lag_window: int, *, record: RecordSample | None = None, transport: Transport,
                 exchange: ExchangeSettings, state: ExchangeSettings,
                 saved: Mapping[str, np.ndarray] | None = None) -> None:
        super().__init__(trainer, peer, discovery, recipe, settings, topology_for, connect, lag_window, record=record)
        assert recipe.diloco is not None, "a DiLoCo recipe"
        self.config: DilocoConfig = recipe.diloco
        self.diloco = DilocoTrainer(trainer, transport, outer_exchange(exchange), self.config, sync_schedule(recipe),
                                    state_peer=peer, state_settings=state)
        self.resumed_outer_state = saved is not None and self.diloco.restore(saved)
        self._started = False
        self._catch_up_with: tuple[int, float | None] | None = None  # margin and epoch of the first catch-up
        self._stop: asyncio.Event | None = None
        self._checked_at = 0.0
        self.skipped_ahead = 0  # times the swarm left this node behind and it caught up
        self._last_report: RoundReport | None = None
        self.status.diloco = self.diloco_status()

    async def start(self) -> None:
        """Serve the fragments' and the momentum's protocols (once)."""
        if not self._started:
            self._started = True
            await self.diloco.start()
            self.peer.round = self.diloco.stats.outer_steps

    async def catch_up(self, stop: asyncio.Event, margin: int, look: bool, epoch: float | None = None) -> None:
        await self.start()
        if self._catch_up_with is None:
            self._catch_up_with = (margin, epoch)
        await super().catch_up(stop, margin, look, epoch)

    async def _skip_ahead_if_left_behind(self) -> None:
        """The laggard rule. A node more than the staleness bound of outer rounds behind its neighbours
        (slower compute, a long pause) finds every round stale: its neighbours answer nothing, and it
        never mixes again. Every LAGGARD_CHECK_S it judges the view's steps as a joiner does; once the
        swarm is more than that margin ahead, it lands its pending syncs and catches up like a joiner
        (the swarm's anchor from several peers, checked and combined, the outer momentum, the view's
        step), giving up the local progress of the phase it could not sync anyway."""
        now = time.monotonic()
        if self._catch_up_with is None or self._stop is None or now - self._checked_at < LAGGARD_CHECK_S:
            return
        self._checked_at = now
        margin, epoch = self._catch_up_with
        before = self.trainer.step
        plausible = plausible_steps(epoch, time.time()) if epoch is not None else None
        judged = swarm_left_behind(self.discovery.view(), self.peer.peer_id, before, margin, self.recipe.steps,
                                   plausible)
        if judged is None:
            return
        logger.warning("the swarm is at step %d, this node at %d (more than %d steps, the staleness bound, behind): "
                       "catching up with it", judged, before, margin)
        await self.diloco.flush()
        await super().catch_up(self._stop, margin, False, epoch)
        if self.trainer.step > before:
            self.skipped_ahead += 1

    async def _after_download(self, sources: Sequence[PeerRecord]) -> None:
        """The downloaded parameters are an anchor (what peers serve): continue from it with the outer
        momentum of the first peer that serves one within bounds (none: start without)."""
        momentum = None
        for record in sources:
            momentum = await self.diloco.fetch_momentum(record.peer_id)
            if momentum is not None:
                break
        await self.diloco.adopt(await self.trainer.tensors(), momentum)
        logger.info("continuing from the downloaded anchor %s outer momentum", "with its" if momentum else "without")

    async def run(self, stop: asyncio.Event, save: Callable[[], Awaitable[None]],
                  average: Callable[[], None] | None = None, merge: Merge | None = None) -> None:
        await self.start()
        self._stop = stop
        try:
            await super().run(stop, save, average, merge)
        finally:
            await self.diloco.close()

    async def plan_fragment(self, fragment: int, round_index: int) -> PeerRound:
        """A fragment's k-th sync is gossip round k over the current view (every fragment the same graph)."""
        return await self.plan_for(round_index)

    async def _step(self) -> StepReport:
        await self._skip_ahead_if_left_behind()
        final = self.recipe.steps > 0 and self.trainer.step + 1 >= self.recipe.steps
        report = await self.diloco.step(self.plan_fragment, final=final)
        self.peer.round = self.diloco.stats.outer_steps
        round_report = None
        for sync in report.synced:
            if sync.outcome is not None:
                distance = sync.anchor_distance if sync.anchors is not None else sync.consensus_distance
                round_report = self._last_report = RoundReport(sync.round, sync.outcome, distance)
        return StepReport(report.stats, report.step_s, round_report)

    async def _publish_final(self) -> None:
        """The last step ends on the anchor, which the main peer already serves."""

    async def _adopt_merged(self, merged: dict[str, Any]) -> None:
        await self.trainer.load_tensors(merged)
        self.diloco.set_anchor(merged)

    async def state(self) -> dict[str, Any]:
        return {**await self.trainer.state(), **self.diloco.state()}

    def extra_traffic(self) -> tuple[int, int]:
        return self.diloco.bytes_sent, self.diloco.bytes_received

    def extra_errors(self) -> dict[str, int]:
        return self.diloco.errors()

    def _record(self, report: StepReport) -> None:
        super()._record(report)
        self.status.diloco = self.diloco_status()

    def status_dict(self) -> dict[str, Any]:
        self.status.diloco = self.diloco_status()  # exchanges in flight change between steps
        return super().status_dict()

    def diloco_status(self) -> dict[str, Any]:
        """The `training.diloco` section of the node's status (docs/monitor.md)."""
        d, c = self.diloco, self.config
        step = max(1, self.trainer.step)
        _, start, end = d.schedule.phase_of(step)
        sent, received = d.outer_bytes
        return {"outer_step": d.stats.outer_steps, "outer_updates": d.stats.outer_updates,
                "fragments": c.fragments, "fragments_in_flight": d.in_flight, "sync_period": end - start,
                "overlap": c.overlap, "outer_lr": c.outer_lr, "outer_momentum": c.outer_momentum,
                "anchor_every": c.anchor_every, "anchor_codec": c.anchor_codec,
                "codec": d.codec_name, "outer_bytes_sent": sent, "outer_bytes_received": received,
                "exchanges_failed": d.stats.exchanges_failed, "skipped": d.skipped(),
                "rounds_run": d.rounds_run, "fragment_rounds": d.fragment_rounds,
                "resumed_outer_state": self.resumed_outer_state, "skipped_ahead": self.skipped_ahead}


__all__ = ["MIN_OUTER_TIMEOUT_S", "DilocoSwarmTraining", "outer_exchange", "sync_schedule"]
