"""One gossip round's mixing of flat parameter vectors: the weighted average, the robust rules and the
variance-corrected average (CORE).

The weighted average runs over the neighbours that arrived (missing neighbours' weight moves to the local
vector); the robust rules are centered clipping, the coordinate-wise median and the coordinate-wise trimmed
mean. The adaptive clipping radius, which needs state across rounds, is `gossip.robust`.

Inputs are assumed finite (the wire layer rejects non-finite frames before they get here).
Vectors are processed in cache-sized blocks, so a call allocates the result plus O(block * vectors)
scratch, never a full-length temporary per neighbour.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np


class MixingKind(enum.StrEnum):
    """The mixing rules by the name configs, swarm documents and reports use."""

    WEIGHTED = "weighted"
    ADAPTIVE_CLIP = "adaptive_clip"  # centered clipping, radius from earlier rounds (gossip.robust.Mixer)
    CLIPPED = "clipped"
    MEDIAN = "median"
    TRIMMED_MEAN = "trimmed_mean"
    VARIANCE_CORRECTED = "variance_corrected"  # CORE: the weighted average, rescaled to the members' variance


MIXING_KINDS: tuple[str, ...] = tuple(kind.value for kind in MixingKind)

# Weights come from float arithmetic elsewhere (Metropolis-Hastings, 1/degree): accept that rounding.
WEIGHT_SUM_TOLERANCE = 1e-6

# variance_corrected never scales by more than this times what uncorrelated members need
VARIANCE_SCALE_LIMIT = 2.0

# Elements per block: 64 Ki float32 is 256 KiB, so a few scratch rows stay in L2.
_BLOCK = 1 << 16


@dataclass(frozen=True)
class MixingRule:
    """How a round combines the local vector with the received ones.

    - ``weighted``: sum_j w_ij x_j over the arrived neighbours and self.
    - ``adaptive_clip``: ``clipped`` with a radius per tensor that `gossip.robust.Mixer` estimates from
      earlier rounds (the node's default; `mix` alone cannot apply it, it has no memory).
    - ``clipped``: x_i + sum_j w_ij * clip(x_j - x_i, tau), clip(v, tau) = v * min(1, tau / ||v||_2).
    - ``median``: coordinate-wise median of {x_i} and the received vectors (weights only decide
      who may send; they do not weight the median).
    - ``variance_corrected`` (CORE, for members that started from different initialisations): the
      weighted average a, then a <- mean(a) + (a - mean(a)) * sqrt(s2 / var(a)) per tensor, where s2 =
      sum_j w_j var(x_j) is the weighted mean of the members' variances (mean and variance over a tensor's
      elements). Averaging uncorrelated tensors shrinks their variance by sum_j w_j^2; this restores it.
      The scale is at least 1 (var(a) <= s2) and at most VARIANCE_SCALE_LIMIT times what uncorrelated
      members need (sqrt(s2 / sum_j w_j^2 var(x_j))), which members that nearly cancel would exceed;
      members that agree are left as the plain average. Not a robust rule: a hostile member's variance
      enters s2 (use it in swarms whose members are trusted).
    - ``trimmed_mean``: per coordinate, drop the floor(trim * m) smallest and largest of the m values
      ({x_i} and the received vectors) and average the rest, unweighted. With few vectors
      floor(trim * m) is 0 and this is the plain mean: e.g. trim=0.2 needs m >= 5 to drop anything,
      so a Byzantine neighbour then goes through. Since trim < 0.5, at least one value always remains.

    Fields that do not apply to ``kind`` (tau for non-clipped rules, trim for non-trimmed ones) are
    ignored, so one config object can carry all of them.
    """

    kind: MixingKind = MixingKind.WEIGHTED
    tau: float | None = None
    trim: float = 0.2

    def __post_init__(self) -> None:
        if self.kind not in MIXING_KINDS:
            raise ValueError(f"unknown mixing kind {self.kind!r}; expected one of {MIXING_KINDS}")
        # configs and swarm documents pass the plain name: store the member
        object.__setattr__(self, "kind", MixingKind(self.kind))
        if self.tau is not None and not self.tau > 0:
            raise ValueError(f"clipping radius tau must be > 0, got {self.tau!r}")
        if self.kind is MixingKind.CLIPPED and self.tau is None:
            raise ValueError("mixing kind 'clipped' needs a clipping radius tau")
        if not 0.0 <= self.trim < 0.5:
            raise ValueError(f"trim fraction must be in [0, 0.5), got {self.trim!r}")


def effective_weights(
    self_weight: float,
    neighbour_weights: Mapping[str, float],
    arrived: Collection[str],
) -> tuple[float, dict[str, float]]:
    """The round's weights restricted to the neighbours in `arrived`, missing ones moved onto self.

    Returns (self weight, {neighbour id: weight} for arrived neighbours only). Weights are validated
    (finite, >= 0, sum 1 within WEIGHT_SUM_TOLERANCE) and divided by their sum, so the result is an
    exact convex combination even when the inputs carry rounding error.
    Raises ValueError for invalid weights or an arrived id that is not a neighbour.
    """
    if isinstance(arrived, str):
        raise TypeError("arrived must be a collection of peer ids, not a single string")
    total = _checked_weight_sum(self_weight, neighbour_weights)
    arrived_ids = set(arrived)
    unknown = sorted(arrived_ids - neighbour_weights.keys())
    if unknown:
        raise ValueError(f"received vectors from peers that are not neighbours this round: {unknown}")
    kept = {peer: float(w) / total for peer, w in neighbour_weights.items() if peer in arrived_ids}
    missing = math.fsum(float(w) for peer, w in neighbour_weights.items() if peer not in arrived_ids)
    return (float(self_weight) + missing) / total, kept


def token_weights(self_weight: float, in_weights: Mapping[str, float], tokens: Mapping[str, float],
                  own_tokens: float) -> tuple[float, dict[str, float]]:
    """A round's mixing weights with each pseudo-gradient weighted by the tokens it covers: w'_ij =
    w_ij t_j / sum_k w_ik t_k over self and the neighbours in `in_weights` (all of whose tokens must be
    known). Equal tokens give the weights back; with exact averaging (w = 1/n) the mix is the
    token-weighted mean sum_j t_j Δ_j / sum_j t_j, the data-parallel gradient of the tokens trained."""
    if own_tokens < 0 or any(not t >= 0 for t in tokens.values()):
        raise ValueError("tokens covered must be >= 0")
    total = self_weight * own_tokens + math.fsum(w * tokens[p] for p, w in in_weights.items())
    if total <= 0.0:  # nobody trained: the plain weights
        return self_weight, dict(in_weights)
    return self_weight * own_tokens / total, {p: w * tokens[p] / total for p, w in in_weights.items()}


def mix(
    own: np.ndarray,
    received: Mapping[str, np.ndarray],
    self_weight: float,
    neighbour_weights: Mapping[str, float],
    rule: MixingRule = MixingRule(),
) -> np.ndarray:
    """Mix the local vector `own` with the `received` neighbour vectors under `rule`.

    `received` may hold any subset of the neighbours in `neighbour_weights`. Returns a new array of
    own's shape and dtype; the inputs are not modified. Raises ValueError for invalid weights, a
    sender that is not a neighbour, or vectors whose shape or dtype differ from `own`.
    """
    if rule.kind is MixingKind.ADAPTIVE_CLIP:
        raise ValueError("the adaptive_clip rule keeps a radius across rounds: mix with gossip.robust.Mixer")
    if rule.kind is MixingKind.CLIPPED:
        assert rule.tau is not None  # checked by MixingRule
        return clip_mix(own, received, self_weight, neighbour_weights, rule.tau)[0]
    self_w, weights = effective_weights(self_weight, neighbour_weights, received.keys())
    _check_vectors(own, received)
    # A fixed summation order makes the result independent of the order in which peers arrived,
    # so peers holding the same inputs compute bit-identical outputs.
    senders = sorted(received)
    vectors = [received[peer] for peer in senders]
    if not vectors:
        return own.copy()
    if rule.kind is MixingKind.WEIGHTED:
        return _weighted_sum(own, self_w, [weights[peer] for peer in senders], vectors)
    if rule.kind is MixingKind.VARIANCE_CORRECTED:
        member_weights = [weights[peer] for peer in senders]
        out = _weighted_sum(own, self_w, member_weights, vectors)
        correct_variance(out, [own, *vectors], [self_w, *member_weights])
        return out
    m = len(vectors) + 1
    if rule.kind is MixingKind.MEDIAN:
        return _trimmed_mean(own, vectors, (m - 1) // 2)
    # The epsilon keeps e.g. trim * m = 0.29999999999999998 * 10 from flooring to 2.
    return _trimmed_mean(own, vectors, math.floor(rule.trim * m + 1e-9))


def clip_mix(
    own: np.ndarray,
    received: Mapping[str, np.ndarray],
    self_weight: float,
    neighbour_weights: Mapping[str, float],
    tau: float,
) -> tuple[np.ndarray, dict[str, float]]:
    """Centered clipping: own + sum_j w_j * clip(x_j - own, tau), and each sender's distance ||x_j - own||_2.

    tau = 0 keeps `own` (no neighbour can move it). Checks as `mix`; the weights of missing
    neighbours stay on `own`.
    """
    if not (math.isfinite(tau) and tau >= 0):
        raise ValueError(f"clipping radius tau must be finite and >= 0, got {tau!r}")
    _check_vectors(own, received)
    norms = {peer: distance(vector, own) for peer, vector in received.items()}
    scales = {peer: clip_scale(norm, tau) for peer, norm in norms.items()}
    return scaled_mix(own, received, self_weight, neighbour_weights, scales), norms


def scaled_mix(
    own: np.ndarray,
    received: Mapping[str, np.ndarray],
    self_weight: float,
    neighbour_weights: Mapping[str, float],
    scales: Mapping[str, float],
) -> np.ndarray:
    """own + sum_j w_j * scales[j] * (x_j - own): each difference shrunk by its own factor in [0, 1]
    (`clip_scale` of a radius). Checks as `mix`; the weights of missing neighbours stay on `own`."""
    _, weights = effective_weights(self_weight, neighbour_weights, received.keys())
    _check_vectors(own, received)
    bad = {peer: f for peer, f in scales.items() if not 0.0 <= f <= 1.0}
    if bad or received.keys() - scales.keys():
        raise ValueError(f"every sender needs a scale in [0, 1]; got {bad or 'none for some'}")
    senders = sorted(received)
    return _clipped(own, [weights[p] for p in senders], [received[p] for p in senders], [scales[p] for p in senders])


def distance(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b||_2 of two flat vectors of one shape, block by block (no full-length temporary); inf if
    the squared sum overflows."""
    n = a.shape[0]
    if n == 0:
        return 0.0
    scratch = np.empty(min(_BLOCK, n), _accumulator_dtype(a.dtype))
    squared = 0.0
    for start in _blocks(n):
        stop = min(start + _BLOCK, n)
        diff = scratch[: stop - start]
        np.subtract(a[start:stop], b[start:stop], out=diff)
        squared += _squared_norm(diff)
    return math.sqrt(squared) if math.isfinite(squared) else math.inf


