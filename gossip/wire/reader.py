"""Reading one message from an async stream, the header first, so a receiver can refuse a request before
reading its payload.

Framing runs on the event loop; large payloads are decoded on a worker thread while the next bytes are
read."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import numpy as np

from gossip.errors import Truncated
from gossip.wire.decode import Message, MessageDecoder, ValuesSink
from gossip.wire.header import DEFAULT_LIMITS, Expectation, Header, WireLimits

_OFFLOAD_BYTES = 1 << 20  # read_message hands payload to a worker thread in batches of at least this much


class MessageReader:
    """One message read from an async stream in two parts: `header()` reads and validates the header
    frame and nothing more, so a receiver can refuse a request before any of its payload is read;
    `rest()` reads the payload.

    `read_exactly(n)` returns n bytes or raises at EOF (EOFError, including
    asyncio.IncompleteReadError, or ConnectionError, including gossip.transport.StreamClosed); EOF or
    a short read becomes Truncated. Neither call has a deadline of its own: callers set one.

    Large payloads are decoded on a worker thread, batch by batch while the next bytes are read,
    so the event loop only frames; at most one batch is being decoded at a time. `on_values` sees
    the values as they are decoded (see `MessageDecoder`), on the decoding thread.
    """

    def __init__(self, read_exactly: Callable[[int], Awaitable[bytes]], limits: WireLimits = DEFAULT_LIMITS,
                 expected: Expectation | None = None, on_values: ValuesSink | None = None) -> None:
        self._read_exactly = read_exactly
        self._decoder = MessageDecoder(limits, expected, on_values)

    async def _next(self) -> bytes:
        decoder = self._decoder
        needed = decoder.bytes_needed()
        try:
            data = await self._read_exactly(needed)
        except (EOFError, ConnectionError) as exc:
            raise Truncated(f"stream ended after {decoder.bytes_fed} bytes, while reading the {decoder.reading}") from exc
        if len(data) != needed:
            raise Truncated(f"asked for {needed} bytes of the {decoder.reading}, got {len(data)}")
        return data

    async def header(self) -> Header:
        """The validated header; reads no byte of the payload."""
        decoder = self._decoder
        while decoder.header is None:
            decoder.feed(await self._next(), decode=False)
        return decoder.header

    def completed(self) -> dict[str, np.ndarray]:
        """The tensors read whole so far (`MessageDecoder.completed`): after `rest()` failed, what arrived."""
        return self._decoder.completed()

    async def rest(self) -> Message:
        """The whole message (reading the header first if `header()` was not awaited)."""
        decoder = self._decoder
        await self.header()
        loop = asyncio.get_running_loop()
        decoding: asyncio.Future[None] | None = None  # the batch a worker thread is decoding
        try:
            while decoder.bytes_needed():
                decoder.feed(await self._next(), decode=False)
                if decoder.queued_nbytes >= _OFFLOAD_BYTES:
                    if decoding is not None:
                        await asyncio.shield(decoding)
                    decoding = loop.run_in_executor(None, decoder.decode_queued, decoder.take_queued())
            if decoding is not None:
                await asyncio.shield(decoding)
            decoder.decode_queued(decoder.take_queued())  # less than one batch: not worth a thread hop
        finally:
            if decoding is not None:
                # failing or cancelled with a batch in flight: the worker finishes with the decoder before
                # it is dropped, and its outcome is retrieved here (the error that ended the read is raised)
                if not decoding.done():
                    await asyncio.wait([decoding])
                if not decoding.cancelled():
                    decoding.exception()
        return decoder.result()


async def read_message(
    read_exactly: Callable[[int], Awaitable[bytes]],
    limits: WireLimits = DEFAULT_LIMITS,
    expected: Expectation | None = None,
    *,
    # the deadline bounds the whole message and callers pass it with the stream; kept for them
    timeout: float | None = None,  # noqa: ASYNC109
    on_values: ValuesSink | None = None,
) -> Message:
    """Read one whole message from a stream through `read_exactly(n)` (see `MessageReader`).

    `timeout` bounds the whole message; None leaves the deadline to the caller (who must then set one).
    """
    async with asyncio.timeout(timeout):
        return await MessageReader(read_exactly, limits, expected, on_values).rest()
