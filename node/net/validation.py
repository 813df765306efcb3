"""The DHT validators every murmur DHT node runs, `murmur bootstrap` included: what a value under any key
must be before it is stored or taken from another node (hivemind calls them on both).

- Every key (`DhtRules`, the only rules a bootstrap, which knows no swarm, can apply): the value sits
  in a subkey that names its owner's RSA key (of at least 2048 bits, as every libp2p peer id has, at
  most MAX_OWNER_KEY_BITS, with the public exponent 65537: checked before any signature, so no key makes
  a verify dearer than an ordinary peer's) and carries that owner's signature (hivemind's RSASignatureValidator checks it), so no plain value is
  kept anywhere; it is at most MAX_DHT_VALUE_BYTES; it expires at most MAX_CONFIG_TTL_S (plus clock
  skew) from now.
- A swarm's own keys (`SwarmRules`, on that swarm's nodes): `<swarm>.peers` holds a peer record or a
  withdrawal about the subkey's owner, expiring within MAX_RECORD_TTL_S and, in a key or allowlist
  swarm, proving the owner's membership; `<swarm>.experts` holds SPES records within their bounds and
  the same expiry; both may be split over shards (`<swarm>.peers.<i>`, node.net.records.ShardedKey), and
  once the swarm's shard count is known a record stands only under its owner's shard; `<swarm>.config` holds a config envelope signed by the swarm's founder (the pinned
  one, once known) whose document is inside the recipe schema's bounds.

hivemind refuses a whole dictionary from a node when one of its entries fails, so a node that stored
what the swarm refuses (a bootstrap knows none of a swarm's rules) loses only its own copy: the swarm's
nodes read the key from the others. Each refusal is counted by reason (`RecordRefusal`).
"""

from __future__ import annotations

import collections
import enum
import functools
import logging
import threading
from dataclasses import dataclass, field

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from node.net.admission import Admission
from node.net.founder import MAX_CONFIG_BYTES as _MAX_CONFIG_DOC_BYTES
from node.net.founder import ConfigRefused, NotAdmitted, verify_config
from node.net.records import (
    MAX_EXPERT_RECORDS_BYTES,
    MAX_RECORD_BYTES,
    MIN_OWNER_KEY_BITS,
    BadAddress,
    PeerRecord,
    config_key,
    decode_expert_records,
    decode_peer_entry,
    every_shard_key,
    experts_key,
    owner_key,
    owner_peer_id,
    peer_shard,
    peers_key,
)
from node.swarm.recipe import RecipeInvalid, parse_document

logger = logging.getLogger(__name__)

MAX_CLOCK_SKEW_S = 30.0  # how far ahead of ours another node's clock may run
MAX_HEARTBEAT_S = 30.0  # the longest `--heartbeat` a node takes
RECORD_TTL_HEARTBEATS = 3  # a record outlives its heartbeat by this many periods
MAX_RECORD_TTL_S = (RECORD_TTL_HEARTBEATS + 1) * MAX_HEARTBEAT_S  # peer and expert records, withdrawals
CONFIG_TTL_S = 300.0  # every holder of the config stores it again every quarter of this
MAX_CONFIG_TTL_S = 2 * CONFIG_TTL_S
MAX_LOGGED_PEERS = 1024  # refused records are logged once per peer, for this many peers
MAX_DHT_VALUE_BYTES = MAX_EXPERT_RECORDS_BYTES + 8192  # the largest murmur value, with signature and framing
_MAX_CONFIG_VALUE_BYTES = _MAX_CONFIG_DOC_BYTES + 16384
# An RSA verify costs about e's bit length times the modulus' size squared: a key of exponent 2^k + 1 or an
# 8192-bit modulus makes one verify tens of times dearer. murmur's identities (node.net.identity) and
# hivemind's are 2048-bit keys with e = 65537, as almost every libp2p peer's; 4096 leaves room for peers
# that chose a longer key and bounds a verify at about 4x a 2048-bit one.
MAX_OWNER_KEY_BITS = 4096
OWNER_KEY_EXPONENT = 65537


