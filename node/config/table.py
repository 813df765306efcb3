"""The settings table: every setting declared once (TOML key, environment variable, flag, kind, help,
commands), from which the CLI, the file and environment readers and the docs table all derive.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

import msgspec

from gossip.choco import ChocoKnobs
from gossip.codecs import SPARSE_CODECS, STATE_CODECS
from gossip.diloco import DilocoSettings
from gossip.knobs import Knob, knobs
from gossip.mixing import MIXING_KINDS
from gossip.optimizers import ALGORITHMS, OptimizerSettings
from gossip.pace import TransferPace
from gossip.scoring import ScoringSettings
from gossip.spes import NODE_REFRESH_CODECS, SpesSettings, SpesSyncSettings
from node.config.kinds import Boolean, Choice, EdgeList, Integer, Kind, Multiaddrs, Named, Number, PathKind, Text
from node.net.reach_mode import ReachMode
from node.swarm.recipe import MAX_IDENTITY_WORK_BITS, MAX_MEMBERSHIP_SHARDS
from node.train.model_names import HF_PRESET_NAMES, MODEL_NAME_PATTERN
from topology import TOPOLOGY_NAMES, WEIGHT_SCHEMES


class Command(StrEnum):
    """The `murmur` subcommands (their names on the command line)."""

    NODE = "node"
    JOIN = "join"
    BOOTSTRAP = "bootstrap"
    STATUS = "status"
    EVAL = "eval"
    DOCTOR = "doctor"
    EXPORT = "export"
    TOKENIZER = "tokenizer"
    TOPOLOGY = "topology"
    SIM = "sim"
    DEMO = "demo"
    PLAN = "plan"
    INVITE = "invite"

    def __repr__(self) -> str:  # argparse lists a bad command's choices by repr: 'node', not <Command.NODE: ...>
        return repr(self.value)


NODE = frozenset({Command.NODE, Command.JOIN})
DAEMONS = NODE | {Command.BOOTSTRAP}
FOUNDING = frozenset({Command.NODE})
JOINING = frozenset({Command.JOIN})
MONITOR_CLIENTS = NODE | {Command.STATUS, Command.EVAL, Command.DOCTOR}  # commands that find a node by its monitor
# `murmur doctor --peers` starts a throwaway p2pd with a node's network settings
NETWORK_CHECKED = DAEMONS | {Command.DOCTOR}


REACH_MODES = tuple(ReachMode)


class Transport(StrEnum):
    """The data planes of --transport."""

    P2PD = "p2pd"  # hivemind's daemon, shared with the DHT
    LIBP2P = "libp2p"  # py-libp2p in a child process


TRANSPORTS = tuple(Transport)
NODE_CODECS = (*STATE_CODECS, *SPARSE_CODECS)
GOSSIP_COMPRESSIONS = ("none", "choco")
SPES_REFRESH_CODECS = NODE_REFRESH_CODECS  # what --spes-refresh-codec offers (gossip.spes takes fp32 too)
SPES_EXPERT_CODECS = STATE_CODECS  # what --spes-expert-codec offers
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
ADMISSION_MODES = ("open", "key", "allowlist")  # node.swarm.recipe.AdmissionMode
OPTIMIZERS = ALGORITHMS
FINAL_MERGE = ("auto", "on", "off")
JOIN_CHECKS = ("auto", "median", "spot")  # node.swarm.joining.JoinCheck
DEVICES_HELP = "auto, cpu, cuda or cuda:N"
PRECISION_NAMES = ("auto", "fp32", "bf16", "fp16")

MODEL_NAME = Named("model", MODEL_NAME_PATTERN,
                   hint=f"moe, dense, vector, {', '.join(HF_PRESET_NAMES)}, hf:PATH or package.module:callable",
                   description=f"moe | dense | vector | {' | '.join(HF_PRESET_NAMES)} | hf:PATH | package.module:callable",
                   metavar="MODEL")
DEVICE_NAME = Named("device", r"auto|cpu|cuda(:\d+)?", hint=DEVICES_HELP, description=DEVICES_HELP, metavar="DEVICE")
_BASE58 = r"[1-9A-HJ-NP-Za-km-z]{20,128}"
PEER_ID = Named("peer id", _BASE58, hint="the founder's peer id, like 12D3KooW... or Qm...",
                description="libp2p peer id", metavar="PEER_ID")
INVITE_TEXT = Named("invite", r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}@" + _BASE58,
               hint="NAME@FOUNDER_PEER_ID, as the founder's `murmur node` prints it",
               description="NAME@FOUNDER_PEER_ID", metavar="NAME@PEER_ID")


@dataclass(frozen=True)
class Setting:
    """One setting: where it lives in NodeConfig and the TOML file, and how users set it."""

    key: str  # dotted path in NodeConfig, also the TOML key
    kind: Kind
    env: str
    flag: str
    help: str
    commands: frozenset[Command]  # commands that take the flag and read the environment variable
    optional: bool = False  # None (unset) is a valid value
    default_text: str | None = None  # the default in words, where the value itself says little

    @property
    def dest(self) -> str:
        """The argparse destination of the flag."""
        return f"setting:{self.key}"

    @property
    def metavar(self) -> str:
        return self.kind.metavar


def struct_settings(struct: type[msgspec.Struct], prefix: str, commands: frozenset[Command],
                    *names: str) -> tuple[Setting, ...]:
    """The settings of an algorithm's knobs, declared once as the fields of a msgspec Struct in gossip/
    (gossip.knobs; gossip.diloco.DilocoSettings): each knob becomes the setting `<prefix><field>`, `field`
    the field's name or `Meta.extra["setting"]`, with the flag `--<name>` and the variable `MURMUR_<NAME>`
    (`name`: the key after its last dot, training.spes_outer_lr: --spes-outer-lr, MURMUR_SPES_OUTER_LR),
    its kind carries a node's own bounds and the extra's `metavar` and `noun`, its help is the field's
    description; a knob that may be None is an optional setting, its default in words the extra's
    `default_text`; the extra's `env` names a variable older than the derived one. With `names`, the
    settings of those fields only, in that order (where the table places a Struct's rows apart)."""
    found = {knob.name: knob for knob in knobs(struct)}
    return tuple(_knob_setting(found[name], prefix, commands) for name in (names or found))


def _knob_setting(knob: Knob, prefix: str, commands: frozenset[Command]) -> Setting:
    bounds, named = knob.bounds, {k: knob.extra[k] for k in ("metavar", "noun") if k in knob.extra}
    kind: Kind
    if knob.type is bool:
        kind = Boolean(**named)
    elif knob.type is int:
        low = bounds["ge"] if bounds["gt"] is None else bounds["gt"] + 1
        high = bounds["le"] if bounds["lt"] is None else bounds["lt"] - 1
        kind = Integer(low, high, **named)
    elif knob.type is float:
        kind = Number(bounds["ge"] if bounds["gt"] is None else bounds["gt"], lo_open=bounds["gt"] is not None,
                      hi=bounds["le"] if bounds["lt"] is None else bounds["lt"], hi_open=bounds["lt"] is not None,
                      **named)
    elif knob.choices:
        kind = Choice(choices=knob.choices, **named)
    else:
        raise TypeError(f"{knob.name}: no setting kind for {knob.type!r}")
    key = prefix + knob.setting_name
    name = key.rpartition(".")[2]  # training.spes_outer_lr: --spes-outer-lr, MURMUR_SPES_OUTER_LR
    return Setting(key, kind, knob.extra.get("env", f"MURMUR_{name.upper()}"), "--" + name.replace("_", "-"), knob.help, commands,
                   optional=knob.optional, default_text=knob.extra.get("default_text"))

_NONNEG = Integer(0)

SETTINGS: tuple[Setting, ...] = (
    Setting("swarm", Text(), "MURMUR_SWARM", "--swarm", "swarm name: namespaces the swarm's DHT keys; "
            "1-64 letters, digits, '.', '_' or '-'", NODE | {Command.INVITE}),
    Setting("invite", INVITE_TEXT, "MURMUR_INVITE", "--invite",
            "the swarm to join and the founder whose signed config to trust: NAME@FOUNDER_PEER_ID (sets the "
            "swarm name and --founder)", JOINING, optional=True, default_text="none"),
    Setting("founder", PEER_ID, "MURMUR_FOUNDER", "--founder",
            "peer id of the swarm's founder: only configs it signed are taken; pinned in the data directory "
            "once joined", JOINING, optional=True, default_text="the one pinned by an earlier join"),
    Setting("trust_first_founder", Boolean(), "MURMUR_TRUST_FIRST_FOUNDER", "--trust-first-founder",
            "without --invite/--founder or a pinned founder: trust the founder of the signed config found "
            "(refused when several founders' configs are there) and pin it. Unsafe on an open network: whoever "
            "answers first names the swarm", JOINING),
    Setting("admission", Choice("admission mode", ADMISSION_MODES, metavar="MODE"), "MURMUR_ADMISSION",
            "--admission", "who may take part: open (anyone), key (holders of the swarm key, --swarm-key-file) "
            "or allowlist (peers with the founder's certificate, `murmur invite`) (the swarm's)", FOUNDING),
    Setting("identity_work", Integer(0, MAX_IDENTITY_WORK_BITS, noun="identity work", metavar="BITS"),
            "MURMUR_IDENTITY_WORK", "--identity-work",
            "open swarms: the proof of work each peer identity must carry, in leading zero bits of a sha256 "
            "(each bit doubles it; 20 is about a second of one core, minted once per identity; 0: none) (the "
            "swarm's)", FOUNDING),
    Setting("membership_shards", Integer(1, MAX_MEMBERSHIP_SHARDS, noun="shard count", metavar="N"),
            "MURMUR_MEMBERSHIP_SHARDS", "--membership-shards",
            f"how many DHT keys the swarm's peer records and SPES expert records are each split over (1-"
            f"{MAX_MEMBERSHIP_SHARDS}), so none outgrows the 4 MiB a DHT node answers: 1 holds thousands of peers, "
            "but 34 of a 24x64 MoE's SPES peers or 64 records padded by hostile peers fill it; every view read "
            "reads every shard (the swarm's)", FOUNDING),
    Setting("swarm_key_file", PathKind(metavar="FILE"), "MURMUR_SWARM_KEY_FILE", "--swarm-key-file",
            "the swarm key of a key-admission swarm; the founder creates it (mode 0600) if missing. Give it to "
            "members out of band", NODE, optional=True, default_text="none"),
    Setting("certificate_file", PathKind(metavar="FILE"), "MURMUR_CERTIFICATE", "--certificate",
            "this node's membership certificate in an allowlist swarm, as `murmur invite` wrote it", JOINING,
            optional=True, default_text="none"),
    Setting("data_dir", PathKind(metavar="DIR"), "MURMUR_DATA_DIR", "--data-dir",
            "directory for the identity, checkpoints, logs and the monitor's per-run token (monitor.token); "
            "created if missing. status, eval and doctor read the token there",
            DAEMONS | {Command.INVITE, Command.STATUS, Command.EVAL, Command.DOCTOR},
            default_text="./murmur-data"),
    Setting("identity_file", PathKind(metavar="FILE"), "MURMUR_IDENTITY", "--identity",
            "libp2p RSA key file that gives the node its peer id; created (mode 0600) if missing",
            DAEMONS | {Command.INVITE}, optional=True, default_text="<data-dir>/identity.key"),
    Setting("heartbeat_s", Number(0.0, lo_open=True, hi=30.0, metavar="S"), "MURMUR_HEARTBEAT", "--heartbeat",
            "seconds between DHT heartbeats, at most 30; a peer's record expires after 3 missed ones", NODE),
    Setting("dim", Integer(1, noun="dim"), "MURMUR_DIM", "--dim",
            "floats in the random vector gossiped while no model is trained", NODE),
    Setting("seed", _NONNEG, "MURMUR_SEED", "--seed", "seed of the node's own randomness", NODE),
    Setting("log_level", Choice("log level", LOG_LEVELS, upper=True, metavar="LEVEL"), "MURMUR_LOG_LEVEL",
            "--log-level", "log level, case-insensitive", DAEMONS),
    Setting("network.listen", Multiaddrs(peer=False), "MURMUR_LISTEN", "--listen",
            "multiaddr to listen on; repeatable. Loopback by default: listening on a "
            "public interface is a choice", NETWORK_CHECKED),
    Setting("network.announce", Multiaddrs(peer=False), "MURMUR_ANNOUNCE", "--announce",
            "multiaddr other peers should dial instead of the listen ones, behind NAT or port "
            "forwarding; repeatable", NETWORK_CHECKED),
    Setting("network.initial_peers", Multiaddrs(peer=True), "MURMUR_PEERS", "--peers",
            "full multiaddr (ending in /p2p/<peer id>) of a peer or bootstrap node to join the DHT "
            "through; several may follow one flag", NETWORK_CHECKED),
    Setting("network.transport", Choice("transport", TRANSPORTS, metavar="TRANSPORT"), "MURMUR_TRANSPORT",
            "--transport", "data-plane transport: p2pd (hivemind's daemon, shared with the DHT) or "
            "libp2p (py-libp2p in a child process)", NODE),
    Setting("network.data_listen", Multiaddrs(peer=False), "MURMUR_DATA_LISTEN", "--data-listen",
            "with --transport libp2p: multiaddr the py-libp2p data plane listens on; repeatable "
            "(default: the --listen hosts on a free port)", NODE),
    Setting("network.data_announce", Multiaddrs(peer=False), "MURMUR_DATA_ANNOUNCE", "--data-announce",
            "with --transport libp2p: multiaddr peers should dial for gossip instead of the data-plane "
            "listen ones, behind NAT or port forwarding; repeatable (--announce covers the DHT only)", NODE),
    Setting("network.nat_port_map", Boolean(), "MURMUR_UPNP", "--upnp",
            "ask the router for a port mapping by UPnP; it multicasts on every interface, so "
            "use it only in real deployments", DAEMONS),
    Setting("network.reachability", Choice("reachability", REACH_MODES, metavar="MODE"), "MURMUR_REACHABILITY",
            "--reachability", "auto: ask peers to dial this node back at start; public: reachable directly (a "
            "public address or a forwarded port); private: behind NAT, reachable only through relays", NETWORK_CHECKED),
    Setting("network.relays", Multiaddrs(peer=True), "MURMUR_RELAYS", "--relays",
            "full multiaddr of a relay (a `murmur bootstrap` or a node with --relay-service) where a node "
            "behind NAT reserves a slot and is dialled through; several may follow one flag", NETWORK_CHECKED,
            default_text="the --peers"),
    Setting("network.relay_service", Boolean(), "MURMUR_RELAY_SERVICE", "--relay-service",
            "serve as a relay for nodes behind NAT, with the limits below (checked at start); for public "
            "nodes only", DAEMONS, optional=True, default_text="on for bootstrap, off for node and join"),
    Setting("network.relay_data_limit_mb", Integer(1, noun="MiB", metavar="MIB"), "MURMUR_RELAY_DATA_LIMIT",
            "--relay-data-limit", "with --relay-service: MiB one circuit may carry each way before the relay "
            "resets it (its peers then re-dial)", DAEMONS),
    Setting("network.relay_time_limit_s", Number(1.0, metavar="S"), "MURMUR_RELAY_TIME_LIMIT",
            "--relay-time-limit", "with --relay-service: seconds one circuit may stay open before the relay "
            "resets it (its peers then re-dial)", DAEMONS),
    Setting("monitor.host", Text(metavar="HOST", description="host name or IP address"), "MURMUR_MONITOR_HOST",
            "--monitor-host", "address the monitor page listens on; 0.0.0.0 exposes it to the network",
            MONITOR_CLIENTS),
    Setting("monitor.port", Integer(0, 65535, noun="port", metavar="PORT"), "MURMUR_MONITOR_PORT",
            "--monitor-port", "TCP port of the monitor page; 0 picks a free one", MONITOR_CLIENTS),
    Setting("gossip.codec", Choice("codec", NODE_CODECS, metavar="CODEC"), "MURMUR_CODEC", "--codec",
            "wire codec of what the swarm exchanges: the parameters (dsgd, dadam), their differences with "
            "--gossip-compression choco, or DiLoCo's pseudo-gradients (error feedback for the lossy ones); topk and "
            "sparseloco (chunked top-k, 2-bit values) only with --optimizer diloco or --gossip-compression choco "
            "(the swarm's)", NODE),
    Setting("gossip.topk_ratio", Number(0.0, lo_open=True, hi=1.0, metavar="RATIO"), "MURMUR_TOPK_RATIO",
            "--topk-ratio", "fraction of each tensor's entries --codec topk sends, the largest in magnitude "
            "(of each 4096-element chunk's with --codec sparseloco) (the swarm's)", NODE),
    Setting("gossip.topk_packed", Boolean(), "MURMUR_TOPK_PACKED", "--topk-packed",
            "--codec topk sends each kept entry as a uint16 in-block offset and an int8 value under one scale "
            "per tensor: 3 bytes instead of 8, the rounding carried on by the error feedback (the swarm's)", NODE),
    Setting("gossip.topk_elias_fano", Boolean(), "MURMUR_TOPK_ELIAS_FANO", "--topk-elias-fano",
            "--topk-packed with the kept entries' indices Elias-Fano coded, 2 + log2(1/ratio) bits each instead "
            "of 16 (about 2 bytes per entry in all at ratio 0.01-0.02) (the swarm's)", NODE),
    Setting("gossip.compression", Choice("gossip compression", GOSSIP_COMPRESSIONS, metavar="KIND"),
            "MURMUR_GOSSIP_COMPRESSION", "--gossip-compression",
            "choco: dsgd/dadam rounds send --codec-compressed differences against per-neighbour estimates "
            "(CHOCO-SGD) instead of whole parameters; symmetric topologies only (the swarm's)", NODE),
    *struct_settings(ChocoKnobs, "gossip.", NODE),
    Setting("gossip.round_interval_s", Number(0.0, lo_open=True, metavar="S"), "MURMUR_ROUND_INTERVAL",
            "--round-interval", "seconds between the starts of two gossip rounds", NODE),
    Setting("gossip.exchange_timeout_s", Number(0.0, lo_open=True, metavar="S"), "MURMUR_EXCHANGE_TIMEOUT",
            "--exchange-timeout", "seconds a neighbour has to start answering a round's exchange (the "
            "header of its reply) before it counts as missing; the tensors that follow are paced by "
            "--stall-timeout and --goodput-floor", NODE),
    *struct_settings(TransferPace, "gossip.", NODE),
    Setting("gossip.min_peers", Integer(1, noun="peer count"), "MURMUR_MIN_PEERS", "--min-peers",
            "gossip starts once this many peers (this one included) are in the view; all peers that see "
            "the same quorum start in the same round", NODE),
    Setting("gossip.max_staleness_rounds", _NONNEG, "MURMUR_MAX_STALENESS", "--max-staleness",
            "mix a neighbour's parameters only if they are at most this many rounds old", NODE),
    Setting("gossip.topology.name", Choice("topology", TOPOLOGY_NAMES, metavar="TOPOLOGY"), "MURMUR_TOPOLOGY",
            "--topology", "gossip topology family", NODE),
    Setting("gossip.topology.weights", Choice("weight scheme", WEIGHT_SCHEMES, metavar="SCHEME"),
            "MURMUR_WEIGHTS", "--weights", "mixing-weight scheme", NODE, optional=True,
            default_text="the family's own"),
    Setting("gossip.topology.degree", Integer(1, noun="degree"), "MURMUR_DEGREE", "--degree",
            "degree of the random-regular topology", NODE),
    Setting("gossip.topology.seed", _NONNEG, "MURMUR_TOPOLOGY_SEED", "--topology-seed",
            "seed of the random-regular topology; must be the same on every peer", NODE),
    Setting("gossip.topology.rows", Integer(1, noun="rows"), "MURMUR_ROWS", "--rows",
            "rows of the torus", NODE, optional=True, default_text="the most square shape"),
    Setting("gossip.topology.edges", EdgeList(), "MURMUR_EDGES", "--edges",
            "edge list of the custom topology over ranks, e.g. 0-1,1-2,2-0", NODE),
    Setting("gossip.topology.directed", Boolean(), "MURMUR_DIRECTED", "--directed",
            "treat the custom edge list as directed", NODE),
    Setting("gossip.mixing.kind", Choice("mixing rule", MIXING_KINDS, metavar="RULE"), "MURMUR_MIXING", "--mixing",
            "how a round combines the received parameters: centered clipping with an adaptive radius "
            "(adaptive_clip, robust to a hostile neighbour), weighted average, centered clipping with a fixed "
            "radius --tau, coordinate-wise median or trimmed mean, or variance_corrected (CORE: the average "
            "rescaled to the members' variance, for members that started from different initialisations); this "
            "node's own choice (a joiner keeps its own, not the swarm's)", NODE),
    Setting("gossip.mixing.tau", Number(0.0, lo_open=True, metavar="TAU"), "MURMUR_TAU", "--tau",
            "clipping radius of --mixing clipped", NODE, optional=True),
    *struct_settings(ScoringSettings, "gossip.", NODE),
    Setting("training.model", MODEL_NAME, "MURMUR_MODEL", "--model",
            "what the swarm trains: the embedded MoE or dense GPT, `vector` (no model: gossip a random vector "
            "of --dim floats), a tiny Hugging Face preset, hf:PATH (a transformers config directory or local "
            "pretrained checkpoint: the swarm config carries the config, so joiners need no path), or a builder "
            "by import path; a joiner takes the swarm's, and runs a builder only if its own --model names the "
            "same one", NODE),
    *struct_settings(OptimizerSettings, "training.", NODE, "algorithm", "lr", "warmup_steps"),
    Setting("training.steps", _NONNEG, "MURMUR_STEPS", "--steps",
            "steps to train, where the cosine schedule ends; 0 trains until stopped. A node that is done "
            "keeps serving its parameters until stopped (the swarm's)", NODE),
    *struct_settings(OptimizerSettings, "training.", NODE, "local_steps"),
    *struct_settings(DilocoSettings, "training.", NODE),
    Setting("training.final_merge", Choice("final merge", FINAL_MERGE, metavar="WHEN"), "MURMUR_FINAL_MERGE",
            "--final-merge", "at the end of the step budget every node averages the final models of all live "
            "peers once, so the swarm ends on one model; auto: on for diloco, off otherwise (the swarm's)", NODE),
    *struct_settings(OptimizerSettings, "training.", NODE, "micro_batches", "adam_accumulate"),
    Setting("training.batch_size", Integer(1, noun="batch size"), "MURMUR_BATCH_SIZE", "--batch-size",
            "sequences per micro-batch on each node (the swarm's)", NODE),
    Setting("training.context", Integer(2, noun="context"), "MURMUR_CONTEXT", "--context",
            "tokens per training sequence, at most the model's context (the swarm's)", NODE),
    Setting("training.data", PathKind(metavar="PATH"), "MURMUR_DATA", "--data",
            "a directory, file or glob of text (.txt), jsonl or parquet shards to train on, streamed; each peer "
            "reads a disjoint part per epoch (docs/training.md, \"Data\"; this node's own)", NODE, optional=True,
            default_text="the embedded corpus"),
    Setting("training.text_field", Text(metavar="FIELD"), "MURMUR_TEXT_FIELD", "--text-field",
            "the field (jsonl) or column (parquet) of --data that holds the text (this node's own)", NODE),
    Setting("training.tokenizer", PathKind(metavar="FILE"), "MURMUR_TOKENIZER", "--tokenizer",
            "a tokenizer.json (murmur tokenizer train) the swarm tokenizes with; its hash is in the swarm config, "
            "and a joiner without the file fetches it from a peer (the founder's)", NODE, optional=True,
            default_text="one token per byte, or a pretrained hf:PATH checkpoint's own tokenizer.json"),
    Setting("training.device", DEVICE_NAME, "MURMUR_DEVICE", "--device", "torch device of this node", NODE),
    Setting("training.precision", Choice("precision", PRECISION_NAMES, metavar="PRECISION"), "MURMUR_PRECISION",
            "--precision", "autocast precision; auto: bf16 (else fp16) on CUDA, fp32 on CPU", NODE),
    Setting("training.threads", _NONNEG, "MURMUR_THREADS", "--threads",
            "torch CPU threads of this node; 0: torch's default (all cores)", NODE),
    Setting("training.eval_every", Integer(1, noun="steps"), "MURMUR_EVAL_EVERY", "--eval-every",
            "steps between validation-loss evaluations of the local model", NODE),
    Setting("training.checkpoint_every", Integer(1, noun="steps"), "MURMUR_CHECKPOINT_EVERY",
            "--checkpoint-every", "steps between checkpoints; one is also written when training ends "
            "and when the node stops", NODE),
    Setting("training.join_check", Choice("join check", JOIN_CHECKS, metavar="HOW"), "MURMUR_JOIN_CHECK",
            "--join-check", "how a node that catches up checks what it downloads: median downloads three whole "
            "copies from three donors and takes their coordinate-wise median; spot downloads one, in parts from up to "
            "4 donors at once, and checks a block of each part against two other donors (about 1.1 copies); auto: "
            "spot for a model of "
            "256 MiB (fp32) or more (docs/training.md, \"Joining mid-run\"; this node's own)", NODE),
    Setting("training.average_every", _NONNEG, "MURMUR_AVERAGE_EVERY", "--average-every",
            "steps between writes of the swarm-average model to swarm-average.safetensors in the data directory "
            "(and one when training ends); each pulls every live peer's parameters; 0: only on request "
            "(murmur eval --save)", NODE),
    Setting("gossip.mixing.trim", Number(0.0, hi=0.5, hi_open=True, metavar="FRACTION"), "MURMUR_TRIM", "--trim",
            "fraction trimmed per side by --mixing trimmed_mean", NODE),
    Setting("training.spes", Boolean(), "MURMUR_SPES", "--spes",
            "SPES: each node trains the shared weights and the experts it owns of the MoE model, and syncs "
            "experts sparsely (docs/spes.md); needs --model moe or an MoE builder (the swarm's)", NODE),
    *struct_settings(SpesSettings, "training.spes_", NODE),
    *struct_settings(SpesSyncSettings, "training.spes_", NODE),
    Setting("training.experts", Integer(1, noun="experts"), "MURMUR_EXPERTS", "--experts",
            "SPES capacity: experts per MoE layer this node trains (this node's own)", NODE, optional=True,
            default_text="all on CPU (the most that fit, when all do not); on CUDA as many as fit in 90% of the free "
                         "GPU memory after one micro-batch's activations (docs/spes.md)"),
)

SETTINGS_BY_KEY: Mapping[str, Setting] = {setting.key: setting for setting in SETTINGS}
# The TOML tables: every proper prefix of a setting's dotted key.
TABLES = frozenset(
    ".".join(parts[:i]) for parts in (key.split(".") for key in SETTINGS_BY_KEY) for i in range(1, len(parts))
)


def settings_for(command: str) -> tuple[Setting, ...]:
    return tuple(setting for setting in SETTINGS if command in setting.commands)