def coordinate_median(vectors: Sequence[np.ndarray]) -> np.ndarray:
    """The coordinate-wise median of an odd number of flat vectors of one shape and dtype (a new array)."""
    if not vectors or len(vectors) % 2 == 0:
        raise ValueError(f"a coordinate-wise median needs an odd number of vectors, got {len(vectors)}")
    first, rest = vectors[0], list(vectors[1:])
    _check_vectors(first, {str(i): v for i, v in enumerate(rest)})
    return _trimmed_mean(first, rest, len(rest) // 2) if rest else first.copy()


def _checked_weight_sum(self_weight: float, neighbour_weights: Mapping[str, float]) -> float:
    named = [("self", self_weight), *((f"neighbour {peer!r}", w) for peer, w in neighbour_weights.items())]
    for name, weight in named:
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"weight of {name} is {weight!r}; weights must be finite and >= 0")
    total = math.fsum(float(w) for _, w in named)
    if abs(total - 1.0) > WEIGHT_SUM_TOLERANCE:
        raise ValueError(f"weights sum to {total!r}, not 1 (tolerance {WEIGHT_SUM_TOLERANCE})")
    return total


def _check_vectors(own: np.ndarray, received: Mapping[str, np.ndarray]) -> None:
    if not isinstance(own, np.ndarray) or own.ndim != 1 or not np.issubdtype(own.dtype, np.floating):
        raise ValueError(
            f"own vector must be a 1-D floating numpy array, got {type(own).__name__} "
            f"with shape {getattr(own, 'shape', None)} and dtype {getattr(own, 'dtype', None)}"
        )
    for peer, vector in received.items():
        if not isinstance(vector, np.ndarray):
            raise ValueError(f"vector from {peer!r} is a {type(vector).__name__}, not a numpy array")
        if vector.shape != own.shape:
            raise ValueError(f"vector from {peer!r} has shape {vector.shape}, expected {own.shape}")
        if vector.dtype != own.dtype:
            raise ValueError(f"vector from {peer!r} has dtype {vector.dtype}, expected {own.dtype}")


