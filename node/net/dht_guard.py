"""What one DHT store request, one peer's requests and all of them together may cost a node: its store and
find RPCs and local storage.

hivemind's DHT answers anyone's store RPC (no membership is needed to be a DHT node) and its handler
(`DHTProtocol.rpc_store`) validates every entry of a request on the node's one event loop, in turn: a
request of a few MiB may repeat one signed entry thousands of times, each RSA-verified again. Its local
storage keeps whatever validates, with no bound on the total. `StoreGuard.rpc_store` answers the same
RPC instead (node.net.hivemind_adapter.guard_dht_node installs it) and:

- drops an entry identical to one earlier in the same request (key, subkey, value, expiration) before
  any validation (`dht_refused_duplicate`);
- validates at most MAX_VALIDATED_PER_STORE entries of one request (dictionary entries counted one by
  one); the rest are refused unvalidated (`dht_refused_over_budget`);
- charges each entry it would validate to the sending peer's store rate, and refuses the entries beyond
  it unvalidated (`dht_refused_over_rate`); `StoreGuard.rpc_find` answers the find RPC likewise, each key
  of a request charged to the peer's find rate, a request beyond it refused whole (DhtRates, PeerRates);
- validates on a thread of its own (one per node), so the event loop that heartbeats and steps the
  node waits for no RSA verify; the entries are stored back on the loop, where hivemind's storage lives;
- stores into `BoundedStorage`, which refuses new entries beyond MAX_STORED_ENTRIES or MAX_STORED_BYTES
  (`dht_refused_storage_full`) and still takes a record's owner storing it again (its heartbeat).

Unlike hivemind, which refuses a whole dictionary when one of its entries fails, the guard stores a
dictionary's valid entries one by one (each is signed by its own owner) and answers True only if all were.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import P2PContext
from hivemind.proto import dht_pb2

from node.net.validation import RecordRefusal, RefusalCounts

# An honest murmur node's own store carries at most three entries (its peer record, its SPES records,
# the config), and a node handing a newcomer the keys it should hold sends whole dictionaries: a swarm's
# `<swarm>.peers` of up to this many peers arrives whole; the entries of a larger one come from their
# owners' next heartbeat instead. With owner keys of at most MAX_OWNER_KEY_BITS and e = 65537, one
# request costs at most this many verifies of ~0.1 ms: ~15 ms of one core, off the event loop.
MAX_VALIDATED_PER_STORE = 128
# A node holds the keys of the swarms whose key ids fall near its own: a few entries per peer of each
# (its record and its SPES records under two keys). 16384 entries hold eight swarms of a thousand peers,
# a bootstrap's share of many more; 64 MiB is what a volunteer's node may spend on others' records
# (each value is at most MAX_DHT_VALUE_BYTES, so a full-size SPES record of 64 owners fits).
MAX_STORED_ENTRIES = 16384
MAX_STORED_BYTES = 64 << 20
# Entries only leave the storage on expiry, and hivemind purges them lazily: a full storage is counted
# again at most this often (a walk over at most MAX_STORED_ENTRIES entries), else refused on its count.
RECOUNT_INTERVAL_S = 1.0
# Per-peer rates (DhtRates): what one DHT peer (its libp2p id, authenticated by the connection) may make a
# node validate and look up. They must never be reached by an honest peer, which per heartbeat sends a node
# at most (hivemind 1.1.12's DHTNode, node.net.discovery, node.algorithms.spes.directory):
# - store entries: its own 3 (peer record, expert records, the config every few heartbeats), and after each
#   read of a key, the value found is stored again on the nearest node that lacked it (`cache_nearest=1`):
#   the whole `<swarm>.peers` or `<swarm>.experts` dictionary, each read twice a heartbeat (the view every
#   half heartbeat, the SPES directory at most as often), up to MAX_VALIDATED_PER_STORE validated each:
#   4 * 128 + 3 = 515 entries; once, when a node first meets another, the keys it should hold (one request,
#   at most MAX_VALIDATED_PER_STORE validated);
# - find keys: each get or store visits a node at most once per key: 4 reads of keys split over S shards
#   (node.net.records.ShardedKey, S at most MAX_MEMBERSHIP_SHARDS), 3 stores and the config watch, 4S + 4
#   keys, plus on-demand view reads (an unknown peer's stream, node.net.membership): ~5S + 4, 84 at S = 16.
# At the shortest heartbeat murmur's own swarms run (MIN_RATED_HEARTBEAT_S) that is ~1030 entries and ~170
# keys a second; the rates are at least about twice that and each burst is two seconds of its rate (a hand-off
# and a stalled heartbeat's backlog). A bootstrap's peers send it the same (it is a DHT node like any, and
# bootstraps heartbeat nothing of their own). What the rates bound: per peer id, ~2048 verifies a second (off
# the event loop; ~0.1 ms each for a 2048-bit key, 0.3 ms at MAX_OWNER_KEY_BITS) and ~320 lookups a second
# (each a value of at most MAX_STORED_BYTES serialized, on the loop). A swarm whose heartbeat is shorter
# than MIN_RATED_HEARTBEAT_S and which holds more than ~100 peers may see its cache stores refused (a
# sharded key's shards are stored back one request each, N entries in all for N peers): they are a cache,
# and its records still reach their replicas.
MIN_RATED_HEARTBEAT_S = 0.5
STORE_ENTRIES_PER_S = 2048.0
STORE_ENTRY_BURST = 4096
FIND_KEYS_PER_S = 320.0
FIND_KEY_BURST = 640
# Peers whose buckets are kept: a node meets its bucket_size (20) nearest DHT nodes per key and the peers of
# its swarms (a view holds at most 256). Beyond this, buckets that refilled are forgotten (a new bucket
# starts full: nothing is lost), else the fullest eighth: a peer that spends its rate keeps its bucket.
MAX_RATED_PEERS = 1024
_OTHER_SUBKEY_BYTES = 64  # a subkey that is neither bytes nor str (murmur's are bytes: an owner key)


def _subkey_bytes(subkey: object) -> int:
    return len(subkey) if isinstance(subkey, (bytes, str)) else _OTHER_SUBKEY_BYTES


@dataclass(frozen=True)
class DhtRates:
    """What one DHT peer may ask of a node: store entries validated and find keys looked up, per second,
    with a burst of each (see STORE_ENTRIES_PER_S for the numbers)."""

    store_entries_per_s: float = STORE_ENTRIES_PER_S
    store_burst: int = STORE_ENTRY_BURST
    find_keys_per_s: float = FIND_KEYS_PER_S
    find_burst: int = FIND_KEY_BURST
    max_peers: int = MAX_RATED_PEERS


class PeerRates:
    """A token bucket per peer (`burst` tokens, refilled at `rate_per_s`) for at most `max_peers` peers.
    A new peer beyond that forgets every bucket that has refilled (one that had not been made would be
    the same), or if none has, the fullest eighth: a peer that keeps its bucket drained cannot have it
    forgotten by sending from many other peer ids."""

    def __init__(self, rate_per_s: float, burst: int, max_peers: int = MAX_RATED_PEERS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if rate_per_s <= 0 or burst < 1 or max_peers < 1:
            raise ValueError("a rate, a burst and a table of at least one peer")
        self._rate, self._burst, self._max_peers, self._clock = rate_per_s, float(burst), max_peers, clock
        self._buckets: dict[str, tuple[float, float]] = {}  # peer -> (tokens, when counted)

    def __len__(self) -> int:
        return len(self._buckets)

    def _level(self, tokens: float, at: float, now: float) -> float:
        return min(self._burst, tokens + (now - at) * self._rate)

    def _make_room(self, now: float) -> None:
        # One walk over the table frees many places (all refilled buckets, else the fullest eighth), so
        # peer ids met one after another cost a walk per max_peers / 8 of them, not one each.
        levels = {peer: self._level(tokens, at, now) for peer, (tokens, at) in self._buckets.items()}
        full = [peer for peer, level in levels.items() if level >= self._burst]
        for peer in full or heapq.nlargest(max(1, len(levels) // 8), levels, key=levels.__getitem__):
            del self._buckets[peer]

    def take(self, peer: str, n: int = 1, *, partial: bool = False) -> int:
        """Charge `peer` for `n` tokens: how many it got (`n` or 0; with `partial`, as many as it has)."""
        now = self._clock()
        held = self._buckets.get(peer)
        if held is None:
            if len(self._buckets) >= self._max_peers:
                self._make_room(now)
            tokens = self._burst
        else:
            tokens = self._level(*held, now)
        granted = min(n, math.floor(tokens)) if partial else (n if tokens >= n else 0)
        self._buckets[peer] = (tokens - granted, now)
        return granted


def _peer_of(context: P2PContext | None) -> str:
    """The peer an RPC came from (libp2p authenticates it); "" when unknown (a local call)."""
    remote = getattr(context, "remote_id", None)
    return "" if remote is None else str(remote)


class BoundedStorage(DHTLocalStorage):  # type: ignore[misc]  # hivemind is untyped
    """hivemind's local DHT storage with a bound on its entries (plain values and dictionary entries)
    and their bytes. Beyond either, a new entry is refused and counted; an entry already held may still
    be replaced by one no larger (its owner's next heartbeat), so honest records already held stay.

    The counts grow with each store and are only made exact again by a recount (expired entries leave
    lazily), so they err on the side of refusing, and at most for RECOUNT_INTERVAL_S."""

    def __init__(self, refused: RefusalCounts, *, max_entries: int = MAX_STORED_ENTRIES,
                 max_bytes: int = MAX_STORED_BYTES, maxsize: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(maxsize=maxsize)
        self._refused = refused
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.entries = 0
        self.bytes = 0
        self._clock = clock
        self._recounted_at = -math.inf

    @classmethod
    def adopt(cls, storage: DHTLocalStorage, refused: RefusalCounts, **bounds: Any) -> BoundedStorage:
        """A bounded storage holding what `storage` holds (its maxsize too)."""
        maxsize = None if storage.maxsize == float("inf") else int(storage.maxsize)
        bounded = cls(refused, maxsize=maxsize, **bounds)
        for key, item in list(storage.items()):
            super(DHTLocalStorage, bounded).store(key, item.value, item.expiration_time)
        bounded.recount()
        return bounded

    def recount(self) -> None:
        """Count the entries and bytes held now (dropping those expired)."""
        entries = size = 0
        for _, item in list(self.items()):
            if isinstance(item.value, DictionaryDHTValue):
                for subkey, sub in list(item.value.items()):
                    entries += 1
                    size += _subkey_bytes(subkey) + len(sub.value)
            else:
                entries += 1
                size += len(item.value)
        self.entries, self.bytes = entries, size
        self._recounted_at = self._clock()

    def _room(self, new_entries: int, new_bytes: int) -> bool:
        def fits() -> bool:
            return self.entries + new_entries <= self.max_entries and self.bytes + new_bytes <= self.max_bytes

        if fits():
            return True
        if self._clock() - self._recounted_at >= RECOUNT_INTERVAL_S:
            self.recount()
        return fits()

    def store(self, key: DHTID, value: Any, expiration_time: float, subkey: Any = None) -> bool:
        if subkey is not None:
            return self.store_subkey(key, subkey, value, expiration_time)
        held = self.data.get(key)
        held_bytes = len(held.value) if held is not None and isinstance(held.value, bytes) else None
        size = len(value)
        if (held_bytes is None or size > held_bytes) and \
                not self._room(0 if held is not None else 1, size - (held_bytes or 0)):
            return self._refused.refuse(RecordRefusal.STORAGE_FULL)
        stored = bool(super().store(key, value, expiration_time))
        if stored:
            self.entries += 1 if held is None else 0
            self.bytes += max(0, size - (held_bytes or 0))
        return stored

    def store_subkey(self, key: DHTID, subkey: Any, value: bytes, expiration_time: float) -> bool:
        held = self.data.get(key)
        held_item = held.value.data.get(subkey) if held is not None and isinstance(held.value, DictionaryDHTValue) \
            else None
        size = _subkey_bytes(subkey) + len(value)
        held_size = _subkey_bytes(subkey) + len(held_item.value) if held_item is not None else None
        if (held_size is None or size > held_size) and \
                not self._room(0 if held_item is not None else 1, size - (held_size or 0)):
            return self._refused.refuse(RecordRefusal.STORAGE_FULL)
        stored = bool(super().store_subkey(key, subkey, value, expiration_time))
        if stored:
            self.entries += 0 if held_item is not None else 1
            self.bytes += max(0, size - (held_size or 0))
        return stored


class StoreGuard:
    """Answers the DHT store and find RPCs of one `DHTProtocol` (see the module's docstring); `close`
    when the DHT node stops."""

    def __init__(self, protocol: DHTProtocol, refused: RefusalCounts, *,
                 max_validated: int = MAX_VALIDATED_PER_STORE, rates: DhtRates | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._protocol = protocol
        self._refused = refused
        self._max_validated = max_validated
        rates = rates if rates is not None else DhtRates()
        self._store_rates = PeerRates(rates.store_entries_per_s, rates.store_burst, rates.max_peers, clock)
        self._find_rates = PeerRates(rates.find_keys_per_s, rates.find_burst, rates.max_peers, clock)
        self._verifier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dht-verify")
        self._pings: set[asyncio.Task[Any]] = set()

    def close(self) -> None:
        self._verifier.shutdown(wait=False, cancel_futures=True)

    def _validate_all(self, records: list[DHTRecord]) -> list[bool]:
        validator = self._protocol.record_validator
        if validator is None:
            return [True] * len(records)
        return [bool(validator.validate(record)) for record in records]

    async def rpc_find(self, request: dht_pb2.FindRequest, context: P2PContext) -> dht_pb2.FindResponse:
        """hivemind's find, once the sender's find rate holds every key of the request; else an answer
        for no key, which its sender takes for a failed request (and refused here unread)."""
        if not self._find_rates.take(_peer_of(context), max(1, len(request.keys))):
            self._refused.refuse(RecordRefusal.OVER_RATE)
            return dht_pb2.FindResponse(results=[], peer=self._protocol.node_info)
        response: dht_pb2.FindResponse = await self._protocol.rpc_find(request, context)
        return response

    async def rpc_store(self, request: dht_pb2.StoreRequest, context: P2PContext) -> dht_pb2.StoreResponse:
        protocol = self._protocol
        if request.peer:  # as hivemind's: the sender may join the routing table
            task = asyncio.create_task(protocol.rpc_ping(dht_pb2.PingRequest(peer=request.peer), context))
            self._pings.add(task)
            task.add_done_callback(self._pings.discard)
        response = dht_pb2.StoreResponse(store_ok=[], peer=protocol.node_info)
        count = len(request.keys)
        if not count == len(request.subkeys) == len(request.values) == len(request.expiration_time) \
                == len(request.in_cache):
            self._refused.refuse(RecordRefusal.MALFORMED)
            return response
        # per entry of the request: (storage, key id, [(subkey or None, record) to validate and store])
        plan: list[tuple[DHTLocalStorage, DHTID, list[tuple[Any, DHTRecord]], bool]] = []
        to_validate: list[DHTRecord] = []
        seen: set[tuple[bytes, bytes, bytes, float]] = set()
        peer = _peer_of(context)
        for key, tag, value, expiration, in_cache in zip(request.keys, request.subkeys, request.values,
                                                         request.expiration_time, request.in_cache):
            storage = protocol.cache if in_cache else protocol.storage
            items: list[tuple[Any, DHTRecord]] = []
            complete = True
            try:
                key_id = DHTID.from_bytes(key)
                if tag == DHTProtocol.IS_DICTIONARY:
                    dictionary = DHTProtocol.serializer.loads(value)
                    if not isinstance(dictionary, DictionaryDHTValue):
                        raise ValueError("not a dictionary")
                    with dictionary.freeze():
                        entries = [(subkey, DHTProtocol.serializer.dumps(subkey), item.value, item.expiration_time)
                                   for subkey, item in dictionary.items()]
                elif tag == DHTProtocol.IS_REGULAR_VALUE:
                    entries = [(None, tag, value, expiration)]
                else:
                    entries = [(DHTProtocol.serializer.loads(tag), tag, value, expiration)]
            except Exception:  # a malformed key, subkey or dictionary: hivemind's handler would fail the request
                self._refused.refuse(RecordRefusal.MALFORMED)
                plan.append((storage, DHTID(0), [], False))
                continue
            for subkey, subkey_bytes, item_value, item_expiration in entries:
                if not isinstance(item_value, bytes):
                    self._refused.refuse(RecordRefusal.MALFORMED)
                    complete = False
                    continue
                identity = (key, subkey_bytes, item_value, float(item_expiration))
                if identity in seen:
                    self._refused.refuse(RecordRefusal.DUPLICATE)
                    complete = False
                    continue
                seen.add(identity)
                if len(to_validate) >= self._max_validated:
                    self._refused.refuse(RecordRefusal.OVER_BUDGET)
                    complete = False
                    continue
                if not self._store_rates.take(peer, partial=True):
                    self._refused.refuse(RecordRefusal.OVER_RATE)
                    complete = False
                    continue
                record = DHTRecord(key, subkey_bytes, item_value, float(item_expiration))
                to_validate.append(record)
                items.append((subkey, record))
            plan.append((storage, key_id, items, complete))
        valid: list[bool] = []
        if to_validate:
            loop = asyncio.get_running_loop()
            valid = await loop.run_in_executor(self._verifier, self._validate_all, to_validate)
        verdict = iter(valid)
        for storage, key_id, items, complete in plan:
            ok = complete and bool(items)
            for subkey, record in items:
                if not next(verdict):
                    ok = False
                elif subkey is None:
                    ok = bool(storage.store(key_id, record.value, record.expiration_time)) and ok
                else:
                    ok = bool(storage.store_subkey(key_id, subkey, record.value, record.expiration_time)) and ok
            response.store_ok.append(ok)
        return response
