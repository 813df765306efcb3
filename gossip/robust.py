"""What bounds a hostile neighbour's pull on a node: the adaptive clipping radius, the magnitude bound, and
`Mixer`, a node's mixing rule with the state it keeps across rounds.

The radius of centered clipping is per tensor, estimated from earlier rounds; a received tensor beyond the
magnitude bound is refused. `Mixer` is used by GossipPeer and the simulator.

docs/architecture.md ("Robust mixing") explains the choices; docs/threat-model.md what they bound.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from gossip.errors import OutOfRange
from gossip.mixing import MixingKind, MixingRule, clip_mix, clip_scale, distance, mix, scaled_mix

Tensors = Mapping[str, np.ndarray]


@dataclass(frozen=True)
class ClipSettings:
    """The adaptive radius of `MixingKind.ADAPTIVE_CLIP`, per tensor (see `AdaptiveRadius`)."""

    window: int = 32  # neighbour distances, and own moves, remembered per tensor
    spread_factor: float = 2.0  # tau = spread_factor x the lower median of recent neighbour distances ...
    step_factor: float = 1.0  # ... at least step_factor x the median of this node's own recent moves ...
    cap_factor: float = 4.0  # ... and at most cap_factor x that median, when the node moves at all
    history: int = 8  # a neighbour's recent distances, in radii, remembered (see `Standing`)
    tracked: int = 1024  # neighbours remembered at most; the one seen least recently is forgotten first

    def __post_init__(self) -> None:
        for name in ("window", "history", "tracked"):
            if getattr(self, name) < 1:
                raise ValueError(f"clip {name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("spread_factor", "step_factor", "cap_factor"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"clip {name} must be finite and > 0, got {value!r}")
        if self.cap_factor < self.step_factor:
            raise ValueError(f"clip cap_factor ({self.cap_factor}) must be >= step_factor ({self.step_factor})")


class AdaptiveRadius:
    """Per tensor, the radius a node clips a neighbour's difference to:

        tau = clamp(spread_factor * lower median of the last `window` neighbour distances ||x_j - x_i||,
                    low  = step_factor * median of the node's own last `window` moves between rounds,
                    high = cap_factor  * that median, when it is > 0)

    The neighbour distances track how far apart honest peers are, which shrinks as they reach
    consensus: an honest round is rarely clipped, a value far away (noise, a scaled or stale copy) moves
    the node by at most w * tau. A lower median needs hostile values in more than half of the window
    to grow tau; with one neighbour per round a hostile peer is one of several in-neighbours over a
    period. The node's own moves (x before this round minus the mix of the last one: its local
    training update) come from no peer, so they bound tau from both sides: from below, so that honest
    mixing never stalls (at the start every distance is 0), and from above, so that even a window
    full of hostile values moves the node at most a few of its own steps per round. A node that does
    not train (the vector payload) has no moves and relies on the distances alone. Before any
    history tau is 0: the first round mixes nothing in (every fresh node starts from the same seed).
    """

    def __init__(self, settings: ClipSettings | None = None) -> None:
        self.settings = settings or ClipSettings()
        window = self.settings.window
        self._distances: collections.defaultdict[str, collections.deque[float]] = collections.defaultdict(
            lambda: collections.deque(maxlen=window))
        self._moves: collections.defaultdict[str, collections.deque[float]] = collections.defaultdict(
            lambda: collections.deque(maxlen=window))

    def radius(self, name: str) -> float:
        s = self.settings
        distances = sorted(self._distances.get(name, ()))
        spread = s.spread_factor * distances[(len(distances) - 1) // 2] if distances else 0.0
        moves = sorted(self._moves.get(name, ()))
        moved = moves[len(moves) // 2] if moves else 0.0
        if moved > 0.0:
            return min(max(spread, s.step_factor * moved), s.cap_factor * moved)
        return spread if math.isfinite(spread) else 0.0

    def observe(self, name: str, distances: Iterable[float]) -> None:
        """Remember this round's neighbour distances of tensor `name` (after its radius was used)."""
        self._distances[name].extend(distances)

    def observe_move(self, name: str, moved: float) -> None:
        """Remember how far the node's own tensor `name` moved since the last round's mix."""
        if math.isfinite(moved):
            self._moves[name].append(moved)


