"""The runtime model behind `murmur plan`: per-step time and bytes of a gossip training configuration
and of ring all-reduce for the same model and link, from the wire's exact message sizes and the
exchange protocol's message pattern (docs/plan.md has the formulas and their checks).

Pure arithmetic: no network, no torch. Bytes are exact where the protocol fixes them (every message a
round sends, header included, as `gossip.wire.message_nbytes` counts it); times are a model: transfers
at the link's effective rate plus the protocol's round trips.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gossip.codecs import SPARSE_CODECS, Codec, Fp32Codec, get_codec
from gossip.diloco.config import DILOCO_DEFAULTS
from gossip.exchange import DUPLEX, WHOLE_MODEL_CODEC
from gossip.optimizers import OptimizerConfig
from gossip.pace import DEFAULT_PACE, TransferPace
from gossip.rules import Knobs, Rule, broken_rules
from gossip.wire import MetaValue, TensorSpec, message_nbytes
from topology import MembershipView, Topology, TopologySpec, build_topology, peer_round

# What a typical live header carries (docs/plan.md): an RSA peer id (46 characters), a sha256 config hash.
TYPICAL_SENDER = "Qm" + "1" * 44
TYPICAL_CONFIG_HASH = "0" * 64
# Effective share of the link rate that carries message bytes (TCP/IP, Noise and yamux framing take the
# rest): a raw p2pd stream across a tbf-shaped link moved 0.96 of the rate, the exchange 0.87-0.93.
DEFAULT_LINK_EFFICIENCY = 0.93
# Round trips a round costs besides its transfers: opening a stream (multistream-select) and the request
# (a pull); an exchange adds the ack and the answerer's hang-up that the asker waits for.
PULL_ROUND_TRIPS = 2
EXCHANGE_ROUND_TRIPS = 3
# DiLoCo's anchors are mixed on their own peer, whose messages carry the config hash with this suffix
ANCHOR_HASH_SUFFIX = "/anchor"
# Round trips of one ring all-reduce step (send a chunk, the next peer has it): one latency each way.
ALLREDUCE_STEP_LATENCIES = 1


class Algorithm(enum.StrEnum):
    """What a step does between syncs (docs/training.md)."""

    DSGD = "dsgd"  # local step, then the round: communication adds to compute
    DADAM = "dadam"  # the round of x_t runs while g(x_t) is computed
    DILOCO = "diloco"  # H inner steps, then an outer sync of the pseudo-gradients (overlapped or not)


class Compression(enum.StrEnum):
    """How a round's payload is formed."""

    NONE = "none"  # the whole tensors, in the codec
    CHOCO = "choco"  # compressed differences against per-neighbour estimates (gossip/choco.py)


class Winner(enum.StrEnum):
    GOSSIP = "gossip"
    ALLREDUCE = "allreduce"
    TIE = "tie"


