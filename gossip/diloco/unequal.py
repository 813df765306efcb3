"""Volunteers of unequal speed in gossip DiLoCo: how long a round waits for its neighbours (a grace window
learned from arrival times). How pseudo-gradients covering unequal numbers of tokens are weighted is the
mix's (gossip.mixing.token_weights)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

import numpy as np

# median + GRACE_K * MAD of the recent arrival delays: with a normal spread 3 MAD is about 2 standard
# deviations, so a neighbour that is merely unlucky is still waited for and a stalled one is not
GRACE_K = 3.0
GRACE_SAMPLES = 16  # the recent rounds the window is learned from (a volunteer's speed drifts)
GRACE_MIN_SAMPLES = 4  # fewer: nothing learned yet, wait the upper bound


# Wall-clock phases (DilocoConfig.phase_seconds): the budget a founder gives H steps of the swarm's fast
# nodes, over their compute alone: room for a step that runs slow (an evaluation's cache, a loaded host)
# without passing over the fast nodes' own steps.
PHASE_ROOM = 1.25


def phase_seconds_for(step_time_s: float, local_steps: int) -> float:
    """The --phase-seconds that fits `local_steps` steps of `step_time_s` each (a fast node's), with room."""
    return PHASE_ROOM * local_steps * step_time_s


def grace_window(delays: Iterable[float], *, k: float = GRACE_K, lo: float, hi: float) -> float:
    """median + k * MAD of `delays` (seconds), within [lo, hi]; hi without any delay. MAD is the median
    absolute deviation from the median, robust to the one straggler the window is there to cut."""
    if not 0.0 <= lo <= hi:
        raise ValueError(f"a grace window needs 0 <= lo <= hi, got {lo} and {hi}")
    values = np.array([d for d in delays if math.isfinite(d) and d >= 0.0], dtype=np.float64)
    if values.size == 0:
        return hi
    median = float(np.median(values))
    mad = float(np.median(np.abs(values - median)))
    return min(hi, max(lo, median + k * mad))


class ArrivalWindow:
    """The recent rounds' arrival delays (the time the last neighbour that came took to come) and the
    grace window they give the next round: `hi` until `min_samples` rounds are known. A round that cut
    a neighbour for its timeout says only that the delay was longer than the window (a censored sample):
    it records twice the window (at most `hi`, `record_cut`), so rounds that keep being cut, say because
    the link slowed down for good, back off towards the fixed wait instead of cutting every neighbour
    for ever, while one cut among many fast rounds moves the median little."""

    def __init__(self, *, lo: float, hi: float, k: float = GRACE_K, samples: int = GRACE_SAMPLES,
                 min_samples: int = GRACE_MIN_SAMPLES) -> None:
        grace_window((), k=k, lo=lo, hi=hi)  # checks the bounds
        self.lo, self.hi, self.k, self.min_samples = lo, hi, k, min_samples
        self._delays: deque[float] = deque(maxlen=samples)

    def record(self, delay_s: float) -> None:
        if math.isfinite(delay_s) and delay_s >= 0.0:
            self._delays.append(delay_s)

    def record_cut(self) -> None:
        """A round cut a neighbour after the current window."""
        self._delays.append(min(self.hi, 2.0 * self.window()))

    @property
    def delays(self) -> tuple[float, ...]:
        return tuple(self._delays)

    def window(self) -> float:
        """How long the next round waits for a neighbour, in seconds."""
        if len(self._delays) < self.min_samples:
            return self.hi
        return grace_window(self._delays, k=self.k, lo=self.lo, hi=self.hi)


__all__ = ["GRACE_K", "GRACE_MIN_SAMPLES", "GRACE_SAMPLES", "PHASE_ROOM", "ArrivalWindow", "grace_window",
           "phase_seconds_for"]
