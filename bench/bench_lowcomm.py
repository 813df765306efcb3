"""Low-communication training benchmarks, each against baselines run in the same command:

1. quality: validation loss against bytes at the same token budget. 4 nodes (the real GossipPeer /
   DilocoTrainer code over the in-memory transport, gossip/memory.py, one-peer exponential, rounds
   started together) against one process with the 4x batch: DAdam fp32 (every step a round) and gossip
   DiLoCo at H in {25, 100} with fp32, int8 and top-k (error feedback), with and without streaming
   (4 fragments, overlapped), and SparseLoCo payloads (chunked top-k 2% with 2-bit values and error
   feedback). Per setup: the final swarm-average validation loss (the final merge's model), its ratio to
   the single process and to DAdam fp32, bytes per node per step and their ratio to DAdam fp32's, and
   the bits per parameter per inner step a node sends (headers and anchors included, the one final
   merge not); medians over seeds. Target: a setup at <= 1% of DAdam fp32's bytes within 3% of its
   loss. Other setups plug in through `EXTRA_SETUPS` (e.g. DAdam with compressed gossip).
   Against training apart and data-parallel training: `no communication` (each node on its shard alone, the
   mean of their own models' losses), DiLoCo with the exact average (`complete` graph, 1/n each) beside
   gossip's one-peer mixing, and the share of the single process's improvement over no communication each
   arm recovers. `--warm-start STEPS` starts every arm from the single process trained that long.
2. overlap: time per inner step of gossip DiLoCo whose outer exchanges run over a rate-limited link
   (the in-memory transport's bandwidth model, 20 Mbit/s and 25 ms each way), overlapped with the next
   phase or not, against inner steps alone; compute is a fixed sleep per step in a forward hook (a GPU
   step, which leaves the CPU free), on the default dense model's parameters (870,656). Target: the
   overlapped step within 10% of the inner step alone.

The model of part 1 is the tests' TINY GPT (2 layers, width 64, context 32; 100,992 parameters) on the
embedded 4 MB corpus, so that a seed's runs take minutes on two shared cores.

Run from the repository root: .venv/bin/python -m bench.bench_lowcomm [--only quality,overlap] [--seeds 0,1,2]
[--steps 600] [--setups "NAME;..."] [--warm-start STEPS] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from gossip.codecs import get_codec
from gossip.diloco import DilocoConfig, SyncSchedule
from gossip.exchange import ExchangeSettings, GossipPeer
from gossip.lockstep import Lockstep
from gossip.memory import InMemoryNetwork, LinkModel
from gossip.optimizers import OptimizerConfig
from node.algorithms.diloco.trainer import DilocoTrainer
from node.algorithms.dsgd import GossipTrainer
from node.algorithms.lockstep import drive
from node.train.data import Corpus, embedded_corpus, peer_shard
from node.train.models import DENSE_DEFAULT, ModelConfig, build_model
from node.train.trainer import Trainer, TrainerConfig, average_tensors, train_alone
from topology import MembershipView, PeerRound, build_topology, peer_round

TINY = ModelConfig(context=32, layers=2, width=64, heads=4, experts=0, expert_hidden=128)
NODES, BATCH = 4, 8
TOPOLOGY = "one-peer-exp"
BYTES_TARGET, LOSS_TARGET = 0.01, 1.03  # of DAdam fp32's bytes, and of its loss
OVERLAP_TARGET = 1.10
EXCHANGE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Setup:
    """One way to train the swarm (or the single process) for the quality table."""

    name: str
    kind: str  # "single", "alone", "dadam", "diloco"
    lr: float
    local_steps: int = 1
    codec: str = "fp32"
    codec_options: tuple[tuple[str, float], ...] = ()
    fragments: int = 1
    overlap: bool = False
    outer_lr: float = 1.0  # the grid's, not the recipe's defaults (0.7, Nesterov 0.9): docs/benchmarks.md
    outer_momentum: float = 0.0
    anchor_every: int = 1
    anchor_codec: str = "int8"
    topology: str = TOPOLOGY  # "complete": every node mixes with all the others at 1/n, an exact average

    def optimizer(self, steps: int) -> OptimizerConfig:
        algorithm = "diloco" if self.kind == "diloco" else "dadam"  # "alone" trains with DAdam's inner AdamW
        return OptimizerConfig(algorithm=algorithm, lr=self.lr, warmup_steps=steps // 10, total_steps=steps,
                               clip_norm=1.0, local_steps=self.local_steps)


@dataclass(frozen=True)
class Result:
    setup: str
    seed: int
    loss: float  # validation loss of the swarm-average model (the single process's own)
    bytes_per_step: float  # sent + received per node per step, every protocol of the setup
    merge_per_step: float = 0.0  # of which the final merge (once per run)
    consensus: float = 0.0  # ||x_i - mean|| / ||mean|| over the nodes' final models (before averaging)
    sent_bits_per_param: float = 0.0  # bits a node sends per parameter per inner step (without the final merge)
    seconds: float = 0.0


# Inner learning rates, each the best of a sweep on seed 0 at this budget: the tests' 1.5e-2 is tuned for
# 80 steps and falls behind at 400-800 (see docs/benchmarks.md, "Low-communication training").
SINGLE_LR, DADAM_LR, DILOCO_LR = 5e-3, 5e-3, 5e-3
SPARSELOCO_OPTIONS = (("ratio", 0.02), ("chunk", 4096), ("bits", 2))


BASELINES = ("single process", "no communication", "DAdam fp32")  # run whatever --setups names


def default_setups() -> list[Setup]:
    setups = [Setup("single process", "single", SINGLE_LR), Setup("no communication", "alone", SINGLE_LR),
              Setup("DAdam fp32", "dadam", DADAM_LR)]
    # the exact average (all-reduce) of the pseudo-gradients, against which gossip's one-peer mixing is measured
    setups += [Setup(f"DiLoCo H={h} int8 + EF, exact average", "diloco", DILOCO_LR, h, "int8", topology="complete")
               for h in (25, 100)]
    for h in (25, 100):
        for codec, options in (("fp32", ()), ("int8", ()), ("topk", (("ratio", 0.01),))):
            label = "top-k 1% + EF" if codec == "topk" else codec + (" + EF" if codec == "int8" else "")
            setups.append(Setup(f"DiLoCo H={h} {label}", "diloco", DILOCO_LR, h, codec, options))
            setups.append(Setup(f"DiLoCo H={h} {label}, 4 fragments overlapped", "diloco", DILOCO_LR, h, codec,
                                options, fragments=4, overlap=True))
    # the trade-off below H = 25, and DiLoCo's own outer step (lr 0.7, Nesterov 0.9)
    setups += [Setup(f"DiLoCo H={h} int8 + EF", "diloco", DILOCO_LR, h, "int8") for h in (5, 10)]
    setups += [Setup(f"DiLoCo H={h} int8 + EF, outer lr 0.7 + Nesterov 0.9", "diloco", DILOCO_LR, h, "int8",
                     outer_lr=0.7, outer_momentum=0.9) for h in (25, 100)]
    # SparseLoCo payloads for the pseudo-gradients; anchors (whole parameters) stay int8 + EF, mixed at every
    # sync or at every 4th, since at 0.2 bits per parameter per message the anchors' 8 dominate otherwise
    for h in (10, 25, 100):
        for every in (1, 4):
            setups.append(Setup(f"DiLoCo H={h} sparseloco 2% 2-bit + EF" + (f", anchors every {every}th sync"
                                                                            if every > 1 else ""),
                                "diloco", DILOCO_LR, h, "sparseloco", SPARSELOCO_OPTIONS, anchor_every=every))
    # and with DiLoCo's own outer step: what is then mixed, sparsified, is the next momentum buffer (mu b + Δ)
    setups += [Setup(f"DiLoCo H={h} sparseloco 2% 2-bit + EF, outer lr 0.7 + Nesterov 0.9", "diloco", DILOCO_LR, h,
                     "sparseloco", SPARSELOCO_OPTIONS, outer_lr=0.7, outer_momentum=0.9) for h in (25, 100)]
    return setups


# More setups by name, run after the default ones: async (corpus, seed, steps) -> Result. A module of
# bench/ may register one here (e.g. DAdam with compressed gossip of differences).
EXTRA_SETUPS: dict[str, Callable[[Corpus, int, int], Awaitable[Result]]] = {}


def tiny_trainer(corpus: Corpus, optimizer: OptimizerConfig, peer_id: str, seed: int, batch: int,
                 tokens: torch.Tensor) -> Trainer:
    config = TrainerConfig(optimizer=optimizer, batch_size=batch, context=TINY.context, device="cpu",
                           precision="fp32", eval_batch_size=64, eval_batches=8)
    return Trainer(build_model(TINY, seed=seed), config, peer_id=peer_id, train_tokens=tokens, val_tokens=corpus.val)


def settings(codec: str, options: tuple[tuple[str, float], ...] = ()) -> ExchangeSettings:
    return ExchangeSettings(swarm="bench", config_hash="0" * 64, codec=get_codec(codec, **dict(options)),
                            exchange_timeout_s=EXCHANGE_TIMEOUT_S)


def numel(model: dict[str, np.ndarray]) -> int:
    return sum(t.size for t in model.values())


def spread(models: Sequence[dict[str, np.ndarray]]) -> float:
    """sqrt(mean_i ||x_i - mean||^2) / ||mean||."""
    mean = average_tensors(models)
    num = sum(float(np.square(m[n].astype(np.float64) - mean[n]).sum()) for m in models for n in mean) / len(models)
    den = sum(float(np.square(mean[n].astype(np.float64)).sum()) for n in mean)
    return float(np.sqrt(num / den))


Warm = dict[str, np.ndarray] | None  # the parameters every arm starts from (--warm-start), None: the seed's init


async def warm_start(corpus: Corpus, seed: int, steps: int) -> dict[str, np.ndarray]:
    """The single process (batch NODES x BATCH) trained `steps` steps from the seed's init: the checkpoint
    every arm of a --warm-start run starts from, as the DiLoCo papers start from a pretrained model."""
    optimizer = OptimizerConfig(algorithm="dadam", lr=SINGLE_LR, warmup_steps=steps // 10, total_steps=steps,
                                clip_norm=1.0)
    async with tiny_trainer(corpus, optimizer, f"s{seed}-warm", seed, NODES * BATCH, corpus.train) as trainer:
        await train_alone(trainer, steps)
        return await trainer.tensors()


async def _started(trainer: Trainer, warm: Warm) -> Trainer:
    if warm is not None:  # the parameters only: each arm's optimizer and schedule start afresh
        await trainer.load_tensors(warm)
    return trainer


async def run_single(corpus: Corpus, setup: Setup, seed: int, steps: int, warm: Warm = None) -> Result:
    async with tiny_trainer(corpus, setup.optimizer(steps), f"s{seed}-single", seed, NODES * BATCH,
                            corpus.train) as trainer:
        await _started(trainer, warm)
        await train_alone(trainer, steps)
        return Result(setup.name, seed, await trainer.evaluate(), 0.0)


async def run_alone(corpus: Corpus, setup: Setup, seed: int, steps: int, warm: Warm = None) -> Result:
    """Training apart: each node on its own shard, never communicating; its loss is the mean of the nodes'
    own models' (averaging them at the end would be a communication)."""
    losses, finals = [], []
    for i in range(NODES):
        pid = f"s{seed}-peer{i}"
        async with tiny_trainer(corpus, setup.optimizer(steps), pid, seed, BATCH, peer_shard(corpus, pid)) as trainer:
            await _started(trainer, warm)
            await train_alone(trainer, steps)
            losses.append(await trainer.evaluate())
            finals.append(await trainer.tensors())
    return Result(setup.name, seed, statistics.fmean(losses), 0.0, consensus=spread(finals))


