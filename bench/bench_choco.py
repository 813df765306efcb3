"""Quality against bytes of compressed gossip (CHOCO) for DAdam, against a single process and DAdam fp32.

Per setup, over several seeds: the final validation loss of the swarm-average model over a single process's
at the same token budget, and the bytes per node per step against DAdam with whole fp32 parameters. The
columns are those of gossip DiLoCo's quality-against-bytes table (bench/bench_lowcomm.py), so the rows of
both sit side by side in docs/benchmarks.md.

4 GossipTrainers over the in-memory transport (no latency: the loss does not depend on the link), the tests'
TINY dense GPT (or, with --model dense, the embedded default dense GPT, DENSE_DEFAULT: on a model that size
the message headers no longer count) and the tuned DAdam schedule (bench/bench_training.py), batch 8 per node against
one process of batch 32, on a ring or (--topology hypercube) the hypercube's one-peer pairings (compressed gossip
needs symmetric edges; DAdam fp32 runs on the same graph, so the rows differ only in what a round sends). Bytes
are every message byte the exchange counts, sent and received.

Run from the repository root:
.venv/bin/python -m bench.bench_choco [--seeds 0,1,2] [--steps 80] [--model tiny|dense] [--topology ring|hypercube]
    [--setups "NAME;..."]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
from dataclasses import dataclass, replace

from bench.bench_training import BATCH, NODES, SCHEDULES, TINY, single_curve, tiny_trainer
from gossip.choco import ChocoSettings, ChocoState, default_gamma
from gossip.codecs import Codec, Int8Codec, TopKCodec, get_codec
from gossip.exchange import ExchangeSettings, GossipPeer
from gossip.lockstep import Lockstep
from gossip.memory import InMemoryNetwork
from node.algorithms.dsgd import GossipTrainer
from node.algorithms.lockstep import drive
from node.train.data import embedded_corpus, peer_shard
from node.train.models import build_model
from node.train.models.gpt import DENSE_DEFAULT, ModelConfig
from node.train.trainer import average_tensors

CORPUS_BYTES = 600_000
# symmetric topologies compressed gossip runs on: the ring (2 neighbours), or the hypercube's one-peer
# pairings (1 neighbour a round, like the default one-peer exponential graph: half the ring's bytes)
TOPOLOGIES = ("ring", "hypercube")
MODELS = {"tiny": TINY, "dense": DENSE_DEFAULT}


@dataclass(frozen=True)
class Setup:
    name: str
    codec: Codec | None  # None: whole fp32 parameters (plain DAdam)
    gamma: float | None = None  # None: gossip.choco.default_gamma of the codec


SETUPS = (
    Setup("DAdam fp32 (baseline)", None),
    Setup("DAdam + choco int8", Int8Codec()),
    Setup("DAdam + choco top-k 10%", TopKCodec(0.1)),
    Setup("DAdam + choco top-k 1%", TopKCodec(0.01)),
    # packed: uint16 in-block offsets and int8 values, 3 bytes per kept entry instead of 8
    Setup("DAdam + choco top-k 1% packed", TopKCodec(0.01, packed=True)),
    Setup("DAdam + choco top-k 1.25% packed", TopKCodec(0.0125, packed=True)),
    # Elias-Fano indices: about 2.05 bytes per kept entry at these ratios instead of 3
    Setup("DAdam + choco top-k 1.25% Elias-Fano", TopKCodec(0.0125, packed=True, elias_fano=True)),
    Setup("DAdam + choco top-k 1.25% Elias-Fano, gamma 0.2", TopKCodec(0.0125, packed=True, elias_fano=True), 0.2),
)


async def swarm_run(setup: Setup, seed: int, steps: int, model: ModelConfig,
                    topology: str = TOPOLOGIES[0]) -> tuple[float, float]:
    """(validation loss of the 4 nodes' average after `steps` steps, mean bytes per node per step)."""
    corpus = embedded_corpus(size_bytes=CORPUS_BYTES)
    optimizer = replace(SCHEDULES["dadam"], total_steps=steps, warmup_steps=max(1, steps // 10))
    ids = [f"s{seed}-peer{i}" for i in range(NODES)]
    net = InMemoryNetwork()
    trainers = [tiny_trainer(corpus, optimizer, pid, seed, BATCH, peer_shard(corpus, pid), model) for pid in ids]
    try:
        anchor = await trainers[0].tensors()
        nodes = []
        settings = ExchangeSettings(swarm="bench", config_hash="0" * 64, codec=get_codec("fp32"), exchange_timeout_s=60)
        for pid, trainer in zip(ids, trainers):
            choco = (ChocoState(ChocoSettings(setup.codec, setup.gamma or default_gamma(setup.codec)), anchor)
                     if setup.codec is not None else None)
            peer = GossipPeer(net.transport(pid), settings, await trainer.tensors(), choco=choco)
            await peer.start()
            nodes.append(GossipTrainer(trainer, peer))
        await drive(nodes, steps, Lockstep(ids, topology))
        loss = await trainers[0].evaluate(average_tensors([await t.tensors() for t in trainers]))
        moved = statistics.mean(n.peer.stats.bytes_sent + n.peer.stats.bytes_received for n in nodes) / steps
        return loss, moved
    finally:
        for trainer in trainers:
            trainer.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.bench_choco", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny",
                        help="tiny: the tests' TINY GPT (100,992 parameters); dense: the embedded default dense GPT")
    parser.add_argument("--topology", choices=TOPOLOGIES, default=TOPOLOGIES[0],
                        help="the graph every row gossips on, DAdam fp32 included (default ring)")
    parser.add_argument("--setups", default="", help="only these setups (names, ';'-separated; the baseline "
                        "always runs)")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    model = MODELS[args.model]
    wanted = {name.strip() for name in args.setups.split(";") if name.strip()}
    unknown = wanted - {s.name for s in SETUPS}
    if unknown:
        parser.error(f"unknown setups {sorted(unknown)}; known: {[s.name for s in SETUPS]}")
    setups = [s for s in SETUPS if s is SETUPS[0] or not wanted or s.name in wanted]
    print(f"command: .venv/bin/python -m bench.bench_choco {' '.join(argv)}".rstrip())
    print(f"python {platform.python_version()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start",
          flush=True)
    print(f"model {args.model}: {sum(p.numel() for p in build_model(model).parameters()):,} parameters; "
          f"topology {args.topology}", flush=True)

    async def run() -> dict[str, list[tuple[float, float, float]]]:
        corpus = embedded_corpus(size_bytes=CORPUS_BYTES)
        results: dict[str, list[tuple[float, float, float]]] = {s.name: [] for s in setups}
        for seed in seeds:
            optimizer = replace(SCHEDULES["dadam"], total_steps=args.steps, warmup_steps=max(1, args.steps // 10))
            single = (await single_curve(corpus, optimizer, seed, args.steps, args.steps, model)).losses[-1]
            for setup in setups:
                loss, moved = await swarm_run(setup, seed, args.steps, model, args.topology)
                results[setup.name].append((loss / single, moved, loss))
                print(f"seed {seed} {setup.name}: loss {loss:.4f} (single {single:.4f}, {loss / single:.3f}x), "
                      f"{moved / 1e3:.1f} kB per node per step", flush=True)
        return results

    results = asyncio.run(run())
    baseline = results[SETUPS[0].name]
    base = statistics.median(m for _, m, _ in baseline)
    lines = ["", f"| setup | final val loss / single process (median of {len(seeds)} seeds) | seeds | "
             "/ DAdam fp32's loss (median of the seeds' ratios) | bytes per node per step | / DAdam fp32's bytes | "
             "target (<= 1% bytes, <= 1.03x loss) |", "|---|---:|---|---:|---:|---:|---|",
             f"| single process (batch {NODES * BATCH}) | 1.000 | - | - | 0 | - | |"]
    for setup in setups:
        rows = results[setup.name]
        ratio = statistics.median(r for r, _, _ in rows)
        moved = statistics.median(m for _, m, _ in rows)
        to_dadam = statistics.median(loss / b for (_, _, loss), (_, _, b) in zip(rows, baseline, strict=True))
        met = "" if setup is SETUPS[0] else ("met" if moved / base <= 0.01 and to_dadam <= 1.03 else "missed")
        lines.append(f"| {setup.name} | {ratio:.3f} | {', '.join(f'{r:.3f}' for r, _, _ in rows)} | {to_dadam:.3f} | "
                     f"{moved / 1e3:,.1f} kB | {moved / base:.4f} | {met} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
