"""Error feedback: the sender keeps what a lossy codec left out of a message and adds it to the next."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from gossip.codecs.base import Codec
from gossip.codecs.kernels import _flat_source, _from_float32


class ErrorFeedback:
    """The sender's memory of what its codec (top-k, int8, fp16...) left out: one residual per tensor.

    Each message carries the codec's image of (x + residual) and keeps the rest as the new residual,
    so over many messages nothing is lost: the sum of what was sent plus the residual equals the sum
    of the inputs. Sound only for quantities that are summed over time (pseudo-gradients, updates,
    differences), not for whole parameter vectors, whose residual would be added to a later, different
    vector. `compress` returns exactly what the receiver will decode (same dtype and shape): offer those
    arrays to the gossip peer, whose wire encoding in the same codec carries them unchanged.
    """

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self._residuals: dict[str, np.ndarray] = {}

    def compress(self, name: str, x: np.ndarray) -> np.ndarray:
        flat = _flat_source(x)
        work = np.float64 if flat.dtype == np.float64 else np.float32
        v: np.ndarray = flat.astype(work)
        residual = self._residuals.get(name)
        if residual is not None:
            if residual.size != v.size:
                raise ValueError(f"tensor {name!r} has {v.size} elements, its residual {residual.size}")
            v += residual
        sent32 = self.codec.decode(self.codec.encode(v), v.size)  # what the wire will carry
        sent = _from_float32(sent32, flat.dtype)  # the receiver's cast into the tensor's dtype
        self._residuals[name] = v - sent.astype(work)
        return sent.reshape(np.shape(x))

    def residual(self, name: str) -> np.ndarray | None:
        """What has not been sent yet for `name` (flat), or None before its first step."""
        return self._residuals.get(name)

    def state(self) -> dict[str, np.ndarray]:
        """Every residual by tensor name (for checkpoints: a restarted node sends what it still owed)."""
        return dict(self._residuals)

    def load_state(self, residuals: Mapping[str, np.ndarray]) -> None:
        self._residuals = {name: np.asarray(r).reshape(-1).copy() for name, r in residuals.items()}

    def reset(self, name: str | None = None) -> None:
        """Forget the residual of one tensor, or of all of them."""
        if name is None:
            self._residuals.clear()
        else:
            self._residuals.pop(name, None)
