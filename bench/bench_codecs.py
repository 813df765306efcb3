"""Codec throughput: encode + decode of a large float32 vector per codec, as a ratio to a plain numpy copy
of the same bytes measured in the same run (best of N, interleaved so background load hits both alike).

Run from the repository root: .venv/bin/python -m bench.bench_codecs [--mib 64] [--repeats 11]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from gossip.codecs import Bf16Codec, Codec, Fp16Codec, Fp32Codec, Int8Codec, TopKCodec

# minimum (encode + decode) throughput as a fraction of the copy's, per codec
TARGETS: dict[str, float] = {"fp16": 0.25, "bf16": 0.25, "int8": 0.10}


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(x: np.ndarray, codecs: list[Codec], repeats: int) -> tuple[float, dict[str, tuple[float, float]]]:
    """Best copy time, and best (encode, decode) times per codec, over `repeats` interleaved rounds."""
    encoded = {codec.name: codec.encode(x) for codec in codecs}  # warm up, and inputs for decode
    copy_best = float("inf")
    best = {codec.name: (float("inf"), float("inf")) for codec in codecs}
    for _ in range(repeats):
        copy_best = min(copy_best, _timed(x.copy))
        for codec in codecs:
            enc = _timed(lambda: codec.encode(x))
            buf = encoded[codec.name]
            dec = _timed(lambda: codec.decode(buf, x.size))
            e, d = best[codec.name]
            best[codec.name] = (min(e, enc), min(d, dec))
    return copy_best, best


def report(nbytes: int, copy_time: float, best: dict[str, tuple[float, float]], argv: list[str]) -> str:
    mb = nbytes / 1e6
    lines = [
        f"command: {sys.executable} -m bench.bench_codecs {' '.join(argv)}".rstrip(),
        f"input: {nbytes / 2**20:.0f} MiB float32 (standard normal); numpy {np.__version__}, "
        f"python {platform.python_version()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch thread(s); "
        "times are best of the repeats",
        f"baseline: numpy copy of the same {nbytes / 2**20:.0f} MiB: {mb / copy_time:,.0f} MB/s",
        "",
        "| codec | encode MB/s | decode MB/s | encode+decode MB/s | ratio to copy | target |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, (enc, dec) in best.items():
        ratio = copy_time / (enc + dec)
        target = TARGETS.get(name)
        verdict = "-" if target is None else f">= {target:.2f}: {'met' if ratio >= target else 'MISSED'}"
        lines.append(
            f"| {name} | {mb / enc:,.0f} | {mb / dec:,.0f} | {mb / (enc + dec):,.0f} | {ratio:.2f}x | {verdict} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.bench_codecs", description=__doc__)
    parser.add_argument("--mib", type=int, default=64, help="size of the float32 vector in MiB (default 64)")
    parser.add_argument("--repeats", type=int, default=11, help="timing rounds; the best is kept (default 11)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--torch-threads", type=int, default=1,
        help="torch intra-op threads for the fp16 casts (default 1, like the single-threaded copy)",
    )
    args = parser.parse_args(argv)
    if args.mib < 1 or args.repeats < 1 or args.torch_threads < 1:
        parser.error("--mib, --repeats and --torch-threads must be positive")
    torch.set_num_threads(args.torch_threads)
    x = np.random.default_rng(args.seed).standard_normal(args.mib * 2**20 // 4).astype(np.float32)
    codecs: list[Codec] = [Fp32Codec(), Fp16Codec(), Bf16Codec(), Int8Codec(block=256), TopKCodec(ratio=0.01)]
    copy_time, best = measure(x, codecs, args.repeats)
    print(report(x.nbytes, copy_time, best, argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
