"""Who belongs to a swarm, as its founder chose in the signed config (docs/threat-model.md):

- `open`: anyone;
- `key`: holders of the swarm key, a secret the founder hands to members out of band. A member proves
  it with HMAC-SHA256 under the key: in its DHT record over (swarm, its peer id, the record's
  heartbeat) and in every message over (swarm, config hash, sender, round, kind). Neither the key nor
  anything that proves membership for another peer id is ever published: a proof names its peer, and
  a message's sender is the peer the transport authenticated (Noise);
- `allowlist`: peers holding the founder's membership certificate (`murmur invite PEER_ID`,
  node.net.founder), presented in the record and in every message; the founder itself needs none.

`Admission` is the node's side: it makes this node's proofs and checks its peers' (the DHT validators,
the membership view and, as gossip.admission.StreamAdmission, the gossip and SPES protocols).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

import msgspec

from gossip.errors import NotMember
from gossip.wire import Header, HeaderFields, MetaValue
from node.net.founder import MembershipCertificate, NotAdmitted, parse_certificate, verify_membership
from node.swarm.recipe import AdmissionDoc, AdmissionMode

logger = logging.getLogger(__name__)

MIN_SWARM_KEY_BYTES = 32
MAX_SWARM_KEY_BYTES = 4096
PROOF_META = "proof"  # key swarms: the message's HMAC (hex)
MEMBER_META = "member"  # allowlist swarms: the sender's certificate token
_KEY_CHECK = "murmur/key-check/1"
_RECORD_PROOF = "murmur/record/1"
_STREAM_PROOF = "murmur/stream/1"
_ENCODER = msgspec.msgpack.Encoder()


class KeyRefusal(enum.StrEnum):
    """Why a key proof does not admit a peer."""

    MISSING = "missing"
    WRONG = "wrong"  # not an HMAC under the swarm key of this peer's statement


class SwarmKeyError(Exception):
    """The swarm key file cannot be used (one line, says why)."""


# ---- the swarm key -------------------------------------------------------------------------------


def create_swarm_key(path: Path) -> bytes:
    """A new random swarm key (256 bits, hex) written to `path` with mode 0600; FileExistsError if it exists."""
    key = secrets.token_hex(32).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(key + b"\n")
    return key


def load_swarm_key(path: Path) -> bytes:
    """The key in `path` (its content without surrounding whitespace); SwarmKeyError saying what is wrong."""
    try:
        if path.stat().st_size > MAX_SWARM_KEY_BYTES:
            raise SwarmKeyError(f"swarm key file {path} is over {MAX_SWARM_KEY_BYTES} bytes: not a swarm key")
        key = path.read_bytes().strip()
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError as exc:
        raise SwarmKeyError(f"cannot read the swarm key file {path}: {exc.strerror}") from None
    if len(key) < MIN_SWARM_KEY_BYTES:
        raise SwarmKeyError(f"swarm key file {path} holds {len(key)} bytes; a swarm key has at least "
                            f"{MIN_SWARM_KEY_BYTES} (let the founder's `murmur node --admission key` create one)")
    if mode & 0o077:
        logger.warning("swarm key file %s is readable by other users (mode %o): anyone who reads it is a member",
                       path, mode)
    return key


def key_check(key: bytes, swarm: str) -> str:
    """What the signed config says of the swarm key, so a member given another key learns so at start.
    An HMAC of a fixed statement under a 256-bit random key: it reveals nothing usable of the key."""
    return hmac.new(key, _ENCODER.encode((_KEY_CHECK, swarm)), hashlib.sha256).hexdigest()


def admission_document(mode: AdmissionMode, swarm: str, key: bytes | None) -> AdmissionDoc | None:
    """The `admission` part of the founder's document (None for an open swarm: its hash stays as it was)."""
    if mode is AdmissionMode.OPEN:
        return None
    if mode is AdmissionMode.KEY:
        assert key is not None, "a key swarm's founder holds the key"
        return AdmissionDoc(mode=mode, key_check=key_check(key, swarm))
    return AdmissionDoc(mode=mode)


# ---- proofs --------------------------------------------------------------------------------------


def record_proof(key: bytes, swarm: str, peer_id: str, heartbeat: float) -> str:
    return hmac.new(key, _ENCODER.encode((_RECORD_PROOF, swarm, peer_id, heartbeat)), hashlib.sha256).hexdigest()


def stream_proof(key: bytes, fields: HeaderFields) -> str:
    statement = (_STREAM_PROOF, fields["swarm"], fields["config_hash"], fields["sender"], fields["round"], fields["kind"])
    return hmac.new(key, _ENCODER.encode(statement), hashlib.sha256).hexdigest()


def _check_key_proof(expected: str, given: object, peer_id: str) -> None:
    if not isinstance(given, str) or not given:
        raise NotAdmitted(KeyRefusal.MISSING, f"{peer_id} proves no swarm key")
    # bytes: compare_digest refuses str with characters outside ASCII, which a peer may send
    if not hmac.compare_digest(expected.encode(), given.encode()):
        raise NotAdmitted(KeyRefusal.WRONG, f"{peer_id} proves another key than the swarm's")


