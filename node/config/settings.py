"""The node's settings: one frozen `NodeConfig`, resolved from defaults < a TOML file < `MURMUR_*`
environment variables < command-line flags, with one specific error per bad value naming its source.

Every setting is declared once in `SETTINGS` (its TOML key, environment variable, flag, type and help),
and the CLI, the file and environment readers and the docs table (`python -m node.config`) all derive
from that list, so they cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import difflib
import errno
import math
import os
import re
import socket
import tomllib
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

from multiaddr import Multiaddr

from gossip.mixing import MIXING_KINDS, MixingRule
from topology import TOPOLOGY_NAMES, WEIGHT_SCHEMES, TopologySpec

# 7690 rather than 0 so that `murmur status` finds a node started with defaults; 0 asks the OS for
# a free port (tests, several nodes on one machine), which the node then reports in its log.
DEFAULT_MONITOR_PORT = 7690
LOOPBACK_LISTEN = "/ip4/127.0.0.1/tcp/0"
IDENTITY_FILE_NAME = "identity.key"
TRANSPORTS = ("p2pd", "libp2p")
NODE_CODECS = ("fp32", "fp16", "bf16", "int8")
SPES_REFRESH_CODECS = ("bf16", "int8")  # what --spes-refresh-codec offers (gossip.spes takes fp32/fp16 too)
SPES_EXPERT_CODECS = ("fp32", "fp16", "bf16", "int8")  # what --spes-expert-codec offers
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
ENV_CONFIG_FILE = "MURMUR_CONFIG"


class ConfigError(ValueError):
    """A setting that cannot be used. The message is one line: its source (flag, environment variable
    or file:key) and the problem."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.splitlines()))


# ---- the config --------------------------------------------------------------------------------


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

    topology: TopologySpec = TopologySpec("one-peer-exp")
    codec: str = "fp32"  # wire codec of the exchanged tensors
    round_interval_s: float = 1.0  # time between the starts of two gossip rounds
    exchange_timeout_s: float = 5.0  # one exchange with one neighbour, after which it counts as missing
    max_staleness_rounds: int = 2  # a neighbour's parameters at most this many rounds old are mixed
    min_peers: int = 1  # gossip starts once this many peers (this one included) are in the view
    mixing: MixingRule = MixingRule()


EMBEDDED_MODEL_NAMES = ("moe", "dense")
VECTOR_MODEL = "vector"  # no model: gossip a random vector of `dim` floats (tests, demos of the gossip alone)
OPTIMIZERS = ("dsgd", "dadam")
DEVICES_HELP = "auto, cpu, cuda or cuda:N"
PRECISION_NAMES = ("auto", "fp32", "bf16", "fp16")


@dataclass(frozen=True)
class TrainingConfig:
    """What the swarm trains and how (published by the founder; joiners take it from the swarm's config),
    and how this node runs it (device, precision, threads, evaluation and checkpoint cadence: its own)."""

    model: str = "moe"  # "moe", "dense", "vector" or a user builder "package.module:callable"
    optimizer: str = "dadam"
    lr: float = 3e-3
    warmup_steps: int = 10
    steps: int = 0  # steps to train; 0: until stopped (the LR schedule then stays flat after warm-up)
    local_steps: int = 1  # H: steps between gossip rounds
    micro_batches: int = 1  # k: gradient accumulation
    batch_size: int = 16  # sequences per micro-batch on each node
    context: int = 128  # tokens per sequence
    data: Path | None = None  # a directory of *.txt files; None: the embedded corpus
    device: str = "auto"
    precision: str = "auto"
    threads: int = 0  # torch CPU threads; 0: torch's default
    eval_every: int = 25  # steps between validation-loss evaluations of the local model
    checkpoint_every: int = 50  # steps between checkpoints (and one when training stops)
    average_every: int = 0  # steps between writes of the swarm-average model (and one at the end); 0: never
    # SPES, sparse expert sync of the MoE model (docs/spes.md): the swarm's knobs, and this node's capacity
    spes: bool = False
    spes_sync_every: int = 1  # S
    spes_merge_every: int = 10  # M, a multiple of S
    spes_merge_until: int = 0  # D; 0: no merge warm-up
    spes_alpha0: float = 0.1
    spes_replication: int = 2  # r
    spes_refresh_codec: str = "bf16"
    spes_expert_codec: str = "fp32"  # co-owners mix their experts in this codec
    experts: int | None = None  # experts per MoE layer this node trains; None: all (CPU) or by free GPU memory

    @property
    def trains_model(self) -> bool:
        return self.model != VECTOR_MODEL