async def run_dadam(corpus: Corpus, setup: Setup, seed: int, steps: int, warm: Warm = None) -> Result:
    ids = [f"s{seed}-peer{i}" for i in range(NODES)]
    net = InMemoryNetwork()
    trainers = [tiny_trainer(corpus, setup.optimizer(steps), pid, seed, BATCH, peer_shard(corpus, pid)) for pid in ids]
    try:
        nodes = []
        for pid, trainer in zip(ids, trainers, strict=True):
            await _started(trainer, warm)
            peer = GossipPeer(net.transport(pid), settings(setup.codec, setup.codec_options), await trainer.tensors())
            await peer.start()
            nodes.append(GossipTrainer(trainer, peer))
        lockstep = Lockstep(ids, setup.topology)
        await drive(nodes, steps, lockstep)
        finals = [await t.tensors() for t in trainers]
        loss = await trainers[0].evaluate(average_tensors(finals))
        moved = sum(n.peer.stats.bytes_sent + n.peer.stats.bytes_received for n in nodes) / NODES
        sent = sum(n.peer.stats.bytes_sent for n in nodes) / NODES
        return Result(setup.name, seed, loss, moved / steps, spread(finals),
                      sent_bits_per_param=8 * sent / steps / numel(finals[0]))
    finally:
        for trainer in trainers:
            trainer.close()


