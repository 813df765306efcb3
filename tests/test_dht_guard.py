"""The DHT below murmur's validators (node.net.dht_guard, node.net.validation): an owner key whose verify
would be dear is refused unverified, a store request's repeated entries are validated once and its
entries beyond a budget not at all, validation runs off the event loop, the local storage is bounded,
and each peer's store entries and find keys are held to a rate an honest peer never reaches."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.proto import dht_pb2
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from node.net.dht_guard import (
    MAX_RATED_PEERS,
    MAX_VALIDATED_PER_STORE,
    MIN_RATED_HEARTBEAT_S,
    BoundedStorage,
    DhtRates,
    PeerRates,
    StoreGuard,
)
from node.net.identity import Identity, create_identity
from node.net.validation import MAX_OWNER_KEY_BITS, RecordRefusal, RefusalCounts, make_record_validator
from tests.support.hostile_dht import distinct_keys, large_exponent_key

pytestmark = pytest.mark.unit

KEY = "some.key"


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Identity]:
    directory = tmp_path_factory.mktemp("ids")
    return {name: create_identity(directory / f"{name}.key") for name in ("node", "member")}


def _owner(key: RSAPrivateKey) -> bytes:
    return RSASignatureValidator(key).local_public_key


def _record(signer: RSAPrivateKey, value: bytes = b"x", *, key: str = KEY, expires_in: float = 60.0,
            owner: bytes | None = None) -> DHTRecord:
    """A record under `key` in the subkey of `owner` (the signer's key unless given), signed by `signer`."""
    record = DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(owner or _owner(signer)),
                       MSGPackSerializer.dumps(value), get_dht_time() + expires_in)
    signature = signer.sign(MSGPackSerializer.dumps(dataclasses.astuple(record)))
    return dataclasses.replace(record, value=record.value + b"[signature:" + signature + b"]")