class RecordRefusal(enum.StrEnum):
    """Why a DHT value was refused (counted as `dht_refused_<reason>`)."""

    UNSIGNED = "unsigned"  # no single owner key in the subkey: a plain value
    WEAK_KEY = "weak_key"  # an owner key no libp2p peer could have (RSA under 2048 bits)
    ODD_KEY = "odd_key"  # RSA over MAX_OWNER_KEY_BITS or with another exponent than 65537: a dear verify
    TOO_LARGE = "too_large"
    EXPIRATION = "expiration"  # expires further ahead than the key's time to live allows
    MALFORMED = "malformed"  # not a record of the key's schema
    BAD_ADDRESS = "bad_address"  # a peer record with an address no dialer takes (node.net.records.check_maddr)
    NOT_OWNER = "not_owner"  # a record about another peer than the subkey's owner
    NOT_MEMBER = "not_member"  # a record that proves no membership in a key or allowlist swarm
    WRONG_SHARD = "wrong_shard"  # a peer's record under another shard's key than its own (node.net.records.ShardedKey)
    DUPLICATE = "duplicate"  # an entry repeated in one store request: dropped unvalidated (node.net.dht_guard)
    OVER_BUDGET = "over_budget"  # beyond MAX_VALIDATED_PER_STORE entries of one store request, unvalidated
    STORAGE_FULL = "storage_full"  # a new entry beyond the local storage's bound (node.net.dht_guard)
    # a store entry or a find request beyond its sender's rate (node.net.dht_guard.DhtRates): unvalidated, unanswered
    OVER_RATE = "over_rate"
    CONFIG = "config"  # a config that is not the founder's, or outside the recipe's bounds (see ConfigRefusal)


@functools.lru_cache(maxsize=4096)
def owner_key_shape(ssh_public_key: bytes) -> tuple[int, int]:
    """(modulus bits, public exponent) of an OpenSSH-encoded RSA key, read without any RSA operation
    (cached per key: a flood repeats its keys); ValueError for anything that is not an RSA public key."""
    try:
        key = serialization.load_ssh_public_key(ssh_public_key)
    except Exception as exc:  # cryptography raises ValueError, and UnsupportedAlgorithm for other key types
        raise ValueError(f"not an OpenSSH public key: {exc}") from None
    if not isinstance(key, rsa.RSAPublicKey):
        raise ValueError("not an RSA public key")
    numbers = key.public_numbers()
    return key.key_size, numbers.e


@dataclass
class RefusalCounts:
    """Refused DHT values by reason (RecordRefusal, and `config_<ConfigRefusal>` for configs)."""

    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    logged: set[str] = field(default_factory=set)  # peers whose refused records were logged (bounded)
    # validators also run on the DHT's verify thread (node.net.dht_guard): one count at a time
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def refuse(self, reason: str) -> bool:
        with self._lock:
            self.counts[str(reason)] += 1
        return False

    def refuse_logged(self, reason: str, peer: str | None, detail: str) -> bool:
        """`refuse`, with one log line per peer (the first MAX_LOGGED_PEERS peers; later ones are counted only)."""
        key = peer or "an unsigned owner"
        if key not in self.logged and len(self.logged) < MAX_LOGGED_PEERS:
            self.logged.add(key)
            logger.warning("refusing DHT records of %s (%s): %s; further ones are counted as dht_refused_%s",
                           key, reason, detail, reason)
        return self.refuse(reason)


class DhtRules(RecordValidatorBase):  # type: ignore[misc]  # hivemind is untyped
    """The rules for every key: signed by an owner with a real peer key, bounded in size and expiry."""

    def __init__(self, refused: RefusalCounts) -> None:
        self._refused = refused

    def validate(self, record: DHTRecord) -> bool:
        key = owner_key(record.subkey)
        if key is None or owner_key(record.key) is not None:
            return self._refused.refuse(RecordRefusal.UNSIGNED)
        try:
            bits, exponent = owner_key_shape(key)
        except ValueError:
            return self._refused.refuse(RecordRefusal.UNSIGNED)
        if bits < MIN_OWNER_KEY_BITS:
            return self._refused.refuse(RecordRefusal.WEAK_KEY)
        if bits > MAX_OWNER_KEY_BITS or exponent != OWNER_KEY_EXPONENT:
            return self._refused.refuse(RecordRefusal.ODD_KEY)
        if len(record.value) > MAX_DHT_VALUE_BYTES:
            return self._refused.refuse(RecordRefusal.TOO_LARGE)
        if record.expiration_time > get_dht_time() + MAX_CONFIG_TTL_S + MAX_CLOCK_SKEW_S:
            return self._refused.refuse(RecordRefusal.EXPIRATION)
        return True

    @property
    def priority(self) -> int:
        # Above RSASignatureValidator's 10: the cheap checks run before its signature check.
        return 20


@dataclass
class SwarmMembership:
    """What a swarm's node knows of its swarm, for its validators and its view: the founder it pinned
    and who is admitted. Set once the signed config is read; until then only the founder may be known."""

    founder: str | None = None
    admission: Admission | None = None
    shards: int | None = None  # how many keys `<swarm>.peers` and `<swarm>.experts` are split over


