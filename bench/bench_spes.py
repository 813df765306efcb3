"""SPES against dense training and against the reference SPES scheme: memory, bytes per sync and validation
loss.

In one process over the in-memory transport: per-node memory of parameters + gradients + optimizer state,
bytes per node per sync, validation loss against steps (written as an SVG plot), and (part 4, with
--period-steps) loss and bytes against the sync period S over seeds, beside data-parallel training and
training apart.

Run from the repository root: .venv/bin/python -m bench.bench_spes [--steps 96] [--plot docs/img/spes_loss.svg]
[--period-steps 300 --periods 1,10,50,100 --warmup-at 1,50 --seeds 0,1,2]
Baselines are measured in the same command: dense training on the same MoE model (memory, loss; and
for the loss, the same swarm with every expert frozen, to show the experts matter) and the
reference SPES traffic for the same model (upload shared + owned experts in fp32, download the whole
model in fp32 at every sync).
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from gossip.codecs import get_codec
from gossip.exchange import ExchangeSettings, GossipPeer
from gossip.lockstep import Lockstep
from gossip.memory import InMemoryNetwork
from gossip.optimizers import OptimizerConfig
from gossip.spes import SpesConfig, assign_experts, reference_sync_bytes, training_memory
from node.algorithms.dsgd import GossipTrainer
from node.algorithms.lockstep import drive
from node.algorithms.spes.node import InMemoryExpertDirectory, SpesNode
from node.algorithms.spes.partition import ModelPartition, spes_average
from node.train.data import Corpus, embedded_corpus, peer_shard
from node.train.models import DEFAULT, ModelConfig, build_model
from node.train.trainer import Trainer, TrainerConfig, average_tensors, train_alone

NODES = 4
IDS = [f"peer{i}" for i in range(NODES)]
SETTINGS = ExchangeSettings(swarm="bench", config_hash="spes", codec=get_codec("fp32"), exchange_timeout_s=60.0)
# the loss curves use the tests' small MoE, so that three runs fit in a few minutes on two cores
SMALL = ModelConfig(context=32, layers=2, width=32, heads=4, experts=8, top_k=2, expert_hidden=64)
TARGET_TRAFFIC_RATIO = 0.4


def trainer_config(optimizer: OptimizerConfig, model: ModelConfig) -> TrainerConfig:
    return TrainerConfig(optimizer=optimizer, batch_size=8, context=model.context, device="cpu", precision="fp32",
                         eval_batch_size=64, eval_batches=8)


def make_trainer(corpus: Corpus, model: ModelConfig, optimizer: OptimizerConfig, peer_id: str,
                 seed: int = 0) -> Trainer:
    return Trainer(build_model(model, seed=seed), trainer_config(optimizer, model), peer_id=peer_id,
                   train_tokens=peer_shard(corpus, peer_id), val_tokens=corpus.val)


def seeded_ids(seed: int) -> list[str]:
    """The peers of a seed's swarm: their names pick their shards and batches, so seed 0 keeps IDS."""
    return IDS if seed == 0 else [f"s{seed}-peer{i}" for i in range(NODES)]


async def spes_nodes(corpus: Corpus, model: ModelConfig, optimizer: OptimizerConfig, config: SpesConfig,
                     capacity: int, seed: int = 0) -> list[SpesNode]:
    ids = seeded_ids(seed)
    ownership = assign_experts(ids, dict.fromkeys(ids, capacity), model.experts, model.layers, config.replication)
    net, directory = InMemoryNetwork(), InMemoryExpertDirectory()
    nodes = [SpesNode(make_trainer(corpus, model, optimizer, pid, seed), net.transport(pid), SETTINGS, config,
                      ownership, directory) for pid in ids]
    for node in nodes:
        await node.start()
    return nodes


# ---- memory -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryRow:
    name: str
    parameters: int
    gradients: int
    optimizer_state: int
    analytic: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state