@dataclass(frozen=True)
class LinkSpec:
    """Every node's access link: symmetric rate, one-way latency, and the share of the rate messages get."""

    bandwidth_mbit: float
    latency_ms: float = 0.0
    efficiency: float = DEFAULT_LINK_EFFICIENCY

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bandwidth_mbit) and self.bandwidth_mbit > 0):
            raise ValueError(f"bandwidth must be a finite number of Mbit/s > 0, got {self.bandwidth_mbit!r}")
        if not (math.isfinite(self.latency_ms) and self.latency_ms >= 0):
            raise ValueError(f"latency must be a finite number of ms >= 0, got {self.latency_ms!r}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"link efficiency must be in (0, 1], got {self.efficiency!r}")

    @property
    def bytes_per_s(self) -> float:
        """Message bytes per second one direction of the link carries."""
        return self.bandwidth_mbit * 1e6 / 8 * self.efficiency

    @property
    def latency_s(self) -> float:
        return self.latency_ms / 1000

    def transfer_s(self, nbytes: float) -> float:
        return nbytes / self.bytes_per_s


@dataclass(frozen=True)
class HeaderValues:
    """The per-message header fields that change a message's size by a few bytes (docs/plan.md)."""

    swarm: str = "murmur"
    config_hash: str = TYPICAL_CONFIG_HASH
    sender: str = TYPICAL_SENDER
    round: int = 1000
    step: int = 1000


@dataclass(frozen=True)
class PlanConfig:
    """One configuration to predict. `specs` are the gossip tensors (names, dtypes, shapes: the manifest),
    `step_time_s` one optimizer step's compute on one node, `tokens_per_step` the tokens one node's step
    consumes. `local_steps` is H (steps between rounds; DiLoCo's inner steps), `fragments` is P
    (DiLoCo's streaming fragments, each synced once per H steps). DiLoCo's outer step and anchors
    (`outer_lr`, `outer_momentum`, `anchor_every`, `anchor_codec`, as gossip.diloco.DilocoConfig has
    them) decide how many rounds a fragment's sync runs (`diloco_rounds`)."""

    specs: tuple[TensorSpec, ...]
    step_time_s: float
    link: LinkSpec
    peers: int
    topology: TopologySpec
    algorithm: Algorithm = Algorithm.DADAM
    codec: Codec = field(default_factory=Fp32Codec)
    local_steps: int = OptimizerConfig.local_steps
    fragments: int = DILOCO_DEFAULTS.fragments
    compression: Compression = Compression.NONE
    tokens_per_step: int = 16 * 128
    overlap: bool = DILOCO_DEFAULTS.overlap  # DiLoCo's outer sync runs during the next inner phase (--overlap)
    outer_lr: float = DILOCO_DEFAULTS.outer_lr
    outer_momentum: float = DILOCO_DEFAULTS.outer_momentum
    anchor_every: int = DILOCO_DEFAULTS.anchor_every  # DiLoCo mixes the anchors too at every this-many-th sync; 0: never
    anchor_codec: Codec = field(default_factory=lambda: get_codec(DILOCO_DEFAULTS.anchor_codec))
    header: HeaderValues = HeaderValues()
    # meta a round's tensor messages carry (CHOCO's edge state); None: what `compression` implies
    meta: Mapping[str, MetaValue] | None = None
    # CPU seconds of one sync's local work on one node (encoding, validating and decoding messages, mixing,
    # compressed gossip's estimates), on the cores that compute the steps (see docs/plan.md)
    round_cpu_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.specs:
            raise ValueError("a plan needs the model's tensors (at least one)")
        if not (math.isfinite(self.step_time_s) and self.step_time_s >= 0):
            raise ValueError(f"step time must be a finite number of seconds >= 0, got {self.step_time_s!r}")
        if self.peers < 2:
            raise ValueError(f"a plan needs at least 2 peers, got {self.peers}")
        if self.local_steps < 1:
            raise ValueError(f"local steps (H) must be >= 1, got {self.local_steps}")
        if self.fragments < 1:
            raise ValueError(f"fragments (P) must be >= 1, got {self.fragments}")
        broken = broken_rules(Knobs(codec=self.codec.name, diloco=self.algorithm is Algorithm.DILOCO,
                                    choco=self.compression is Compression.CHOCO, fragments=self.fragments))
        if Rule.FRAGMENTS_WITHOUT_DILOCO in broken:
            raise ValueError("fragments (P > 1) are DiLoCo's streaming sync; use them with --optimizer diloco")
        if self.fragments > len(self.specs):
            raise ValueError(f"{self.fragments} fragments of a model of {len(self.specs)} tensors: at most one per tensor")
        if Rule.CHOCO_WITH_DILOCO in broken:
            raise ValueError("compressed gossip (choco) is for the per-step algorithms dsgd and dadam")
        if self.tokens_per_step < 1:
            raise ValueError(f"tokens per step must be >= 1, got {self.tokens_per_step}")
        if not (math.isfinite(self.round_cpu_s) and self.round_cpu_s >= 0):
            raise ValueError(f"round CPU time must be a finite number of seconds >= 0, got {self.round_cpu_s!r}")
        if self.anchor_every < 0:
            raise ValueError(f"anchor_every must be >= 0, got {self.anchor_every}")
        if self.anchor_codec.name in SPARSE_CODECS:
            raise ValueError(f"anchors are whole parameters: {self.anchor_codec.name} is sound on differences only")

    @property
    def diloco_fused(self) -> bool:
        """Whether a DiLoCo sync that mixes anchors sends one message (anchor - pseudo-gradient) instead of
        two: outer lr 1, no momentum and one codec (as node.algorithms.outer_group.OuterGroup decides)."""
        return self.outer_lr == 1.0 and self.outer_momentum == 0.0 and self.anchor_codec.name == self.codec.name

    @property
    def anchor_share(self) -> float:
        """The share of DiLoCo's syncs that mix anchors (gossip.diloco.DilocoConfig.mixes_anchors)."""
        return 1 / self.anchor_every if self.algorithm is Algorithm.DILOCO and self.anchor_every > 0 else 0.0

    @property
    def numel(self) -> int:
        return sum(math.prod(spec.shape) for spec in self.specs)


@dataclass(frozen=True)
class MessageSizes:
    """Exact bytes of the messages of one round over one tensor group (header frames included)."""

    exchange: int  # an asker's request, with its tensors
    reply: int  # an answer, with the answerer's tensors
    ack: int  # header only
    pull: int  # header only
    duplex: bool = True  # an exchange's request and reply cross at once (dense gossip; not compressed gossip)

    @classmethod
    def of(cls, specs: Sequence[TensorSpec], codec: Codec, header: HeaderValues,
           meta: Mapping[str, MetaValue] | None = None, control_codec: Codec | None = None,
           duplex: bool = True) -> MessageSizes:
        """`control_codec` is the codec named in header-only messages (acks, pulls), when it is not the
        tensors' (compressed gossip sends differences in its own codec and the rest in the exchange's)."""
        def size(kind: str, tensors: Sequence[TensorSpec], named: Codec, with_meta: Mapping[str, MetaValue] | None) -> int:
            return message_nbytes(tensors, named, swarm=header.swarm, config_hash=header.config_hash,
                                  sender=header.sender, round=header.round, step=header.step, kind=kind,
                                  meta=with_meta)

        control = control_codec or codec
        asked = {**(meta or {}), DUPLEX: True} if duplex else meta  # the asker's flag (gossip.exchange)
        return cls(exchange=size("exchange", specs, codec, asked), reply=size("reply", specs, codec, meta),
                   ack=size("ack", (), control, None), pull=size("pull", (), control, None), duplex=duplex)


@dataclass(frozen=True)
class RoleCounts:
    """One rank's part in one round: exchanges it asks and answers (symmetric edges), pulls it makes and serves."""

    asks: int = 0
    answers: int = 0
    pulls: int = 0
    serves: int = 0

    def sent(self, m: MessageSizes) -> int:
        return self.asks * (m.exchange + m.ack) + self.answers * m.reply + self.pulls * m.pull + self.serves * m.reply

    def received(self, m: MessageSizes) -> int:
        return self.asks * m.reply + self.answers * (m.exchange + m.ack) + self.pulls * m.reply + self.serves * m.pull

    def transfers(self, duplex: bool = True) -> int:
        """Tensor messages in a row on this rank's busier direction. A duplex exchange's request and reply
        cross at once, so each direction carries one message per exchange asked or answered; without
        duplex (compressed gossip) requests go out (and come in) before the replies can (an answer waits
        for the whole request), so an exchange costs two. Pulls only carry tensors one way, concurrently
        in both directions."""
        exchanges = self.asks + self.answers if duplex else 2 * max(self.asks, self.answers)
        return exchanges + max(self.pulls, self.serves)


def round_roles(topology: Topology, round_index: int) -> list[RoleCounts]:
    """Every rank's roles in round `round_index`, as `GossipPeer.run_round` assigns them: a neighbour that
    is both in- and out-neighbour is a symmetric edge whose smaller id asks; an in-neighbour only is pulled."""
    view = MembershipView.of(f"{rank:08d}" for rank in range(topology.n))
    roles = []
    for rank, peer in enumerate(view.peer_ids):
        plan = peer_round(topology, view, peer, round_index)
        asks = answers = pulls = 0
        for other in plan.in_weights:
            if other in plan.out_peers:
                if peer < other:
                    asks += 1
                else:
                    answers += 1
            else:
                pulls += 1
        serves = sum(1 for other in plan.out_peers if other not in plan.in_weights)
        roles.append(RoleCounts(asks, answers, pulls, serves))
        assert view.rank_of(peer) == rank
    return roles


@dataclass(frozen=True)
class RoundCost:
    """One gossip round (or one fragment's sync) averaged over the ranks and the rounds of a period."""

    sent_bytes: float  # mean per node
    received_bytes: float  # mean per node
    time_s: float  # mean over the period of the slowest rank's round

    def as_json(self) -> dict[str, float]:
        return {"sent_bytes": self.sent_bytes, "received_bytes": self.received_bytes, "time_s": self.time_s}


def gossip_round(topology: Topology, sizes: MessageSizes, link: LinkSpec, *alongside: MessageSizes) -> RoundCost:
    """Bytes and time of one round over `topology` with these message sizes, averaged over one period;
    with `alongside`, as many more rounds of the same plan run at once on their own streams (DiLoCo's
    anchors next to its pseudo-gradients): their bytes share the link, their round trips overlap."""
    sent = received = time_s = 0.0
    groups = (sizes, *alongside)
    for t in range(topology.period):
        roles = round_roles(topology, t)
        sent += sum(r.sent(m) for r in roles for m in groups) / len(roles)
        received += sum(r.received(m) for r in roles for m in groups) / len(roles)
        # the slowest rank paces the swarm: its neighbours wait for it to begin the next round
        duplex = all(m.duplex for m in groups)
        slowest = max(roles, key=lambda r: r.transfers(duplex))
        tensor_bytes = sum(max(m.exchange, m.reply) for m in groups)
        trips = (EXCHANGE_ROUND_TRIPS if any(r.asks or r.answers for r in roles)
                 else PULL_ROUND_TRIPS if any(r.pulls for r in roles) else 0)
        time_s += slowest.transfers(duplex) * link.transfer_s(tensor_bytes) + trips * 2 * link.latency_s
    p = topology.period
    return RoundCost(sent / p, received / p, time_s / p)


def allreduce_sync(payload_bytes: int, peers: int, link: LinkSpec) -> RoundCost:
    """Ring all-reduce of `payload_bytes` over `peers`: reduce-scatter then all-gather, 2(n-1) steps of
    one payload/n chunk each, so every node sends and receives 2(n-1)/n of the payload."""
    n = peers
    per_node = 2 * (n - 1) / n * payload_bytes
    time_s = 2 * (n - 1) * (ALLREDUCE_STEP_LATENCIES * link.latency_s + link.transfer_s(payload_bytes / n))
    return RoundCost(per_node, per_node, time_s)


def allgather_sync(payload_bytes: int, peers: int, link: LinkSpec) -> RoundCost:
    """Ring all-gather of every node's `payload_bytes`: what a sparse (top-k) payload needs instead of an
    all-reduce, whose partial sums would not stay sparse. Every node sends and receives (n-1) payloads."""
    n = peers
    per_node = float((n - 1) * payload_bytes)
    return RoundCost(per_node, per_node, (n - 1) * (link.latency_s + link.transfer_s(payload_bytes)))


def collective_sync(payload: int, codec: Codec, peers: int, link: LinkSpec) -> RoundCost:
    """The ring collective that averages this payload: all-reduce, or all-gather for a sparse codec."""
    return (allgather_sync if codec.name in SPARSE_CODECS else allreduce_sync)(payload, peers, link)


def payload_bytes(specs: Sequence[TensorSpec], codec: Codec) -> int:
    """The tensors' encoded bytes alone, as an all-reduce moves them (no message headers)."""
    return sum(codec.encoded_nbytes(math.prod(spec.shape)) for spec in specs)


@dataclass(frozen=True)
class Estimate:
    """Predicted steady-state figures per node for one way of synchronising."""

    name: str
    step_s: float  # wall time per optimizer step
    sync_s: float  # one sync's communication (a round, a fragment's sync, an all-reduce)
    syncs_per_step: float
    sent_bytes_per_step: float
    received_bytes_per_step: float
    tokens_per_step: int

    @property
    def bytes_per_token(self) -> float:
        """Bytes one node sends per token it trains on."""
        return self.sent_bytes_per_step / self.tokens_per_step

    @property
    def communication_bound(self) -> bool:
        """Whether communication, not compute, sets the step time."""
        return self.sync_s * self.syncs_per_step > 0 and self.step_s > 0 and self._comm_share() > 0.5

    def _comm_share(self) -> float:
        return self.sync_s * self.syncs_per_step / self.step_s

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "step_s": self.step_s, "sync_s": self.sync_s, "syncs_per_step": self.syncs_per_step,
                "sent_bytes_per_step": self.sent_bytes_per_step,
                "received_bytes_per_step": self.received_bytes_per_step, "bytes_per_token": self.bytes_per_token,
                "tokens_per_step": self.tokens_per_step, "communication_bound": self.communication_bound}


