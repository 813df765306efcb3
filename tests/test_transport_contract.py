"""The contract every `gossip.transport.Transport` keeps, run over the in-memory, p2pd and py-libp2p
transports (each started for real; the last two on loopback): bulk bytes both ways with exact byte
counts and a clean end of stream, bounded failures for dead and unknown peers, unserved protocols
refused. What only one backend does (link models, child processes, daemons) stays in its own file."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gossip.memory import InMemoryNetwork
from gossip.transport import PeerUnreachable, Stream, StreamClosed
from node.net.identity import claim_identity
from node.net.transport.libp2p import LibP2PSettings, LibP2PTransport
from node.net.transport.p2pd import P2PDTransport, P2PSettings, start_p2pd

PROTOCOL = "/murmur/test/1"
CHUNK = 1 << 20


@contextlib.asynccontextmanager
async def p2pd_transport(identity_path: Path, **options: Any) -> AsyncIterator[P2PDTransport]:
    with claim_identity(identity_path) as claimed:
        p2p = await start_p2pd(P2PSettings(identity_path=claimed.identity.path))
        transport = P2PDTransport(p2p, **options)
        try:
            yield transport
        finally:
            await transport.close()
            await p2p.shutdown()


@contextlib.asynccontextmanager
async def libp2p_transport(identity_path: Path, **options: Any) -> AsyncIterator[LibP2PTransport]:
    with claim_identity(identity_path) as claimed:
        transport = await LibP2PTransport.start(
            LibP2PSettings(identity_path=claimed.identity.path, peer_id=claimed.identity.peer_id, **options))
        try:
            yield transport
        finally:
            await transport.close()


@contextlib.asynccontextmanager
async def transport_of(kind: str, identity_path: Path, **options: Any) -> AsyncIterator[Any]:
    factory = libp2p_transport if kind == "libp2p" else p2pd_transport
    async with factory(identity_path, **options) as transport:
        yield transport


@dataclass(frozen=True)
class Backend:
    """How the contract tests start a transport of one kind and make one peer known to another."""

    kind: str
    start: Callable[[Path], contextlib.AbstractAsyncContextManager[Any]]
    open_slack_s: float = 5.0  # how much past its open timeout a failed open may return (a loaded machine)

    async def link(self, client: Any, server: Any) -> None:
        """Tell `client` where `server` is; the memory network needs no addresses."""
        if self.kind != "memory":
            await client.connect(server.peer_id, await server.maddrs())


def memory_backend() -> Backend:
    net = InMemoryNetwork()

    @contextlib.asynccontextmanager
    async def start(identity_path: Path) -> AsyncIterator[Any]:
        transport = net.transport(identity_path.stem)
        try:
            yield transport
        finally:
            await transport.close()

    return Backend("memory", start)


BACKENDS = {
    "memory": memory_backend,
    "p2pd": lambda: Backend("p2pd", p2pd_transport),
    "libp2p": lambda: Backend("libp2p", libp2p_transport, open_slack_s=5.5),
}
MEMORY = pytest.param("memory", marks=pytest.mark.unit)
P2PD = pytest.param("p2pd", marks=pytest.mark.multiprocess)
LIBP2P = pytest.param("libp2p", marks=pytest.mark.multiprocess)


# ---- bytes both ways ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "client_kind,server_kind,payload_bytes",
    [
        pytest.param("memory", "memory", 8 << 20, marks=pytest.mark.unit),
        pytest.param("p2pd", "p2pd", 50 << 20, marks=pytest.mark.multiprocess),
        pytest.param("libp2p", "p2pd", 8 << 20, marks=pytest.mark.multiprocess),
        pytest.param("p2pd", "libp2p", 8 << 20, marks=pytest.mark.multiprocess),
        pytest.param("libp2p", "libp2p", 8 << 20, marks=pytest.mark.multiprocess),
    ],
)
def test_bulk_round_trip_counts_every_byte(tmp_path: Path, client_kind: str, server_kind: str,
                                           payload_bytes: int) -> None:
    async def scenario() -> None:
        saw_end_of_stream = asyncio.Event()

        async def echo(stream: Stream) -> None:
            size = int.from_bytes(await stream.read_exactly(8), "big")
            for offset in range(0, size, CHUNK):
                await stream.write(await stream.read_exactly(min(CHUNK, size - offset)))
            with pytest.raises(StreamClosed):
                await stream.read_exactly(1)
            saw_end_of_stream.set()

        payload = os.urandom(payload_bytes)
        server_backend = client_backend = BACKENDS[server_kind]()
        if client_kind != server_kind:
            client_backend = BACKENDS[client_kind]()
        async with server_backend.start(tmp_path / "s.key") as server, \
                client_backend.start(tmp_path / "c.key") as client:
            await server.serve(PROTOCOL, echo)
            await client_backend.link(client, server)
            async with asyncio.timeout(120):
                stream = await client.open_stream(server.peer_id, PROTOCOL)
                assert stream.remote_peer == server.peer_id
                async with asyncio.TaskGroup() as group:  # full duplex: the echo starts before we finish sending
                    group.create_task(stream.write(len(payload).to_bytes(8, "big") + payload))
                    echoed = group.create_task(stream.read_exactly(len(payload)))
                assert echoed.result() == payload
                await stream.close()
                await saw_end_of_stream.wait()
            assert client.bytes_sent == server.bytes_received == payload_bytes + 8
            assert server.bytes_sent == client.bytes_received == payload_bytes

    asyncio.run(scenario())


# ---- bounded failures -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [P2PD, LIBP2P])
def test_open_stream_to_dead_or_unknown_peer_fails_within_its_timeout(tmp_path: Path, kind: str) -> None:
    open_timeout_s = 3.0
    backend = BACKENDS[kind]()

    async def scenario() -> None:
        async with transport_of(kind, tmp_path / "client.key", open_timeout_s=open_timeout_s) as client:
            async with backend.start(tmp_path / "dead.key") as dead:  # a peer we knew, now dead
                await dead.serve(PROTOCOL, lambda stream: stream.close())
                await backend.link(client, dead)
                dead_id = dead.peer_id
            with claim_identity(tmp_path / "never.key") as never:  # a peer id nobody runs
                unknown_id = never.identity.peer_id
            for peer_id in (dead_id, unknown_id):
                started = time.monotonic()
                with pytest.raises(PeerUnreachable, match=peer_id):
                    await client.open_stream(peer_id, PROTOCOL)
                assert time.monotonic() - started < open_timeout_s + backend.open_slack_s

    asyncio.run(scenario())


@pytest.mark.parametrize("kind", [MEMORY, P2PD, LIBP2P])
def test_unserved_protocol_is_refused(tmp_path: Path, kind: str) -> None:
    backend = BACKENDS[kind]()
    refusal = ConnectionError if kind == "memory" else PeerUnreachable

    async def scenario() -> None:
        async with backend.start(tmp_path / "a.key") as server, backend.start(tmp_path / "b.key") as client:
            await server.serve(PROTOCOL, lambda stream: stream.close())
            await backend.link(client, server)
            with pytest.raises(refusal):
                await client.open_stream(server.peer_id, "/murmur/not-served/1")

    asyncio.run(scenario())
