"""The DHT validators (node.net.validation), one test per rule, on records as they travel between DHT
nodes: signed by their owner's key, or forged. What a node of a swarm refuses, and what `murmur
bootstrap` (no swarm) refuses."""

from __future__ import annotations

import collections
import dataclasses
import time
from pathlib import Path

import msgspec
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from gossip.spes import ExpertRecord
from node.config import NodeConfig, TrainingConfig
from node.net.admission import Admission, key_check
from node.net.founder import issue_certificate, sign_config
from node.net.identity import Identity, create_identity
from node.net.records import (
    PeerRecord,
    ShardedKey,
    config_key,
    encode_expert_records,
    encode_peer_record,
    encode_withdrawal,
    experts_key,
    peers_key,
)
from node.net.validation import (
    MAX_CLOCK_SKEW_S,
    MAX_CONFIG_TTL_S,
    MAX_DHT_VALUE_BYTES,
    MAX_RECORD_TTL_S,
    RefusalCounts,
    SwarmMembership,
    make_record_validator,
)
from node.runtime.founding import swarm_document
from node.swarm.recipe import MAX_MEMBERSHIP_SHARDS, AdmissionDoc, AdmissionMode

pytestmark = pytest.mark.unit

SWARM = "valswarm"
KEY = b"k" * 64


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Identity]:
    directory = tmp_path_factory.mktemp("ids")
    return {name: create_identity(directory / f"{name}.key") for name in ("founder", "member", "stranger", "node")}


def _weak_key() -> RSAPrivateKey:
    """A 1024-bit key: hivemind signs with it, but no libp2p peer can have it."""
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    private = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    key.__setstate__({"_private_key": private.private_bytes(serialization.Encoding.DER,
                                                            serialization.PrivateFormat.TraditionalOpenSSL,
                                                            serialization.NoEncryption())})
    return key


def _owner(key: RSAPrivateKey) -> bytes:
    return RSASignatureValidator(key).local_public_key


def _record(signer: RSAPrivateKey | None, key: str, value: bytes, *, subkey: bytes | None = None,
            expires_in: float = 10.0) -> DHTRecord:
    """A DHT record as it travels: in `signer`'s subkey (its owner key, unless `subkey` says otherwise) and
    signed by it; with no signer, a plain value (no subkey)."""
    raw_subkey = DHTProtocol.IS_REGULAR_VALUE if subkey is None and signer is None else \
        MSGPackSerializer.dumps(subkey if subkey is not None else _owner(signer))  # type: ignore[arg-type]
    record = DHTRecord(DHTID.generate(source=key).to_bytes(), raw_subkey, MSGPackSerializer.dumps(value),
                       get_dht_time() + expires_in)
    if signer is None:
        return record
    signature = signer.sign(MSGPackSerializer.dumps(dataclasses.astuple(record)))
    return dataclasses.replace(record, value=record.value + b"[signature:" + signature + b"]")


def _peer_record(peer_id: str, credential: str = "", heartbeat: float | None = None) -> PeerRecord:
    return PeerRecord(peer_id=peer_id, maddrs=(f"/ip4/127.0.0.1/tcp/1/p2p/{peer_id}",), step=1, round=1, experts=(),
                      capacity=0, version="t", heartbeat=time.time() if heartbeat is None else heartbeat,
                      credential=credential)


def _node(ids: dict[str, Identity], membership: SwarmMembership | None = None,
          swarm: str | None = SWARM) -> tuple[object, RefusalCounts]:
    counts = RefusalCounts()
    signer = RSASignatureValidator(ids["node"].signing_key)
    return make_record_validator(signer, swarm, membership or SwarmMembership(), counts), counts


VECTOR_DOC = swarm_document(NodeConfig(training=TrainingConfig(model="vector"), dim=8), epoch=1.0)


# ---- every key: what a bootstrap refuses too ---------------------------------------------------


