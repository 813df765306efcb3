"""Who may open streams to this node (gossip.limits.Membership): the peers with a live record in its
view. A stream from a peer not in view first has the view re-read (at most once a second, shared by
every such stream), so a joiner whose record is a moment old is not refused."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

REFRESH_INTERVAL_S = 1.0  # an unknown peer's stream re-reads the view at most this often
REFRESH_TIMEOUT_S = 3.0


class _Record(Protocol):
    @property
    def peer_id(self) -> str: ...


class _View(Protocol):
    def view(self) -> Sequence[_Record]: ...

    async def refresh_now(self, min_interval_s: float) -> None: ...


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

    async def admits(self, peer: str) -> bool:
        if peer in self._members():
            return True
        try:
            async with asyncio.timeout(REFRESH_TIMEOUT_S):
                await self._discovery.refresh_now(REFRESH_INTERVAL_S)
        except TimeoutError:
            return False
        return peer in self._members()
