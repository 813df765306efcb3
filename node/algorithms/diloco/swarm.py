"""Gossip DiLoCo inside the daemon: the Algorithm the loop runs for a DiLoCo recipe.

Its steps run a DilocoTrainer (inner steps, per-fragment outer exchanges over the topology of the current
view), its checkpoints carry the outer state, its joiners take their sources' outer momentum with the anchor,
and its status shows the outer loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from gossip.diloco import DilocoConfig, SyncSchedule
from gossip.exchange import ExchangeSettings, GossipPeer
from gossip.transport import Transport
from node.algorithms.diloco.trainer import DilocoTrainer
from node.swarm.algorithm import PlanFor, RoundReport, StepReport
from node.swarm.contribution import ContributionScorer
from node.swarm.joining import combine
from node.swarm.loop import TrainingStatus
from node.swarm.peers import SwarmRecord
from node.swarm.recipe import TrainingRecipe
from node.swarm.swarm_eval import Average
from node.train.trainer import Trainer
from topology import PeerRound

logger = logging.getLogger("murmur.diloco")

# The outer exchanges wait this long at least for a neighbour to reach the same sync (a neighbour a
# few inner steps behind is seconds behind) and for a fragment to cross a slow link.
MIN_OUTER_TIMEOUT_S = 60.0
# A joiner's outer momentum comes from this many of its download's sources at most (as its parameters do):
# one source alone could hand it any momentum within the norm bound.
MOMENTUM_SOURCES = 3


def sync_schedule(recipe: TrainingRecipe) -> SyncSchedule:
    """When each fragment syncs, from the swarm's recipe (every node computes the same)."""
    assert recipe.diloco is not None, "a DiLoCo recipe"
    o = recipe.optimizer
    return SyncSchedule(o.local_steps, recipe.diloco.fragments, o.schedule.lr_at, qsr_alpha=recipe.diloco.qsr_alpha,
                        warmup_steps=o.warmup_steps, outer_warmup=recipe.diloco.outer_warmup)


def outer_exchange(exchange: ExchangeSettings) -> ExchangeSettings:
    """The fragments' exchange settings: the swarm's codec (of pseudo-gradients), a longer deadline."""
    return replace(exchange, exchange_timeout_s=max(exchange.exchange_timeout_s, MIN_OUTER_TIMEOUT_S))


def grace_bounds(exchange: ExchangeSettings) -> tuple[float, float]:
    """The bounds of the outer rounds' learned grace window (gossip.diloco.ArrivalWindow): never below the
    node's own --exchange-timeout, never above the fixed wait it replaces."""
    return exchange.exchange_timeout_s, outer_exchange(exchange).exchange_timeout_s


