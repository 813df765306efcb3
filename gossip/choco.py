"""Compressed gossip of differences for the per-step algorithms (CHOCO-SGD, Koloskova et al. 2019), with
the estimates kept per edge so that a lost exchange cannot split them.

For each neighbour j a node i keeps two estimates, both also held (mirrored) by j:
`mine` = what j believes x_i is, and `theirs` = what i believes x_j is. An exchange on the edge sends
q_i = Q(x_i - mine) one way and q_j = Q(x_j - theirs_at_j) the other, where Q is the codec's round trip
(exactly what the receiver decodes); once both sides know the exchange completed (the exchange's ack),
both add q_i to their copy of i's estimate and q_j to their copy of j's, and node i moves

    x_i <- x_i + gamma * sum_j w_ij * (theirs_j - mine_j)

over the edges that completed this round. With symmetric weights (w_ij = w_ji) the moves of an edge's
two ends cancel, so the swarm's average is preserved, as in plain gossip. Per-edge estimates cost two
model copies per neighbour (at most `max_edges` neighbours, least recently used dropped) where CHOCO's
shared estimate costs one per neighbour, but they are what keeps both ends in step when an exchange
fails for some neighbours only: a failed exchange updates neither end of its edge.

An edge starts (and restarts) from the `anchor`, parameters every peer holds bit for bit (the swarm's
seeded initial model). Each message carries the sender's count of completed exchanges on the edge and a
digest of its anchor; a count or anchor that differs from the receiver's means the two ends no longer
hold the same estimates (an ack lost after it was written, a restart, an evicted edge), and both reset
the edge to the anchor. Docs: docs/training.md, "Compressed gossip".
"""

from __future__ import annotations

import collections
import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Annotated

import msgspec
import numpy as np

from gossip.codecs import SPARSE_CODECS, Codec
from gossip.mixing import MixingKind, MixingRule, clip_scale, distance
from gossip.robust import Mixer, check_values
from gossip.rules import CHOCO_RULES, Knobs, Rule, broken_rules
from gossip.wire import MetaValue
from topology import TopologySpec

# meta keys of every CHOCO message (exchange request and reply)
META_EDGE = "choco_edge"  # completed exchanges on the edge, as the sender counts them
META_ANCHOR = "choco_anchor"  # digest of the sender's anchor
ANCHOR_DIGEST_CHARS = 16
DEFAULT_MAX_EDGES = 16
# default consensus step (see default_gamma): DENSE_GAMMA for codecs that keep every element; for top-k
# TOPK_GAMMA_PER_RATIO x its ratio, at most MAX_TOPK_GAMMA
DENSE_GAMMA = 1.0
TOPK_GAMMA_PER_RATIO = 10.0
MAX_TOPK_GAMMA = 0.5

# topology families whose every edge is symmetric (an exchange with an ack): the ones CHOCO runs on
SYMMETRIC_TOPOLOGIES = ("ring", "torus", "complete", "star", "hypercube", "random-regular", "custom")
# of those, the families whose graphs are regular, where uniform weights are symmetric too
_REGULAR_TOPOLOGIES = ("ring", "torus", "complete", "hypercube", "random-regular")

Tensors = Mapping[str, np.ndarray]