@pytest.mark.parametrize("swarm", [SWARM, None], ids=["swarm node", "bootstrap"])
def test_every_key_refuses_plain_weak_oversized_and_far_values(ids, swarm):
    validator, counts = _node(ids, swarm=swarm)
    member = ids["member"].signing_key
    for key in (config_key(SWARM), peers_key(SWARM), experts_key(SWARM), "anything.else"):
        assert not validator.validate(_record(None, key, b"plain"))  # no owner: a plain value
    assert not validator.validate(_record(member, "anything.else", b"x", subkey=b"no owner here"))
    assert not validator.validate(_record(_weak_key(), "anything.else", b"x"))
    assert not validator.validate(_record(member, "anything.else", b"x" * MAX_DHT_VALUE_BYTES))
    assert not validator.validate(_record(member, "anything.else", b"x", expires_in=MAX_CONFIG_TTL_S
                                          + MAX_CLOCK_SKEW_S + 60))
    assert not validator.validate(_record(member, "anything.else", b"x", expires_in=1e9))
    assert dict(counts.counts) == {"unsigned": 5, "weak_key": 1, "too_large": 1, "expiration": 2}
    # a signed, bounded value under a key of no swarm this node knows is kept
    assert validator.validate(_record(member, "anything.else", b"x", expires_in=MAX_CONFIG_TTL_S))
    # a forged signature is hivemind's RSASignatureValidator's to refuse
    forged = _record(member, "anything.else", b"x", subkey=_owner(ids["founder"].signing_key))
    assert not validator.validate(forged)


# ---- <swarm>.peers ------------------------------------------------------------------------------


def test_peer_records_are_bounded_and_speak_only_for_their_owner(ids):
    validator, counts = _node(ids)
    m = ids["member"]
    record = encode_peer_record(_peer_record(m.peer_id))
    assert validator.validate(_record(m.signing_key, peers_key(SWARM), record))
    assert validator.validate(_record(m.signing_key, peers_key(SWARM), encode_withdrawal(m.peer_id)))
    assert not validator.validate(_record(m.signing_key, peers_key(SWARM), record,
                                          expires_in=MAX_RECORD_TTL_S + MAX_CLOCK_SKEW_S + 5))
    assert not validator.validate(_record(ids["stranger"].signing_key, peers_key(SWARM), record))  # about m
    assert not validator.validate(_record(m.signing_key, peers_key(SWARM), b"not a record"))
    assert not validator.validate(_record(m.signing_key, peers_key(SWARM), record + b"x" * 70_000))
    assert dict(counts.counts) == {"expiration": 1, "not_owner": 1, "malformed": 1, "too_large": 1}


def test_a_sharded_key_names_one_key_per_shard_and_spreads_peers_evenly():
    one = ShardedKey(peers_key(SWARM))
    assert one.shard_keys() == (peers_key(SWARM),) and one.key_of("anyone") == peers_key(SWARM)  # swarms before shards
    eight = ShardedKey(peers_key(SWARM), 8)
    assert eight.shard_keys() == tuple(f"{SWARM}.peers.{i}" for i in range(8))
    ids = [f"Qm{i:044d}" for i in range(4000)]
    counts = collections.Counter(eight.shard_of(peer) for peer in ids)
    assert sorted(counts) == list(range(8)) and max(counts.values()) < 1.2 * min(counts.values()), counts
    assert [eight.key_of(peer) for peer in ids[:50]] == [ShardedKey(peers_key(SWARM), 8).key_of(p) for p in ids[:50]]
    for bad in (0, MAX_MEMBERSHIP_SHARDS + 1):
        with pytest.raises(ValueError, match="shards"):
            ShardedKey(peers_key(SWARM), bad)


