"""What the swarm's loop reads of the membership, as Protocols.

node.swarm sits below node.net and names no class of it (node.net.discovery, node.net.records)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from node.swarm.progress import ProgressRecord


class PeerRecordLike(Protocol):
    """A peer as its record names it: enough to dial it and pull its parameters."""

    @property
    def peer_id(self) -> str: ...

    @property
    def maddrs(self) -> tuple[str, ...]: ...


class SwarmRecord(PeerRecordLike, ProgressRecord, Protocol):
    """What the loop, a joiner and the algorithms read of a membership record (node.net.records.PeerRecord):
    how to reach the peer, its progress, its capacity and its tokens processed."""

    @property
    def capacity(self) -> int: ...

    @property
    def tokens(self) -> int:
        """Training tokens the peer says it processed (clipped to its step by node.net.discovery)."""
        ...


class Membership(Protocol):
    """The membership view and this peer's own record, as the loop uses them (node.net.discovery.Discovery)."""

    def view(self) -> Sequence[SwarmRecord]:
        """Live peers (this one included), sorted by peer id."""
        ...

    def update(self, *, step: int | None = None, round: int | None = None, loss: float | None = None,
               tokens: int | None = None, tokens_per_s: float | None = None) -> None:
        """Change what the next heartbeat publishes about this peer (tokens: processed so far, over restarts)."""
        ...
