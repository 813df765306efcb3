"""SPES on a node: train the shared weights and the owned experts only, and sync sparsely over the
gossip transport — shared weights with topology neighbours, owned experts with their co-owners,
frozen expert copies fetched from an owner only when the owner's published hash changed.

The rules (ownership, records, merge warm-up, traffic) and the fetch protocol are gossip.spes; this
module applies them to a `Trainer` and a `Transport`. The daemon drives a `SpesNode` (see docs/spes.md, "Running SPES").
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch
from torch import nn

from gossip.codecs import get_codec
from gossip.diloco import OuterNesterov
from gossip.exchange import ExchangeSettings, GossipPeer, RoundOutcome
from gossip.spes import (
    EXPERT,
    FETCH,
    FETCH_PROTOCOL,
    ExpertFetch,
    ExpertKey,
    ExpertRecord,
    FetchSkip,
    FetchStats,
    Ownership,
    RecordsByPeer,
    RefreshFailed,
    ServedCopy,
    SpesConfig,
    advance_record,
    bounded_records,
    codec_image,
    content_hash,
    expert_label,
    freshest_holder,
    merge_layer,
    needs_refresh,
    refresh_source,
    version_bound,
)
from gossip.transport import Transport
from node.algorithms.outer_group import GroupSync, OuterGroup
from node.algorithms.spes.partition import ModelPartition, optimizer_state_covers, spes_average, tensor_manifest
from node.swarm.algorithm import PlanFor
from node.train.models.experts import moe_expert_lists
from node.train.trainer import StepStats, Tensors, Trainer
from topology import PeerRound

logger = logging.getLogger(__name__)

SHARED_PROTOCOL = "/murmur/spes/shared/1"
SHARED_ANCHOR_PROTOCOL = "/murmur/spes/shared/anchor/1"
# syncs beyond this node's own sync index that a believable expert version may be (gossip.spes.version_bound)
VERSION_SLACK = 64


def expert_protocol(key: ExpertKey) -> str:
    """The protocol on which the owners of one expert mix its pseudo-gradient (one OuterGroup per owned expert)."""
    return f"/murmur/spes/expert/{expert_label(key)}/1"


def expert_anchor_protocol(key: ExpertKey) -> str:
    """The protocol on which the owners of one expert mix its anchor (with the defaults: its weights)."""
    return f"/murmur/spes/expert/{expert_label(key)}/anchor/1"


class ExpertDirectory(Protocol):
    """Where peers publish their expert records: the DHT key `<swarm>.experts` (one subkey per peer)
    in the daemon, `InMemoryExpertDirectory` in-process."""

    async def publish(self, peer_id: str, records: Mapping[ExpertKey, ExpertRecord]) -> None: ...

    async def read(self) -> RecordsByPeer: ...


class InMemoryExpertDirectory:
    """The directory for peers in one process (tests, benchmarks): the latest records per peer."""

    def __init__(self) -> None:
        self._records: dict[str, dict[ExpertKey, ExpertRecord]] = {}

    async def publish(self, peer_id: str, records: Mapping[ExpertKey, ExpertRecord]) -> None:
        self._records[peer_id] = dict(records)

    async def read(self) -> RecordsByPeer:
        return {peer: dict(records) for peer, records in self._records.items()}

    def withdraw(self, peer_id: str) -> None:
        """Forget a peer's records, as its DHT record expiring does."""
        self._records.pop(peer_id, None)


def install_expert_casts(model: nn.Module) -> None:
    """Let experts whose weights are stored in another dtype (bf16 frozen copies) run inside a float32
    model: the expert computes in its weights' dtype and hands back the caller's dtype. Idempotent."""
    for _, experts in moe_expert_lists(model):
        for expert in experts:
            if getattr(expert, "_spes_casts", False):
                continue
            expert.register_forward_pre_hook(_cast_input)
            expert.register_forward_hook(_cast_output)
            expert._spes_casts = True  # type: ignore[assignment]  # torch types Module attributes as Tensor | Module