def test_a_sharded_swarm_keeps_a_record_only_under_its_owners_shard_once_the_shard_count_is_known(ids):
    """`<swarm>.peers` and `<swarm>.experts` split over the founder's shards: each shard's key holds the
    swarm's records under the same rules, and once the config says how many shards there are, a record
    stands only under the key of its owner's shard (not another shard's, nor the unsharded key)."""
    membership = SwarmMembership()
    validator, counts = _node(ids, membership)
    m = ids["member"]
    peer, experts = encode_peer_record(_peer_record(m.peer_id)), encode_expert_records({(0, 1): ExpertRecord(3, "ab" * 32, True)})
    for base, value in ((peers_key(SWARM), peer), (experts_key(SWARM), experts)):
        sharded = ShardedKey(base, 4)
        other = next(key for key in sharded.shard_keys() if key != sharded.key_of(m.peer_id))
        # before the config is read, any shard's key is checked as the key itself is, and kept
        membership.shards = None
        assert validator.validate(_record(m.signing_key, other, value))
        assert not validator.validate(_record(m.signing_key, other, b"not a record"))
        membership.shards = 4
        assert validator.validate(_record(m.signing_key, sharded.key_of(m.peer_id), value))
        assert not validator.validate(_record(m.signing_key, other, value))
        assert not validator.validate(_record(m.signing_key, base, value))
        membership.shards = 1  # an unsharded swarm: the key itself only
        assert validator.validate(_record(m.signing_key, base, value))
        assert not validator.validate(_record(m.signing_key, sharded.key_of(m.peer_id), value))
    assert dict(counts.counts) == {"malformed": 2, "wrong_shard": 6}
    # the same subkey rules hold under a shard's key: a record about another peer is refused
    membership.shards = 4
    key = ShardedKey(peers_key(SWARM), 4).key_of(ids["stranger"].peer_id)
    assert not validator.validate(_record(ids["stranger"].signing_key, key, peer))
    assert counts.counts["not_owner"] == 1


def test_a_key_swarm_refuses_records_without_the_members_own_proof(ids):
    admission = Admission.with_key(SWARM, KEY, key_check(KEY, SWARM))
    validator, counts = _node(ids, SwarmMembership(admission=admission))
    m, s = ids["member"], ids["stranger"]
    now = time.time()
    proof = admission.record_credential(m.peer_id, now)

    def stored(signer: Identity, record: PeerRecord) -> bool:
        return validator.validate(_record(signer.signing_key, peers_key(SWARM), encode_peer_record(record)))

    assert stored(m, _peer_record(m.peer_id, proof, now))
    assert not stored(s, _peer_record(s.peer_id))  # no proof
    assert not stored(s, _peer_record(s.peer_id, proof, now))  # m's proof, replayed for another peer id
    assert not stored(m, _peer_record(m.peer_id, proof, now + 1))  # the proof of another heartbeat
    wrong = Admission.with_key(SWARM, b"w" * 64, key_check(b"w" * 64, SWARM))
    assert not stored(s, _peer_record(s.peer_id, wrong.record_credential(s.peer_id, now), now))  # another key
    assert stored(s, _peer_record(s.peer_id, admission.record_credential(s.peer_id, now), now))  # once it has it
    assert validator.validate(_record(s.signing_key, peers_key(SWARM), encode_withdrawal(s.peer_id)))
    assert dict(counts.counts) == {"not_member": 4}


def test_an_allowlist_swarm_refuses_records_without_the_founders_certificate(ids):
    f, m, s = ids["founder"], ids["member"], ids["stranger"]
    config = sign_config(f.signing_key, SWARM, 1, VECTOR_DOC)
    admission = Admission.with_allowlist(SWARM, f.peer_id, config.founder_key, ids["node"].peer_id,
                                         issue_certificate(f.signing_key, SWARM, ids["node"].peer_id, 2**35))
    validator, counts = _node(ids, SwarmMembership(founder=f.peer_id, admission=admission))
    good = issue_certificate(f.signing_key, SWARM, m.peer_id, int(time.time()) + 3600).token

    def stored(signer: Identity, credential: str) -> bool:
        record = encode_peer_record(_peer_record(signer.peer_id, credential))
        return validator.validate(_record(signer.signing_key, peers_key(SWARM), record))

    assert stored(m, good)
    assert stored(f, "")  # the founder needs no certificate
    assert not stored(s, "")
    assert not stored(s, good)  # m's certificate, copied from m's record
    assert not stored(m, issue_certificate(f.signing_key, SWARM, m.peer_id, int(time.time()) - 1).token)  # expired
    assert not stored(m, issue_certificate(s.signing_key, SWARM, m.peer_id, 2**35).token)  # not the founder's
    assert not stored(m, issue_certificate(f.signing_key, "other", m.peer_id, 2**35).token)  # another swarm's
    assert not stored(m, "12.not-base64")
    assert dict(counts.counts) == {"not_member": 6}


# ---- <swarm>.experts ----------------------------------------------------------------------------


