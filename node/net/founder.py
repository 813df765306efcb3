"""What a swarm's founder vouches for with its key: the invite that names a swarm, the swarm's signed config, and
the membership certificates of an allowlist swarm.

The invite is `NAME@FOUNDER_PEER_ID`; the config is a signed, versioned envelope (the `<swarm>.config` value).
Signatures are hivemind's RSA key type (RSA-PSS, SHA-256) with the founder's libp2p identity key, so a founder
is known by its peer id.

Every signature covers a purpose tag, so a config signature can never pass for a certificate or a
record: `murmur/config/1` (swarm, version, sha256 of the document) and `murmur/member/1` (swarm, peer
id, expiry).
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import base58
import msgspec
import multihash
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from node.net.identity import peer_id_of_ssh_key
from node.net.records import SwarmConfigInvalid, canonical_config_bytes, validate_swarm_name

INVITE_SEPARATOR = "@"
MAX_CONFIG_BYTES = 256 * 1024  # a document's canonical JSON (a custom topology's edges are the big part)
MAX_CONFIG_VERSION = 2**53  # JSON-safe
_MAX_KEY_BYTES = 4096  # an OpenSSH RSA public key of up to 16k bits
_MAX_SIGNATURE_BYTES = 4096
_CONFIG_PURPOSE = "murmur/config/1"
_MEMBER_PURPOSE = "murmur/member/1"
_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{20,128}")  # base58
CERTIFICATE_HEADER = "murmur-member/1"


class ConfigRefusal(enum.StrEnum):
    """Why a `<swarm>.config` value was not taken (counted as `config_refused_<reason>`)."""

    MALFORMED = "malformed"  # not a signed config envelope, or over its size bounds
    WRONG_SWARM = "wrong_swarm"  # signed for another swarm name
    BAD_SIGNATURE = "bad_signature"  # the founder key in it did not sign it
    NOT_FOUNDER = "not_founder"  # signed by a key other than the pinned founder's
    BAD_RECIPE = "bad_recipe"  # the document is outside the recipe schema's bounds


class ConfigRefused(SwarmConfigInvalid):
    """A `<swarm>.config` value that this node does not take; `reason` is a ConfigRefusal."""

    def __init__(self, reason: ConfigRefusal, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class MembershipRefusal(enum.StrEnum):
    """Why a membership certificate does not admit a peer."""

    MALFORMED = "malformed"
    EXPIRED = "expired"
    BAD_SIGNATURE = "bad_signature"  # not the founder's signature over this swarm and this peer


class NotAdmitted(Exception):
    """A membership proof that does not hold; `reason` says why (a MembershipRefusal or a key-proof reason)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = str(reason)


# ---- invites --------------------------------------------------------------------------------------


def check_peer_id(text: str) -> str:
    """`text` if it is a libp2p peer id (base58 multihash); ValueError saying what is wrong otherwise."""
    if not _PEER_ID.fullmatch(text):
        raise ValueError(f"{text!r} is not a peer id (base58, like 12D3KooW... or Qm...)")
    try:
        multihash.decode(base58.b58decode(text))
    except Exception:
        raise ValueError(f"{text!r} is not a peer id (not a base58 multihash)") from None
    return text


@dataclass(frozen=True)
class Invite:
    """A swarm's name and its founder's peer id: all a joiner needs to know whom to trust."""

    swarm: str
    founder: str

    def __str__(self) -> str:
        return f"{self.swarm}{INVITE_SEPARATOR}{self.founder}"


def parse_invite(text: str) -> Invite:
    """`NAME@FOUNDER_PEER_ID`; ValueError saying what is wrong."""
    swarm, sep, founder = text.strip().rpartition(INVITE_SEPARATOR)
    if not sep or not swarm or not founder:
        raise ValueError(f"{text!r} is not an invite: expected NAME@FOUNDER_PEER_ID (printed by the founder's "
                         "`murmur node` and `murmur status`)")
    return Invite(validate_swarm_name(swarm), check_peer_id(founder))


# ---- the signed config ---------------------------------------------------------------------------

SwarmName = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


class SignedConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The `<swarm>.config` value: the document's canonical JSON, its version and its founder's signature.

    The config hash (what gossip headers carry) is the sha256 of `config` alone, so a founder that
    publishes the same document again under a higher version keeps the swarm's hash."""

    swarm: SwarmName
    version: Annotated[int, msgspec.Meta(ge=1, le=MAX_CONFIG_VERSION)]
    config: Annotated[bytes, msgspec.Meta(max_length=MAX_CONFIG_BYTES)]
    founder_key: Annotated[bytes, msgspec.Meta(max_length=_MAX_KEY_BYTES)]  # OpenSSH RSA public key
    signature: Annotated[bytes, msgspec.Meta(max_length=_MAX_SIGNATURE_BYTES)]  # base64, hivemind's form


@dataclass(frozen=True)
class SwarmConfig:
    """The swarm's training config as its founder published it, with the hash peers compare.

    `version`, `founder`, `founder_key` and `signed` are those of the envelope it came in (0 and
    empty for a config that was never signed, as in unit tests)."""

    config: Mapping[str, Any]
    config_hash: str
    version: int = 0
    founder: str = ""
    founder_key: bytes = b""
    signed: bytes = b""  # the encoded SignedConfig, what every holder stores again


_ENCODER = msgspec.msgpack.Encoder()
_SIGNED_DECODER = msgspec.msgpack.Decoder(SignedConfig)


def _config_statement(swarm: str, version: int, config: bytes) -> bytes:
    return _ENCODER.encode((_CONFIG_PURPOSE, swarm, version, hashlib.sha256(config).hexdigest()))


def sign_config(key: RSAPrivateKey, swarm: str, version: int, document: Mapping[str, Any]) -> SwarmConfig:
    """The founder's signed envelope of `document` as version `version` of `swarm`'s config."""
    config = canonical_config_bytes(document)
    if len(config) > MAX_CONFIG_BYTES:
        raise ValueError(f"the swarm config is {len(config)} bytes, over {MAX_CONFIG_BYTES}")
    if not 1 <= version <= MAX_CONFIG_VERSION:
        raise ValueError(f"config version {version} outside 1..{MAX_CONFIG_VERSION}")
    founder_key = key.get_public_key().to_bytes()
    signed = SignedConfig(swarm=swarm, version=version, config=config, founder_key=founder_key,
                          signature=key.sign(_config_statement(swarm, version, config)))
    return SwarmConfig(config=json.loads(config), config_hash=hashlib.sha256(config).hexdigest(), version=version,
                       founder=peer_id_of_ssh_key(founder_key), founder_key=founder_key,
                       signed=_ENCODER.encode(signed))


def verify_config(value: object, swarm: str, founder: str | None) -> SwarmConfig:
    """The config a `<swarm>.config` value carries, if its founder signed it for `swarm` (and the founder
    is `founder`, when given); ConfigRefused saying why not. The document's recipe is not checked here
    (node.swarm.recipe does, see node.net.validation)."""
    if not isinstance(value, bytes) or len(value) > MAX_CONFIG_BYTES + 2 * _MAX_KEY_BYTES:
        raise ConfigRefused(ConfigRefusal.MALFORMED, "the swarm config in the DHT is not a signed config")
    try:
        signed = _SIGNED_DECODER.decode(value)
        signer = peer_id_of_ssh_key(signed.founder_key)
        public_key = RSAPublicKey.from_bytes(signed.founder_key)
    except (msgspec.DecodeError, ValueError, RecursionError):
        raise ConfigRefused(ConfigRefusal.MALFORMED, "the swarm config in the DHT is not a signed config") from None
    if signed.swarm != swarm:
        raise ConfigRefused(ConfigRefusal.WRONG_SWARM, f"a config signed for swarm {signed.swarm!r}, not {swarm!r}")
    if founder is not None and signer != founder:
        raise ConfigRefused(ConfigRefusal.NOT_FOUNDER, f"a config signed by {signer}, not by the founder {founder}")
    if not public_key.verify(_config_statement(signed.swarm, signed.version, signed.config), signed.signature):
        raise ConfigRefused(ConfigRefusal.BAD_SIGNATURE, f"a config whose signature is not {signer}'s")
    try:
        config = json.loads(signed.config)
    except ValueError:
        raise ConfigRefused(ConfigRefusal.MALFORMED, "the signed swarm config is not JSON") from None
    if not isinstance(config, dict) or canonical_config_bytes(config) != signed.config:
        raise ConfigRefused(ConfigRefusal.MALFORMED, "the signed swarm config is not canonical JSON")
    return SwarmConfig(config=config, config_hash=hashlib.sha256(signed.config).hexdigest(), version=signed.version,
                       founder=signer, founder_key=signed.founder_key, signed=value)