async def run_diloco(corpus: Corpus, setup: Setup, seed: int, steps: int, warm: Warm = None) -> Result:
    ids = [f"s{seed}-peer{i}" for i in range(NODES)]
    net = InMemoryNetwork()
    optimizer = setup.optimizer(steps)
    trainers = [tiny_trainer(corpus, optimizer, pid, seed, BATCH, peer_shard(corpus, pid)) for pid in ids]
    config = DilocoConfig(outer_lr=setup.outer_lr, outer_momentum=setup.outer_momentum, fragments=setup.fragments,
                          overlap=setup.overlap, anchor_every=setup.anchor_every, anchor_codec=setup.anchor_codec)
    nodes = []
    try:
        for pid, trainer in zip(ids, trainers, strict=True):
            await _started(trainer, warm)
            schedule = SyncSchedule(setup.local_steps, setup.fragments, optimizer.schedule.lr_at)
            node = DilocoTrainer(trainer, net.transport(pid), settings(setup.codec, setup.codec_options), config,
                                 schedule)
            await node.start()
            nodes.append(node)
        await drive(nodes, steps, Lockstep(ids, setup.topology), last=steps)
        finals = [node.anchor for node in nodes]
        # the final merge: every node ends on the average of the nodes' final models
        loss = await trainers[0].evaluate(average_tensors(finals))
        moved = sum(sum(node.outer_bytes) for node in nodes) / NODES
        sent = sum(node.outer_bytes[0] for node in nodes) / NODES
        # the merge itself moves (n - 1) fp32 models in and out per node, once per run
        merge = 2 * (NODES - 1) * 4 * sum(t.size for t in finals[0].values())
        return Result(setup.name, seed, loss, (moved + merge) / steps, merge_per_step=merge / steps,
                      consensus=spread(finals), sent_bits_per_param=8 * sent / steps / numel(finals[0]))
    finally:
        for node in nodes:
            await node.close()
        for trainer in trainers:
            trainer.close()


