"""How SPES splits a model: its parameter names as shared weights and per-expert groups, and what
is computed over that split (the swarm-average model, the optimizer's coverage, gossip manifests).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from torch import nn

from gossip.spes import ExpertKey, Ownership
from node.train.models import expert_parameter_names, shared_parameter_names
from node.train.models.experts import unsupported_expert_layouts
from node.train.trainer import Tensors, Trainer, average_tensors


@dataclass(frozen=True)
class ModelPartition:
    """A model's parameter names split the way SPES syncs them (flat float32 vectors, Trainer order)."""

    shared: tuple[str, ...]
    experts: Mapping[ExpertKey, tuple[str, ...]]  # first matrix (w1) first
    experts_per_layer: int
    layers: int

    @classmethod
    def of(cls, model: nn.Module) -> ModelPartition:
        unsupported = unsupported_expert_layouts(model)
        if unsupported:
            raise ValueError(f"SPES cannot split the experts of this model per expert: unsupported layout "
                             f"{'; '.join(unsupported[:2])} (docs/spes.md, \"Hugging Face MoE models\")")
        experts = {key: tuple(names) for key, names in expert_parameter_names(model).items()}
        if not experts:
            raise ValueError("SPES needs a mixture-of-experts model; this one has no MoE layer")
        layers = 1 + max(layer for layer, _ in experts)
        per_layer = 1 + max(e for _, e in experts)
        return cls(tuple(shared_parameter_names(model)), experts, per_layer, layers)

    def names_of(self, keys: set[ExpertKey] | frozenset[ExpertKey]) -> list[str]:
        return [name for key in sorted(keys) for name in self.experts[key]]




def spes_average(members: Mapping[str, Tensors], ownership: Ownership, partition: ModelPartition) -> dict[str, np.ndarray]:
    """The swarm-average SPES model: shared weights averaged over every node, each expert over its
    owners (the copies that are trained; frozen copies are only caches of them)."""
    if not members:
        raise ValueError("nothing to average")
    out = average_tensors([{name: m[name] for name in partition.shared} for m in members.values()])
    for key, names in partition.experts.items():
        owners = [p for p in ownership.owners[key] if p in members] or list(members)
        out.update(average_tensors([{name: members[p][name] for name in names} for p in owners]))
    return out


def optimizer_state_covers(trainer: Trainer, partition: ModelPartition, owned: frozenset[ExpertKey]) -> bool:
    """Whether the optimizer holds state for shared + owned parameters only (what SPES promises)."""
    return trainer.optimizer_parameter_names <= set(partition.shared) | set(partition.names_of(owned))


def tensor_manifest(names: list[str], trainer: Trainer) -> dict[str, tuple[tuple[int], str]]:
    """(shape, dtype) per flat gossip tensor, for gossip.wire.message_nbytes."""
    sizes = {name: p.numel() for name, p in trainer.model.named_parameters()}
    return {n: ((sizes[n],), "float32") for n in names}


__all__ = ["ModelPartition", "optimizer_state_covers", "spes_average", "tensor_manifest"]