def _step_time(algorithm: Algorithm, compute_s: float, sync_s: float, steps_per_sync: float, overlap: bool,
               cpu_s: float = 0.0) -> float:
    """Wall time per step when a sync of `sync_s` (its transfers and round trips) happens every
    `steps_per_sync` steps, and costs `cpu_s` of work on the cores that also compute: that work is in
    the sync's own time and adds to the compute it overlaps."""
    k = steps_per_sync
    if algorithm is Algorithm.DADAM:
        # the round overlaps the one step it belongs to; the other H-1 steps are compute alone
        return ((k - 1) * compute_s + max(compute_s + cpu_s, sync_s + cpu_s)) / k
    if algorithm is Algorithm.DILOCO and overlap:
        # the sync runs during the next k steps; compute waits only for what does not fit
        return max(compute_s + cpu_s / k, (sync_s + cpu_s) / k)
    return compute_s + (sync_s + cpu_s) / k


def round_messages(config: PlanConfig) -> list[MessageSizes]:
    """The message sizes of each tensor group a sync moves: the whole model, or each DiLoCo fragment."""
    meta = config.meta if config.meta is not None else _default_meta(config.compression)
    # compressed gossip: the exchange's own codec (fp32, what downloads use) names the header-only messages
    choco = config.compression is Compression.CHOCO
    control = Fp32Codec() if choco else None
    return [MessageSizes.of(group, config.codec, config.header, meta, control, duplex=not choco)
            for group in fragment_groups(config)]