async def measure_memory(corpus: Corpus, name: str, node: SpesNode | None, trainer: Trainer) -> MemoryRow:
    """Live tensors after the backward pass of one Adam step (the peak: every gradient exists) and
    the optimizer state after it."""
    await trainer.compute_update()
    params = list(trainer.model.parameters())
    parameters = sum(p.nbytes for p in params)
    gradients = sum(p.grad.nbytes for p in params if p.grad is not None)
    await trainer.apply_update()
    state = trainer.optimizer_state_bytes
    sizes = {n: p.numel() for n, p in trainer.model.named_parameters()}
    trainable = sum(sizes[n] for n in trainer.trainable_parameter_names)
    frozen_bytes = 2 if node is not None and node.config.frozen_bf16 else 4
    analytic = training_memory(trainable, sum(sizes.values()) - trainable, 2, frozen_bytes).total
    return MemoryRow(name, parameters, gradients, state, analytic)


async def memory_rows(corpus: Corpus) -> list[MemoryRow]:
    optimizer = OptimizerConfig(algorithm="dadam", lr=3e-3)
    rows = []
    dense = make_trainer(corpus, DEFAULT, optimizer, IDS[0])
    rows.append(await measure_memory(corpus, "dense (all experts trained)", None, dense))
    dense.close()
    for replication, capacity in ((1, 2), (2, 4)):
        for bf16 in (False, True):
            config = SpesConfig(replication=replication, frozen_bf16=bf16)
            ownership = assign_experts(IDS, dict.fromkeys(IDS, capacity), DEFAULT.experts, DEFAULT.layers, replication)
            trainer = make_trainer(corpus, DEFAULT, optimizer, IDS[0])
            node = SpesNode(trainer, InMemoryNetwork().transport(IDS[0]), SETTINGS, config, ownership,
                            InMemoryExpertDirectory())
            await node.start()
            label = f"SPES r={replication}, owns {capacity}/8" + (", frozen bf16" if bf16 else "")
            rows.append(await measure_memory(corpus, label, node, trainer))
            trainer.close()
    return rows


# ---- traffic --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrafficRow:
    name: str
    measured: float  # bytes sent + received per node per sync (mean over nodes and syncs)
    reference: float


@dataclass(frozen=True)
class TrafficSetup:
    replication: int
    capacity: int
    topology: str = "ring"
    expert_codec: str = "fp32"
    refresh_codec: str = "bf16"
    refresh_every: int = 1
    shared_codec: str = "fp32"
    delta_refresh: bool = False

    @property
    def name(self) -> str:
        refresh = f"{self.refresh_codec} deltas" if self.delta_refresh else self.refresh_codec
        return (f"r={self.replication} owns {self.capacity}/8, shared {self.topology} {self.shared_codec}, experts "
                f"{self.expert_codec}, refresh {refresh}" + (f" every {self.refresh_every}" if self.refresh_every > 1
                                                              else ""))


# int8 with error feedback for the shared weights and the experts, refreshes as int8 deltas
NEW_DEFAULTS = {"shared_codec": "int8", "expert_codec": "int8", "refresh_codec": "int8", "delta_refresh": True}
TRAFFIC_SETUPS = (
    TrafficSetup(1, 2),
    TrafficSetup(2, 4),
    TrafficSetup(1, 2, "one-peer-exp", refresh_codec="int8"),
    TrafficSetup(1, 2, "one-peer-exp", refresh_codec="int8", refresh_every=2),
    TrafficSetup(2, 4, "one-peer-exp", expert_codec="bf16", refresh_codec="int8", refresh_every=2),
    TrafficSetup(2, 4, "one-peer-exp", expert_codec="int8", refresh_codec="int8", refresh_every=2),
    TrafficSetup(2, 4, "one-peer-exp"),  # as OLD_DEFAULTS: fp32 weights and experts, whole bf16 refreshes
    TrafficSetup(2, 4, "one-peer-exp", **NEW_DEFAULTS),  # the defaults
    TrafficSetup(1, 2, "one-peer-exp", **NEW_DEFAULTS),
    TrafficSetup(2, 4, "ring", **NEW_DEFAULTS),
)
OLD_DEFAULTS = {"shared_codec": "fp32", "expert_codec": "fp32", "refresh_codec": "bf16", "delta_refresh": False}
# the loss curves: name -> (r, capacity, SpesConfig fields beyond the common ones)
CURVES = {
    "SPES r=1": (1, 2, OLD_DEFAULTS),
    "SPES r=2": (2, 4, OLD_DEFAULTS),
    "SPES r=2 int8": (2, 4, {**OLD_DEFAULTS, "expert_codec": "int8", "refresh_codec": "int8", "refresh_every": 2}),
    "SPES r=2 defaults": (2, 4, NEW_DEFAULTS),
}


