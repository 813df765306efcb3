"""Which neighbours' records show progress, so that a round waits only for a laggard that is catching up
(docs/training.md, "Training in the daemon").

A round leaves out a neighbour whose record stopped changing while it fell beyond the staleness bound (it
would be skipped as stale or time out anyway), so a record at step 0 that never trains, or a frozen peer until
its record expires, never holds a round.

A record that does move can still be made to creep: rise one step a heartbeat, staying just beyond the lag
window, and hold every round of its neighbours for the whole wait. So each peer's waiting is paid from a
budget of its own (a token bucket of seconds, `WAIT_BUDGET_S` refilled over `WAIT_BUDGET_WINDOW_S`): once
it is spent, rounds go on without waiting for that peer until the bucket refills."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from topology import PeerRound


class ProgressRecord(Protocol):
    """What a peer record says of its progress (node.net.records.PeerRecord)."""

    @property
    def peer_id(self) -> str: ...

    @property
    def step(self) -> int: ...

    @property
    def round(self) -> int: ...

    @property
    def gossip_from(self) -> int: ...


# Seconds of round-holding one peer may cost this node at most, refilled evenly over WAIT_BUDGET_WINDOW_S (a
# token bucket). Three full laggard waits (node.swarm.loop.LAG_WAIT_S, 30 s): an honest peer is waited for
# only until it is back within the lag window — a joiner or a restarted node downloads the swarm's
# parameters and step (node.swarm.joining) within a wait or two, a node that started a moment after its
# neighbours catches up in a wait or a few — so an honest catch-up never runs out of it.
WAIT_BUDGET_S = 90.0
# ... over 15 minutes: a record creeping for ever costs each neighbour the first 90 s, then at most a tenth
# of its wall-clock time (90 s per 900 s); an honest peer slower than the swarm for good gets the same, the
# pace DiLoCo's laggard rule and the staleness bound then handle.
WAIT_BUDGET_WINDOW_S = 900.0
# The least budget worth a wait. The bucket refills continuously, so a budget charged to zero has refilled a
# few microseconds' worth by the time it is looked at again: without a floor, a spent budget would never
# stop a wait on a real clock (a creeping record held every round for the whole LAG_WAIT_S). 0.05 s is a
# half second's refill, a quarter of the wait loop's longest sleep.
MIN_WAIT_S = 0.05
# Peers whose budget is kept while not full (a peer that leaves the view keeps what it spent, so that
# dropping out of the view for a few heartbeats buys no fresh budget); beyond it the fullest are dropped.
WAIT_BUDGET_PEERS = 1024


@dataclass
class _Seen:
    step: int
    round: int
    changed_at: float  # when this node first saw the record's current (step, round)
    rose_at: float | None  # when this node last saw its step rise; None: never


class PeerProgress:
    """Per peer in view: its last (step, round) and when it changed. Kept only for peers in the latest
    view, so it is as bounded as the view."""

    def __init__(self, stalled_after_s: float, clock: Callable[[], float] = time.monotonic,
                 wait_budget_s: float = WAIT_BUDGET_S, wait_budget_window_s: float = WAIT_BUDGET_WINDOW_S) -> None:
        self.stalled_after_s = stalled_after_s
        self._clock = clock
        self._seen: dict[str, _Seen] = {}
        self._behind_since: dict[str, float] = {}  # peer -> since when it is seen beyond the staleness bound
        self.wait_budget_s = wait_budget_s
        self.wait_budget_window_s = wait_budget_window_s
        self._waits: dict[str, tuple[float, float]] = {}  # peer -> (budget left, when it was that); absent: full
        self._told: dict[str, float] = {}  # peer -> when its spent budget was last logged

    @property
    def now(self) -> float:
        return self._clock()

    def observe(self, view: Sequence[ProgressRecord]) -> None:
        now = self._clock()
        seen: dict[str, _Seen] = {}
        for record in view:
            last = self._seen.get(record.peer_id)
            if last is None:
                seen[record.peer_id] = _Seen(record.step, record.round, now, None)
            elif (last.step, last.round) != (record.step, record.round):
                rose = now if record.step > last.step else last.rose_at
                seen[record.peer_id] = _Seen(record.step, record.round, now, rose)
            else:
                seen[record.peer_id] = last
        self._seen = seen

    def stalled(self, peer: str) -> bool:
        """Its record has shown the same step and round for `stalled_after_s` (since this node first saw it)."""
        seen = self._seen.get(peer)
        return seen is not None and self._clock() - seen.changed_at >= self.stalled_after_s

    def note_behind(self, peers: set[str]) -> None:
        """`peers` are beyond the staleness bound now; every other peer is not."""
        now = self._clock()
        self._behind_since = {p: self._behind_since.get(p, now) for p in peers}

    def left_behind(self, peer: str) -> bool:
        """Beyond the staleness bound, and stalled, for `stalled_after_s` at least: no longer a record
        that lags its peer by a heartbeat (or a peer that just started gossiping)."""
        since = self._behind_since.get(peer)
        return since is not None and self._clock() - since >= self.stalled_after_s and self.stalled(peer)

    def progressing(self, peer: str) -> bool:
        """This node saw its step rise within the last `stalled_after_s`: worth waiting for."""
        seen = self._seen.get(peer)
        return seen is not None and seen.rose_at is not None and self._clock() - seen.rose_at < self.stalled_after_s

    def wait_left(self, peer: str) -> float:
        """Seconds a round may still be held for `peer` (its token bucket, refilled since it was charged)."""
        entry = self._waits.get(peer)
        if entry is None:
            return self.wait_budget_s
        left, at = entry
        refill = (self._clock() - at) * self.wait_budget_s / self.wait_budget_window_s
        return min(self.wait_budget_s, left + refill)

    def may_wait_for(self, peer: str) -> bool:
        return self.wait_left(peer) >= MIN_WAIT_S

    def charge_wait(self, peers: Iterable[str], seconds: float) -> None:
        """A round was held `seconds` for `peers` (each pays the whole time: waiting for two at once
        costs each of them what it would alone)."""
        now = self._clock()
        for peer in peers:
            self._waits[peer] = (max(0.0, self.wait_left(peer) - seconds), now)
        if len(self._waits) > WAIT_BUDGET_PEERS:
            full = [p for p in self._waits if self.wait_left(p) >= self.wait_budget_s]
            for p in full:
                del self._waits[p]
            for p in sorted(self._waits, key=self.wait_left, reverse=True)[:len(self._waits) - WAIT_BUDGET_PEERS]:
                del self._waits[p]
        self._told = {p: at for p, at in self._told.items() if now - at < self.wait_budget_window_s}

    def tell_wait_spent(self, peer: str) -> bool:
        """True once per peer and budget window: whether to log that its budget is spent."""
        now = self._clock()
        at = self._told.get(peer)
        if at is not None and now - at < self.wait_budget_window_s:
            return False
        self._told[peer] = now
        return True


def stalled_after(heartbeat_s: float, exchange_timeout_s: float) -> float:
    """How long an unchanged record counts as live progress: a live peer republishes every heartbeat."""
    return max(5 * heartbeat_s, exchange_timeout_s)


def leave_out_stalled(plan: PeerRound, view: Sequence[ProgressRecord], progress: PeerProgress, round_index: int,
                      max_staleness: int, record_lag_rounds: int | None = None) -> tuple[PeerRound, tuple[str, ...]]:
    """`plan` without the neighbours whose record has stayed more than `max_staleness` rounds behind
    `round_index`, unchanged, for `progress.stalled_after_s`, or (when rounds follow a clock) is further
    behind than a live peer's record can lag (`record_lag_rounds` more); and who they are. Their answer
    would be refused as stale, or never come. (A peer that announced a later first round than its
    record's counts from that round: before its first round, its record shows none.)"""
    position = {r.peer_id: max(r.round, r.gossip_from - 1) for r in view}
    behind = {p for p, at in position.items() if at + max_staleness < round_index}
    progress.note_behind(behind)
    neighbours = sorted(set(plan.in_weights) | set(plan.out_peers))
    gone = tuple(p for p in neighbours if p in behind and (
        progress.left_behind(p)
        or (record_lag_rounds is not None and position[p] + max_staleness + record_lag_rounds < round_index)))
    return plan.without(gone), gone


def record_lag_rounds(heartbeat_s: float, exchange_timeout_s: float, round_interval_s: float) -> int:
    """Rounds of a wall-clock schedule by which a live peer's record may trail it: a heartbeat until it is
    published, another until it is read, and a round that took its whole deadline."""
    return math.ceil((2 * heartbeat_s + exchange_timeout_s) / round_interval_s) + 1
