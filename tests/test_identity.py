"""A node's identity file: created once, reused, locked against a second node, rejected clearly when corrupt."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.proto import crypto_pb2

from node.net.identity import (
    IdentityInUse,
    InvalidIdentity,
    claim_identity,
    create_identity,
    load_identity,
    lock_path_for,
    peer_id_of_ssh_key,
)


@pytest.mark.unit
def test_identity_is_created_once_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "state" / "identity.key"  # parent directory does not exist yet
    with claim_identity(path) as first:
        created_id = first.identity.peer_id
    assert path.exists()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with claim_identity(path) as second:
        assert second.identity.peer_id == created_id
    assert load_identity(path).peer_id == created_id
    assert created_id.startswith("Qm")  # sha2-256 multihash of an RSA key, base58


@pytest.mark.unit
def test_distinct_files_give_distinct_peer_ids(tmp_path: Path) -> None:
    with claim_identity(tmp_path / "a.key") as a, claim_identity(tmp_path / "b.key") as b:
        assert a.identity.peer_id != b.identity.peer_id


@pytest.mark.unit
def test_second_claim_is_refused_naming_file_and_pid(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    with claim_identity(path):
        with pytest.raises(IdentityInUse) as refused:
            claim_identity(path)
        message = str(refused.value)
        assert str(path) in message
        assert f"process {os.getpid()}" in message
        assert "\n" not in message
    # Released on exit: a new node may take it.
    with claim_identity(path) as again:
        assert again.held


@pytest.mark.unit
def test_lock_file_records_holder_and_survives_release(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    claimed = claim_identity(path)
    assert lock_path_for(path).read_text().strip() == str(os.getpid())
    claimed.release()
    assert not claimed.held
    assert lock_path_for(path).exists()  # never unlinked: see IdentityLock
    claimed.release()  # idempotent


@pytest.mark.unit
def test_forked_children_do_not_keep_the_identity_locked(tmp_path: Path) -> None:
    """A forked worker outliving the node must not keep its identity locked in the node's name."""
    path = tmp_path / "identity.key"
    claimed = claim_identity(path)
    ready_read, ready_write = os.pipe()
    child = os.fork()
    if child == 0:  # fork hooks have run by the time fork() returns here
        os.write(ready_write, b"1")
        time.sleep(30)
        os._exit(0)
    try:
        assert os.read(ready_read, 1) == b"1"
        claimed.release()
        with claim_identity(path):
            pass
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        os.close(ready_read)
        os.close(ready_write)


@pytest.mark.unit
def test_create_never_overwrites_an_identity(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    original = create_identity(path)
    with pytest.raises(FileExistsError):
        create_identity(path)
    assert load_identity(path).peer_id == original.peer_id
    assert [p.name for p in tmp_path.iterdir()] == ["identity.key"]  # no temp file left


def _ed25519_identity_bytes() -> bytes:
    key = ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    return crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=key).SerializeToString()


@pytest.mark.unit
@pytest.mark.parametrize(
    "content, reason",
    [
        (b"", "does not contain a valid RSA private key"),
        (b"\xff\xfe garbage \x00\x01", "not a libp2p private key file"),
        (crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=b"\x30\x82trunc").SerializeToString(),
         "does not contain a valid RSA private key"),
        (_ed25519_identity_bytes(), "holds a Ed25519 key"),
    ],
    ids=["empty", "garbage", "truncated-der", "ed25519"],
)
def test_unusable_identity_file_raises_one_clear_line(tmp_path: Path, content: bytes, reason: str) -> None:
    path = tmp_path / "identity.key"
    path.write_bytes(content)
    with pytest.raises(InvalidIdentity) as rejected:
        claim_identity(path)
    message = str(rejected.value)
    assert str(path) in message and reason in message
    assert "\n" not in message
    assert path.read_bytes() == content  # a bad identity is reported, never replaced
    with claim_identity(tmp_path / "other.key"):  # and the failed claim left no lock behind on it
        pass
    path.unlink()
    with claim_identity(path):
        pass


@pytest.mark.unit
def test_signing_key_is_the_identity_key(tmp_path: Path) -> None:
    """DHT records are signed with the identity key, so the key in a record's subkey names its peer."""
    identity = create_identity(tmp_path / "identity.key")
    owner_marker = RSASignatureValidator(identity.signing_key).local_public_key
    ssh_key = owner_marker.removeprefix(b"[owner:").removesuffix(b"]")
    assert peer_id_of_ssh_key(ssh_key) == identity.peer_id


@pytest.mark.multiprocess
def test_p2pd_runs_with_the_identity_peer_id(tmp_path: Path) -> None:
    from node.net.transport.p2pd import P2PSettings, start_p2pd

    async def scenario() -> str:
        with claim_identity(tmp_path / "identity.key") as claimed:
            p2p = await start_p2pd(P2PSettings(identity_path=claimed.identity.path))
            try:
                return p2p.peer_id.to_base58()
            finally:
                await p2p.shutdown()

    daemon_peer_id = asyncio.run(scenario())
    assert daemon_peer_id == load_identity(tmp_path / "identity.key").peer_id
