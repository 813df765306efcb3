"""The monitor's recent events and errors: a bounded log of what changed (peers joining and leaving,
error and skip counters growing, gossip starting) and of the node's own warnings."""

from __future__ import annotations

import collections
import itertools
import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

DEFAULT_CAPACITY = 200
LOGGER_PREFIXES = ("murmur", "node", "gossip")  # the node's own loggers; hivemind's chatter stays out


@dataclass(frozen=True)
class LogEntry:
    id: int  # increasing; a client asks for entries after the last id it saw
    t: float  # unix time
    level: str  # "info", "warning" or "error"
    kind: str  # peer_joined, peer_left, error, skipped, gossip_started, log
    message: str

    def as_json(self) -> dict[str, object]:
        return asdict(self)


class EventLog:
    """Thread-safe: the logging handler may append from worker threads."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._entries: collections.deque[LogEntry] = collections.deque(maxlen=capacity)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def add(self, t: float, level: str, kind: str, message: str) -> LogEntry:
        with self._lock:
            entry = LogEntry(next(self._ids), t, level, kind, message)
            self._entries.append(entry)
        return entry

    def entries(self, after: int = 0, limit: int | None = None) -> list[LogEntry]:
        with self._lock:
            chosen = [e for e in self._entries if e.id > after]
        return chosen[-limit:] if limit is not None else chosen


@dataclass(frozen=True)
class Snapshot:
    """What the change watcher compares between two ticks."""

    peers: frozenset[str]
    errors: Mapping[str, int]
    skipped: Mapping[str, int]
    gossip_from: int


def log_changes(log: EventLog, before: Snapshot | None, after: Snapshot, now: float) -> None:
    """Add an entry for each difference between two successive snapshots."""
    if before is None:
        return
    for peer in sorted(after.peers - before.peers):
        log.add(now, "info", "peer_joined", f"peer {peer} joined")
    for peer in sorted(before.peers - after.peers):
        log.add(now, "warning", "peer_left", f"peer {peer} left (withdrawn or its record expired)")
    for kind, grown in _growth(before.errors, after.errors):
        log.add(now, "error", "error", f"{kind}: {grown} more (total {after.errors[kind]})")
    for reason, grown in _growth(before.skipped, after.skipped):
        log.add(now, "warning", "skipped", f"neighbour skipped ({reason}): {grown} more (total {after.skipped[reason]})")
    if after.gossip_from and not before.gossip_from:
        log.add(now, "info", "gossip_started", f"announced gossip from round {after.gossip_from}")


def _growth(before: Mapping[str, int], after: Mapping[str, int]) -> Iterable[tuple[str, int]]:
    for kind in sorted(after):
        grown = after[kind] - before.get(kind, 0)
        if grown > 0:
            yield kind, grown


class LogCapture(logging.Handler):
    """Copies the node's warnings and errors into an EventLog (attached while the monitor runs)."""

    def __init__(self, log: EventLog, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self._log = log
        self.addFilter(lambda record: record.name.split(".")[0] in LOGGER_PREFIXES)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level = "error" if record.levelno >= logging.ERROR else "warning"
            self._log.add(record.created, level, "log", f"{record.name}: {record.getMessage()}")
        except Exception:
            self.handleError(record)