class Admission:
    """Membership in one swarm as its signed config says: this node's proofs, and the check of its peers'.

    Build it with `open()`, `with_key()` or `with_allowlist()`; it is immutable."""

    def __init__(self, mode: AdmissionMode, swarm: str, *, founder: str = "", founder_key: bytes = b"",
                 key: bytes | None = None, certificate: MembershipCertificate | None = None) -> None:
        self.mode = mode
        self.swarm = swarm
        self.founder = founder
        self._founder_key = founder_key
        self._key = key
        self._token = certificate.token if certificate is not None else None

    @classmethod
    def open(cls, swarm: str) -> Admission:
        return cls(AdmissionMode.OPEN, swarm)

    @classmethod
    def with_key(cls, swarm: str, key: bytes, expected_check: str | None) -> Admission:
        """A key swarm's admission; SwarmKeyError if `key` is not the one the signed config names."""
        if expected_check is None or not hmac.compare_digest(key_check(key, swarm).encode(), expected_check.encode()):
            raise SwarmKeyError(f"this swarm key is not the key of swarm {swarm!r} (the founder's config names another "
                                "one)")
        return cls(AdmissionMode.KEY, swarm, key=key)

    @classmethod
    def with_allowlist(cls, swarm: str, founder: str, founder_key: bytes, peer_id: str,
                       certificate: MembershipCertificate | None) -> Admission:
        """An allowlist swarm's admission for `peer_id`; NotAdmitted if its certificate does not admit it
        (the founder needs none)."""
        if peer_id != founder:
            if certificate is None:
                raise NotAdmitted("missing", f"swarm {swarm!r} admits only peers with a certificate from its founder")
            if certificate.swarm != swarm or certificate.peer_id != peer_id:
                raise NotAdmitted("malformed", f"the certificate is for peer {certificate.peer_id} in swarm "
                                  f"{certificate.swarm!r}, not for this node ({peer_id}) in {swarm!r}")
            verify_membership(certificate.token, swarm, peer_id, founder_key)
        return cls(AdmissionMode.ALLOWLIST, swarm, founder=founder, founder_key=founder_key, certificate=certificate)

    @property
    def is_open(self) -> bool:
        return self.mode is AdmissionMode.OPEN

    # ---- DHT records ------------------------------------------------------------------------------

    def record_credential(self, peer_id: str, heartbeat: float) -> str:
        """What this node's record carries to prove its membership ("" in an open swarm)."""
        if self.mode is AdmissionMode.KEY:
            assert self._key is not None
            return record_proof(self._key, self.swarm, peer_id, heartbeat)
        if self.mode is AdmissionMode.ALLOWLIST:
            return self._token or ""
        return ""

    def check_record(self, peer_id: str, heartbeat: float, credential: object) -> None:
        """Raise NotAdmitted unless a record of `peer_id` with this heartbeat and credential proves membership."""
        if self.mode is AdmissionMode.KEY:
            assert self._key is not None
            _check_key_proof(record_proof(self._key, self.swarm, peer_id, heartbeat), credential, peer_id)
        elif self.mode is AdmissionMode.ALLOWLIST and peer_id != self.founder:
            verify_membership(credential, self.swarm, peer_id, self._founder_key)

    # ---- streams (gossip.admission.StreamAdmission) -------------------------------------------

    def credentials(self, fields: HeaderFields) -> Mapping[str, MetaValue]:
        if self.mode is AdmissionMode.KEY:
            assert self._key is not None
            return {PROOF_META: stream_proof(self._key, fields)}
        if self.mode is AdmissionMode.ALLOWLIST and self._token is not None:
            return {MEMBER_META: self._token}
        return {}

    def admit(self, header: Header) -> None:
        try:
            if self.mode is AdmissionMode.KEY:
                assert self._key is not None
                fields: HeaderFields = {"swarm": header.swarm, "config_hash": header.config_hash,
                                        "sender": header.sender, "round": header.round, "step": header.step,
                                        "kind": header.kind}
                _check_key_proof(stream_proof(self._key, fields), header.meta.get(PROOF_META), header.sender)
            elif self.mode is AdmissionMode.ALLOWLIST and header.sender != self.founder:
                verify_membership(header.meta.get(MEMBER_META), self.swarm, header.sender, self._founder_key)
        except NotAdmitted as exc:
            raise NotMember(f"{exc} ({exc.reason})") from None


def read_certificate(path: Path) -> MembershipCertificate:
    """The certificate file `murmur invite` wrote; ValueError saying what is wrong."""
    try:
        text = path.read_text(errors="replace")[:8192]
    except OSError as exc:
        raise ValueError(f"cannot read the certificate {path}: {exc.strerror}") from None
    return parse_certificate(text)
