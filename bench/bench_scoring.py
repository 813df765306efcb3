"""What one scored round of contribution scoring (gossip.scoring, node.swarm.contribution) costs a node: the
trainer's `moved_losses` over `--score-sequences` held-out windows with 1 and 4 neighbours (2 + n forward
passes), against one training step and one evaluation of the same model, on one torch thread (the median
of `--repeats` timings, interleaved).

Run from the repository root: .venv/bin/python -m bench.bench_scoring [--models tiny,moe] [--sequences 16]
Figures go to docs/benchmarks.md ("Contribution scoring").
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from node.train.data import embedded_corpus, peer_shard
from node.train.models import build_model, build_named_model
from node.train.trainer import Trainer, TrainerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.tiny_model import TINY

CORPUS_BYTES = 600_000
MODELS = {"tiny": (lambda: build_model(TINY), TINY.context),  # the tests' model
          "moe": (lambda: build_named_model("moe", seed=0), 128)}  # the embedded default, its default context


async def measure(name: str, sequences: int, repeats: int) -> dict[str, float]:
    build, context = MODELS[name]
    corpus = embedded_corpus(size_bytes=CORPUS_BYTES)
    config = TrainerConfig(batch_size=16, context=context, device="cpu", precision="fp32")
    trainer = Trainer(build(), config, peer_id="bench", train_tokens=peer_shard(corpus, "bench"), val_tokens=corpus.val)
    try:
        own = await trainer.tensors()
        times: dict[str, list[float]] = {"1 neighbour": [], "4 neighbours": [], "training step": [], "evaluation": []}
        await trainer.moved_losses(own, [(own, 0.5)] * 2, sequences, 300.0)  # warm-up
        for _ in range(repeats):
            for label, n in (("1 neighbour", 1), ("4 neighbours", 4)):
                started = time.perf_counter()
                await trainer.moved_losses(own, [(own, 0.5)] * (n + 1), sequences, 300.0)
                times[label].append(time.perf_counter() - started)
            started = time.perf_counter()
            await trainer.train_step()
            times["training step"].append(time.perf_counter() - started)
            started = time.perf_counter()
            await trainer.evaluate()
            times["evaluation"].append(time.perf_counter() - started)
        return {label: statistics.median(values) for label, values in times.items()}
    finally:
        trainer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,moe")
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread, "
          f"{args.sequences} held-out sequences, median of {args.repeats}")
    print("| model | scored round, 1 neighbour | scored round, 4 neighbours | training step | evaluation (8 x 32) |")
    print("|---|---:|---:|---:|---:|")
    for name in args.models.split(","):
        t = asyncio.run(measure(name, args.sequences, args.repeats))
        print(f"| {name} | {t['1 neighbour']:.2f} s | {t['4 neighbours']:.2f} s | {t['training step']:.2f} s | "
              f"{t['evaluation']:.2f} s |", flush=True)


if __name__ == "__main__":
    main()
