"""`murmur plan`: predict per-step time and bytes of a training configuration against ring all-reduce
(the model is `gossip.plan`; this module counts the model's parameters, measures a step's compute when
it is not given, and prints the result)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from gossip.codecs import Codec
from gossip.plan import Compression, Estimate, Plan, PlanConfig, make_plan, round_roles
from gossip.wire import TensorSpec
from topology import Topology

# steps run before the timed ones: the first step allocates and warms the allocator
WARMUP_STEPS = 1


@dataclass(frozen=True)
class StepTime:
    seconds: float
    source: str  # "given", or how it was measured


def model_specs(model: str, seed: int = 0) -> tuple[TensorSpec, ...]:
    """The gossip manifest of a model by name (embedded or import path): one flat float32 tensor per
    named parameter, as a node exchanges them. Builds the model (imports torch)."""
    from node.train.models import build_named_model

    built = build_named_model(model, seed=seed)
    return tuple(TensorSpec(name, "float32", (int(p.numel()),)) for name, p in built.named_parameters())


@dataclass(frozen=True)
class LocalCosts:
    """What this machine measured: one training step's compute, and one sync's local CPU work (None when
    not measured)."""

    step: StepTime | None
    round_cpu_s: float | None


@dataclass(frozen=True)
class Measure:
    """What to time here: steps of `model` (None: none), rounds over these tensors (repeats 0: none)."""

    model: str | None
    steps: int
    batch_size: int
    context: int
    micro_batches: int
    optimizer: str
    threads: int
    round_repeats: int = 0


def measure_costs(measure: Measure, specs: Sequence[TensorSpec], codec: Codec, compression: Compression,
                  topology: Topology) -> LocalCosts:
    """Time training steps of the model (on the embedded corpus, with the recipe's batch, on `threads` torch
    threads) and the local work of a sync, interleaved so that both see the same load: medians after a
    warm-up of each. A sync's work is a symmetric exchange between two GossipPeers over the in-memory
    transport (no link, so its wall time is the two peers' encoding, validation, decoding and mixing, and
    compressed gossip's estimates), halved, times the edges a node has per round (a pull or a served
    pull counting half an exchange)."""
    import asyncio

    async def run() -> LocalCosts:
        async with contextlib.AsyncExitStack() as stack:
            step = await _stepper(measure, stack) if measure.model is not None else None
            pair = await _pair_round(specs, codec, compression) if measure.round_repeats else None
            steps: list[float] = []
            rounds: list[float] = []
            for i in range(WARMUP_STEPS + max(measure.steps if step else 0, measure.round_repeats if pair else 0)):
                if step is not None and i < WARMUP_STEPS + measure.steps:
                    steps.append(await step())
                if pair is not None and i < WARMUP_STEPS + measure.round_repeats:
                    rounds.append(await pair(i))
        step_time = None
        if steps:
            threads = f"{measure.threads} thread{'s' if measure.threads != 1 else ''}" if measure.threads else \
                "torch's default threads"
            step_time = StepTime(statistics.median(steps[WARMUP_STEPS:]), f"measured: median of {measure.steps} steps "
                                 f"of {measure.model} on this machine, {threads}")
        round_cpu = None
        if rounds:
            roles = [r for t in range(topology.period) for r in round_roles(topology, t)]
            edges = statistics.mean(r.asks + r.answers + (r.pulls + r.serves) / 2 for r in roles)
            round_cpu = statistics.median(rounds[WARMUP_STEPS:]) / 2 * edges
        return LocalCosts(step_time, round_cpu)

    return asyncio.run(run())


async def _stepper(measure: Measure, stack: contextlib.AsyncExitStack) -> Callable[[], Awaitable[float]]:
    """A function that takes one training step of the model and returns its compute time."""
    import torch

    from gossip.optimizers import OptimizerConfig
    from node.train.data import embedded_corpus
    from node.train.models import build_named_model
    from node.train.trainer import Trainer, TrainerConfig

    assert measure.model is not None
    if measure.threads:
        torch.set_num_threads(measure.threads)
    corpus = embedded_corpus()
    # DiLoCo's inner steps are Adam steps; the outer step costs a few vector operations per sync
    algorithm = "dsgd" if measure.optimizer == "dsgd" else "dadam"
    config = TrainerConfig(optimizer=OptimizerConfig(algorithm=algorithm, micro_batches=measure.micro_batches),  # type: ignore[arg-type]
                           batch_size=measure.batch_size, context=measure.context, device="cpu", precision="fp32")
    trainer = await stack.enter_async_context(Trainer(build_named_model(measure.model, seed=0), config, peer_id="plan",
                                                      train_tokens=corpus.train, val_tokens=corpus.val))

    async def step() -> float:
        return (await trainer.train_step()).compute_s

    return step


async def _pair_round(specs: Sequence[TensorSpec], codec: Codec, compression: Compression
                      ) -> Callable[[int], Awaitable[float]]:
    """A function that runs round r of a symmetric exchange between two in-process peers; returns its wall time."""
    import numpy as np

    from gossip.choco import ChocoSettings, ChocoState, default_gamma
    from gossip.codecs import Fp32Codec
    from gossip.exchange import ExchangeSettings, GossipPeer
    from gossip.memory import InMemoryNetwork
    from topology import PeerRound

    rng = np.random.default_rng(0)
    tensors = [{s.name: rng.standard_normal(math.prod(s.shape)).astype(np.float32) for s in specs} for _ in range(2)]
    choco = compression is Compression.CHOCO
    settings = ExchangeSettings(swarm="plan", config_hash="0" * 64, codec=Fp32Codec() if choco else codec,
                                exchange_timeout_s=600.0)
    net = InMemoryNetwork()
    anchor = {name: np.zeros_like(x) for name, x in tensors[0].items()}
    peers = [GossipPeer(net.transport(pid), settings, t,
                        choco=ChocoState(ChocoSettings(codec, default_gamma(codec)), anchor) if choco else None)
             for pid, t in zip(("a", "b"), tensors)]
    for peer in peers:
        await peer.start()
    plans = (PeerRound(0.5, {"b": 0.5}, ("b",)), PeerRound(0.5, {"a": 0.5}, ("a",)))

    async def pair(r: int) -> float:
        started = time.perf_counter()
        await asyncio.gather(*(peer.run_round(r, plan) for peer, plan in zip(peers, plans)))
        return time.perf_counter() - started

    return pair


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.3f}"


def _row(e: Estimate) -> str:
    bound = "communication" if e.communication_bound else "compute"
    return (f"| {e.name} | {e.step_s:.3f} | {e.sync_s:.3f} | {e.syncs_per_step:.3g} | {_mb(e.sent_bytes_per_step)} | "
            f"{_mb(e.received_bytes_per_step)} | {e.bytes_per_token:,.1f} | {bound} |")


def describe(plan: Plan, config: PlanConfig, step: StepTime, model: str) -> list[str]:
    """The text report: inputs, one row per way of synchronising, and the verdict."""
    c = config
    options = c.codec.options()
    layout = ", packed, Elias-Fano indices" if options.get("elias_fano") else ", packed" if options.get("packed") else ""
    codec = c.codec.name + (f" (ratio {options['ratio']:g}{layout})" if c.codec.name == "topk" else "")
    lines = [
        f"model: {model}, {plan.numel:,} parameters ({_mb(4 * plan.numel)} MB in fp32), {len(c.specs)} tensors",
        f"compute per step: {step.seconds:.3f} s ({step.source}); {c.tokens_per_step:,} tokens per node per step",
        f"local work of a sync (encode, decode, mix): {c.round_cpu_s:.3f} s of CPU"
        + (" (not counted: --round-cpu measure counts it)" if c.round_cpu_s == 0 else ""),
        f"link: {c.link.bandwidth_mbit:g} Mbit/s each way, {c.link.latency_ms:g} ms one-way, "
        f"{c.link.efficiency:.0%} of the rate for messages",
        f"swarm: {c.peers} peers, {c.topology.name}; {c.algorithm}, codec {codec}, H = {c.local_steps}"
        + (f", P = {c.fragments} fragments" if c.fragments > 1 else "")
        + (", compressed gossip (choco)" if c.compression == "choco" else "")
        + ("" if c.algorithm != "diloco" else (", outer sync overlapped" if c.overlap else ", outer sync not overlapped")
           + f", outer lr {c.outer_lr:g} momentum {c.outer_momentum:g}, "
           + (f"anchors ({c.anchor_codec.name}) mixed at every "
               + ("sync" if c.anchor_every == 1 else f"{c.anchor_every}th sync")
              + (" in the same message" if c.diloco_fused else " in a second round") if c.anchor_every else
              "anchors never mixed")),
        "",
        "| synchronisation | step s | sync s | syncs/step | MB sent/step | MB received/step | bytes sent/token | bound by |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
        _row(plan.gossip), _row(plan.allreduce), _row(plan.data_parallel), "",
    ]
    if plan.winner == "tie":
        lines.append(f"tie: gossip and ring all-reduce take the same time per step ({plan.gossip.step_s:.3f} s); "
                     f"gossip sends {plan.bytes_ratio:.2f}x the bytes")
    elif plan.winner == "gossip":
        lines.append(f"gossip wins: {plan.speedup:.2f}x faster per step than ring all-reduce with the same codec and "
                     f"sync period, sending {plan.bytes_ratio:.2f}x its bytes")
    else:
        lines.append(f"ring all-reduce wins: {1 / plan.speedup:.2f}x faster per step than gossip, which sends "
                     f"{plan.bytes_ratio:.2f}x its bytes")
    dp = plan.data_parallel
    lines.append(f"against data-parallel fp32 all-reduce every step: {dp.step_s / plan.gossip.step_s:.2f}x faster, "
                 f"{plan.gossip.sent_bytes_per_step / dp.sent_bytes_per_step:.4f}x the bytes")
    return lines


def print_plan(plan: Plan, config: PlanConfig, step: StepTime, model: str, *, as_json: bool) -> None:
    if as_json:
        inputs = {"model": model, "params": plan.numel, "tensors": len(config.specs), "step_time_s": step.seconds,
                  "step_time_source": step.source, "bandwidth_mbit": config.link.bandwidth_mbit,
                  "latency_ms": config.link.latency_ms, "link_efficiency": config.link.efficiency,
                  "peers": config.peers, "topology": config.topology.name, "algorithm": str(config.algorithm),
                  "codec": config.codec.name, "codec_options": config.codec.options(),
                  "local_steps": config.local_steps, "fragments": config.fragments,
                  "compression": str(config.compression), "overlap": config.overlap, "outer_lr": config.outer_lr,
                  "outer_momentum": config.outer_momentum, "anchor_every": config.anchor_every,
                  "anchor_codec": config.anchor_codec.name,
                  "tokens_per_step": config.tokens_per_step, "round_cpu_s": config.round_cpu_s}
        print(json.dumps({"inputs": inputs, **plan.as_json()}))
        return
    print("\n".join(describe(plan, config, step, model)))


def plan_and_print(config: PlanConfig, step: StepTime, model: str, *, as_json: bool) -> Plan:
    plan = make_plan(config)
    print_plan(plan, config, step, model, as_json=as_json)
    return plan


def flat_specs(params: int) -> Sequence[TensorSpec]:
    """A model given only by its size: one flat tensor (a real manifest adds a few bytes of header per tensor)."""
    return (TensorSpec("params", "float32", (params,)),)