async def measure_traffic(corpus: Corpus, setup: TrafficSetup, syncs: int) -> TrafficRow:
    optimizer = OptimizerConfig(algorithm="dadam", lr=3e-3)
    config = SpesConfig(sync_every=1, merge_every=1, merge_until=0, replication=setup.replication,
                        expert_codec=setup.expert_codec, refresh_codec=setup.refresh_codec,
                        refresh_every=setup.refresh_every, shared_codec=setup.shared_codec,
                        delta_refresh=setup.delta_refresh)
    capacity, topology = setup.capacity, setup.topology
    nodes = await spes_nodes(corpus, DEFAULT, optimizer, config, capacity)
    lockstep = Lockstep(IDS, topology)

    async def run(steps: int) -> None:
        await drive(nodes, steps, lockstep)

    await run(1)  # the first sync also carries the first refreshes; steady state from the second on
    before = sum(n.bytes_sent + n.bytes_received for n in nodes)
    await run(syncs)
    measured = (sum(n.bytes_sent + n.bytes_received for n in nodes) - before) / (NODES * syncs)
    sizes = {n: p.numel() for n, p in nodes[0].trainer.model.named_parameters()}
    partition = nodes[0].partition
    shared = sum(sizes[n] for n in partition.shared)
    owned = sum(sizes[n] for n in partition.names_of(nodes[0].owned))
    reference = reference_sync_bytes(shared, owned, sum(sizes.values()))
    for node in nodes:
        node.trainer.close()
    return TrafficRow(setup.name, measured, reference)


# ---- loss curves ----------------------------------------------------------------------------------------


async def dense_nodes(corpus: Corpus, optimizer: OptimizerConfig, seed: int = 0,
                      train_experts: bool = True) -> list[GossipTrainer]:
    """Dense DAdam nodes of the small MoE over one in-memory network, a fp32 gossip peer each."""
    net, nodes = InMemoryNetwork(), []
    for pid in seeded_ids(seed):
        trainer = make_trainer(corpus, SMALL, optimizer, pid, seed)
        if not train_experts:  # the control: experts stay at their initial values
            await trainer.set_trainable(set(ModelPartition.of(trainer.model).shared).__contains__)
        peer = GossipPeer(net.transport(pid), SETTINGS, await trainer.tensors())
        await peer.start()
        nodes.append(GossipTrainer(trainer, peer))
    return nodes


async def dense_curve(corpus: Corpus, optimizer: OptimizerConfig, steps: int, every: int,
                      train_experts: bool = True) -> list[tuple[int, float]]:
    nodes = await dense_nodes(corpus, optimizer, train_experts=train_experts)
    lockstep = Lockstep(IDS, "ring")
    curve = [(0, await nodes[0].trainer.evaluate())]
    for done in range(every, steps + 1, every):
        await drive(nodes, every, lockstep)
        average = average_tensors([await n.trainer.tensors() for n in nodes])
        curve.append((done, await nodes[0].trainer.evaluate(average)))
    for node in nodes:
        node.trainer.close()
    return curve


async def spes_curve(corpus: Corpus, optimizer: OptimizerConfig, config: SpesConfig, capacity: int, steps: int,
                     every: int) -> list[tuple[int, float]]:
    nodes = await spes_nodes(corpus, SMALL, optimizer, config, capacity)
    lockstep = Lockstep(IDS, "ring")
    curve = [(0, await nodes[0].trainer.evaluate())]
    for done in range(every, steps + 1, every):
        await drive(nodes, every, lockstep)
        members = {n.peer_id: await n.trainer.tensors() for n in nodes}
        average = spes_average(members, nodes[0].ownership, nodes[0].partition)
        curve.append((done, await nodes[0].trainer.evaluate(average)))
    for node in nodes:
        node.trainer.close()
    return curve


# ---- sync period ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeriodResult:
    name: str
    seed: int
    loss: float  # the swarm average's validation loss (training apart: the mean of the nodes' own models')
    bytes_per_step: float  # sent + received per node per step