class ChocoKnobs(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Compressed gossip's knobs, each declared once (gossip.knobs, as gossip.diloco.DilocoSettings): the
    swarm document's part (node.swarm.recipe.CompressionDoc subclasses this Struct and adds its `kind`) and
    the node's settings table rows `gossip.<setting>` with their flags and variables (node.config.table),
    hence docs/cli.md's table. ChocoSettings is the running config (codec, gamma resolved, max_edges).

    `gamma` left out (None) means default_gamma(codec), which `default_text` says in words; the help names
    the node's flags: it is the settings table's text, user-visible byte for byte."""

    gamma: Annotated[float, msgspec.Meta(
        gt=0.0, le=1.0,
        extra={"metavar": "GAMMA", "setting": "choco_gamma",
               "default_text": f"{DENSE_GAMMA:g} for fp32/fp16/bf16/int8; for topk {TOPK_GAMMA_PER_RATIO:g} x "
               f"--topk-ratio, at most {MAX_TOPK_GAMMA:g}"},
        description="consensus step of --gossip-compression choco (the swarm's)",
    )] | None = None


def check_topology(spec: TopologySpec) -> None:
    """Raise ValueError (one line) unless compressed gossip can run on this topology: every edge symmetric,
    so that an exchange's ack tells both ends it completed, and symmetric weights, so that the two ends'
    moves cancel and the swarm's average is kept."""
    if spec.name not in SYMMETRIC_TOPOLOGIES or (spec.name == "custom" and spec.directed):
        raise ValueError(f"compressed gossip needs a topology whose edges are symmetric ({', '.join(SYMMETRIC_TOPOLOGIES)}"
                         f" undirected); {spec.name}{' (directed)' if spec.directed else ''} pulls over directed edges, "
                         "where a sender cannot know its message arrived and the per-neighbour estimates would drift apart")
    if spec.weight_scheme == "uniform" and spec.name not in _REGULAR_TOPOLOGIES:
        raise ValueError(f"compressed gossip needs symmetric weights: 'uniform' weights on {spec.name} differ between "
                         "the two ends of an edge; use metropolis-hastings or max-degree")


class Desync(Exception):
    """The two ends of an edge no longer hold the same estimates; `reason` says what differed."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class ChocoSettings:
    """The swarm's compressed-gossip knobs: the codec differences travel in, the consensus step gamma,
    and how many neighbours' estimates a node keeps."""

    codec: Codec
    gamma: float = DENSE_GAMMA
    max_edges: int = DEFAULT_MAX_EDGES
    rule: MixingRule = field(default_factory=MixingRule)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.gamma) and 0 < self.gamma <= 1):
            raise ValueError(f"the compressed-gossip step gamma must be in (0, 1], got {self.gamma!r}")
        if self.max_edges < 1:
            raise ValueError(f"max_edges must be >= 1, got {self.max_edges!r}")
        if Rule.CHOCO_WITH_WHOLE_VECTOR_MIXING in broken_rules(Knobs(choco=True, mixing=self.rule.kind)):
            raise ValueError(f"compressed gossip moves along per-edge differences; mixing rule {self.rule.kind!r} "
                             f"needs whole vectors: use {' or '.join(CHOCO_RULES)}")


def default_gamma(codec: Codec) -> float:
    """The consensus step when the recipe leaves it open: 1 for codecs that keep every element (the
    estimates then catch up in about one exchange); for top-k, 10 times its ratio, at most 1/2: the
    step that trained best in the measurements of docs/training.md (larger steps diverged with DAdam); for
    SparseLoCo's chunked top-k the same from its ratio (not measured there)."""
    ratio = codec.options().get("ratio") if codec.name in SPARSE_CODECS else None
    return DENSE_GAMMA if ratio is None else min(MAX_TOPK_GAMMA, TOPK_GAMMA_PER_RATIO * float(ratio))


def anchor_digest(anchor: Tensors) -> str:
    """A short digest of the anchor's names and bytes: ends with different anchors never pair."""
    h = hashlib.sha256()
    for name in sorted(anchor):
        x = np.ascontiguousarray(anchor[name], dtype=np.float32)
        h.update(name.encode())
        h.update(len(x.shape).to_bytes(1, "big"))
        h.update(x.tobytes())
    return h.hexdigest()[:ANCHOR_DIGEST_CHARS]


def typical_meta(edge_count: int = 1000) -> dict[str, MetaValue]:
    """The meta of a CHOCO message mid-run (for `gossip.plan`'s exact message sizes)."""
    return {META_EDGE: edge_count, META_ANCHOR: "0" * ANCHOR_DIGEST_CHARS}


@dataclass(frozen=True)
class Outgoing:
    """What one exchange sends to one neighbour: `wire` goes to the codec (x - mine), `sent` is what the
    receiver will decode from it (Q(x - mine)), `count` the edge's completed exchanges it was built on."""

    peer: str
    wire: dict[str, np.ndarray]
    sent: dict[str, np.ndarray]
    count: int


