"""Proof of work that makes an identity of an open swarm cost CPU time: a nonce such that
sha256(statement, swarm, peer id, nonce) starts with the founder's number of zero bits (docs/threat-model.md)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from node.swarm.recipe import MAX_IDENTITY_WORK_BITS

logger = logging.getLogger(__name__)

NONCE_BYTES = 8
MAX_NONCE_CHARS = 2 * NONCE_BYTES  # a record's `work` field: the nonce in hex
_STATEMENT = b"murmur/identity-work/1\0"
_CACHE_SUFFIX = ".work"
_MAX_CACHE_BYTES = 64 * 1024


class WorkError(Exception):
    """No nonce of the asked difficulty was found within the bound (practically never: 2^-256)."""


def _prefix(swarm: str, peer_id: str) -> hashlib._Hash:
    return hashlib.sha256(_STATEMENT + f"{swarm}\0{peer_id}\0".encode())


def _meets(digest: bytes, bits: int) -> bool:
    return int.from_bytes(digest, "big") >> (256 - bits) == 0


def identity_work_bits(config: Mapping[str, Any]) -> int:
    """The proof of work a swarm's config document asks of each identity (0: none, or a malformed value,
    which the config's validators have refused already)."""
    bits = config.get("identity_work", 0)
    return bits if isinstance(bits, int) and not isinstance(bits, bool) and 0 <= bits <= MAX_IDENTITY_WORK_BITS else 0


def check_work(swarm: str, peer_id: str, nonce: str, bits: int) -> bool:
    """Whether `nonce` (hex, at most MAX_NONCE_CHARS) proves `bits` of work for `peer_id` in `swarm`: one hash."""
    if bits <= 0:
        return True
    if not nonce or len(nonce) > MAX_NONCE_CHARS:
        return False
    try:
        raw = bytes.fromhex(nonce)
    except ValueError:
        return False
    digest = _prefix(swarm, peer_id)
    digest.update(raw)
    return _meets(digest.digest(), bits)


def mint_work(swarm: str, peer_id: str, bits: int) -> str:
    """A nonce (hex) proving `bits` of work: ~2^bits hashes, CPU-bound (callers run it in a thread).
    The search starts at a random point so two processes of one identity do not repeat each other."""
    if not 0 <= bits <= MAX_IDENTITY_WORK_BITS:
        raise ValueError(f"identity work must be 0-{MAX_IDENTITY_WORK_BITS} bits")
    if bits == 0:
        return ""
    prefix = _prefix(swarm, peer_id)
    start = secrets.randbits(8 * NONCE_BYTES - 1)
    for i in range(1 << min(bits + 8, 8 * NONCE_BYTES - 1)):  # the chance to fail the bound is e^-256
        raw = ((start + i) % (1 << 8 * NONCE_BYTES)).to_bytes(NONCE_BYTES, "big")
        digest = prefix.copy()
        digest.update(raw)
        if _meets(digest.digest(), bits):
            return raw.hex()
    raise WorkError(f"no nonce of {bits} bits found")


def cache_path_for(identity_path: Path) -> Path:
    return identity_path.with_name(identity_path.name + _CACHE_SUFFIX)


def cached_work(identity_path: Path, swarm: str, peer_id: str, bits: int) -> str:
    """This identity's nonce for `swarm`, minted once and kept next to the identity file (a restart does
    not pay again; a nonce of more bits serves a lower difficulty too). Blocking: run it in a thread."""
    path = cache_path_for(identity_path)
    try:
        cached = json.loads(path.read_bytes()[:_MAX_CACHE_BYTES]) if path.exists() else {}
    except (OSError, ValueError):
        cached = {}
    if not isinstance(cached, dict):
        cached = {}
    nonce = cached.get(swarm)
    if isinstance(nonce, str) and check_work(swarm, peer_id, nonce, bits):
        return nonce
    logger.info("minting this identity's proof of work for swarm %r (%d bits, ~%.1g hashes)", swarm, bits, 2.0**bits)
    nonce = mint_work(swarm, peer_id, bits)
    cached = {k: v for k, v in cached.items() if isinstance(k, str) and isinstance(v, str)}
    cached[swarm] = nonce
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as file:
            json.dump(cached, file)
        os.replace(tmp, path)
    except OSError as exc:  # the proof is good; only the next restart pays again
        logger.warning("could not keep the proof of work in %s: %s", path, exc)
        tmp.unlink(missing_ok=True)
    return nonce
