"""Simulator cost per round against swarm size, against one numpy pass over the same floats measured in the
same run.

256, 512 and 1024 peers x 1M parameters on the one-peer exponential topology, with the slope per (peer x
parameter); the baseline pass is `out = 0.5 * a + 0.5 * b` over the same n x d floats.

The simulator should stay linear in peers x parameters: time per round / baseline stays flat as
n grows. Run from the repository root: .venv/bin/python -m bench.bench_sim [--dim 1000000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from gossip.sim import SimConfig, simulate
from topology import TopologySpec


def round_time(peers: int, dim: int, rounds: int) -> float:
    """Median wall time of the mixing rounds (round 0, the set-up, excluded)."""
    stamps = []
    config = SimConfig(peers=peers, topology=TopologySpec("one-peer-exp"), rounds=rounds, dim=dim, dtype="float32")
    for _ in simulate(config):
        stamps.append(time.perf_counter())
    return float(np.median(np.diff(stamps)))


def baseline_time(peers: int, dim: int) -> float:
    """One pairwise-average pass over n x d float32 values, row by row as the simulator stores them."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal(dim, dtype=np.float32)
    b = rng.standard_normal(dim, dtype=np.float32)
    out = np.empty_like(a)
    start = time.perf_counter()
    for _ in range(peers):
        np.multiply(a, 0.5, out=out)
        out += 0.5 * b
    return time.perf_counter() - start


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dim", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--peers", type=int, nargs="+", default=[256, 512, 1024])
    args = parser.parse_args(argv)
    print(f"command: {sys.executable} -m bench.bench_sim {' '.join(argv)}".rstrip())
    print(f"one-peer-exp, {args.dim:,} float32 parameters per peer, median of {args.rounds} rounds\n")
    print("| peers | s / round | ns per peer x param | baseline pass s | round / baseline |")
    print("|---:|---:|---:|---:|---:|")
    rows = []
    for n in args.peers:
        t = round_time(n, args.dim, args.rounds)
        base = baseline_time(n, args.dim)
        rows.append((n, t))
        print(f"| {n} | {t:.2f} | {t / (n * args.dim) * 1e9:.2f} | {base:.2f} | {t / base:.2f} |", flush=True)
    work = np.array([n * args.dim for n, _ in rows], dtype=float)
    times = np.array([t for _, t in rows])
    slope, intercept = np.polyfit(work, times, 1)
    print(f"\nlinear fit: {slope * 1e9:.3f} ns per peer x parameter, intercept {intercept:.3f} s; "
          f"time ratio {rows[-1][0] // rows[0][0]}x peers: {times[-1] / times[0]:.2f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
