"""Circuit probes: is this node reachable through a relay, and does the relay let a model-sized exchange through?
Also the relay's own start-up check (docs/deploy.md).

A throwaway p2pd (a fresh identity with no connection to the node, so the push really takes the circuit)
pushes bytes over `/murmur/probe/1` and the node counts what arrives.

`/murmur/probe/1`: the asker sends an 8-byte big-endian length N (at most MAX_PROBE_BYTES) and N
bytes; the node answers the 8-byte count it read. N = 0 measures the round trip (latency). Every node and
bootstrap answers it, strangers included (a joiner measures its link to the bootstrap peers before it is a
member): a few askers at a time, each push at most MAX_PROBE_BYTES within PROBE_TIMEOUT_S, and each asker
at most PROBE_BURST probes, then one per 1/PROBE_RATE_PER_S seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from gossip.limits import PeerBuckets
from gossip.transport import PeerUnreachable, StreamClosed
from node.net.hivemind_adapter import DEFAULT_SERVICE_DATA_LIMIT, circuit_maddr, peer_of
from node.net.transport.p2pd import P2PDTransport, P2PSettings, start_p2pd

logger = logging.getLogger(__name__)

PROBE_PROTOCOL = "/murmur/probe/1"
MAX_PROBE_BYTES = 1 << 20
# More than p2pd's default relay service lets through (128 KiB each way): arriving whole, it shows
# that the relay's configured limits are in force.
LIMIT_CHECK_BYTES = 3 * DEFAULT_SERVICE_DATA_LIMIT
PROBE_TIMEOUT_S = 15.0
_MAX_CONCURRENT_ANSWERS = 4
# per asker: a doctor run takes 2 probes a neighbour, a guided join 2 a bootstrap peer; a stranger pushing
# without end gets 1 MiB every 2 s at most (and the concurrency bound above holds across askers)
PROBE_BURST = 16
PROBE_RATE_PER_S = 0.5
_TRACKED_ASKERS = 1024
_CHUNK = 1 << 16
_LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)
_RESERVATION_S = 0.5


class CircuitVerdict(enum.StrEnum):
    """What a push through a relay's circuit found."""

    CARRIES = "carries"  # the whole push arrived: the relay's limits allow model-sized exchanges
    LIMITED = "limited"  # cut before the end: the relay runs p2pd's default limits (128 KiB per circuit)
    NO_SLOT = "no_slot"  # no circuit opened: the relay holds no reservation for the node, or is down
    FAILED = "failed"  # the probe itself could not run (no throwaway daemon)


@dataclass(frozen=True)
class CircuitCheck:
    verdict: CircuitVerdict
    detail: str = ""
    seconds: float = 0.0  # how long the push took, when it arrived


@dataclass(frozen=True)
class PushResult:
    confirmed: int  # bytes the other side says it read
    seconds: float  # from opening the stream to the answer