class Counting:
    """A validator that counts its calls (and the threads it ran on) before passing them on."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls, self.threads = inner, 0, set[int]()

    def validate(self, record: DHTRecord) -> bool:
        self.calls += 1
        self.threads.add(threading.get_ident())
        return bool(self.inner.validate(record))


@dataclasses.dataclass
class FakeProtocol:
    """What StoreGuard uses of a DHTProtocol."""

    record_validator: Any
    storage: BoundedStorage
    cache: BoundedStorage
    node_info: dht_pb2.NodeInfo = dataclasses.field(default_factory=dht_pb2.NodeInfo)

    async def rpc_ping(self, request: dht_pb2.PingRequest, context: object) -> None:
        return None

    async def rpc_find(self, request: dht_pb2.FindRequest, context: object) -> dht_pb2.FindResponse:
        return dht_pb2.FindResponse(results=[dht_pb2.FindResult(type=dht_pb2.NOT_FOUND) for _ in request.keys],
                                    peer=self.node_info)


def _guard(ids: dict[str, Identity], **bounds: Any) -> tuple[StoreGuard, FakeProtocol, Counting, RefusalCounts]:
    refused = RefusalCounts()
    counting = Counting(make_record_validator(RSASignatureValidator(ids["node"].signing_key), refused=refused))
    protocol = FakeProtocol(counting, BoundedStorage(refused, **bounds), BoundedStorage(refused, **bounds))
    return StoreGuard(protocol, refused), protocol, counting, refused  # type: ignore[arg-type]


def _request(records: list[DHTRecord]) -> dht_pb2.StoreRequest:
    return dht_pb2.StoreRequest(keys=[r.key for r in records], subkeys=[r.subkey for r in records],
                                values=[r.value for r in records], expiration_time=[r.expiration_time for r in records],
                                in_cache=[False] * len(records))


def _store(guard: StoreGuard, request: dht_pb2.StoreRequest) -> list[bool]:
    async def run() -> list[bool]:
        try:
            return list((await guard.rpc_store(request, None)).store_ok)  # type: ignore[arg-type]
        finally:
            guard.close()

    return asyncio.run(run())


def _public_key_of_size(bits: int, exponent: int = 65537) -> bytes:
    """The OpenSSH encoding of an RSA public key with a `bits`-bit modulus (not a product of two primes:
    the refusal comes before anything would notice)."""
    n = (1 << (bits - 1)) | 1
    return rsa.RSAPublicNumbers(exponent, n).public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                                       serialization.PublicFormat.OpenSSH)


def test_an_owner_key_with_a_large_exponent_or_modulus_is_refused_before_any_verify(ids, monkeypatch):
    refused = RefusalCounts()
    validator = make_record_validator(RSASignatureValidator(ids["node"].signing_key), refused=refused)
    verifies = []
    original = RSASignatureValidator.validate
    monkeypatch.setattr(RSASignatureValidator, "validate", lambda self, r: verifies.append(r) or original(self, r))
    large_e = large_exponent_key(1024)
    assert not validator.validate(_record(large_e))
    wide = RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", _public_key_of_size(MAX_OWNER_KEY_BITS + 8))
    member = ids["member"].signing_key
    assert not validator.validate(_record(member, owner=wide))  # its signature is not even looked at
    assert dict(refused.counts) == {RecordRefusal.ODD_KEY: 2} and verifies == []
    assert validator.validate(_record(member)) and len(verifies) == 1  # an ordinary key is verified


def test_a_store_request_validates_a_repeated_entry_once(ids):
    guard, protocol, counting, refused = _guard(ids)
    record = _record(ids["member"].signing_key)
    ok = _store(guard, _request([record] * 1000))
    assert ok[0] and not any(ok[1:]) and counting.calls == 1
    assert refused.counts[RecordRefusal.DUPLICATE] == 999 and protocol.storage.entries == 1


def test_a_store_request_validates_at_most_its_budget_off_the_event_loop(ids):
    guard, _protocol, counting, refused = _guard(ids)
    large_e = large_exponent_key(1024)
    member = ids["member"].signing_key
    records = [_record(member, b"%d" % i) for i in range(10)] + \
        [_record(large_e, b"%d" % i) for i in range(2 * MAX_VALIDATED_PER_STORE)]
    ok = _store(guard, _request(records))
    assert counting.calls == MAX_VALIDATED_PER_STORE and threading.get_ident() not in counting.threads
    assert refused.counts[RecordRefusal.OVER_BUDGET] == len(records) - MAX_VALIDATED_PER_STORE
    assert refused.counts[RecordRefusal.ODD_KEY] == MAX_VALIDATED_PER_STORE - 10
    assert all(ok[:10])  # one subkey: each (later-expiring) value replaces the one before
    assert not any(ok[10:])


def test_a_dictionary_keeps_its_valid_entries(ids):
    guard, protocol, counting, _refused = _guard(ids)
    member, keys = ids["member"].signing_key, distinct_keys(2)
    good = [_record(k, b"v") for k in (member, *keys)]
    forged = _record(member, b"v", owner=_owner(keys[0]))
    dictionary = DictionaryDHTValue()
    for record in good[:2] + [forged]:
        dictionary.store(MSGPackSerializer.loads(record.subkey), record.value, record.expiration_time)
    request = dht_pb2.StoreRequest(keys=[good[0].key], subkeys=[DHTProtocol.IS_DICTIONARY],
                                   values=[MSGPackSerializer.dumps(dictionary)],
                                   expiration_time=[dictionary.latest_expiration_time], in_cache=[False])
    assert _store(guard, request) == [False]  # not all of it was stored
    held = protocol.storage.get(DHTID.from_bytes(good[0].key))
    assert held is not None and set(held.value.data) == {MSGPackSerializer.loads(good[0].subkey)}
    assert counting.calls == 2  # the forged entry replaced the second good one in the dictionary


def test_the_local_storage_refuses_new_entries_beyond_its_bound_and_keeps_refreshes(ids):
    refused = RefusalCounts()
    now = [0.0]
    storage = BoundedStorage(refused, max_entries=3, max_bytes=10_000, clock=lambda: now[0])
    key = DHTID.generate(source=KEY)
    expiration = get_dht_time() + 60
    for i in range(3):
        assert storage.store_subkey(key, b"owner%d" % i, b"v" * 100, expiration)
    assert not storage.store_subkey(key, b"owner9", b"v" * 100, expiration)
    assert not storage.store(DHTID.generate(source="other"), b"v", expiration)
    assert refused.counts[RecordRefusal.STORAGE_FULL] == 2
    assert storage.store_subkey(key, b"owner1", b"v" * 100, expiration + 1)  # its owner's next heartbeat
    # entries that expire make room again, once the storage is counted again
    short = BoundedStorage(refused, max_entries=1, max_bytes=10_000, clock=lambda: now[0])
    assert short.store(key, b"v", get_dht_time() + 0.05)
    assert not short.store(DHTID.generate(source="other"), b"v", expiration)
    asyncio.run(asyncio.sleep(0.1))
    now[0] += 2.0
    assert short.store(DHTID.generate(source="other"), b"v", expiration)


def test_the_local_storage_bounds_bytes(ids):
    refused = RefusalCounts()
    storage = BoundedStorage(refused, max_entries=100, max_bytes=1000)
    key = DHTID.generate(source=KEY)
    expiration = get_dht_time() + 60
    assert storage.store_subkey(key, b"a", b"v" * 600, expiration)
    assert not storage.store_subkey(key, b"b", b"v" * 600, expiration)
    assert storage.store_subkey(key, b"b", b"v" * 300, expiration)
    assert refused.counts[RecordRefusal.STORAGE_FULL] == 1 and storage.bytes <= 1000


@dataclasses.dataclass(frozen=True)
class From:
    """What StoreGuard reads of an RPC's P2PContext: the peer it came from."""

    remote_id: str


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Accepting:
    """A validator that takes everything (the rate tests are about what reaches it, not its verdicts)."""

    def __init__(self) -> None:
        self.calls = 0

    def validate(self, record: DHTRecord) -> bool:
        self.calls += 1
        return True


