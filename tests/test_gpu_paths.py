"""The parts of the CUDA path that run without a GPU (there is none here; docs/training.md, "GPU"):
the host staging buffers of the gossip tensors, unpinned, and the SPES capacity arithmetic."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from node.algorithms.spes.swarm import GPU_MEMORY_SHARE, TRAINED_BYTES, spes_capacity
from node.train.staging import HostStaging

pytestmark = pytest.mark.unit


def test_staging_buffers_carry_parameters_out_and_back_and_are_not_aliased() -> None:
    params = {"a": torch.randn(3, 4), "b": torch.randn(5).to(torch.bfloat16)}
    staging = HostStaging(pin=False)
    out = staging.to_host(params.items())
    assert out["a"].dtype == np.float32 and out["a"].shape == (12,)
    np.testing.assert_array_equal(out["a"], params["a"].reshape(-1).numpy())
    np.testing.assert_array_equal(out["b"], params["b"].float().numpy())
    again = staging.to_host(params.items())
    out["a"][:] = 0  # the caller's copy: the staging buffer and the next call are unaffected
    assert not np.array_equal(again["a"], out["a"])
    new = {"a": np.arange(12, dtype=np.float32), "b": np.full(5, 0.5, np.float32)}
    staging.to_device(params, new)
    assert torch.equal(params["a"], torch.arange(12.0).view(3, 4))
    assert params["b"].dtype == torch.bfloat16 and torch.equal(params["b"].float(), torch.full((5,), 0.5))
    with pytest.raises(ValueError, match="has 12 values, got 3"):
        staging.to_device(params, {"a": np.zeros(3, np.float32)})


def test_spes_capacity_counts_activations_shared_weights_and_frozen_experts() -> None:
    shared, every_expert, experts = 1_000_000, 8_000_000, 8  # 1M parameters per expert index
    fixed = TRAINED_BYTES * shared + 2 * every_expert  # shared trained, every expert frozen in bf16
    per_index = (TRAINED_BYTES - 2) * 1_000_000
    free = int((fixed + 3 * per_index) / GPU_MEMORY_SHARE) + 1000
    assert spes_capacity(free, 0, shared, every_expert, experts, 2) == 3
    # the activations of a micro-batch take room that would otherwise hold an expert
    assert spes_capacity(free, per_index, shared, every_expert, experts, 2) == 2
    assert spes_capacity(10**15, 0, shared, every_expert, experts, 2) == experts  # at most every expert
    assert spes_capacity(0, 0, shared, every_expert, experts, 2) == 1  # at least one
