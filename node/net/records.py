"""What murmur keeps in hivemind's DHT: the keys of a swarm, the declared schemas of its peer and config
records with their encoding, and the validator that lets only a peer speak for itself."""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer

from node.net.identity import peer_id_of_ssh_key

_SWARM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_OWNER_KEY = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX)

# Bounds on what a peer record may hold, so a hostile record costs little to reject.
MAX_RECORD_BYTES = 64 * 1024
MAX_MADDRS = 16
_MAX_MADDR_CHARS = 512
_MAX_EXPERTS = 8192
_MAX_VERSION_CHARS = 64
_MAX_PEER_ID_CHARS = 128

PeerId = Annotated[str, msgspec.Meta(min_length=1, max_length=_MAX_PEER_ID_CHARS)]
Count = Annotated[int, msgspec.Meta(ge=0)]
# msgspec has no finiteness constraint; NaN and the infinities fail both bounds.
Finite = Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=sys.float_info.max)]
Maddrs = Annotated[
    tuple[Annotated[str, msgspec.Meta(max_length=_MAX_MADDR_CHARS)], ...],
    msgspec.Meta(min_length=1, max_length=MAX_MADDRS),
]
Experts = Annotated[tuple[Count, ...], msgspec.Meta(max_length=_MAX_EXPERTS)]
Version = Annotated[str, msgspec.Meta(max_length=_MAX_VERSION_CHARS)]


class DiscoveryError(Exception):
    """Discovery could not do what was asked of the DHT."""


class SwarmConfigInvalid(DiscoveryError):
    """The swarm config found in the DHT is malformed or does not match its hash."""


