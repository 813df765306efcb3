"""Dial-back (`/murmur/dialback/1`): a node asks a peer to open TCP connections back to it, to learn
whether others can reach it directly and at what address they see it (its observed address).

Public nodes and bootstraps answer. To keep the answer from being a scanner for hire, a node dials
only the address the request came from (the asker's own, as seen on the connection) and only at the
few ports the asker names, a few askers at a time, a few times per asker, with a short timeout; a
relayed asker gets its observed address and no dials. (Not per address: the nodes of a local swarm, or
of one house, share one.) A TCP handshake is all it checks: a NAT drops the SYN, so no handshake
means no direct reachability, whatever listens behind it.

Frames: a 4-byte big-endian length (at most 1 KiB) and a msgpack map, checked against a declared schema.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Annotated

import msgspec
from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from gossip.transport import Stream
from node.net.hivemind_adapter import is_circuit

logger = logging.getLogger(__name__)

DIALBACK_PROTOCOL = "/murmur/dialback/1"
MAX_PORTS = 4
DIAL_TIMEOUT_S = 3.0
ANSWER_TIMEOUT_S = DIAL_TIMEOUT_S + 4.0
_MAX_FRAME = 1024
_MAX_CONCURRENT = 4
_WINDOW_S = 30.0  # at most _PER_WINDOW answers to one asker (peer id) in this long
_PER_WINDOW = 4
_REMEMBERED_ASKERS = 1024

Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]


class DialbackRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    v: Annotated[int, msgspec.Meta(ge=1, le=1)]
    ports: Annotated[tuple[Port, ...], msgspec.Meta(min_length=1, max_length=MAX_PORTS)]


class DialbackReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    v: Annotated[int, msgspec.Meta(ge=1, le=1)]
    observed: Annotated[str, msgspec.Meta(max_length=512)]  # the asker's address as this node sees it
    reachable: Annotated[tuple[Port, ...], msgspec.Meta(max_length=MAX_PORTS)]  # ports a handshake completed on
    refused: Annotated[str, msgspec.Meta(max_length=128)] = ""  # why nothing was dialled, if so


@dataclass(frozen=True)
class ObservedAddress:
    host: str  # an IP address
    port: int
    relayed: bool  # the asker came through a relay: nothing to dial

    @classmethod
    def of(cls, maddr: str) -> ObservedAddress | None:
        """`/ip4/1.2.3.4/tcp/5` (or ip6) -> its host and port; circuits are relayed; None otherwise."""
        if is_circuit(maddr):
            return cls("", 0, relayed=True)
        parts = maddr.strip("/").split("/")
        if len(parts) >= 4 and parts[0] in ("ip4", "ip6") and parts[2] == "tcp":
            try:
                return cls(str(ipaddress.ip_address(parts[1])), int(parts[3]), relayed=False)
            except ValueError:
                return None
        return None


_ENCODER = msgspec.msgpack.Encoder()
_REQUEST = msgspec.msgpack.Decoder(DialbackRequest)
_REPLY = msgspec.msgpack.Decoder(DialbackReply)


def _frame(message: msgspec.Struct) -> bytes:
    body = _ENCODER.encode(message)
    return len(body).to_bytes(4, "big") + body


async def _tcp_handshake(host: str, port: int) -> bool:
    try:
        async with asyncio.timeout(DIAL_TIMEOUT_S):
            _, writer = await asyncio.open_connection(host, port)
    except (OSError, TimeoutError):
        return False
    writer.transport.abort()
    return True


class DialbackServer:
    """Answers dial-back requests on a node's p2pd (see the module docstring for the bounds)."""

    def __init__(self, p2p: P2P) -> None:
        self._p2p = p2p
        self._slots = asyncio.Semaphore(_MAX_CONCURRENT)
        # asker -> when it was last answered (its latest answers), least recently asked first
        self._answered: OrderedDict[str, tuple[float, ...]] = OrderedDict()
        self.answered = 0
        self.refused = 0

    async def start(self) -> None:
        await self._p2p.add_binary_stream_handler(DIALBACK_PROTOCOL, self._answer)

    def _cooling_down(self, asker: str) -> bool:
        """Whether `asker` had its share of answers lately; else its answer is counted now."""
        now = asyncio.get_running_loop().time()
        recent = tuple(t for t in self._answered.pop(asker, ()) if now - t < _WINDOW_S)
        if len(recent) >= _PER_WINDOW:
            self._answered[asker] = recent
            return True
        self._answered[asker] = (*recent, now)
        while len(self._answered) > _REMEMBERED_ASKERS:
            self._answered.popitem(last=False)
        return False

    async def _answer(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(ANSWER_TIMEOUT_S):
                length = int.from_bytes(await reader.readexactly(4), "big")
                if length > _MAX_FRAME:
                    raise ValueError(f"a {length}-byte request")
                request = _REQUEST.decode(await reader.readexactly(length))
                reply = await self._reply(info.peer_id.to_base58(), str(info.addr), request)
                writer.write(_frame(reply))
                await writer.drain()
                await reader.read(1)  # the asker hangs up first (p2pd resets a stream closed first)
        except (TimeoutError, ValueError, ConnectionError, asyncio.IncompleteReadError, RecursionError) as exc:
            self.refused += 1
            logger.debug("dial-back request from %s dropped: %s", info.peer_id, exc or type(exc).__name__)
        finally:
            writer.transport.abort()

    async def _reply(self, asker: str, observed_maddr: str, request: DialbackRequest) -> DialbackReply:
        observed = ObservedAddress.of(observed_maddr)
        if observed is None or observed.relayed:
            return DialbackReply(1, observed_maddr, (), "relayed" if observed else "unknown address")
        if self._slots.locked() or self._cooling_down(asker):
            self.refused += 1
            return DialbackReply(1, observed_maddr, (), "busy")
        async with self._slots:
            ports = tuple(dict.fromkeys(request.ports))
            results = await asyncio.gather(*(_tcp_handshake(observed.host, port) for port in ports))
        self.answered += 1
        return DialbackReply(1, observed_maddr, tuple(p for p, ok in zip(ports, results, strict=True) if ok))


async def ask_dialback(stream: Stream, ports: tuple[int, ...]) -> DialbackReply:
    """Send a dial-back request on an open `/murmur/dialback/1` stream and read the answer; raises
    ValueError (a malformed answer), StreamClosed; the caller bounds the time."""
    await stream.write(_frame(DialbackRequest(1, ports[:MAX_PORTS])))
    length = int.from_bytes(await stream.read_exactly(4), "big")
    if length > _MAX_FRAME:
        raise ValueError(f"a {length}-byte dial-back answer")
    try:
        return _REPLY.decode(await stream.read_exactly(length))
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ValueError(f"a malformed dial-back answer: {exc}") from None