RUNNERS = {"single": run_single, "alone": run_alone, "dadam": run_dadam, "diloco": run_diloco}


async def quality(seeds: Sequence[int], steps: int, names: set[str] | None, warm_steps: int = 0) -> list[Result]:
    corpus = embedded_corpus()
    results = []
    for seed in seeds:
        warm = await warm_start(corpus, seed, warm_steps) if warm_steps else None
        for setup in default_setups():
            if names is not None and setup.name not in names and setup.name not in BASELINES:
                continue
            started = time.perf_counter()
            result = await RUNNERS[setup.kind](corpus, setup, seed, steps, warm)
            result = Result(**{**result.__dict__, "seconds": time.perf_counter() - started})
            results.append(result)
            print(f"  {setup.name}, seed {seed}: loss {result.loss:.4f}, {result.bytes_per_step:,.0f} B/node/step, "
                  f"spread {result.consensus:.2e}, {result.seconds:.0f} s", file=sys.stderr, flush=True)
        for name, run in EXTRA_SETUPS.items():
            if names is None or name in names:
                results.append(await run(corpus, seed, steps))
    return results


def report_quality(results: Sequence[Result], setups: Sequence[Setup]) -> list[str]:
    by = {}
    for r in results:
        by.setdefault(r.setup, []).append(r)
    single = {r.seed: r.loss for r in by["single process"]}
    alone = {r.seed: r.loss for r in by.get("no communication", [])}
    dadam = {r.seed: r for r in by["DAdam fp32"]}
    lrs = {s.name: s for s in setups}
    lines = ["| setup | inner lr | loss (median) | / single process | / DAdam fp32 | bytes per node per step | "
             "/ DAdam fp32 bytes | without the final merge | sent bits / param / inner step | node spread | "
             "recovered | target |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, rs in by.items():
        loss = statistics.median(r.loss for r in rs)
        to_single = statistics.median(r.loss / single[r.seed] for r in rs)
        to_dadam = statistics.median(r.loss / dadam[r.seed].loss for r in rs)
        moved = statistics.median(r.bytes_per_step for r in rs)
        to_bytes = statistics.median(r.bytes_per_step / dadam[r.seed].bytes_per_step for r in rs)
        no_merge = statistics.median((r.bytes_per_step - r.merge_per_step) / dadam[r.seed].bytes_per_step for r in rs)
        met = to_bytes <= BYTES_TARGET and to_dadam <= LOSS_TARGET
        verdict = ("met" if met else "-") if name not in BASELINES else ""
        # the share of the data-parallel baseline's improvement over training apart that this arm recovers
        gaps = [(alone[r.seed] - r.loss) / (alone[r.seed] - single[r.seed]) for r in rs
                if r.seed in alone and alone[r.seed] != single[r.seed]]
        recovered = f"{statistics.median(gaps):.0%}" if gaps else "-"
        setup = lrs.get(name)
        lines.append(f"| {name} | {setup.lr if setup else '-'} | {loss:.4f} | {to_single:.3f}x | {to_dadam:.3f}x | "
                     f"{moved:,.0f} | {to_bytes:.4f} | {no_merge:.4f} | "
                     f"{statistics.median(r.sent_bits_per_param for r in rs):.4f} | "
                     f"{statistics.median(r.consensus for r in rs):.1e} | {recovered} | "
                     f"{verdict} |")
    lines += ["", "per seed (loss, bytes per node per step):"]
    for name, rs in by.items():
        lines.append(f"- {name}: " + "; ".join(f"seed {r.seed} {r.loss:.4f} {r.bytes_per_step:,.0f}" for r in rs))
    return lines


# ---- 2. overlap ----------------------------------------------------------------------------------------


@dataclass
class OverlapRun:
    mode: str
    step_s: list[float] = field(default_factory=list)


async def overlap_run(mode: str, steps: int, local_steps: int, compute_s: float, link: LinkModel,
                      fragments: int) -> OverlapRun:
    """Two nodes of the default dense model's size; mode "local" (inner steps alone), "sync" (DiLoCo,
    exchanges awaited at each sync) or "overlap" (DiLoCo, exchanges run during the next phase)."""
    corpus = embedded_corpus(size_bytes=600_000)
    ids = ["peer-a", "peer-b"]
    optimizer = OptimizerConfig(algorithm="diloco", lr=1e-3, local_steps=local_steps)
    model_config = DENSE_DEFAULT
    trainers = []
    for pid in ids:
        config = TrainerConfig(optimizer=optimizer, batch_size=1, context=8, device="cpu", precision="fp32")
        trainer = Trainer(build_model(model_config, seed=0), config, peer_id=pid, train_tokens=peer_shard(corpus, pid),
                          val_tokens=corpus.val)
        trainer.model.register_forward_pre_hook(lambda module, args: time.sleep(compute_s))
        trainers.append(trainer)
    net = InMemoryNetwork(link)
    run = OverlapRun(mode)
    nodes = []
    try:
        for pid, trainer in zip(ids, trainers, strict=True):
            node = DilocoTrainer(trainer, net.transport(pid), settings("int8"),
                                 DilocoConfig(fragments=fragments, overlap=mode == "overlap"),
                                 SyncSchedule(local_steps, fragments, optimizer.schedule.lr_at))
            await node.start()
            nodes.append(node)
        view = MembershipView.of(ids)
        topo = build_topology(TOPOLOGY, 2)

        async def one(node: DilocoTrainer) -> list[float]:
            async def plan(fragment: int, round_index: int) -> PeerRound:
                return peer_round(topo, view, node.trainer.peer_id, round_index)

            times = []
            for _ in range(steps):
                started = time.perf_counter()
                if mode == "local":
                    await node.trainer.train_step()
                else:
                    await node.step(plan)
                times.append(time.perf_counter() - started)
            return times

        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(node)) for node in nodes]
        # the first phase warms up; after it, a step's time is the slower node's
        per_step = np.max([task.result() for task in tasks], axis=0)
        run.step_s = list(per_step[local_steps:])
    finally:
        for node in nodes:
            await node.close()
        for trainer in trainers:
            trainer.close()
    return run


