"""The node's config: one frozen `NodeConfig` of nested dataclasses, each value checked by its
setting's kind (see `node.config.table`) when it is built."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gossip.codecs import DEFAULT_TOPK_RATIO
from gossip.diloco import DILOCO_DEFAULTS
from gossip.mixing import MixingKind, MixingRule
from gossip.optimizers import OptimizerConfig
from gossip.pace import DEFAULT_PACE
from gossip.scoring import ScoringSettings
from gossip.spes import SpesConfig
from node.config.kinds import LOOPBACK_LISTEN
from node.config.table import SETTINGS
from node.swarm.recipe import DEFAULT_IDENTITY_WORK_BITS
from node.train.model_names import VECTOR_MODEL
from topology import TopologySpec

# 7690 rather than 0 so that `murmur status` finds a node started with defaults; 0 asks the OS for
# a free port (tests, several nodes on one machine), which the node then reports in its log.
DEFAULT_MONITOR_PORT = 7690
IDENTITY_FILE_NAME = "identity.key"
MONITOR_TOKEN_FILE = "monitor.token"  # this run's monitor token (node.monitor.access), in the data dir
# Frozen, so one instance can be every config's default.
DEFAULT_TOPOLOGY = TopologySpec("one-peer-exp")
# Robust by default: centered clipping with an adaptive radius bounds a hostile neighbour's pull (gossip.robust).
DEFAULT_MIXING = MixingRule(MixingKind.ADAPTIVE_CLIP)
# The algorithms' own defaults, written once in gossip/ (the fields below read them, never repeat them)
_OPTIMIZER = OptimizerConfig()
_DILOCO = DILOCO_DEFAULTS
_SPES = SpesConfig()
_SCORING = ScoringSettings()


class ConfigError(ValueError):
    """A setting that cannot be used. The message is one line: its source (flag, environment variable
    or file:key) and the problem."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.splitlines()))


@dataclass(frozen=True)
class NetworkConfig:
    """How the node reaches the swarm and how the swarm reaches it."""

    # Multiaddrs p2pd listens on. Loopback by default: listening on a public interface is a choice.
    listen: tuple[str, ...] = (LOOPBACK_LISTEN,)
    # Multiaddrs other peers should dial instead of the listen ones (behind NAT / port forwarding).
    announce: tuple[str, ...] = ()
    # Full multiaddrs (ending in /p2p/<peer id>) of DHT peers to join through; a joiner needs one.
    initial_peers: tuple[str, ...] = ()
    # Data-plane transport: "p2pd" (hivemind's daemon, shared with the DHT) or "libp2p" (py-libp2p child).
    transport: str = "p2pd"
    # libp2p only: where the py-libp2p child listens (default: the `listen` hosts on a free port) and
    # what peers should dial for gossip streams instead (NAT / port forwarding of that port).
    data_listen: tuple[str, ...] = ()
    data_announce: tuple[str, ...] = ()
    # UPnP port mapping in p2pd. It multicasts on every interface, so it is opt-in (`--upnp`).
    nat_port_map: bool = False
    # Reachability (docs/architecture.md): "auto" asks peers to dial back, "public" / "private" say it.
    reachability: str = "auto"
    # Full multiaddrs of relays a node behind NAT reserves slots at; empty: the --peers.
    relays: tuple[str, ...] = ()
    # Serve as a relay with the limits below; None: the command's default (on for bootstrap only).
    relay_service: bool | None = None
    relay_data_limit_mb: int = 8192  # per circuit and direction; a cut circuit is re-dialled
    relay_time_limit_s: float = 3600.0  # per circuit

    def serves_relay(self, bootstrap: bool) -> bool:
        return self.relay_service if self.relay_service is not None else bootstrap


