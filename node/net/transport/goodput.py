"""Per-neighbour goodput: how fast the payload bytes of gossip streams arrive from each peer, for
`murmur status`, the monitor and `murmur doctor`.

A stream adds up the bytes of its large reads and the time from the end of its first read (a message
header: the other side has started answering) to the end of its last large read; when it closes, a
stream that read enough gives one sample, folded into the peer's moving average. Time spent inside
reads alone would not do: p2pd and the socket buffer megabytes ahead of the reader.
"""

from __future__ import annotations

import time
from collections import OrderedDict

LARGE_READ = 64 * 1024  # smaller reads (frame headers) measure latency more than rate
MIN_SAMPLE_BYTES = 1 << 20
_WEIGHT = 0.3  # of the newest sample in the moving average
_MAX_PEERS = 1024  # peers remembered, least recently measured dropped first


class GoodputMeter:
    """Goodput per peer in Mbit/s (received payload bytes over the time spent waiting for them)."""

    def __init__(self) -> None:
        self._mbit_s: OrderedDict[str, float] = OrderedDict()

    def add_sample(self, peer: str, nbytes: int, seconds: float) -> None:
        if nbytes < MIN_SAMPLE_BYTES or seconds <= 0:
            return
        rate = nbytes * 8 / seconds / 1e6
        old = self._mbit_s.pop(peer, None)
        self._mbit_s[peer] = rate if old is None else (1 - _WEIGHT) * old + _WEIGHT * rate
        while len(self._mbit_s) > _MAX_PEERS:
            self._mbit_s.popitem(last=False)

    def mbit_s(self, peer: str) -> float | None:
        return self._mbit_s.get(peer)


class StreamTiming:
    """One stream's large reads: their bytes, and the span from the first read's end to the last one's."""

    __slots__ = ("_first", "_last", "nbytes")

    def __init__(self) -> None:
        self.nbytes = 0
        self._first: float | None = None
        self._last = 0.0

    @property
    def seconds(self) -> float:
        return self._last - self._first if self._first is not None else 0.0

    def read(self, nbytes: int) -> None:
        now = time.perf_counter()
        if self._first is None:
            self._first = now
            return  # the bytes before the clock started are not in the span
        if nbytes >= LARGE_READ:
            self.nbytes += nbytes
            self._last = now
