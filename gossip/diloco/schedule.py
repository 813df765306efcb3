"""When gossip DiLoCo syncs: phases of H inner steps, and within a phase the staggered step at which each
fragment syncs.

The first `outer_warmup` phases ramp up to H (frequent syncs early); then H is constant, or grows as the learning rate decays by the quadratic synchronisation rule. A pure function
of the step count and the swarm's recipe, so every node (a joiner too) agrees on it without messages."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable

MAX_PHASE = 1_000_000  # QSR's H at a vanishing learning rate is capped here (floats stay finite)


def warmup_period(base: int, fragments: int, warmup: int, k: int) -> int:
    """H of phase k under the outer warm-up: ceil(base (k + 1) / (warmup + 1)) for k < warmup, at least
    `fragments` (each syncs at its own step) and at most base; base from phase `warmup` on."""
    if k >= warmup:
        return base
    return max(fragments, min(base, -(-base * (k + 1) // (warmup + 1))))


def qsr_period(base: int, alpha: float, lr: float) -> int:
    """The quadratic synchronisation rule (Gu et al., 2023): H = max(H_base, floor((alpha / lr)^2));
    alpha = 0 keeps H_base."""
    if alpha <= 0.0:
        return base
    if lr <= 0.0:
        return MAX_PHASE
    # + 1e-9: a learning rate that is 0.01 up to rounding gives (alpha / 0.01)^2, not one step less
    return int(min(MAX_PHASE, max(base, math.floor((alpha / lr) ** 2 + 1e-9))))


class SyncSchedule:
    """Phase k covers steps (b_k, b_{k+1}] of the step count c (steps done); b_0 = 0 and
    b_{k+1} = b_k + H_k, H_k = qsr_period(base, alpha, lr_at(b_k)) after the warm-up, `base`
    during it; the first `outer_warmup` phases are shorter (warmup_period). Fragment p of P syncs once per phase, when c = b_{k+1} - floor(p H_k / P): fragment
    0 at the end of the phase, the others staggered before it. Its k-th sync is gossip round k."""

    def __init__(self, base: int, fragments: int, lr_at: Callable[[int], float], *, qsr_alpha: float = 0.0,
                 warmup_steps: int = 0, outer_warmup: int = 0) -> None:
        if base < 1:
            raise ValueError(f"the sync period must be >= 1 step, got {base}")
        if not 1 <= fragments <= base:
            raise ValueError(f"{fragments} fragments cannot sync at distinct steps of a {base}-step phase; "
                             f"use at most {base} (--local-steps)")
        self.base = base
        self.fragments = fragments
        self.qsr_alpha = qsr_alpha
        self.warmup_steps = warmup_steps
        self.outer_warmup = outer_warmup
        self._lr_at = lr_at
        self._bounds = [0]  # b_0, b_1, ... as far as asked for

    def period_at(self, start: int, k: int) -> int:
        """H of phase k, which begins after `start` steps."""
        if k < self.outer_warmup:
            return warmup_period(self.base, self.fragments, self.outer_warmup, k)
        if start < self.warmup_steps:
            return self.base
        return qsr_period(self.base, self.qsr_alpha, self._lr_at(start))

    def _extend(self, count: int) -> None:
        while self._bounds[-1] < count:
            self._bounds.append(self._bounds[-1] + self.period_at(self._bounds[-1], len(self._bounds) - 1))

    def phase_of(self, count: int) -> tuple[int, int, int]:
        """(k, b_k, b_{k+1}) of the phase that holds step count `count` >= 1 (steps done)."""
        if count < 1:
            raise ValueError(f"a step count of at least 1 is in a phase, got {count}")
        self._extend(count)
        k = bisect.bisect_left(self._bounds, count) - 1
        return k, self._bounds[k], self._bounds[k + 1]

    def sync_point(self, fragment: int, k: int) -> int:
        """The step count at which `fragment` syncs in phase k."""
        self._extend(1)
        while len(self._bounds) <= k + 1:
            self._extend(self._bounds[-1] + 1)
        start, end = self._bounds[k], self._bounds[k + 1]
        return end - (fragment * (end - start)) // self.fragments

    def syncs_at(self, count: int) -> tuple[tuple[int, int], ...]:
        """The (fragment, round) pairs that sync once `count` steps are done; () for none."""
        k, _, _ = self.phase_of(count)
        return tuple((p, k) for p in range(self.fragments) if self.sync_point(p, k) == count)

    def last_sync(self, fragment: int, count: int) -> int:
        """The round of `fragment`'s latest sync at or before step count `count`; -1 for none."""
        if count < 1:
            return -1
        k, _, _ = self.phase_of(count)
        return k if self.sync_point(fragment, k) <= count else k - 1
