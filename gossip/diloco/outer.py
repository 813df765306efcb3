"""DiLoCo's outer optimizer: Nesterov momentum on the pseudo-gradient, one buffer per tensor, kept by
each node for itself (the buffers are never exchanged)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


class OuterNesterov:
    """b <- mu b + g; anchor <- anchor - lr (g + mu b): torch.optim.SGD(nesterov=True) on the
    pseudo-gradient g, as DiLoCo applies it. Arrays are float32 and replaced, never modified in
    place, so a gossip peer may serve the anchor or the buffers while the next step is computed."""

    def __init__(self, lr: float, momentum: float) -> None:
        self.lr = lr
        self.momentum = momentum
        self._buffers: dict[str, np.ndarray] = {}

    def step(self, name: str, anchor: np.ndarray, pseudo_gradient: np.ndarray) -> np.ndarray:
        """The new anchor of tensor `name`; advances its momentum buffer."""
        g = np.asarray(pseudo_gradient, np.float32)
        if self.momentum:
            previous = self._buffers.get(name)
            buffer = g.copy() if previous is None else previous * np.float32(self.momentum) + g
            self._buffers[name] = buffer
            update = g + np.float32(self.momentum) * buffer
        else:
            update = g
        return (anchor - np.float32(self.lr) * update).astype(np.float32, copy=False)

    def state(self) -> dict[str, np.ndarray]:
        """The momentum buffers by tensor name (for checkpoints and for joiners)."""
        return dict(self._buffers)

    def load_state(self, buffers: Mapping[str, np.ndarray]) -> None:
        self._buffers = {name: np.asarray(b, np.float32).reshape(-1).copy() for name, b in buffers.items()}

    def buffer(self, name: str) -> np.ndarray | None:
        return self._buffers.get(name)