@dataclass(frozen=True)
class NodeConfig:
    """Everything a node (or a bootstrap node) needs to run. See `SETTINGS` for each setting's
    flag, environment variable and TOML key, and docs/cli.md for the table."""

    swarm: str = "murmur"  # namespaces the swarm's DHT keys
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


# ---- value kinds: how a setting is read from text (env, flags) and from TOML, and checked ----------


class Kind(Protocol):
    """Parses and checks one kind of value; raises ValueError saying what is wrong (without the source)."""

    metavar: str
    description: str  # for the docs table

    def from_text(self, text: str) -> object: ...

    def from_toml(self, raw: object) -> object: ...

    def check(self, value: object) -> None: ...


def _toml_type(raw: object) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "an array", dict: "a table"}
    return names.get(type(raw), type(raw).__name__)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Integer:
    lo: int
    hi: int | None = None
    noun: str = "value"
    metavar: str = "N"

    @property
    def description(self) -> str:
        return f"integer {self.lo}-{self.hi}" if self.hi is not None else f"integer >= {self.lo}"

    def from_text(self, text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise ValueError(f"{text!r} is not an integer") from None
        self.check(value)
        return value

    def from_toml(self, raw: object) -> int:
        if not _is_int(raw):
            raise ValueError(f"must be an integer, got {_toml_type(raw)} ({raw!r})")
        self.check(raw)
        return raw  # type: ignore[return-value]

    def check(self, value: object) -> None:
        if not _is_int(value):
            raise ValueError(f"must be an integer, got {value!r}")
        if value < self.lo or (self.hi is not None and value > self.hi):  # type: ignore[operator]
            limits = f"out of range {self.lo}-{self.hi}" if self.hi is not None else f"below the minimum {self.lo}"
            raise ValueError(f"{self.noun} {value} is {limits}")


@dataclass(frozen=True)
class Number:
    """A finite float in (lo, hi) with each end open or closed."""

    lo: float
    lo_open: bool = False
    hi: float | None = None
    hi_open: bool = False
    metavar: str = "X"

    @property
    def description(self) -> str:
        low = f"{'>' if self.lo_open else '>='} {self.lo:g}"
        return f"number {low}" + (f" and {'<' if self.hi_open else '<='} {self.hi:g}" if self.hi is not None else "")

    def from_text(self, text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise ValueError(f"{text!r} is not a number") from None
        self.check(value)
        return value

    def from_toml(self, raw: object) -> float:
        if not isinstance(raw, (int, float)) or isinstance(raw, bool):
            raise ValueError(f"must be a number, got {_toml_type(raw)} ({raw!r})")
        self.check(float(raw))
        return float(raw)

    def check(self, value: object) -> None:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"must be a finite number, got {value!r}")
        too_low = value <= self.lo if self.lo_open else value < self.lo
        too_high = self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi)
        if too_low or too_high:
            raise ValueError(f"{value:g} is out of range: must be a {self.description}")


@dataclass(frozen=True)
class Choice:
    noun: str
    choices: tuple[str, ...]
    upper: bool = False  # compare case-insensitively, stored upper-case (log levels)
    metavar: str = "NAME"

    @property
    def description(self) -> str:
        return " | ".join(self.choices)

    def from_text(self, text: str) -> str:
        value = text.strip().upper() if self.upper else text.strip()
        self.check(value)
        return value

    def from_toml(self, raw: object) -> str:
        if not isinstance(raw, str):
            raise ValueError(f"must be a string, got {_toml_type(raw)} ({raw!r})")
        return self.from_text(raw)

    def check(self, value: object) -> None:
        if value not in self.choices:
            raise ValueError(f"unknown {self.noun} {value!r}; choose one of {', '.join(self.choices)}")


@dataclass(frozen=True)
class Text:
    """A non-empty string without whitespace (names, host names); deeper checks are in `check_environment`."""

    metavar: str = "NAME"
    description: str = "string"

    def from_text(self, text: str) -> str:
        self.check(text)
        return text

    def from_toml(self, raw: object) -> str:
        if not isinstance(raw, str):
            raise ValueError(f"must be a string, got {_toml_type(raw)} ({raw!r})")
        return self.from_text(raw)

    def check(self, value: object) -> None:
        if not isinstance(value, str) or not value or any(c.isspace() for c in value):
            raise ValueError(f"{value!r} must be a non-empty string without spaces")


