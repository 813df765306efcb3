"""Dialling the peers of the view in the background, off the round path.

A background task gives the data plane the addresses of each new peer (or of one whose record names new
addresses), a few dials at a time, each bounded by a timeout; a failed dial is retried after an exponential
backoff; addresses the routability rule refuses (node.net.reach) are never dialled. Rounds never wait for a
dial: an exchange with a peer not dialled yet fails within its own deadline, like one with a dead peer."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from node.net.reach import dialable_maddrs

logger = logging.getLogger(__name__)


class Dialable(Protocol):
    """A peer as its record names it."""

    @property
    def peer_id(self) -> str: ...

    @property
    def maddrs(self) -> tuple[str, ...]: ...


class Connector(Protocol):
    """The data plane: tell it where a peer listens and dial it."""

    async def connect(self, peer_id: str, maddrs: Sequence[str]) -> None: ...


@dataclass(frozen=True)
class DialSettings:
    concurrency: int = 8  # dials in flight at once
    timeout_s: float = 10.0  # one dial
    backoff_s: float = 2.0  # the wait before the first retry of a failed dial; doubles per failure
    max_backoff_s: float = 120.0
    tick_s: float = 0.5  # how often the view is looked at for new peers and retries due

    def __post_init__(self) -> None:
        if self.concurrency < 1 or min(self.timeout_s, self.backoff_s, self.max_backoff_s, self.tick_s) <= 0:
            raise ValueError("concurrency must be >= 1 and every duration positive")


class DialOutcome(enum.StrEnum):
    """What became of a dial (Dialer.counts)."""

    OK = "ok"
    FAILED = "failed"  # unreachable or timed out: retried after a backoff
    REFUSED = "refused"  # no address the routability rule lets this node dial: not tried


class _State(enum.Enum):
    DIALLING = "dialling"
    CONNECTED = "connected"
    FAILED = "failed"
    REFUSED = "refused"


@dataclass
class _Peer:
    maddrs: tuple[str, ...]  # as the record named them (the dialled ones are a subset)
    state: _State = _State.DIALLING
    failures: int = 0
    retry_at: float = 0.0


class Dialer:
    """Background dials of the view's peers (see the module docstring). Per-peer state is kept only
    for peers in the latest view, so it is as bounded as the view."""

    def __init__(self, connector: Connector, me: str, own_maddrs: Callable[[], Iterable[str]],
                 settings: DialSettings = DialSettings(), clock: Callable[[], float] = time.monotonic) -> None:
        self._connector = connector
        self._me = me
        self._own_maddrs = own_maddrs
        self._settings = settings
        self._clock = clock
        self._peers: dict[str, _Peer] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._slots = asyncio.Semaphore(settings.concurrency)
        self.counts: collections.Counter[str] = collections.Counter()  # by DialOutcome

    @property
    def backing_off(self) -> int:
        """Peers whose last dial failed, waiting for their retry."""
        return sum(1 for p in self._peers.values() if p.state is _State.FAILED)

    def connected(self, peer_id: str) -> bool:
        peer = self._peers.get(peer_id)
        return peer is not None and peer.state is _State.CONNECTED

    async def run(self, view: Callable[[], Sequence[Dialable]]) -> None:
        """Follow `view()` until cancelled: dial new peers, retry failed ones when their backoff ends."""
        try:
            while True:
                self.update(view())
                await asyncio.sleep(self._settings.tick_s)
        finally:
            await self.close()

    def update(self, view: Sequence[Dialable]) -> None:
        """Start the dials `view` calls for (new peers, new addresses, retries due); forget peers gone."""
        now = self._clock()
        live = {r.peer_id: r for r in view if r.peer_id != self._me}
        for gone in [p for p in self._peers if p not in live]:
            del self._peers[gone]
            task = self._tasks.pop(gone, None)
            if task is not None:
                task.cancel()
        for peer_id, record in live.items():
            known = self._peers.get(peer_id)
            if known is None or known.maddrs != tuple(record.maddrs):
                self._start(record, None)  # a new peer, or new addresses: a fresh start, no backoff
            elif known.state is _State.FAILED and now >= known.retry_at and peer_id not in self._tasks:
                self._start(record, known)  # its backoff is over

    def _start(self, record: Dialable, known: _Peer | None) -> None:
        peer = known or _Peer(tuple(record.maddrs))
        self._peers[record.peer_id] = peer
        targets = dialable_maddrs(record.maddrs, self._own_maddrs())
        if not targets:
            if peer.state is not _State.REFUSED:
                peer.state = _State.REFUSED
                self.counts[DialOutcome.REFUSED] += 1
                logger.info("not dialling %s: none of its addresses is routable from here (%s)", record.peer_id,
                            " ".join(record.maddrs) or "none given")
            return
        peer.state = _State.DIALLING
        old = self._tasks.pop(record.peer_id, None)
        if old is not None:
            old.cancel()
        self._tasks[record.peer_id] = asyncio.create_task(self._dial(record.peer_id, peer, targets),
                                                          name=f"dial {record.peer_id}")

    async def _dial(self, peer_id: str, peer: _Peer, targets: tuple[str, ...]) -> None:
        try:
            async with self._slots:
                async with asyncio.timeout(self._settings.timeout_s):
                    await self._connector.connect(peer_id, targets)
        except (ConnectionError, TimeoutError, ValueError, OSError) as exc:
            peer.failures += 1
            backoff = min(self._settings.max_backoff_s, self._settings.backoff_s * 2 ** (peer.failures - 1))
            peer.state, peer.retry_at = _State.FAILED, self._clock() + backoff
            self.counts[DialOutcome.FAILED] += 1
            logger.info("could not dial %s (failure %d; next try in %.0f s): %s", peer_id, peer.failures, backoff,
                        exc or type(exc).__name__)
        else:
            peer.state, peer.failures = _State.CONNECTED, 0
            self.counts[DialOutcome.OK] += 1
        finally:
            if self._tasks.get(peer_id) is asyncio.current_task():
                del self._tasks[peer_id]

    async def ensure(self, records: Sequence[Dialable], timeout_s: float) -> None:
        """Dial `records` now (a backoff waiting for its time is cut short) and wait, at most
        `timeout_s`, for those dials: for a node's start-up download or an evaluation, not a round."""
        waiting = []
        for record in records:
            if record.peer_id == self._me:
                continue
            known = self._peers.get(record.peer_id)
            same = known is not None and known.maddrs == tuple(record.maddrs)
            if same and known is not None and known.state in (_State.CONNECTED, _State.REFUSED):
                continue
            if not (same and record.peer_id in self._tasks):
                self._start(record, known if same else None)
            task = self._tasks.get(record.peer_id)
            if task is not None:
                waiting.append(task)
        if waiting:
            await asyncio.wait(waiting, timeout=timeout_s)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
