"""In-memory `Transport` (see gossip.transport) for the simulator and unit tests: peers in one asyncio
loop joined by simulated links (latency, bandwidth, connection loss), with freeze and kill to inject faults.

Link model, per direction of each pair of peers (a network default, overridable per link):
- a write occupies the link direction for len/bandwidth seconds (writes from all streams on that
  direction queue behind each other, and the writer waits until its bytes have left), then arrives
  latency_s later;
- `loss` is the probability that `open_stream` fails with ConnectionError. A reliable stream
  transport retransmits lost packets, so what the exchange protocol sees of a lossy link is a failed
  exchange, not missing bytes: streams that did open deliver every byte, in order.
- opening a stream takes one latency (the dial reaching the peer) before the peer's handler starts.

Faults:
- `freeze(peer)` models a stopped process (SIGSTOP): until `thaw(peer)`, dials to or from it, its
  own reads, and writes in either direction on its streams wait. What it wrote before the freeze
  still arrives and can be read. `close()` never waits, so cleanup always works.
- `kill(peer)` models a crash: its streams end at once (the other side reads what had already arrived,
  then StreamClosed; bytes still in flight are lost), its handlers are cancelled, dials to it fail.
  A graceful `close()` of a stream or transport instead delivers the bytes in flight before the end.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections import deque
from dataclasses import dataclass

from gossip.limits import IncomingGate
from gossip.transport import Stream, StreamClosed, StreamHandler

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LinkModel:
    """One direction of a simulated link: one-way latency, bandwidth, probability a dial fails."""

    latency_s: float = 0.0
    bandwidth_bytes_per_s: float = math.inf
    loss: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"latency_s must be finite and >= 0, got {self.latency_s!r}")
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s!r}")
        if not 0.0 <= self.loss <= 1.0:
            raise ValueError(f"loss must be a probability in [0, 1], got {self.loss!r}")

    def transmit_s(self, nbytes: int) -> float:
        """Seconds the link direction is busy sending `nbytes`."""
        return nbytes / self.bandwidth_bytes_per_s


class InMemoryNetwork:
    """A set of in-memory peers, their links, and the seeded randomness behind connection loss.

    All its transports must be used from one asyncio event loop.
    """

    def __init__(self, link: LinkModel = LinkModel(), rng: random.Random | int = 0) -> None:
        self._default_link = link
        self._links: dict[tuple[str, str], LinkModel] = {}
        self._rng = rng if isinstance(rng, random.Random) else random.Random(rng)
        self._peers: dict[str, InMemoryTransport] = {}
        # When each link direction finishes sending what is already queued on it (loop time).
        self._busy_until: dict[tuple[str, str], float] = {}

    def transport(self, peer_id: str, gate: IncomingGate | None = None) -> InMemoryTransport:
        """Create the transport of `peer_id`; an id whose previous transport was closed may return.
        With `gate`, incoming streams pass it before their handler sees them (gossip.limits)."""
        current = self._peers.get(peer_id)
        if current is not None and current.alive:
            raise ValueError(f"peer {peer_id!r} already has a live transport in this network")
        transport = InMemoryTransport(self, peer_id, gate)
        self._peers[peer_id] = transport
        return transport

    def set_link(self, src: str, dst: str, link: LinkModel, *, both_directions: bool = True) -> None:
        """Override the default link model from `src` to `dst` (and back, unless told otherwise)."""
        self._links[(src, dst)] = link
        if both_directions:
            self._links[(dst, src)] = link

    def link(self, src: str, dst: str) -> LinkModel:
        """The link model for bytes (and dials) going from `src` to `dst`."""
        return self._links.get((src, dst), self._default_link)

    def freeze(self, peer_id: str) -> None:
        """Stop `peer_id` as SIGSTOP would: its dials and reads, and writes to or from it, wait until `thaw`."""
        peer = self._live_peer(peer_id)
        peer._frozen = True
        peer._running.clear()

    def thaw(self, peer_id: str) -> None:
        """Let a frozen `peer_id` continue; waiting operations resume."""
        peer = self._live_peer(peer_id)
        peer._frozen = False
        peer._running.set()
        peer._wake_streams()

    async def kill(self, peer_id: str) -> None:
        """Crash `peer_id`: streams end abruptly on both sides, handlers are cancelled, dials fail."""
        await self._live_peer(peer_id)._shut_down(graceful=False)

    def _live_peer(self, peer_id: str) -> InMemoryTransport:
        peer = self._peers.get(peer_id)
        if peer is None or not peer.alive:
            raise ValueError(f"no live peer {peer_id!r} in this network")
        return peer

    def _lookup(self, peer_id: str) -> InMemoryTransport:
        peer = self._peers.get(peer_id)
        if peer is None:
            raise ConnectionError(f"unknown peer {peer_id!r}: no transport with that id in this network")
        return peer

    def _draw_loss(self, link: LinkModel) -> bool:
        return link.loss > 0 and self._rng.random() < link.loss

    def _send(self, pipe: _Pipe, payload: bytes) -> float:
        """Queue `payload` on the pipe's link direction; return the loop time its last byte leaves."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        key = (pipe.src.peer_id, pipe.dst.peer_id)
        link = self.link(*key)
        leaves = max(now, self._busy_until.get(key, now)) + link.transmit_s(len(payload))
        self._busy_until[key] = leaves
        pipe.push(payload, leaves + link.latency_s)
        return leaves

    def _send_end(self, pipe: _Pipe) -> None:
        loop = asyncio.get_running_loop()
        pipe.push(None, loop.time() + self.link(pipe.src.peer_id, pipe.dst.peer_id).latency_s)