@dataclass(frozen=True)
class PathKind:
    metavar: str = "PATH"
    description: str = "path"

    def from_text(self, text: str) -> Path:
        if not text.strip():
            raise ValueError("the path is empty")
        return Path(text).expanduser()

    def from_toml(self, raw: object) -> Path:
        if not isinstance(raw, str):
            raise ValueError(f"must be a string (a path), got {_toml_type(raw)} ({raw!r})")
        return self.from_text(raw)

    def check(self, value: object) -> None:
        if not isinstance(value, Path):
            raise ValueError(f"must be a pathlib.Path, got {value!r}")


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Boolean:
    metavar: str = "BOOL"
    description: str = "boolean (env: 1/0, true/false, yes/no, on/off)"

    def from_text(self, text: str) -> bool:
        word = text.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
        raise ValueError(f"{text!r} is not a boolean; use one of {'/'.join(_TRUE)} or {'/'.join(_FALSE)}")

    def from_toml(self, raw: object) -> bool:
        if not isinstance(raw, bool):
            raise ValueError(f"must be true or false, got {_toml_type(raw)} ({raw!r})")
        return raw

    def check(self, value: object) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"must be a boolean, got {value!r}")


_ADDRESS_PROTOCOLS = ("ip4", "ip6", "dns", "dns4", "dns6")


def check_multiaddr(text: str, *, peer: bool) -> None:
    """A multiaddr p2pd can listen on / announce (peer=False: no /p2p part) or dial as an initial
    peer (peer=True: ends in /p2p/<peer id>); raises ValueError saying what is wrong."""
    if not isinstance(text, str) or not text.startswith("/"):
        raise ValueError(f"malformed multiaddr {text!r}: it must start with '/', e.g. {LOOPBACK_LISTEN}")
    try:
        names = [protocol.name for protocol in Multiaddr(text).protocols()]
    except Exception as exc:  # the multiaddr package raises several exception types
        raise ValueError(f"malformed multiaddr {text!r}: {getattr(exc, 'message', exc)}") from None
    if not names:
        raise ValueError(f"malformed multiaddr {text!r}: it names no protocol")
    if peer and names == ["dnsaddr", "p2p"]:
        return  # resolved by p2pd through DNS TXT records
    if names[0] not in _ADDRESS_PROTOCOLS:
        raise ValueError(f"multiaddr {text!r} must start with an address: /{', /'.join(_ADDRESS_PROTOCOLS)}")
    if "tcp" not in names and "udp" not in names:
        raise ValueError(f"multiaddr {text!r} has no /tcp/<port> or /udp/<port>")
    if peer and names[-1] != "p2p":
        raise ValueError(f"peer multiaddr {text!r} must end with /p2p/<peer id>")
    if not peer and "p2p" in names:
        raise ValueError(f"multiaddr {text!r} must not name a peer (/p2p/...): it is this node's own address")


@dataclass(frozen=True)
class Multiaddrs:
    """A list of multiaddrs: repeated flags, a space- or comma-separated env value, a TOML array."""

    peer: bool
    metavar: str = "MULTIADDR"

    @property
    def description(self) -> str:
        return "list of peer multiaddrs (.../p2p/<peer id>)" if self.peer else "list of multiaddrs"

    def from_text(self, text: str) -> tuple[str, ...]:
        value = tuple(part for part in re.split(r"[\s,]+", text) if part)
        self.check(value)
        return value

    def from_toml(self, raw: object) -> tuple[str, ...]:
        if not isinstance(raw, list) or not all(isinstance(item, str) for item in raw):
            raise ValueError(f"must be an array of strings, got {_toml_type(raw)} ({raw!r})")
        value = tuple(raw)
        self.check(value)
        return value

    def check(self, value: object) -> None:
        if not isinstance(value, tuple):
            raise ValueError(f"must be a tuple of multiaddrs, got {value!r}")
        for item in value:
            check_multiaddr(item, peer=self.peer)


@dataclass(frozen=True)
class EdgeList:
    """Edges of the custom topology: "0-1,1-2,2-0" as text, [[0, 1], [1, 2]] (or the text) in TOML."""

    metavar: str = "EDGES"
    description: str = "edge list, e.g. 0-1,1-2,2-0"

    def from_text(self, text: str) -> tuple[tuple[int, int], ...]:
        try:
            edges = tuple(tuple(int(r) for r in pair.split("-")) for pair in text.split(",") if pair.strip())
        except ValueError:
            raise ValueError(f"{text!r} is not an edge list like 0-1,1-2,2-0") from None
        if any(len(edge) != 2 for edge in edges):
            raise ValueError(f"{text!r} is not an edge list like 0-1,1-2,2-0")
        self.check(edges)
        return edges  # type: ignore[return-value]

    def from_toml(self, raw: object) -> tuple[tuple[int, int], ...]:
        if isinstance(raw, str):
            return self.from_text(raw)
        if not isinstance(raw, list) or not all(
            isinstance(edge, list) and len(edge) == 2 and all(_is_int(r) for r in edge) for edge in raw
        ):
            raise ValueError(f"must be an array of [from, to] rank pairs or a string like \"0-1,1-2\", got {raw!r}")
        edges = tuple((edge[0], edge[1]) for edge in raw)
        self.check(edges)
        return edges

    def check(self, value: object) -> None:
        if not isinstance(value, tuple) or not all(
            isinstance(edge, tuple) and len(edge) == 2 and all(_is_int(r) and r >= 0 for r in edge) for edge in value
        ):
            raise ValueError(f"must be a tuple of (from, to) pairs of non-negative ranks, got {value!r}")


