"""Experts of mixture-of-experts layers found by module structure, per layer and per expert.

Two layouts are found: a `ModuleList` of expert modules beside a router (the embedded GPT's `MoE`,
transformers 4.x Mixtral, user models), and the fused layout of transformers 5.x, where one module
holds every expert of a layer as 3-D tensors `gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I)
(Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, PhiMoE, GraniteMoE, MiniMax). `split_fused_experts`
turns the fused layout into a `SplitExperts` list of one module per expert with the same forward, so
SPES can freeze, train and mix each expert on its own; `fuse_state_dict` turns it back for
`save_pretrained`. Other fused layouts (GPT-OSS's biased, transposed experts; DBRX's flattened ones)
are recorded as unsupported, and SPES refuses them by name (`unsupported_expert_layouts`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

FUSED_PARAMETERS = ("gate_up_proj", "down_proj")  # the supported fused layout, first expert matrix first
ROUTER_NAMES = ("router", "gate")
UNSUPPORTED_ATTRIBUTE = "_murmur_unsupported_experts"


class ExpertMLP(nn.Module):
    """One expert of the fused layout: down(act(gate) * up), where gate_up_proj stacks gate over up."""

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act_fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up_proj)
        self.down_proj = nn.Parameter(down_proj)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj).chunk(2, dim=-1)
        out: torch.Tensor = F.linear(self.act_fn(gate) * up, self.down_proj)
        return out


class SplitExperts(nn.ModuleList):
    """A fused experts module as one `ExpertMLP` per expert, called as the fused one is:
    (hidden_states (tokens, H), top_k_index (tokens, k), top_k_weights (tokens, k)) -> (tokens, H)."""

    def __init__(self, fused: nn.Module) -> None:
        params = _fused_parameters(fused)
        gate_up, down = params["gate_up_proj"], params["down_proj"]
        act_fn: Callable[[torch.Tensor], torch.Tensor] = getattr(fused, "act_fn")  # noqa: B009 - typed as a callable
        super().__init__(ExpertMLP(gate_up[e].detach().clone(), down[e].detach().clone(), act_fn)
                         for e in range(gate_up.shape[0]))
        self.fused_class = type(fused).__name__

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self):
            token_idx, position = torch.where(top_k_index == e)
            if token_idx.numel() == 0:
                continue
            y = expert(hidden_states[token_idx]) * top_k_weights[token_idx, position, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


def _fused_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in module.named_parameters(recurse=False)}


def _is_supported_fused(module: nn.Module) -> bool:
    params = _fused_parameters(module)
    if set(params) != set(FUSED_PARAMETERS) or not callable(getattr(module, "act_fn", None)):
        return False
    gate_up, down = params["gate_up_proj"], params["down_proj"]
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0]:
        return False
    experts, two_i, hidden = gate_up.shape
    return two_i % 2 == 0 and tuple(down.shape) == (experts, hidden, two_i // 2)


def _looks_fused(module: nn.Module) -> bool:
    """A module holding several experts' weights in tensors of its own: named *Experts, or with a 3-D
    parameter. A module named *Experts that keeps them in a child instead (DBRX: `DbrxExperts.mlp`, a
    `DbrxExpertGLU` with w1, v1, w2 flattened to 2-D (E * F, H)) counts too, unless its experts are
    modules of their own (a ModuleList or ModuleDict inside, as moe_expert_lists finds them)."""
    params = _fused_parameters(module)
    named = type(module).__name__.endswith("Experts")
    if params:
        return named or any(p.dim() >= 3 for p in params.values())
    return (named and any(True for _ in module.parameters())
            and not any(isinstance(m, nn.ModuleList | nn.ModuleDict) for m in module.modules()))


def split_fused_experts(model: nn.Module) -> int:
    """Replace every supported fused experts module of `model` by its `SplitExperts` (same values,
    same forward); remember the unsupported ones (class names) for `unsupported_expert_layouts`.
    Returns how many were split."""
    split, unsupported = 0, []
    family = getattr(getattr(model, "config", None), "model_type", None)
    for prefix, module in list(model.named_modules()):
        if not prefix or isinstance(module, SplitExperts) or not _looks_fused(module):
            continue
        if not _is_supported_fused(module):
            params = ", ".join(f"{n} {tuple(p.shape)}" for n, p in module.named_parameters())
            where = f"{type(module).__name__} of model type {family!r}" if family else type(module).__name__
            unsupported.append(f"{where} at {prefix} ({params})")
            continue
        parent_name, _, child = prefix.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, SplitExperts(module))
        split += 1
    setattr(model, UNSUPPORTED_ATTRIBUTE, tuple(unsupported))
    return split


def unsupported_expert_layouts(model: nn.Module) -> tuple[str, ...]:
    """Fused experts modules `split_fused_experts` could not split (empty if none, or never split)."""
    found: tuple[str, ...] = ()
    for module in model.modules():
        found += getattr(module, UNSUPPORTED_ATTRIBUTE, ())
    return found


def _has_router(module: nn.Module) -> bool:
    return any(isinstance(getattr(module, name, None), nn.Module) for name in ROUTER_NAMES)


def moe_expert_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """(prefix of the experts list, the list) of every MoE layer, in module order: a `ModuleList` named
    `experts` of modules with equal parameter shapes, beside a router (`router` or `gate`)."""
    found = []
    for prefix, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if not isinstance(experts, nn.ModuleList) or not experts or not _has_router(module):
            continue
        shapes = {tuple((n, tuple(p.shape)) for n, p in expert.named_parameters()) for expert in experts}
        if len(shapes) != 1 or not next(iter(shapes)):
            continue
        found.append((f"{prefix}.experts" if prefix else "experts", experts))
    return found


def fuse_state_dict(state: Mapping[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """`state` (names of `model`, which has SplitExperts) with every split expert list stacked back
    into the fused tensors transformers 5.x loads: `<prefix>.gate_up_proj` (E, 2I, H) and so on."""
    out = dict(state)
    for prefix, module in model.named_modules():
        if not isinstance(module, SplitExperts):
            continue
        for name in FUSED_PARAMETERS:
            keys = [f"{prefix}.{e}.{name}" for e in range(len(module))]
            out[f"{prefix}.{name}"] = torch.stack([out.pop(k) for k in keys])
    return out


__all__ = [
    "FUSED_PARAMETERS",
    "ExpertMLP",
    "SplitExperts",
    "fuse_state_dict",
    "moe_expert_lists",
    "split_fused_experts",
    "unsupported_expert_layouts",
]
