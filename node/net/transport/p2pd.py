"""The default data-plane transport: raw libp2p streams through the p2pd daemon that hivemind's `P2P`
runs, the same daemon (one identity, one process) that carries the DHT.

Also starts that daemon with murmur's network rules: loopback by default, no UPnP, and the relay
settings of node.net.reachability (through node.net.hivemind_adapter, where p2pd needs workarounds).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure, raise_if_failed, read_pbmsg_safe, write_pbmsg
from hivemind.proto import p2pd_pb2

from gossip.limits import IncomingGate
from gossip.transport import PeerUnreachable, StreamClosed, StreamHandler
from node.net.hivemind_adapter import (
    RELAY_SERVICE_ENV,
    RelayLimits,
    autorelay_args,
    daemon_class,
    is_circuit,
    maddr_bytes,
    relay_service_args,
)
from node.net.proc import asyncio_children_die_with_us
from node.net.transport.goodput import GoodputMeter, StreamTiming

logger = logging.getLogger(__name__)

LOOPBACK_MADDRS = ("/ip4/127.0.0.1/tcp/0",)

# Bytes handed to the daemon per write() before awaiting drain(): bounds the copy asyncio makes of
# a large buffer and lets the byte counter follow progress.
_WRITE_CHUNK = 1 << 20
# Read buffer for streams we open; asyncio's 64 KiB default costs a pause/resume cycle per 128 KiB.
_READ_LIMIT = 1 << 22
# How long a dial of a peer's direct addresses may take before its relays' circuits are tried.
DIRECT_FIRST_S = 3.0

AddressBook = Callable[[str], Sequence[str]]


@dataclass(frozen=True)
class P2PSettings:
    """How to start p2pd. Defaults follow murmur's network rules; widening them is an explicit choice."""

    identity_path: Path | None  # None: a fresh random identity (a throwaway daemon, node.net.probe)
    host_maddrs: tuple[str, ...] = LOOPBACK_MADDRS
    announce_maddrs: tuple[str, ...] = ()
    initial_peers: tuple[str, ...] = ()
    # UPnP port mapping multicasts on every interface: opt-in for real deployments only.
    nat_port_map: bool = False
    # The relay transport: needed to dial peers behind NAT through their relays.
    use_relay: bool = True
    # "public" / "private" fixes what libp2p's AutoNAT would otherwise have to find out.
    force_reachability: str | None = None
    # Reserve slots at these relays (full multiaddrs) and be reachable through them (behind NAT).
    relays: tuple[str, ...] = ()
    # Serve as a relay with these limits (None: only p2pd's built-in minimal relay service).
    relay_service: RelayLimits | None = None
    # AutoNAT service and hole punching (DCUtR); they come together in p2pd (-autonat).
    hole_punching: bool = False
    dht_mode: str = "server"
    startup_timeout_s: float = 15.0

    def extra_args(self) -> tuple[str, ...]:
        """What p2pd needs beyond `P2P.create`'s arguments (node.net.hivemind_adapter)."""
        args = autorelay_args(self.relays)
        if self.relay_service is not None:
            args += relay_service_args(self.relay_service)
        elif self.use_relay:
            args += ("-relayService=0",)
        return args

    def env(self) -> tuple[tuple[str, str], ...]:
        """Environment p2pd needs beyond this process's (node.net.hivemind_adapter, workaround 3)."""
        return RELAY_SERVICE_ENV if self.relay_service is not None else ()


async def start_p2pd(settings: P2PSettings) -> P2P:
    """Start p2pd with `settings`; the daemon is SIGKILLed if this process dies without shutting it down."""
    force = None if settings.relay_service is not None else settings.force_reachability
    async with asyncio.timeout(settings.startup_timeout_s + 5.0):
        with asyncio_children_die_with_us():
            p2p: P2P = await daemon_class(settings.extra_args(), settings.env()).create(
                initial_peers=list(settings.initial_peers) or None,
                host_maddrs=list(settings.host_maddrs),
                announce_maddrs=list(settings.announce_maddrs) or None,
                identity_path=str(settings.identity_path) if settings.identity_path else None,
                # Our identity lock already keeps two local nodes apart; hivemind's network check
                # would start a second, anonymous daemon with UPnP on.
                check_if_identity_free=False,
                nat_port_map=settings.nat_port_map,
                use_relay=settings.use_relay,
                use_auto_relay=bool(settings.relays),
                trusted_relays=list(settings.relays) or None,
                force_reachability=force,
                use_ipfs=False,
                auto_nat=settings.hole_punching,
                dht_mode=settings.dht_mode,
                startup_timeout=settings.startup_timeout_s,
            )
            return p2p