async def overlap(phases: int, local_steps: int, compute_s: float, fragments: int) -> list[str]:
    link = LinkModel(latency_s=0.025, bandwidth_bytes_per_s=20e6 / 8)
    params = sum(p.numel() for p in build_model(DENSE_DEFAULT, seed=0).parameters())
    steps = (phases + 1) * local_steps
    runs = [await overlap_run(mode, steps, local_steps, compute_s, link, fragments)
            for mode in ("local", "overlap", "sync")]
    base = statistics.mean(runs[0].step_s)
    lines = [f"two nodes, {params:,} parameters, int8 pseudo-gradients and anchors, H = {local_steps}, "
             f"{fragments} fragment(s), compute {compute_s} s per step, link 20 Mbit/s and 25 ms each way; "
             f"{phases} phases timed after one warm-up phase", "",
             "| mode | mean s per inner step | / inner steps alone | max s per step | target |", "|---|---:|---:|---:|---|"]
    for run in runs:
        mean = statistics.mean(run.step_s)
        verdict = f"<= {OVERLAP_TARGET}: {'met' if mean / base <= OVERLAP_TARGET else 'MISSED'}" \
            if run.mode == "overlap" else ""
        lines.append(f"| {run.mode} | {mean:.3f} | {mean / base:.3f}x | {max(run.step_s):.3f} | {verdict} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="quality,overlap")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--setups", help="setup names separated by \";\" (the baselines always run)")
    parser.add_argument("--phases", type=int, default=6, help="overlap: phases timed")
    parser.add_argument("--quick", action="store_true", help="one seed, 200 steps, 2 phases: a smoke run")
    parser.add_argument("--warm-start", type=int, default=0, metavar="STEPS",
                        help="quality: every arm starts from the single process trained this many steps (0: from "
                             "the seed's init)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    steps, phases = args.steps, args.phases
    if args.quick:
        seeds, steps, phases = seeds[:1], 200, 2
    only = set(args.only.split(","))
    print(f"# bench_lowcomm: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}", flush=True)
    if "quality" in only:
        names = {n.strip() for n in args.setups.split(";")} if args.setups else None
        results = asyncio.run(quality(seeds, steps, names, args.warm_start))
        print(f"\n## quality against bytes: {NODES} nodes x {steps} steps of batch {BATCH} vs one process of batch "
              f"{NODES * BATCH}, seeds {seeds}"
              + (f", every arm warm-started from the single process at step {args.warm_start}" if args.warm_start
                 else "") + "\n")
        print("\n".join(report_quality(results, default_setups())), flush=True)
    if "overlap" in only:
        print("\n## overlap\n")
        print("\n".join(asyncio.run(overlap(phases, local_steps=10, compute_s=0.3, fragments=4))), flush=True)
    print(f"# load average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