def validate_swarm_name(swarm: str) -> str:
    if not _SWARM_NAME.fullmatch(swarm):
        raise ValueError(
            f"invalid swarm name {swarm!r}: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return swarm


def config_key(swarm: str) -> str:
    return f"{validate_swarm_name(swarm)}.config"


def peers_key(swarm: str) -> str:
    return f"{validate_swarm_name(swarm)}.peers"


def experts_key(swarm: str) -> str:
    """Reserved for SPES expert ownership."""
    return f"{validate_swarm_name(swarm)}.experts"


# Unknown fields are ignored so newer peers can add some; known ones must be well-formed.
class PeerRecord(msgspec.Struct, frozen=True):
    """What a live peer says about itself in `<swarm>.peers` (its fields, in order, are the msgpack map)."""

    peer_id: PeerId
    maddrs: Maddrs  # full multiaddrs others can dial, each ending in /p2p/<peer_id>
    step: Count
    round: Count
    experts: Experts  # ids of the experts this peer owns
    capacity: Count  # how many experts this peer can own
    version: Version  # murmur software version
    heartbeat: Finite  # DHT (unix) time when the record was published
    gossip_from: Count = 0  # first round this peer gossips in; 0 while it waits for a quorum (see node.training.rounds)
    loss: Finite | None = None  # the peer's latest training loss, for the monitors of its peers


class Withdrawal(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A tombstone a peer publishes on clean shutdown; it outranks the peer's last record."""

    peer_id: PeerId
    withdrawn: bool = True


class _EntryHead(msgspec.Struct, frozen=True):
    """What is read of any `<swarm>.peers` value first: whose it is, and whether it is a tombstone."""

    peer_id: PeerId
    withdrawn: Any = False  # only `true` makes a tombstone; any other value belongs to a record


class _ConfigRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The `<swarm>.config` value: the canonical JSON bytes of the config and their sha256."""

    config: bytes
    hash: str


@dataclass(frozen=True)
class SwarmConfig:
    """The swarm's training config as its founder published it, with the hash peers compare."""

    config: Mapping[str, Any]
    config_hash: str


_ENCODER = msgspec.msgpack.Encoder()
_HEAD_DECODER = msgspec.msgpack.Decoder(_EntryHead)
_RECORD_DECODER = msgspec.msgpack.Decoder(PeerRecord)
_CONFIG_DECODER = msgspec.msgpack.Decoder(_ConfigRecord)


def canonical_config_bytes(config: Mapping[str, Any]) -> bytes:
    """Key-sorted compact JSON: equal configs give equal bytes on every peer."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def config_hash(config: Mapping[str, Any]) -> str:
    return hashlib.sha256(canonical_config_bytes(config)).hexdigest()


def encode_peer_record(record: PeerRecord) -> bytes:
    return _ENCODER.encode(record)


def encode_withdrawal(peer_id: str) -> bytes:
    return _ENCODER.encode(Withdrawal(peer_id))


def decode_peer_entry(raw: bytes) -> PeerRecord | Withdrawal:
    """Parse and check a `<swarm>.peers` value; raises ValueError saying what is wrong."""
    if len(raw) > MAX_RECORD_BYTES:
        raise ValueError(f"peer record of {len(raw)} bytes exceeds {MAX_RECORD_BYTES}")
    try:
        head = _HEAD_DECODER.decode(raw)
        if head.withdrawn is True:
            return Withdrawal(head.peer_id)
        record = _RECORD_DECODER.decode(raw)
    except msgspec.DecodeError as exc:
        raise ValueError(f"peer record is malformed: {exc}") from None
    # The one rule a schema cannot declare: every address names the record's own peer.
    suffix = f"/p2p/{record.peer_id}"
    if not all(addr.endswith(suffix) for addr in record.maddrs):
        raise ValueError(f"peer record maddrs must be 1-{MAX_MADDRS} multiaddrs ending in {suffix}")
    return record


def encode_config(config: SwarmConfig) -> bytes:
    return _ENCODER.encode(_ConfigRecord(config=canonical_config_bytes(config.config), hash=config.config_hash))


def decode_config(value: object) -> SwarmConfig:
    """The swarm config a `<swarm>.config` value holds; SwarmConfigInvalid if it is malformed or altered."""
    try:
        if not isinstance(value, bytes):
            raise TypeError("not bytes")
        record = _CONFIG_DECODER.decode(value)
        config = json.loads(record.config)
    except (TypeError, ValueError):  # msgspec's and json's decode errors are ValueErrors
        raise SwarmConfigInvalid("the swarm config in the DHT is malformed") from None
    if not isinstance(config, dict):
        raise SwarmConfigInvalid("the swarm config in the DHT is malformed")
    actual_hash = hashlib.sha256(record.config).hexdigest()
    if actual_hash != record.hash or canonical_config_bytes(config) != record.config:
        raise SwarmConfigInvalid(f"the swarm config in the DHT does not match its hash {record.hash[:12]}")
    return SwarmConfig(config=config, config_hash=record.hash)


def owner_peer_id(subkey: bytes) -> str | None:
    """The peer id whose RSA key is embedded (as `[owner:...]`) in a DHT subkey, if exactly one is."""
    keys = set(_OWNER_KEY.findall(subkey))
    if len(keys) != 1:
        return None
    try:
        return peer_id_of_ssh_key(keys.pop())
    except ValueError:
        return None


class PeerRecordValidator(RecordValidatorBase):  # type: ignore[misc]  # hivemind is untyped
    """Only a peer can speak for itself in `<swarm>.peers`.

    hivemind's RSASignatureValidator (which runs first) checks that a subkey's value is signed by the
    key in the subkey; this one requires that key to be there and the record to be about the peer
    that key identifies, so a peer can neither overwrite another's record nor add one in its name.
    """

    def __init__(self, swarm: str) -> None:
        self._peers_key_id = DHTID.generate(source=peers_key(swarm)).to_bytes()

    def validate(self, record: DHTRecord) -> bool:
        if record.key != self._peers_key_id:
            return True
        owner = owner_peer_id(record.subkey)
        if owner is None:
            return False
        try:
            value = MSGPackSerializer.loads(record.value)
            return isinstance(value, bytes) and decode_peer_entry(value).peer_id == owner
        except Exception:
            return False

    @property
    def priority(self) -> int:
        # Below RSASignatureValidator's 10: validated after it, on the value with its signature stripped.
        return 5


def make_record_validator(signer: RSASignatureValidator, swarm: str) -> CompositeValidator:
    """What every murmur DHT node checks records with: signatures first, then peer-record ownership."""
    return CompositeValidator([signer, PeerRecordValidator(swarm)])
