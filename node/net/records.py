"""What murmur keeps in hivemind's DHT: a swarm's keys, the schemas of its peer and SPES expert records, and
the config's canonical bytes and hash.

The records' encoding is declared here too. The signed config envelope is node.net.founder's; the
validators that hold every DHT value to these are node.net.validation."""

from __future__ import annotations

import functools
import hashlib
import json
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any

import msgpack
import msgspec
import multiaddr
from hivemind.dht.crypto import RSASignatureValidator

from gossip.spes import ExpertKey, ExpertRecord, records_from_wire
from node.net.identity import owner_key_bits, peer_id_of_ssh_key
from node.net.work import MAX_NONCE_CHARS
from node.swarm.contributors import MAX_TOKENS
from node.swarm.recipe import MAX_MEMBERSHIP_SHARDS

_SWARM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_OWNER_KEY = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX)

# Bounds on what a peer record may hold, so a hostile record costs little to reject.
MAX_RECORD_BYTES = 64 * 1024
MAX_MADDRS = 16
_MAX_MADDR_CHARS = 512
_MAX_EXPERTS = 8192
_MAX_VERSION_CHARS = 64
_MAX_PEER_ID_CHARS = 128
MAX_CREDENTIAL_CHARS = 1024  # a membership certificate token is ~360 characters, a key proof 64
MAX_EXPERT_RECORDS_BYTES = 1 << 20  # a peer's SPES records: ~80 bytes per expert copy; more is refused unread
MIN_OWNER_KEY_BITS = 2048  # what go-libp2p (and so every real peer id) requires of an RSA key

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
Credential = Annotated[str, msgspec.Meta(max_length=MAX_CREDENTIAL_CHARS)]
ConfigHash = Annotated[str, msgspec.Meta(max_length=64)]
# The work summary a peer publishes (the swarm page, the export's contributors): bounded here, and its
# tokens clipped to what its step allows where the recipe is known (node.net.discovery).
MAX_TOKEN_RATE = 1e9
MAX_UPTIME_S = 20 * 365 * 86400.0
Tokens = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]
TokenRate = Annotated[float, msgspec.Meta(ge=0, le=MAX_TOKEN_RATE)]
Uptime = Annotated[float, msgspec.Meta(ge=0, le=MAX_UPTIME_S)]
# a free word rather than the enum: a newer peer's new kind must not make older peers drop its record
ReachWord = Annotated[str, msgspec.Meta(max_length=16, pattern="^[a-z]*$")]
# an open swarm's proof of work for the record's peer id (node.net.work): the nonce in hex
WorkNonce = Annotated[str, msgspec.Meta(max_length=MAX_NONCE_CHARS, pattern="^[0-9a-f]*$")]


class ReachedVia(StrEnum):
    """How a peer says the swarm reaches it (its record's `reach`): what its reachability check found."""

    DIRECT = "direct"  # dialled back by a peer, or --reachability public
    RELAYED = "relayed"  # behind NAT: dialled through relays' circuits
    UNKNOWN = "unknown"  # nobody answered its dial-back request (or an older peer that does not say)

    @classmethod
    def from_reach(cls, reach: str) -> ReachedVia:
        """What a reachability check's verdict (node.net.reachability.Reach) tells peers."""
        return {"public": cls.DIRECT, "private": cls.RELAYED}.get(reach, cls.UNKNOWN)

    @classmethod
    def of(cls, word: str) -> ReachedVia:
        """A record's word as a kind; an unknown word is UNKNOWN."""
        try:
            return cls(word)
        except ValueError:
            return cls.UNKNOWN


# What a peer record's address may be made of: the protocols p2pd and py-libp2p dial. Anything else
# (unix sockets, onion, memory, unknown codes) is refused with the record.
_ADDRESS_START = frozenset({"ip4", "ip6", "dns", "dns4", "dns6", "dnsaddr"})
_DIALABLE_PROTOCOLS = _ADDRESS_START | frozenset({
    "tcp", "udp", "quic", "quic-v1", "ws", "wss", "tls", "sni", "noise", "webtransport", "certhash",
    "webrtc", "webrtc-direct", "p2p", "p2p-circuit",
})


