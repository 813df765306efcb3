"""Pinned host buffers for a CUDA model's gossip tensors, so parameters leave and reach the GPU with one
synchronisation per direction.

The copies go through page-locked memory asynchronously, instead of one blocking pageable copy per
parameter. Untested on a GPU here (docs/training.md, "GPU")."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import torch


class HostStaging:
    """One float32 host buffer per parameter, allocated on first use and reused; `pin` page-locks them
    (CUDA only; the CPU tests run the same code unpinned)."""

    def __init__(self, pin: bool) -> None:
        self._pin = pin
        self._buffers: dict[str, torch.Tensor] = {}

    def _buffer(self, name: str, numel: int) -> torch.Tensor:
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() != numel:
            buffer = torch.empty(numel, dtype=torch.float32, pin_memory=self._pin)
            self._buffers[name] = buffer
        return buffer

    @torch.no_grad()
    def to_host(self, params: Iterable[tuple[str, torch.Tensor]]) -> dict[str, np.ndarray]:
        """Flat float32 copies of `params` (owned by the caller: the staging buffers are reused)."""
        staged = []
        for name, p in params:
            buffer = self._buffer(name, p.numel())
            buffer.copy_(p.detach().reshape(-1), non_blocking=True)  # casts to float32 on the way
            staged.append((name, buffer))
        if self._pin:
            torch.cuda.synchronize()
        return {name: buffer.numpy().copy() for name, buffer in staged}

    @torch.no_grad()
    def to_device(self, params: Mapping[str, torch.Tensor], values: Mapping[str, np.ndarray]) -> None:
        """Copy flat `values` into the parameters of the same names (sizes checked)."""
        for name, vector in values.items():
            p = params[name]
            if vector.size != p.numel():
                raise ValueError(f"parameter {name!r} has {p.numel()} values, got {vector.size}")
            buffer = self._buffer(name, p.numel())
            buffer.copy_(torch.from_numpy(np.asarray(vector, dtype=np.float32).reshape(-1)))
            p.copy_(buffer.view(p.shape), non_blocking=True)
        if self._pin:
            torch.cuda.synchronize()  # the buffers are reused: the copies must be done before they are


__all__ = ["HostStaging"]