@dataclass(frozen=True)
class Named:
    """A name that must match `pattern` in full (models, devices); text is stripped of spaces."""

    noun: str
    pattern: str
    hint: str  # what the error suggests instead
    description: str
    metavar: str = "NAME"

    def from_text(self, text: str) -> str:
        value = text.strip()
        self.check(value)
        return value

    def from_toml(self, raw: object) -> str:
        if not isinstance(raw, str):
            raise ValueError(f"must be a string, got {_toml_type(raw)} ({raw!r})")
        return self.from_text(raw)

    def check(self, value: object) -> None:
        if not (isinstance(value, str) and re.fullmatch(self.pattern, value)):
            raise ValueError(f"unknown {self.noun} {value!r}; use {self.hint}")


# An embedded model, `vector`, or a user builder named by import path (imported when the node starts).
MODEL_NAME = Named("model", "|".join((*EMBEDDED_MODEL_NAMES, VECTOR_MODEL, r"[\w.]+:[\w.]+")),
                   hint="moe, dense, vector or package.module:callable",
                   description="moe | dense | vector | package.module:callable", metavar="MODEL")
DEVICE_NAME = Named("device", r"auto|cpu|cuda(:\d+)?", hint=DEVICES_HELP, description=DEVICES_HELP, metavar="DEVICE")


# ---- the settings ------------------------------------------------------------------------------

NODE = frozenset({"node", "join"})
DAEMONS = NODE | {"bootstrap"}
MONITOR_CLIENTS = NODE | {"status", "eval"}  # commands that find a node by its monitor


@dataclass(frozen=True)
class Setting:
    """One setting: where it lives in NodeConfig and the TOML file, and how users set it."""

    key: str  # dotted path in NodeConfig, also the TOML key
    kind: Kind
    env: str
    flag: str
    help: str
    commands: frozenset[str]  # commands that take the flag and read the environment variable
    optional: bool = False  # None (unset) is a valid value
    default_text: str | None = None  # the default in words, where the value itself says little

    @property
    def dest(self) -> str:
        """The argparse destination of the flag."""
        return f"setting:{self.key}"

    @property
    def metavar(self) -> str:
        return self.kind.metavar

    def default_in_words(self) -> str:
        if self.default_text is not None:
            return self.default_text
        value = setting_value(DEFAULTS, self.key)
        if isinstance(value, bool):
            return str(value).lower()
        if isinstance(value, tuple):
            return " ".join(map(str, value)) or "none"
        return "none" if value is None else str(value)


_NONNEG = Integer(0)