class BadAddress(ValueError):
    """A peer record's address is no multiaddr a dialer can take (counted as `bad_address`); `peer_id`
    is whom the record is about (set by decode_peer_entry)."""

    peer_id: str = ""


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
    """SPES expert ownership (node.algorithms.spes.directory)."""
    return f"{validate_swarm_name(swarm)}.experts"


@dataclass(frozen=True)
class ShardedKey:
    """A per-peer swarm key (`<swarm>.peers`, `<swarm>.experts`) spread over `shards` DHT keys, so that no
    one key outgrows what a DHT node can answer (hivemind's 4 MiB response): a peer's subkey lives under
    `<base>.<i>`, i its shard, and a reader reads every shard. One shard is `<base>` itself, the key
    swarms founded before shards have."""

    base: str
    shards: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.shards <= MAX_MEMBERSHIP_SHARDS:
            raise ValueError(f"a key is split over 1 to {MAX_MEMBERSHIP_SHARDS} shards, not {self.shards}")

    def shard_of(self, peer_id: str) -> int:
        return peer_shard(peer_id, self.shards)

    def key(self, shard: int) -> str:
        return self.base if self.shards == 1 else f"{self.base}.{shard}"

    def key_of(self, peer_id: str) -> str:
        """The DHT key that holds `peer_id`'s subkey."""
        return self.key(self.shard_of(peer_id))

    def shard_keys(self) -> tuple[str, ...]:
        return tuple(self.key(shard) for shard in range(self.shards))


def peer_shard(peer_id: str, shards: int) -> int:
    """The shard of a peer: a hash of its id, so every node agrees and no one chooses another's."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:8], "big") % shards


def membership_shards(config: Mapping[str, Any]) -> int:
    """The shard count a swarm's config document names (1: none named, or a malformed value, which the
    config's validators have refused already)."""
    shards = config.get("membership_shards", 1)
    valid = isinstance(shards, int) and not isinstance(shards, bool) and 1 <= shards <= MAX_MEMBERSHIP_SHARDS
    return shards if valid else 1


def every_shard_key(base: str) -> tuple[str, ...]:
    """Every DHT key a sharded `base` can be stored under, whatever the swarm's shard count (validators)."""
    return (base, *(f"{base}.{shard}" for shard in range(MAX_MEMBERSHIP_SHARDS)))


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
    gossip_from: Count = 0  # first round this peer gossips in; 0 while it waits for a quorum (see node.swarm.rounds)
    loss: Finite | None = None  # the peer's latest training loss, for the monitors of its peers
    config_hash: ConfigHash = ""  # the swarm config this peer runs; peers of another config are not in a view
    credential: Credential = ""  # proof of membership in a key or allowlist swarm (node.net.admission)
    tokens: Tokens = 0  # training tokens this peer processed itself (not adopted by a download), over restarts
    tokens_per_s: TokenRate = 0.0  # its latest step's training throughput
    uptime_s: Uptime = 0.0  # how long its node process has run
    reach: ReachWord = ""  # a ReachedVia; "" from peers older than the field
    work: WorkNonce = ""  # open swarms whose config asks for it: this peer id's proof of work (node.net.work)