def period_optimizer(steps: int) -> OptimizerConfig:
    return OptimizerConfig(algorithm="dadam", lr=1.5e-2, warmup_steps=max(1, steps // 12), total_steps=steps)


async def period_single(corpus: Corpus, steps: int, seed: int) -> PeriodResult:
    """The data-parallel baseline: one process whose batch is the swarm's (NODES x 8), the same steps."""
    config = replace(trainer_config(period_optimizer(steps), SMALL), batch_size=NODES * 8)
    trainer = Trainer(build_model(SMALL, seed=seed), config, peer_id=f"s{seed}-single", train_tokens=corpus.train,
                      val_tokens=corpus.val)
    try:
        await train_alone(trainer, steps)
        return PeriodResult("data-parallel (1 process, batch 32)", seed, await trainer.evaluate(), 0.0)
    finally:
        trainer.close()


async def period_apart(corpus: Corpus, steps: int, seed: int) -> PeriodResult:
    """Training apart: every node alone on its shard, all experts trained; the mean of its models' losses
    (averaging them at the end would be a communication)."""
    losses = []
    for pid in seeded_ids(seed):
        trainer = make_trainer(corpus, SMALL, period_optimizer(steps), pid, seed)
        try:
            await train_alone(trainer, steps)
            losses.append(await trainer.evaluate())
        finally:
            trainer.close()
    return PeriodResult("apart (no communication)", seed, float(np.mean(losses)), 0.0)


async def period_dense(corpus: Corpus, steps: int, seed: int) -> PeriodResult:
    """Dense DAdam, every expert trained by every node, a fp32 ring round after every step."""
    nodes = await dense_nodes(corpus, period_optimizer(steps), seed)
    try:
        await drive(nodes, steps, Lockstep(seeded_ids(seed), "ring"))
        moved = sum(n.peer.stats.bytes_sent + n.peer.stats.bytes_received for n in nodes) / (NODES * steps)
        average = average_tensors([await n.trainer.tensors() for n in nodes])
        return PeriodResult("dense DAdam, fp32 every step", seed, await nodes[0].trainer.evaluate(average), moved)
    finally:
        for node in nodes:
            node.trainer.close()


def period_config(sync_every: int, steps: int, warmup: bool) -> SpesConfig:
    """SPES r = 2 with the defaults' codecs at period S; the merge warm-up (every multiple of S from 10
    on, strength 0.1 falling to 0 at half the run) on or off."""
    merge_every = sync_every * -(-10 // sync_every)
    return SpesConfig(sync_every=sync_every, merge_every=merge_every, merge_until=steps // 2 if warmup else 0,
                      alpha0=0.1, replication=2, **NEW_DEFAULTS)


async def period_spes(corpus: Corpus, steps: int, seed: int, sync_every: int, warmup: bool) -> PeriodResult:
    """SPES on a ring for `steps` steps, a multiple of S (the last step syncs), then the swarm average."""
    name = f"SPES S={sync_every}" + (", merge warm-up" if warmup else "")
    nodes = await spes_nodes(corpus, SMALL, period_optimizer(steps), period_config(sync_every, steps, warmup), 4,
                             seed)
    try:
        await drive(nodes, steps, Lockstep(seeded_ids(seed), "ring"))
        moved = sum(n.bytes_sent + n.bytes_received for n in nodes) / (NODES * steps)
        members = {n.peer_id: await n.trainer.tensors() for n in nodes}
        average = spes_average(members, nodes[0].ownership, nodes[0].partition)
        return PeriodResult(name, seed, await nodes[0].trainer.evaluate(average), moved)
    finally:
        for node in nodes:
            node.trainer.close()


async def period_results(corpus: Corpus, steps: int, seeds: list[int], periods: list[int],
                         warmup_at: list[int]) -> list[PeriodResult]:
    results = []
    for seed in seeds:
        runs = [period_single(corpus, steps, seed), period_apart(corpus, steps, seed),
                period_dense(corpus, steps, seed)]
        runs += [period_spes(corpus, steps, seed, s, warmup=False) for s in periods]
        runs += [period_spes(corpus, steps, seed, s, warmup=True) for s in warmup_at]
        for run in runs:
            result = await run
            print(f"   seed {seed}: {result.name}: loss {result.loss:.4f}, {result.bytes_per_step / 1e3:.1f} kB per "
                  "node per step", flush=True)
            results.append(result)
    return results


def print_period_table(results: list[PeriodResult]) -> None:
    """Medians over seeds: the loss, its ratio to the data-parallel baseline, the share of the baseline's
    improvement over training apart that the arm recovers, and bytes per node per step."""
    by_name: dict[str, dict[int, PeriodResult]] = {}
    for r in results:
        by_name.setdefault(r.name, {})[r.seed] = r
    single, apart = by_name["data-parallel (1 process, batch 32)"], by_name["apart (no communication)"]
    every_step = by_name.get("SPES S=1")
    print(f"   {'setup':42s} {'loss':>7s} {'vs data-parallel':>17s} {'recovered':>10s} {'kB/node/step':>13s} "
          f"{'vs S=1':>7s}  per seed")
    for name, runs in by_name.items():
        seeds = sorted(runs)
        loss = float(np.median([runs[s].loss for s in seeds]))
        ratio = float(np.median([runs[s].loss / single[s].loss for s in seeds]))
        recovered = float(np.median([(apart[s].loss - runs[s].loss) / (apart[s].loss - single[s].loss)
                                     for s in seeds]))
        kb = float(np.median([runs[s].bytes_per_step for s in seeds])) / 1e3
        vs = (f"{kb * 1e3 / float(np.median([every_step[s].bytes_per_step for s in seeds])):7.3f}"
              if every_step is not None and kb else f"{'':7s}")
        print(f"   {name:42s} {loss:7.3f} {ratio:16.3f}x {recovered:9.0%} {kb:13.1f} {vs}  "
              + " ".join(f"{runs[s].loss:.3f}" for s in seeds))


def svg_plot(curves: dict[str, list[tuple[int, float]]], title: str) -> str:
    """A line plot as a self-contained SVG (no plotting library is installed here)."""
    width, height, left, right, top, bottom = 640, 400, 60, 170, 40, 50
    xs = [x for c in curves.values() for x, _ in c]
    ys = [y for c in curves.values() for _, y in c]
    x_max, y_min, y_max = max(xs), np.floor(min(ys) * 2) / 2, np.ceil(max(ys) * 2) / 2
    plot_w, plot_h = width - left - right, height - top - bottom

    def px(x: float) -> float:
        return left + plot_w * x / x_max

    def py(y: float) -> float:
        return top + plot_h * (y_max - y) / (y_max - y_min)

    colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
           f'<text x="{left}" y="22" font-size="14">{title}</text>',
           f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="black"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="black"/>',
           f'<text x="{left + plot_w / 2}" y="{height - 12}" text-anchor="middle">steps per node</text>',
           f'<text x="16" y="{top + plot_h / 2}" transform="rotate(-90 16 {top + plot_h / 2})" '
           f'text-anchor="middle">validation loss (nats)</text>']
    for k in range(5):
        x = x_max * k / 4
        out.append(f'<text x="{px(x):.1f}" y="{top + plot_h + 16}" text-anchor="middle">{x:.0f}</text>')
        y = y_min + (y_max - y_min) * k / 4
        out.append(f'<line x1="{left}" y1="{py(y):.1f}" x2="{left + plot_w}" y2="{py(y):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:.2f}</text>')
    for i, (name, curve) in enumerate(curves.items()):
        colour = colours[i % len(colours)]
        points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in curve)
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{points}"/>')
        ly = top + 20 * i + 10
        out.append(f'<line x1="{left + plot_w + 12}" y1="{ly}" x2="{left + plot_w + 32}" y2="{ly}" stroke="{colour}" '
                   f'stroke-width="2"/>')
        out.append(f'<text x="{left + plot_w + 38}" y="{ly + 4}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


# ---- main -----------------------------------------------------------------------------------------------


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    corpus = embedded_corpus(size_bytes=600_000)
    print(f"command: {sys.executable} -m bench.bench_spes {' '.join(sys.argv[1:])}".rstrip())
    print(f"machine: {platform.machine()}, torch {torch.__version__}, numpy {np.__version__}; {NODES} nodes in one "
          f"process, in-memory transport")

    started = time.perf_counter()
    if not args.skip_memory:
        print("\n1. Memory per node, default MoE (4 layers x 8 experts, 2.45M parameters), Adam, one step")
        rows = await memory_rows(corpus)
        dense = rows[0].total
        print(f"   {'setup':40s} {'params':>10s} {'grads':>10s} {'opt state':>10s} {'total':>10s} {'vs dense':>9s} "
              f"{'analytic':>10s}")
        for row in rows:
            print(f"   {row.name:40s} {row.parameters / 1e6:9.2f}M {row.gradients / 1e6:9.2f}M "
                  f"{row.optimizer_state / 1e6:9.2f}M {row.total / 1e6:9.2f}M {row.total / dense:8.2f}x "
                  f"{row.analytic / 1e6:9.2f}M")

    if not args.skip_traffic:
        print(f"\n2. Bytes per node per sync (sent + received, mean of {args.syncs} syncs after the first), "
              "default MoE, against the reference SPES scheme for the same model")
        for setup in TRAFFIC_SETUPS:
            row = await measure_traffic(corpus, setup, args.syncs)
            ratio = row.measured / row.reference
            verdict = "meets" if ratio <= TARGET_TRAFFIC_RATIO else "misses"
            print(f"   {row.name:96s} {row.measured / 1e6:6.2f} MB vs reference {row.reference / 1e6:6.2f} MB: "
                  f"{ratio:.2f}x ({verdict} the {TARGET_TRAFFIC_RATIO}x target)")

    if args.period_steps:
        periods, warmup_at = _ints(args.periods), _ints(args.warmup_at)
        if any(args.period_steps % s for s in periods + warmup_at):
            raise SystemExit(f"--period-steps {args.period_steps} must be a multiple of every period")
        print(f"\n4. Sync period: the swarm average's validation loss after {args.period_steps} steps, small MoE, "
              f"Adam, ring, SPES r=2 with the defaults' int8 codecs; seeds {args.seeds}")
        print_period_table(await period_results(corpus, args.period_steps, _ints(args.seeds), periods, warmup_at))
    if args.steps:
        print(f"\n3. Validation loss of the swarm average vs steps, small MoE ({SMALL.layers} layers x {SMALL.experts} "
              f"experts), Adam, a sync (or round) after every step, ring")
        optimizer = OptimizerConfig(algorithm="dadam", lr=1.5e-2, warmup_steps=6, total_steps=args.steps)
        every = max(1, args.steps // 12)
        curves = {"dense DAdam": await dense_curve(corpus, optimizer, args.steps, every),
                  "experts frozen": await dense_curve(corpus, optimizer, args.steps, every, train_experts=False)}
        for name, (replication, capacity, extra) in CURVES.items():
            config = SpesConfig(sync_every=1, merge_every=5, merge_until=args.steps // 2, alpha0=0.1,
                                replication=replication, **extra)
            curves[name] = await spes_curve(corpus, optimizer, config, capacity, args.steps, every)
        print("   " + f"{'step':>6s}" + "".join(f"{name:>16s}" for name in curves))
        for i, (step, _) in enumerate(curves["dense DAdam"]):
            print("   " + f"{step:6d}" + "".join(f"{c[i][1]:16.3f}" for c in curves.values()))
        final = {name: c[-1][1] for name, c in curves.items()}
        for name, loss in final.items():
            print(f"   final {name}: {loss:.3f} ({loss / final['dense DAdam']:.3f}x dense)")
        if args.plot:
            Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
            Path(args.plot).write_text(svg_plot(curves, "Swarm-average validation loss, 4 nodes, small MoE"))
            print(f"   plot written to {args.plot}")
    print(f"\ntook {time.perf_counter() - started:.0f} s")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=72, help="steps per node for the loss curves (0: skip)")
    parser.add_argument("--syncs", type=int, default=4, help="syncs measured per traffic configuration")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-traffic", action="store_true")
    parser.add_argument("--period-steps", type=int, default=0,
                        help="steps per node of the sync-period comparison (part 4; 0: skip)")
    parser.add_argument("--periods", default="1,10,50,100", help="SPES sync periods S compared in part 4")
    parser.add_argument("--warmup-at", default="50", help="periods part 4 also runs with the merge warm-up on")
    parser.add_argument("--seeds", default="0,1,2", help="seeds of part 4 (model init, shards and batches)")
    parser.add_argument("--plot", default="docs/img/spes_loss.svg", help="where to write the SVG ('' : nowhere)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args(sys.argv[1:])))
