"""DiLoCo's outer optimizer: Nesterov momentum on the pseudo-gradient, one buffer per tensor. Over gossip
the buffer itself is what is mixed (`message` / `step_mixed`), so the nodes' momenta stay in consensus."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


class OuterNesterov:
    """b <- mu b + g; anchor <- anchor - lr (g + mu b): torch.optim.SGD(nesterov=True) on the
    pseudo-gradient g, as DiLoCo applies it (`step`, a node alone).

    Over gossip (`message`, then `step_mixed`) a node sends m_i = mu b_i + g_i, its next buffer, in place
    of the raw g_i (the same bytes), and takes the mix m'_i = sum_j w_ij m_j as its new buffer; the
    pseudo-gradient that mix stands for is g'_i = m'_i - mu b_i, and the step is anchor - lr (g'_i + mu m'_i).
    With exact averaging from equal buffers this is centralised DiLoCo on the mean pseudo-gradient to the
    last bit of arithmetic, and the buffers stay equal; over a sparse graph each buffer is mixed every
    sync, so it cannot drift with its own node's data as an unmixed one does. With mu = 0 it is the step
    on the mixed pseudo-gradient. Arrays are float32 and replaced, never modified in place, so a gossip
    peer may serve the anchor or the buffers while the next step is computed."""

    def __init__(self, lr: float, momentum: float) -> None:
        self.lr = lr
        self.momentum = momentum
        self._buffers: dict[str, np.ndarray] = {}

    def step(self, name: str, anchor: np.ndarray, pseudo_gradient: np.ndarray) -> np.ndarray:
        """The new anchor of tensor `name` from this node's own pseudo-gradient; advances its buffer."""
        return self.step_mixed(name, anchor, self.message(name, pseudo_gradient))

    def message(self, name: str, pseudo_gradient: np.ndarray) -> np.ndarray:
        """What this node mixes for tensor `name`: its next buffer mu b + g (g itself without momentum)."""
        g = np.asarray(pseudo_gradient, np.float32)
        previous = self._buffers.get(name)
        if not self.momentum or previous is None:
            return g
        return (previous * np.float32(self.momentum) + g).astype(np.float32, copy=False)

    def step_mixed(self, name: str, anchor: np.ndarray, mixed: np.ndarray) -> np.ndarray:
        """The new anchor of tensor `name` from the mix of the neighbours' `message`s; the mix becomes the
        buffer. The applied update is (1 + mu) m' - mu b: the mixed pseudo-gradient m' - mu b plus mu m'."""
        m: np.ndarray = np.asarray(mixed, np.float32)
        update: np.ndarray
        if not self.momentum:
            update = m
        else:
            mu = np.float32(self.momentum)
            previous = self._buffers.get(name)
            g = m if previous is None else m - mu * previous
            # a copy: the mix may be a gossip peer's array, and the buffer is served and checkpointed
            self._buffers[name] = m.copy()
            update = g + mu * m
        new_anchor: np.ndarray = (anchor - np.float32(self.lr) * update).astype(np.float32, copy=False)
        return new_anchor

    def state(self) -> dict[str, np.ndarray]:
        """The momentum buffers by tensor name (for checkpoints and for joiners)."""
        return dict(self._buffers)

    def load_state(self, buffers: Mapping[str, np.ndarray]) -> None:
        self._buffers = {name: np.asarray(b, np.float32).reshape(-1).copy() for name, b in buffers.items()}

    def buffer(self, name: str) -> np.ndarray | None:
        return self._buffers.get(name)