class Withdrawal(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A tombstone a peer publishes on clean shutdown; it outranks the peer's last record."""

    peer_id: PeerId
    withdrawn: bool = True


class _EntryHead(msgspec.Struct, frozen=True):
    """What is read of any `<swarm>.peers` value first: whose it is, and whether it is a tombstone."""

    peer_id: PeerId
    withdrawn: Any = False  # only `true` makes a tombstone; any other value belongs to a record


_ENCODER = msgspec.msgpack.Encoder()
_HEAD_DECODER = msgspec.msgpack.Decoder(_EntryHead)
_RECORD_DECODER = msgspec.msgpack.Decoder(PeerRecord)


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
    except (msgspec.DecodeError, RecursionError) as exc:  # msgspec recurses into an unknown field's nesting
        raise ValueError(f"peer record is malformed: {exc}") from None
    # The rules a schema cannot declare: every address names the record's own peer, and parses as
    # a multiaddr of dialable protocols (so no dialer ever meets one that does not).
    suffix = f"/p2p/{record.peer_id}"
    if not all(addr.endswith(suffix) for addr in record.maddrs):
        raise ValueError(f"peer record maddrs must be 1-{MAX_MADDRS} multiaddrs ending in {suffix}")
    try:
        for addr in record.maddrs:
            check_maddr(addr, record.peer_id)
    except BadAddress as exc:
        exc.peer_id = record.peer_id
        raise
    return record


def check_maddr(addr: str, peer_id: str) -> None:
    """Raise BadAddress unless `addr` (at most _MAX_MADDR_CHARS) is a multiaddr of dialable protocols
    that parses (protocols, port range, ip syntax) as a whole, in binary, and without its `/p2p/<peer_id>`
    suffix: the forms the dialers (node.net.transport) hand to p2pd and py-libp2p."""
    if len(addr) > _MAX_MADDR_CHARS:
        raise BadAddress(f"multiaddr of {len(addr)} characters exceeds {_MAX_MADDR_CHARS}")
    problem = _maddr_problem(addr, peer_id)
    if problem is not None:
        raise BadAddress(problem)


# Views are read every half heartbeat, and every read decodes the same records again: the verdicts on
# addresses are kept (bounded; ~40-70 us each to parse), so a read costs a lookup per address.
@functools.lru_cache(maxsize=4096)
def _maddr_problem(addr: str, peer_id: str) -> str | None:
    shown = addr[:80]
    suffix = f"/p2p/{peer_id}"
    transport_part = addr[: -len(suffix)] if addr.endswith(suffix) else addr
    try:
        parsed = multiaddr.Multiaddr(addr)
        names = [protocol.name for protocol in parsed.protocols()]
        multiaddr.Multiaddr(parsed.to_bytes())
        multiaddr.Multiaddr(transport_part).to_bytes()
    except Exception as exc:  # py-multiaddr raises ValueErrors of its own, and others on odd input
        return f"unparseable multiaddr {shown!r}: {type(exc).__name__}: {str(exc)[:120]}"
    if not names or names[0] not in _ADDRESS_START:
        return f"multiaddr {shown!r} does not start with an ip or dns address"
    unknown = sorted(set(names) - _DIALABLE_PROTOCOLS)
    if unknown:
        return f"multiaddr {shown!r} has protocols no dialer takes: {', '.join(unknown)}"
    return None


def owner_key(subkey: bytes) -> bytes | None:
    """The OpenSSH RSA key embedded (as `[owner:...]`) in a DHT subkey, if exactly one is."""
    keys = set(_OWNER_KEY.findall(subkey))
    return keys.pop() if len(keys) == 1 else None


def owner_peer_id(subkey: bytes) -> str | None:
    """The peer id whose RSA key (of at least MIN_OWNER_KEY_BITS) is embedded in a DHT subkey, if exactly one is."""
    key = owner_key(subkey)
    if key is None:
        return None
    try:
        return peer_id_of_ssh_key(key) if owner_key_bits(key) >= MIN_OWNER_KEY_BITS else None
    except ValueError:
        return None


def encode_expert_records(records: Mapping[ExpertKey, ExpertRecord]) -> bytes:
    from gossip.spes import records_to_wire

    packed: bytes = msgpack.packb(records_to_wire(records), use_bin_type=True)
    return packed


def decode_expert_records(raw: bytes) -> dict[ExpertKey, ExpertRecord]:
    """A peer's `<swarm>.experts` value; ValueError saying what is wrong."""
    if len(raw) > MAX_EXPERT_RECORDS_BYTES:
        raise ValueError(f"expert records of {len(raw)} bytes exceed {MAX_EXPERT_RECORDS_BYTES}")
    try:
        value = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types for malformed input
        raise ValueError(f"expert records are not msgpack: {exc}") from None
    return records_from_wire(value)
