"""Which neighbours' records show progress, so that a round waits only for a laggard that is catching up
(docs/training.md, "Training in the daemon").

A round leaves out a neighbour whose record stopped changing while it fell beyond the staleness bound (it
would be skipped as stale or time out anyway), so a record at step 0 that never trains, or a frozen peer until
its record expires, never holds a round."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
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


@dataclass
class _Seen:
    step: int
    round: int
    changed_at: float  # when this node first saw the record's current (step, round)
    rose_at: float | None  # when this node last saw its step rise; None: never


class PeerProgress:
    """Per peer in view: its last (step, round) and when it changed. Kept only for peers in the latest
    view, so it is as bounded as the view."""

    def __init__(self, stalled_after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stalled_after_s = stalled_after_s
        self._clock = clock
        self._seen: dict[str, _Seen] = {}
        self._behind_since: dict[str, float] = {}  # peer -> since when it is seen beyond the staleness bound

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
