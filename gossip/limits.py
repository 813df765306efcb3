"""Bounds on what peers can make a node do: incoming streams, who may open one, how often a peer may pull,
and bounded per-peer bookkeeping.

Streams are capped per peer and in all. Pure bookkeeping without sockets: the transports consult
`IncomingGate` before they hand a stream to a protocol, and the protocols (`gossip.exchange`,
`gossip.spes.fetch`) consult the request limits once a header is read.

docs/threat-model.md ("Resource limits and the monitor") gives the figures and why.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Hashable
from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, Protocol, TypeVar

from gossip.transport import Stream, StreamHandler

logger = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class StreamRefusal(StrEnum):
    """Why an incoming stream was closed before a byte of it was read (IncomingGate.refused)."""

    PEER_STREAMS = "peer_streams"  # the peer already has `per_peer_streams` streams open to us
    TOTAL_STREAMS = "total_streams"  # `total_streams` incoming streams are open in all
    NOT_MEMBER = "not_member"  # the peer has no live record in our view


@dataclass(frozen=True)
class IncomingLimits:
    """What one peer, and all peers together, may ask of a node at once and over time."""

    # Streams open at once. A served protocol adds two to each (SPES serves one per owned expert, and a
    # co-owner exchanges every shared expert in the same sync), so the caps grow with what is served.
    per_peer_streams: int = 32
    total_streams: int = 256
    per_protocol_streams: int = 2
    # A peer's header must arrive this soon after its stream opens; the payload has the exchange deadline.
    header_timeout_s: float = 5.0
    # Streams from peers not in the view as last read, held at once while the view is read again (a
    # joiner's record can be newer than that read); beyond, refused at once: floods from ids without
    # records cannot hold the node's stream slots.
    unknown_streams: int = 16
    # Pulls of the current parameters outside any round (a joiner's download, the swarm-average
    # evaluation): a token bucket per peer. Each costs a whole model of upload.
    current_pulls_burst: int = 4
    current_pulls_per_s: float = 0.5
    # Those answers being sent at once, all askers together; beyond, a pull of the current parameters is
    # refused `uploading` at once and the asker takes the next donor: a home uplink serves two joiners at
    # half its rate each, not ten at a tenth, which their stall timeouts would cut.
    concurrent_uploads: int = 2
    # Answers to a pull of one round, per peer (a retry is allowed, a loop is not).
    round_pulls: int = 2
    # SPES: answers per peer for one expert at one version (a refresh fetches a changed copy once).
    fetches_per_version: int = 2
    # Per-peer bookkeeping entries kept at most; the least recently used are dropped first.
    tracked_peers: int = 1024

    def __post_init__(self) -> None:
        if min(self.per_peer_streams, self.total_streams, self.current_pulls_burst, self.round_pulls,
               self.fetches_per_version, self.tracked_peers, self.unknown_streams, self.concurrent_uploads) < 1:
            raise ValueError("every limit must be at least 1")
        if self.per_protocol_streams < 0 or self.header_timeout_s <= 0 or self.current_pulls_per_s <= 0:
            raise ValueError("per_protocol_streams must be >= 0, header_timeout_s and current_pulls_per_s > 0")


DEFAULT_INCOMING = IncomingLimits()


class Membership(Protocol):
    """Who may open streams to this node: the peers with a live record in its view."""

    def knows(self, peer: str) -> bool:
        """In the view as last read (no waiting)."""
        ...

    async def admits(self, peer: str) -> bool:
        """In the view, once a read of it that began after this call has ended (a joiner's record may
        be newer than the last read); within a bounded wait."""
        ...


class ThrottledLog:
    """One log line per reason and interval, saying how many were refused since the last line: a
    flood is visible in the log without filling it (the counters have every refusal)."""

    def __init__(self, log: logging.Logger, what: str, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log, self._what, self._interval_s, self._clock = log, what, interval_s, clock
        self._last: dict[str, float] = {}
        self._since: collections.Counter[str] = collections.Counter()

    def refused(self, reason: str, peer: str) -> None:
        self._since[reason] += 1
        now = self._clock()
        if now - self._last.get(reason, -math.inf) < self._interval_s:
            return
        n, self._since[reason] = self._since[reason], 0
        self._last[reason] = now
        more = f" ({n} since the last such line)" if n > 1 else ""
        self._log.warning("%s from %s refused: %s%s", self._what, peer, reason, more)


class IncomingGate:
    """Admission of incoming streams, shared by every protocol a node serves: at most
    `per_peer_streams` open from one peer and `total_streams` in all (each plus `per_protocol_streams`
    per served protocol), and only from members when a `Membership` is given. A refused stream is
    closed before a byte of it is read; refusals are counted in `refused` by `StreamRefusal`."""

    def __init__(self, limits: IncomingLimits = DEFAULT_INCOMING, membership: Membership | None = None) -> None:
        self.limits = limits
        self.membership = membership
        self.protocols = 0  # protocols served through this gate (the transports count them)
        self.refused: collections.Counter[str] = collections.Counter()
        self.admitted = 0
        self._open: collections.Counter[str] = collections.Counter()  # peer -> its open streams; 0s removed
        self._total = 0
        self._unknown = 0  # streams waiting for a read of the view (`unknown_streams`)
        self._log = ThrottledLog(logger, "incoming stream")

    @property
    def open_streams(self) -> int:
        return self._total

    @property
    def peer_cap(self) -> int:
        return self.limits.per_peer_streams + self.limits.per_protocol_streams * self.protocols

    @property
    def total_cap(self) -> int:
        return self.limits.total_streams + self.limits.per_protocol_streams * self.protocols * 4

    def try_open(self, peer: str) -> StreamRefusal | None:
        """Take a stream slot for `peer`, or say why not (counted). `close(peer)` gives it back."""
        refusal = None
        if self._open[peer] >= self.peer_cap:
            refusal = StreamRefusal.PEER_STREAMS
        elif self._total >= self.total_cap:
            refusal = StreamRefusal.TOTAL_STREAMS
        if refusal is not None:
            if not self._open[peer]:
                del self._open[peer]
            self._refuse(refusal, peer)
            return refusal
        self._open[peer] += 1
        self._total += 1
        return None

    def close(self, peer: str) -> None:
        self._open[peer] -= 1
        self._total -= 1
        if self._open[peer] <= 0:
            del self._open[peer]

    def _refuse(self, refusal: StreamRefusal, peer: str) -> None:
        self.refused[refusal] += 1
        self._log.refused(refusal, peer)

    def guard(self, handler: StreamHandler) -> StreamHandler:
        """`handler` behind this gate, for a transport's `serve`: a refused stream is returned unread
        (the transport then closes it) and counts one more served protocol toward the caps."""
        self.protocols += 1

        async def guarded(stream: Stream) -> None:
            async with self.admit(stream.remote_peer) as refusal:
                if refusal is None:
                    await handler(stream)

        return guarded

    @contextlib.asynccontextmanager
    async def admit(self, peer: str) -> AsyncIterator[StreamRefusal | None]:
        """`async with gate.admit(peer) as refusal:` serve the stream if `refusal` is None, else close
        it unread. The slot is held (and membership asked) for the whole block; a peer not in the
        view as last read waits for the next read in one of `unknown_streams` places, or is refused."""
        refusal = self.try_open(peer)
        if refusal is not None:
            yield refusal
            return
        try:
            if not await self._member(peer):
                refusal = StreamRefusal.NOT_MEMBER
                self._refuse(refusal, peer)
            else:
                self.admitted += 1
            yield refusal
        finally:
            self.close(peer)

    async def _member(self, peer: str) -> bool:
        membership = self.membership
        if membership is None or membership.knows(peer):
            return True
        if self._unknown >= self.limits.unknown_streams:
            return False
        self._unknown += 1
        try:
            return await membership.admits(peer)
        finally:
            self._unknown -= 1


class LruTable(Generic[K, V]):
    """A dict that keeps at most `capacity` entries, dropping the least recently used: per-peer
    bookkeeping that a flood of peer ids cannot grow."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._items: collections.OrderedDict[K, V] = collections.OrderedDict()

    def get(self, key: K) -> V | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def prune(self, keep: Callable[[K, V], bool]) -> None:
        for key in [k for k, v in self._items.items() if not keep(k, v)]:
            del self._items[key]

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items