class ProbeServer:
    """Answers `/murmur/probe/1` on a node's p2pd, a few askers at a time, each bounded in bytes and time."""

    def __init__(self, p2p: P2P) -> None:
        self._p2p = p2p
        self._slots = asyncio.Semaphore(_MAX_CONCURRENT_ANSWERS)
        self._askers = PeerBuckets(PROBE_RATE_PER_S, PROBE_BURST, _TRACKED_ASKERS)
        self.refused = 0  # pushes refused: too many at once, too often from one asker, or too large

    async def start(self) -> None:
        await self._p2p.add_binary_stream_handler(PROBE_PROTOCOL, self._answer)

    async def _answer(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._slots.locked() or not self._askers.take(info.peer_id.to_base58()):
            self.refused += 1
            writer.transport.abort()
            return
        async with self._slots:
            try:
                async with asyncio.timeout(PROBE_TIMEOUT_S):
                    wanted = int.from_bytes(await reader.readexactly(8), "big")
                    if wanted > MAX_PROBE_BYTES:
                        self.refused += 1
                        raise ValueError(f"a push of {wanted} bytes exceeds {MAX_PROBE_BYTES}")
                    got = 0
                    while got < wanted:
                        got += len(await reader.readexactly(min(_CHUNK, wanted - got)))
                    writer.write(got.to_bytes(8, "big"))
                    await writer.drain()
                    # p2pd resets a stream whose end closes first: the asker hangs up once it has read
                    await reader.read(1)
            except (TimeoutError, ValueError, ConnectionError, asyncio.IncompleteReadError) as exc:
                logger.debug("probe from %s ended: %s", info.peer_id, exc or type(exc).__name__)
            finally:
                writer.transport.abort()


async def push(transport: P2PDTransport, peer_id: str, nbytes: int, timeout_s: float = PROBE_TIMEOUT_S) -> PushResult:
    """Push `nbytes` to `peer_id` over `/murmur/probe/1` and read what it confirms; raises
    PeerUnreachable, StreamClosed (cut) or TimeoutError."""
    started = time.monotonic()
    async with asyncio.timeout(timeout_s):
        stream = await transport.open_stream(peer_id, PROBE_PROTOCOL)
        try:
            await stream.write(nbytes.to_bytes(8, "big"))
            block = bytes(_CHUNK)
            for offset in range(0, nbytes, _CHUNK):
                await stream.write(block[: min(_CHUNK, nbytes - offset)])
            confirmed = int.from_bytes(await stream.read_exactly(8), "big")
        finally:
            stream.abort()
    return PushResult(confirmed, time.monotonic() - started)


@contextlib.asynccontextmanager
async def throwaway_daemon(*, listen: Sequence[str] = _LOOPBACK, relays: Sequence[str] = ()) -> AsyncIterator[P2P]:
    """A p2pd of a fresh random identity, shut down on exit: a stranger to every node, so its dials take
    the addresses it is given. With `relays` it is forced private and reserves slots there."""
    p2p = await start_p2pd(P2PSettings(identity_path=None, host_maddrs=tuple(listen), relays=tuple(relays),
                                       force_reachability="private" if relays else None, dht_mode="client"))
    try:
        yield p2p
    finally:
        with contextlib.suppress(Exception):
            await p2p.shutdown()


async def check_circuit(client: P2PDTransport, relay_maddr: str, target: str, nbytes: int = LIMIT_CHECK_BYTES,
                        timeout_s: float = PROBE_TIMEOUT_S) -> CircuitCheck:
    """Dial `target` through the relay at `relay_maddr` from `client` (a throwaway daemon's transport)
    and push `nbytes` through the circuit."""
    circuit = circuit_maddr(relay_maddr, target)
    try:
        async with asyncio.timeout(timeout_s):
            await client.connect(target, [circuit])
    except (PeerUnreachable, TimeoutError) as exc:
        return CircuitCheck(CircuitVerdict.NO_SLOT, str(exc))
    try:
        result = await push(client, target, nbytes, timeout_s)
    except (StreamClosed, PeerUnreachable, TimeoutError, ConnectionError) as exc:
        return CircuitCheck(CircuitVerdict.LIMITED, f"the circuit was cut: {exc or type(exc).__name__}")
    if result.confirmed != nbytes:
        return CircuitCheck(CircuitVerdict.LIMITED, f"{result.confirmed} of {nbytes} bytes arrived")
    return CircuitCheck(CircuitVerdict.CARRIES, f"{nbytes} bytes in {result.seconds:.2f} s", result.seconds)


async def check_own_circuits(relays: Sequence[str], target: str) -> dict[str, CircuitCheck]:
    """For each relay (full multiaddr), whether `target` (this node, serving `/murmur/probe/1`) is
    reachable through it and gets a model-sized push through; one throwaway daemon for all."""
    try:
        async with throwaway_daemon() as stranger:
            client = P2PDTransport(stranger, open_timeout_s=PROBE_TIMEOUT_S)
            try:
                checks = await asyncio.gather(*(check_circuit(client, relay, target) for relay in relays))
            finally:
                await client.close()
    except Exception as exc:  # p2pd failed to start: say so per relay rather than fail the caller
        return {relay: CircuitCheck(CircuitVerdict.FAILED, f"no throwaway p2pd: {exc}") for relay in relays}
    return dict(zip(relays, checks, strict=True))


async def check_relay_service(relay_maddrs: Sequence[str], reserve_timeout_s: float = 10.0) -> CircuitCheck:
    """The relay's own start-up check: a throwaway daemon reserves a slot at this node (one of its
    `relay_maddrs`, which this host can dial), a second one dials it through the circuit and pushes
    more than the default service's 128 KiB."""
    relay = _local_maddr(relay_maddrs)
    if relay is None:
        return CircuitCheck(CircuitVerdict.FAILED, f"no address of the relay to dial among {list(relay_maddrs)}")
    try:
        async with throwaway_daemon(relays=[relay]) as reserver, throwaway_daemon() as dialer:
            await ProbeServer(reserver).start()
            relay_id = peer_of(relay)
            assert relay_id is not None
            await P2PDTransport(reserver).connect(relay_id, [relay])  # autorelay reserves once connected
            # A dial before the reservation is in puts the circuit into the dialer's backoff (5 s): wait
            # the few milliseconds a reservation takes, with margin for a loaded machine.
            await asyncio.sleep(_RESERVATION_S)
            client = P2PDTransport(dialer, open_timeout_s=PROBE_TIMEOUT_S)
            target = reserver.peer_id.to_base58()
            try:
                deadline = time.monotonic() + reserve_timeout_s
                while True:  # the reservation follows the connection within milliseconds
                    check = await check_circuit(client, relay, target)
                    if check.verdict is not CircuitVerdict.NO_SLOT or time.monotonic() > deadline:
                        return check
                    await asyncio.sleep(1.0)
            finally:
                await client.close()
    except Exception as exc:
        return CircuitCheck(CircuitVerdict.FAILED, f"no throwaway p2pd: {exc}")


async def relay_limits_in_force(p2p: P2P, restart: Callable[[P2P], Awaitable[P2P]],
                                attempts: int) -> tuple[P2P, CircuitCheck]:
    """Check that circuits through the relay `p2p` carry model-sized exchanges; while p2pd's default
    limits answer instead, `restart` it (stop it, start a new one), at most `attempts` checks in all.

    p2pd registers its configured relay service and its default one on the same protocol, from two
    goroutines, and whichever registers last answers; node.net.hivemind_adapter (workaround 3) orders
    them, and this check and a new daemon are the backstop should it not.
    """
    for attempt in range(1, attempts + 1):
        check = await check_relay_service([str(a) for a in await p2p.get_visible_maddrs()])
        if check.verdict is not CircuitVerdict.LIMITED or attempt == attempts:
            return p2p, check
        logger.info("relay service: p2pd's default relay limits answered (%s); restarting p2pd (%d of %d)",
                    check.detail, attempt, attempts - 1)
        p2p = await restart(p2p)
    raise ValueError("attempts must be at least 1")


def _local_maddr(maddrs: Sequence[str]) -> str | None:
    """The relay's address this host dials best: loopback if it listens there, else its first."""
    usable = [m for m in maddrs if "/p2p-circuit" not in m and peer_of(m) is not None]
    loopback = [m for m in usable if m.startswith("/ip4/127.")]
    chosen = loopback or usable
    return chosen[0] if chosen else None

