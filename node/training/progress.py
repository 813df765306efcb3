"""Which neighbours' records show progress: a round waits only for a laggard that is seen catching up,
and leaves out a neighbour whose record stopped changing while it fell beyond the staleness bound
(it would be skipped as stale or time out anyway), so a record at step 0 that never trains, or a frozen
peer until its record expires, never holds a round (docs/training.md, "Training in the daemon").
"""

from __future__ import annotations

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

    def progressing(self, peer: str) -> bool:
        """This node saw its step rise within the last `stalled_after_s`: worth waiting for."""
        seen = self._seen.get(peer)
        return seen is not None and seen.rose_at is not None and self._clock() - seen.rose_at < self.stalled_after_s


def stalled_after(heartbeat_s: float, exchange_timeout_s: float) -> float:
    """How long an unchanged record counts as live progress: a live peer republishes every heartbeat."""
    return max(5 * heartbeat_s, exchange_timeout_s)


def leave_out_stalled(plan: PeerRound, view: Sequence[ProgressRecord], progress: PeerProgress, round_index: int,
                      max_staleness: int) -> tuple[PeerRound, tuple[str, ...]]:
    """`plan` without the neighbours whose record is stalled more than `max_staleness` rounds behind
    `round_index`, and who they are. Their answer would be refused as stale, or never come."""
    records = {r.peer_id: r for r in view}
    neighbours = sorted(set(plan.in_weights) | set(plan.out_peers))
    gone = tuple(p for p in neighbours if p in records and records[p].round + max_staleness < round_index
                 and progress.stalled(p))
    return plan.without(gone), gone
