"""One counted message stream: wire messages written to and read from a `Stream`, their bytes and
refused messages counted where the protocol keeps its counters, one log line per refused message.

Shared by the gossip exchange (`gossip.exchange`) and the SPES fetch protocol (`gossip.spes.fetch`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

import numpy as np

from gossip.errors import BadSchema, WireError
from gossip.pace import PIECE_BYTES, TransferStalled
from gossip.transport import Stream
from gossip.wire import Expectation, Header, Message, MessageReader, ValuesSink, WireLimits

Frames = Iterable[bytes | memoryview]
T = TypeVar("T")


class TensorsUnsendable(Exception):
    """Our own tensors failed the wire's checks halfway through a message (counted as `unsendable`)."""


class Counts(Protocol):
    """The counters a protocol keeps for its streams (ExchangeStats, FetchStats)."""

    bytes_sent: int
    bytes_received: int
    errors: collections.Counter[str]  # refused input (and unsendable output), by kind


@dataclass(frozen=True)
class Accounting:
    """Where one protocol's streams count, and how they log: `refused` starts the warning logged for
    each refused message ("rejected gossip message", "refused expert message")."""

    counts: Counts
    logger: logging.Logger
    refused: str

    def count_refused(self, exc: WireError, peer: str) -> None:
        self.counts.errors[exc.kind] += 1
        self.logger.warning("%s from %s: %s: %s", self.refused, peer, exc.kind, exc)


class IncomingMessage:
    """A message whose header has been read and checked; `rest()` reads its payload."""

    __slots__ = ("_reader", "header")

    def __init__(self, header: Header, reader: MessageReader) -> None:
        self.header = header
        self._reader = reader

    async def rest(self) -> Message:
        return await self._reader.rest()

    def completed(self) -> dict[str, np.ndarray]:
        """The tensors read whole so far: after `rest()` failed, what arrived before it did."""
        return self._reader.completed()


class MessageStream:
    """A `Stream` that moves whole wire messages and counts what it moves (see `Accounting`)."""

    __slots__ = ("_accounting", "_stream", "mid_message", "received")

    def __init__(self, stream: Stream, accounting: Accounting) -> None:
        self._stream = stream
        self._accounting = accounting
        self.received = 0  # bytes read from this stream so far
        # a message of ours was cut partway (a failure or a cancel mid-send): nothing more may follow it
        self.mid_message = False

    @property
    def remote_peer(self) -> str:
        return self._stream.remote_peer

    async def send(self, frames: Frames, stall_s: float | None = None) -> None:
        """Write a message's buffers as they are produced (`gossip.wire.iter_message`), so the first
        are on their way while later ones are encoded. A buffer that fails its check after earlier
        ones went out (e.g. a NaN) cannot be finished, and a reject after part of a message would be
        garbage to the receiver: counted as `unsendable` and raised as TensorsUnsendable; the caller
        closes the stream, which the receiver reads as a truncated message. With `stall_s`, frames are
        written in pieces of at most PIECE_BYTES, and a piece the peer does not take within that long raises
        TransferStalled (gossip.pace): a 1 MiB frame may take longer than that on a slow but moving link."""
        self.mid_message = True
        try:
            for frame in frames:
                if stall_s is None:
                    await self._stream.write(frame)
                else:
                    view = memoryview(frame).cast("B")
                    for at in range(0, len(view), PIECE_BYTES):
                        await _within_stall(self._stream.write(view[at:at + PIECE_BYTES]), stall_s,
                                            "writing to", self.remote_peer)
                self._accounting.counts.bytes_sent += len(frame)
            self.mid_message = False
        except WireError as exc:
            self._accounting.counts.errors["unsendable"] += 1
            self._accounting.logger.error("stopped sending our tensors to %s halfway: %s: %s", self.remote_peer,
                                          exc.kind, exc)
            raise TensorsUnsendable(str(exc)) from None

    async def read(self, limits: WireLimits, expected: Expectation | None,
                   on_values: ValuesSink | None = None) -> Message:
        """One message, from the peer at the other end (BadSchema if its header names another sender)."""
        return await (await self.read_header(limits, expected, on_values)).rest()

    async def read_header(self, limits: WireLimits, expected: Expectation | None,
                          on_values: ValuesSink | None = None, *, stall_s: float | None = None,
                          on_bytes: Callable[[int], None] | None = None) -> IncomingMessage:
        """One message's header, checked (BadSchema if it names another sender than the stream's
        peer), and not a byte of its payload: the caller decides whether to read the rest.

        With `stall_s`, the payload is read in pieces of at most PIECE_BYTES, each of which must arrive
        within that long, else TransferStalled (gossip.pace): a deadline on progress, which the
        caller's on the whole bounds. The header is not: the caller's deadline says how long a peer may
        take to start answering (a round's answer may wait for the answering peer's round to begin).
        `on_bytes` sees the size of every piece read, header included."""
        header_read = False
        def count(data: bytes) -> bytes:
            self._accounting.counts.bytes_received += len(data)
            self.received += len(data)
            if on_bytes is not None:
                on_bytes(len(data))
            return data

        async def read_exactly(n: int) -> bytes:
            if stall_s is None or not header_read:
                return count(await self._stream.read_exactly(n))
            pieces = []
            while n:
                piece = await _within_stall(self._stream.read_exactly(min(n, PIECE_BYTES)), stall_s,
                                            "reading from", self.remote_peer)
                pieces.append(count(piece))
                n -= len(piece)
            return pieces[0] if len(pieces) == 1 else b"".join(pieces)  # no piece: n was 0

        # the sender is checked with the header, before any payload (and before the sender's admission)
        checked = replace(expected, sender=self.remote_peer) if expected is not None else None
        reader = MessageReader(read_exactly, limits, checked, on_values)
        header = await reader.header()
        header_read = True
        if header.sender != self.remote_peer:
            raise BadSchema(f"header names sender {header.sender}, but the stream comes from {self.remote_peer}")
        return IncomingMessage(header, reader)

    def count_refused(self, exc: WireError) -> None:
        self._accounting.count_refused(exc, self.remote_peer)

    async def try_reject(self, reject: Callable[[], Frames], timeout_s: float) -> None:
        """Send the `reject` message `reject()` encodes, if the peer still listens within `timeout_s` and no
        message of ours was cut partway (the peer would read the reject as that message's bytes)."""
        if self.mid_message:
            return
        try:
            async with asyncio.timeout(timeout_s):
                await self.send(reject())
        except (TimeoutError, ConnectionError, WireError, TensorsUnsendable):
            pass  # the peer is gone or broken; the error is already counted

    async def linger(self, timeout_s: float) -> None:
        """Keep our end open until the other end hangs up (it does once it has read what we sent).

        p2pd resets a stream whose end closes first, and the reset can overtake the last bytes
        written: the other end would then read a truncated message.
        """
        try:
            async with asyncio.timeout(timeout_s):
                await self._stream.read_exactly(1)
        except (TimeoutError, ConnectionError):
            pass  # hung up (or never will): either way we are done

    async def close(self) -> None:
        await self._stream.close()


async def _within_stall(step: Awaitable[T], stall_s: float, doing: str, peer: str) -> T:
    try:
        async with asyncio.timeout(stall_s):
            return await step
    except TimeoutError:
        raise TransferStalled(f"stalled {doing} {peer}: nothing moved for {stall_s:g} s") from None
