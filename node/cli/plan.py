"""`murmur plan`: predict per-step time and bytes of a training configuration against ring all-reduce
(the model is `gossip.plan`; this module counts the model's parameters, measures a step's compute when
it is not given, and prints the result)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

from gossip.codecs import Codec, TopKCodec, get_codec
from gossip.diloco import DILOCO_DEFAULTS, DILOCO_LOCAL_STEPS, PHASE_ROOM, phase_seconds_for
from gossip.knobs import codec_outer_step
from gossip.plan import (
    DEFAULT_LINK_EFFICIENCY,
    Algorithm,
    Compression,
    Estimate,
    LinkSpec,
    Plan,
    PlanConfig,
    make_plan,
    round_roles,
)
from gossip.rules import Knobs, Rule, broken_rules
from gossip.wire import TensorSpec, message_nbytes
from node.cli.args import (
    UsageError,
    add_knob_flag,
    add_topology_options,
    non_negative_float,
    non_negative_int,
    number,
    positive_int,
    topology_spec,
    values_checked,
)
from node.config import DEFAULTS, Command, setting_value
from node.swarm.joining import JoinCheck, JoinRules, join_check
from node.swarm.recipe import MAX_MEMBERSHIP_SHARDS
from topology import Topology, build_topology

# steps run before the timed ones: the first step allocates and warms the allocator
WARMUP_STEPS = 1
DEFAULT_HEARTBEAT_S = DEFAULTS.heartbeat_s
# a DHT entry beyond its value: the owner's subkey (an OpenSSH RSA key, ~400 bytes) and the signature (~350)
DHT_ENTRY_OVERHEAD = 800


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
    codec = c.codec.name + (f" (ratio {options['ratio']:g}{layout})" if c.codec.name == "topk"
                            else f" (ratio {options['ratio']:g}, chunk {options['chunk']}, {options['bits']} bits)"
                            if c.codec.name == "sparseloco" else "")
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
    lines.append(f"a gossip sync: {plan.gossip.sync_s:.1f} s, its messages over this link (a symmetric exchange's request "
                 "and reply at once; compressed gossip's one after the other); --exchange-timeout bounds only how long "
                 "a neighbour takes to start answering, the payload is paced as a download is")
    d, up = plan.download, catch_up(plan, c)
    copies = ("one such copy, in parts from up to 4 donors at once, and two blocks of ~5% of each part from two "
              "other donors" if up.check is JoinCheck.SPOT
              else "three such copies, one from each of three donors at once")
    lines.append(f"a joiner's download from one donor: {_mb(d.nbytes)} MB in {d.seconds:.1f} s over this link; cut "
                 f"only when it stalls or falls below the goodput floor (at most {d.bound_s:.0f} s before any goodput "
                 f"is measured: --stall-timeout, --goodput-floor); a catch-up at this size (--join-check auto: "
                 f"{up.check}) moves {copies}"
                 + (f", then the outer momentum from {up.momentum_copies} of the peers that vouched for them, whole "
                    "in int8" if up.momentum_copies else "")
                 + f": {_mb(up.nbytes)} MB ({up.nbytes / d.nbytes:.1f} fp32 copies) in about {up.seconds:.0f} s "
                 "through the joiner's link, and evaluates the parameters (a few forward passes over the validation "
                 "batches)")
    if c.algorithm is Algorithm.DILOCO:
        lines.append(f"volunteers of unequal speed: --phase-seconds {phase_seconds_for(c.step_time_s, c.local_steps):.3g} "
                     f"fits H = {c.local_steps} steps of this compute with {PHASE_ROOM - 1:.0%} room; a node slower "
                     "than that trains what fits each phase, passes over the rest and syncs with the swarm, its "
                     "pseudo-gradient weighed by the steps it trained (docs/training.md)")
    m = membership(c.peers)
    every = m.read_interval_s(DEFAULT_HEARTBEAT_S)
    lines.append(f"membership: {c.peers} peer records of ~{m.record_bytes} B make a view read of ~{m.read_bytes / 1024:.0f} "
                 f"KiB, stored back once; a node reads it every {every:.1f} s, "
                 + ("every half of the default heartbeat" if every <= DEFAULT_HEARTBEAT_S / 2 else
                    f"as often as ~{m.budget_mbit_s:g} Mbit/s each way allows (every half heartbeat would "
                    f"cost {m.mbit_s(DEFAULT_HEARTBEAT_S):.1f} Mbit/s), so its view is up to that stale")
                 + "; one DHT key answers at most 4 MiB: "
                 + ("one key holds them" if m.shards == 1 else f"found the swarm with --membership-shards {m.shards}"
                    if m.shards <= MAX_MEMBERSHIP_SHARDS else f"more than {MAX_MEMBERSHIP_SHARDS} shards would be needed"))
    return lines


@dataclass(frozen=True)
class Membership:
    """What reading the swarm's membership costs a node (node.net.discovery reads every shard of
    `<swarm>.peers` every half heartbeat; hivemind stores what it found back on the nearest node that
    lacked it)."""

    record_bytes: int  # one peer record as the DHT stores it
    read_bytes: int  # every record, once
    shards: int  # the fewest shards that keep every key under half of what a DHT node answers
    budget_mbit_s: float  # what a node's background reads of it may cost each way

    def mbit_s(self, heartbeat_s: float) -> float:
        """Each way, were it read every half of `heartbeat_s`: two reads a heartbeat in, each stored back once out."""
        return 2 * self.read_bytes * 8 / heartbeat_s / 1e6

    def read_interval_s(self, heartbeat_s: float) -> float:
        """How often a node reads it: every half heartbeat, or as often as the budget allows (as
        node.net.discovery.Discovery.read_interval_s spaces its reads)."""
        from node.net.discovery import read_interval_s

        return read_interval_s(self.read_bytes, heartbeat_s / 2, self.budget_mbit_s)

    def as_json(self) -> dict[str, float]:
        return {"record_bytes": self.record_bytes, "read_bytes": self.read_bytes, "shards": self.shards,
                "read_interval_s": self.read_interval_s(DEFAULT_HEARTBEAT_S),
                "mbit_s_unspaced": self.mbit_s(DEFAULT_HEARTBEAT_S)}


def membership(peers: int) -> Membership:
    from node.net.discovery import MEMBERSHIP_BUDGET_MBIT_S, SHARD_WARN_BYTES
    from node.net.records import PeerRecord, encode_peer_record

    peer = "Qm" + "x" * 44  # a peer id's length; three addresses, a step, a credential's length
    record = PeerRecord(peer_id=peer, maddrs=tuple(f"/ip4/203.0.113.{i}/tcp/31337/p2p/{peer}" for i in range(3)),
                        step=10**6, round=10**5, experts=(), capacity=0, version="0.1.0", heartbeat=1.7e9,
                        credential="c" * 64, config_hash="h" * 64)
    size = len(encode_peer_record(record)) + DHT_ENTRY_OVERHEAD
    read = peers * size
    return Membership(size, read, max(1, math.ceil(read / SHARD_WARN_BYTES)), MEMBERSHIP_BUDGET_MBIT_S)


@dataclass(frozen=True)
class CatchUp:
    """A joiner's catch-up under `--join-check auto`: the copies of the parameters it downloads, those of
    gossip DiLoCo's outer momentum after them (whole, in int8, from up to 3 of the peers that vouched for
    the parameters), and how long all of them take."""

    check: JoinCheck
    copies: float
    momentum_copies: int
    nbytes: float
    seconds: float

    def as_json(self) -> dict[str, object]:
        return {"check": str(self.check), "copies": self.copies, "momentum_copies": self.momentum_copies,
                "bytes": self.nbytes, "seconds": self.seconds}


def catch_up(plan: Plan, config: PlanConfig) -> CatchUp:
    """The joiner's own link carries every copy (its downloads run at once and share it), after the round
    trips of one download."""
    from node.algorithms.diloco.swarm import MOMENTUM_SOURCES
    from node.algorithms.diloco.trainer import MOMENTUM_CODEC

    check = join_check(JoinCheck.AUTO, plan.numel)
    copies = JoinRules().copies_moved(check)
    momentum = MOMENTUM_SOURCES if config.algorithm is Algorithm.DILOCO and config.outer_momentum > 0 else 0
    d = plan.download
    moved = copies * d.nbytes + momentum * message_nbytes(config.specs, get_codec(MOMENTUM_CODEC), kind="reply")
    return CatchUp(check, copies, momentum, moved, d.seconds + config.link.transfer_s(moved - d.nbytes))


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
        phase = ({"phase_seconds": phase_seconds_for(config.step_time_s, config.local_steps)}
                 if config.algorithm is Algorithm.DILOCO else {})
        print(json.dumps({"inputs": inputs, **plan.as_json(), "catch_up": catch_up(plan, config).as_json(),
                          "membership": membership(config.peers).as_json(), **phase}))
        return
    print("\n".join(describe(plan, config, step, model)))


def plan_and_print(config: PlanConfig, step: StepTime, model: str, *, as_json: bool) -> Plan:
    plan = make_plan(config)
    print_plan(plan, config, step, model, as_json=as_json)
    return plan


def flat_specs(params: int) -> Sequence[TensorSpec]:
    """A model given only by its size: one flat tensor (a real manifest adds a few bytes of header per tensor)."""
    return (TensorSpec("params", "float32", (params,)),)


# diloco's inner steps per outer sync when --local-steps is not given: a node's own default
PLAN_DILOCO_LOCAL_STEPS = DILOCO_LOCAL_STEPS


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    plan = commands.add_parser(
        Command.PLAN, help="predict per-step time and bytes of a configuration against ring all-reduce",
        description="Predict, for a model, a link and a swarm, the time per step and the bytes per step and per "
        "token of gossip training as murmur runs it, next to ring all-reduce with the same codec and sync period "
        "and to data-parallel fp32 all-reduce every step, and say which wins and by how much (docs/plan.md). "
        "Bytes are the exact message sizes of the wire format; times are a model checked against "
        "bench/bench_wan.py. Without --step-time it measures a step of the model on this machine.")
    size = plan.add_mutually_exclusive_group()
    add_knob_flag(size, "training.model", metavar="MODEL",
                  help="model whose parameters are counted: moe, dense or package.module:callable (default %(default)s)")
    size.add_argument("--params", type=positive_int, help="parameter count instead of a model (needs --step-time)")
    plan.add_argument("--step-time", type=number(float, lo=0.0), metavar="SECONDS",
                      help="compute time of one step on one node (default: measured on this machine)")
    plan.add_argument("--measure-steps", type=number(int, lo=1, hi=100), default=3,
                      help="steps timed when measuring the step time, after one warm-up (default 3)")
    plan.add_argument("--round-cpu", type=_round_cpu, metavar="SECONDS|measure",
                      help="CPU seconds of one sync's local work on a node (encoding, decoding, mixing), or 'measure' "
                      "to time it here (default: measured when the step time is, else 0)")
    # not the node's --threads: its default (torch's own) would time a step on all cores
    plan.add_argument("--threads", type=non_negative_int, default=1,
                      help="torch threads when measuring; 0: torch's default (default 1, as murmur demo runs nodes)")
    plan.add_argument("--bandwidth-mbit", type=number(float, lo=1e-6), default=20.0,
                      help="each node's link rate in Mbit/s, each way (default 20)")
    plan.add_argument("--latency-ms", type=non_negative_float, default=25.0, help="one-way latency (default 25)")
    plan.add_argument("--link-efficiency", type=number(float, lo=1e-3, hi=1.0), default=None,
                      help="share of the link rate that carries message bytes (default 0.93, measured)")
    plan.add_argument("--peers", type=number(int, lo=2), default=8, help="number of peers (default 8)")
    # The swarm's knobs: name, bounds, choices and default are the settings table's (add_knob_flag)
    add_knob_flag(plan, "gossip.topology.name", help="gossip topology (default %(default)s)")
    add_knob_flag(plan, "training.optimizer",
                  help="dsgd, dadam (round overlapped with the step) or diloco (default %(default)s)")
    add_knob_flag(plan, "training.local_steps", default=None,
                  help=f"H: steps between syncs (default {setting_value(DEFAULTS, 'training.local_steps')}; "
                  f"{PLAN_DILOCO_LOCAL_STEPS} for diloco)")
    # a plan may model more fragments than a node takes (the node's bound is the DiLoCo config's)
    plan.add_argument("--fragments", type=positive_int, default=DILOCO_DEFAULTS.fragments,
                      help="P: diloco's streaming fragments, each synced once per H steps (default %(default)s)")
    add_knob_flag(plan, "training.overlap",
                  help="diloco: the outer sync runs while the next phase computes (default off, as a node's)")
    add_knob_flag(plan, "training.outer_lr", default=None,
                  help=f"diloco: outer learning rate (default {DILOCO_DEFAULTS.outer_lr:g}, 1 with --codec sparseloco, "
                  "as a node's; with 1, momentum 0 and --anchor-codec equal to --codec a sync that mixes anchors "
                  "sends one message instead of two)")
    add_knob_flag(plan, "training.outer_momentum", default=None,
                  help=f"diloco: outer Nesterov momentum (default {DILOCO_DEFAULTS.outer_momentum:g}, 0 with --codec "
                  "sparseloco, as a node's)")
    add_knob_flag(plan, "training.anchor_every",
                  help="diloco: the anchors are mixed too at every this-many-th sync, a second round; 0: never "
                  "(default %(default)s)")
    add_knob_flag(plan, "training.anchor_codec", help="diloco: codec of the anchors (default %(default)s)")
    add_knob_flag(plan, "gossip.codec", help="wire codec (default %(default)s)")
    add_knob_flag(plan, "gossip.topk_ratio", help="share of the elements --codec topk sends (default %(default)s)")
    # store_true, not the node's --flag/--no-flag pair: a plan has no lower layer to turn off
    add_knob_flag(plan, "gossip.topk_packed", action="store_true",
                  help="--codec topk in the packed layout: 3 bytes per kept element instead of 8")
    add_knob_flag(plan, "gossip.topk_elias_fano", action="store_true",
                  help="--codec topk packed with Elias-Fano indices: about 2 bytes per kept element at 1-2%%")
    add_knob_flag(plan, "gossip.compression",
                  help="choco: dsgd/dadam send compressed differences against per-neighbour estimates")
    add_knob_flag(plan, "training.batch_size", help="sequences per micro-batch (default %(default)s)")
    add_knob_flag(plan, "training.context", help="tokens per sequence (default %(default)s)")
    add_knob_flag(plan, "training.micro_batches", help="micro-batches per step (default %(default)s)")
    plan.add_argument("--json", action="store_true",
                      help="print one JSON object: inputs, numel, gossip, allreduce, data_parallel (each: step_s, "
                      "sync_s, syncs_per_step, sent_bytes_per_step, received_bytes_per_step, bytes_per_token, ...), "
                      "winner, speedup, bytes_ratio, vs_data_parallel")
    add_topology_options(plan)
    plan.set_defaults(run=_run_plan)


def _round_cpu(text: str) -> float | str:
    """--round-cpu: seconds, or 'measure'."""
    return text if text == "measure" else number(float, lo=0.0)(text)


def _run_plan(args: argparse.Namespace) -> int:
    from gossip.choco import check_topology

    algorithm, compression = Algorithm(args.optimizer), Compression(args.gossip_compression)
    if args.params is not None and args.step_time is None:
        raise UsageError("--params gives no model to measure a step of: pass --step-time SECONDS too")
    # the combinations PlanConfig refuses, checked before a model is built (that imports torch)
    broken = broken_rules(Knobs(codec=args.codec, diloco=algorithm is Algorithm.DILOCO,
                                choco=compression is Compression.CHOCO, fragments=args.fragments))
    if Rule.FRAGMENTS_WITHOUT_DILOCO in broken:
        raise UsageError("--fragments: streaming fragments are diloco's outer sync; use them with --optimizer diloco")
    if Rule.CHOCO_WITH_DILOCO in broken:
        raise UsageError("--gossip-compression choco is for the per-step algorithms dsgd and dadam; diloco "
                         "compresses its pseudo-gradients with --codec")
    if Rule.TOPK_ON_WHOLE_PARAMETERS in broken:
        raise UsageError("--codec topk drops most of every message; it is sound on differences only: use it with "
                         "--gossip-compression choco or --optimizer diloco")
    topology = topology_spec(args, args.topology)
    with values_checked():
        if compression is Compression.CHOCO:
            check_topology(topology)
        codec = (TopKCodec(args.topk_ratio, args.topk_packed or args.topk_elias_fano, args.topk_elias_fano)
                 if args.codec == "topk" else get_codec(args.codec, ratio=args.topk_ratio)
                 if args.codec == "sparseloco" else get_codec(args.codec))
        link = LinkSpec(args.bandwidth_mbit, args.latency_ms,
                        DEFAULT_LINK_EFFICIENCY if args.link_efficiency is None else args.link_efficiency)
        build_topology(topology, args.peers)  # a bad combination fails here, in one line
    if args.params is not None:
        specs, model = tuple(flat_specs(args.params)), f"{args.params:,} parameters"
    else:
        try:
            specs, model = model_specs(args.model), args.model
        except (ValueError, ImportError, AttributeError, TypeError) as exc:
            raise UsageError(f"--model {args.model}: {exc}") from None
    local_steps = args.local_steps or (PLAN_DILOCO_LOCAL_STEPS if algorithm is Algorithm.DILOCO else 1)
    outer_lr, outer_momentum = codec_outer_step(args.codec) or (DILOCO_DEFAULTS.outer_lr, DILOCO_DEFAULTS.outer_momentum)
    outer_lr = outer_lr if args.outer_lr is None else args.outer_lr
    outer_momentum = outer_momentum if args.outer_momentum is None else args.outer_momentum
    with values_checked():
        config = PlanConfig(specs, 0.0 if args.step_time is None else args.step_time, link, args.peers, topology,
                            algorithm=algorithm, codec=codec, local_steps=local_steps, fragments=args.fragments,
                            compression=compression, overlap=args.overlap, outer_lr=outer_lr,
                            outer_momentum=outer_momentum, anchor_every=args.anchor_every,
                            anchor_codec=get_codec(args.anchor_codec),
                            tokens_per_step=args.batch_size * args.context * args.micro_batches)
    # a step time given from elsewhere (say a GPU) says nothing of this machine's CPU: then 0 unless asked
    measure_cpu = args.round_cpu == "measure" or (args.round_cpu is None and args.step_time is None)
    costs = measure_costs(Measure(None if args.step_time is not None else args.model, args.measure_steps,
                                  args.batch_size, args.context, args.micro_batches, args.optimizer, args.threads,
                                  round_repeats=args.measure_steps if measure_cpu else 0),
                          specs, codec, compression, build_topology(topology, args.peers))
    step = costs.step if costs.step is not None else StepTime(args.step_time, "given")
    round_cpu = args.round_cpu if isinstance(args.round_cpu, float) else costs.round_cpu_s or 0.0
    config = replace(config, step_time_s=step.seconds, round_cpu_s=round_cpu)
    plan_and_print(config, step, model, as_json=args.json)
    return 0