class PeerBuckets:
    """A token bucket per peer (`burst` tokens, refilled at `rate_per_s`): `take(peer)` is False when
    the peer has asked too often. At most `capacity` peers are tracked; a dropped one starts full."""

    def __init__(self, rate_per_s: float, burst: int, capacity: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._rate, self._burst, self._clock = rate_per_s, float(burst), clock
        self._buckets: LruTable[str, tuple[float, float]] = LruTable(capacity)  # peer -> (tokens, at)

    def take(self, peer: str) -> bool:
        now = self._clock()
        tokens, at = self._buckets.get(peer) or (self._burst, now)
        tokens = min(self._burst, tokens + (now - at) * self._rate)
        allowed = tokens >= 1.0
        self._buckets.put(peer, (tokens - 1.0 if allowed else tokens, now))
        return allowed

    def __len__(self) -> int:
        return len(self._buckets)


class CountPerKey(Generic[K]):
    """How many times each key (e.g. (peer, round)) was answered, at most `limit` each; at most
    `capacity` keys are kept (least recently used dropped first), and `prune` drops old ones."""

    def __init__(self, limit: int, capacity: int) -> None:
        self.limit = limit
        self._counts: LruTable[K, int] = LruTable(capacity)

    def take(self, key: K) -> bool:
        n = self._counts.get(key) or 0
        if n >= self.limit:
            return False
        self._counts.put(key, n + 1)
        return True

    def prune(self, keep: Callable[[K], bool]) -> None:
        self._counts.prune(lambda key, _: keep(key))

    def __len__(self) -> int:
        return len(self._counts)
