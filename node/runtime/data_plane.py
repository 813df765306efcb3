"""The data plane `--transport` selects for gossip streams, and the addresses the node's record gives for it.

Either p2pd's own streams, or a py-libp2p child process under the node's identity (docs/architecture.md,
"Data-plane backends")."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from gossip.limits import IncomingGate
from gossip.transport import Transport
from node.config import NodeConfig
from node.net.reach import dialable_maddrs
from node.runtime.errors import StartupError

if TYPE_CHECKING:
    from hivemind.p2p import P2P

    from node.net.dialer import Dialer
    from node.net.discovery import Discovery
    from node.net.identity import Identity
    from node.net.transport.libp2p import LibP2PTransport

logger = logging.getLogger("murmur.node")


class DataPlane(Transport, Protocol):
    """A gossip Transport the node can also dial peers with and ask where it listens."""

    async def connect(self, peer_id: str, maddrs: Sequence[str]) -> None: ...

    async def maddrs(self) -> tuple[str, ...]: ...


async def start_data_plane(config: NodeConfig, identity: Identity, p2p: P2P, on_death: Callable[[], None],
                           stack: contextlib.AsyncExitStack, gate: IncomingGate, relays: Sequence[str] = ()) -> DataPlane:
    """The gossip transport `--transport` selects, its incoming streams behind `gate`. `on_death` runs
    if the py-libp2p child dies; the node then stops, and the exit reports why once its parts have stopped.
    `relays`: behind NAT, where the py-libp2p child reserves slots (p2pd's are node.net.relays')."""
    if config.network.transport == "p2pd":
        from node.net.transport.p2pd import P2PDTransport

        return P2PDTransport(p2p, gate=gate)
    from node.net.transport.libp2p import ChildFailed, LibP2PSettings, LibP2PTransport, data_listen_maddrs

    if config.network.announce and not config.network.data_announce:
        logger.warning("--announce covers the DHT only: peers will dial the py-libp2p data plane at its listen "
                       "addresses; give --data-announce (and --data-listen) for NAT or port forwarding")
    listen = config.network.data_listen or data_listen_maddrs(config.network.listen)
    try:
        transport = await LibP2PTransport.start(LibP2PSettings(identity.path, identity.peer_id, listen=listen,
                                                              relays=tuple(relays)), on_death=on_death, gate=gate)
    except ChildFailed as exc:
        raise StartupError(str(exc)) from None
    stack.push_async_callback(_stopped_by_dead_child, transport)  # runs once the node's parts have stopped
    return transport


async def _stopped_by_dead_child(transport: LibP2PTransport) -> None:
    if transport.died:
        raise StartupError(f"{transport.died}; the node stopped (its final checkpoint is written)")


async def advertised_data_maddrs(config: NodeConfig, transport: DataPlane, peer_id: str) -> tuple[str, ...]:
    """Where this node's record tells peers to open gossip streams: `--data-announce` when given,
    else the data plane's own (for p2pd, the daemon's visible ones, `--announce` included)."""
    if config.network.data_announce:
        return tuple(f"{addr}/p2p/{peer_id}" for addr in config.network.data_announce)
    return await transport.maddrs()


def follow_child_circuits(transport: DataPlane, discovery: Discovery) -> None:
    """With the py-libp2p backend behind NAT: the record lists the child's circuits (through the relays
    holding a slot for it) before its direct addresses, updated whenever they change."""
    on_state = getattr(transport, "on_state", None)
    if not hasattr(transport, "circuits") or on_state is not None:
        return
    direct = discovery.local_record.maddrs

    def publish(circuits: tuple[str, ...]) -> None:
        discovery.set_maddrs((*circuits, *direct))

    transport.on_state = publish  # type: ignore[attr-defined]
    circuits: tuple[str, ...] = getattr(transport, "circuits", ())
    if circuits:
        publish(circuits)


def _own_maddrs(discovery: Discovery) -> tuple[str, ...]:
    """This node's own addresses (its record's and its DHT's), which the routability rule compares with."""
    return (*discovery.local_record.maddrs, *discovery.dht_maddrs)


def set_address_book(transport: DataPlane, discovery: Discovery) -> None:
    """Let the data plane re-dial a peer at its record's addresses when a stream cannot be opened (a
    relay died: the record by then lists the circuits of the peer's other relays); only the addresses
    the routability rule lets this node dial (node.net.reach), as the background dialer does."""
    if not hasattr(transport, "set_address_book"):
        return

    def addresses(peer_id: str) -> tuple[str, ...]:
        record = next((p.maddrs for p in discovery.view() if p.peer_id == peer_id), ())
        return dialable_maddrs(record, _own_maddrs(discovery))

    transport.set_address_book(addresses)


async def start_dialer(transport: DataPlane, discovery: Discovery, stack: contextlib.AsyncExitStack) -> Dialer:
    """Dial the view's peers in the background (node.net.dialer), by the routability rule applied to
    this node's own addresses (its record's and its DHT's); stopped with the node."""
    from node.net.dialer import Dialer

    dialer = Dialer(transport, discovery.peer_id, lambda: _own_maddrs(discovery))
    task = asyncio.create_task(dialer.run(discovery.view), name="dialer")

    async def stop() -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    stack.push_async_callback(stop)
    return dialer
