"""Data pipeline throughput against the training step: whether one peer's `ShardStream` delivers tokens as
fast as a training step of hf-tiny-llama consumes them, both in this run on this machine.

The stream reads jsonl records, BPE-tokenizes them with `tokenizers` in its reader thread and packs them
into windows; its tokens per second are printed as a ratio to the step's. A ratio above 1 means the stream
keeps the step fed; the stream runs off the event loop and off the training thread, so it overlaps the
step.

Run from the repository root: .venv/bin/python -m bench.bench_data [--mib 8] [--vocab 8192] [--steps 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from node.swarm.recipe import optimizer_config
from node.train.data import synthetic_text
from node.train.models.hf import build_hf_model, read_source
from node.train.shards import ShardStream, open_dataset
from node.train.tokenizer import BpeTokenizer, ByteTokenizer, TextTokenizer, train_bpe
from node.train.trainer import Trainer, TrainerConfig

BATCH, CONTEXT = 16, 128


def write_jsonl(directory: Path, mib: int) -> int:
    stories = [s for s in synthetic_text(1, mib << 20).decode().split("\n\n") if s]
    with open(directory / "data.jsonl", "w") as f:
        for i, story in enumerate(stories):
            f.write(json.dumps({"id": i, "text": story}) + "\n")
    return len(stories)


def stream_tokens_per_s(directory: Path, tokenizer: TextTokenizer, tokens: int) -> float:
    """Tokens/s of a fresh stream delivering `tokens` tokens in training-sized batches (reader thread included)."""
    stream = ShardStream(open_dataset(directory), tokenizer, "bench")
    try:
        started, taken = time.perf_counter(), 0
        while taken < tokens:
            stream.train_batch(BATCH, CONTEXT)
            taken += BATCH * (CONTEXT + 1)
        return taken / (time.perf_counter() - started)
    finally:
        stream.close()


def step_tokens_per_s(vocab: int, steps: int) -> float:
    """Tokens/s a training step of hf-tiny-llama (batch 16 x context 128, Adam, fp32, CPU) consumes."""
    model = build_hf_model(read_source("hf-tiny-llama", vocab).config, seed=0)
    tokens = torch.randint(vocab, (1 << 20,), dtype=torch.int64)
    config = TrainerConfig(optimizer=optimizer_config("dadam", 1e-3, 0, 0, 1, 1), batch_size=BATCH, context=CONTEXT,
                           device="cpu", precision="fp32")

    async def run() -> float:
        async with Trainer(model, config, peer_id="bench", train_tokens=tokens, val_tokens=tokens[:4096]) as trainer:
            await trainer.train_step()  # warm-up
            started = time.perf_counter()
            for _ in range(steps):
                await trainer.train_step()
            return steps * BATCH * CONTEXT / (time.perf_counter() - started)

    return asyncio.run(run())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_data", description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=8, help="jsonl data to write (default 8 MiB)")
    parser.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary (default 8192)")
    parser.add_argument("--steps", type=int, default=20, help="training steps timed (default 20)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        root = Path(tmp)
        (root / "data").mkdir()
        records = write_jsonl(root / "data", args.mib)
        started = time.perf_counter()
        with open(root / "data" / "data.jsonl") as lines:
            train_bpe((json.loads(line)["text"] for line in lines), args.vocab, root / "tokenizer.json")
        train_s = time.perf_counter() - started
        bpe = BpeTokenizer((root / "tokenizer.json").read_bytes())
        budget = 400_000
        bpe_rate = stream_tokens_per_s(root / "data", bpe, budget)
        byte_rate = stream_tokens_per_s(root / "data", ByteTokenizer(), budget)
    step_rate = step_tokens_per_s(args.vocab, args.steps)
    print(f"command: {sys.executable} -m bench.bench_data {' '.join(argv)}".rstrip())
    print(f"data: {args.mib} MiB jsonl, {records} records; BPE of {args.vocab} tokens trained in {train_s:.1f} s; "
          f"python {platform.python_version()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} torch thread(s)")
    print(f"baseline: hf-tiny-llama training step, batch {BATCH} x context {CONTEXT}: {step_rate:,.0f} tokens/s")
    print()
    print("| stream (one reader thread) | tokens/s | ratio to the step |")
    print("|---|---:|---:|")
    print(f"| jsonl + BPE ({args.vocab}) | {bpe_rate:,.0f} | {bpe_rate / step_rate:.1f}x |")
    print(f"| jsonl + bytes | {byte_rate:,.0f} | {byte_rate / step_rate:.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