class _ByteCounts:
    __slots__ = ("goodput", "received", "sent")

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0
        self.goodput = GoodputMeter()


class P2PDStream:
    """One libp2p stream, seen as the unix-socket connection p2pd pipes it through.

    Any failure or cancellation of a read or write aborts the stream: after a timeout the position
    in the byte stream is unknown, so the stream is unusable, and aborting frees the daemon's side
    at once instead of leaving it half-open. Later calls raise StreamClosed.
    """

    def __init__(
        self,
        remote_peer: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        counts: _ByteCounts,
        live: set[P2PDStream],
        close_timeout_s: float,
    ) -> None:
        self._remote_peer = remote_peer
        self._reader = reader
        self._writer = writer
        self._counts = counts
        self._live = live  # the transport's open streams, so closing it can drop them
        self._close_timeout_s = close_timeout_s
        self._closed = False
        self._timing = StreamTiming()
        self._live.add(self)

    @property
    def remote_peer(self) -> str:
        return self._remote_peer

    @property
    def closed(self) -> bool:
        return self._closed

    async def read_exactly(self, n: int) -> bytes:
        if self._closed:
            raise StreamClosed(f"stream to {self._remote_peer} is closed")
        try:
            data = await self._reader.readexactly(n)
        except asyncio.IncompleteReadError as exc:
            self.abort()
            raise StreamClosed(
                f"{self._remote_peer} closed the stream after {len(exc.partial)} of {n} bytes"
            ) from None
        except (ConnectionError, OSError) as exc:
            self.abort()
            raise StreamClosed(f"stream to {self._remote_peer} failed: {exc}") from exc
        except BaseException:
            self.abort()
            raise
        self._counts.received += n
        self._timing.read(n)
        return data

    async def write(self, data: bytes | memoryview) -> None:
        if self._closed:
            raise StreamClosed(f"stream to {self._remote_peer} is closed")
        view = memoryview(data).cast("B")
        try:
            for offset in range(0, len(view), _WRITE_CHUNK):
                chunk = view[offset : offset + _WRITE_CHUNK]
                self._writer.write(chunk)
                await self._writer.drain()
                self._counts.sent += len(chunk)
        except (ConnectionError, OSError) as exc:
            self.abort()
            raise StreamClosed(f"stream to {self._remote_peer} failed: {exc}") from exc
        except BaseException:
            self.abort()
            raise

    def _done(self) -> None:
        self._closed = True
        self._live.discard(self)
        self._counts.goodput.add_sample(self._remote_peer, self._timing.nbytes, self._timing.seconds)

    async def close(self) -> None:
        """Flush what was written, then close; the remote reads everything, then end of stream."""
        if self._closed:
            return
        self._done()
        try:
            self._writer.close()
            async with asyncio.timeout(self._close_timeout_s):
                await self._writer.wait_closed()
        except (TimeoutError, ConnectionError, OSError):
            self._writer.transport.abort()
        except BaseException:
            self._writer.transport.abort()
            raise

    def abort(self) -> None:
        """Drop the stream now, discarding unsent bytes."""
        if not self._closed:
            self._done()
        self._writer.transport.abort()


