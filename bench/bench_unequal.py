"""Volunteers of unequal speed in gossip DiLoCo, each arm against 4 equal nodes run in the same command.

4 DilocoTrainers (the real code over the in-memory transport, gossip/memory.py; the exact average of the
`complete` graph, so the arms differ by speed alone) on the tests' TINY model, each node on its own shard of
the embedded corpus, inner AdamW, outer lr 0.7 with Nesterov 0.9, int8 + error feedback, H = 20. A step's
compute is mocked as a GPU's: a sleep of STEP_S x the node's slowness (the CPU stays free, as on a GPU; the
model's real forward and backward, a few ms, run besides). Arms:

- `4 equal nodes (1x)`: the reference;
- `1x 1x 2x 4x, step-based phases`: every node trains every step, so each sync waits for the slowest
  (the in-process planner's barrier stands for the daemon's wait of up to the grace window);
- `1x 1x 2x 4x, wall-clock phases`: `phase_seconds` = 1.25 H STEP_S (`murmur plan`'s), so the slower nodes pass over the
  rest of each phase and their pseudo-gradients count by the steps they trained;
- `the two 1x nodes alone`: the swarm without its slow volunteers (half the data).

Per arm, medians over seeds: the wall time of the step budget and its ratio to the equal nodes', the final
validation loss of the node-average (the final merge's model) and its ratio, the time to reach the target
(the loss the equal nodes reach at half their budget; evaluated on node 0's anchor after each sync) and its
ratio, the steps the slow nodes passed over, and the seconds a 1x node spent waiting per sync.

Run from the repository root: .venv/bin/python -m bench.bench_unequal [--seeds 0,1,2] [--steps 400]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from bench.bench_lowcomm import BATCH, DILOCO_LR, settings, tiny_trainer
from gossip.diloco import DilocoConfig, SyncSchedule, phase_seconds_for
from gossip.lockstep import Lockstep
from gossip.memory import InMemoryNetwork
from gossip.optimizers import OptimizerConfig
from node.algorithms.diloco.trainer import DilocoTrainer
from node.algorithms.lockstep import drive
from node.train.data import Corpus, embedded_corpus, peer_shard
from node.train.trainer import Trainer, average_tensors

STEP_S = 0.05  # the 1x node's mocked step
H = 20


@dataclass(frozen=True)
class Arm:
    name: str
    slowness: tuple[float, ...]  # each node's step time, in STEP_S
    wall_clock: bool = False


ARMS = (Arm("4 equal nodes (1x)", (1, 1, 1, 1)),
        Arm("1x 1x 2x 4x, step-based phases", (1, 1, 2, 4)),
        Arm("1x 1x 2x 4x, wall-clock phases", (1, 1, 2, 4), wall_clock=True),
        Arm("the two 1x nodes alone", (1, 1)))


@dataclass(frozen=True)
class Run:
    arm: str
    seed: int
    seconds: float  # wall time of the step budget
    loss: float  # the node-average's validation loss
    curve: tuple[tuple[float, float], ...]  # (seconds, node 0's anchor loss) after each of its syncs
    passed: int  # steps the nodes passed over, all together
    wait_per_sync: float  # seconds a 1x node's steps took beyond its compute, per sync


def mocked_gpu(trainer: Trainer, step_s: float) -> Trainer:
    """The trainer's steps take `step_s` more, asleep (a GPU's forward and backward leave the CPU free)."""
    train = trainer.train_step

    async def train_step():
        stats = await train()
        await asyncio.sleep(step_s)
        return stats

    trainer.train_step = train_step  # type: ignore[method-assign]
    return trainer


async def run_arm(corpus: Corpus, arm: Arm, seed: int, steps: int) -> Run:
    ids = [f"s{seed}-peer{i}" for i in range(len(arm.slowness))]
    optimizer = OptimizerConfig(algorithm="diloco", lr=DILOCO_LR, warmup_steps=steps // 10, total_steps=steps,
                                clip_norm=1.0, local_steps=H)
    config = DilocoConfig(outer_lr=0.7, outer_momentum=0.9, anchor_codec="int8", outer_warmup=0,
                          phase_seconds=phase_seconds_for(STEP_S, H) if arm.wall_clock else 0.0)
    net = InMemoryNetwork()
    trainers = [mocked_gpu(tiny_trainer(corpus, optimizer, pid, seed, BATCH, peer_shard(corpus, pid)), STEP_S * s)
                for pid, s in zip(ids, arm.slowness, strict=True)]
    nodes: list[DilocoTrainer] = []
    anchors: list[tuple[float, dict[str, np.ndarray]]] = []
    try:
        for pid, trainer in zip(ids, trainers, strict=True):
            node = DilocoTrainer(trainer, net.transport(pid), settings("int8"), config,
                                 SyncSchedule(H, 1, optimizer.schedule.lr_at))
            await node.start()
            nodes.append(node)
        lockstep = Lockstep(ids, "complete")
        started = time.perf_counter()
        waits: list[float] = []

        async def fast_node() -> None:  # node 0 (1x): its anchors after each sync, and its waits
            node, plan_for = nodes[0], lockstep.fragment_plan_for(ids[0])
            for count in range(1, steps + 1):
                report = await node.step(plan_for, final=count == steps)
                if report.synced:
                    anchors.append((time.perf_counter() - started, node.anchor))
                    waits.append(report.step_s - report.stats.compute_s - STEP_S)

        async with asyncio.TaskGroup() as group:
            group.create_task(fast_node())
            group.create_task(drive(nodes[1:], steps, lockstep, last=steps))
        seconds = time.perf_counter() - started
        loss = await trainers[0].evaluate(average_tensors([node.anchor for node in nodes]))
        curve = tuple([(at, await trainers[0].evaluate(anchor)) for at, anchor in anchors])
        return Run(arm.name, seed, seconds, loss, curve, sum(n.stats.steps_passed for n in nodes),
                   statistics.fmean(waits) if waits else 0.0)
    finally:
        for node in nodes:
            await node.close()
        for trainer in trainers:
            trainer.close()


def time_to(curve: tuple[tuple[float, float], ...], target: float) -> float | None:
    return next((at for at, loss in curve if loss <= target), None)


def report(runs: list[Run], seeds: list[int]) -> list[str]:
    reference = {r.seed: r for r in runs if r.arm == ARMS[0].name}
    # the target: what the equal nodes reach at half their budget (node 0's anchor, after that sync)
    targets = {seed: r.curve[len(r.curve) // 2 - 1][1] for seed, r in reference.items()}
    lines = ["| arm | wall time (s) | / equal | loss | / equal | time to target (s) | / equal | steps passed | "
             "1x node's wait per sync (s) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for arm in ARMS:
        rs = [r for r in runs if r.arm == arm.name]
        reached = [(time_to(r.curve, targets[r.seed]), time_to(reference[r.seed].curve, targets[r.seed])) for r in rs]
        to_target = [t / ref for t, ref in reached if t is not None and ref]
        missed = sum(1 for t, _ in reached if t is None)
        lines.append(
            f"| {arm.name} | {statistics.median(r.seconds for r in rs):.1f} | "
            f"{statistics.median(r.seconds / reference[r.seed].seconds for r in rs):.2f}x | "
            f"{statistics.median(r.loss for r in rs):.4f} | "
            f"{statistics.median(r.loss / reference[r.seed].loss for r in rs):.3f}x | "
            f"{statistics.median(t for t, _ in reached if t is not None) if missed < len(rs) else float('nan'):.1f}"
            f"{f' ({missed} of {len(rs)} seeds never)' if missed else ''} | "
            f"{f'{statistics.median(to_target):.2f}x' if to_target else '-'} | "
            f"{statistics.median(r.passed for r in rs):.0f} | {statistics.median(r.wait_per_sync for r in rs):.2f} |")
    lines += ["", "per seed (wall time, loss, target):"]
    for r in runs:
        lines.append(f"- {r.arm}, seed {r.seed}: {r.seconds:.1f} s, loss {r.loss:.4f}, target {targets[r.seed]:.4f} "
                     f"reached at {time_to(r.curve, targets[r.seed])}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    corpus = embedded_corpus()
    runs = []
    for seed in seeds:
        for arm in ARMS:
            run = asyncio.run(run_arm(corpus, arm, seed, args.steps))
            runs.append(run)
            print(f"  {arm.name}, seed {seed}: {run.seconds:.1f} s, loss {run.loss:.4f}, passed {run.passed}, "
                  f"wait {run.wait_per_sync:.2f} s/sync", file=sys.stderr, flush=True)
    print(f"bench_unequal: {len(seeds)} seeds, {args.steps} steps, H = {H}, 1x step {STEP_S} s "
          f"({platform.machine()}, torch {torch.__version__})")
    print("\n".join(report(runs, seeds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
