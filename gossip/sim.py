"""A swarm simulator: N peers in one process gossiping over a topology, with link latency and
bandwidth, message loss and churn; reports consensus error and bytes moved per round.

It runs the same pieces a node runs — the topology's round weights over the sorted membership view,
`gossip.mixing.mix`, the codec's lossy round trip and the wire format's exact message size — but
delivers messages by function call, rounds in lock-step, and every peer sees the same view.
Model choices (documented in docs/architecture.md):
- loss drops one directed message (the receiver renormalises, as a node does for a failed exchange);
  a lost message moves no bytes;
- churn: each live peer leaves with probability `churn` before a round, and as many new peers join;
  a joiner starts from a copy of a live peer's vector (the download counts as bytes moved), as a
  node joining a running swarm does;
- a round lasts as long as its slowest sender: latency + (out-degree * message bytes) / bandwidth.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from gossip.codecs import Codec, get_codec
from gossip.memory import LinkModel
from gossip.mixing import MixingRule
from gossip.robust import Mixer
from gossip.wire import message_nbytes
from topology import MembershipView, Topology, TopologySpec, build_topology, peer_round


@dataclass(frozen=True)
class SimConfig:
    peers: int
    topology: TopologySpec
    rounds: int
    dim: int = 1000
    drop: float = 0.0
    churn: float = 0.0
    codec: str = "fp32"
    link: LinkModel = field(default_factory=LinkModel)
    rule: MixingRule = field(default_factory=MixingRule)
    seed: int = 0
    dtype: str = "float64"

    def __post_init__(self) -> None:
        if self.peers < 1:
            raise ValueError(f"--peers must be >= 1, got {self.peers}")
        if self.rounds < 0:
            raise ValueError(f"--rounds must be >= 0, got {self.rounds}")
        if self.dim < 1:
            raise ValueError(f"--dim must be >= 1, got {self.dim}")
        for name in ("drop", "churn"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"--{name} must be a probability in [0, 1), got {getattr(self, name)}")
        if self.codec == "topk":
            raise ValueError("the simulator mixes whole vectors; top-k only suits sending differences")
        get_codec(self.codec)  # unknown codec -> clear error now, not in round 1
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be float32 or float64, got {self.dtype!r}")


@dataclass(frozen=True)
class RoundReport:
    round: int  # 0 is the state before any mixing
    consensus_error: float  # RMS distance of the live peers' vectors to their mean
    bytes: int  # bytes moved in this round (delivered exchanges and joiners' downloads)
    peers: int  # live peers during the round
    messages: int  # delivered messages
    dropped: int  # lost messages
    sim_time_s: float  # simulated duration of the round under the link model

    def as_json(self) -> dict[str, float | int]:
        return {
            "round": self.round,
            "consensus_error": self.consensus_error,
            "bytes": self.bytes,
            "peers": self.peers,
            "messages": self.messages,
            "dropped": self.dropped,
            "sim_time_s": self.sim_time_s,
        }


def consensus_error(vectors: list[np.ndarray]) -> float:
    """sqrt(mean_i ||x_i - mean||^2), accumulated per peer so no n x d stack is built."""
    mean = np.zeros(vectors[0].shape, dtype=np.float64)
    for x in vectors:
        mean += x
    mean /= len(vectors)
    return math.sqrt(sum(float(np.sum((x - mean) ** 2)) for x in vectors) / len(vectors))


def simulate(config: SimConfig) -> Iterator[RoundReport]:
    """Yield the round-0 state, then one report per round."""
    rng = np.random.default_rng(config.seed)
    codec = get_codec(config.codec)
    dtype = np.dtype(config.dtype)
    msg_bytes = message_nbytes({"params": ((config.dim,), config.dtype)}, codec)
    counter = itertools.count()

    def new_id() -> str:
        return f"sim{next(counter):08d}"

    state = {new_id(): rng.standard_normal(config.dim).astype(dtype) for _ in range(config.peers)}
    topologies: dict[int, Topology] = {}
    mixers: dict[str, Mixer] = {}  # each peer's rule and what it remembers (the adaptive radius)
    lossless = codec.name == "fp32" and dtype == np.float32
    yield RoundReport(0, consensus_error(list(state.values())), 0, len(state), 0, 0, 0.0)

    for t in range(config.rounds):
        moved = _churn(state, rng, config.churn, new_id) * msg_bytes
        view = MembershipView.of(state)
        if view.n not in topologies:
            topologies[view.n] = build_topology(config.topology, view.n)
        topo = topologies[view.n]
        # what each peer's neighbours receive: its vector after the codec's round trip
        sent = state if lossless else {pid: _round_trip(codec, x) for pid, x in state.items()}
        new_state: dict[str, np.ndarray] = {}
        delivered = dropped = 0
        out_degree = {pid: 0 for pid in state}
        for pid in view.peer_ids:
            plan = peer_round(topo, view, pid, t)
            arrived = {}
            for src in sorted(plan.in_weights):
                if config.drop and rng.random() < config.drop:
                    dropped += 1
                    continue
                arrived[src] = sent[src]
                out_degree[src] += 1
            delivered += len(arrived)
            mixer = mixers.setdefault(pid, Mixer(config.rule))
            new_state[pid] = mixer.mix({"params": state[pid]}, {src: {"params": x} for src, x in arrived.items()},
                                       plan.self_weight, plan.in_weights).tensors["params"]
        state = new_state
        moved += delivered * msg_bytes
        slowest = max(out_degree.values(), default=0)
        sim_time = config.link.latency_s + slowest * msg_bytes / config.link.bandwidth_bytes_per_s if slowest else 0.0
        yield RoundReport(t + 1, consensus_error(list(state.values())), moved, view.n, delivered, dropped, sim_time)


def _round_trip(codec: Codec, x: np.ndarray) -> np.ndarray:
    decoded: np.ndarray = codec.decode(codec.encode(x), x.size).astype(x.dtype, copy=False)
    return decoded


def _churn(state: dict[str, np.ndarray], rng: np.random.Generator, churn: float, new_id: Callable[[], str]) -> int:
    """Remove each peer with probability `churn` (keeping at least one), add as many joiners.

    Returns the number of joiners; each copies the vector of a random peer that stayed.
    """
    if not churn:
        return 0
    ids = list(state)
    leaving = [pid for pid in ids if rng.random() < churn]
    if len(leaving) == len(ids):
        leaving = leaving[1:]
    for pid in leaving:
        del state[pid]
    stayed = list(state)
    for _ in leaving:
        donor = stayed[rng.integers(len(stayed))]
        state[new_id()] = state[donor].copy()
    return len(leaving)