SETTINGS: tuple[Setting, ...] = (
    Setting("swarm", Text(), "MURMUR_SWARM", "--swarm", "swarm name: namespaces the swarm's DHT keys; "
            "1-64 letters, digits, '.', '_' or '-'", NODE),
    Setting("data_dir", PathKind(metavar="DIR"), "MURMUR_DATA_DIR", "--data-dir",
            "directory for the identity, checkpoints and logs; created if missing", DAEMONS,
            default_text="./murmur-data"),
    Setting("identity_file", PathKind(metavar="FILE"), "MURMUR_IDENTITY", "--identity",
            "libp2p RSA key file that gives the node its peer id; created (mode 0600) if missing",
            DAEMONS, optional=True, default_text="<data-dir>/identity.key"),
    Setting("heartbeat_s", Number(0.0, lo_open=True, metavar="S"), "MURMUR_HEARTBEAT", "--heartbeat",
            "seconds between DHT heartbeats; a peer's record expires after 3 missed ones", NODE),
    Setting("dim", Integer(1, noun="dim"), "MURMUR_DIM", "--dim",
            "floats in the random vector gossiped while no model is trained", NODE),
    Setting("seed", _NONNEG, "MURMUR_SEED", "--seed", "seed of the node's own randomness", NODE),
    Setting("log_level", Choice("log level", LOG_LEVELS, upper=True, metavar="LEVEL"), "MURMUR_LOG_LEVEL",
            "--log-level", "log level, case-insensitive", DAEMONS),
    Setting("network.listen", Multiaddrs(peer=False), "MURMUR_LISTEN", "--listen",
            "multiaddr to listen on; repeatable. Loopback by default: listening on a "
            "public interface is a choice", DAEMONS),
    Setting("network.announce", Multiaddrs(peer=False), "MURMUR_ANNOUNCE", "--announce",
            "multiaddr other peers should dial instead of the listen ones, behind NAT or port "
            "forwarding; repeatable", DAEMONS),
    Setting("network.initial_peers", Multiaddrs(peer=True), "MURMUR_PEERS", "--peers",
            "full multiaddr (ending in /p2p/<peer id>) of a peer or bootstrap node to join the DHT "
            "through; several may follow one flag", DAEMONS),
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
    Setting("monitor.host", Text(metavar="HOST", description="host name or IP address"), "MURMUR_MONITOR_HOST",
            "--monitor-host", "address the monitor page listens on; 0.0.0.0 exposes it to the network",
            MONITOR_CLIENTS),
    Setting("monitor.port", Integer(0, 65535, noun="port", metavar="PORT"), "MURMUR_MONITOR_PORT",
            "--monitor-port", "TCP port of the monitor page; 0 picks a free one", MONITOR_CLIENTS),
    Setting("gossip.codec", Choice("codec", NODE_CODECS, metavar="CODEC"), "MURMUR_CODEC", "--codec",
            "wire codec of the exchanged parameters", NODE),
    Setting("gossip.round_interval_s", Number(0.0, lo_open=True, metavar="S"), "MURMUR_ROUND_INTERVAL",
            "--round-interval", "seconds between the starts of two gossip rounds", NODE),
    Setting("gossip.exchange_timeout_s", Number(0.0, lo_open=True, metavar="S"), "MURMUR_EXCHANGE_TIMEOUT",
            "--exchange-timeout", "seconds one exchange with one neighbour may take before it counts "
            "as missing", NODE),
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
            "how a round combines the received parameters: weighted average, centered clipping, "
            "coordinate-wise median or trimmed mean", NODE),
    Setting("gossip.mixing.tau", Number(0.0, lo_open=True, metavar="TAU"), "MURMUR_TAU", "--tau",
            "clipping radius of --mixing clipped", NODE, optional=True),
    Setting("training.model", MODEL_NAME, "MURMUR_MODEL", "--model",
            "what the swarm trains: the embedded MoE or dense GPT, `vector` (no model: gossip a random vector "
            "of --dim floats), or a builder by import path; a joiner takes the swarm's, and runs a builder only "
            "if its own --model names the same one", NODE),
    Setting("training.optimizer", Choice("optimizer", OPTIMIZERS, metavar="OPTIMIZER"), "MURMUR_OPTIMIZER",
            "--optimizer", "dsgd (adapt-then-combine) or dadam (decentralized Adam, exchange overlapped "
            "with compute); a joiner takes the swarm's", NODE),
    Setting("training.lr", Number(0.0, lo_open=True, metavar="LR"), "MURMUR_LR", "--lr",
            "peak learning rate (the swarm's)", NODE),
    Setting("training.warmup_steps", _NONNEG, "MURMUR_WARMUP", "--warmup-steps",
            "linear learning-rate warm-up steps (the swarm's)", NODE),
    Setting("training.steps", _NONNEG, "MURMUR_STEPS", "--steps",
            "steps to train, where the cosine schedule ends; 0 trains until stopped. A node that is done "
            "keeps serving its parameters until stopped (the swarm's)", NODE),
    Setting("training.local_steps", Integer(1, noun="local steps"), "MURMUR_LOCAL_STEPS", "--local-steps",
            "H: optimizer steps between gossip rounds (the swarm's)", NODE),
    Setting("training.micro_batches", Integer(1, noun="micro-batches"), "MURMUR_MICRO_BATCHES",
            "--micro-batches", "k: micro-batches accumulated per step (the swarm's)", NODE),
    Setting("training.batch_size", Integer(1, noun="batch size"), "MURMUR_BATCH_SIZE", "--batch-size",
            "sequences per micro-batch on each node (the swarm's)", NODE),
    Setting("training.context", Integer(2, noun="context"), "MURMUR_CONTEXT", "--context",
            "tokens per training sequence, at most the model's context (the swarm's)", NODE),
    Setting("training.data", PathKind(metavar="DIR"), "MURMUR_DATA", "--data",
            "a directory of *.txt files to train on (this node's own corpus; every node of a swarm "
            "should have the same one)", NODE, optional=True, default_text="the embedded corpus"),
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
    Setting("training.average_every", _NONNEG, "MURMUR_AVERAGE_EVERY", "--average-every",
            "steps between writes of the swarm-average model to swarm-average.npz in the data directory "
            "(and one when training ends); each pulls every live peer's parameters; 0: only on request "
            "(murmur eval --save)", NODE),
    Setting("gossip.mixing.trim", Number(0.0, hi=0.5, hi_open=True, metavar="FRACTION"), "MURMUR_TRIM", "--trim",
            "fraction trimmed per side by --mixing trimmed_mean", NODE),
    Setting("training.spes", Boolean(), "MURMUR_SPES", "--spes",
            "SPES: each node trains the shared weights and the experts it owns of the MoE model, and syncs "
            "experts sparsely (docs/spes.md); needs --model moe or an MoE builder (the swarm's)", NODE),
    Setting("training.spes_sync_every", Integer(1, noun="steps"), "MURMUR_SPES_SYNC_EVERY", "--spes-sync-every",
            "S: steps between SPES syncs (the swarm's)", NODE),
    Setting("training.spes_merge_every", Integer(1, noun="steps"), "MURMUR_SPES_MERGE_EVERY", "--spes-merge-every",
            "M: steps between expert-merging warm-up merges, a multiple of S (the swarm's)", NODE),
    Setting("training.spes_merge_until", _NONNEG, "MURMUR_SPES_MERGE_UNTIL", "--spes-merge-until",
            "D: no warm-up merge from this step on; 0 turns the warm-up off (the swarm's)", NODE),
    Setting("training.spes_alpha0", Number(0.0, hi=1.0, metavar="ALPHA"), "MURMUR_SPES_ALPHA0", "--spes-alpha0",
            "warm-up merge strength at step 0, falling linearly to 0 at D (the swarm's)", NODE),
    Setting("training.spes_replication", Integer(1, noun="replication"), "MURMUR_SPES_REPLICATION",
            "--spes-replication", "r: owners per expert where peers and capacities allow (the swarm's)", NODE),
    Setting("training.spes_refresh_codec", Choice("refresh codec", SPES_REFRESH_CODECS, metavar="CODEC"),
            "MURMUR_SPES_REFRESH_CODEC", "--spes-refresh-codec",
            "codec frozen expert copies travel and are hashed in (the swarm's)", NODE),
    Setting("training.spes_expert_codec", Choice("expert codec", SPES_EXPERT_CODECS, metavar="CODEC"),
            "MURMUR_SPES_EXPERT_CODEC", "--spes-expert-codec",
            "codec co-owners mix their experts in; int8 or bf16 cut the traffic of r >= 2 (the swarm's)", NODE),
    Setting("training.experts", Integer(1, noun="experts"), "MURMUR_EXPERTS", "--experts",
            "SPES capacity: experts per MoE layer this node trains (this node's own)", NODE, optional=True,
            default_text="all on CPU; on CUDA as many as fit in half the free GPU memory (docs/spes.md)"),
)

