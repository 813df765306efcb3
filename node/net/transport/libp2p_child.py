"""The py-libp2p data-plane process: a libp2p host (TCP, Noise or TLS, Yamux) that a murmur node starts and
drives over local sockets (node/net/transport/control.py).

Each libp2p stream is piped to one local connection.

Never imports hivemind (both register protobuf package `crypto.pb`; see docs/architecture.md), nor
anything from the node but the control protocol. Runs under trio, the only loop py-libp2p supports.
Run as `python -m node.net.transport.libp2p_child --help`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.serialization import deserialize_private_key
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network.config import ConnectionConfig
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.security.tls.transport import PROTOCOL_ID as TLS_PROTOCOL_ID
from libp2p.security.tls.transport import TLSTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.tools.anyio_service import background_trio_service

from node.net.transport import control

logger = logging.getLogger("murmur.libp2p_child")

# Bytes moved per read between a libp2p stream and its local connection.
_CHUNK = 1 << 18
# How long known addresses of a peer stay in the peerstore; peers re-announce them every heartbeat.
_ADDR_TTL_S = 3600
_CIRCUIT = "/p2p-circuit"
# A peer's direct addresses are tried this long before the circuits through its relays.
_DIRECT_FIRST_S = 3.0
_RELAY_CHECK_S = 1.0  # how often the reservations and connections are looked at
_RESERVE_RETRY_S = 5.0


@dataclass(frozen=True)
class ChildSettings:
    control_fd: int
    identity_path: Path
    expected_peer_id: str
    listen: tuple[str, ...]
    stream_socket: Path  # the child listens here for the node's outgoing streams
    node_socket: Path  # the node listens here for streams the child accepted
    io_timeout_s: float  # one read or write on a libp2p stream or a local connection
    dial_timeout_s: float
    relays: tuple[str, ...] = ()  # behind NAT: reserve slots at these relays (full multiaddrs)


def load_key_pair(identity_path: Path) -> KeyPair:
    """The node's identity file (protobuf-wrapped private key, as p2pd reads it) as a py-libp2p key pair."""
    private = deserialize_private_key(identity_path.read_bytes())
    return KeyPair(private, private.get_public_key())


def make_host(key_pair: KeyPair, settings: ChildSettings) -> Any:  # libp2p.abc.IHost, typed loosely upstream
    # Explicit security and muxer maps: new_host's defaults would also accept plaintext, SECIO and Mplex.
    security = {
        NOISE_PROTOCOL_ID: NoiseTransport(key_pair, noise_privkey=create_new_x25519_key_pair().private_key),
        TLS_PROTOCOL_ID: TLSTransport(key_pair),
    }
    return new_host(
        key_pair=key_pair,
        sec_opt=security,
        muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
        listen_addrs=[multiaddr.Multiaddr(addr) for addr in settings.listen],
        enable_mDNS=False,
        enable_upnp=False,
        # max_connections_per_peer=1: without it every dial waits 250 ms for a possible second
        # connection. No minimum and a zero low watermark: the node decides whom to dial, never the
        # host's auto-connector (it would redial every peer it ever saw).
        connection_config=ConnectionConfig(max_connections_per_peer=1, dial_timeout=settings.dial_timeout_s,
                                           min_connections=0, low_watermark=0),
        negotiate_timeout=max(1, int(settings.dial_timeout_s)),
    )


