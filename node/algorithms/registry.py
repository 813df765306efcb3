"""Which Algorithm a swarm trains with, by name.

The runtime looks its recipe's up here instead of branching on it; a new algorithm is one entry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the builders import their algorithm (torch, a model's code) only when it is picked
    from gossip.exchange import ExchangeSettings, GossipPeer
    from gossip.transport import Transport
    from node.net.discovery import Discovery
    from node.swarm.algorithm import Algorithm
    from node.swarm.recipe import TrainingRecipe
    from node.train.checkpoint import Checkpoint
    from node.train.trainer import Trainer


@dataclass(frozen=True)
class AlgorithmContext:
    """Everything a builder may take: the node's parts and settings, and what it resumes from."""

    trainer: Trainer
    peer: GossipPeer  # the main gossip peer: downloads, evaluations, final merges (and D-SGD's rounds)
    discovery: Discovery
    transport: Transport
    recipe: TrainingRecipe
    exchange: ExchangeSettings  # the swarm's exchange settings
    peer_exchange: ExchangeSettings  # the main peer's (DiLoCo's: lossless)
    resumed: Checkpoint | None  # this node's checkpoint when it is of this swarm's config, else None
    swarm: str
    heartbeat_s: float
    record_ttl_s: float
    experts: int | None  # --experts: experts per MoE layer this node trains (None: as many as fit)


@dataclass(frozen=True)
class Entry:
    label: str  # how a startup error names it: "cannot train the swarm's model with <label> here"
    build: Callable[[AlgorithmContext], Algorithm]  # raises ValueError where the model does not fit it


def _dsgd(c: AlgorithmContext) -> Algorithm:
    from node.algorithms.dsgd import DsgdAlgorithm

    return DsgdAlgorithm(c.trainer, c.peer, c.recipe)


def _diloco(c: AlgorithmContext) -> Algorithm:
    from node.algorithms.diloco.swarm import DilocoAlgorithm

    return DilocoAlgorithm(c.trainer, c.peer, c.recipe, transport=c.transport, exchange=c.exchange,
                           state=c.peer_exchange, saved=c.resumed.tensors if c.resumed is not None else None)


def _spes(c: AlgorithmContext) -> Algorithm:
    from node.algorithms.spes.swarm import SpesAlgorithm, saved_records

    return SpesAlgorithm(c.trainer, c.peer, c.discovery, c.recipe, transport=c.transport, exchange=c.exchange,
                         heartbeat_s=c.heartbeat_s, ttl_s=c.record_ttl_s, swarm=c.swarm, capacity=c.experts,
                         saved=saved_records(c.resumed.meta) if c.resumed is not None else None)


ALGORITHMS: dict[str, Entry] = {
    "dsgd": Entry("D-SGD", _dsgd),
    "dadam": Entry("DAdam", _dsgd),
    "diloco": Entry("gossip DiLoCo", _diloco),
    "spes": Entry("SPES", _spes),
}


def algorithm_name(recipe: TrainingRecipe) -> str:
    """A SPES recipe trains with SPES (its optimizer steps the shared weights); any other with its optimizer."""
    return "spes" if recipe.spes is not None else recipe.optimizer.algorithm


__all__ = ["ALGORITHMS", "AlgorithmContext", "Entry", "algorithm_name"]
