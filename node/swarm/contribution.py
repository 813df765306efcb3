"""Contribution scoring on a node: every `score_every`-th round, the held-out loss of this node's own
parameters against that of each neighbour's value mixed in with its weight, measured in the background
on the trainer's worker, and the ratings (gossip.scoring) that scale each neighbour's weight in later rounds.

docs/training.md ("Contribution scoring") gives the knobs and the cost; docs/threat-model.md what it bounds."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any, Protocol

import msgspec
import numpy as np

from gossip.scoring import ContributionRatings, ScoreState, ScoringSettings

logger = logging.getLogger("murmur.scoring")

Tensors = Mapping[str, np.ndarray]

HELD_OUT_BATCHES = 1  # validation batches per loss: the same fixed batch every time, on every node
BUDGET_S = 30.0  # the most worker time one scored round takes; neighbours not reached by then go unrated
MAX_SCORED = 16  # neighbours scored in one round at most (the first by id): bounds the work per round


class MovedLosses(Protocol):
    """node.train.trainer.Trainer.moved_losses."""

    async def moved_losses(self, own: Tensors, toward: Mapping[str, tuple[Tensors, float]], batches: int,
                           budget_s: float) -> tuple[float, dict[str, float]]: ...


class ContributionScorer:
    """A GossipPeer's judge (gossip.exchange.Judge): starts scoring a scored round's neighbours in the
    background (one scoring at a time: a scored round that finds one running is not scored) and answers
    each neighbour's weight factor from the ratings so far. `close()` cancels a scoring that runs."""

    def __init__(self, trainer: MovedLosses, settings: ScoringSettings, *, batches: int = HELD_OUT_BATCHES,
                 budget_s: float = BUDGET_S) -> None:
        self._trainer = trainer
        self.settings = settings
        self.ratings = ContributionRatings(settings)
        self._batches = batches
        self._budget_s = budget_s
        self._running: asyncio.Task[None] | None = None
        self.scored_rounds = 0
        self.last_scoring_s = 0.0  # worker time of the last scored round (docs/training.md's cost)

    @property
    def busy(self) -> bool:
        return self._running is not None and not self._running.done()

    def weigh(self, round_index: int, own: Tensors, received: Mapping[str, Tensors],
              weights: Mapping[str, float]) -> dict[str, float]:
        if self.settings.scored(round_index) and not self.busy:
            toward = {p: (received[p], float(weights[p])) for p in sorted(received)[:MAX_SCORED] if p in weights}
            if toward:
                self._running = asyncio.create_task(self._score(round_index, own, toward),
                                                    name=f"contribution scoring of round {round_index}")
        return {peer: self.ratings.factor(peer) for peer in received}

    async def _score(self, round_index: int, own: Tensors, toward: Mapping[str, tuple[Tensors, float]]) -> None:
        started = time.monotonic()
        try:
            async with asyncio.timeout(self._budget_s * 2 + 10.0):  # the worker may be in a step first
                base, losses = await self._trainer.moved_losses(own, toward, self._batches, self._budget_s)
        except TimeoutError:
            logger.warning("contribution scoring of round %d took over %g s; not rated", round_index,
                           self._budget_s * 2 + 10.0)
            return
        except Exception as exc:  # a scoring never stops training: the round's mix is done already
            logger.warning("contribution scoring of round %d failed: %s: %s", round_index, type(exc).__name__, exc)
            return
        self.last_scoring_s = time.monotonic() - started
        self.scored_rounds += 1
        before = {peer: self.ratings.state(peer) for peer in losses}
        self.ratings.rate({peer: base - loss for peer, loss in losses.items()})
        for peer, was in before.items():
            now = self.ratings.state(peer)
            if now is not was:
                log = logger.warning if now is ScoreState.EXCLUDED else logger.info
                log("contribution of %s: %s -> %s (score %.2f after %d ratings)", peer, was, now,
                    self.ratings.scores()[peer].score, self.ratings.scores()[peer].rated_rounds)

    async def wait_idle(self) -> None:
        """Wait for a scoring that runs (tests)."""
        if self._running is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._running

    async def close(self) -> None:
        if self._running is not None and not self._running.done():
            self._running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._running

    def status(self) -> dict[str, dict[str, Any]]:
        """The status document's `contribution`: peer id -> {score, rated_rounds, state}."""
        scores: dict[str, dict[str, Any]] = msgspec.to_builtins(self.ratings.scores())
        return scores
