"""Content-addressed blobs over any `Transport` (`/murmur/blob/1`): a small file asked for by its sha256,
such as a swarm's tokenizer.

The asker gets its bytes, bounded by the size it expects and checked against the hash before use.

Messages are frames (8-byte big-endian length, then the body; `gossip.wire.frames`):
- request: msgpack map {"v": 1, "sha256": <64 hex digits>}, at most MAX_REQUEST_BYTES;
- answer: msgpack map {"v": 1, "ok": bool, "error": str (when not ok)}, at most MAX_REQUEST_BYTES,
  then (when ok) one frame of the blob's bytes, which the asker refuses unheard if its declared length
  is not the size it expects.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable
from typing import Annotated

import msgspec

from gossip.limits import DEFAULT_INCOMING, IncomingLimits, PeerBuckets
from gossip.transport import Stream, Transport
from gossip.wire.frames import PREFIX_BYTES, frame_prefix, read_prefix

logger = logging.getLogger(__name__)

BLOB_PROTOCOL = "/murmur/blob/1"
VERSION = 1
MAX_REQUEST_BYTES = 1024
TIMEOUT_S = 30.0
RATE_LIMITED = "rate_limited"  # the answer's error when an asker asks too often

Sha256Hex = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]


class BlobRequest(msgspec.Struct, forbid_unknown_fields=True):
    v: Annotated[int, msgspec.Meta(ge=VERSION, le=VERSION)]
    sha256: Sha256Hex


class BlobAnswer(msgspec.Struct, forbid_unknown_fields=True):
    v: Annotated[int, msgspec.Meta(ge=VERSION, le=VERSION)]
    ok: bool
    error: Annotated[str, msgspec.Meta(max_length=200)] = ""


class BlobFailed(Exception):
    """A blob could not be fetched from one peer (unreachable, refused, wrong size or hash); says why."""


# sha256 -> the blob's bytes, or None when this node does not hold it
BlobSource = Callable[[str], Awaitable[bytes | None]]


async def _read_frame(stream: Stream, limit: int) -> bytes:
    length = read_prefix(await stream.read_exactly(PREFIX_BYTES))
    if length > limit:
        raise BlobFailed(f"a frame of {length} bytes, more than the {limit} expected")
    return await stream.read_exactly(length) if length else b""


async def _write_frame(stream: Stream, body: bytes) -> None:
    await stream.write(frame_prefix(len(body)) + body)


async def fetch_blob(transport: Transport, peer: str, sha256: str, size: int, timeout_s: float = TIMEOUT_S) -> bytes:
    """The blob of `sha256` from `peer`: exactly `size` bytes that hash to `sha256`, or BlobFailed."""
    try:
        async with asyncio.timeout(timeout_s):
            stream = await transport.open_stream(peer, BLOB_PROTOCOL)
            try:
                await _write_frame(stream, msgspec.msgpack.encode(BlobRequest(VERSION, sha256)))
                answer = msgspec.msgpack.decode(await _read_frame(stream, MAX_REQUEST_BYTES), type=BlobAnswer)
                if not answer.ok:
                    raise BlobFailed(f"{peer} refused: {answer.error or 'no reason given'}")
                data = await _read_frame(stream, size)
            finally:
                await stream.close()
    except TimeoutError:
        raise BlobFailed(f"{peer} did not answer within {timeout_s:g} s") from None
    except ConnectionError as exc:
        raise BlobFailed(f"{peer} is unreachable: {exc or type(exc).__name__}") from None
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise BlobFailed(f"{peer} sent a malformed answer: {exc}") from None
    if len(data) != size or hashlib.sha256(data).hexdigest() != sha256:
        raise BlobFailed(f"{peer} sent {len(data)} bytes that do not hash to {sha256[:12]}")
    return data


async def serve_blobs(transport: Transport, source: BlobSource, timeout_s: float = TIMEOUT_S,
                      limits: IncomingLimits = DEFAULT_INCOMING) -> None:
    """Answer blob requests from `source` (a request for an unknown hash is refused, not an error).
    An asker gets blobs at the rate of its pulls of current parameters (`limits`): a request is a
    kilobyte and its answer may be megabytes, so it must not loop; beyond that, "rate_limited"."""
    answered = PeerBuckets(limits.current_pulls_per_s, limits.current_pulls_burst, limits.tracked_peers)

    async def handler(stream: Stream) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                try:
                    request = msgspec.msgpack.decode(await _read_frame(stream, MAX_REQUEST_BYTES), type=BlobRequest)
                except (BlobFailed, msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
                    logger.info("blob request from %s refused: %s", stream.remote_peer, exc)
                    request = None
                limited = request is not None and not answered.take(stream.remote_peer)
                data = await source(request.sha256) if request is not None and not limited else None
                if data is None:
                    error = "malformed request" if request is None else RATE_LIMITED if limited else "unknown blob"
                    await _write_frame(stream, msgspec.msgpack.encode(BlobAnswer(VERSION, False, error)))
                else:
                    await _write_frame(stream, msgspec.msgpack.encode(BlobAnswer(VERSION, True)))
                    await _write_frame(stream, data)
                # keep our end open until the asker hangs up: p2pd resets a stream closed first, and
                # the reset can overtake the last bytes written
                await stream.read_exactly(1)
        except (TimeoutError, ConnectionError):
            pass
        finally:
            await stream.close()

    await transport.serve(BLOB_PROTOCOL, handler)


__all__ = ["BLOB_PROTOCOL", "BlobFailed", "BlobSource", "fetch_blob", "serve_blobs"]