def anchor_messages(config: PlanConfig) -> list[MessageSizes]:
    """DiLoCo: the message sizes of each fragment's anchor round (its own peer: the anchor codec, and a
    config hash suffixed `/anchor`, as node.algorithms.outer_group.OuterGroup sends them)."""
    header = replace(config.header, config_hash=f"{config.header.config_hash}{ANCHOR_HASH_SUFFIX}")
    return [MessageSizes.of(group, config.anchor_codec, header) for group in fragment_groups(config)]


def fragment_groups(config: PlanConfig) -> list[tuple[TensorSpec, ...]]:
    """The tensor groups a sync moves: the whole model, or DiLoCo's fragments as the daemon cuts them
    (gossip.diloco.fragment_partition)."""
    if config.fragments == 1:
        return [config.specs]
    from gossip.diloco import fragment_partition

    by_name = {spec.name: spec for spec in config.specs}
    cut = fragment_partition({spec.name: math.prod(spec.shape) for spec in config.specs}, config.fragments)
    return [tuple(by_name[name] for name in group) for group in cut]


def diloco_sync(topology: Topology, config: PlanConfig, grads: MessageSizes, anchors: MessageSizes) -> RoundCost:
    """One fragment's DiLoCo sync, averaged over syncs: the pseudo-gradients' round, and at every
    `anchor_every`-th sync the anchors' round beside it, or (fused) in its place."""
    share = config.anchor_share
    plain = gossip_round(topology, grads, config.link)
    if share == 0.0:
        return plain
    with_anchors = (gossip_round(topology, anchors, config.link) if config.diloco_fused
                    else gossip_round(topology, grads, config.link, anchors))
    return RoundCost(*((1 - share) * a + share * b for a, b in zip(
        (plain.sent_bytes, plain.received_bytes, plain.time_s),
        (with_anchors.sent_bytes, with_anchors.received_bytes, with_anchors.time_s), strict=True)))


