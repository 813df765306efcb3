"""The one small interface the exchange protocol needs from a network: open a stream, serve a protocol.

Implementations: the in-memory transport (`gossip.memory`) here, and the network backends in
`node/net/transport/` (hivemind's p2pd, py-libp2p). Every read and write on a stream may block on a
remote peer, so callers wrap them in `asyncio.timeout`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

GOSSIP_PROTOCOL = "/murmur/gossip/1"


class StreamClosed(ConnectionError):
    """The other end closed the stream (or died) before the bytes asked for arrived."""


class PeerUnreachable(ConnectionError):
    """No stream to the peer could be opened (unknown, dead, or not serving the protocol) in time."""


class Stream(Protocol):
    """A reliable, ordered, bidirectional byte stream to one remote peer."""

    @property
    def remote_peer(self) -> str: ...

    async def read_exactly(self, n: int) -> bytes:
        """Return exactly n bytes, or raise StreamClosed if the stream ends first."""
        ...

    async def write(self, data: bytes | memoryview) -> None: ...

    async def close(self) -> None: ...


StreamHandler = Callable[[Stream], Awaitable[None]]


class Transport(Protocol):
    """One node's endpoint: its peer id, outgoing streams, and handlers for incoming ones."""

    @property
    def peer_id(self) -> str: ...

    async def open_stream(self, peer_id: str, protocol: str) -> Stream: ...

    async def serve(self, protocol: str, handler: StreamHandler) -> None:
        """Register `handler` for incoming streams of `protocol`; returns once registered."""
        ...

    async def close(self) -> None: ...
