"""The one place that works around what hivemind 1.1.12 and its bundled p2pd get wrong for NAT traversal,
where murmur's DHT guard (node.net.dht_guard) replaces hivemind's store and find handlers (5), and where
a DHT read that no peer answered is told from one that found nothing (6).

Workarounds 1-4 have their tests in tests/test_hivemind_adapter.py (docs/architecture.md, "Reachability"):

1. **relay discovery**: with `-autoRelay`, p2pd waits about 3 minutes before reserving a relay slot
   unless it gets `-relayDiscovery=0`, which `P2P.create` does not expose: `daemon_class` gives p2pd
   extra arguments through hivemind's own process-argument builder.
2. **private relays**: a relay whose address libp2p thinks private (10.x, 192.168.x, ...) reserves a
   slot but p2pd never advertises the `/p2p-circuit` address: `circuit_maddr` builds it.
3. **relay limits**: p2pd registers two relay services on the same protocol, and the last one
   registered answers. Its default one (128 KiB and 2 minutes per circuit) is registered by p2pd's
   main goroutine right after start-up; the configured one (`-relayDataLimit` / `-relayTimeLimit`)
   only once libp2p deems the node public, by a goroutine that usually runs first, so the default
   one answers. `relay_service_args` forces public reachability and `RELAY_SERVICE_ENV` runs
   p2pd on one scheduler thread, where that goroutine usually runs only after main has registered the
   default one. That is a race all the same, lost more often on a busy CPU (see docs/benchmarks.md,
   "Relay service limits at p2pd start-up"). So node.net.probe pushes more than
   `DEFAULT_SERVICE_DATA_LIMIT` through a circuit to check it worked, and the node restarts p2pd until it
   did (node.runtime.host).
4. **`/p2p/` encoding**: hivemind's bundled `Multiaddr` encodes `/p2p/<id>` as a CIDv1, which p2pd's
   `connect` rejects inside relayed addresses ("length greater than remaining number of bytes"):
   `maddr_bytes` encodes with the `multiaddr` package, whose `/p2p/` is the raw multihash p2pd expects.
5. **the DHT's store and find RPCs**: `DHTNode.create` builds its `DHTProtocol` itself and registers its
   handlers with p2pd at once; it takes no protocol class. p2pd's client looks a unary handler up by name
   on each request, so `guard_dht_node` swaps the node's storages for bounded ones and replaces the
   `DHTProtocol.rpc_store` and `rpc_find` handlers (same names, so peers see no difference) by
   `StoreGuard`'s. Before that, for the few seconds `DHTNode.create` bootstraps, hivemind's own handlers answer.
6. **a read nobody answered**: `DHTNode.get` returns None both when the peers it asked had nothing and
   when none of them answered (each find failed: unreachable, timed out, or a value over p2pd's 4 MiB
   message limit, which no replica can send). `FindWatch` wraps the node's one way out for a get's finds
   (`DHTNode._call_find_with_blacklist`, blacklisted peers included) and counts, per key being read, the
   finds tried and answered: nothing found after finds of which none was answered is a failed read
   (tests/test_discovery_reads.py).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import multiaddr
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.p2p import P2P
from hivemind.proto import dht_pb2
from hivemind.utils.auth import AuthRole, AuthRPCWrapper
from hivemind.utils.timed_storage import ValueWithExpiration

from node.net.dht_guard import BoundedStorage, DhtRates, StoreGuard
from node.net.validation import RefusalCounts

CIRCUIT = "/p2p-circuit"
# p2pd's default relay service (go-libp2p's relay.DefaultResources): what a circuit carries through a
# relay whose configured limits are not in force.
DEFAULT_SERVICE_DATA_LIMIT = 128 * 1024
DEFAULT_SERVICE_TIME_LIMIT_S = 120.0


@dataclass(frozen=True)
class RelayLimits:
    """What one circuit through this node's relay service may carry (each direction) and for how long;
    a cut circuit is re-dialled by its peers, so these bound a relayed connection, not an exchange."""

    data_bytes: int
    duration_s: float
    max_circuits: int = 16  # open circuits per peer
    max_reservations: int = 128


def daemon_class(extra_args: Sequence[str], env: Sequence[tuple[str, str]] = ()) -> type[P2P]:
    """A `P2P` whose p2pd also gets `extra_args` and runs with `env` set (workaround 1, and how 3
    reaches p2pd).

    `P2P.create` builds the daemon's command line with `_make_process_args`; a subclass that appends
    to it is the only way to pass flags `create` does not know. It passes this process's environment,
    so `env` goes in front as `env NAME=VALUE p2pd ...`: env execs p2pd, which keeps the PID (and
    the parent-death signal) hivemind and node.net.proc rely on. A class per call: no shared state.
    """
    extra = tuple(extra_args)
    prefix = ("env", *(f"{name}={value}" for name, value in env)) if env else ()

    class _P2PWithArgs(P2P):  # type: ignore[misc]  # hivemind is untyped
        @staticmethod
        def _make_process_args(*args: Any, **kwargs: Any) -> list[str]:
            return [*prefix, *P2P._make_process_args(*args, **kwargs), *extra]

    return _P2PWithArgs


def autorelay_args(relays: Sequence[str]) -> tuple[str, ...]:
    """Reserve slots at exactly `relays`, at once (workaround 1); hivemind passes them as -trustedRelays."""
    return ("-relayDiscovery=0",) if relays else ()


# Workaround 3's other half: one Go scheduler thread orders the two relay services' registration.
# A relay forwards at most tens of Mbit/s on a home or small server link: one thread is plenty.
RELAY_SERVICE_ENV: tuple[tuple[str, str], ...] = (("GOMAXPROCS", "1"),)


def relay_service_args(limits: RelayLimits) -> tuple[str, ...]:
    """Serve as a relay with `limits` in force (workaround 3): public reachability makes go-libp2p start
    the configured relay service, whose hop handler then replaces the default service's."""
    return ("-relayService=1", "-forceReachabilityPublic=1", f"-relayDataLimit={limits.data_bytes}",
            f"-relayTimeLimit={math.ceil(limits.duration_s)}s", f"-relayMaxCircuits={limits.max_circuits}",
            f"-relayMaxReservations={limits.max_reservations}")