def _accumulator_dtype(dtype: np.dtype, weights: Sequence[float] = ()) -> np.dtype:
    """The precision a weighted sum runs in.

    Sums run in float64 and round once when a weight is not exactly a value of the vectors' dtype:
    in float32 the weights themselves would round (1/3 -> 1/3 + 1e-8), and a ring would then grow
    every vector by ~3e-8 per round, which moves the swarm's average. Weights a float32 holds exactly
    (the 1/2 of every pairwise schedule, 1/4, ...) sum to 1 exactly, so float32 sums only add
    unbiased rounding of half an ulp per addition, and run twice as fast.
    """
    if dtype == np.float32 and weights and all(float(np.float32(w)) == w for w in weights):
        return np.dtype(np.float32)
    return np.promote_types(dtype, np.float64)


def _blocks(n: int) -> range:
    return range(0, n, _BLOCK)


def _squared_norm(scratch: np.ndarray) -> float:
    """The sum of squares of a scratch block, squared in place. Not np.dot: numpy's BLAS threads a dot of
    this length over every core and leaves its threads spinning after it, which on a node that trains
    beside its neighbours' processes cost more CPU than the training (docs/benchmarks.md)."""
    return float(np.square(scratch, out=scratch).sum())


def weighted_sum_into(
    out: np.ndarray, own: np.ndarray, self_w: float, weights: Sequence[float], vectors: Sequence[np.ndarray]
) -> None:
    """out[:] = self_w * own + sum_k weights[k] * vectors[k], block by block.

    Elementwise, so any split of a vector into spans gives the same bits as one call over all of it:
    a receiver may mix a tensor span by span as it arrives. `weights` are effective weights (see
    `effective_weights`); `out` must not overlap the inputs.
    """
    n = own.shape[0]
    if n == 0:
        return
    acc_dtype = _accumulator_dtype(own.dtype, (self_w, *weights))
    scratch = np.empty(min(_BLOCK, n), acc_dtype)
    acc_buffer = None if acc_dtype == own.dtype else np.empty(min(_BLOCK, n), acc_dtype)
    typed = [acc_dtype.type(w) for w in weights]  # exact: either float64, or float32 weights it holds
    for start in _blocks(n):
        stop = min(start + _BLOCK, n)
        target = out[start:stop]
        acc = target if acc_buffer is None else acc_buffer[: stop - start]
        term = scratch[: stop - start]
        # dtype= makes numpy multiply in the accumulator's precision: with a Python float and a float32
        # array it would round the weight to float32 first
        np.multiply(own[start:stop], acc_dtype.type(self_w), out=acc, dtype=acc.dtype)
        for weight, vector in zip(typed, vectors):
            if weight == 0.0:
                continue
            np.multiply(vector[start:stop], weight, out=term, dtype=term.dtype)
            np.add(acc, term, out=acc)
        if acc_buffer is not None:
            np.copyto(target, acc, casting="same_kind")


