"""A node's reachability at run time: its relays and their circuits, its own relay service, and how it is
connected to each neighbour. Also answers `murmur doctor` (node.cli.doctor).

Each relay it holds a slot at is checked by pushing a model-sized probe through its circuit, and the peer
record carries the `/p2p-circuit` addresses of those relays; the relay service is checked for whether its
limits are in force.

A relay whose connection goes away is reported lost at once (status, log, monitor) and its circuit
leaves the record; p2pd's autorelay reconnects to it, and the node checks the circuit again then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hivemind.p2p import P2P

from gossip.transport import PeerUnreachable, StreamClosed
from node.net.dialback import DialbackServer
from node.net.hivemind_adapter import RelayLimits, circuit_maddr, is_circuit, peer_of
from node.net.probe import (
    LIMIT_CHECK_BYTES,
    CircuitCheck,
    CircuitVerdict,
    ProbeServer,
    check_own_circuits,
    check_relay_service,
    push,
)
from node.net.reachability import ConnectionKind, Detection, Reach, connection_kind, detect, tcp_ports
from node.net.transport.p2pd import P2PDTransport

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 1.0
RECHECK_NO_SLOT_S = 5.0  # a relay that held no slot yet (the reservation may lag the connection)
RECHECK_HELD_S = 300.0
MAX_CIRCUITS_PUBLISHED = 4
LATENCY_TIMEOUT_S = 5.0
GOODPUT_PROBE_BYTES = 1 << 20


@dataclass
class RelayState:
    """One relay this node reserves a slot at."""

    maddr: str  # its full multiaddr
    connected: bool = False
    check: CircuitCheck | None = None
    checked_at: float = 0.0  # monotonic
    lost_at: float | None = None  # unix time its connection went away while it held a slot

    @property
    def peer_id(self) -> str:
        peer = peer_of(self.maddr)
        assert peer is not None, self.maddr
        return peer

    @property
    def held(self) -> bool:
        """Connected, and a push through its circuit reached this node (whatever its limits)."""
        return self.connected and self.check is not None and self.check.verdict in (CircuitVerdict.CARRIES,
                                                                                     CircuitVerdict.LIMITED)

    def as_json(self) -> dict[str, Any]:
        return {"peer_id": self.peer_id, "maddr": self.maddr, "connected": self.connected, "held": self.held,
                "circuit": self.check.verdict.value if self.check else None,
                "detail": self.check.detail if self.check else "", "lost_at": self.lost_at}


@dataclass
class RelayServiceState:
    limits: RelayLimits
    check: CircuitCheck | None = None
    checked_at: float | None = None  # unix time

    def as_json(self) -> dict[str, Any]:
        return {"data_limit_bytes": self.limits.data_bytes, "time_limit_s": self.limits.duration_s,
                "limits_in_force": None if self.check is None else self.check.verdict is CircuitVerdict.CARRIES,
                "check": self.check.verdict.value if self.check else None,
                "detail": self.check.detail if self.check else "pending", "checked_at": self.checked_at}


@dataclass
class _Connections:
    by_peer: dict[str, list[str]] = field(default_factory=dict)  # peer -> remote addresses of its connections


class NodeReachability:
    """See the module docstring. `publish` receives the record's new maddrs whenever they change."""

    def __init__(self, p2p: P2P, detection: Detection, *, relays: Sequence[str] = (),
                 relay_service: RelayLimits | None = None, service_check: CircuitCheck | None = None,
                 publish: Callable[[tuple[str, ...]], None] | None = None, mode: str = "auto") -> None:
        self._p2p = p2p
        self._client = P2PDTransport(p2p, open_timeout_s=LATENCY_TIMEOUT_S)  # probes and dial-backs it asks
        self.detection = detection
        self.mode = mode
        self.peer_id: str = p2p.peer_id.to_base58()
        self._relays = [RelayState(r) for r in dict.fromkeys(relays) if peer_of(r) and not is_circuit(r)]
        self.service = RelayServiceState(relay_service) if relay_service is not None else None
        if self.service is not None and service_check is not None:
            self.service.check, self.service.checked_at = service_check, time.time()
        self._publish = publish
        self._published: tuple[str, ...] = ()
        self._direct: tuple[str, ...] = ()
        self._connections = _Connections()
        self._probe = ProbeServer(p2p)
        self._dialback = DialbackServer(p2p)
        self._tasks: set[asyncio.Task[None]] = set()
        self._checking = False
        self._runner: asyncio.Task[None] | None = None

    @property
    def private(self) -> bool:
        return self.detection.reach is Reach.PRIVATE

    @property
    def relays(self) -> list[RelayState]:
        return list(self._relays)

    @property
    def relay_maddrs(self) -> tuple[str, ...]:
        return tuple(r.maddr for r in self._relays)

    def publish_to(self, publish: Callable[[tuple[str, ...]], None]) -> None:
        """From now on, hand the record's maddrs to `publish` whenever they change (and once now)."""
        self._publish, self._published = publish, ()
        self._republish()

    def service_line(self) -> str:
        """One line on the relay service, for logs and `murmur bootstrap`'s output."""
        if self.service is None:
            return "relay service off"
        check, limits = self.service.check, self.service.limits
        if check is None:
            return "relay service: not checked yet"
        if check.verdict is CircuitVerdict.CARRIES:
            return (f"relay service on: a {LIMIT_CHECK_BYTES >> 10} KiB push went through a circuit, limits in force "
                    f"({limits.data_bytes >> 20} MiB and {limits.duration_s:g} s per circuit)")
        return (f"relay service: LIMITS NOT IN FORCE ({check.verdict.value}: {check.detail}): circuits through this "
                "node carry at most 128 KiB, too little for model exchanges")

    async def start(self) -> None:
        await self._probe.start()
        if not self.private:
            await self._dialback.start()
        self._direct = await self._visible()
        if self.service is not None and self.service.check is None:
            self._spawn(self._check_service())
        self._runner = asyncio.create_task(self._watch(), name="reachability")

    async def close(self) -> None:
        tasks = [t for t in (self._runner, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self._client.close()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- the watch loop ----------------------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            try:
                await self._tick()
            except Exception as exc:  # p2pd busy or restarting: try again next tick
                logger.debug("reachability watch: %s", exc)
            await asyncio.sleep(WATCH_INTERVAL_S)

    async def _tick(self) -> None:
        async with asyncio.timeout(LATENCY_TIMEOUT_S):
            peers = await self._p2p.list_peers()
        by_peer: dict[str, list[str]] = {}
        for info in peers:
            by_peer.setdefault(info.peer_id.to_base58(), []).extend(str(a) for a in info.addrs)
        self._connections = _Connections(by_peer)
        if not self.private:
            return
        now = time.monotonic()
        due = []
        for relay in self._relays:
            connected = any(not is_circuit(a) for a in by_peer.get(relay.peer_id, []))
            if relay.connected and not connected:
                if relay.held:
                    relay.lost_at = time.time()
                    left = sum(r.held for r in self._relays if r is not relay)
                    logger.warning("relay %s lost: its connection is gone; its circuit leaves this node's record "
                                   "(%d relay(s) left)", relay.peer_id, left)
                relay.check = None
            relay.connected = connected
            if connected and (relay.check is None
                              or now - relay.checked_at > (RECHECK_HELD_S if relay.held else RECHECK_NO_SLOT_S)):
                due.append(relay)
        if due and not self._checking:
            self._checking = True
            self._spawn(self._check_relays(due))
        self._republish()

    async def _check_relays(self, relays: list[RelayState]) -> None:
        try:
            checks = await check_own_circuits([r.maddr for r in relays], self.peer_id)
        finally:
            self._checking = False
        now = time.monotonic()
        for relay in relays:
            check = checks[relay.maddr]
            before = relay.check
            relay.check, relay.checked_at = check, now
            if check.verdict is CircuitVerdict.CARRIES and (before is None or before.verdict != check.verdict):
                relay.lost_at = None
                logger.info("relay %s holds a slot for this node; its circuit carries model-sized exchanges",
                            relay.peer_id)
            elif check.verdict is CircuitVerdict.LIMITED:
                logger.warning("relay %s holds a slot but cuts circuits (%s): it runs p2pd's default relay limits, "
                               "too small for model exchanges", relay.peer_id, check.detail)
        self._republish()

    async def _check_service(self) -> None:
        assert self.service is not None
        try:
            check = await check_relay_service(await self._visible())
        except Exception as exc:  # p2pd gone or busy: report it, do not kill the caller
            check = CircuitCheck(CircuitVerdict.FAILED, str(exc) or type(exc).__name__)
        self.service.check, self.service.checked_at = check, time.time()
        if check.verdict is CircuitVerdict.CARRIES:
            logger.info(self.service_line())
        else:
            logger.warning(self.service_line())

    async def _visible(self) -> tuple[str, ...]:
        async with asyncio.timeout(LATENCY_TIMEOUT_S):
            return tuple(str(a) for a in await self._p2p.get_visible_maddrs(latest=True))

    def circuits(self) -> tuple[str, ...]:
        """The circuit addresses for the record: relays that carry model-sized exchanges first."""
        held = sorted((r for r in self._relays if r.held), key=lambda r: r.check.verdict is not CircuitVerdict.CARRIES
                      if r.check else True)
        return tuple(circuit_maddr(r.maddr, self.peer_id) for r in held[:MAX_CIRCUITS_PUBLISHED])

    def record_maddrs(self) -> tuple[str, ...]:
        direct = tuple(a for a in self._direct if not is_circuit(a))
        return (*self.circuits(), *direct) if self.private else direct

    def _republish(self) -> None:
        maddrs = self.record_maddrs()
        if maddrs != self._published and self._publish is not None:
            self._published = maddrs
            self._publish(maddrs)

    # ---- connections -------------------------------------------------------------------------------

    def connection_kinds(self, records: Mapping[str, Sequence[str]]) -> dict[str, ConnectionKind]:
        """Each peer in `records` (peer -> its record's maddrs): how this node is connected to it."""
        conns = self._connections.by_peer
        return {peer: connection_kind(conns.get(peer, []), maddrs, self.private) for peer, maddrs in records.items()}

    # ---- reports -------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {"mode": self.mode, "reach": self.detection.reach.value, "observed": list(self.detection.observed),
                "ports": list(tcp_ports(self._direct)),
                "confirmed_by": list(self.detection.confirmed_by), "detail": self.detection.detail,
                "relays": [r.as_json() for r in self._relays], "relays_held": sum(r.held for r in self._relays),
                "circuits": list(self.circuits()),
                "relay_service": self.service.as_json() if self.service is not None else None}

    async def refresh(self, ask: Sequence[str], neighbours: Mapping[str, Sequence[str]],
                      goodput: Callable[[str], float | None], *, redetect: bool = True) -> dict[str, Any]:
        """`murmur doctor`'s report: ask `ask` (full multiaddrs) to dial back (unless `redetect` is false:
        the start-up answer is fresh), push through every relay's circuit again, check the relay service,
        and measure each neighbour (peer -> record maddrs)."""
        redetected = await detect(self._client, ask, tcp_ports(self._direct)) if redetect else self.detection
        if self.private and self._relays:
            await self._settle_relays()
            checks = await check_own_circuits([r.maddr for r in self._relays], self.peer_id)
            for relay in self._relays:
                relay.check, relay.checked_at = checks[relay.maddr], time.monotonic()
            self._republish()
        if self.service is not None:
            await self._check_service()
        kinds = self.connection_kinds(neighbours)
        measured = await asyncio.gather(*(self._measure(peer, goodput(peer)) for peer in neighbours))
        report = self.status()
        report["redetected"] = {"reach": redetected.reach.value, "observed": list(redetected.observed),
                                "confirmed_by": list(redetected.confirmed_by), "detail": redetected.detail}
        report["neighbours"] = [{"peer_id": peer, "connection": kinds[peer].value, **m}
                                for peer, m in zip(neighbours, measured, strict=True)]
        return report

    async def _settle_relays(self, timeout_s: float = 3.0) -> None:
        """Until every relay is connected (p2pd dials them at start), at most `timeout_s`; then the few
        milliseconds a reservation takes after its connection."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                await self._tick()
            if all(r.connected for r in self._relays):
                break
            await asyncio.sleep(0.3)
        await asyncio.sleep(0.3)

    async def measure(self, peer: str) -> dict[str, Any]:
        """Round-trip latency and goodput to `peer` (a peer this node's p2pd can dial), by two probes:
        `latency_ms`, `goodput_mbit_s` and `error` (None, or why the probe failed)."""
        return await self._measure(peer, None)

    async def _measure(self, peer: str, goodput: float | None) -> dict[str, Any]:
        """Round-trip latency of an empty probe, and goodput: measured on gossip traffic if there was
        some, else by a 1 MiB probe."""
        try:
            latency = (await push(self._client, peer, 0, LATENCY_TIMEOUT_S)).seconds
            if goodput is None:  # one round trip is in the time: the figure errs low
                result = await push(self._client, peer, GOODPUT_PROBE_BYTES, 2 * LATENCY_TIMEOUT_S)
                goodput = result.confirmed * 8 / 1e6 / result.seconds
        except (PeerUnreachable, StreamClosed, TimeoutError, ConnectionError) as exc:
            return {"latency_ms": None, "goodput_mbit_s": goodput, "error": str(exc) or type(exc).__name__}
        return {"latency_ms": latency * 1000, "goodput_mbit_s": goodput, "error": None}


def relay_candidates(relays: Iterable[str], initial_peers: Iterable[str]) -> tuple[str, ...]:
    """--relays, else the bootstrap peers: full multiaddrs of relays, circuits excluded."""
    chosen = tuple(relays) or tuple(initial_peers)
    return tuple(r for r in dict.fromkeys(chosen) if peer_of(r) is not None and not is_circuit(r))
