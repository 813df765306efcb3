"""Contribution scoring on a node: every `score_every`-th round, the held-out loss at the node's last mix
against the loss there moved toward each neighbour's value by its weight, and toward the node's own update
(the yardstick), measured in the background on the trainer's worker; and the ratings (gossip.scoring) that
scale each neighbour's weight in later rounds. Rounds whose values are not parameters (gossip DiLoCo's
pseudo-gradients) say how to turn them into parameters first (`ValuesOf`, `ContributionScorer.weigh_with`).

docs/training.md ("Contribution scoring") gives the knobs and the cost; docs/threat-model.md what it bounds."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import msgspec
import numpy as np

from gossip.scoring import ContributionRatings, ScoreState, ScoringSettings

logger = logging.getLogger("murmur.scoring")

Tensors = Mapping[str, np.ndarray]

BUDGET_S = 30.0  # the most worker time one scored round takes; neighbours not reached by then go unrated
# neighbours scored in one round at most: bounds the work, and the copies of their values held until it is
# done (with the node's own and its base, MAX_SCORED + 2 copies of the parameters)
MAX_SCORED = 4


# What a scored round measures, from what the round holds (own, base, received): the parameters to measure
# from, the node's own value and each neighbour's, as parameters; None: nothing to measure (no own update).
# A value may hold some of the parameters only (a DiLoCo fragment's): the others stay at the base's.
Measured = tuple[Tensors, Tensors, dict[str, Tensors]]
ValuesOf = Callable[[Tensors, "Tensors | None", Mapping[str, Tensors]], "Measured | None"]


def parameters_as_given(own: Tensors, base: Tensors | None, received: Mapping[str, Tensors]) -> Measured | None:
    """Dense gossip: the round's values are parameters, measured from the last mix."""
    return None if base is None else (base, own, dict(received))


class MovedLosses(Protocol):
    """node.train.trainer.Trainer.moved_losses."""

    async def moved_losses(self, own: Tensors, toward: Sequence[tuple[Tensors, float]], sequences: int,
                           budget_s: float) -> tuple[float, list[float]]: ...


class ContributionScorer:
    """A GossipPeer's judge (gossip.exchange.Judge): starts scoring a scored round's neighbours in the
    background (one scoring at a time: a scored round that finds one running, or that has no update of
    the node's own to compare with, is not scored) and answers each neighbour's weight factor from the
    ratings so far. `close()` cancels a scoring that runs."""

    def __init__(self, trainer: MovedLosses, settings: ScoringSettings, *, budget_s: float = BUDGET_S) -> None:
        self._trainer = trainer
        self.settings = settings
        self.ratings = ContributionRatings(settings)
        self._sequences = settings.score_sequences
        self._budget_s = budget_s
        self._running: asyncio.Task[None] | None = None
        self.scored_rounds = 0
        self.last_scoring_s = 0.0  # wall time of the last scored round's measuring (docs/training.md's cost)

    @property
    def busy(self) -> bool:
        return self._running is not None and not self._running.done()

    def weigh(self, round_index: int, own: Tensors, base: Tensors | None, received: Mapping[str, Tensors],
              weights: Mapping[str, float]) -> dict[str, float]:
        """gossip.exchange.Judge, for rounds of parameters (D-SGD, DAdam)."""
        if base is None:  # no own update to compare with: not scored
            return self.factors(received)
        return self.weigh_with(parameters_as_given, round_index, own, base, received, weights)

    def weigh_with(self, values: ValuesOf, round_index: int, own: Tensors, base: Tensors | None,
                   received: Mapping[str, Tensors], weights: Mapping[str, float]) -> dict[str, float]:
        """Score a scored round's neighbours in the background, their values turned into parameters by
        `values` (on a thread, as the scoring starts); answer each one's weight factor."""
        if self.settings.scored(round_index) and not self.busy:
            peers = [p for p in sorted(received) if weights.get(p, 0.0) > 0.0]
            if len(peers) > MAX_SCORED:  # a different few each scored round, so every neighbour is rated in turn
                turn = (round_index // self.settings.score_every) * MAX_SCORED % len(peers)
                peers = (peers[turn:] + peers[:turn])[:MAX_SCORED]
            if peers:
                self._running = asyncio.create_task(
                    self._score(round_index, values, own, base, {p: received[p] for p in peers},
                                {p: float(weights[p]) for p in peers}),
                    name=f"contribution scoring of round {round_index}")
        return self.factors(received)

    def factors(self, received: Mapping[str, object]) -> dict[str, float]:
        """Each neighbour's weight factor from its rating so far."""
        return {peer: self.ratings.factor(peer) for peer in received}

    async def _score(self, round_index: int, values: ValuesOf, own: Tensors, base: Tensors | None,
                     received: Mapping[str, Tensors], weights: Mapping[str, float]) -> None:
        """Measure from the base (the last mix): the loss there, moved toward our own update by the
        neighbours' mean weight, and toward each neighbour's value by its weight; then rate the neighbours."""
        started = time.monotonic()
        own_weight = sum(weights.values()) / len(weights)
        limit = self._budget_s * 2 + 10.0  # the worker may be in a step first
        try:
            measured = await asyncio.to_thread(values, own, base, received)
            if measured is None:
                return
            base_value, own_value, theirs = measured
            peers = list(theirs)
            toward = [(own_value, own_weight), *((theirs[p], weights[p]) for p in peers)]
            async with asyncio.timeout(limit):
                loss, losses = await self._trainer.moved_losses(base_value, toward, self._sequences, self._budget_s)
        except TimeoutError:
            logger.warning("contribution scoring of round %d took over %g s; not rated", round_index, limit)
            return
        except Exception as exc:  # a scoring never stops training: the round's mix is done already
            logger.warning("contribution scoring of round %d failed: %s: %s", round_index, type(exc).__name__, exc)
            return
        self.last_scoring_s = time.monotonic() - started
        if len(losses) < 2:
            return
        self.scored_rounds += 1
        gains = {peer: loss - moved for peer, moved in zip(peers, losses[1:], strict=False)}
        before = {peer: self.ratings.state(peer) for peer in gains}
        self.ratings.rate(loss - losses[0], gains, weights, own_weight)
        scores = self.ratings.scores()
        for peer, was in before.items():
            now = scores[peer].state if peer in scores else was
            if now is not was:
                log = logger.warning if now is ScoreState.EXCLUDED else logger.info
                log("contribution of %s: %s -> %s (score %.2f after %d ratings)", peer, was, now,
                    scores[peer].score, scores[peer].rated_rounds)

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
