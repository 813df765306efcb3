"""`murmur` with its forward and backward pass replaced by a sleep, as on a GPU that leaves the CPU free.

There is no GPU here: the step's compute takes a fixed time and no CPU, while everything else (the
optimizer, the gossip, the codecs, p2pd) runs as in a real node. bench/bench_wan.py's --mock-gpu-step
starts its nodes with this, to measure whether an overlapped sync hides behind compute on a shaped link
when the compute is not on the same cores.

    python -m bench.mock_gpu_node SECONDS murmur-arguments...
"""

from __future__ import annotations

import sys
import time

import torch


def mock_gpu_gradients(step_s: float):
    """A replacement for Trainer._accumulate_gradients: sleeps `step_s` (the GPU's forward and backward),
    then gives every parameter a small random gradient (so the optimizer and the pseudo-gradients have
    full-size values to move) and reports a constant loss."""

    def accumulate(self, micro_batches: int) -> float:
        time.sleep(step_s)
        generator = torch.Generator().manual_seed(self.step)
        with torch.no_grad():
            for p in self._params.values():
                p.grad = torch.randn(p.shape, generator=generator, dtype=p.dtype) * 1e-3
        return 3.0

    return accumulate


def main(argv: list[str]) -> int:
    from node.cli.main import main as murmur_main
    from node.train.trainer import Trainer

    step_s, rest = float(argv[0]), argv[1:]
    Trainer._accumulate_gradients = mock_gpu_gradients(step_s)  # type: ignore[method-assign]
    return murmur_main(rest)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