class InMemoryTransport:
    """One peer's endpoint in an InMemoryNetwork; implements gossip.transport.Transport."""

    def __init__(self, network: InMemoryNetwork, peer_id: str, gate: IncomingGate | None = None) -> None:
        self._network = network
        self._peer_id = peer_id
        self._gate = gate
        self._handlers: dict[str, StreamHandler] = {}
        self._streams: set[_StreamEnd] = set()
        self._handler_tasks: set[asyncio.Task[None]] = set()
        self._alive = True
        self._frozen = False
        self._running = asyncio.Event()
        self._running.set()
        self._bytes_sent = 0
        self._bytes_received = 0
        self._handler_errors = 0

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def alive(self) -> bool:
        """False once closed or killed."""
        return self._alive

    @property
    def bytes_sent(self) -> int:
        """Payload bytes written by this peer's streams."""
        return self._bytes_sent

    @property
    def bytes_received(self) -> int:
        """Payload bytes that arrived at this peer's open streams."""
        return self._bytes_received

    @property
    def handler_errors(self) -> int:
        """Handlers that ended with an exception (each is also logged)."""
        return self._handler_errors

    async def open_stream(self, peer_id: str, protocol: str) -> Stream:
        """Dial `peer_id` and start its handler for `protocol`; ConnectionError if that fails."""
        self._check_alive()
        if peer_id == self._peer_id:
            raise ConnectionError(f"peer {peer_id!r} cannot open a stream to itself")
        target = self._network._lookup(peer_id)
        link = self._network.link(self._peer_id, peer_id)
        # Drawn before any wait, so the n-th dial of a run always gets the n-th draw.
        lost = self._network._draw_loss(link)
        await asyncio.sleep(link.latency_s)
        # A stopped process neither completes nor refuses a handshake.
        while self._alive and target._alive and (self._frozen or target._frozen):
            await (self if self._frozen else target)._running.wait()
        self._check_alive()
        if not target._alive:
            raise ConnectionError(f"peer {peer_id!r} is down (its transport was closed or killed)")
        if lost:
            raise ConnectionError(f"connection to {peer_id!r} dropped (simulated link loss {link.loss})")
        handler = target._handlers.get(protocol)
        if handler is None:
            raise ConnectionError(f"peer {peer_id!r} does not serve protocol {protocol!r}")
        ours, theirs = _stream_pair(self, target)
        target._start_handler(handler, theirs, protocol)
        return ours

    async def serve(self, protocol: str, handler: StreamHandler) -> None:
        """Run `handler` as a task for each incoming stream of `protocol`; the stream closes when it returns."""
        self._check_alive()
        if protocol in self._handlers:
            raise ValueError(f"peer {self._peer_id!r} already serves protocol {protocol!r}")
        self._handlers[protocol] = handler if self._gate is None else self._gate.guard(handler)

    async def close(self) -> None:
        """Close every stream (the other sides get the bytes in flight, then StreamClosed) and stop handlers."""
        await self._shut_down(graceful=True)

    def _check_alive(self) -> None:
        if not self._alive:
            raise ConnectionError(f"transport of peer {self._peer_id!r} is closed")

    def _start_handler(self, handler: StreamHandler, stream: _StreamEnd, protocol: str) -> None:
        task = asyncio.create_task(
            self._run_handler(handler, stream, protocol),
            name=f"memory handler {protocol} {stream.remote_peer}->{self._peer_id}",
        )
        self._handler_tasks.add(task)
        task.add_done_callback(self._handler_tasks.discard)

    async def _run_handler(self, handler: StreamHandler, stream: _StreamEnd, protocol: str) -> None:
        try:
            await handler(stream)
        except Exception:
            # A failing handler must not take the peer down; the exchange layer counts its own errors.
            self._handler_errors += 1
            _log.exception("handler for %s on %s failed (stream from %s)", protocol, self._peer_id, stream.remote_peer)
        finally:
            await stream.close()

    def _wake_streams(self) -> None:
        for stream in self._streams:
            stream._wake()
            stream._peer_end._wake()

    async def _shut_down(self, *, graceful: bool) -> None:
        if not self._alive:
            return
        self._alive = False
        self._frozen = False
        self._running.set()  # dials waiting on a frozen peer see it is gone
        self._handlers.clear()
        for stream in list(self._streams):
            if graceful:
                await stream.close()
            else:
                stream._abort()
        current = asyncio.current_task()
        tasks = [task for task in self._handler_tasks if task is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Pipe:
    """One direction of a stream: bytes in flight (with arrival times) and bytes arrived, unread."""

    def __init__(self, src: InMemoryTransport, dst: InMemoryTransport) -> None:
        self.src = src
        self.dst = dst
        self.reader: _StreamEnd | None = None
        self.arrived = bytearray()
        self.ended = False  # the writer's end-of-stream has arrived
        self.discarding = False  # the reader closed: nothing more is kept
        # (sequence number, payload or None for end-of-stream), in send order.
        self._in_flight: deque[tuple[int, bytes | None]] = deque()
        self._next_seq = 0
        self._last_arrival = -math.inf

    def push(self, payload: bytes | None, arrival: float) -> None:
        """Schedule `payload` (None: end of stream) to arrive at loop time `arrival`, after earlier pushes."""
        if self.discarding:
            return
        seq = self._next_seq
        self._next_seq += 1
        # Arrival times within one stream never decrease, so bytes stay in order even if the
        # link model changes mid-stream.
        self._last_arrival = max(arrival, self._last_arrival)
        self._in_flight.append((seq, payload))
        asyncio.get_running_loop().call_at(self._last_arrival, self._arrive_through, seq)

    def cut(self) -> None:
        """The writer crashed: bytes in flight are lost and the reader sees the end now."""
        self._in_flight.clear()
        self.ended = True
        if self.reader is not None:
            self.reader._wake()

    def discard(self) -> None:
        """The reader closed: drop what arrived and whatever is still coming."""
        self.discarding = True
        self._in_flight.clear()
        self.arrived.clear()

    def _arrive_through(self, seq: int) -> None:
        # Timers with equal deadlines may fire in any order; delivering everything up to `seq`
        # keeps the stream ordered regardless.
        while self._in_flight and self._in_flight[0][0] <= seq:
            _, payload = self._in_flight.popleft()
            if payload is None:
                self.ended = True
            else:
                self.arrived += payload
                self.dst._bytes_received += len(payload)
        if self.reader is not None:
            self.reader._wake()


class _StreamEnd:
    """One peer's end of an in-memory stream; implements gossip.transport.Stream."""

    def __init__(self, local: InMemoryTransport, remote: InMemoryTransport, inbound: _Pipe, outbound: _Pipe) -> None:
        self._local = local
        self._remote = remote
        self._inbound = inbound
        self._outbound = outbound
        self._peer_end: _StreamEnd = self  # set by _stream_pair
        self._closed = False
        self._changed = asyncio.Event()

    @property
    def remote_peer(self) -> str:
        return self._remote.peer_id

    async def read_exactly(self, n: int) -> bytes:
        """Exactly n bytes, or StreamClosed if either side closes first. Waits while this peer is frozen."""
        if n < 0:
            raise ValueError(f"cannot read a negative number of bytes ({n})")
        while True:
            if self._closed:
                raise StreamClosed(f"stream to {self.remote_peer!r} was closed locally")
            if not self._local._frozen:
                arrived = self._inbound.arrived
                if len(arrived) >= n:
                    with memoryview(arrived) as view:
                        data = bytes(view[:n])
                    del arrived[:n]
                    return data
                if self._inbound.ended:
                    raise StreamClosed(
                        f"{self.remote_peer!r} closed the stream after {len(arrived)} of {n} bytes"
                    )
            await self._wait_for_change()

    async def write(self, data: bytes | memoryview) -> None:
        """Send `data`; returns once its last byte has left (bandwidth), not when it arrives (latency).

        Waits while either end is frozen.
        """
        payload = bytes(data)  # the caller may reuse its buffer once we return
        while True:
            if self._closed:
                raise StreamClosed(f"stream to {self.remote_peer!r} was closed locally")
            if self._inbound.ended:
                raise StreamClosed(f"{self.remote_peer!r} closed the stream")
            if not self._frozen():
                break
            await self._wait_for_change()
        if not payload:
            return
        self._local._bytes_sent += len(payload)
        leaves = self._local._network._send(self._outbound, payload)
        await asyncio.sleep(max(0.0, leaves - asyncio.get_running_loop().time()))

    async def close(self) -> None:
        """Close both directions; bytes already written still reach the other side before the end."""
        if self._closed:
            return
        self._closed = True
        self._local._streams.discard(self)
        self._inbound.discard()
        if not self._outbound.discarding:
            self._local._network._send_end(self._outbound)
        self._wake()

    def _abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._local._streams.discard(self)
        self._inbound.discard()
        self._outbound.cut()
        self._wake()

    def _frozen(self) -> bool:
        return self._local._frozen or self._remote._frozen

    def _wake(self) -> None:
        self._changed.set()

    async def _wait_for_change(self) -> None:
        # Safe without a lock: nothing runs between the caller's checks and this clear().
        self._changed.clear()
        await self._changed.wait()


def _stream_pair(opener: InMemoryTransport, acceptor: InMemoryTransport) -> tuple[_StreamEnd, _StreamEnd]:
    forward = _Pipe(opener, acceptor)
    backward = _Pipe(acceptor, opener)
    ours = _StreamEnd(opener, acceptor, inbound=backward, outbound=forward)
    theirs = _StreamEnd(acceptor, opener, inbound=forward, outbound=backward)
    ours._peer_end, theirs._peer_end = theirs, ours
    forward.reader, backward.reader = theirs, ours
    opener._streams.add(ours)
    acceptor._streams.add(theirs)
    return ours, theirs

