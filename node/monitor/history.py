"""The monitor's time series: a bounded ring buffer of samples, one per sampling tick, fed by the
node's counters and by the trainer's `record()` calls in between."""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import numpy as np

DEFAULT_CAPACITY = 1800  # 30 minutes at one sample a second


@dataclass(frozen=True)
class Counters:
    """What the node's own counters say at one instant (read by the sampler and `/metrics`)."""

    step: int
    round: int
    bytes_sent: int
    bytes_received: int
    peers_alive: int
    peer_loss: Mapping[str, float] = field(default_factory=dict)  # other peers' last published loss
    # The latest training figures the node knows without record() (a trainer's own status), and in
    # vector mode its own consensus estimate (see MixingStepEstimate); what record() gave wins.
    loss: float | None = None
    val_loss: float | None = None
    tokens_per_s: float | None = None
    consensus_distance: float | None = None


@dataclass(frozen=True)
class Sample:
    """One point of every chart. Training figures are None while nothing was recorded in the interval."""

    t: float  # unix time
    step: int
    round: int
    loss: float | None  # mean training loss of the steps recorded in the interval
    val_loss: float | None  # the last validation loss recorded in the interval
    tokens_per_s: float | None
    bytes_sent: int  # cumulative
    bytes_received: int  # cumulative
    consensus_distance: float | None
    peers_alive: int
    peer_loss: Mapping[str, float]

    def as_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class TrainingFigures:
    """The latest values the trainer recorded (what `/api/status` shows between samples)."""

    step: int = 0
    loss: float | None = None
    val_loss: float | None = None
    consensus_distance: float | None = None
    tokens_per_s: float | None = None
    recorded: int = 0  # record() calls so far


def _finite_or_none(value: float | None, what: str) -> float | None:
    if value is None:
        return None
    value = float(value)
    if not math.isfinite(value):
        # a diverged loss is worth seeing, but JSON and the charts cannot carry it: it is dropped and counted
        raise ValueError(f"{what} is not finite: {value}")
    return value


class HistoryRecorder:
    """A bounded ring buffer of `Sample`s plus the trainer's figures for the interval being filled.

    `record()` may be called from the trainer's worker thread; `tick()` runs in the event loop.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 2:
            raise ValueError(f"a history holds at least 2 samples, got capacity={capacity}")
        self._samples: collections.deque[Sample] = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._losses: list[float] = []
        self._val_loss: float | None = None
        self._distance: float | None = None
        self._tokens = 0
        self._last_tick_t: float | None = None
        self._latest = TrainingFigures()
        self.rejected = 0  # record() calls with a non-finite value

    @property
    def capacity(self) -> int:
        return self._samples.maxlen or 0

    @property
    def latest(self) -> TrainingFigures:
        return self._latest

    def record(self, *, step: int, loss: float | None = None, val_loss: float | None = None,
               consensus_distance: float | None = None, tokens: int = 0) -> None:
        """The trainer's report after one step: its training loss, a validation loss when it evaluated,
        its consensus distance estimate when it has one, and the tokens the step consumed.

        Raises ValueError for a non-finite value (nothing of that call is kept; `rejected` counts it).
        """
        try:
            loss = _finite_or_none(loss, "loss")
            val_loss = _finite_or_none(val_loss, "val_loss")
            consensus_distance = _finite_or_none(consensus_distance, "consensus_distance")
        except ValueError:
            self.rejected += 1
            raise
        if tokens < 0:
            self.rejected += 1
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        with self._lock:
            if loss is not None:
                self._losses.append(loss)
            if val_loss is not None:
                self._val_loss = val_loss
            if consensus_distance is not None:
                self._distance = consensus_distance
            self._tokens += int(tokens)
            prev = self._latest
            self._latest = TrainingFigures(
                step=int(step),
                loss=loss if loss is not None else prev.loss,
                val_loss=val_loss if val_loss is not None else prev.val_loss,
                consensus_distance=consensus_distance if consensus_distance is not None else prev.consensus_distance,
                tokens_per_s=prev.tokens_per_s,
                recorded=prev.recorded + 1,
            )

    def tick(self, counters: Counters, now: float) -> Sample:
        """Close the current interval: append and return its sample."""
        with self._lock:
            losses, self._losses = self._losses, []
            val_loss, self._val_loss = self._val_loss, None
            distance, self._distance = self._distance, None
            tokens, self._tokens = self._tokens, 0
            trained = self._latest.recorded > 0
            elapsed = None if self._last_tick_t is None else now - self._last_tick_t
            self._last_tick_t = now
            tokens_per_s = tokens / elapsed if trained and elapsed and elapsed > 0 else counters.tokens_per_s
            if tokens_per_s is not None:
                self._latest = TrainingFigures(**{**asdict(self._latest), "tokens_per_s": tokens_per_s})
            step = max(counters.step, self._latest.step)
            # without record(), the node's latest loss is a point only when a step happened since the last sample
            stepped = not self._samples or step > self._samples[-1].step
        sample = Sample(
            t=now, step=step, round=counters.round,
            loss=float(np.mean(losses)) if losses else counters.loss if stepped and not trained else None,
            val_loss=val_loss if val_loss is not None or trained else counters.val_loss, tokens_per_s=tokens_per_s,
            bytes_sent=counters.bytes_sent, bytes_received=counters.bytes_received,
            consensus_distance=distance if distance is not None else counters.consensus_distance,
            peers_alive=counters.peers_alive, peer_loss=dict(counters.peer_loss),
        )
        self._samples.append(sample)
        return sample

    def samples(self, since: float | None = None, limit: int | None = None) -> list[Sample]:
        """Samples newer than `since` (unix time), the last `limit` of them, oldest first."""
        chosen = [s for s in list(self._samples) if since is None or s.t > since]
        return chosen[-limit:] if limit is not None else chosen


class MixingStepEstimate:
    """A node's own consensus-distance estimate while it trains nothing (vector mode): how far one
    round of mixing moved its vector, ||x_r - x_{r-1}|| per round. Mixing moves x_i by
    sum_j w_ij (x_j - x_i), so this falls to 0 exactly as the swarm reaches consensus."""

    def __init__(self) -> None:
        self._rounds_run = -1
        self._vector: np.ndarray | None = None
        self._value: float | None = None

    def update(self, rounds_run: int, vector: np.ndarray) -> float | None:
        """Idempotent between rounds: a new value only once `rounds_run` has grown."""
        if rounds_run != self._rounds_run:
            if self._vector is not None and self._vector.shape == vector.shape and rounds_run > self._rounds_run:
                moved = np.linalg.norm(vector.astype(np.float64) - self._vector.astype(np.float64))
                self._value = float(moved) / (rounds_run - self._rounds_run)
            self._rounds_run, self._vector = rounds_run, vector
        return self._value