class Relaying:
    """Circuit relay v2 (py-libp2p's, which interoperates with p2pd's): dial peers through their relays'
    circuits, and, behind NAT, hold slots at our relays so that peers can dial us through them."""

    def __init__(self, host: Any, relays: Sequence[str]) -> None:
        self.host = host
        self.relays = tuple(relays)
        self.protocol = CircuitV2Protocol(host, allow_hop=False)
        # STOP only: a CLIENT would first ask every relay it dials through for a slot of its own
        self.transport = CircuitV2Transport(host, self.protocol, RelayConfig(roles=RelayRole.STOP))
        self.held: dict[str, bool] = dict.fromkeys(self.relays, False)
        self._tried: dict[str, float] = {}

    def circuits(self, peer_id: str) -> list[str]:
        return [f"{relay}{_CIRCUIT}/p2p/{peer_id}" for relay, held in self.held.items() if held]

    def relayed_peers(self) -> list[str]:
        """Peers this host is connected to only through a relay."""
        out = []
        for peer, conns in list(self.host.get_network().connections.items()):
            kinds = [_relayed(conn) for conn in (conns if isinstance(conns, list) else [conns])]
            if kinds and all(kinds):
                out.append(peer.to_base58())
        return out

    async def keep_slots(self, nursery: trio.Nursery) -> None:
        """Reserve at each relay, again when its connection is gone (py-libp2p refreshes held slots)."""
        while True:
            connected = self.host.get_network().connections
            for relay in self.relays:
                relay_id = ID.from_base58(relay.rsplit("/p2p/", 1)[1])
                if self.held[relay] and relay_id not in connected:
                    self.held[relay] = False
                    logger.warning("relay %s lost", relay_id)
                if not self.held[relay] and trio.current_time() - self._tried.get(relay, -1e9) > _RESERVE_RETRY_S:
                    self._tried[relay] = trio.current_time()
                    nursery.start_soon(self._reserve, relay, relay_id, nursery)
            await trio.sleep(_RELAY_CHECK_S)

    async def _reserve(self, relay: str, relay_id: ID, nursery: trio.Nursery) -> None:
        try:
            with trio.fail_after(_RESERVE_RETRY_S * 2):
                await self.host.connect(PeerInfo(relay_id, [_without_peer(relay, relay_id.to_base58())]))
                stream = await self.host.new_stream(relay_id, [HOP_PROTOCOL_ID])
                self.held[relay] = bool(await self.transport.reserve(stream, relay_id, nursery))
        except Exception as exc:
            logger.info("no slot at relay %s yet: %s", relay_id, _reason(exc))