class DilocoAlgorithm:
    """Gossip DiLoCo steps in the daemon's loop (docs/training.md, "Gossip DiLoCo";
    node.swarm.algorithm.Algorithm). The main gossip peer (fp32) runs no rounds: it serves the anchor to
    joiners, evaluations and final merges."""

    rejoins_when_left_behind = True
    average: Average | None = None

    def __init__(self, trainer: Trainer, peer: GossipPeer, recipe: TrainingRecipe, *, transport: Transport,
                 exchange: ExchangeSettings, state: ExchangeSettings,
                 saved: Mapping[str, np.ndarray] | None = None) -> None:
        assert recipe.diloco is not None, "a DiLoCo recipe"
        self.trainer = trainer
        self.peer = peer
        self.recipe = recipe
        self.config: DilocoConfig = recipe.diloco
        self.diloco = DilocoTrainer(trainer, transport, outer_exchange(exchange), self.config, sync_schedule(recipe),
                                    state_peer=peer, state_settings=state, grace=grace_bounds(exchange))
        self.resumed_outer_state = saved is not None and self.diloco.restore(saved)
        self._started = False
        self.skipped_ahead = 0  # times the swarm left this node behind and it caught up
        self.rejoins_unbacked = 0  # times the records said so but the catch-up did not move this node on
        self._last_report: RoundReport | None = None

    async def start(self) -> None:
        """Serve the fragments' and the momentum's protocols (once)."""
        if not self._started:
            self._started = True
            await self.diloco.start()
            self.peer.round = self.diloco.stats.outer_steps

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await self.diloco.close()

    async def rejoin(self, swarm_step: int, margin: int, catch_up: Callable[[], Awaitable[None]]) -> bool:
        """Land the pending syncs, then catch up with the swarm's anchor (node.swarm.loop.SwarmLoop)."""
        before = self.trainer.step
        logger.warning("the swarm is at step %d, this node at %d (more than %d steps, the staleness bound, behind): "
                       "catching up with it", swarm_step, before, margin)
        await self.diloco.flush()
        await catch_up()
        if self.trainer.step > before + margin:
            self.skipped_ahead += 1
            return True
        self.rejoins_unbacked += 1
        return False

    def score_with(self, scorer: ContributionScorer) -> bool:
        self.diloco.score_with(scorer)
        return True

    async def record_refusals(self, view: Sequence[SwarmRecord], step: int) -> dict[str, str]:
        return {}

    async def adopt_download(self, sources: Sequence[SwarmRecord]) -> None:
        """The downloaded parameters are an anchor (what peers serve): continue from it with the outer
        momentum of the download's sources (up to MOMENTUM_SOURCES, fetched at once), combined
        coordinate-wise as the parameters are (node.swarm.joining.combine: of 3, one hostile source moves no
        coordinate beyond the honest two). A source that fails or serves one out of bounds is left out;
        none left: start without."""
        fetched = await asyncio.gather(*(self.diloco.fetch_momentum(r.peer_id)
                                         for r in sources[:MOMENTUM_SOURCES]))
        momenta = [m for m in fetched if m is not None]
        momentum = await asyncio.to_thread(combine, momenta) if momenta else None
        await self.diloco.adopt(await self.trainer.tensors(), momentum)
        logger.info("continuing from the downloaded anchor with %s", f"the outer momentum of {len(momenta)} of "
                    f"{min(len(sources), MOMENTUM_SOURCES)} sources" if momenta else "no outer momentum")

    async def moved_to(self, step: int) -> None:
        self.diloco.place_rounds()

    async def step(self, plan_for: PlanFor) -> StepReport:
        async def plan_fragment(fragment: int, round_index: int) -> PeerRound:
            """A fragment's k-th sync is gossip round k over the current view (every fragment the same graph)."""
            return await plan_for(round_index)

        final = self.recipe.steps > 0 and self.trainer.step + 1 >= self.recipe.steps
        report = await self.diloco.step(plan_fragment, final=final)
        self.peer.round = self.diloco.stats.outer_steps
        round_report = None
        for sync in report.synced:
            if sync.outcome is not None:
                distance = sync.anchor_distance if sync.anchors is not None else sync.consensus_distance
                round_report = self._last_report = RoundReport(sync.round, sync.outcome, distance)
        return StepReport(report.stats, report.step_s, round_report, passed=report.passed)

    async def publish_final(self) -> None:
        """The last step ends on the anchor, which the main peer already serves."""

    async def adopt_merged(self, merged: dict[str, Any]) -> None:
        await self.trainer.load_tensors(merged)
        self.diloco.set_anchor(merged)

    async def state(self) -> dict[str, Any]:
        return {**await self.trainer.state(), **self.diloco.state()}

    def checkpoint_meta(self) -> dict[str, str]:
        return {}

    def traffic(self) -> tuple[int, int]:
        return self.diloco.bytes_sent, self.diloco.bytes_received

    def errors(self) -> dict[str, int]:
        return self.diloco.errors()

    def skipped(self) -> dict[str, int]:
        return self.diloco.skipped()

    def show(self, status: TrainingStatus) -> None:
        status.diloco = self.diloco_status()

    def sections(self) -> dict[str, dict[str, Any]]:
        return {}

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
                "exchanges_failed": d.stats.exchanges_failed, "grace_window_s": d.grace_window_s, "skipped": d.skipped(),
                "rounds_run": d.rounds_run, "fragment_rounds": d.fragment_rounds,
                "resumed_outer_state": self.resumed_outer_state, "skipped_ahead": self.skipped_ahead,
                "rejoins_unbacked": self.rejoins_unbacked, "phase_seconds": c.phase_seconds,
                "steps_passed": d.stats.steps_passed, "last_share": d.stats.last_share}


__all__ = ["MIN_OUTER_TIMEOUT_S", "DilocoAlgorithm", "grace_bounds", "outer_exchange", "sync_schedule"]
