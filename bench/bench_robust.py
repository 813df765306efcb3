"""What the robust default (adaptive centered clipping, gossip.robust) costs an honest swarm, against the
weighted mean measured in the same command:

1. quality: N GossipTrainers (the tests' TINY GPT, one-peer exponential, in-memory transport) train S
   steps with each rule from the same seeds; the honest nodes' mean validation loss and the
   swarm-average model's loss, as adaptive / weighted (target: at most 1.03, i.e. 3% worse).
2. compute: one round's mix of the default MoE model's tensors with one neighbour, adaptive_clip
   against weighted (median of repeated timings, interleaved).

Run from the repository root: .venv/bin/python -m bench.bench_robust [--only quality,compute] [--quick]
Figures go to docs/benchmarks.md ("Robust mixing").
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from bench.bench_training import SCHEDULES, tiny_trainer
from gossip.codecs import get_codec
from gossip.exchange import ExchangeSettings, GossipPeer
from gossip.lockstep import Lockstep
from gossip.memory import InMemoryNetwork
from gossip.mixing import MixingKind, MixingRule
from gossip.robust import Mixer
from node.algorithms.dsgd import GossipTrainer
from node.algorithms.lockstep import drive
from node.train.data import embedded_corpus, peer_shard
from node.train.models import build_named_model
from node.train.trainer import average_tensors

QUALITY_TARGET = 1.03
CORPUS_BYTES = 600_000
RULES = (MixingKind.WEIGHTED, MixingKind.ADAPTIVE_CLIP)


@dataclass(frozen=True)
class QualityResult:
    algorithm: str
    seed: int
    rule: str
    node_loss: float  # mean of the nodes' own validation losses after S steps
    average_loss: float  # the swarm-average model's
    clipped: int  # neighbour values clipped, all nodes together
    rounds: int


async def train_swarm(algorithm: str, rule: MixingKind, seed: int, nodes: int, steps: int, batch: int) -> QualityResult:
    corpus = embedded_corpus(size_bytes=CORPUS_BYTES)
    optimizer = replace(SCHEDULES[algorithm], total_steps=steps)
    ids = [f"s{seed}-peer{i}" for i in range(nodes)]
    net = InMemoryNetwork()
    trainers = [tiny_trainer(corpus, optimizer, pid, seed, batch, peer_shard(corpus, pid)) for pid in ids]
    try:
        swarm = []
        for trainer in trainers:
            settings = ExchangeSettings(swarm="bench", config_hash="0" * 64, codec=get_codec("fp32"),
                                        exchange_timeout_s=60.0, rule=MixingRule(rule))
            peer = GossipPeer(net.transport(trainer.peer_id), settings, await trainer.tensors())
            await peer.start()
            swarm.append(GossipTrainer(trainer, peer))
        async with asyncio.timeout(3600):
            await drive(swarm, steps, Lockstep(ids, "one-peer-exp"))
        losses = [await t.evaluate() for t in trainers]
        average = await trainers[0].evaluate(average_tensors([await t.tensors() for t in trainers]))
        return QualityResult(algorithm, seed, str(rule), float(np.mean(losses)), average,
                             sum(n.peer.stats.clipped for n in swarm), sum(n.peer.stats.rounds for n in swarm))
    finally:
        for trainer in trainers:
            trainer.close()


def report_quality(results: list[QualityResult]) -> list[str]:
    lines = ["| optimizer | seed | weighted: nodes / average | adaptive_clip: nodes / average | ratio nodes | "
             "ratio average | clipped / rounds |", "|---|---:|---:|---:|---:|---:|---:|"]
    ratios = []
    by_key = {(r.algorithm, r.seed, r.rule): r for r in results}
    for algorithm, seed in sorted({(r.algorithm, r.seed) for r in results}):
        w, a = by_key[(algorithm, seed, "weighted")], by_key[(algorithm, seed, "adaptive_clip")]
        ratios += [a.node_loss / w.node_loss, a.average_loss / w.average_loss]
        lines.append(f"| {algorithm} | {seed} | {w.node_loss:.4f} / {w.average_loss:.4f} | {a.node_loss:.4f} / "
                     f"{a.average_loss:.4f} | {a.node_loss / w.node_loss:.4f} | {a.average_loss / w.average_loss:.4f} | "
                     f"{a.clipped} / {a.rounds} |")
    worst = max(ratios)
    lines.append(f"\nworst ratio {worst:.4f} (target <= {QUALITY_TARGET}: {'met' if worst <= QUALITY_TARGET else 'MISSED'})")
    return lines


def compute_times(repeats: int) -> list[str]:
    """One round's mix of the default model's tensors (fp32) with one neighbour, per rule."""
    model = build_named_model("moe", seed=0)
    own = {n: p.detach().reshape(-1).numpy().copy() for n, p in model.named_parameters()}
    rng = np.random.default_rng(0)
    theirs = {n: (x + 1e-3 * rng.standard_normal(x.size)).astype(np.float32) for n, x in own.items()}
    base = {n: (x - 1e-3 * rng.standard_normal(x.size)).astype(np.float32) for n, x in own.items()}
    numel = sum(x.size for x in own.values())
    mixers = {rule: Mixer(MixingRule(rule)) for rule in RULES}
    times: dict[MixingKind, list[float]] = {rule: [] for rule in RULES}
    for _ in range(repeats):
        for rule in RULES:
            started = time.perf_counter()
            mixers[rule].mix(own, {"peer": theirs}, 0.5, {"peer": 0.5}, base)
            times[rule].append(time.perf_counter() - started)
    weighted = statistics.median(times[MixingKind.WEIGHTED])
    adaptive = statistics.median(times[MixingKind.ADAPTIVE_CLIP])
    return [f"default MoE model, {numel / 1e6:.2f}M parameters in {len(own)} tensors, one neighbour, "
            f"median of {repeats}: weighted {weighted * 1e3:.1f} ms, adaptive_clip {adaptive * 1e3:.1f} ms "
            f"({adaptive / weighted:.2f}x)"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_robust", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="quality,compute")
    parser.add_argument("--quick", action="store_true", help="one seed, fewer steps (a smoke run, not the figures)")
    parser.add_argument("--nodes", type=int, default=5)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    only = set(args.only.split(","))
    steps, seeds = (20, 1) if args.quick else (args.steps, args.seeds)
    print(f"# bench_robust on {platform.node()}: {args.nodes} nodes, {steps} steps, seeds 0..{seeds - 1}")
    if "quality" in only:
        results = []
        for algorithm in ("dadam", "dsgd"):
            for seed in range(seeds):
                for rule in RULES:
                    result = asyncio.run(train_swarm(algorithm, rule, seed, args.nodes, steps, batch=8))
                    print(f"  {algorithm} seed {seed} {rule}: nodes {result.node_loss:.4f} "
                          f"average {result.average_loss:.4f}", flush=True)
                    results.append(result)
        print("\n".join(report_quality(results)))
    if "compute" in only:
        print("\n".join(compute_times(5 if args.quick else 30)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