class P2PDTransport:
    """`gossip.transport.Transport` over an existing hivemind `P2P` (shared with the DHT).

    The transport does not own the daemon: `close()` removes its handlers and drops its streams,
    and whoever started the `P2P` shuts it down afterwards.
    """

    def __init__(self, p2p: P2P, *, open_timeout_s: float = 10.0, close_timeout_s: float = 5.0,
                 gate: IncomingGate | None = None) -> None:
        self._p2p = p2p
        self._gate = gate  # incoming streams pass it before their handler reads a byte
        self._open_timeout_s = open_timeout_s
        self._close_timeout_s = close_timeout_s
        self._counts = _ByteCounts()
        self._streams: set[P2PDStream] = set()
        self._protocols: set[str] = set()
        self._handler_tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._address_book: AddressBook | None = None
        self.redials = 0  # streams that opened only after a re-dial (a relay or connection lost meanwhile)

    def set_address_book(self, addresses: AddressBook) -> None:
        """Where each peer can be dialled (its DHT record's maddrs): a stream that cannot be opened on the
        connection the daemon has (say, its relay died) is opened again after a dial of these."""
        self._address_book = addresses

    @property
    def peer_id(self) -> str:
        peer_id: str = self._p2p.peer_id.to_base58()
        return peer_id

    @property
    def bytes_sent(self) -> int:
        return self._counts.sent

    @property
    def bytes_received(self) -> int:
        return self._counts.received

    def goodput_mbit_s(self, peer_id: str) -> float | None:
        """How fast gossip payloads arrived from `peer_id` lately (None: no large transfer yet)."""
        return self._counts.goodput.mbit_s(peer_id)

    async def maddrs(self) -> tuple[str, ...]:
        """Full multiaddrs others can dial, each ending in /p2p/<peer id>."""
        async with asyncio.timeout(self._open_timeout_s):
            return tuple(str(addr) for addr in await self._p2p.get_visible_maddrs())

    async def connect(self, peer_id: str, maddrs: Sequence[str]) -> None:
        """Tell the daemon where `peer_id` listens and dial it (e.g. with addresses from its DHT record).

        Direct addresses first: only if none answers within DIRECT_FIRST_S are the circuits through the
        peer's relays dialled, so a peer reachable both ways gets a direct connection, which libp2p then
        uses for every stream (bulk exchanges prefer direct connections).
        """
        direct = [addr for addr in maddrs if not is_circuit(addr)]
        if direct and len(direct) < len(maddrs):
            try:
                await self._connect(peer_id, direct, min(DIRECT_FIRST_S, self._open_timeout_s))
                return
            except PeerUnreachable as exc:
                logger.debug("%s: no direct connection (%s); dialling its relays' circuits", peer_id, exc)
        await self._connect(peer_id, maddrs, self._open_timeout_s)

    async def _connect(self, peer_id: str, maddrs: Sequence[str], timeout_s: float) -> None:
        # Everything that reads the peer's addresses or id is inside the try: an address that does not
        # parse (a ValueError), a protobuf or daemon error is this peer's PeerUnreachable, never a crash
        # of the round or download that asked for the dial. Cancellation is no Exception and passes.
        try:
            addrs = [maddr_bytes(_transport_part(addr, peer_id)) for addr in maddrs]
            request = p2pd_pb2.Request(
                type=p2pd_pb2.Request.CONNECT,
                connect=p2pd_pb2.ConnectRequest(
                    peer=PeerID.from_base58(peer_id).to_bytes(),
                    addrs=addrs,
                    timeout=math.ceil(timeout_s),
                ),
            )
            async with asyncio.timeout(timeout_s):
                _, writer = await self._daemon_request(request)
        except Exception as exc:
            raise PeerUnreachable(f"cannot connect to {peer_id}: {_reason(exc)}") from exc
        writer.close()

    async def open_stream(self, peer_id: str, protocol: str) -> P2PDStream:
        """A stream to `peer_id`; if the daemon cannot open one (no connection, and the addresses it
        knows fail), the peer's addresses from the address book are dialled and the open tried again."""
        try:
            return await self._open_stream(peer_id, protocol)
        except PeerUnreachable as first:
            maddrs = _addresses(self._address_book, peer_id)
            if not maddrs or self._closed:
                raise
            try:
                await self.connect(peer_id, maddrs)
            except PeerUnreachable:
                raise first from None
            self.redials += 1
            logger.info("re-dialled %s to open a %s stream", peer_id, protocol)
            return await self._open_stream(peer_id, protocol)

    async def _open_stream(self, peer_id: str, protocol: str) -> P2PDStream:
        if self._closed:
            raise RuntimeError("transport is closed")
        try:
            request = p2pd_pb2.Request(
                type=p2pd_pb2.Request.STREAM_OPEN,
                streamOpen=p2pd_pb2.StreamOpenRequest(
                    peer=PeerID.from_base58(peer_id).to_bytes(),
                    proto=[protocol],
                    timeout=math.ceil(self._open_timeout_s),
                ),
            )
            async with asyncio.timeout(self._open_timeout_s):
                reader, writer = await self._daemon_request(request, expect_stream=True)
        except Exception as exc:  # a bad peer id, a daemon or protobuf error: this peer's failure (see _connect)
            raise PeerUnreachable(f"no {protocol} stream to {peer_id}: {_reason(exc)}") from exc
        return P2PDStream(peer_id, reader, writer, self._counts, self._streams, self._close_timeout_s)

    async def _daemon_request(
        self, request: p2pd_pb2.Request, *, expect_stream: bool = False
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        # hivemind's ControlClient sends the same requests but leaves the control connection open
        # when the daemon answers with an error or the caller is cancelled; a stream the daemon
        # opens after we gave up would then stay half-open. Here every failure closes it.
        reader, writer = await asyncio.open_unix_connection(self._p2p.daemon_listen_maddr["unix"], limit=_READ_LIMIT)
        try:
            await write_pbmsg(writer, request)
            response = p2pd_pb2.Response()
            await read_pbmsg_safe(reader, response)
            raise_if_failed(response)
            if expect_stream and not response.HasField("streamInfo"):
                raise ControlFailure("daemon answered without stream info")
        except asyncio.IncompleteReadError:
            writer.transport.abort()
            raise ConnectionError("p2pd closed the control connection") from None
        except BaseException:
            writer.transport.abort()
            raise
        return reader, writer

    async def serve(self, protocol: str, handler: StreamHandler) -> None:
        if self._closed:
            raise RuntimeError("transport is closed")
        if protocol in self._protocols:
            raise ValueError(f"{protocol} is already served")
        if self._gate is not None:
            handler = self._gate.guard(handler)

        async def on_stream(info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            stream = P2PDStream(
                info.peer_id.to_base58(), reader, writer, self._counts, self._streams, self._close_timeout_s
            )
            task = asyncio.current_task()
            assert task is not None  # hivemind runs each stream's handler in a task of its own
            self._handler_tasks.add(task)
            try:
                await handler(stream)
            except Exception:
                # A handler must deal with bad peers itself; this only keeps a bug from going silent.
                logger.exception("%s handler failed on a stream from %s", protocol, stream.remote_peer)
                stream.abort()
            except BaseException:
                stream.abort()
                raise
            finally:
                self._handler_tasks.discard(task)
            await stream.close()

        async with asyncio.timeout(self._open_timeout_s):
            await self._p2p.add_binary_stream_handler(protocol, on_stream)
        self._protocols.add(protocol)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for protocol in sorted(self._protocols):
            try:
                async with asyncio.timeout(self._close_timeout_s):
                    await self._p2p.remove_binary_stream_handler(protocol)
            except Exception as exc:  # the daemon may already be gone; nothing left to unregister then
                logger.debug("could not remove handler %s: %s", protocol, exc)
        self._protocols.clear()
        tasks = set(self._handler_tasks)
        for task in tasks:
            task.cancel()
        for stream in list(self._streams):
            stream.abort()
        if tasks:
            await asyncio.wait(tasks, timeout=self._close_timeout_s)


def _addresses(book: AddressBook | None, peer_id: str) -> Sequence[str]:
    """`peer_id`'s addresses from `book`, none if there is no book or it fails (logged: a bug, not the peer's)."""
    if book is None:
        return ()
    try:
        return book(peer_id)
    except Exception:
        logger.exception("the address book failed on %s; not re-dialling it", peer_id)
        return ()


def _transport_part(maddr: str, peer_id: str) -> str:
    """`/ip4/.../tcp/N/p2p/<id>` -> `/ip4/.../tcp/N`: the daemon takes the peer id separately. A circuit
    address keeps its relay's `/p2p/<relay id>`."""
    suffix = f"/p2p/{peer_id}"
    return maddr[: -len(suffix)] if maddr.endswith(suffix) else maddr


def _reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__