SETTINGS_BY_KEY: Mapping[str, Setting] = {setting.key: setting for setting in SETTINGS}
# The TOML tables: every proper prefix of a setting's dotted key.
TABLES = frozenset(
    ".".join(parts[:i]) for parts in (key.split(".") for key in SETTINGS_BY_KEY) for i in range(1, len(parts))
)
DEFAULTS = NodeConfig()


def settings_for(command: str) -> tuple[Setting, ...]:
    return tuple(setting for setting in SETTINGS if command in setting.commands)


# ---- layers ------------------------------------------------------------------------------------


class Sourced(NamedTuple):
    """A setting's value and where it came from, for error messages."""

    value: object
    source: str


Layer = Mapping[str, Sourced]


def read_config_file(path: Path, source: str = "--config") -> dict[str, Sourced]:
    """Read a TOML config file: nested tables whose dotted keys are the settings' keys.

    Unknown keys and values of the wrong type are errors. Relative paths in the file are relative
    to the file's directory, so a config and the files it names can move together.
    """
    try:
        with open(path, "rb") as file:
            document = tomllib.load(file)
    except OSError as exc:
        raise ConfigError(f"{source} {path}: cannot read the config file: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    layer: dict[str, Sourced] = {}
    for key, raw in _flatten(path, document):
        setting = SETTINGS_BY_KEY[key]
        try:
            value = setting.kind.from_toml(raw)
        except ValueError as exc:
            raise ConfigError(f"{path}:{key}: {exc}") from None
        if isinstance(value, Path) and not value.is_absolute():
            value = path.parent / value
        layer[key] = Sourced(value, f"{path}:{key}")
    return layer


def _flatten(path: Path, table: Mapping[str, object], prefix: str = "") -> Iterator[tuple[str, object]]:
    for name, raw in table.items():
        key = prefix + name
        if key in SETTINGS_BY_KEY:
            yield key, raw
        elif key in TABLES:
            if not isinstance(raw, dict):
                raise ConfigError(f"{path}:{key}: must be a table ([{key}]), got {_toml_type(raw)}")
            yield from _flatten(path, raw, key + ".")
        else:
            known = [*SETTINGS_BY_KEY, *TABLES]
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{path}: unknown key {key!r}{hint}")


def read_environment(env: Mapping[str, str], settings: Collection[Setting]) -> dict[str, Sourced]:
    """The `MURMUR_*` variables of `settings`; an empty variable counts as unset."""
    layer: dict[str, Sourced] = {}
    for setting in settings:
        text = env.get(setting.env, "")
        if not text.strip():
            continue
        try:
            layer[setting.key] = Sourced(setting.kind.from_text(text), setting.env)
        except ValueError as exc:
            raise ConfigError(f"{setting.env}: {exc}") from None
    return layer


def read_flags(given: Mapping[Setting, object]) -> dict[str, Sourced]:
    """The flags a user actually gave, as argparse left them: a string, a list of strings
    (repeatable flags) or a bool (--x/--no-x)."""
    layer: dict[str, Sourced] = {}
    for setting, raw in given.items():
        try:
            if isinstance(raw, bool):
                setting.kind.check(raw)
                value: object = raw
            else:
                value = setting.kind.from_text(" ".join(raw) if isinstance(raw, list) else str(raw))
        except ValueError as exc:
            raise ConfigError(f"{setting.flag}: {exc}") from None
        layer[setting.key] = Sourced(value, setting.flag)
    return layer


@dataclass(frozen=True)
class ResolvedConfig:
    """A config and, for each setting not left at its default, where its value came from."""

    config: NodeConfig
    sources: Mapping[str, str] = field(default_factory=dict)

    def source(self, key: str) -> str:
        return self.sources.get(key) or _default_source(key)


def _default_source(key: str) -> str:
    return f"default {SETTINGS_BY_KEY[key].flag}"


def merge_layers(*layers: Layer) -> ResolvedConfig:
    """Later layers win: call as merge_layers(file, environment, flags). Paths become absolute."""
    merged: dict[str, Sourced] = {}
    for layer in layers:
        merged.update(layer)
    _check_combinations(merged)
    values = {key: item.value for key, item in merged.items()}
    for key, value in values.items():
        if isinstance(value, Path):
            values[key] = value.absolute()
    if "data_dir" not in values:
        values["data_dir"] = DEFAULTS.data_dir.absolute()
    try:
        config = _replaced(DEFAULTS, values)
    except ValueError as exc:  # TopologySpec / MixingRule checks not covered above
        raise ConfigError(str(exc)) from None
    return ResolvedConfig(config, {key: item.source for key, item in merged.items()})


def _check_combinations(merged: Mapping[str, Sourced]) -> None:
    def current(key: str) -> object:
        return merged[key].value if key in merged else setting_value(DEFAULTS, key)

    def source(key: str) -> str:
        return merged[key].source if key in merged else _default_source(key)

    if current("gossip.mixing.kind") == "clipped" and current("gossip.mixing.tau") is None:
        raise ConfigError(f"{source('gossip.mixing.kind')}: mixing rule 'clipped' needs a clipping radius: "
                          "set --tau, MURMUR_TAU or gossip.mixing.tau")
    for key in ("network.data_listen", "network.data_announce"):
        if current(key) and current("network.transport") != "libp2p":
            raise ConfigError(f"{source(key)}: only the libp2p data plane listens apart from p2pd; "
                              "add --transport libp2p or drop it")
    if current("training.spes") and current("training.model") in (VECTOR_MODEL, "dense"):
        raise ConfigError(f"{source('training.spes')}: SPES syncs the experts of a mixture-of-experts model; "
                          f"--model {current('training.model')} has none (use --model moe)")
    merge_every, sync_every = current("training.spes_merge_every"), current("training.spes_sync_every")
    if current("training.spes") and merge_every % sync_every:  # type: ignore[operator]
        raise ConfigError(f"{source('training.spes_merge_every')}: the merge interval "
                          f"{current('training.spes_merge_every')} must be a multiple of the sync interval "
                          f"{current('training.spes_sync_every')} (--spes-sync-every)")
    if current("gossip.topology.name") == "custom" and not current("gossip.topology.edges"):
        raise ConfigError(f"{source('gossip.topology.name')}: the custom topology needs an edge list: "
                          "set --edges, MURMUR_EDGES or gossip.topology.edges")


def _replaced(obj: object, values: Mapping[str, object]) -> object:
    """`obj` with the values at dotted keys (relative to it) replaced, nested dataclasses included."""
    direct: dict[str, object] = {}
    nested: dict[str, dict[str, object]] = {}
    for key, value in values.items():
        head, _, rest = key.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            direct[head] = value
    for head, sub in nested.items():
        direct[head] = _replaced(getattr(obj, head), sub)
    return dataclasses.replace(obj, **direct)  # type: ignore[type-var]


# ---- checks against the machine -----------------------------------------------------------------


def check_environment(
    resolved: ResolvedConfig, *, swarm: bool = True, files: bool = True, monitor: bool = True
) -> None:
    """What a config can only be checked against on this machine (or with hivemind's rules, which
    cost hivemind's import): the swarm name, the data dir and identity file, the monitor address."""
    config = resolved.config
    if swarm:
        from node.net.discovery import validate_swarm_name  # imports hivemind

        try:
            validate_swarm_name(config.swarm)
        except ValueError as exc:
            raise ConfigError(f"{resolved.source('swarm')}: {exc}") from None
    if files:
        _check_data_dir(config.data_dir, resolved.source("data_dir"))
        _check_identity(config.identity_path, _identity_source(resolved))
    if monitor:
        _check_monitor_address(config.monitor, resolved.source("monitor.host"), resolved.source("monitor.port"))


def _identity_source(resolved: ResolvedConfig) -> str:
    if resolved.config.identity_file is not None:
        return resolved.source("identity_file")
    return f"identity file <data-dir>/{IDENTITY_FILE_NAME} (data dir from {resolved.source('data_dir')})"


def _check_data_dir(path: Path, source: str) -> None:
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{source}: data dir {path} exists and is not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"{source}: data dir {path} is not writable")
        return
    ancestor = next(parent for parent in path.parents if parent.exists())
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(f"{source}: cannot create data dir {path}: {ancestor} is not a writable directory")