def _weighted_sum(own: np.ndarray, self_w: float, weights: Sequence[float], vectors: Sequence[np.ndarray]) -> np.ndarray:
    """self_w * own + sum_k weights[k] * vectors[k] into one new output buffer."""
    out = np.empty(own.shape, own.dtype)
    weighted_sum_into(out, own, self_w, weights, vectors)
    return out


class IncrementalMix:
    """The weighted mix of the local tensors with one neighbour's, computed span by span as the
    neighbour's values arrive, so that mixing overlaps the transfer instead of following it.

    Feed `add` as the wire decoder's `on_values` sink. Since `weighted_sum_into` is elementwise, the
    result has the bits `mix` would give for the same inputs. `result()` is None unless every element
    of every local tensor arrived exactly once and in order; then a caller mixes the usual way (or
    not at all: a neighbour whose message failed is not mixed).
    """

    def __init__(self, own: Mapping[str, np.ndarray], self_weight: float, weight: float) -> None:
        self._own = {name: x.reshape(-1) for name, x in own.items()}
        self._shapes = {name: x.shape for name, x in own.items()}
        self._self_weight, self._weight = self_weight, weight
        self._out: dict[str, np.ndarray] = {}  # allocated when a tensor's first values arrive
        self._next = dict.fromkeys(self._own, 0)  # per tensor, the index the next values must start at
        self._spoiled = False

    def add(self, name: str, start: int, values: np.ndarray) -> None:
        """Mix values[k] into element start + k of tensor `name`; anything unexpected spoils the mix."""
        own = self._own.get(name)
        if (self._spoiled or own is None or values.dtype != own.dtype or values.ndim != 1
                or start != self._next[name] or start + values.size > own.size):
            self._spoiled = True
            return
        out = self._out.get(name)
        if out is None:
            out = self._out[name] = np.empty_like(own)
        stop = start + values.size
        weighted_sum_into(out[start:stop], own[start:stop], self._self_weight, [self._weight], [values])
        self._next[name] = stop

    def result(self) -> dict[str, np.ndarray] | None:
        """The mixed tensors, in the local shapes, once complete; else None."""
        if self._spoiled or any(self._next[name] != x.size for name, x in self._own.items()):
            return None
        # a tensor without values is one of no elements
        return {name: (self._out[name] if name in self._out else x.copy()).reshape(self._shapes[name])
                for name, x in self._own.items()}


