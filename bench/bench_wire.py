"""Header decode time: `gossip.wire.parse_header` (the declared msgspec schema) against the hand-checked
parser it replaced, printed as new / old.

The old parser is loaded from git as the baseline and timed on the same header bodies in the same run
(best of N, interleaved so background load hits both alike).

Run from the repository root: .venv/bin/python -m bench.bench_wire [--baseline 9a9f615] [--repeats 21]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
import types
from collections.abc import Callable

import numpy as np

from gossip.codecs import Codec, Fp16Codec, Int8Codec, TopKCodec
from gossip.wire import DEFAULT_LIMITS, encode_message, parse_header

# the last commit with the hand-checked header parser (gossip/wire was one module then)
BASELINE = "9a9f615"
FIELDS = dict(swarm="tiny-moe", config_hash="c0ffee" * 10, sender="12D3KooW" + "p" * 44, round=3, step=120,
              kind="exchange")  # fmt: skip
# the new parser's time over the old one's may not exceed this, per header
TARGET = 1.0


def load_baseline(commit: str) -> types.ModuleType:
    """gossip/wire as it was at `commit`, imported under another name."""
    source = subprocess.run(
        ["git", "show", f"{commit}:gossip/wire/__init__.py"], capture_output=True, text=True, check=True
    ).stdout
    module = types.ModuleType("gossip_wire_baseline")
    sys.modules[module.__name__] = module  # dataclasses look their module up there
    exec(compile(source, f"{commit}:gossip/wire/__init__.py", "exec"), module.__dict__)
    return module


def header_body(n_tensors: int, codec: Codec, meta: dict[str, object] | None = None) -> bytes:
    tensors = {f"layer{i}.weight": np.zeros((4, 8), np.float32) for i in range(n_tensors)}
    head = encode_message(tensors, codec, meta=meta, **FIELDS)[0]
    return bytes(head)[8:]  # without its length prefix


def best_of(fn: Callable[[], object], number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - start) / number


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default=BASELINE, help="commit holding the hand-checked parser")
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    old = load_baseline(args.baseline)
    cases = {
        "1 tensor, fp16": header_body(1, Fp16Codec()),
        "1 tensor, topk, 4 meta": header_body(1, TopKCodec(0.01), {"current": True, "expert": "e.3", "n": 7, "x": 0.5}),
        "20 tensors, int8": header_body(20, Int8Codec(block=256)),
        "200 tensors, fp16": header_body(200, Fp16Codec()),
    }
    print(f"python {platform.python_version()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, "
          f"baseline {args.baseline}")  # fmt: skip
    print(f"{'header':<26} {'bytes':>6} {'old us':>9} {'new us':>9} {'new/old':>8}")
    worst = 0.0
    for name, body in cases.items():
        new_header, _ = parse_header(body, DEFAULT_LIMITS)
        old_header, _ = old.parse_header(body, old.DEFAULT_LIMITS)
        assert new_header.manifest[0].shape == old_header.manifest[0].shape  # the same header, both ways
        number = max(1, 20000 // (1 + len(new_header.manifest)))
        best_old = best_new = float("inf")
        for _ in range(args.repeats):
            best_old = min(best_old, best_of(lambda b=body: old.parse_header(b, old.DEFAULT_LIMITS), number))
            best_new = min(best_new, best_of(lambda b=body: parse_header(b, DEFAULT_LIMITS), number))
        ratio = best_new / best_old
        worst = max(worst, ratio)
        print(f"{name:<26} {len(body):>6} {best_old * 1e6:>9.1f} {best_new * 1e6:>9.1f} {ratio:>7.2f}x")
    verdict = "met" if worst <= TARGET else "NOT met"
    print(f"worst new/old {worst:.2f}x (target <= {TARGET:.2f}x: {verdict})")
    return 0 if worst <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