def _check_identity(path: Path, source: str) -> None:
    """An existing identity file must be a key murmur can use; a missing one is created at start."""
    if not path.exists() and not path.is_symlink():
        return
    from node.net.identity import InvalidIdentity, load_identity  # imports hivemind

    try:
        load_identity(path)
    except InvalidIdentity as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _check_monitor_address(monitor: MonitorConfig, host_source: str, port_source: str) -> None:
    """Bind the monitor's address once, so a port in use fails now with exit 2, not after p2pd started.

    SO_REUSEADDR as the monitor's server sets it: a port only in TIME_WAIT after a restart is free.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            monitor.host, monitor.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise ConfigError(f"{host_source}: cannot resolve monitor host {monitor.host!r}: {exc.strerror}") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"{port_source}: port {monitor.port} on {monitor.host} is already in use; "
                                  "choose another, or 0 for any free port") from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(f"{host_source}: {monitor.host} is not an address of this machine") from None
            if exc.errno == errno.EACCES:
                raise ConfigError(f"{port_source}: port {monitor.port} needs privileges; use one above 1023") from None
            problem = f"cannot listen on {monitor.host}:{monitor.port}: {exc.strerror}"
            raise ConfigError(f"{port_source}: {problem}") from None


# ---- docs --------------------------------------------------------------------------------------

TABLE_BEGIN = "<!-- settings table: generated by `python -m node.config`; do not edit by hand -->"
TABLE_END = "<!-- end of settings table -->"


def settings_table() -> str:
    """The markdown table of every setting that docs/cli.md embeds."""
    lines = [
        TABLE_BEGIN,
        "| TOML key | Flag | Environment variable | Default | Type | Commands | Meaning |",
        "|---|---|---|---|---|---|---|",
    ]
    for setting in SETTINGS:
        flag = f"`{setting.flag}`" + (f" / `--no-{setting.flag[2:]}`" if isinstance(setting.kind, Boolean) else "")
        commands = ", ".join(c for c in ("node", "join", "bootstrap", "status", "eval") if c in setting.commands)
        cells = (setting.default_in_words(), setting.kind.description, commands, setting.help)
        default, kind, commands, meaning = (_markdown_cell(cell) for cell in cells)
        lines.append(f"| `{setting.key}` | {flag} | `{setting.env}` | {default} | {kind} | {commands} | {meaning} |")
    lines.append(TABLE_END)
    return "\n".join(lines) + "\n"


def _markdown_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")