def is_circuit(maddr: str) -> bool:
    return f"{CIRCUIT}/" in maddr or maddr.endswith(CIRCUIT)


def relay_part(circuit: str) -> str:
    """`/ip4/R/tcp/N/p2p/RELAY/p2p-circuit/p2p/ME` -> `/ip4/R/tcp/N/p2p/RELAY` (the relay's address)."""
    return circuit.split(CIRCUIT, 1)[0]


def peer_of(maddr: str) -> str | None:
    """The peer id a full multiaddr ends in, if it does."""
    _, sep, tail = maddr.rpartition("/p2p/")
    return tail if sep and "/" not in tail else None


def circuit_maddr(relay_maddr: str, peer_id: str) -> str:
    """The address peers dial `peer_id` at through the relay at `relay_maddr` (workaround 2), which must
    be a full multiaddr of the relay (ending in /p2p/<relay id>)."""
    if peer_of(relay_maddr) is None or is_circuit(relay_maddr):
        raise ValueError(f"not a relay's full multiaddr: {relay_maddr!r}")
    return f"{relay_maddr}{CIRCUIT}/p2p/{peer_id}"


def missing_circuits(advertised: Iterable[str], relays_held: Iterable[str], peer_id: str) -> tuple[str, ...]:
    """Circuit addresses through `relays_held` (full relay multiaddrs) that p2pd does not advertise in
    `advertised` itself (it omits those of relays with private addresses)."""
    have = {peer_of(relay_part(a)) for a in advertised if is_circuit(a)}
    return tuple(circuit_maddr(r, peer_id) for r in relays_held if peer_of(r) not in have)


def maddr_bytes(maddr: str) -> bytes:
    """The binary multiaddr p2pd's control protocol takes (workaround 4); ValueError if malformed."""
    try:
        return bytes(multiaddr.Multiaddr(maddr).to_bytes())
    except Exception as exc:  # py-multiaddr raises its own StringParseError (a ValueError) and others
        raise ValueError(f"bad multiaddr {maddr!r}: {exc}") from None


async def guard_dht_node(node: DHTNode, refused: RefusalCounts, *, rates: DhtRates | None = None,
                         **bounds: Any) -> StoreGuard:
    """Bound `node`'s local storage and cache, and answer its store and find RPCs with a `StoreGuard`
    (workaround 5) holding each peer to `rates`; `bounds` go to BoundedStorage. Close the guard when the
    node shuts down. Every murmur DHT node comes here: a swarm's (node.net.discovery) and a bootstrap's
    (node.runtime.serve.run_bootstrap)."""
    protocol = node.protocol
    protocol.storage = BoundedStorage.adopt(protocol.storage, refused, **bounds)
    protocol.cache = BoundedStorage.adopt(protocol.cache, refused, **bounds)
    guard = StoreGuard(protocol, refused, rates=rates)
    if not protocol.client_mode:  # a client serves no RPCs
        servicer = guard if protocol.authorizer is None else AuthRPCWrapper(guard, AuthRole.SERVICER,
                                                                            protocol.authorizer)
        for method, request_type in (("rpc_store", dht_pb2.StoreRequest), ("rpc_find", dht_pb2.FindRequest)):
            name = type(protocol)._get_handle_name(None, method)
            await protocol.p2p.remove_protobuf_handler(name)
            await protocol.p2p.add_protobuf_handler(name, getattr(servicer, method), request_type)
    return guard


@dataclass
class _Watched:
    reads: int = 0  # reads of the key under way
    tried: int = 0  # finds asked of a peer for it (a blacklisted peer's included: hivemind skips it unasked)
    answered: int = 0  # ... that the peer answered (with or without a value)


class FindWatch:
    """Reads of one DHT node that tell "no peer answered" from "nothing there" (workaround 6). Create one
    per `DHTNode`, once; a node without `_call_find_with_blacklist` (a stand-in) is read as-is."""

    def __init__(self, node: DHTNode) -> None:
        self.node = node
        self._watched: dict[DHTID, _Watched] = {}  # only keys with a read under way: bounded by the reads
        inner: Callable[[Any, Collection[DHTID]], Awaitable[Any]] | None = getattr(node, "_call_find_with_blacklist",
                                                                                    None)
        if inner is None:
            return

        async def call_find(peer_id: Any, keys: Collection[DHTID]) -> Any:
            response = await inner(peer_id, keys)
            for key in keys:
                watched = self._watched.get(key)
                if watched is not None:
                    watched.tried += 1
                    watched.answered += response is not None
            return response

        node._call_find_with_blacklist = call_find

    async def get_latest(self, key: str) -> tuple[ValueWithExpiration | None, bool]:
        """The latest value under `key` (None if none was found) and whether the read was answered: a
        value was found, or a peer answered a find, or there was no peer to ask (this node alone)."""
        key_id = DHTID.generate(source=key)
        watched = self._watched.setdefault(key_id, _Watched())
        watched.reads += 1
        tried, answered = watched.tried, watched.answered
        try:
            found: ValueWithExpiration | None = await self.node.get(key, latest=True)
        finally:
            watched.reads -= 1
            if not watched.reads:
                del self._watched[key_id]
        return found, found is not None or watched.tried == tried or watched.answered > answered
