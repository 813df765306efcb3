"""Error feedback for top-k: the sender keeps what top-k left out and adds it to the next step."""

from __future__ import annotations

import numpy as np

from gossip.codecs.kernels import _flat_source, _from_float32
from gossip.codecs.topk import TopKCodec


class ErrorFeedback:
    """The sender's memory of what top-k left out: one residual per tensor name.

    Each step sends top-k of (x + residual) and keeps the rest as the new residual, so over many
    steps everything is sent eventually: the sum of what was sent plus the residual equals the sum
    of the inputs. `compress` returns exactly what the receiver will decode (same dtype and shape);
    pass those arrays to `encode_message` with the same `TopKCodec`.
    """

    def __init__(self, codec: TopKCodec) -> None:
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

    def reset(self, name: str | None = None) -> None:
        """Forget the residual of one tensor, or of all of them."""
        if name is None:
            self._residuals.clear()
        else:
            self._residuals.pop(name, None)
