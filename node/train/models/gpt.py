"""A small GPT-style byte-level decoder, dense or with mixture-of-experts feed-forward layers (nanoGPT-like).

Embedded defaults: `DEFAULT`, an MoE of 4 layers, width 128, 4 heads, 8 experts x 256 hidden, top-2,
context 128; `DENSE_DEFAULT`, its compute-matched dense twin (one 512-wide MLP per layer). Their sizes,
step times and losses are in docs/benchmarks.md ("The embedded models").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from node.train.models.seeded_init import seeded_uniform

INIT_STD = 0.02


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a GPT decoder; `experts == 0` gives dense feed-forward layers."""

    vocab_size: int = 256
    context: int = 128
    layers: int = 4
    width: int = 128
    heads: int = 4
    experts: int = 0
    top_k: int = 2
    # Hidden width of each expert's MLP, and of the single MLP of a dense model.
    expert_hidden: int = 256
    aux_loss_weight: float = 0.01
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context", "layers", "width", "heads", "expert_hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"model config: {name} must be >= 1, got {getattr(self, name)}")
        if self.width % self.heads:
            raise ValueError(f"model config: width {self.width} is not divisible by heads {self.heads}")
        if self.experts < 0:
            raise ValueError(f"model config: experts must be >= 0 (0 = dense), got {self.experts}")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"model config: top_k must be in 1..{self.experts}, got {self.top_k}")
        if self.aux_loss_weight < 0:
            raise ValueError(f"model config: aux_loss_weight must be >= 0, got {self.aux_loss_weight}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model config: dropout must be in [0, 1), got {self.dropout}")

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"model config: unknown keys {', '.join(unknown)}")
        return cls(**values)


DEFAULT = ModelConfig(context=128, layers=4, width=128, heads=4, experts=8, top_k=2, expert_hidden=256)
# Same active feed-forward compute per token as DEFAULT: one MLP as wide as top_k experts together.
DENSE_DEFAULT = dataclasses.replace(DEFAULT, experts=0, expert_hidden=DEFAULT.top_k * DEFAULT.expert_hidden)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.width, 3 * config.width, bias=False)
        self.proj = nn.Linear(config.width, config.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, time, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(batch, time, width))
        return out


class FeedForward(nn.Module):
    """A two-matrix MLP: the dense layer, and each expert (w1 is the "first expert matrix")."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(width, hidden, bias=False)
        self.w2 = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.gelu(self.w1(x)))
        return out


@dataclass(frozen=True, eq=False)
class Routing:
    """Where each token goes: its top-k experts, their renormalised gates, and the full router softmax."""

    experts: torch.Tensor  # (tokens, top_k) long
    gates: torch.Tensor  # (tokens, top_k), rows sum to 1
    probs: torch.Tensor  # (tokens, experts)


class MoE(nn.Module):
    """Top-k routed experts. Each expert sees only the tokens routed to it; no token is dropped."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.top_k
        self.router = nn.Linear(config.width, config.experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(config.width, config.expert_hidden) for _ in range(config.experts))

    def route(self, tokens: torch.Tensor) -> Routing:
        probs = F.softmax(self.router(tokens).float(), dim=-1)
        gates, experts = probs.topk(self.top_k, dim=-1)
        return Routing(experts=experts, gates=gates / gates.sum(dim=-1, keepdim=True), probs=probs)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the layer output and the Switch-Transformer load-balancing loss E * sum_e f_e * p_e,
        which is 1 for a uniform router and grows as routing collapses onto few experts."""
        tokens = x.reshape(-1, x.shape[-1])
        routing = self.route(tokens)
        num_experts = len(self.experts)
        # One slot per (token, choice); sorting slots by expert makes each expert's tokens contiguous.
        slot_expert = routing.experts.reshape(-1)
        order = slot_expert.argsort(stable=True)
        slot_token = torch.arange(tokens.shape[0], device=x.device).repeat_interleave(self.top_k)[order]
        slot_gate = routing.gates.reshape(-1)[order].to(x.dtype)
        counts = torch.bincount(slot_expert, minlength=num_experts)
        out = torch.zeros_like(tokens)
        start = 0
        for expert, count in zip(self.experts, counts.tolist()):
            if count:
                chosen = slot_token[start : start + count]
                y = expert(tokens.index_select(0, chosen)) * slot_gate[start : start + count, None]
                out.index_add_(0, chosen, y)
                start += count
        fraction_routed = counts.float() / slot_expert.numel()
        aux_loss = num_experts * (fraction_routed * routing.probs.mean(dim=0)).sum()
        return out.view_as(x), aux_loss


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.width)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.width)
        if config.is_moe:
            self.moe = MoE(config)
        else:
            self.mlp = FeedForward(config.width, config.expert_hidden)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = x + self.drop(self.attn(self.ln1(x)))
        if hasattr(self, "moe"):
            y, aux_loss = self.moe(self.ln2(x))
            return x + self.drop(y), aux_loss
        return x + self.drop(self.mlp(self.ln2(x))), None


class GPT(nn.Module):
    """forward(idx, targets) -> (logits, loss); for MoE models the loss includes
    aux_loss_weight * the load-balancing loss, which is also kept (detached) in `last_aux_loss`."""

    def __init__(self, config: ModelConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.width)
        self.pos_emb = nn.Embedding(config.context, config.width)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab_size, bias=False)
        self.last_aux_loss = torch.zeros(())
        self.init_parameters(seed)

    @torch.no_grad()
    def init_parameters(self, seed: int) -> None:
        """GPT-2 style init (std 0.02, residual projections scaled by 1/sqrt(2 * layers)), drawn from
        (seed, parameter name) so every machine gets the same bits."""
        residual_std = INIT_STD / math.sqrt(2 * self.config.layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()
            elif isinstance(module, nn.Linear | nn.Embedding):
                std = residual_std if name.endswith(("attn.proj", ".w2")) else INIT_STD
                module.weight.copy_(seeded_uniform(tuple(module.weight.shape), std, seed, f"{name}.weight"))

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        time = idx.shape[1]
        if time > self.config.context:
            raise ValueError(f"sequence length {time} exceeds the model's context {self.config.context}")
        positions = torch.arange(time, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        aux_losses = []
        for block in self.blocks:
            x, aux_loss = block(x)
            if aux_loss is not None:
                aux_losses.append(aux_loss)
        logits = self.head(self.ln_f(x))
        # Averaged over layers so the weight means the same at any depth.
        aux = torch.stack(aux_losses).mean() if aux_losses else torch.zeros((), device=idx.device)
        self.last_aux_loss = aux.detach()
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss + self.config.aux_loss_weight * aux


def build_model(config: ModelConfig = DEFAULT, seed: int = 0) -> GPT:
    """The same seed gives bit-identical parameters on every machine."""
    return GPT(config, seed=seed)