class Child:
    """The child's state: its host, the control channel, and the bridges between streams and sockets."""

    def __init__(self, settings: ChildSettings, host: Any, control_stream: trio.SocketStream) -> None:
        self.settings = settings
        self.host = host
        self.control = control_stream
        self.send_lock = trio.Lock()
        self.relaying = Relaying(host, settings.relays)

    async def report_state(self) -> None:
        """Tell the node whenever the circuits held or the relayed peers change."""
        last: tuple[list[str], list[str]] | None = None
        peer_id = self.host.get_id().to_base58()
        while True:
            now = (self.relaying.circuits(peer_id), sorted(self.relaying.relayed_peers())[:64])
            if now != last:
                await self.send_control(control.Op.STATE, circuits=now[0], relayed=now[1])
                last = now
            await trio.sleep(_RELAY_CHECK_S)

    async def send_control(self, op: control.Op, **fields: object) -> None:
        async with self.send_lock:
            with trio.fail_after(self.settings.io_timeout_s):
                await self.control.send_all(control.encode(op, **fields))

    async def control_loop(self, nursery: trio.Nursery) -> None:
        """Serve the node's requests until it says stop or its end closes (the node is gone)."""
        while True:
            frame = await read_frame(self.control, None, (control.Op.CONNECT, control.Op.SERVE, control.Op.STOP))
            if not isinstance(frame, control.Connect | control.Serve):
                return  # stop, or the node's end closed
            nursery.start_soon(self.answer, frame)

    async def answer(self, frame: control.Connect | control.Serve) -> None:
        try:
            if isinstance(frame, control.Connect):
                await self.connect(frame.peer, frame.maddrs, frame.timeout)
            else:
                self.host.set_stream_handler(TProtocol(frame.protocol), self.on_incoming)
        except Exception as exc:
            await self.send_control(control.Op.RESULT, id=frame.id, ok=False, error=_reason(exc))
        else:
            await self.send_control(control.Op.RESULT, id=frame.id, ok=True, error="")

    async def connect(self, peer: str, maddrs: Sequence[str], timeout_s: float) -> None:
        """Dial `peer` at its direct addresses first, then through the circuits of its relays."""
        peer_id = ID.from_base58(peer)
        direct = [_without_peer(addr, peer) for addr in maddrs if _CIRCUIT not in addr]
        circuits = [multiaddr.Multiaddr(addr) for addr in maddrs if _CIRCUIT in addr]
        failure: BaseException | None = None
        if direct:
            try:
                with trio.fail_after(min(_DIRECT_FIRST_S, timeout_s) if circuits else timeout_s):
                    await self.host.connect(PeerInfo(peer_id, direct))
                return
            except Exception as exc:
                failure = exc
        for circuit in circuits:
            try:
                with trio.fail_after(timeout_s):
                    await self.relaying.transport.dial(circuit)
                return
            except Exception as exc:
                failure = exc
        raise failure if failure is not None else ValueError(f"no address to dial {peer} at")

    async def serve_outgoing(self, local: trio.SocketStream) -> None:
        """One connection to the stream socket: an `open` request, then the stream's bytes."""
        try:
            frame = await read_frame(local, self.settings.io_timeout_s, (control.Op.OPEN,))
            if not isinstance(frame, control.Open):
                return
            try:
                with trio.fail_after(frame.timeout):
                    stream = await self.host.new_stream(ID.from_base58(frame.peer), [TProtocol(frame.protocol)])
            except Exception as exc:
                with trio.fail_after(self.settings.io_timeout_s):
                    await local.send_all(control.encode(control.Op.ERROR, error=_reason(exc)))
                return
            try:
                with trio.fail_after(self.settings.io_timeout_s):
                    await local.send_all(control.encode(control.Op.OPENED, peer=frame.peer))
            except BaseException:
                await _reset(stream)
                raise
            await self.bridge(stream, local)
        except Exception as exc:
            logger.info("outgoing stream request dropped: %s", _reason(exc))
        finally:
            await local.aclose()

    async def on_incoming(self, stream: Any) -> None:  # libp2p.abc.INetStream
        """libp2p handler: pass the stream to the node over a new local connection."""
        peer = str(stream.muxed_conn.peer_id)
        protocol = str(stream.get_protocol())
        try:
            with trio.fail_after(self.settings.io_timeout_s):
                local = await trio.open_unix_socket(str(self.settings.node_socket))
                await local.send_all(control.encode(control.Op.INCOMING, peer=peer, protocol=protocol))
        except (trio.TooSlowError, OSError, trio.BrokenResourceError) as exc:
            logger.info("could not hand a %s stream from %s to the node: %s", protocol, peer, _reason(exc))
            await _reset(stream)
            return
        try:
            await self.bridge(stream, local)
        finally:
            await local.aclose()

    async def bridge(self, stream: Any, local: trio.SocketStream) -> None:
        """Pipe bytes both ways until both ends finished; any failure resets the libp2p stream."""
        timeout = self.settings.io_timeout_s
        failed = False

        async def to_remote() -> None:
            while True:
                with trio.fail_after(timeout):
                    data = await local.receive_some(_CHUNK)
                if not data:
                    with trio.fail_after(timeout):
                        await stream.close_write()
                    return
                with trio.fail_after(timeout):
                    await stream.write(data)

        async def to_local() -> None:
            while True:
                try:
                    with trio.fail_after(timeout):
                        data = await stream.read(_CHUNK)
                except StreamEOF:
                    data = b""
                if not data:
                    with trio.fail_after(timeout):
                        await local.send_eof()
                    return
                with trio.fail_after(timeout):
                    await local.send_all(data)

        async def guarded(pump: Callable[[], Awaitable[None]]) -> None:
            nonlocal failed
            try:
                await pump()
            except Exception as exc:
                failed = True
                logger.debug("stream to %s ends: %s", stream.muxed_conn.peer_id, _reason(exc))
                nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(guarded, to_remote)
            nursery.start_soon(guarded, to_local)
        if failed:
            await _reset(stream)
        else:
            with trio.move_on_after(timeout):
                await stream.close()


async def read_frame(
    local: trio.SocketStream, timeout_s: float | None, expect: tuple[control.Op, ...]
) -> control.Frame | None:
    """One control frame, or None on a clean end of stream before it; ControlError if it is bad."""
    with trio.fail_after(timeout_s) if timeout_s is not None else _no_deadline():
        prefix = await _receive_exactly(local, control.LENGTH_BYTES)
        if prefix is None:
            return None
        body = await _receive_exactly(local, control.frame_length(prefix))
    if body is None:
        raise control.ControlError("control connection closed inside a frame")
    return control.decode_body(body, expect)


