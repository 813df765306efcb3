"""The py-libp2p data plane behind NAT: py-libp2p 0.8.1's circuit relay v2 interoperates with p2pd's,
so the child reserves a slot at a p2pd relay and is dialled through it by a p2pd node, and dials a p2pd
node that sits behind its own relay; multi-megabyte streams cross both ways. On loopback, with only
the circuit addresses given out, so every byte takes the relay."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from test_transport_contract import libp2p_transport

from gossip.transport import PeerUnreachable, Stream
from node.net.hivemind_adapter import RelayLimits, circuit_maddr, is_circuit
from node.net.probe import relay_limits_in_force, throwaway_daemon
from node.net.transport.p2pd import P2PDTransport, P2PSettings, start_p2pd
from node.runtime.host import RELAY_SERVICE_ATTEMPTS
from support.swarm_harness import wait_for

pytestmark = pytest.mark.multiprocess

PROTOCOL = "/murmur/test/1"
PUSH = 6 << 20
LIMITS = RelayLimits(1 << 30, 600)


async def count_bytes(stream: Stream) -> None:
    """Read an 8-byte length and that many bytes, answer how many arrived."""
    wanted = int.from_bytes(await stream.read_exactly(8), "big")
    got = 0
    while got < wanted:
        got += len(await stream.read_exactly(min(1 << 20, wanted - got)))
    await stream.write(got.to_bytes(8, "big"))
    await asyncio.sleep(0.5)  # let the answer leave before the stream closes


async def push(client, peer: str, nbytes: int) -> int:
    stream = await client.open_stream(peer, PROTOCOL)
    try:
        await stream.write(nbytes.to_bytes(8, "big"))
        block = bytes(1 << 20)
        for offset in range(0, nbytes, 1 << 20):
            await stream.write(block[: min(1 << 20, nbytes - offset)])
        return int.from_bytes(await stream.read_exactly(8), "big")
    finally:
        await stream.close()


def test_the_py_libp2p_child_is_reached_through_a_p2pd_relay_and_reaches_a_node_behind_one(tmp_path: Path) -> None:
    async def main() -> None:
        async def restart(old):
            await old.shutdown()
            return await start_p2pd(P2PSettings(identity_path=None, relay_service=LIMITS))

        relay, _ = await relay_limits_in_force(await start_p2pd(P2PSettings(identity_path=None, relay_service=LIMITS)),
                                               restart, attempts=RELAY_SERVICE_ATTEMPTS)
        relay_maddr = next(str(m) for m in await relay.get_visible_maddrs())
        try:
            async with libp2p_transport(tmp_path / "child.key", relays=(relay_maddr,)) as child:
                await child.serve(PROTOCOL, count_bytes)
                circuits = await asyncio.to_thread(
                    wait_for, lambda: child.circuits, 60, "the child's slot at the relay")
                assert circuits == (circuit_maddr(relay_maddr, child.peer_id),)
                # a p2pd node given only the circuit dials the child through the relay
                async with throwaway_daemon() as dialer:
                    client = P2PDTransport(dialer, open_timeout_s=20)
                    await client.connect(child.peer_id, list(circuits))
                    assert await push(client, child.peer_id, PUSH) == PUSH
                    links = [str(a) for info in await dialer.list_peers() if info.peer_id.to_base58() == child.peer_id
                             for a in info.addrs]
                    assert links and all(is_circuit(a) for a in links), links
                    await asyncio.to_thread(wait_for, lambda: dialer.peer_id.to_base58() in child.relayed, 10,
                                            "the child to report the dialler as relayed")
                    await client.close()
                # and the child dials a p2pd node behind the same relay through its circuit
                async with throwaway_daemon(relays=[relay_maddr]) as hidden:
                    server = P2PDTransport(hidden)
                    await server.serve(PROTOCOL, count_bytes)
                    hidden_id = hidden.peer_id.to_base58()
                    await P2PDTransport(hidden).connect(relay_maddr.rsplit("/p2p/", 1)[1], [relay_maddr])
                    # the reservation follows the connection, a moment later on a loaded machine
                    for _ in range(60):
                        try:
                            await child.connect(hidden_id, [circuit_maddr(relay_maddr, hidden_id)])
                            break
                        except PeerUnreachable:
                            await asyncio.sleep(0.5)
                    else:
                        raise AssertionError("the child never reached the hidden node through its circuit")
                    started = time.monotonic()
                    assert await push(child, hidden_id, PUSH) == PUSH
                    assert time.monotonic() - started < 60
                    await server.close()
        finally:
            await relay.shutdown()

    asyncio.run(main())
