"""SPES training inside the daemon: the Algorithm the loop runs for a SPES recipe.

Its steps run a SpesNode (shared weights with topology neighbours, owned experts with their co-owners,
frozen copies refreshed when changed), with ownership recomputed from the membership view and capacities."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from gossip.exchange import ExchangeSettings, GossipPeer
from gossip.spes import (
    ExpertKey,
    ExpertRecord,
    Ownership,
    assign_experts,
    capped_capacities,
    expert_label,
    overclaiming_peers,
    records_from_wire,
    records_to_wire,
    version_bound,
)
from gossip.transport import Transport
from node.algorithms.spes.directory import DhtExpertDirectory
from node.algorithms.spes.node import VERSION_SLACK, SpesNode
from node.algorithms.spes.partition import ModelPartition, spes_average
from node.net.discovery import Discovery
from node.swarm.algorithm import PlanFor, StepReport
from node.swarm.contribution import ContributionScorer
from node.swarm.joining import Refused
from node.swarm.loop import TrainingStatus
from node.swarm.peers import SwarmRecord
from node.swarm.recipe import TrainingRecipe
from node.swarm.swarm_eval import Average
from node.train.trainer import Trainer, average_tensors

logger = logging.getLogger("murmur.spes")

GPU_MEMORY_SHARE = 0.9  # of the free GPU memory, what a node's SPES capacity may plan with (the rest: fragmentation)
TRAINED_BYTES = 16  # per trained parameter: fp32 value, gradient, two Adam moments
CHECKPOINT_META_KEY = "spes_records"


def spes_capacity(free_bytes: int, activation_bytes: int, shared_params: int, every_expert_params: int,
                  experts_per_layer: int, frozen_bytes: int) -> int:
    """Experts per MoE layer that fit in GPU_MEMORY_SHARE of `free_bytes` after the activations of one
    micro-batch, the shared weights (trained) and every expert held frozen (`frozen_bytes` each: 2 in
    bf16); each owned expert index then costs TRAINED_BYTES - frozen_bytes more per parameter. At least 1."""
    per_index = every_expert_params // experts_per_layer  # one expert index, in every layer
    room = GPU_MEMORY_SHARE * free_bytes - activation_bytes - TRAINED_BYTES * shared_params - frozen_bytes * every_expert_params
    return max(1, min(experts_per_layer, int(room // ((TRAINED_BYTES - frozen_bytes) * max(1, per_index)))))


async def capacity_for(trainer: Trainer, partition: ModelPartition, wanted: int | None, frozen_bf16: bool = True) -> int:
    """Experts per MoE layer this node trains: `wanted` (--experts, at most the layer's experts); else
    all of them on CPU; on CUDA as many as fit in the free GPU memory with a micro-batch's activations,
    measured (`spes_capacity`)."""
    experts = partition.experts_per_layer
    if wanted is not None:
        return min(wanted, experts)
    if trainer.device.type != "cuda":
        return experts
    sizes = {name: p.numel() for name, p in trainer.model.named_parameters()}
    shared = sum(sizes[n] for n in partition.shared)
    every_expert = sum(sizes[n] for names in partition.experts.values() for n in names)
    activations = await trainer.measure_activation_bytes()
    free, _ = torch.cuda.mem_get_info(trainer.device)
    # the model already sits on the GPU in fp32: its bytes are free for the plan
    free += 4 * (shared + every_expert)
    return spes_capacity(int(free), activations, shared, every_expert, experts, 2 if frozen_bf16 else 4)


def saved_records(meta: Mapping[str, Any] | None) -> dict[ExpertKey, ExpertRecord] | None:
    """The expert records a checkpoint carries (None if it has none or they do not parse)."""
    raw = (meta or {}).get(CHECKPOINT_META_KEY)
    if raw is None:
        return None
    try:
        return records_from_wire(json.loads(str(raw)))
    except ValueError as exc:
        logger.warning("ignoring the checkpoint's expert records: %s", exc)
        return None


class SpesAlgorithm:
    """SPES steps in the daemon's loop (docs/spes.md, "Running SPES"; node.swarm.algorithm.Algorithm).
    `self.peer` (the node's main GossipPeer) carries no SPES traffic: it serves the whole current model
    to joiners' downloads and swarm evaluations, refreshed after every sync."""

    rejoins_when_left_behind = False

    def __init__(self, trainer: Trainer, peer: GossipPeer, discovery: Discovery, recipe: TrainingRecipe, *,
                 transport: Transport, exchange: ExchangeSettings, heartbeat_s: float, ttl_s: float, swarm: str,
                 capacity: int | None, saved: Mapping[ExpertKey, ExpertRecord] | None) -> None:
        self.trainer = trainer
        self.peer = peer
        self.discovery = discovery
        self.recipe = recipe
        self._transport = transport
        assert self.recipe.spes is not None, "a SPES recipe"
        self.spes_config = self.recipe.spes
        self.partition = ModelPartition.of(self.trainer.model)
        self._wanted_capacity = capacity
        self.capacity = capacity if capacity is not None else self.partition.experts_per_layer  # set by running()
        self._exchange = exchange
        self._saved = saved
        self.directory = DhtExpertDirectory(self.discovery, swarm, heartbeat_s, ttl_s)
        self.node: SpesNode | None = None
        self.ownership_changes = 0
        self._trainable_params: int | None = None  # as of the last announcement of this node's experts

    @property
    def average(self) -> Average:
        return self.swarm_average

    def _done(self, step: int) -> bool:
        return self.recipe.steps > 0 and step >= self.recipe.steps

    def ownership_from_view(self, my_capacity: int | None = None) -> Ownership:
        """The expert table every peer with the same view computes: over the peers training now (as the
        shared topology's rounds) that announce a capacity, and this one (at `my_capacity`, default its own)."""
        me = self.peer.peer_id
        claimed = {p.peer_id: p.capacity for p in self.discovery.view()
                   if p.peer_id != me and p.capacity > 0 and not self._done(p.step)}
        claimed[me] = self.capacity if my_capacity is None else my_capacity
        capacities = capped_capacities(claimed, self.partition.experts_per_layer)
        return assign_experts(capacities, capacities, self.partition.experts_per_layer, self.partition.layers,
                              self.spes_config.replication)

    def score_with(self, scorer: ContributionScorer) -> bool:
        return False  # SPES's syncs average each expert over its owners: not scored (docs/training.md)

    async def record_refusals(self, view: Sequence[SwarmRecord], step: int) -> dict[str, str]:
        """A joiner downloads from no peer whose peer record claims a capacity above the layer's expert
        count, or whose expert records (in the directory) claim a version beyond the bound at `step`
        (the highest believable step of the swarm): `Refused.RECORD_OUT_OF_BOUNDS`. Ownership already
        caps such a capacity and refreshes drop such versions (gossip.spes.capped_capacities,
        bounded_records); a peer that makes them is lying, and its parameters are not taken either."""
        me = self.peer.peer_id
        records = {peer: entries for peer, entries in (await self.directory.read()).items() if peer != me}
        over = overclaiming_peers({p.peer_id: p.capacity for p in view if p.peer_id != me}, records,
                                  self.partition.experts_per_layer,
                                  version_bound(step, self.spes_config.sync_every, VERSION_SLACK))
        return dict.fromkeys(sorted(over), str(Refused.RECORD_OUT_OF_BOUNDS))

    async def start(self) -> None:
        pass

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Start the SpesNode (once), then let the loop train while the directory keeps this node's
        records stored. A training failure propagates as itself, not wrapped in a group."""
        failure: Exception | None = None
        async with asyncio.TaskGroup() as group:
            keeper = group.create_task(self.directory.run())
            try:
                if self.node is None:
                    self.capacity = await capacity_for(self.trainer, self.partition, self._wanted_capacity,
                                                       self.spes_config.frozen_bf16)
                    logger.info("SPES: this node trains %d of %d experts per MoE layer", self.capacity,
                                self.partition.experts_per_layer)
                    # Start owning what the swarm cannot do without (nothing, unless others lack room), then
                    # take up this node's share at the first step through set_ownership, which continues
                    # each expert from the freshest copy in the swarm; and announce the capacity only now,
                    # so that others give this node experts once it serves them.
                    self.node = SpesNode(self.trainer, self._transport, self._exchange, self.spes_config,
                                         self.ownership_from_view(my_capacity=0), self.directory)
                    await self.node.start(self._saved)
                    self._announce_ownership()
                yield
            except Exception as exc:
                failure = exc
            finally:
                keeper.cancel()
        if failure is not None:
            raise failure

    async def step(self, plan_for: PlanFor) -> StepReport:
        assert self.node is not None
        started = time.perf_counter()
        ownership = self.ownership_from_view()
        if dict(ownership.owners) != dict(self.node.ownership.owners):
            await self.node.set_ownership(ownership)
            self.ownership_changes += 1
            self._announce_ownership()
            logger.info("SPES ownership over %d peers: this node owns experts %s", len(ownership.peer_ids),
                        _indices(self.node.owned))
        report = await self.node.step(plan_for)
        if report.sync is not None:
            self.peer.round = report.sync.sync_index
            self.peer.set_tensors(await self.trainer.tensors(), step=self.trainer.step)
        return StepReport(report.stats, time.perf_counter() - started)

    async def rejoin(self, swarm_step: int, margin: int, catch_up: Callable[[], Awaitable[None]]) -> bool:
        before = self.trainer.step
        await catch_up()
        return self.trainer.step > before + margin

    async def adopt_download(self, sources: Sequence[SwarmRecord]) -> None:
        pass

    async def moved_to(self, step: int) -> None:
        pass

    async def publish_final(self) -> None:
        self.peer.set_tensors(await self.trainer.tensors(), step=self.trainer.step)

    async def adopt_merged(self, merged: dict[str, Any]) -> None:
        await self.trainer.load_tensors(merged)

    async def state(self) -> dict[str, Any]:
        return await self.trainer.state()

    def traffic(self) -> tuple[int, int]:
        node = self.node
        return (node.bytes_sent, node.bytes_received) if node is not None else (0, 0)

    def errors(self) -> dict[str, int]:
        return {}

    def skipped(self) -> dict[str, int]:
        return {}  # the shared weights' rounds run on the main peer; expert fetches count in the spes section

    def show(self, status: TrainingStatus) -> None:
        # SPES trains only the shared weights and this node's experts; they change with the ownership
        if self._trainable_params is not None:
            status.trainable_params = self._trainable_params

    def _announce_ownership(self) -> None:
        assert self.node is not None
        self.discovery.update(experts=_indices(self.node.owned), capacity=self.capacity)
        sizes = {name: p.numel() for name, p in self.trainer.model.named_parameters()}
        self._trainable_params = sum(sizes[n] for n in self.trainer.trainable_parameter_names)

    def swarm_average(self, members: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """The SPES swarm average of `members` (peer id -> full model) for the swarm evaluation: shared
        weights over every member, each expert over its owners in the current table."""
        if self.node is None:  # not training yet: no ownership to go by
            return average_tensors(list(members.values()))
        return spes_average(members, self.node.ownership, self.partition)

    def checkpoint_meta(self) -> dict[str, str]:
        if self.node is None:
            return {CHECKPOINT_META_KEY: json.dumps(records_to_wire(self._saved))} if self._saved else {}
        return {CHECKPOINT_META_KEY: json.dumps(records_to_wire(self.node.records()))}

    def sections(self) -> dict[str, dict[str, Any]]:
        return {"spes": self.spes_status()}

    def spes_status(self) -> dict[str, Any]:
        """The `spes` section of the node's status (docs/spes.md, "Running SPES")."""
        node = self.node
        base: dict[str, Any] = {"capacity": self.capacity, "experts_per_layer": self.partition.experts_per_layer,
                                "layers": self.partition.layers, "replication": self.spes_config.replication}
        if node is None:
            return {**base, "started": False}
        owner_of = {name: key for key, names in self.partition.experts.items() for name in names}
        optimizer_experts = {owner_of[n] for n in self.trainer.optimizer_parameter_names if n in owner_of}
        errors = node.errors
        for kind, n in self.directory.errors.items():
            errors[kind] = errors.get(kind, 0) + n
        return {
            **base, "started": True,
            "owned": [expert_label(k) for k in sorted(node.owned)],
            "owned_experts": _indices(node.owned),
            "optimizer_experts": [expert_label(k) for k in sorted(optimizer_experts)],
            "owners": {str(e): list(node.ownership.owners[(0, e)]) for e in range(self.partition.experts_per_layer)},
            "peers": list(node.ownership.peer_ids),
            "records": {expert_label(k): [r.version, r.owner] for k, r in sorted(node.records().items())},
            "ownership_changes": self.ownership_changes,
            "bytes_sent": node.bytes_sent, "bytes_received": node.bytes_received,
            "fetched": node.fetch_stats.fetched, "served": node.fetch_stats.served,
            "skipped": dict(node.fetch_stats.skipped), "errors": errors, "clipped": node.clipped,
            "refused": node.refused,
        }


def _indices(keys: frozenset[ExpertKey]) -> list[int]:
    """Expert indices (a node owns the same ones in every layer)."""
    return sorted({e for _, e in keys})


__all__ = ["SpesAlgorithm", "capacity_for", "saved_records", "spes_capacity"]