def _rated_guard(rates: DhtRates) -> tuple[StoreGuard, Accepting, RefusalCounts, Clock]:
    refused, clock, accepting = RefusalCounts(), Clock(), Accepting()
    protocol = FakeProtocol(accepting, BoundedStorage(refused), BoundedStorage(refused))
    return StoreGuard(protocol, refused, rates=rates, clock=clock), accepting, refused, clock  # type: ignore[arg-type]


def _entries(count: int, tag: str, expiration: float) -> dht_pb2.StoreRequest:
    """`count` distinct subkey entries under one key (unsigned: the validator here takes anything)."""
    key = DHTID.generate(source=f"rated.{tag}").to_bytes()
    return dht_pb2.StoreRequest(keys=[key] * count, subkeys=[MSGPackSerializer.dumps(b"owner%d" % i) for i in range(count)],
                                values=[b"v%d" % i for i in range(count)], expiration_time=[expiration] * count,
                                in_cache=[False] * count)


def _find(keys: int) -> dht_pb2.FindRequest:
    return dht_pb2.FindRequest(keys=[DHTID.generate(source=f"k{i}").to_bytes() for i in range(keys)])


def test_a_peer_over_its_rate_is_refused_unvalidated_and_counted_while_another_is_served() -> None:
    guard, accepting, refused, clock = _rated_guard(DhtRates(store_entries_per_s=10, store_burst=50,
                                                             find_keys_per_s=1, find_burst=3))
    flooder, honest = From("flooder"), From("honest")
    expiration = get_dht_time() + 60

    async def scenario() -> None:
        try:
            ok = list((await guard.rpc_store(_entries(80, "a", expiration), flooder)).store_ok)  # type: ignore[arg-type]
            assert ok == [True] * 50 + [False] * 30 and accepting.calls == 50
            assert refused.counts[RecordRefusal.OVER_RATE] == 30
            ok = list((await guard.rpc_store(_entries(5, "b", expiration), flooder)).store_ok)  # type: ignore[arg-type]
            assert not any(ok) and accepting.calls == 50  # drained: nothing more reaches the validator
            ok = list((await guard.rpc_store(_entries(20, "c", expiration), honest)).store_ok)  # type: ignore[arg-type]
            assert all(ok) and accepting.calls == 70  # another peer is served in full
            clock.now += 1.0  # a second refills 10 of the flooder's entries
            ok = list((await guard.rpc_store(_entries(20, "d", expiration), flooder)).store_ok)  # type: ignore[arg-type]
            assert sum(ok) == 10 and refused.counts[RecordRefusal.OVER_RATE] == 30 + 5 + 10
            # finds: each key counts; a request beyond the rate is answered for no key, and counted
            assert len((await guard.rpc_find(_find(3), flooder)).results) == 3  # type: ignore[arg-type]
            assert len((await guard.rpc_find(_find(1), flooder)).results) == 0  # type: ignore[arg-type]
            assert refused.counts[RecordRefusal.OVER_RATE] == 46
            assert len((await guard.rpc_find(_find(2), honest)).results) == 2  # type: ignore[arg-type]
        finally:
            guard.close()

    asyncio.run(scenario())