def mean_and_variance(x: np.ndarray) -> tuple[float, float]:
    """Mean and (population) variance of a vector's elements, in float64, two passes over blocks."""
    n = x.shape[0]
    if n == 0:
        return 0.0, 0.0
    total = math.fsum(float(np.sum(x[start:start + _BLOCK], dtype=np.float64)) for start in _blocks(n))
    mean = total / n
    scratch = np.empty(min(_BLOCK, n), np.float64)
    squares = 0.0
    for start in _blocks(n):
        block = scratch[: min(_BLOCK, n - start)]
        np.subtract(x[start:start + block.size], mean, out=block, dtype=np.float64)
        squares += _squared_norm(block)
    return mean, squares / n


def correct_variance(average: np.ndarray, members: Sequence[np.ndarray], weights: Sequence[float]) -> float:
    """Rescale `average` (the weighted mean of `members`) in place about its mean so that its variance is
    the weighted mean of the members' (see MixingRule's ``variance_corrected``); returns the scale used."""
    variances = [mean_and_variance(x)[1] for x in members]
    target = math.fsum(w * v for w, v in zip(weights, variances))
    mean, variance = mean_and_variance(average)
    if not (variance > 0 and target > 0):  # constant tensors (a norm's gain at init): nothing to restore
        return 1.0
    # what uncorrelated members need; members that nearly cancel (anti-correlated) would ask for far more
    uncorrelated = math.sqrt(target / math.fsum(w * w * v for w, v in zip(weights, variances)))
    scale = min(max(1.0, math.sqrt(target / variance)), VARIANCE_SCALE_LIMIT * uncorrelated)
    if scale == 1.0:
        return scale
    for start in _blocks(average.shape[0]):
        block = average[start:start + _BLOCK]
        block -= block.dtype.type(mean)
        block *= block.dtype.type(scale)
        block += block.dtype.type(mean)
    return scale


