"""The receiver's side, sans IO: an incremental decoder of one message, fed bytes in pieces of any size,
which validates the header and then decodes each tensor as its bytes arrive (steps 7-8)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np

from gossip.codecs import WIRE_DTYPES, Codec, ElementwiseCodec
from gossip.errors import BadSchema, FrameTooLarge, ManifestMismatch, Truncated, WireError
from gossip.wire.frames import PREFIX_BYTES, read_prefix
from gossip.wire.header import (
    DEFAULT_LIMITS,
    Expectation,
    Header,
    ManifestEntry,
    WireLimits,
    check_expectation,
    parse_header,
)

# A tensor's output array is allocated once 1/_ALLOCATE_AFTER of its bytes have arrived, never on a
# declared size alone: the decoder holds at most that many times the decoded size of what it received.
_ALLOCATE_AFTER = 8
_DECODE_MIN = 64 << 10  # smaller pieces of a tensor are decoded together, once this much has arrived


@dataclass(frozen=True)
class Message:
    """A decoded message: its header and its tensors (fresh arrays, in manifest order)."""

    header: Header
    tensors: dict[str, np.ndarray]

class _Phase(Enum):
    HEADER_PREFIX = "header length prefix"
    HEADER = "header"
    CHUNK_PREFIX = "payload chunk length prefix"
    CHUNK = "payload chunk"
    DONE = "end of message"
    FAILED = "failed message"


# Called with (tensor name, index of the first element, the decoded and validated elements) as each
# run of a tensor arrives, in order, on whichever thread decodes; it must not raise. The values are
# a view of the message's tensor: a consumer copies what it keeps beyond the call.
ValuesSink = Callable[[str, int, np.ndarray], None]


class _JoinedEntry:
    """A tensor whose codec needs all of its bytes at once (int8, top-k): pieces kept, decoded at the end."""

    def __init__(self, codec: Codec, entry: ManifestEntry, on_values: ValuesSink | None = None) -> None:
        self._codec, self._entry, self._on_values = codec, entry, on_values
        self._pieces: list[bytes | memoryview] = []

    def write(self, piece: memoryview, keep: bool) -> None:
        self._pieces.append(piece if keep else bytes(piece))

    def finish(self) -> np.ndarray:
        pieces, self._pieces = self._pieces, []
        buf = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        values = self._codec.decode(buf, self._entry.numel, self._entry.dtype)
        if self._on_values is not None and values.size:
            self._on_values(self._entry.name, 0, values)
        return values


class _ElementwiseEntry:
    """A tensor of an elementwise codec (fp32, fp16, bf16), decoded piece by piece into its output array.

    The output is allocated once 1/`_ALLOCATE_AFTER` of the tensor's bytes have arrived; the pieces
    before that are kept as they came and decoded then, and so are pieces smaller than `_DECODE_MIN`
    until that much has arrived. A piece may end inside an element: its last few bytes wait for the
    next piece.
    """

    def __init__(self, codec: ElementwiseCodec, entry: ManifestEntry, on_values: ValuesSink | None = None) -> None:
        self._codec, self._entry, self._on_values = codec, entry, on_values
        self._out: np.ndarray | None = None
        self._staged: list[bytes | memoryview] = []  # pieces received but not decoded yet
        self._staged_nbytes = 0
        self._received = 0
        self._decoded = 0  # elements written to the output
        self._tail = b""  # the start of an element that the next piece completes

    def write(self, piece: memoryview, keep: bool) -> None:
        nbytes = self._entry.nbytes
        self._received += len(piece)
        # small pieces wait to be decoded together: per call, decoding has a fixed cost of several µs
        if self._received * _ALLOCATE_AFTER < nbytes or (
            self._staged_nbytes + len(piece) < _DECODE_MIN and self._received < nbytes
        ):
            self._staged.append(piece if keep else bytes(piece))
            self._staged_nbytes += len(piece)
            return
        if self._out is None:
            self._out = np.empty(self._entry.numel, WIRE_DTYPES[self._entry.dtype])
        staged, small = self._staged, self._staged_nbytes < _DECODE_MIN
        self._staged, self._staged_nbytes = [], 0
        if staged and small:
            self._decode(b"".join([*staged, piece]))
            return
        for earlier in staged:
            self._decode(earlier)
        self._decode(piece)

    def _decode(self, data: bytes | memoryview) -> None:
        k = self._codec.element_nbytes
        piece = memoryview(data)  # slices of it are views, not copies
        if self._tail:
            head = self._tail + bytes(piece[: k - len(self._tail)])
            piece = piece[k - len(self._tail) :]
            if len(head) < k:
                self._tail = head
                return
            self._tail = b""
            self._decode_whole(head)
        whole = len(piece) - len(piece) % k
        if whole:
            self._decode_whole(piece[:whole])
        if whole < len(piece):
            self._tail = bytes(piece[whole:])

    def _decode_whole(self, buf: bytes | memoryview) -> None:
        assert self._out is not None
        n = len(buf) // self._codec.element_nbytes
        values = self._out[self._decoded : self._decoded + n]
        self._codec.decode_into(buf, values, self._decoded)
        if self._on_values is not None:
            self._on_values(self._entry.name, self._decoded, values)
        self._decoded += n

    def finish(self) -> np.ndarray:
        if self._out is None:  # a tensor of no elements
            self._out = np.empty(self._entry.numel, WIRE_DTYPES[self._entry.dtype])
        return self._out


class _PayloadAssembler:
    """The payload's bytes -> the manifest's tensors, in order (validation step 8)."""

    def __init__(self, header: Header, codec: Codec, on_values: ValuesSink | None = None) -> None:
        self._codec = codec
        self._on_values = on_values
        self._manifest = header.manifest
        self._index = 0  # the manifest entry whose bytes are arriving
        self._left = 0  # bytes that entry still needs
        self._current: _ElementwiseEntry | _JoinedEntry | None = None
        self.tensors: dict[str, np.ndarray] = {}
        self._start_entry()

    @property
    def complete(self) -> bool:
        return self._index == len(self._manifest)

    def write(self, piece: memoryview, keep: bool) -> None:
        while len(piece):
            take = min(self._left, len(piece))
            head, piece = piece[:take], piece[take:]
            self._guarded(functools.partial(self._current.write, head, keep))  # type: ignore[union-attr]
            self._left -= take
            if self._left == 0:
                self._finish_entry()

    def _start_entry(self) -> None:
        """Begin the next entry with bytes, finishing the empty ones on the way."""
        while self._index < len(self._manifest):
            entry = self._manifest[self._index]
            codec = self._codec
            if isinstance(codec, ElementwiseCodec):
                self._current = _ElementwiseEntry(codec, entry, self._on_values)
            else:
                self._current = _JoinedEntry(codec, entry, self._on_values)
            self._left = entry.nbytes
            if entry.nbytes:
                return
            self._finish_entry(start_next=False)
        self._current = None

    def _finish_entry(self, start_next: bool = True) -> None:
        entry = self._manifest[self._index]
        flat = self._guarded(lambda: self._current.finish())  # type: ignore[union-attr]
        self.tensors[entry.name] = self._guarded(lambda: _reshaped(flat, entry.shape))
        self._index += 1
        if start_next:
            self._start_entry()

    def _guarded(self, step: Callable[[], Any]) -> Any:
        try:
            return step()
        except WireError as exc:
            entry = self._manifest[self._index]
            raise type(exc)(f"manifest entry {self._index} {entry.name!r}: {exc}") from None


class MessageDecoder:
    """Sans-IO decoder of one message: feed it bytes, in pieces of any size, until `done`.

    `bytes_needed()` is how many bytes complete the frame part being read, so a stream reader can
    ask for exactly that and never read past the message. `feed` raises a `WireError` as soon as
    something is wrong; after that the decoder is dead and raises it again.

    Tensors of the elementwise codecs (fp32, fp16, bf16) are decoded chunk by chunk into their
    output arrays as the bytes arrive, never joined. A reader that wants that work off its own
    thread feeds with `decode=False`, which only frames and queues the payload, and hands batches
    from `take_queued()` to `decode_queued` (on any one thread at a time, in order).

    `on_values`, if given, sees every tensor's values as they are decoded (see `ValuesSink`), before
    the message is complete: a consumer may start work on a tensor while the rest arrives, and must
    discard that work if the message then fails.
    """

    def __init__(self, limits: WireLimits = DEFAULT_LIMITS, expected: Expectation | None = None,
                 on_values: ValuesSink | None = None) -> None:
        self._limits = limits
        self._expected = expected
        self._on_values = on_values
        self._phase = _Phase.HEADER_PREFIX
        self._buf = bytearray()  # the length prefix or header gathered so far
        self._header_len = 0
        self._header: Header | None = None
        self._assembler: _PayloadAssembler | None = None
        self._chunk_left = 0
        self._payload_left = 0
        self._queued: list[tuple[bytes | memoryview, bool]] = []  # payload pieces not yet decoded, and `keep`
        self._queued_nbytes = 0
        self._error: WireError | None = None
        self.bytes_fed = 0

    @property
    def done(self) -> bool:
        """The whole message has been read and decoded: `result()` is ready."""
        return (
            self._phase is _Phase.DONE
            and self._error is None
            and not self._queued
            and self._assembler is not None
            and self._assembler.complete
        )

    @property
    def header(self) -> Header | None:
        """The validated header, once its frame has been read."""
        return self._header

    @property
    def reading(self) -> str:
        """What the next bytes are, in words (for error messages)."""
        return self._phase.value

    @property
    def queued_nbytes(self) -> int:
        """Payload bytes read with `decode=False` and not yet taken by `take_queued()`."""
        return self._queued_nbytes

    def bytes_needed(self) -> int:
        phase = self._phase
        if phase in (_Phase.HEADER_PREFIX, _Phase.CHUNK_PREFIX):
            return PREFIX_BYTES - len(self._buf)
        if phase is _Phase.HEADER:
            return self._header_len - len(self._buf)
        if phase is _Phase.CHUNK:
            return self._chunk_left
        return 0

    def result(self) -> Message:
        if not self.done or self._header is None or self._assembler is None:
            raise RuntimeError(f"message incomplete: still reading the {self.reading}")
        return Message(self._header, self._assembler.tensors)

    def completed(self) -> dict[str, np.ndarray]:
        """The tensors decoded whole so far, in manifest order: what a message cut partway (a peer that
        died or stalled) delivered, for a reader that resumes it elsewhere. None after a wire error: a
        sender of garbage vouches for none of its earlier tensors either. Decodes what is framed but still
        queued first (less than a reader's batch), so call it once the reading is over."""
        if self._queued and self._error is None:
            with contextlib.suppress(WireError):  # the decoder is failed now, and nothing is kept
                self.decode_queued(self.take_queued())
        return dict(self._assembler.tensors) if self._assembler is not None else {}

    def feed(self, data: bytes | bytearray | memoryview, *, decode: bool = True) -> None:
        """Read `data`; with decode=False its payload is only queued (see `take_queued`)."""
        if self._error is not None:
            raise self._error
        view = memoryview(data).cast("B")
        # slices of an immutable bytes object may be kept until a tensor completes; anything else is copied
        keep = type(data) is bytes
        try:
            self._consume(view, keep)
            if decode:
                self.decode_queued(self.take_queued())
            elif not keep:  # queued views of a buffer the caller may reuse: copy them now
                self._queued = [(bytes(piece), True) if not kept else (piece, kept) for piece, kept in self._queued]
        except WireError as exc:
            self._fail(exc)
            raise
        finally:
            self.bytes_fed += len(view)

    def take_queued(self) -> list[tuple[bytes | memoryview, bool]]:
        """The payload pieces queued so far, in order, for `decode_queued`."""
        queued, self._queued, self._queued_nbytes = self._queued, [], 0
        return queued

    def decode_queued(self, pieces: list[tuple[bytes | memoryview, bool]]) -> None:
        """Decode pieces from `take_queued()` into the tensors; may run on a worker thread while
        `feed(decode=False)` runs on another. Raises the first WireError, which kills the decoder."""
        assembler = self._assembler  # the reading thread drops it if framing fails meanwhile
        if self._error is not None:
            raise self._error
        if not pieces:
            return
        assert assembler is not None
        try:
            for piece, keep in pieces:
                assembler.write(memoryview(piece), keep)
        except WireError as exc:
            self._fail(exc)
            raise

    def _fail(self, exc: WireError) -> None:
        self._error = exc
        self._phase = _Phase.FAILED
        self._queued, self._queued_nbytes = [], 0
        self._assembler = None

    def _consume(self, view: memoryview, keep: bool) -> None:
        pos, end = 0, len(view)
        while pos < end:
            phase = self._phase
            if phase is _Phase.DONE:
                raise BadSchema(f"{end - pos} bytes after the end of the message")
            if phase is _Phase.CHUNK:
                take = min(self._chunk_left, end - pos)
                self._queued.append((view[pos : pos + take], keep))
                self._queued_nbytes += take
                pos += take
                self._chunk_left -= take
                self._payload_left -= take
                if self._chunk_left == 0:
                    self._phase = _Phase.CHUNK_PREFIX if self._payload_left else _Phase.DONE
                continue
            take = min(self.bytes_needed(), end - pos)
            self._buf += view[pos : pos + take]
            pos += take
            if self.bytes_needed():
                continue
            if phase is _Phase.HEADER:
                body, self._buf = self._buf, bytearray()
                self._on_header(body)
            else:
                length = read_prefix(self._buf)
                self._buf.clear()
                self._on_prefix(length)

    def _on_prefix(self, length: int) -> None:
        limits = self._limits
        if self._phase is _Phase.HEADER_PREFIX:
            if length > limits.max_header_bytes:
                raise FrameTooLarge(
                    f"header frame of {length} bytes exceeds max_header_bytes ({limits.max_header_bytes})"
                )
            if length == 0:
                raise BadSchema("empty header frame")
            self._header_len = length
            self._phase = _Phase.HEADER
            return
        if length == 0:
            raise BadSchema("empty payload chunk")
        if length > limits.max_chunk_bytes:
            raise FrameTooLarge(f"payload chunk of {length} bytes exceeds max_chunk_bytes ({limits.max_chunk_bytes})")
        if length > self._payload_left:
            raise ManifestMismatch(
                f"payload chunk of {length} bytes, but the manifest leaves only {self._payload_left} bytes"
            )
        self._chunk_left = length
        self._phase = _Phase.CHUNK

    def _on_header(self, body: bytearray) -> None:
        try:
            header, codec = parse_header(body, self._limits)
            if self._expected is not None:
                check_expectation(header, self._expected)
        except WireError:
            raise
        except (ValueError, TypeError, RecursionError, OverflowError, UnicodeError) as exc:
            # the checks name what they refuse; whatever else a hostile header trips is refused as malformed
            raise BadSchema(f"malformed header ({type(exc).__name__})") from None
        self._header = header
        self._assembler = _PayloadAssembler(header, codec, self._on_values)
        self._payload_left = header.payload_nbytes
        self._phase = _Phase.CHUNK_PREFIX if self._payload_left else _Phase.DONE


def _reshaped(flat: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    try:
        return flat.reshape(shape)
    except ValueError as exc:  # the manifest's checks bound every shape; this is the backstop
        raise BadSchema(f"shape {list(shape)[:8]} does not fit its {flat.size} elements: {exc}") from None


def decode_message(
    buf: bytes | bytearray | memoryview, limits: WireLimits = DEFAULT_LIMITS, expected: Expectation | None = None
) -> Message:
    """Decode one whole message from `buf`; Truncated if it ends early, BadSchema if bytes follow it."""
    decoder = MessageDecoder(limits, expected)
    decoder.feed(buf)
    if not decoder.done:
        raise Truncated(
            f"message ends after {decoder.bytes_fed} bytes, {decoder.bytes_needed()} bytes short of "
            f"completing the {decoder.reading}"
        )
    return decoder.result()
