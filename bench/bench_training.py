"""Training benchmarks, each against a baseline measured in the same command:

1. target: steps to a target validation loss, 4 GossipTrainers (batch B each, one-peer exponential,
   D-SGD and DAdam, in-memory transport) against one process with batch 4B and the same schedule.
   The targets are fractions of the way from the initial loss to the single process's final loss;
   the swarm-average model is evaluated every k steps (target: the overlapped DAdam swarm needs at
   most 1.3x the single process's steps). The model is the tests' TINY GPT (about 0.1M parameters),
   so that it runs in minutes on two shared cores.
2. overlap: wall time per step of DAdam on the default model with real p2pd transports on loopback:
   (a) local steps only, (b) overlapped (x_t exchanged while g(x_t) is computed), (c) the same
   exchange done before the compute; (b)/(a) and (c)/(a) (target: (b)/(a) < 1.15).
3. accum (only when asked: --only accum): DAdam against AccumAdam (--adam-accumulate K) at a small
   local batch (4 nodes x batch 2 by default), the swarm-average model's validation loss over S steps,
   each seed against one process with batch 4 x 2 and plain Adam on the same schedule.
4. join (only when asked: --only join): a fresh trainer (Adam moments at zero) that took a trained
   donor's parameters at step S, with the schedule's warm-up run again from there (Trainer.start_from_download)
   and without it (the full rate at once), against the donor itself going on with its own moments; the
   validation loss 1-16 steps after the download, as ratios to the donor's at the same step.

Run from the repository root: .venv/bin/python -m bench.bench_training [--only target,overlap,accum,join] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from bench.bench_exchange import _run_async, _show_exchange_logs, connect_all, p2pd_daemons, transports_on
from gossip.codecs import get_codec
from gossip.exchange import ExchangeSettings, GossipPeer
from gossip.lockstep import Lockstep
from gossip.memory import InMemoryNetwork
from gossip.optimizers import OptimizerConfig
from node.algorithms.dsgd import GossipTrainer
from node.algorithms.lockstep import drive
from node.swarm.algorithm import PlanFor
from node.train.data import Corpus, embedded_corpus, peer_shard
from node.train.models import ModelConfig, build_model, build_named_model
from node.train.trainer import Trainer, TrainerConfig, average_tensors

# The tests' (tests/test_trainer.py) tiny model, per-node batch and tuned schedules.
TINY = ModelConfig(context=32, layers=2, width=64, heads=4, experts=0, expert_hidden=128)
NODES, BATCH = 4, 8
SCHEDULES = {
    "dsgd": OptimizerConfig(algorithm="dsgd", lr=0.5, warmup_steps=6, total_steps=60, clip_norm=1.0),
    "dadam": OptimizerConfig(algorithm="dadam", lr=1.5e-2, warmup_steps=8, total_steps=80, clip_norm=1.0),
}
FRACTIONS = (0.5, 0.8, 0.9, 1.0)
STEP_RATIO_TARGET = 1.3
OVERLAP_TARGET = 1.15
CORPUS_BYTES = 600_000
ROUND_TIMEOUT_S = 300.0
EXCHANGE_TIMEOUT_S = 60.0


def _settings() -> ExchangeSettings:
    return ExchangeSettings(swarm="bench", config_hash="0" * 64, codec=get_codec("fp32"),
                            exchange_timeout_s=EXCHANGE_TIMEOUT_S)


async def gossip_nodes(transports: Sequence, trainers: Sequence[Trainer]) -> list[GossipTrainer]:
    nodes = []
    for transport, trainer in zip(transports, trainers):
        peer = GossipPeer(transport, _settings(), await trainer.tensors())
        await peer.start()
        nodes.append(GossipTrainer(trainer, peer))
    return nodes


# ---- 1. steps to a target validation loss ----------------------------------------------------------


@dataclass(frozen=True)
class Curve:
    """Validation loss after each evaluated step count (0 = the initial model)."""

    steps: list[int]
    losses: list[float]

    def steps_to(self, target: float) -> int | None:
        return next((s for s, loss in zip(self.steps, self.losses) if loss <= target), None)


@dataclass(frozen=True)
class TargetResult:
    algorithm: str
    seed: int
    total_steps: int
    single: Curve
    swarm: Curve

    def target(self, fraction: float) -> float:
        initial, final = self.single.losses[0], self.single.losses[-1]
        return initial - fraction * (initial - final)


def tiny_trainer(corpus: Corpus, optimizer: OptimizerConfig, peer_id: str, seed: int, batch: int,
                 tokens: torch.Tensor, model: ModelConfig = TINY) -> Trainer:
    config = TrainerConfig(optimizer=optimizer, batch_size=batch, context=model.context, device="cpu",
                           precision="fp32", eval_batch_size=64, eval_batches=8)
    return Trainer(build_model(model, seed=seed), config, peer_id=peer_id, train_tokens=tokens, val_tokens=corpus.val)


async def single_curve(corpus: Corpus, optimizer: OptimizerConfig, seed: int, steps: int, every: int,
                       model: ModelConfig = TINY, batch: int = NODES * BATCH) -> Curve:
    async with tiny_trainer(corpus, optimizer, f"s{seed}-base", seed, batch, corpus.train, model) as alone:
        points, losses = [0], [await alone.evaluate()]
        while alone.step < steps:
            for _ in range(min(every, steps - alone.step)):
                await alone.train_step()
            points.append(alone.step)
            losses.append(await alone.evaluate())
    return Curve(points, losses)


async def swarm_curve(corpus: Corpus, optimizer: OptimizerConfig, seed: int, max_steps: int, every: int,
                      stop_below: float, min_steps: int, batch: int = BATCH) -> Curve:
    """The swarm-average model's loss every `every` steps, until it is at most `stop_below` (and at
    least `min_steps` were taken) or after `max_steps`."""
    ids = [f"s{seed}-peer{i}" for i in range(NODES)]
    net = InMemoryNetwork()
    trainers = [tiny_trainer(corpus, optimizer, pid, seed, batch, peer_shard(corpus, pid)) for pid in ids]
    try:
        nodes = await gossip_nodes([net.transport(pid) for pid in ids], trainers)
        lockstep = Lockstep(ids, "one-peer-exp")
        evaluator = trainers[0]
        points, losses = [0], [await evaluator.evaluate(average_tensors([await t.tensors() for t in trainers]))]
        while trainers[0].step < max_steps and (losses[-1] > stop_below or trainers[0].step < min_steps):
            chunk = min(every, max_steps - trainers[0].step)
            async with asyncio.timeout(ROUND_TIMEOUT_S):
                await drive(nodes, chunk, lockstep)
            points.append(trainers[0].step)
            losses.append(await evaluator.evaluate(average_tensors([await t.tensors() for t in trainers])))
    finally:
        for trainer in trainers:
            trainer.close()
    return Curve(points, losses)


async def steps_to_target(algorithm: str, seed: int, total_steps: int, every: int, max_factor: float,
                          corpus: Corpus) -> TargetResult:
    optimizer = replace(SCHEDULES[algorithm], total_steps=total_steps,
                        warmup_steps=min(SCHEDULES[algorithm].warmup_steps, total_steps // 10))
    single = await single_curve(corpus, optimizer, seed, total_steps, every)
    swarm = await swarm_curve(corpus, optimizer, seed, int(max_factor * total_steps), every,
                              stop_below=single.losses[-1], min_steps=total_steps)
    return TargetResult(algorithm, seed, total_steps, single, swarm)


def report_targets(results: list[TargetResult], every: int, max_factor: float) -> list[str]:
    lines = ["| schedule | seed | S | target fraction | target loss | single-process steps | swarm steps | "
             "swarm / single | target |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        for fraction in FRACTIONS:
            target = r.target(fraction)
            single, swarm = r.single.steps_to(target), r.swarm.steps_to(target)
            if single is None:  # cannot happen for fraction <= 1: the single process's own final loss
                continue
            ratio = f"{swarm / single:.2f}x" if swarm is not None else f"> {r.swarm.steps[-1] / single:.2f}x"
            met = swarm is not None and swarm <= STEP_RATIO_TARGET * single
            verdict = f"<= {STEP_RATIO_TARGET}: {'met' if met else 'MISSED'}" if r.algorithm == "dadam" else "-"
            lines.append(f"| {r.algorithm} | {r.seed} | {r.total_steps} | {fraction:g} | {target:.3f} | {single} | "
                         f"{swarm if swarm is not None else 'not reached'} | {ratio} | {verdict} |")
    lines += ["", f"losses at S (single process / swarm average), evaluated every {every} steps, swarm "
              f"run up to {max_factor:g} x S (the learning rate stays at its floor after S):"]
    for r in results:
        at_s = dict(zip(r.swarm.steps, r.swarm.losses)).get(r.total_steps, float("nan"))
        single = r.single.losses[-1]
        lines.append(f"- {r.algorithm} seed {r.seed}: initial {r.single.losses[0]:.3f}, single {single:.3f},"
                     f" swarm {at_s:.3f} ({at_s / single:.3f}x)")
    return lines


# ---- 3. AccumAdam at a small local batch ------------------------------------------------------------


@dataclass(frozen=True)
class AccumResult:
    seed: int
    single: Curve
    dadam: Curve
    accum: Curve


async def accum_arms(seed: int, steps: int, every: int, batch: int, accumulate: int, lr: float | None,
                     corpus: Corpus) -> AccumResult:
    """One seed: the single process (batch NODES * batch, Adam), then DAdam and AccumAdam swarms of
    NODES x `batch`, each run for exactly `steps` steps on the same schedule (peak `lr`, None: dadam's)."""
    optimizer = replace(SCHEDULES["dadam"], total_steps=steps, lr=lr or SCHEDULES["dadam"].lr,
                        warmup_steps=min(SCHEDULES["dadam"].warmup_steps, steps // 10))
    single = await single_curve(corpus, optimizer, seed, steps, every, batch=NODES * batch)
    dadam = await swarm_curve(corpus, optimizer, seed, steps, every, float("-inf"), steps, batch=batch)
    accum = await swarm_curve(corpus, replace(optimizer, adam_accumulate=accumulate), seed, steps, every,
                              float("-inf"), steps, batch=batch)
    return AccumResult(seed, single, dadam, accum)


def report_accum(results: list[AccumResult], accumulate: int) -> list[str]:
    lines = ["| seed | initial | single process | DAdam swarm | AccumAdam swarm (K = "
             f"{accumulate}) | AccumAdam - DAdam | best DAdam / AccumAdam |", "|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        single, dadam, accum = r.single.losses[-1], r.dadam.losses[-1], r.accum.losses[-1]
        lines.append(f"| {r.seed} | {r.single.losses[0]:.3f} | {single:.3f} | {dadam:.3f} | {accum:.3f} | "
                     f"{accum - dadam:+.3f} | {min(r.dadam.losses):.3f} / {min(r.accum.losses):.3f} |")
    if results:
        mean = {arm: statistics.mean(getattr(r, arm).losses[-1] for r in results) for arm in ("single", "dadam", "accum")}
        lines.append(f"| mean | | {mean['single']:.3f} | {mean['dadam']:.3f} | {mean['accum']:.3f} | "
                     f"{mean['accum'] - mean['dadam']:+.3f} | |")
    lines += ["", "validation loss of the final model (the swarm's: the average of its 4 nodes); curves "
              "(step: single / DAdam / AccumAdam):"]
    for r in results:
        points = ", ".join(f"{s}: {a:.3f}/{b:.3f}/{c:.3f}" for s, a, b, c in
                           zip(r.single.steps, r.single.losses, r.dadam.losses, r.accum.losses))
        lines.append(f"- seed {r.seed}: {points}")
    return lines


# ---- 4. a joiner's first steps on a download ------------------------------------------------------


JOIN_AFTER = (0, 1, 2, 4, 8, 16)  # steps after the download that are evaluated


async def join_arms(seed: int, steps: int, corpus: Corpus) -> dict[str, list[float]]:
    """One seed: a donor trained `steps` DAdam-schedule steps alone (batch BATCH), then per arm the
    validation loss at JOIN_AFTER steps past the download: the donor going on, and fresh joiners with
    the re-warm-up (`rewarm`) and without it (`full_rate`)."""
    optimizer = replace(SCHEDULES["dadam"], total_steps=10 * steps)
    curves: dict[str, list[float]] = {}

    async def follow(trainer: Trainer) -> list[float]:
        losses = []
        for after in range(JOIN_AFTER[-1] + 1):
            if after in JOIN_AFTER:
                losses.append(await trainer.evaluate())
            if after < JOIN_AFTER[-1]:
                await trainer.train_step()
        return losses

    async with tiny_trainer(corpus, optimizer, f"s{seed}-donor", seed, BATCH, corpus.train) as donor:
        for _ in range(steps):
            await donor.train_step()
        downloaded = await donor.tensors()
        for arm in ("full_rate", "rewarm"):
            async with tiny_trainer(corpus, optimizer, f"s{seed}-joiner", seed + 100, BATCH, corpus.train) as joiner:
                await joiner.load_tensors(downloaded)
                if arm == "rewarm":
                    await joiner.start_from_download(steps)
                else:
                    joiner.step = steps
                curves[arm] = await follow(joiner)
        curves["donor"] = await follow(donor)
    return curves


def report_join(results: list[dict[str, list[float]]], steps: int) -> list[str]:
    mean = {arm: [statistics.mean(r[arm][i] for r in results) for i in range(len(JOIN_AFTER))]
            for arm in ("donor", "full_rate", "rewarm")}
    lines = ["| steps after the download | " + " | ".join(str(a) for a in JOIN_AFTER) + " |",
             "|---|" + "---:|" * len(JOIN_AFTER)]
    labels = {"donor": "donor going on (baseline), loss", "full_rate": "fresh joiner at the full rate / donor",
              "rewarm": "fresh joiner, warm-up again / donor"}
    for arm, label in labels.items():
        cells = [f"{v:.3f}" if arm == "donor" else f"{v / d:.3f}" for v, d in zip(mean[arm], mean["donor"])]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", f"mean validation loss over {len(results)} seeds; the donor trained {steps} steps alone before "
              "the download"]
    return lines


# ---- 2. communication share of step time -----------------------------------------------------------


MODES = ("local", "overlapped", "sequential")


async def sequential_dadam_step(node: GossipTrainer, round_index: int, plan_for: PlanFor) -> tuple[float, float]:
    """DAdam without overlap: the round on x_t first, then g(x_t); x_{t+1} = mix(x_t) - lr * d.
    Returns (step seconds, round seconds)."""
    started = time.perf_counter()
    node.peer.set_tensors(await node.trainer.tensors(), step=node.trainer.step)
    outcome = await node.peer.run_round(round_index, await plan_for(round_index))
    await node.trainer.compute_update()
    await node.trainer.apply_update(node.peer.tensors)
    return time.perf_counter() - started, outcome.duration_s


@dataclass
class OverlapTimes:
    step_s: dict[str, list[float]]  # wall time of one step of all peers together (the slowest peer's)
    compute_s: dict[str, list[float]]
    round_s: dict[str, list[float]]
    block_s: dict[str, list[float]]  # median step time of each timed block
    skipped: list[str]

    def median(self, mode: str) -> float:
        return statistics.median(self.step_s[mode])

    def paired_ratio(self, mode: str) -> float:
        """Median over blocks of this mode's block time over the baseline's in the same block: the
        blocks follow each other within seconds, so a change of background load cancels out."""
        return statistics.median(m / a for m, a in zip(self.block_s[mode], self.block_s["local"]))


async def overlap_times(model: str, peers: int, batch: int, context: int, blocks: int, steps: int,
                        workdir: Path) -> tuple[OverlapTimes, int]:
    """Blocks of `steps` steps of each mode in turn, the order rotating from block to block (so that
    background load hits all three alike), after one unrecorded warm-up block; all peers step
    together, each on its own worker thread, and a step's time is the wall time until every peer
    finished it."""
    corpus = embedded_corpus(size_bytes=CORPUS_BYTES)
    optimizer = OptimizerConfig(algorithm="dadam", lr=1e-3)
    config = TrainerConfig(optimizer=optimizer, batch_size=batch, context=context, device="cpu", precision="fp32")
    times = OverlapTimes(*({m: [] for m in MODES} for _ in range(4)), skipped=[])
    async with p2pd_daemons(peers, workdir) as p2ps, transports_on(p2ps) as transports:
        await connect_all(transports)
        trainers = [Trainer(build_named_model(model, seed=0), config, peer_id=t.peer_id,
                            train_tokens=peer_shard(corpus, t.peer_id), val_tokens=corpus.val) for t in transports]
        numel = sum(p.numel() for p in trainers[0].model.parameters())
        try:
            nodes = await gossip_nodes(transports, trainers)
            plan_for = Lockstep([t.peer_id for t in transports], "one-peer-exp").plan_for
            next_round = 0

            async def one_step(node: GossipTrainer, mode: str,
                               round_index: int) -> tuple[float, float, float | None, list[str]]:
                plan = plan_for(node.peer.peer_id)
                if mode == "sequential":
                    step_s, round_s = await sequential_dadam_step(node, round_index, plan)
                    return step_s, float("nan"), round_s, []
                report = await node.step(None if mode == "local" else round_index, plan)
                rnd = report.round
                return (report.step_s, report.stats.compute_s, rnd.outcome.duration_s if rnd else None,
                        list(rnd.outcome.skipped.values()) if rnd else [])

            for block in range(blocks + 1):
                for mode in MODES[block % 3:] + MODES[:block % 3]:  # rotated: no mode always runs first
                    block_s = []
                    for _ in range(steps):
                        started = time.perf_counter()
                        async with asyncio.timeout(ROUND_TIMEOUT_S), asyncio.TaskGroup() as group:
                            tasks = [group.create_task(one_step(node, mode, next_round)) for node in nodes]
                        swarm_step_s = time.perf_counter() - started
                        next_round += mode != "local"
                        if block == 0:
                            continue
                        times.step_s[mode].append(swarm_step_s)
                        block_s.append(swarm_step_s)
                        for task in tasks:
                            _, compute_s, round_s, skipped = task.result()
                            times.compute_s[mode].append(compute_s)
                            if round_s is not None:
                                times.round_s[mode].append(round_s)
                            times.skipped.extend(skipped)
                    if block_s:
                        times.block_s[mode].append(statistics.median(block_s))
        finally:
            for trainer in trainers:
                await asyncio.to_thread(trainer.close)
    return times, numel


def report_overlap(times: OverlapTimes) -> list[str]:
    base = times.median("local")
    labels = {"local": "(a) local steps only (baseline)", "overlapped": "(b) DAdam, exchange overlapped with g(x_t)",
              "sequential": "(c) DAdam, exchange then g(x_t)"}
    lines = ["| mode | step s (median) | steps timed | round s (median) | median / median (a) | "
             "per-block ratio to (a), median |", "|---|---:|---:|---:|---:|---:|"]
    for mode in MODES:
        rounds = f"{statistics.median(times.round_s[mode]):.3f}" if times.round_s[mode] else "-"
        lines.append(f"| {labels[mode]} | {times.median(mode):.3f} | {len(times.step_s[mode])} | {rounds} | "
                     f"{times.median(mode) / base:.2f}x | {times.paired_ratio(mode):.2f}x |")
    overlapped, sequential = times.paired_ratio("overlapped"), times.paired_ratio("sequential")
    per_block = ", ".join(f"{b / a:.2f}" for b, a in zip(times.block_s["overlapped"], times.block_s["local"]))
    compute = {mode: statistics.median(times.compute_s[mode]) for mode in ("local", "overlapped")}
    lines += ["", f"(b)/(a) = {overlapped:.2f}x per block (target < {OVERLAP_TARGET:.2f}: "
              f"{'met' if overlapped < OVERLAP_TARGET else 'MISSED'}); (c)/(a) = {sequential:.2f}x; "
              f"per-block (b)/(a): {per_block}",
              f"compute per step (g(x_t) and the Adam direction, median over peers): local {compute['local']:.3f} s, "
              f"overlapped {compute['overlapped']:.3f} s; a round done alone (c) over a local step's compute: "
              f"{statistics.median(times.round_s['sequential']) / compute['local']:.2f} (what (c) should add, "
              f"read without the step-to-step noise)"]
    if times.skipped:
        lines.append(f"neighbours skipped in timed rounds: {', '.join(times.skipped)}")
    return lines


# ---- main ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.bench_training", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="target,overlap",
                        help="comma-separated parts to run: target, overlap, accum, join (default: target,overlap)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: S = 20 steps; 2 peers, 2 timed blocks of 1 step per mode")
    parser.add_argument("--algorithms", default="dsgd,dadam", help="schedules of the target part (default both)")
    parser.add_argument("--seeds", default="0", help="model seeds of the target, accum and join parts, comma-separated (default 0)")
    parser.add_argument("--steps", type=int, help="S, the single process's steps (default: the tests' 60 / 80)")
    parser.add_argument("--every", type=int, default=5, help="evaluate every this many steps (default 5)")
    parser.add_argument("--max-factor", type=float, default=2.0,
                        help="the swarm runs at most this many times S steps (default 2)")
    parser.add_argument("--model", default="moe", help="model of the overlap part (default: the embedded moe)")
    parser.add_argument("--peers", type=int, default=2, help="p2pd peers of the overlap part (default 2)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step in the overlap part (default 16)")
    parser.add_argument("--context", type=int, default=128, help="tokens per sequence in the overlap part")
    parser.add_argument("--blocks", type=int, default=6, help="timed blocks per mode, after a warm-up (default 6)")
    parser.add_argument("--block-steps", type=int, default=1, help="steps per block (default 1)")
    parser.add_argument("--accum-batch", type=int, default=2, help="per-node batch of the accum part (default 2)")
    parser.add_argument("--accumulate", type=int, default=4, help="AccumAdam's K in the accum part (default 4)")
    parser.add_argument("--accum-lr", type=float, help="peak lr of all arms of the accum part (default dadam's 1.5e-2)")
    args = parser.parse_args(argv)
    parts = {p.strip() for p in args.only.split(",") if p.strip()}
    known = {"target", "overlap", "accum", "join"}
    if parts - known:
        parser.error(f"--only: unknown part(s) {', '.join(sorted(parts - known))}")
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    if set(algorithms) - SCHEDULES.keys():
        parser.error(f"--algorithms: choose from {', '.join(SCHEDULES)}")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if args.quick:
        args.steps, args.blocks, args.block_steps, args.peers = args.steps or 20, 2, 1, 2
    torch.set_num_threads(1)  # several trainers share the cores: more intra-op threads only add waiting
    _show_exchange_logs()

    print(f"command: .venv/bin/python -m bench.bench_training {' '.join(argv)}".rstrip())
    print(f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f} at start\n", flush=True)
    if "target" in parts:
        corpus = embedded_corpus(size_bytes=CORPUS_BYTES)
        results = []
        for algorithm in algorithms:
            for seed in seeds:
                total = args.steps or SCHEDULES[algorithm].total_steps
                result = steps_to_target(algorithm, seed, total, args.every, args.max_factor, corpus)
                results.append(asyncio.run(result))
        lines = [f"### 1. Steps to a target validation loss: {NODES} nodes x batch {BATCH} (one-peer exponential, "
                 f"in-memory transport) vs one process x batch {NODES * BATCH}, TINY model "
                 f"({sum(p.numel() for p in build_model(TINY).parameters()):,} parameters)", "",
                 *report_targets(results, args.every, args.max_factor), ""]
        print("\n".join(lines), flush=True)
    if "accum" in parts:
        corpus = embedded_corpus(size_bytes=CORPUS_BYTES)
        total = args.steps or SCHEDULES["dadam"].total_steps
        accum_results = [asyncio.run(accum_arms(seed, total, args.every, args.accum_batch, args.accumulate,
                                                args.accum_lr, corpus)) for seed in seeds]
        lines = [f"### 3. AccumAdam at a small local batch: {NODES} nodes x batch {args.accum_batch} (one-peer "
                 f"exponential, in-memory transport) vs one process x batch {NODES * args.accum_batch}, TINY model, "
                 f"dadam schedule (peak lr {args.accum_lr or SCHEDULES['dadam'].lr:g}), S = {total} steps", "", *report_accum(accum_results, args.accumulate), ""]
        print("\n".join(lines), flush=True)
    if "join" in parts:
        corpus = embedded_corpus(size_bytes=CORPUS_BYTES)
        total = args.steps or SCHEDULES["dadam"].total_steps
        join_results = [asyncio.run(join_arms(seed, total, corpus)) for seed in seeds]
        lines = [f"### 4. A joiner's first steps on a download: DAdam schedule (peak lr {SCHEDULES['dadam'].lr:g}, "
                 f"warm-up {SCHEDULES['dadam'].warmup_steps} steps), TINY model, batch {BATCH}", "",
                 *report_join(join_results, total), ""]
        print("\n".join(lines), flush=True)
    if "overlap" in parts:
        with tempfile.TemporaryDirectory(prefix="murmur-bench-") as tmp:
            times, numel = _run_async(lambda: overlap_times(args.model, args.peers, args.batch, args.context,
                                                            args.blocks, args.block_steps, Path(tmp)))
        lines = [f"### 2. Communication share of step time: DAdam, model {args.model!r} ({numel:,} parameters, fp32 "
                 f"codec), {args.peers} peers over {args.peers} p2pd daemons on 127.0.0.1, one-peer exponential, "
                 f"batch {args.batch} x {args.context} tokens, torch 1 thread per trainer, "
                 f"{args.blocks} blocks x {args.block_steps} steps per mode", "", *report_overlap(times), ""]
        print("\n".join(lines), flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