def _cast_input(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
    (x,) = args
    weight_dtype = next(module.parameters()).dtype
    module._spes_input_dtype = x.dtype  # type: ignore[assignment]  # as above
    if x.dtype == weight_dtype or torch.is_autocast_enabled(x.device.type):
        return None
    return (x.to(weight_dtype),)


def _cast_output(module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor | None:
    wanted = getattr(module, "_spes_input_dtype", output.dtype)
    return None if output.dtype == wanted or torch.is_autocast_enabled(output.device.type) else output.to(wanted)


@dataclass(frozen=True)
class SyncReport:
    sync_index: int
    step: int
    shared: RoundOutcome
    experts: Mapping[ExpertKey, RoundOutcome]  # owned experts mixed with co-owners (their main round)
    merge_alpha: float  # 0.0: no merge in this sync
    refreshed: tuple[ExpertKey, ...]  # frozen copies fetched
    refresh_skipped: Mapping[ExpertKey, str]  # frozen copies that could not be refreshed, and why
    duration_s: float


@dataclass(frozen=True)
class SpesStepReport:
    stats: StepStats
    sync: SyncReport | None = None


class SpesNode:
    """One node of SPES training: its trainer, its view of ownership, its records, and the gossip
    peers and fetch protocol it syncs over. The daemon calls `start`, then `set_ownership` whenever
    the membership view (or a capacity) changes, `step` (or `sync` after its own steps) and
    publishes `records()` under `<swarm>.experts`; see docs/spes.md."""

    def __init__(self, trainer: Trainer, transport: Transport, settings: ExchangeSettings, config: SpesConfig,
                 ownership: Ownership, directory: ExpertDirectory, *, version_slack: int = VERSION_SLACK) -> None:
        self.trainer = trainer
        self.config = config
        self.partition = ModelPartition.of(trainer.model)
        if (ownership.layers, ownership.experts_per_layer) != (self.partition.layers, self.partition.experts_per_layer):
            raise ValueError(f"ownership covers {ownership.layers} layers x {ownership.experts_per_layer} experts, "
                             f"the model has {self.partition.layers} x {self.partition.experts_per_layer}")
        self._transport = transport
        self._settings = settings
        self._ownership = ownership
        self._directory = directory
        self._fetcher = ExpertFetch(transport, settings, config.refresh_codec, lambda: self.trainer.step,
                                    deltas=config.delta_refresh)
        self._records: dict[ExpertKey, ExpertRecord] = {}
        self._snapshots: dict[ExpertKey, dict[str, np.ndarray]] = {}  # owned experts as last published
        # delta refreshes: owned expert -> (hash of the copy published before, the delta from it as served)
        self._deltas: dict[ExpertKey, tuple[str, dict[str, np.ndarray]]] = {}
        self._published_from: dict[ExpertKey, str] = {}  # hash of the weights a published copy was made from
        self._outer = OuterNesterov(config.outer_lr, config.outer_momentum)
        self._shared: OuterGroup | None = None
        self._expert_groups: dict[ExpertKey, OuterGroup] = {}
        self._owned: frozenset[ExpertKey] = frozenset()
        self._version_slack = version_slack
        self._warned: set[str] = set()  # peers whose out-of-bounds versions were logged (each one is counted)

    @property
    def peer_id(self) -> str:
        return self._transport.peer_id

    @property
    def fetch_stats(self) -> FetchStats:
        return self._fetcher.stats

    @property
    def ownership(self) -> Ownership:
        return self._ownership

    @property
    def owned(self) -> frozenset[ExpertKey]:
        return self._owned

    def records(self) -> dict[ExpertKey, ExpertRecord]:
        """This node's record of every expert copy it holds (what it publishes)."""
        return dict(self._records)

    def _gossip_peers(self) -> list[GossipPeer]:
        groups = [self._shared, *self._expert_groups.values()]
        return [peer for group in groups if group is not None for peer in group.peers]

    @property
    def bytes_sent(self) -> int:
        return self.fetch_stats.bytes_sent + sum(p.stats.bytes_sent for p in self._gossip_peers())

    @property
    def bytes_received(self) -> int:
        return self.fetch_stats.bytes_received + sum(p.stats.bytes_received for p in self._gossip_peers())

    @property
    def clipped(self) -> int:
        """Neighbour values the shared and expert peers mixed after clipping (gossip.robust)."""
        return sum(p.stats.clipped for p in self._gossip_peers())

    @property
    def errors(self) -> dict[str, int]:
        """Refused input by kind: the fetch protocol's and every gossip peer's (shared and experts)."""
        return self._summed("errors")

    @property
    def refused(self) -> dict[str, int]:
        """Requests refused for their rate or timing, by reason: the fetch protocol's and every gossip peer's."""
        return self._summed("refused")

    def _summed(self, counter: str) -> dict[str, int]:
        total: collections.Counter[str] = collections.Counter(getattr(self.fetch_stats, counter))
        for peer in self._gossip_peers():
            total.update(getattr(peer.stats, counter))
        return dict(total)

    # ---- set-up and ownership ------------------------------------------------------------------------

    async def start(self, saved: Mapping[ExpertKey, ExpertRecord] | None = None) -> None:
        """Record every expert copy, serve the shared and fetch protocols, and take up the initial
        ownership (freezing the other experts). A copy keeps its version from `saved` (the records
        checkpointed with the parameters) when its content still hashes the same; otherwise it is
        version 0, the oldest, so a restarted node never passes off an old copy as fresh."""
        if self.config.frozen_bf16:
            install_expert_casts(self.trainer.model)
        tensors = await self.trainer.tensors()
        bound = self.version_bound()
        for key, names in self.partition.experts.items():
            image = codec_image([tensors[n] for n in names], self.config.image_codec)
            digest = content_hash(image)
            old = (saved or {}).get(key)
            kept = old is not None and old.hash == digest and old.version <= bound
            self._records[key] = ExpertRecord(old.version if old is not None and kept else 0, digest, False)
        self._shared = self._group("shared", self.partition.shared, SHARED_PROTOCOL, SHARED_ANCHOR_PROTOCOL)
        await self._shared.start(tensors, self.trainer.step, 0)
        await self._fetcher.serve(self)
        await self.set_ownership(self._ownership, force=True)

    def _group(self, group: str, names: tuple[str, ...], protocol: str, anchor_protocol: str) -> OuterGroup:
        # the config hash names the tensor group, so a message for another group is refused as such
        codec = get_codec(self.config.shared_codec if group == "shared" else self.config.expert_codec)
        settings = replace(self._settings, config_hash=f"{self._settings.config_hash}/{group}", codec=codec)
        return OuterGroup(self._transport, settings, codec, tuple(names), protocol=protocol,
                          anchor_protocol=anchor_protocol, outer=self._outer, anchor_every=self.config.anchor_every)

    async def set_ownership(self, ownership: Ownership, *, force: bool = False) -> None:
        """Adopt a new ownership (after the view changed). An expert this node now owns continues
        from the freshest copy any live peer published, fetched if it is not this node's own; the
        experts it no longer owns become frozen copies. Then it trains shared + owned only."""
        if (ownership.layers, ownership.experts_per_layer) != (self.partition.layers, self.partition.experts_per_layer):
            raise ValueError("new ownership does not match the model's MoE layers")
        owned = ownership.owned_by(self.peer_id)
        gained = owned - self._owned
        lost = self._owned - owned
        self._ownership = ownership
        if gained and not force:
            published = await self._read_directory()
            await self._take_over(gained, published, ownership.peer_ids)
        elif gained:
            await self._claim(gained)
        for key in lost:
            self._records[key] = replace(self._records[key], owner=False)
            self._snapshots.pop(key, None)
            self._deltas.pop(key, None)
            self._published_from.pop(key, None)
        if gained:
            # an expert taken up continues from its current values: they are its anchor
            current = await self.trainer.tensors(self.partition.names_of(gained))
            for key in gained:
                group = self._expert_groups.get(key)
                if group is not None:
                    group.anchor = {n: current[n] for n in self.partition.experts[key]}
                    group.reset_residuals()
        self._owned = owned
        trainable = set(self.partition.shared) | set(self.partition.names_of(owned))
        await self.trainer.set_trainable(trainable.__contains__,
                                         torch.bfloat16 if self.config.frozen_bf16 else None)
        await self._directory.publish(self.peer_id, self._records)

    async def _claim(self, keys: frozenset[ExpertKey]) -> None:
        """Own `keys` from this node's copies, keeping their versions."""
        tensors = await self.trainer.tensors(self.partition.names_of(keys))
        for key in keys:
            names = self.partition.experts[key]
            image = codec_image([tensors[n] for n in names], self.config.image_codec)
            self._snapshots[key] = dict(zip(names, image))
            # a copy stored in bf16 may hash differently from what it was fetched as; its version stays,
            # so a stale copy never looks fresher than it is
            self._records[key] = ExpertRecord(self._records[key].version, content_hash(image), True)

    async def _take_over(self, keys: frozenset[ExpertKey], published: RecordsByPeer, live: tuple[str, ...]) -> None:
        records = {**published, self.peer_id: self._records}
        fetched: dict[str, np.ndarray] = {}
        mine = set(keys)
        for key in sorted(keys):
            best = freshest_holder(key, records, live)
            if best is None or best[0] == self.peer_id or best[1].version <= self._records[key].version:
                continue
            try:
                tensors, record = await self._fetch(best[0], key, best[1].version)
            except RefreshFailed as exc:
                self.fetch_stats.skipped[exc.reason] += 1
                logger.warning("takeover of expert %s: could not fetch the freshest copy from %s (%s); "
                               "continuing from the local copy", expert_label(key), best[0], exc)
                continue
            logger.info("took over expert %s at version %d from %s", expert_label(key), record.version, best[0])
            fetched.update(tensors)
            self._records[key] = replace(record, owner=True)
            self._snapshots[key] = dict(tensors)
            mine.discard(key)
        if fetched:
            await self.trainer.load_tensors(fetched, partial=True)
        if mine:
            await self._claim(frozenset(mine))

    # ---- training and syncing --------------------------------------------------------------------

    async def step(self, plan_for: PlanFor, published: Callable[[int], Awaitable[None]] | None = None) -> SpesStepReport:
        """One local step, and a sync when the step count reaches a multiple of S."""
        stats = await self.trainer.train_step()
        if not self.config.syncs_after(self.trainer.step):
            return SpesStepReport(stats)
        sync_index = self.trainer.step // self.config.sync_every
        return SpesStepReport(stats, await self.sync(sync_index, await plan_for(sync_index), published))

    async def sync(self, sync_index: int, shared_plan: PeerRound,
                   published: Callable[[int], Awaitable[None]] | None = None) -> SyncReport:
        """Mix shared weights (round `sync_index` of `shared_plan`) and owned experts with their
        co-owners, run the merge warm-up, publish the owned experts' records, then refresh changed
        frozen copies. `published(sync_index)`, if given, is awaited between publishing and reading
        the directory (an in-process swarm waits there for everyone's records)."""
        started = time.monotonic()
        step = self.trainer.step
        owned = sorted(self._owned)
        names = [*self.partition.shared, *self.partition.names_of(self._owned)]
        tensors = await self.trainer.tensors(names)
        shared = self._shared
        assert shared is not None, "start() first"
        mixing = {key: self._ownership.co_owners(key, self.peer_id) for key in owned}
        mixing = {key: others for key, others in mixing.items() if others}
        groups = {key: await self._expert_group(key, tensors) for key in mixing}

        def delta(group: OuterGroup) -> dict[str, np.ndarray]:
            return {n: group.anchor[n] - tensors[n] for n in group.names}

        async def plan() -> PeerRound:
            return shared_plan

        def co_owners(others: tuple[str, ...]) -> Callable[[], Awaitable[PeerRound]]:
            async def plan() -> PeerRound:
                return _co_owner_plan(others)
            return plan

        deltas = {key: delta(group) for key, group in groups.items()}
        shared_delta = delta(shared)
        async with asyncio.TaskGroup() as group:
            shared_task = group.create_task(shared.exchange(sync_index, shared_delta, step, plan))
            expert_tasks = {key: group.create_task(groups[key].exchange(sync_index, deltas[key], step,
                                                                        co_owners(mixing[key])))
                            for key in mixing}
        new = await asyncio.to_thread(shared.land, shared_task.result(), shared_delta)
        for key in owned:
            if key in mixing:
                new.update(await asyncio.to_thread(groups[key].land, expert_tasks[key].result(), deltas[key]))
            else:  # no co-owner: the local values stand
                new.update({n: tensors[n] for n in self.partition.experts[key]})
        alpha = self.config.alpha_at(step) if self.config.merges_after(step) else 0.0
        if alpha > 0.0:
            merged = await self._merged(new, alpha)
            new.update(merged)
            for key in mixing:  # the merge moved the anchors too: it is no pseudo-gradient to mix
                groups[key].anchor = {n: new[n] for n in self.partition.experts[key]}
        await self.trainer.load_tensors(new, partial=True)
        await asyncio.to_thread(self._publish_owned, new, sync_index)
        await self._directory.publish(self.peer_id, self._records)
        if published is not None:
            await published(sync_index)
        refreshed, skipped = await self._refresh() if self.config.refreshes_at(sync_index) else ((), {})
        if refreshed:
            await self._directory.publish(self.peer_id, self._records)
        return SyncReport(sync_index, step, _main_round(shared_task.result()),
                          {key: _main_round(task.result()) for key, task in expert_tasks.items()}, alpha, refreshed,
                          skipped, time.monotonic() - started)

    async def _expert_group(self, key: ExpertKey, tensors: Tensors) -> OuterGroup:
        group = self._expert_groups.get(key)
        if group is None:
            # kept once made: a transport cannot stop serving a protocol, and the node may own the expert again
            group = self._group(expert_label(key), self.partition.experts[key], expert_protocol(key),
                                expert_anchor_protocol(key))
            await group.start(tensors, self.trainer.step, 0)
            self._expert_groups[key] = group
        return group

    async def _merged(self, current: dict[str, np.ndarray], alpha: float) -> dict[str, np.ndarray]:
        """The owned experts after one warm-up merge, from the post-mix owned values and the local
        frozen copies of the rest of their layers."""
        layers = sorted({layer for layer, _ in self._owned})
        others = {key for key in self.partition.experts if key[0] in layers and key not in self._owned}
        frozen = await self.trainer.tensors(self.partition.names_of(others))
        values = {**frozen, **current}

        def compute() -> dict[str, np.ndarray]:
            out: dict[str, np.ndarray] = {}
            for layer in layers:
                keys = [(layer, e) for e in range(self.partition.experts_per_layer)]
                experts = [[values[n] for n in self.partition.experts[key]] for key in keys]
                mine = [e for layer_, e in self._owned if layer_ == layer]
                for e, merged in merge_layer(experts, alpha, only=mine).items():
                    out.update(zip(self.partition.experts[(layer, e)], merged))
            return out

        return await asyncio.to_thread(compute)

    def _publish_owned(self, tensors: Mapping[str, np.ndarray], sync_index: int) -> None:
        for key in self._owned:
            names = self.partition.experts[key]
            values = [tensors[n] for n in names]
            previous = self._snapshots.get(key)
            source = content_hash(values)
            if self.config.delta_refresh and previous is not None and self._published_from.get(key) == source:
                continue  # unchanged since it was published: its record stands, and no copy moves
            self._published_from[key] = source
            if self.config.delta_refresh and previous is not None:
                # the published copy moves by the codec's image of (now - published), so what is not sent
                # stays in (now - published) for the next delta: error feedback without a residual
                sent = codec_image([v - previous[n] for v, n in zip(values, names, strict=True)],
                                   self.config.refresh_codec)
                arrives = codec_image(sent, self.config.refresh_codec)  # what the wire delivers of `sent`
                image = [(previous[n] + d).astype(np.float32) for n, d in zip(names, arrives, strict=True)]
                digest = content_hash(image)
                if digest != self._records[key].hash:
                    self._deltas[key] = (self._records[key].hash, dict(zip(names, sent, strict=True)))
            else:
                image = codec_image(values, self.config.image_codec)
                digest = content_hash(image)
            self._records[key] = advance_record(self._records[key], digest, sync_index, True)
            self._snapshots[key] = dict(zip(names, image, strict=True))

    def version_bound(self) -> int:
        """The highest expert version this node believes now (gossip.spes.version_bound)."""
        return version_bound(self.trainer.step, self.config.sync_every, self._version_slack)

    async def _read_directory(self) -> RecordsByPeer:
        """Every peer's published records, without the versions beyond `version_bound` (counted as
        `version_out_of_bounds`, logged once per peer)."""
        raw = await self._directory.read()
        published, dropped = bounded_records(raw, self.version_bound())
        if dropped:
            self.fetch_stats.errors["version_out_of_bounds"] += dropped
            for peer in sorted(set(raw) - self._warned):
                if len(raw[peer]) != len(published[peer]):
                    self._warned.add(peer)
                    logger.warning("ignoring expert records of %s with versions beyond %d (this node is at sync %d)",
                                   peer, self.version_bound(), self.trainer.step // self.config.sync_every)
        return published

    async def _refresh(self) -> tuple[tuple[ExpertKey, ...], dict[ExpertKey, str]]:
        published = await self._read_directory()
        skipped: dict[ExpertKey, str] = {}
        wanted: dict[ExpertKey, tuple[str, ExpertRecord]] = {}
        for key in self.partition.experts:
            if key in self._owned:
                continue
            source = refresh_source(key, self._ownership, published, self.peer_id)
            if source is None:
                skipped[key] = str(FetchSkip.NO_RECORD)
                continue
            record = published[source][key]
            if needs_refresh(self._records[key], record):
                wanted[key] = (source, record)
            elif record.version > self._records[key].version:
                self._records[key] = replace(self._records[key], version=record.version)
        results: dict[ExpertKey, tuple[dict[str, np.ndarray], ExpertRecord]] = {}

        async def one(key: ExpertKey, source: str, record: ExpertRecord) -> None:
            try:
                results[key] = await self._fetch(source, key, record.version, have=True)
            except RefreshFailed as exc:
                skipped[key] = exc.reason

        async with asyncio.TaskGroup() as group:
            for key, (source, record) in sorted(wanted.items()):
                group.create_task(one(key, source, record))
        loaded: dict[str, np.ndarray] = {}
        for key, (tensors, record) in results.items():
            loaded.update(tensors)
            self._records[key] = replace(record, owner=False)
        if loaded:
            await self.trainer.load_tensors(loaded, partial=True)
        for reason in skipped.values():
            self.fetch_stats.skipped[reason] += 1
        return tuple(sorted(results)), skipped

    # ---- the fetch protocol ------------------------------------------------------------------------

    def _expert_specs(self, key: ExpertKey) -> dict[str, np.ndarray]:
        sizes = {name: p.numel() for name, p in self.trainer.model.named_parameters()}
        return {n: np.empty(sizes[n], np.float32) for n in self.partition.experts[key]}

    async def _fetch(self, source: str, key: ExpertKey, min_version: int,
                     have: bool = False) -> tuple[dict[str, np.ndarray], ExpertRecord]:
        """Expert `key` from `source`; `have`: offer our copy as the base of a delta."""
        held = None
        if have and self.config.delta_refresh:
            names = self.partition.experts[key]
            tensors = await self.trainer.tensors(names)
            # a copy that is not exactly what its record says (stored in bf16) is no base for a delta
            if await asyncio.to_thread(content_hash, [tensors[n] for n in names]) == self._records[key].hash:
                held = (self._records[key].hash, tensors)
        return await self._fetcher.fetch(source, key, self._expert_specs(key), min_version, held,
                                        self.version_bound())

    def holds(self, key: ExpertKey) -> bool:
        """Whether this node has a copy of expert `key` to serve (every node holds every expert)."""
        return key in self.partition.experts

    async def served_copy(self, key: ExpertKey, have: str | None = None) -> ServedCopy:
        """An owner serves what it last published: the delta from its previous copy when the asker has
        that one (`have`), else the whole copy; a holder of a frozen copy (asked on takeover) serves that
        copy, under its version, hashed as sent."""
        if key in self._snapshots:
            delta = self._deltas.get(key)
            if have is not None and delta is not None and delta[0] == have:
                return ServedCopy(delta[1], self._records[key], base=have)
            return ServedCopy(self._snapshots[key], self._records[key])
        names = self.partition.experts[key]
        tensors = await self.trainer.tensors(names)
        image = await asyncio.to_thread(codec_image, [tensors[n] for n in names], self.config.image_codec)
        return ServedCopy(dict(zip(names, image, strict=True)), replace(self._records[key], hash=content_hash(image)))


def _main_round(sync: GroupSync) -> RoundOutcome:
    """The round that carried a group's values (fused: the anchors'), for the sync report."""
    outcome = sync.outcome if sync.outcome is not None else sync.anchors
    assert outcome is not None, "a group sync runs at least one round"
    return outcome


def _co_owner_plan(others: tuple[str, ...]) -> PeerRound:
    """Co-owners of an expert average it uniformly over a complete graph among themselves."""
    weight = 1.0 / (len(others) + 1)
    return PeerRound(weight, dict.fromkeys(others, weight), tuple(others))


__all__ = [
    "EXPERT",
    "FETCH",
    "FETCH_PROTOCOL",
    "SHARED_ANCHOR_PROTOCOL",
    "SHARED_PROTOCOL",
    "ExpertDirectory",
    "FetchStats",
    "InMemoryExpertDirectory",
    "ModelPartition",
    "SpesNode",
    "SpesStepReport",
    "SyncReport",
    "expert_anchor_protocol",
    "expert_protocol",
    "install_expert_casts",
    "optimizer_state_covers",
    "spes_average",
    "tensor_manifest",
]