class Standing:
    """How far each neighbour has recently been from this node, in radii: per encounter the ratio
    ||x_j - x_i|| / ||tau|| over all tensors, and per neighbour s = the lower median of its last
    `history` ratios. A neighbour's radius is tau / max(1, s)^2.

    Clipping alone bounds one round; a hostile peer that pulls the same way every time (replaying
    stale parameters, reversing its updates) still adds w * tau per encounter, which over many rounds
    outweighs training that moves in noisy steps. Honest neighbours sit within the radius (ratio about
    1/2, since tau is twice the median distance) and keep the full radius; a neighbour that is far
    round after round gets a radius shrunk by the square of how far it is, so its pull fades to
    tau^3 / distance^2 (a copy reversing its update at 3 radii pulls a ninth of the radius). It is never
    cut off: honest peers that drifted apart (a healed partition) still meet, the more slowly the
    further apart they are.
    """

    def __init__(self, history: int, tracked: int) -> None:
        self._history, self._tracked = history, tracked
        self._ratios: collections.OrderedDict[str, collections.deque[float]] = collections.OrderedDict()

    def record(self, peer: str, ratio: float) -> float:
        """Remember an encounter with `peer` at `ratio` radii; its standing after it."""
        ratios = self._ratios.get(peer)
        if ratios is None:
            ratios = self._ratios[peer] = collections.deque(maxlen=self._history)
            while len(self._ratios) > self._tracked:
                self._ratios.popitem(last=False)
        self._ratios.move_to_end(peer)
        ratios.append(ratio)
        return self.of(peer)

    def of(self, peer: str) -> float:
        """The lower median of the peer's recent ratios (1 for a peer not met yet)."""
        ratios = sorted(self._ratios.get(peer, ()))
        return ratios[(len(ratios) - 1) // 2] if ratios else 1.0

    def __len__(self) -> int:
        return len(self._ratios)


@dataclass(frozen=True)
class ValueBound:
    """A received tensor is refused (`OutOfRange`) when a value's magnitude exceeds

        min(absolute, max(floor, ratio * max |x| of the node's own tensor of that name)):

    a declared hard bound, and one relative to the node's own values (parameters never grow a
    hundredfold between neighbours in a round; `floor` leaves room for tensors near zero).
    """

    absolute: float = 1e4
    ratio: float = 100.0
    floor: float = 10.0

    def __post_init__(self) -> None:
        for name in ("absolute", "ratio", "floor"):
            value = getattr(self, name)
            if not (value > 0):
                raise ValueError(f"value bound {name} must be > 0, got {value!r}")

    def limit(self, own_max_abs: float) -> float:
        return min(self.absolute, max(self.floor, self.ratio * own_max_abs))

    def limits(self, own: Tensors) -> dict[str, float]:
        return {name: self.limit(max_abs(x)) for name, x in own.items()}


def max_abs(x: np.ndarray) -> float:
    """max |x| without an |x| temporary (inf for non-finite input)."""
    if x.size == 0:
        return 0.0
    return float(max(x.max(), -x.min()))


def check_values(tensors: Tensors, limits: Mapping[str, float]) -> None:
    """Raise OutOfRange naming the first tensor with a value beyond its limit."""
    for name, x in tensors.items():
        limit = limits.get(name)
        if limit is None:
            continue
        peak = max_abs(np.asarray(x).reshape(-1))
        if not peak <= limit:
            raise OutOfRange(f"tensor {name!r} holds a value of magnitude {peak:.4g}, beyond the bound {limit:.4g}")


@dataclass(frozen=True)
class MixOutcome:
    tensors: dict[str, np.ndarray]
    clipped: tuple[str, ...]  # neighbours whose difference was clipped in at least one tensor


@dataclass
class Mixer:
    """A node's mixing rule and what it remembers across rounds (the adaptive radius); one per GossipPeer."""

    rule: MixingRule = field(default_factory=MixingRule)
    clip: ClipSettings = field(default_factory=ClipSettings)
    bound: ValueBound = field(default_factory=ValueBound)

    def __post_init__(self) -> None:
        self.radius = AdaptiveRadius(self.clip)
        self.standing = Standing(self.clip.history, self.clip.tracked)

    def screen(self, own: Tensors, received: Mapping[str, Tensors]) -> dict[str, OutOfRange]:
        """The senders whose tensors break the value bound (relative to `own`), and why. CPU-bound:
        call in a thread from an event loop."""
        if not received:
            return {}
        limits = self.bound.limits(own)
        refused = {}
        for peer, tensors in received.items():
            try:
                check_values(tensors, limits)
            except OutOfRange as exc:
                refused[peer] = exc
        return refused

    def mix(self, own: Tensors, received: Mapping[str, Tensors], self_weight: float, weights: Mapping[str, float],
            base: Tensors | None = None) -> MixOutcome:
        """Mix every tensor of `own` with the received ones under the rule; `base` is what the node's
        tensors were after the previous round's mix (its own move is own - base; None: unknown).
        CPU-bound: call in a thread from an event loop."""
        kind = self.rule.kind
        if kind is MixingKind.ADAPTIVE_CLIP:
            return self._adaptive(own, received, self_weight, weights, base)
        clipped: set[str] = set()
        out: dict[str, np.ndarray] = {}
        for name, x in own.items():
            theirs = {peer: tensors[name] for peer, tensors in received.items()}
            if kind is MixingKind.CLIPPED:
                assert self.rule.tau is not None  # checked by MixingRule
                out[name], distances = clip_mix(x, theirs, self_weight, weights, self.rule.tau)
                clipped.update(peer for peer, d in distances.items() if d > self.rule.tau)
            else:
                out[name] = mix(x, theirs, self_weight, weights, self.rule)
        return MixOutcome(out, tuple(sorted(clipped)))

    def edge_scales(self, own: Tensors, distances: Mapping[str, Mapping[str, float]],
                    base: Tensors | None = None) -> tuple[dict[str, dict[str, float]], tuple[str, ...]]:
        """Per tensor and neighbour, the factor in [0, 1] the node's rule shrinks a neighbour's difference
        by, given its length `distances[name][peer]`; and the neighbours clipped in some tensor. For
        compressed gossip (gossip.choco), whose differences are per edge: `weighted` keeps every
        difference, `clipped` clips to its tau, and every other rule (`adaptive_clip`, and the whole-vector
        rules median, trimmed mean, variance-corrected, which have no per-edge form) clips at the adaptive
        radius shrunk by the neighbour's standing, as `mix` does for adaptive_clip."""
        kind = self.rule.kind
        peers = sorted({peer for d in distances.values() for peer in d})
        if kind is MixingKind.WEIGHTED:
            return {name: dict.fromkeys(peers, 1.0) for name in distances}, ()
        if kind is MixingKind.CLIPPED:
            tau = self.rule.tau
            assert tau is not None  # checked by MixingRule
            scales = {name: {peer: clip_scale(d[peer], tau) for peer in peers} for name, d in distances.items()}
        else:
            taus = {}
            for name, x in own.items():
                if base is not None and name in base:
                    self.radius.observe_move(name, distance(np.asarray(x).reshape(-1),
                                                            np.asarray(base[name]).reshape(-1)))
                taus[name] = self.radius.radius(name)
            shrink = self._shrink(peers, taus, distances)
            scales = {name: {peer: clip_scale(d[peer], taus[name] / shrink[peer]) for peer in peers}
                      for name, d in distances.items()}
            for name, d in distances.items():
                self.radius.observe(name, (d[peer] for peer in peers))
        clipped = tuple(peer for peer in peers if any(s[peer] < 1.0 for s in scales.values()))
        return scales, clipped

    def _shrink(self, peers: Iterable[str], taus: Mapping[str, float],
                distances: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
        """Each neighbour's radius divisor, max(1, standing)^2, recording this encounter's standing."""
        tau_norm = math.sqrt(sum(t * t for t in taus.values()))
        shrink = {}
        for peer in peers:
            if tau_norm > 0.0:
                far = math.sqrt(sum(d[peer] ** 2 for d in distances.values())) / tau_norm
                shrink[peer] = max(1.0, self.standing.record(peer, far)) ** 2
            else:  # no radius yet: nothing moves this round, and there is nothing to measure by
                shrink[peer] = max(1.0, self.standing.of(peer)) ** 2
        return shrink

    def _adaptive(self, own: Tensors, received: Mapping[str, Tensors], self_weight: float,
                  weights: Mapping[str, float], base: Tensors | None) -> MixOutcome:
        """Centered clipping, each tensor at its adaptive radius shrunk by each neighbour's standing."""
        peers = sorted(received)
        taus: dict[str, float] = {}
        distances: dict[str, dict[str, float]] = {}
        for name, x in own.items():
            if base is not None and name in base:
                self.radius.observe_move(name, distance(x, base[name]))
            taus[name] = self.radius.radius(name)
            distances[name] = {peer: distance(received[peer][name], x) for peer in peers}
        shrink = self._shrink(peers, taus, distances)
        clipped: set[str] = set()
        out: dict[str, np.ndarray] = {}
        for name, x in own.items():
            scales = {peer: clip_scale(distances[name][peer], taus[name] / shrink[peer]) for peer in peers}
            clipped.update(peer for peer, f in scales.items() if f < 1.0)
            out[name] = scaled_mix(x, {peer: received[peer][name] for peer in peers}, self_weight, weights, scales)
            self.radius.observe(name, (distances[name][peer] for peer in peers))
        return MixOutcome(out, tuple(sorted(clipped)))