def _default_meta(compression: Compression) -> Mapping[str, MetaValue] | None:
    if compression is Compression.CHOCO:
        from gossip.choco import typical_meta

        return typical_meta()
    return None


def gossip_estimate(config: PlanConfig) -> Estimate:
    """Per-step time and bytes of the configuration as murmur runs it."""
    topology = build_topology(config.topology, config.peers)
    if config.algorithm is Algorithm.DILOCO:
        costs = [diloco_sync(topology, config, grads, anchors)
                 for grads, anchors in zip(round_messages(config), anchor_messages(config), strict=True)]
    else:
        costs = [gossip_round(topology, sizes, config.link) for sizes in round_messages(config)]
    h, p = config.local_steps, len(costs)
    # P fragments each sync once per H steps, staggered: one fragment's sync every H/P steps
    sync_s = sum(c.time_s for c in costs) / p
    steps_per_sync = h / p
    step_s = _step_time(config.algorithm, config.step_time_s, sync_s, steps_per_sync, config.overlap,
                        config.round_cpu_s / p)
    name = f"gossip {config.algorithm}" + (" + choco" if config.compression is Compression.CHOCO else "")
    return Estimate(name, step_s, sync_s, 1 / steps_per_sync, sum(c.sent_bytes for c in costs) / h,
                    sum(c.received_bytes for c in costs) / h, config.tokens_per_step)


