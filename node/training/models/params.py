"""Which parameters are shared and which belong to one expert: the partition SPES syncs by."""

from __future__ import annotations

from torch import nn

from node.training.models.gpt import MoE


def expert_parameter_names(model: nn.Module) -> dict[tuple[int, int], list[str]]:
    """(layer, expert) -> that expert's full parameter names, its first matrix (`w1.weight`, the one
    expert similarity is measured on) first. Layers number the model's MoE layers in module order,
    which for GPT is the block index. Empty for a dense model."""
    names: dict[tuple[int, int], list[str]] = {}
    moe_layers = [(prefix, module) for prefix, module in model.named_modules() if isinstance(module, MoE)]
    for layer, (prefix, moe) in enumerate(moe_layers):
        for expert, module in enumerate(moe.experts):
            names[(layer, expert)] = [f"{prefix}.experts.{expert}.{name}" for name, _ in module.named_parameters()]
    return names


def shared_parameter_names(model: nn.Module) -> list[str]:
    """Every parameter that is no expert's: embeddings, attention, norms, routers, head."""
    owned = {name for names in expert_parameter_names(model).values() for name in names}
    return [name for name, _ in model.named_parameters() if name not in owned]