@dataclass(frozen=True)
class MonitorConfig:
    """Where the node serves its monitor page, JSON API and Prometheus metrics."""

    host: str = "127.0.0.1"  # never 0.0.0.0 unless asked
    port: int = DEFAULT_MONITOR_PORT  # 0: any free port, reported by the node when it starts

    @property
    def url(self) -> str:
        """The URL a local client (`murmur status`) reaches the monitor at."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"


@dataclass(frozen=True)
class GossipConfig:
    """How the node mixes its parameters with its neighbours."""

    topology: TopologySpec = DEFAULT_TOPOLOGY
    codec: str = "fp32"  # wire codec of the exchanged tensors (choco: of the differences; diloco: of the pseudo-gradients)
    topk_ratio: float = DEFAULT_TOPK_RATIO  # --codec topk: fraction of each tensor's entries sent
    topk_packed: bool = False  # --codec topk: uint16 offsets and int8 values, 3 bytes per kept entry instead of 8
    topk_elias_fano: bool = False  # --topk-packed with Elias-Fano indices: about 2 bytes per kept entry at 1-2%
    compression: str = "none"  # "choco": compressed differences against per-neighbour estimates (gossip/choco.py)
    choco_gamma: float | None = None  # CHOCO's consensus step; None: gossip.choco.default_gamma of the codec
    round_interval_s: float = 1.0  # time between the starts of two gossip rounds
    exchange_timeout_s: float = 5.0  # for a neighbour to start answering; its payload is paced (gossip.pace)
    # transfers of tensors (round exchanges, downloads, evaluation pulls): cut when a piece stalls this long (s), and
    # given time for their size at this goodput (Mbit/s) at least (gossip.pace)
    stall_timeout: float = DEFAULT_PACE.stall_timeout_s
    goodput_floor: float = DEFAULT_PACE.goodput_floor_mbit_s
    max_staleness_rounds: int = 2  # a neighbour's parameters at most this many rounds old are mixed
    min_peers: int = 1  # gossip starts once this many peers (this one included) are in the view
    mixing: MixingRule = DEFAULT_MIXING
    # contribution scoring of neighbours (gossip.scoring.ScoringSettings, each node's own)
    score_every: int = _SCORING.score_every
    score_alpha: float = _SCORING.score_alpha
    score_min_rated: int = _SCORING.score_min_rated
    score_low: float = _SCORING.score_low
    score_down_weight: float = _SCORING.score_down_weight
    score_exclude_after: int = _SCORING.score_exclude_after
    score_sequences: int = _SCORING.score_sequences

    @property
    def scoring(self) -> ScoringSettings:
        return ScoringSettings(**{f: getattr(self, f) for f in ScoringSettings.__struct_fields__})


@dataclass(frozen=True)
class TrainingConfig:
    """What the swarm trains and how (published by the founder; joiners take it from the swarm's config),
    and how this node runs it (device, precision, threads, evaluation and checkpoint cadence: its own)."""

    model: str = "moe"  # "moe", "dense", "vector", an hf-tiny-* preset, "hf:PATH" or a builder "package.module:callable"
    optimizer: str = "dadam"
    lr: float = _OPTIMIZER.lr
    warmup_steps: int = 10
    steps: int = 0  # steps to train; 0: until stopped (the LR schedule then stays flat after warm-up)
    local_steps: int = _OPTIMIZER.local_steps  # H: steps between gossip rounds
    micro_batches: int = _OPTIMIZER.micro_batches  # k: gradient accumulation
    adam_accumulate: int = _OPTIMIZER.adam_accumulate  # K: dadam's AccumAdam block; 1: plain DAdam
    # gossip DiLoCo (--optimizer diloco; docs/training.md): the outer step, fragments, overlap, QSR, anchors
    outer_lr: float = _DILOCO.outer_lr
    outer_momentum: float = _DILOCO.outer_momentum
    fragments: int = _DILOCO.fragments  # P
    overlap: bool = _DILOCO.overlap
    qsr_alpha: float = _DILOCO.qsr_alpha  # 0: constant H
    outer_warmup: int = _DILOCO.outer_warmup  # W: the first W phases ramp up to H
    phase_seconds: float = _DILOCO.phase_seconds  # S: wall-clock phases; 0: every step trained
    anchor_every: int = _DILOCO.anchor_every  # mix anchors at every this-many-th sync; 0: never
    anchor_codec: str = _DILOCO.anchor_codec
    inner_optimizer: str = _DILOCO.inner  # adam (AdamW, DiLoCo's) or sgd
    final_merge: str = "auto"  # auto (on for diloco), on, off
    batch_size: int = 16  # sequences per micro-batch on each node
    context: int = 128  # tokens per sequence
    data: Path | None = None  # text/jsonl/parquet shards (a directory, file or glob); None: the embedded corpus
    text_field: str = "text"  # the jsonl field / parquet column of --data holding the text
    tokenizer: Path | None = None  # a tokenizer.json; None: bytes (or a pretrained checkpoint's own)
    device: str = "auto"
    precision: str = "auto"
    threads: int = 0  # torch CPU threads; 0: torch's default
    eval_every: int = 25  # steps between validation-loss evaluations of the local model
    checkpoint_every: int = 50  # steps between checkpoints (and one when training stops)
    average_every: int = 0  # steps between writes of the swarm-average model (and one at the end); 0: never
    join_check: str = "auto"  # auto, median (three copies) or spot (one, spot-checked) when catching up
    # SPES, sparse expert sync of the MoE model (docs/spes.md): the swarm's knobs, and this node's capacity
    spes: bool = False
    spes_sync_every: int = _SPES.sync_every  # S
    spes_merge_every: int = _SPES.merge_every  # M, a multiple of S
    spes_merge_until: int = _SPES.merge_until  # D; 0: no merge warm-up
    spes_alpha0: float = _SPES.alpha0
    spes_replication: int = _SPES.replication  # r
    spes_refresh_codec: str = _SPES.refresh_codec  # the codec of the deltas frozen copies are refreshed with
    spes_expert_codec: str = _SPES.expert_codec  # co-owners mix their experts in this codec (error feedback)
    spes_shared_codec: str = _SPES.shared_codec  # neighbours mix the shared weights in this codec (error feedback)
    spes_delta_refresh: bool = _SPES.delta_refresh  # frozen copies are refreshed with compressed deltas
    spes_outer_lr: float = _SPES.outer_lr  # the outer step of each sync (1.0 and no momentum: plain mixing)
    spes_outer_momentum: float = _SPES.outer_momentum
    spes_anchor_every: int = _SPES.anchor_every
    experts: int | None = None  # experts per MoE layer this node trains; None: all (CPU) or by free GPU memory

    @property
    def trains_model(self) -> bool:
        return self.model != VECTOR_MODEL


@dataclass(frozen=True)
class NodeConfig:
    """Everything a node (or a bootstrap node) needs to run. See `SETTINGS` for each setting's
    flag, environment variable and TOML key, and docs/cli.md for the table."""

    swarm: str = "murmur"  # namespaces the swarm's DHT keys
    invite: str | None = None  # join: NAME@FOUNDER_PEER_ID; node_config_from_args copies it into swarm and founder
    founder: str | None = None  # join: the founder's peer id (else the pinned one, see node.runtime.swarm_config)
    trust_first_founder: bool = False  # join: trust the founder of the config found when none is known
    admission: str = "open"  # node: who may take part (node.swarm.recipe.AdmissionMode), the swarm's
    swarm_key_file: Path | None = None  # key swarms: the swarm key (the founder creates it)
    certificate_file: Path | None = None  # allowlist swarms: this node's certificate from the founder
    identity_work: int = DEFAULT_IDENTITY_WORK_BITS  # open swarms: proof-of-work bits per identity, the swarm's
    membership_shards: int = 1  # DHT keys `<swarm>.peers` and `<swarm>.experts` are each split over, the swarm's
    data_dir: Path = Path("murmur-data")  # identity, checkpoints and logs; relative to the working dir
    identity_file: Path | None = None  # None: <data_dir>/identity.key (see `identity_path`)
    heartbeat_s: float = 2.0  # seconds between DHT heartbeats; a record lives for 3 of them
    dim: int = 100_000  # floats in the random vector gossiped while no model is trained
    seed: int = 0  # seed of the node's own randomness
    log_level: str = "INFO"
    network: NetworkConfig = NetworkConfig()
    monitor: MonitorConfig = MonitorConfig()
    gossip: GossipConfig = GossipConfig()
    training: TrainingConfig = TrainingConfig()

    def __post_init__(self) -> None:
        for setting in SETTINGS:
            value = setting_value(self, setting.key)
            if value is None and setting.optional:
                continue
            try:
                setting.kind.check(value)
            except ValueError as exc:
                raise ConfigError(f"{setting.key}: {exc}") from None

    @property
    def identity_path(self) -> Path:
        return self.identity_file if self.identity_file is not None else self.data_dir / IDENTITY_FILE_NAME


def setting_value(config: object, key: str) -> object:
    """The value at a dotted key such as "gossip.topology.name"."""
    for part in key.split("."):
        config = getattr(config, part)
    return config


DEFAULTS = NodeConfig()