def allreduce_estimate(config: PlanConfig, *, codec: Codec | None = None, every: int | None = None,
                       name: str = "ring all-reduce") -> Estimate:
    """Ring all-reduce of the same tensors in place of the gossip rounds: by default with the same codec and
    sync period (so only the communication pattern differs; a top-k payload is all-gathered, see
    `collective_sync`); `codec`/`every` override them."""
    codec = codec or config.codec
    h = config.local_steps if every is None else every
    algorithm = config.algorithm if every is None else Algorithm.DSGD
    groups = fragment_groups(config) if every is None else [config.specs]
    costs = [collective_sync(payload_bytes(group, codec), codec, config.peers, config.link) for group in groups]
    p = len(costs)
    sync_s = sum(c.time_s for c in costs) / p
    steps_per_sync = h / p
    # the collective's local work (encoding, summing, decoding the same tensors) costs about what a round's does
    step_s = _step_time(algorithm, config.step_time_s, sync_s, steps_per_sync, config.overlap,
                        config.round_cpu_s / p if every is None else 0.0)
    return Estimate(name, step_s, sync_s, 1 / steps_per_sync, sum(c.sent_bytes for c in costs) / h,
                    sum(c.received_bytes for c in costs) / h, config.tokens_per_step)


@dataclass(frozen=True)
class Download:
    """A joiner's download of the whole model from one donor: its bytes, the time the link takes for
    them, and the longest the transfer deadlines allow it before any goodput is measured (gossip.pace)."""

    nbytes: int
    seconds: float
    bound_s: float

    def as_json(self) -> dict[str, Any]:
        return {"bytes": self.nbytes, "seconds": self.seconds, "bound_s": self.bound_s}