def _clipped(own: np.ndarray, weights: Sequence[float], vectors: Sequence[np.ndarray],
             scales: Sequence[float]) -> np.ndarray:
    """own + sum_k weights[k] * scales[k] * (vectors[k] - own), where scales[k] = min(1, tau / ||vectors[k] - own||)."""
    n = own.shape[0]
    acc_dtype = _accumulator_dtype(own.dtype)
    scratch = np.empty(min(_BLOCK, n), acc_dtype)
    moves = [w * s for w, s in zip(weights, scales)]

    out = np.empty(own.shape, own.dtype)
    acc_buffer = None if acc_dtype == own.dtype else np.empty(min(_BLOCK, n), acc_dtype)
    for start in _blocks(n):
        stop = min(start + _BLOCK, n)
        target = out[start:stop]
        acc = target if acc_buffer is None else acc_buffer[: stop - start]
        diff = scratch[: stop - start]
        np.copyto(acc, own[start:stop])
        for move, vector in zip(moves, vectors):
            if move == 0.0:
                continue
            np.subtract(vector[start:stop], own[start:stop], out=diff)
            np.multiply(diff, move, out=diff)
            np.add(acc, diff, out=acc)
        if acc_buffer is not None:
            np.copyto(target, acc, casting="same_kind")
    return out


def clip_scale(norm: float, tau: float) -> float:
    """min(1, tau / norm), the factor that shrinks a difference of length `norm` into radius tau."""
    if not math.isfinite(norm):
        # The squared norm overflowed: the vector is astronomically far and its clipped move is ~0.
        return 0.0
    return 1.0 if norm <= tau else tau / norm


def _trimmed_mean(own: np.ndarray, vectors: Sequence[np.ndarray], k: int) -> np.ndarray:
    """Per coordinate, the mean of {own} U vectors without the k smallest and k largest values.

    Uses k passes of a bubble network (elementwise minimum/maximum over whole rows) instead of
    np.sort along the stacking axis, which costs far more for the handful of vectors a round has.
    """
    n = own.shape[0]
    m = len(vectors) + 1
    assert 0 <= 2 * k < m
    acc_dtype = _accumulator_dtype(own.dtype)
    buffers = [np.empty(min(_BLOCK, n), acc_dtype) for _ in range(m + 1)]
    out = np.empty(own.shape, own.dtype)
    for start in _blocks(n):
        stop = min(start + _BLOCK, n)
        rows = [buffer[: stop - start] for buffer in buffers[:m]]
        spare = buffers[m][: stop - start]
        for row, vector in zip(rows, (own, *vectors)):
            np.copyto(row, vector[start:stop])
        low, high = 0, m
        for _ in range(k):
            # Bubble the largest remaining value of each coordinate up to row high-1 ...
            for i in range(low, high - 1):
                np.minimum(rows[i], rows[i + 1], out=spare)
                np.maximum(rows[i], rows[i + 1], out=rows[i + 1])
                rows[i], spare = spare, rows[i]
            high -= 1
            # ... and the smallest down to row low; rows swap by reference, so no copies.
            for i in range(high - 1, low, -1):
                np.maximum(rows[i - 1], rows[i], out=spare)
                np.minimum(rows[i - 1], rows[i], out=rows[i - 1])
                rows[i], spare = spare, rows[i]
            low += 1
        acc = rows[low]
        for i in range(low + 1, high):
            np.add(acc, rows[i], out=acc)
        np.divide(acc, high - low, out=acc)
        np.copyto(out[start:stop], acc, casting="same_kind")
    return out
