"""Validation loss: the pure cross-entropy of a model's logits, without any auxiliary loss."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn


@torch.no_grad()
def mean_cross_entropy(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean next-token cross-entropy in nats over every target of `batches`, computed from the logits
    so it works for any model with forward(idx, targets) -> (logits, loss)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            logits, _ = model(x, y)
            flat_logits = logits.reshape(-1, logits.shape[-1]).float()
            total += F.cross_entropy(flat_logits, y.reshape(-1), reduction="sum").item()
            count += y.numel()
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("no validation batches")
    return total / count