def download_estimate(config: PlanConfig, pace: TransferPace = DEFAULT_PACE) -> Download:
    """The whole model as a donor serves it, in fp32 whatever the rounds' codec (gossip.exchange
    WHOLE_MODEL_CODEC), over the link after the request's round trips (the dial, the pull)."""
    h = config.header
    nbytes = message_nbytes(config.specs, WHOLE_MODEL_CODEC, swarm=h.swarm,
                            config_hash=h.config_hash, sender=h.sender, round=h.round, step=h.step, kind="reply")
    seconds = config.link.transfer_s(nbytes) + 2 * PULL_ROUND_TRIPS * config.link.latency_s
    return Download(nbytes, seconds, pace.whole_s(nbytes))


@dataclass(frozen=True)
class Plan:
    """The prediction for one configuration: gossip as configured, ring all-reduce with the same codec
    and sync period, and data-parallel training (fp32 all-reduce every step) for reference; and a
    joiner's download."""

    gossip: Estimate
    allreduce: Estimate
    data_parallel: Estimate
    numel: int
    download: Download

    @property
    def winner(self) -> Winner:
        ratio = self.speedup
        if abs(ratio - 1.0) < 0.01:
            return Winner.TIE
        return Winner.GOSSIP if ratio > 1.0 else Winner.ALLREDUCE

    @property
    def speedup(self) -> float:
        """All-reduce step time over gossip step time: > 1 when gossip is faster."""
        return self.allreduce.step_s / self.gossip.step_s if self.gossip.step_s > 0 else 1.0

    @property
    def bytes_ratio(self) -> float:
        """Bytes gossip sends per step over what all-reduce sends."""
        return self.gossip.sent_bytes_per_step / self.allreduce.sent_bytes_per_step

    def as_json(self) -> dict[str, Any]:
        return {"numel": self.numel, "gossip": self.gossip.as_json(), "allreduce": self.allreduce.as_json(),
                "data_parallel": self.data_parallel.as_json(), "winner": str(self.winner),
                "speedup": self.speedup, "bytes_ratio": self.bytes_ratio,
                "vs_data_parallel": {"speedup": self.data_parallel.step_s / self.gossip.step_s
                                     if self.gossip.step_s > 0 else 1.0,
                                     "bytes_ratio": self.gossip.sent_bytes_per_step
                                     / self.data_parallel.sent_bytes_per_step},
                "download": self.download.as_json()}


def make_plan(config: PlanConfig) -> Plan:
    """Predict `config` (see `Plan`)."""
    return Plan(gossip=gossip_estimate(config), allreduce=allreduce_estimate(config),
                data_parallel=allreduce_estimate(config, codec=Fp32Codec(), every=1,
                                                 name="data parallel (fp32 all-reduce every step)"),
                numel=config.numel, download=download_estimate(config))


def bytes_per_node(config: PlanConfig, steps: int) -> float:
    """Message bytes one node sends and receives (together, mean over nodes) in `steps` steps: what a
    node's `bytes_sent + bytes_received` should read after that many steps of this configuration."""
    estimate = gossip_estimate(config)
    return steps * (estimate.sent_bytes_per_step + estimate.received_bytes_per_step)


def specs_for_vectors(sizes: Mapping[str, int], dtype: str = "float32") -> tuple[TensorSpec, ...]:
    """Flat tensors by name and element count, as a node gossips its parameters."""
    return tuple(TensorSpec(name, dtype, (int(numel),)) for name, numel in sizes.items())
