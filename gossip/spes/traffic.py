"""SPES's analytic figures: the bytes a node sends per sync, and a node's training memory."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# ---- traffic and memory -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SyncTraffic:
    """Bytes one node sends in one sync, by what they carry."""

    shared: int
    experts: int
    refresh: int

    @property
    def total(self) -> int:
        return self.shared + self.experts + self.refresh


def sync_bytes_sent(shared_message_bytes: int, shared_out_degree: int, expert_message_bytes: int,
                    co_owner_counts: Iterable[int], refresh_message_bytes: int, refreshes_served: int) -> SyncTraffic:
    """The analytic bytes a node sends in a sync: its shared weights to each topology neighbour
    that mixes them, each owned expert to each of its co-owners, and one refresh message per
    changed frozen copy it serves. Message sizes are whole wire messages (gossip.wire.message_nbytes);
    header-only requests (pulls, fetch requests) are left out: they are a few hundred bytes."""
    return SyncTraffic(
        shared=shared_message_bytes * shared_out_degree,
        experts=expert_message_bytes * sum(co_owner_counts),
        refresh=refresh_message_bytes * refreshes_served,
    )


def reference_sync_bytes(shared_numel: int, owned_expert_numel: int, total_numel: int) -> int:
    """Bytes one node moves per sync in the reference SPES implementation (central server, barrier):
    it uploads its shared weights and owned experts in fp32 and downloads the whole model in fp32."""
    return 4 * (shared_numel + owned_expert_numel) + 4 * total_numel


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes of parameters, gradients and optimizer state on one node at the peak of a step."""

    parameters: int
    gradients: int
    optimizer_state: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state


def training_memory(trainable_numel: int, frozen_numel: int, optimizer_floats_per_param: int,
                    frozen_bytes_per_param: int = 4) -> TrainingMemory:
    """Analytic memory: fp32 trainable parameters with fp32 gradients and `optimizer_floats_per_param`
    fp32 state values each (Adam 2, SGD with momentum 1, plain SGD 0), frozen parameters at
    `frozen_bytes_per_param` (4 fp32, 2 bf16) with neither."""
    return TrainingMemory(
        parameters=4 * trainable_numel + frozen_bytes_per_param * frozen_numel,
        gradients=4 * trainable_numel,
        optimizer_state=4 * optimizer_floats_per_param * trainable_numel,
    )
