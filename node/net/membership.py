"""Who may open streams to this node (gossip.limits.Membership): the peers with a live record in its view.

A stream from a peer not in view waits for a read of the view that began after it arrived (the background
reads come every half heartbeat; one is started at once if none ran for a second), so a joiner whose record is
a moment old is not refused."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

REFRESH_INTERVAL_S = 1.0  # an unknown peer's stream starts a read of the view at most this often
REFRESH_TIMEOUT_S = 3.0  # and waits for one at most this long


class _Record(Protocol):
    @property
    def peer_id(self) -> str: ...


class _View(Protocol):
    def view(self) -> Sequence[_Record]: ...

    async def read_after(self, since: float, min_interval_s: float) -> None: ...


class ViewMembership:
    """`gossip.limits.Membership` over a `node.net.discovery.Discovery`."""

    def __init__(self, discovery: _View) -> None:
        self._discovery = discovery
        self._seen: Sequence[_Record] | None = None
        self._ids: frozenset[str] = frozenset()

    def _members(self) -> frozenset[str]:
        view = self._discovery.view()
        if view is not self._seen:  # the view is a new tuple whenever it changes
            self._seen, self._ids = view, frozenset(r.peer_id for r in view)
        return self._ids

    def knows(self, peer: str) -> bool:
        return peer in self._members()

    async def admits(self, peer: str) -> bool:
        if self.knows(peer):
            return True
        asked = asyncio.get_running_loop().time()
        try:
            async with asyncio.timeout(REFRESH_TIMEOUT_S):
                await self._discovery.read_after(asked, REFRESH_INTERVAL_S)
        except TimeoutError:
            return False
        return self.knows(peer)