def test_expert_records_are_bounded(ids):
    validator, counts = _node(ids)
    m = ids["member"].signing_key
    records = encode_expert_records({(0, 1): ExpertRecord(3, "ab" * 32, True)})
    assert validator.validate(_record(m, experts_key(SWARM), records))
    assert not validator.validate(_record(m, experts_key(SWARM), b"\xc1 not msgpack"))
    assert not validator.validate(_record(m, experts_key(SWARM), msgspec.msgpack.encode({"0/1": [-1, "x", 1]})))
    assert not validator.validate(_record(m, experts_key(SWARM), records, expires_in=1e6))
    assert dict(counts.counts) == {"malformed": 2, "expiration": 1}


# ---- <swarm>.config -----------------------------------------------------------------------------


def test_only_the_founders_config_within_the_recipes_bounds_is_kept(ids):
    f, s = ids["founder"], ids["stranger"]
    validator, counts = _node(ids, SwarmMembership(founder=f.peer_id))
    founders = sign_config(f.signing_key, SWARM, 1, VECTOR_DOC)
    forged = sign_config(s.signing_key, SWARM, 99, VECTOR_DOC)
    # any member keeps the founder's config alive in its own subkey: the founder's signature is inside
    assert validator.validate(_record(s.signing_key, config_key(SWARM), founders.signed))
    assert validator.validate(_record(f.signing_key, config_key(SWARM), founders.signed, expires_in=MAX_CONFIG_TTL_S))
    assert not validator.validate(_record(s.signing_key, config_key(SWARM), forged.signed))
    assert not validator.validate(_record(f.signing_key, config_key(SWARM), founders.signed, expires_in=1e6))
    other_swarm = sign_config(f.signing_key, "elsewhere", 1, VECTOR_DOC)
    assert not validator.validate(_record(f.signing_key, config_key(SWARM), other_swarm.signed))
    tampered = msgspec.msgpack.decode(founders.signed)
    tampered["version"] = 2  # a replica bumping the version would win without the founder
    assert not validator.validate(_record(s.signing_key, config_key(SWARM), msgspec.msgpack.encode(tampered)))
    bad_recipe = {**VECTOR_DOC, "gossip": {**VECTOR_DOC["gossip"], "max_staleness_rounds": 10**9}}
    assert not validator.validate(_record(f.signing_key, config_key(SWARM),
                                          sign_config(f.signing_key, SWARM, 2, bad_recipe).signed))
    assert not validator.validate(_record(f.signing_key, config_key(SWARM), b"{\"unsigned\": true}"))
    assert dict(counts.counts) == {"config_not_founder": 1, "expiration": 1, "config_wrong_swarm": 1,
                                   "config_bad_signature": 1, "config_bad_recipe": 1, "config_malformed": 1}


def test_before_the_founder_is_known_any_founders_signed_config_is_kept(ids):
    """A joiner given --trust-first-founder knows no founder yet: it keeps signed configs and chooses later;
    a bootstrap knows no swarm at all and keeps any signed value within the bounds."""
    swarm_node, _ = _node(ids)
    bootstrap, _ = _node(ids, swarm=None)
    forged = sign_config(ids["stranger"].signing_key, SWARM, 1, VECTOR_DOC)
    for validator in (swarm_node, bootstrap):
        assert validator.validate(_record(ids["stranger"].signing_key, config_key(SWARM), forged.signed))


def test_a_key_swarms_config_names_its_key_without_revealing_it(ids):
    document = swarm_document(NodeConfig(training=TrainingConfig(model="vector"), dim=8), 1.0,
                              AdmissionDoc(mode=AdmissionMode.KEY, key_check=key_check(KEY, SWARM)))
    config = sign_config(ids["founder"].signing_key, SWARM, 1, document)
    assert KEY.decode() not in config.signed.decode(errors="replace")
    assert config.config["admission"] == {"mode": "key", "key_check": key_check(KEY, SWARM)}
    assert key_check(KEY, SWARM) != key_check(KEY, "other") != key_check(b"w" * 64, SWARM)


def test_founder_key_file_roundtrip(tmp_path: Path, ids):
    """The founder's identity file signs what `verify_config` checks, after a reload (what `murmur invite` does)."""
    from node.net.founder import verify_config
    from node.net.identity import load_identity

    reloaded = load_identity(ids["founder"].path)
    config = sign_config(reloaded.signing_key, SWARM, 3, VECTOR_DOC)
    assert verify_config(config.signed, SWARM, ids["founder"].peer_id).version == 3
