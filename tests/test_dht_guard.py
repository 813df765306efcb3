"""The DHT below murmur's validators (node.net.dht_guard, node.net.validation): an owner key whose verify
would be dear is refused unverified, a store request's repeated entries are validated once and its
entries beyond a budget not at all, validation runs off the event loop, and the local storage is bounded."""

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

from node.net.dht_guard import MAX_VALIDATED_PER_STORE, BoundedStorage, StoreGuard
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
