"""The seam between the one loop (node.swarm.loop.SwarmLoop) and what a swarm trains with.

The loop owns catch-up, quorum, laggards, evaluation, checkpoints and the final merge; an `Algorithm`
(D-SGD or DAdam, gossip DiLoCo, SPES: node.algorithms) owns its steps, its protocols and its part of the status."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from gossip.exchange import RoundOutcome
from node.swarm.peers import SwarmRecord
from node.swarm.swarm_eval import Average
from node.train.trainer import StepStats
from topology import PeerRound

if TYPE_CHECKING:
    from node.swarm.contribution import ContributionScorer
    from node.swarm.loop import TrainingStatus

# Round index -> this peer's plan for it, returned when the round may start: the daemon waits for its
# round clock and reads the membership view; an in-process test may wait on a barrier.
PlanFor = Callable[[int], Awaitable[PeerRound]]


@dataclass(frozen=True)
class RoundReport:
    index: int
    outcome: RoundOutcome
    consensus_distance: float | None  # ||x_i - mean of the neighbour values that arrived||_2


@dataclass(frozen=True)
class StepReport:
    stats: StepStats
    step_s: float  # wall time of the whole step, exchange included
    round: RoundReport | None = None
    val_loss: float | None = None
    # the step was passed over, not trained (gossip DiLoCo's wall-clock phases): no loss, no tokens
    passed: bool = False


class Algorithm(Protocol):
    """How one node trains with the swarm, between the loop's catch-up, evaluations and checkpoints."""

    # DiLoCo: a node that fell more than the staleness bound behind mixes with no one again, so the
    # loop re-joins it (see SwarmLoop._rejoin_if_left_behind); a per-step algorithm's rounds wait instead
    @property
    def rejoins_when_left_behind(self) -> bool: ...

    @property
    def average(self) -> Average | None:
        """How the swarm evaluation combines peers' models; None: uniformly."""
        ...

    async def start(self) -> None:
        """Serve the protocols a catch-up already needs (DiLoCo's outer momentum); once, whoever calls first."""
        ...

    def running(self) -> AbstractAsyncContextManager[None]:
        """Held while the loop trains: what runs beside the steps (SPES's expert directory) starts on
        entry, and every protocol this algorithm serves closes on exit. A failure inside propagates as itself."""
        ...

    async def step(self, plan_for: PlanFor) -> StepReport:
        """One optimizer step, with whatever exchange follows it; `plan_for` gives a round's neighbours."""
        ...

    async def rejoin(self, swarm_step: int, margin: int, catch_up: Callable[[], Awaitable[None]]) -> bool:
        """The swarm, at `swarm_step`, left this node more than `margin` steps behind: land what is in
        flight and `catch_up` (as a joiner does); whether that moved this node more than `margin` steps on
        (what the records claimed was backed by what its downloads found). Called only where
        `rejoins_when_left_behind`."""
        ...

    def score_with(self, scorer: ContributionScorer) -> bool:
        """Rate what each neighbour's updates do to this node's held-out loss in this algorithm's rounds, and
        weigh the neighbours by their ratings (node.swarm.contribution); whether this algorithm does. Called
        before `start`."""
        ...

    async def record_refusals(self, view: Sequence[SwarmRecord], step: int) -> dict[str, str]:
        """Peers of `view` a catch-up takes nothing from, whatever their step, by what their records claim
        of a swarm whose believable steps go up to `step`: peer -> reason (a node.swarm.joining.Refused)."""
        ...

    async def adopt_download(self, sources: Sequence[SwarmRecord]) -> None:
        """What else a node takes from the swarm after a catch-up installed downloaded parameters (DiLoCo:
        the outer momentum); `sources` are the peers it downloaded from, best first."""
        ...

    async def moved_to(self, step: int) -> None:
        """The trainer's step was moved on to `step` after adopt_download (the swarm trained on while this
        node fetched what it adopts): place whatever follows the step (DiLoCo: its fragments' rounds)."""
        ...

    async def publish_final(self) -> None:
        """Offer the final parameters on the main gossip peer, once the step budget is spent."""
        ...

    async def adopt_merged(self, merged: dict[str, Any]) -> None:
        """Continue from (serve, checkpoint) the final merge's model."""
        ...

    async def state(self) -> dict[str, Any]:
        """What the checkpoint holds: the trainer's state and this algorithm's own."""
        ...

    def checkpoint_meta(self) -> dict[str, str]:
        """What the checkpoint carries beyond its tensors (SPES: the expert records)."""
        ...

    def show(self, status: TrainingStatus) -> None:
        """Put this algorithm's figures into the `training` section: after every step and when it is read."""
        ...

    def sections(self) -> dict[str, dict[str, Any]]:
        """Top-level sections of the node's status this algorithm fills (SPES: `spes`)."""
        ...

    def traffic(self) -> tuple[int, int]:
        """Bytes sent and received on this algorithm's protocols besides the main gossip peer's."""
        ...

    def errors(self) -> dict[str, int]:
        """Refused input counted on this algorithm's protocols besides the main gossip peer's."""
        ...

    def skipped(self) -> dict[str, int]:
        """Neighbours left out of this algorithm's rounds besides the main gossip peer's, by reason."""
        ...