@dataclass(frozen=True)
class ChocoStep:
    """A round's move: the node's new tensors, and the neighbours whose pull its own rule clipped."""

    tensors: dict[str, np.ndarray]
    clipped: tuple[str, ...] = ()


class _Edge:
    __slots__ = ("count", "mine", "theirs")

    def __init__(self, anchor: dict[str, np.ndarray]) -> None:
        # arrays are replaced, never modified in place, so a fresh edge shares the anchor's
        self.mine = dict(anchor)
        self.theirs = dict(anchor)
        self.count = 0


class ChocoState:
    """One node's per-edge estimates and the CHOCO update (see the module docstring).

    Not thread-safe: the exchange calls it from its event loop, and its numpy work is per tensor.
    """

    def __init__(self, settings: ChocoSettings, anchor: Tensors) -> None:
        self.settings = settings
        self._anchor = {name: np.ascontiguousarray(x, dtype=np.float32).reshape(-1) for name, x in anchor.items()}
        self._shapes = {name: np.shape(x) for name, x in anchor.items()}
        self.digest = anchor_digest(self._anchor)
        self._edges: collections.OrderedDict[str, _Edge] = collections.OrderedDict()
        self.resets = 0  # edges found out of step and restarted from the anchor

    @property
    def edges(self) -> tuple[str, ...]:
        """The neighbours whose estimates are kept, least recently used first."""
        return tuple(self._edges)

    def count(self, peer: str) -> int:
        edge = self._edges.get(peer)
        return 0 if edge is None else edge.count

    def meta(self, count: int) -> dict[str, MetaValue]:
        return {META_EDGE: count, META_ANCHOR: self.digest}

    def check(self, peer: str, meta: Mapping[str, MetaValue]) -> None:
        """Raise Desync unless `peer`'s message was built on the estimates this node holds for the edge."""
        anchor, count = meta.get(META_ANCHOR), meta.get(META_EDGE)
        if anchor != self.digest:
            raise Desync(f"anchor {anchor!r} differs from ours ({self.digest})")
        if type(count) is not int:
            raise Desync(f"no edge count in the message (got {count!r})")
        if count != self.count(peer):
            raise Desync(f"edge count {count} differs from ours ({self.count(peer)})")

    def prepare(self, peer: str, own: Tensors) -> Outgoing:
        """The message for `peer` from our round input `own`: the difference to the estimate `peer`
        holds of us, and what the codec makes of it."""
        edge = self._edge(peer)
        codec = self.settings.codec
        wire: dict[str, np.ndarray] = {}
        sent: dict[str, np.ndarray] = {}
        for name, x in own.items():
            diff = np.subtract(np.asarray(x, np.float32).reshape(-1), edge.mine[name], dtype=np.float32)
            wire[name] = diff.reshape(self._shapes[name])
            # the receiver decodes exactly this: encoding is deterministic, so both ends add the same bits
            sent[name] = codec.decode(codec.encode(diff), diff.size).reshape(-1)
        return Outgoing(peer, wire, sent, edge.count)

    def commit(self, outgoing: Outgoing, received: Tensors) -> None:
        """Both ends know the exchange completed: add what crossed to both estimates of the edge."""
        edge = self._edge(outgoing.peer)
        if edge.count != outgoing.count:
            raise RuntimeError(f"edge {outgoing.peer}: committed on count {outgoing.count}, now {edge.count}")
        edge.mine = {name: edge.mine[name] + q for name, q in outgoing.sent.items()}
        edge.theirs = {name: edge.theirs[name] + np.asarray(received[name], np.float32).reshape(-1)
                       for name in edge.theirs}
        edge.count += 1

    def reset(self, peer: str) -> None:
        """Restart the edge from the anchor (its other end does the same when it finds the mismatch)."""
        if self._edges.pop(peer, None) is not None:
            self.resets += 1

    def screen(self, peer: str, received: Tensors, limits: Mapping[str, float]) -> None:
        """Raise OutOfRange unless the differences `received` from `peer`, and the estimate of `peer` they
        would make, hold finite values within `limits` (the node's value bound, `gossip.robust.ValueBound`,
        relative to its own tensors). Changes nothing: a refused difference never reaches the estimate."""
        check_values(received, limits)
        edge = self._edges.get(peer)
        theirs = edge.theirs if edge is not None else self._anchor
        for name, q in received.items():  # one tensor's estimate at a time
            if name in theirs:
                check_values({name: theirs[name] + np.asarray(q, np.float32).reshape(-1)}, limits)

    def step(self, own: Tensors, weights: Mapping[str, float], mixer: Mixer | None = None,
             base: Tensors | None = None) -> ChocoStep:
        """x + gamma * sum_j w_j * s_j * (theirs_j - mine_j) over the edges in `weights` (those that completed
        this round): the move towards neighbour j's estimate from this node's own as the edge holds it.
        s_j in [0, 1] is the product of the swarm's rule (`clipped`: its tau per tensor; any other: 1) and
        of the node's own rule, `mixer` (its --mixing; see `Mixer.edge_scales`: centered clipping of the
        neighbour's estimate at the node's adaptive radius unless the node chose `weighted`); `base` is
        what the node's tensors were after the last round's mix (its own move feeds the radius)."""
        gamma, rule = self.settings.gamma, self.settings.rule
        peers = sorted(weights)
        flat = {name: np.asarray(x).reshape(-1) for name, x in own.items()}
        # ||theirs_j - mine_j|| block by block: no difference is held for more than one tensor at a time
        norms = {name: {peer: distance(self._edges[peer].theirs[name], self._edges[peer].mine[name])
                        for peer in peers} for name in flat}
        scales = {name: dict.fromkeys(peers, 1.0) for name in flat}
        if rule.kind is MixingKind.CLIPPED:
            assert rule.tau is not None  # MixingRule checks it
            scales = {name: {peer: clip_scale(n[peer], rule.tau) for peer in peers} for name, n in norms.items()}
        clipped: tuple[str, ...] = ()
        if mixer is not None and peers:
            own_scales, clipped = mixer.edge_scales(flat, norms, base)
            scales = {name: {peer: s[peer] * own_scales[name][peer] for peer in peers} for name, s in scales.items()}
        out: dict[str, np.ndarray] = {}
        for name, x in own.items():
            move = np.zeros(flat[name].shape, np.float64)
            for peer in peers:
                edge = self._edges[peer]
                diff = np.subtract(edge.theirs[name], edge.mine[name], dtype=np.float64)
                move += (weights[peer] * scales[name][peer]) * diff
            out[name] = (flat[name] + gamma * move).astype(flat[name].dtype).reshape(np.shape(x))
        return ChocoStep(out, clipped)

    def estimates(self, peers: Iterable[str]) -> dict[str, dict[str, np.ndarray]]:
        """Our estimate of each of `peers`' parameters, in the model's shapes (what contribution scoring
        measures a neighbour by). Views, not copies: a commit replaces an edge's arrays, never writes them."""
        return {peer: {name: x.reshape(self._shapes[name]) for name, x in self._edges[peer].theirs.items()}
                for peer in peers if peer in self._edges}

    def _edge(self, peer: str) -> _Edge:
        edge = self._edges.get(peer)
        if edge is None:
            edge = self._edges[peer] = _Edge(self._anchor)
            while len(self._edges) > self.settings.max_edges:
                self._edges.popitem(last=False)
        else:
            self._edges.move_to_end(peer)
        return edge

    def memory_bytes(self) -> int:
        """Bytes of the estimates this node holds beyond the anchor (what --gossip-compression costs)."""
        seen: set[int] = {id(x) for x in self._anchor.values()}
        total = 0
        for edge in self._edges.values():
            for x in (*edge.mine.values(), *edge.theirs.values()):
                if id(x) not in seen:
                    seen.add(id(x))
                    total += int(x.nbytes)
        return total