def test_an_honest_peers_heartbeats_reads_and_key_hand_off_are_never_refused() -> None:
    """What an honest peer sends one node per heartbeat at the shortest heartbeat the rates are sized for
    (node.net.dht_guard, STORE_ENTRIES_PER_S): its own three entries, the cache store hivemind sends after
    each of its four reads (a whole dictionary, MAX_VALIDATED_PER_STORE validated), ten find keys; and
    once, a newcomer's key hand-off, all in a burst the moment it meets the node."""
    guard, accepting, refused, clock = _rated_guard(DhtRates())
    peer = From("honest")
    start = get_dht_time() + 60

    async def scenario() -> None:
        try:
            expiration, stored = start, 0
            hand_off = await guard.rpc_store(_entries(MAX_VALIDATED_PER_STORE, "hand-off", expiration), peer)  # type: ignore[arg-type]
            stored += sum(hand_off.store_ok)
            for _beat in range(40):
                expiration += 1  # each heartbeat's entries replace the last ones
                requests = [_entries(3, "own", expiration)] + \
                    [_entries(MAX_VALIDATED_PER_STORE, f"read{i}", expiration) for i in range(4)]
                for request in requests:
                    stored += sum((await guard.rpc_store(request, peer)).store_ok)  # type: ignore[arg-type]
                for _ in range(10):
                    assert len((await guard.rpc_find(_find(1), peer)).results) == 1  # type: ignore[arg-type]
                clock.now += MIN_RATED_HEARTBEAT_S
            assert stored == MAX_VALIDATED_PER_STORE + 40 * (3 + 4 * MAX_VALIDATED_PER_STORE) == accepting.calls
            assert refused.counts[RecordRefusal.OVER_RATE] == 0
        finally:
            guard.close()

    asyncio.run(scenario())


def test_the_rate_table_stays_bounded_under_many_peer_ids_and_keeps_a_drained_bucket() -> None:
    clock = Clock()
    rates = PeerRates(rate_per_s=1.0, burst=10, max_peers=MAX_RATED_PEERS, clock=clock)
    assert rates.take("flooder", 10) == 10 and rates.take("flooder") == 0
    for i in range(5 * MAX_RATED_PEERS):  # fresh peer ids, each asking once, one after another
        assert rates.take(f"sybil{i}") == 1
        assert len(rates) <= MAX_RATED_PEERS
        clock.now += 1e-4
    assert rates.take("flooder") == 0  # its drained bucket was never the one forgotten
    assert rates.take("flooder", 5, partial=True) == 0
    clock.now += 3.0
    assert rates.take("flooder", 5, partial=True) == 3  # refilled at its rate, no faster