# ---- membership certificates (allowlist swarms) -------------------------------------------------


def _member_statement(swarm: str, peer_id: str, expires: int) -> bytes:
    return _ENCODER.encode((_MEMBER_PURPOSE, swarm, peer_id, expires))


@dataclass(frozen=True)
class MembershipCertificate:
    """The founder's statement that `peer_id` belongs to `swarm` until `expires` (unix seconds).

    A peer presents `token` (EXPIRES.SIGNATURE) in its DHT record and in every message it sends; the
    swarm and the peer id are not in it, they are the ones the token is checked against, so a token
    copied from a record admits no other peer. The certificate file (`text`) names them, for people."""

    swarm: str
    peer_id: str
    expires: int
    signature: str  # base64

    @property
    def token(self) -> str:
        return f"{self.expires}.{self.signature}"

    @property
    def text(self) -> str:
        return f"{CERTIFICATE_HEADER} {self.swarm} {self.peer_id} {self.token}\n"


def issue_certificate(key: RSAPrivateKey, swarm: str, peer_id: str, expires: int) -> MembershipCertificate:
    """What `murmur invite PEER_ID` writes: signed with the founder's key (`key`)."""
    validate_swarm_name(swarm)
    check_peer_id(peer_id)
    signature = key.sign(_member_statement(swarm, peer_id, expires)).decode()
    return MembershipCertificate(swarm, peer_id, expires, signature)


def parse_certificate(text: str) -> MembershipCertificate:
    """A certificate file's content; ValueError saying what is wrong."""
    parts = text.split()
    if len(parts) != 4 or parts[0] != CERTIFICATE_HEADER:
        raise ValueError(f"not a murmur membership certificate (expected '{CERTIFICATE_HEADER} SWARM PEER_ID TOKEN', "
                         "as `murmur invite` writes it)")
    expires, signature = _split_token(parts[3])
    return MembershipCertificate(validate_swarm_name(parts[1]), check_peer_id(parts[2]), expires, signature)


def _split_token(token: str) -> tuple[int, str]:
    expires, sep, signature = token.partition(".")
    if not sep or not expires.isdigit() or len(expires) > 12 or not signature or len(signature) > _MAX_SIGNATURE_BYTES:
        raise ValueError("a membership token is EXPIRES.SIGNATURE")
    return int(expires), signature


def verify_membership(token: object, swarm: str, peer_id: str, founder_key: bytes, now: float | None = None) -> None:
    """Raise NotAdmitted unless `token` is the founder's (`founder_key`) unexpired certificate of `peer_id`
    in `swarm`."""
    if not isinstance(token, str):
        raise NotAdmitted(MembershipRefusal.MALFORMED, f"{peer_id} presents no membership certificate")
    try:
        expires, signature = _split_token(token)
    except ValueError:
        raise NotAdmitted(MembershipRefusal.MALFORMED, f"{peer_id} presents a malformed certificate") from None
    if expires <= (time.time() if now is None else now):
        raise NotAdmitted(MembershipRefusal.EXPIRED, f"the certificate of {peer_id} expired at {expires}")
    if not _founder_signed(founder_key, swarm, peer_id, expires, signature):
        raise NotAdmitted(MembershipRefusal.BAD_SIGNATURE,
                          f"the certificate {peer_id} presents is not the founder's for it in swarm {swarm!r}")


def _founder_signed(founder_key: bytes, swarm: str, peer_id: str, expires: int, signature: str) -> bool:
    try:
        public_key = RSAPublicKey.from_bytes(founder_key)
    except ValueError:
        return False
    return bool(public_key.verify(_member_statement(swarm, peer_id, expires), signature.encode()))