async def _receive_exactly(local: trio.SocketStream, n: int) -> bytes | None:
    buffer = bytearray()
    while len(buffer) < n:
        data = await local.receive_some(n - len(buffer))
        if not data:
            if buffer:
                raise control.ControlError("control connection closed inside a frame")
            return None
        buffer += data
    return bytes(buffer)


def _no_deadline() -> trio.CancelScope:
    return trio.CancelScope()


async def _reset(stream: Any) -> None:
    with trio.move_on_after(1.0):
        try:
            await stream.reset()
        except Exception as exc:
            logger.debug("reset failed: %s", exc)


def _without_peer(maddr: str, peer: str) -> multiaddr.Multiaddr:
    suffix = f"/p2p/{peer}"
    return multiaddr.Multiaddr(maddr[: -len(suffix)] if maddr.endswith(suffix) else maddr)


def _relayed(conn: Any) -> bool:
    """Whether a swarm connection runs through a relay (py-libp2p tags them RELAYED, or by address)."""
    kind = getattr(conn, "_get_connection_type_metadata", lambda: None)()
    if getattr(kind, "name", "") == "RELAYED":
        return True
    with contextlib.suppress(Exception):
        return any(_CIRCUIT in str(addr) for addr in conn.get_transport_addresses())
    return False


def _reason(exc: BaseException) -> str:
    if isinstance(exc, trio.TooSlowError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def _unix_listener(path: Path) -> trio.SocketListener:
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await sock.bind(str(path))
    sock.listen(128)
    return trio.SocketListener(sock)


async def run(settings: ChildSettings) -> int:
    key_pair = load_key_pair(settings.identity_path)
    peer_id = ID.from_pubkey(key_pair.public_key).to_base58()
    if peer_id != settings.expected_peer_id:
        print(f"libp2p child: the identity gives peer id {peer_id}, the node expects {settings.expected_peer_id}",
              file=sys.stderr)
        return 2
    host = make_host(key_pair, settings)
    control_stream = trio.SocketStream(trio.socket.from_stdlib_socket(socket.socket(fileno=settings.control_fd)))
    child = Child(settings, host, control_stream)
    listener = await _unix_listener(settings.stream_socket)
    async with host.run(listen_addrs=[multiaddr.Multiaddr(addr) for addr in settings.listen]), \
            trio.open_nursery() as nursery, background_trio_service(child.relaying.protocol):
        nursery.start_soon(trio.serve_listeners, child.serve_outgoing, [listener])
        maddrs = [f"{addr}/p2p/{peer_id}" if "/p2p/" not in str(addr) else str(addr) for addr in host.get_addrs()]
        await child.send_control(control.Op.READY, peer_id=peer_id, maddrs=maddrs)
        if settings.relays:
            nursery.start_soon(child.relaying.keep_slots, nursery)
        nursery.start_soon(child.report_state)
        await child.control_loop(nursery)
        nursery.cancel_scope.cancel()
    return 0


def parse_args(argv: Sequence[str]) -> ChildSettings:
    parser = argparse.ArgumentParser(prog="python -m node.net.transport.libp2p_child",
                                     description="murmur's py-libp2p data-plane process (started by a node)")
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--identity", type=Path, required=True)
    parser.add_argument("--peer-id", required=True, help="the peer id the identity must give")
    parser.add_argument("--listen", action="append", required=True)
    parser.add_argument("--stream-socket", type=Path, required=True)
    parser.add_argument("--node-socket", type=Path, required=True)
    parser.add_argument("--io-timeout", type=float, default=30.0)
    parser.add_argument("--dial-timeout", type=float, default=10.0)
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--relay", action="append", default=[], help="reserve a slot at this relay (behind NAT)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return ChildSettings(args.control_fd, args.identity, args.peer_id, tuple(args.listen), args.stream_socket,
                         args.node_socket, args.io_timeout, args.dial_timeout, tuple(args.relay))


def main(argv: Sequence[str] | None = None) -> int:
    # The node starts us with PR_SET_PDEATHSIG (node.net.proc), so we die with it.
    settings = parse_args(sys.argv[1:] if argv is None else argv)
    # The node stops us over the control channel; a terminal's Ctrl-C reaches the node, which does.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return trio.run(run, settings)


if __name__ == "__main__":
    sys.exit(main())
