"""Which parameters are shared and which belong to one expert: the partition SPES syncs by."""

from __future__ import annotations

from torch import nn

from node.train.models.experts import moe_expert_lists


def expert_parameter_names(model: nn.Module) -> dict[tuple[int, int], list[str]]:
    """(layer, expert) -> that expert's full parameter names, its first matrix (`w1.weight` of the
    embedded GPT, `gate_up_proj` of a Hugging Face MoE: the one expert similarity is measured on)
    first. Layers number the model's MoE layers in module order (node.train.models.experts).
    Empty for a dense model."""
    names: dict[tuple[int, int], list[str]] = {}
    for layer, (prefix, experts) in enumerate(moe_expert_lists(model)):
        for expert, module in enumerate(experts):
            names[(layer, expert)] = [f"{prefix}.{expert}.{name}" for name, _ in module.named_parameters()]
    return names


def shared_parameter_names(model: nn.Module) -> list[str]:
    """Every parameter that is no expert's: embeddings, attention, norms, routers, head."""
    owned = {name for names in expert_parameter_names(model).values() for name in names}
    return [name for name, _ in model.named_parameters() if name not in owned]