class SwarmRules(RecordValidatorBase):  # type: ignore[misc]  # hivemind is untyped
    """The rules for one swarm's keys; other keys are left to DhtRules."""

    def __init__(self, swarm: str, membership: SwarmMembership, refused: RefusalCounts) -> None:
        self._swarm = swarm
        self._membership = membership
        self._refused = refused
        # every key a shard of `<swarm>.peers` or `<swarm>.experts` can have, by DHT id: its shard (0 for the
        # unsharded key), whether it holds peer records, and the shard count it implies (1 or more)
        self._sharded: dict[bytes, tuple[int, bool, bool]] = {}
        for base, is_peers in ((peers_key(swarm), True), (experts_key(swarm), False)):
            for index, key in enumerate(every_shard_key(base)):
                self._sharded[DHTID.generate(source=key).to_bytes()] = (max(index - 1, 0), is_peers, index > 0)
        self._config = DHTID.generate(source=config_key(swarm)).to_bytes()

    def validate(self, record: DHTRecord) -> bool:
        sharded = self._sharded.get(record.key)
        if sharded is None and record.key != self._config:
            return True
        try:
            value = MSGPackSerializer.loads(record.value)
        except Exception:
            return self._refused.refuse(RecordRefusal.MALFORMED)
        if not isinstance(value, bytes):
            return self._refused.refuse(RecordRefusal.MALFORMED)
        if sharded is None:
            return self._valid_config(record, value)
        if record.expiration_time > get_dht_time() + MAX_RECORD_TTL_S + MAX_CLOCK_SKEW_S:
            return self._refused.refuse(RecordRefusal.EXPIRATION)
        shard, is_peers, split = sharded
        if not self._in_own_shard(record.subkey, shard, split):
            return self._refused.refuse(RecordRefusal.WRONG_SHARD)
        if is_peers:
            return self._valid_peer_entry(record, value)
        if len(value) > MAX_EXPERT_RECORDS_BYTES:
            return self._refused.refuse(RecordRefusal.TOO_LARGE)
        try:
            decode_expert_records(value)
        except ValueError:
            return self._refused.refuse(RecordRefusal.MALFORMED)
        return True

    def _in_own_shard(self, subkey: object, shard: int, split: bool) -> bool:
        """Whether a record sits under the key its owner's shard names, once the swarm's shard count is known
        (before, a record under any shard's key passes here; the reader looks only where it belongs)."""
        shards = self._membership.shards
        if shards is None:
            return True
        if not split:
            return shards == 1
        owner = owner_peer_id(subkey) if isinstance(subkey, bytes) else None
        return shards > 1 and owner is not None and peer_shard(owner, shards) == shard

    def _valid_peer_entry(self, record: DHTRecord, value: bytes) -> bool:
        if len(value) > MAX_RECORD_BYTES:
            return self._refused.refuse(RecordRefusal.TOO_LARGE)
        try:
            entry = decode_peer_entry(value)
        except BadAddress as exc:
            owner = owner_peer_id(record.subkey)
            if exc.peer_id != owner:  # about another peer: that is what is wrong with it first
                return self._refused.refuse(RecordRefusal.NOT_OWNER)
            return self._refused.refuse_logged(RecordRefusal.BAD_ADDRESS, owner, str(exc))
        except ValueError:
            return self._refused.refuse(RecordRefusal.MALFORMED)
        if entry.peer_id != owner_peer_id(record.subkey):
            return self._refused.refuse(RecordRefusal.NOT_OWNER)
        admission = self._membership.admission
        if isinstance(entry, PeerRecord) and admission is not None and not admission.is_open:
            try:
                admission.check_record(entry.peer_id, entry.heartbeat, entry.credential)
            except NotAdmitted:
                return self._refused.refuse(RecordRefusal.NOT_MEMBER)
        return True

    def _valid_config(self, record: DHTRecord, value: bytes) -> bool:
        if len(value) > _MAX_CONFIG_VALUE_BYTES:
            return self._refused.refuse(RecordRefusal.TOO_LARGE)
        if record.expiration_time > get_dht_time() + MAX_CONFIG_TTL_S + MAX_CLOCK_SKEW_S:
            return self._refused.refuse(RecordRefusal.EXPIRATION)
        try:
            config = verify_config(value, self._swarm, self._membership.founder)
        except ConfigRefused as exc:
            return self._refused.refuse(f"config_{exc.reason}")
        try:
            parse_document(config.config)
        except RecipeInvalid:
            return self._refused.refuse("config_bad_recipe")
        return True

    @property
    def priority(self) -> int:
        # Below RSASignatureValidator's 10: validated after it, on the value with its signature stripped.
        return 5


def make_record_validator(signer: RSASignatureValidator, swarm: str | None = None,
                          membership: SwarmMembership | None = None,
                          refused: RefusalCounts | None = None) -> CompositeValidator:
    """What a murmur DHT node checks records with: the rules for every key, signatures, then (with a
    swarm) that swarm's rules. `murmur bootstrap` passes no swarm."""
    counts = refused if refused is not None else RefusalCounts()
    validators: list[RecordValidatorBase] = [signer, DhtRules(counts)]
    if swarm is not None:
        validators.append(SwarmRules(swarm, membership if membership is not None else SwarmMembership(), counts))
    return CompositeValidator(validators)
