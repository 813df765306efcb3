"""Per-neighbour goodput: how fast the payload bytes of gossip streams arrive from each peer, for
`murmur status`, the monitor and `murmur doctor`.

A stream adds up the bytes of its large reads and the time spent waiting for them; when it closes, a
stream that read enough gives one sample, folded into the peer's moving average.
"""

from __future__ import annotations

import time
from collections import OrderedDict

LARGE_READ = 64 * 1024  # smaller reads (frame headers) measure latency more than rate
MIN_SAMPLE_BYTES = 256 * 1024
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
    """One stream's large reads: bytes and the seconds spent waiting for them."""

    __slots__ = ("nbytes", "seconds")

    def __init__(self) -> None:
        self.nbytes = 0
        self.seconds = 0.0

    def read(self, nbytes: int, started: float) -> None:
        if nbytes >= LARGE_READ:
            self.nbytes += nbytes
            self.seconds += time.perf_counter() - started
