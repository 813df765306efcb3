"""A node's persistent identity: the libp2p RSA key file p2pd reads, its peer id, and a lock that keeps
two live nodes from sharing it.

The same RSA key signs the node's DHT records, so a record's signer key determines its peer id.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import os
import secrets
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import base58
import multihash
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

# go-libp2p refuses RSA keys shorter than 2048 bits.
_RSA_KEY_BITS = 2048


class IdentityError(Exception):
    """The node cannot use the identity it was given."""


class IdentityInUse(IdentityError):
    """Another live process holds the identity's lock."""


class InvalidIdentity(IdentityError):
    """The identity file cannot be read or is not a libp2p RSA private key."""


@dataclass(frozen=True)
class Identity:
    """A loaded identity: where it lives, the peer id it gives, and the key that signs DHT records."""

    path: Path
    peer_id: str
    signing_key: RSAPrivateKey = field(repr=False, compare=False)


def lock_path_for(identity_path: Path) -> Path:
    return identity_path.with_name(identity_path.name + ".lock")


class IdentityLock:
    """An exclusive flock on `<identity>.lock`, held until `release()` or until the process dies.

    The lock file keeps the holder's PID so a refused node can name it; forked children do not
    inherit the lock. The file itself is never removed: unlinking a lock file lets a third process
    lock a fresh inode while the first still runs.
    """

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    def acquire(cls, identity_path: Path) -> IdentityLock:
        path = lock_path_for(identity_path)
        # O_CLOEXEC: exec'd children (p2pd) must not keep the lock alive after the node is gone.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_holder_pid(fd)
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise IdentityError(f"cannot lock identity {identity_path}: {exc.strerror}") from None
            raise IdentityInUse(
                f"identity {identity_path} is in use by another node (process {holder}, lock {path})"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        lock = cls(fd, path)
        # A flock belongs to the open file, which fork() shares: a forked worker (DataLoader,
        # multiprocessing) that outlived the node would keep the identity locked in the dead
        # node's name. Forks drop their copy at once, so the lock lives exactly as long as this process.
        os.register_at_fork(after_in_child=functools.partial(_forget_in_child, weakref.ref(lock)))
        return lock

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _forget(self) -> None:
        """In a forked child: close the inherited descriptor without touching the parent's lock."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        os.ftruncate(fd, 0)
        os.close(fd)  # closing the only descriptor releases the flock


def _forget_in_child(lock_ref: weakref.ref[IdentityLock]) -> None:
    lock = lock_ref()
    if lock is not None:
        lock._forget()


def _read_holder_pid(fd: int) -> str:
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return text if text.isdigit() else "unknown"


class ClaimedIdentity:
    """An identity together with the lock that makes this process its only user."""

    def __init__(self, identity: Identity, lock: IdentityLock) -> None:
        self.identity = identity
        self._lock = lock

    @property
    def held(self) -> bool:
        return self._lock.held

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> ClaimedIdentity:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def claim_identity(path: Path | str) -> ClaimedIdentity:
    """Lock the identity at `path`, creating the key file (mode 0600) if it does not exist yet.

    Raises IdentityInUse if another process holds it, InvalidIdentity if the file is unusable.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock = IdentityLock.acquire(path)
    try:
        # Under the lock, so two nodes started at once cannot both create a key.
        identity = load_identity(path) if path.exists() else create_identity(path)
    except BaseException:
        lock.release()
        raise
    return ClaimedIdentity(identity, lock)


def create_identity(path: Path) -> Identity:
    """Write a new RSA identity to `path` atomically with mode 0600; fails if `path` exists."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=_RSA_KEY_BITS)
    der = key.private_bytes(
        encoding=serialization.Encoding.DER,
        format=serialization.PrivateFormat.TraditionalOpenSSL,
        encryption_algorithm=serialization.NoEncryption(),
    )
    data = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString()
    # Write-then-link: a crash leaves either no identity or a complete one, never a truncated key.
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        _publish_new_file(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return _identity_from_key(path, key)


def _publish_new_file(tmp: Path, path: Path) -> None:
    """Move `tmp` to `path` unless `path` exists (FileExistsError)."""
    try:
        os.link(tmp, path)  # unlike rename, refuses to replace an existing identity
    except FileExistsError:
        raise
    except OSError as exc:
        # Some mounts (vfat, some FUSE/SMB volumes) have no hard links. Callers hold the identity
        # lock, so checking first and renaming cannot race another murmur node.
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV):
            raise
        if path.exists():
            raise FileExistsError(errno.EEXIST, "identity already exists", str(path)) from None
        os.rename(tmp, path)


def load_identity(path: Path) -> Identity:
    """Read a libp2p protobuf-wrapped RSA private key (the format p2pd's `-id` flag takes)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InvalidIdentity(f"cannot read identity {path}: {exc.strerror}") from None
    try:
        wrapped = crypto_pb2.PrivateKey.FromString(data)
    except Exception:
        raise InvalidIdentity(f"identity {path} is not a libp2p private key file (corrupt?)") from None
    if wrapped.key_type != crypto_pb2.KeyType.RSA:
        raise InvalidIdentity(f"identity {path} holds a {_key_type_name(wrapped.key_type)} key; murmur needs RSA")
    try:
        key = serialization.load_der_private_key(wrapped.data, password=None)
    except Exception:
        raise InvalidIdentity(f"identity {path} does not contain a valid RSA private key (corrupt?)") from None
    if not isinstance(key, rsa.RSAPrivateKey) or key.key_size < _RSA_KEY_BITS:
        raise InvalidIdentity(f"identity {path} does not hold an RSA key of at least {_RSA_KEY_BITS} bits")
    return _identity_from_key(path, key)


def _key_type_name(key_type: int) -> str:
    try:
        name: str = crypto_pb2.KeyType.Name(key_type)
        return name
    except ValueError:
        return f"unknown (type {key_type})"


def _identity_from_key(path: Path, key: rsa.RSAPrivateKey) -> Identity:
    return Identity(path=path, peer_id=peer_id_of(key.public_key()), signing_key=_as_hivemind_key(key))


def _as_hivemind_key(key: rsa.RSAPrivateKey) -> RSAPrivateKey:
    # hivemind's RSAPrivateKey always generates a fresh key in __init__; its pickle hook
    # (__setstate__, DER bytes) is the supported way to wrap an existing one.
    wrapped = RSAPrivateKey.__new__(RSAPrivateKey)
    wrapped.__setstate__(
        {
            "_private_key": key.private_bytes(
                encoding=serialization.Encoding.DER,
                format=serialization.PrivateFormat.TraditionalOpenSSL,
                encryption_algorithm=serialization.NoEncryption(),
            )
        }
    )
    return wrapped


def peer_id_of(public_key: rsa.RSAPublicKey) -> str:
    """The libp2p peer id (base58) of an RSA public key: sha2-256 multihash of the protobuf-wrapped DER."""
    der = public_key.public_bytes(
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo
    )
    wrapped = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(wrapped).digest(), multihash.coerce_code("sha2-256"))
    return base58.b58encode(digest).decode()


@functools.lru_cache(maxsize=4096)
def peer_id_of_ssh_key(ssh_public_key: bytes) -> str:
    """Peer id of the OpenSSH-encoded RSA key hivemind puts in `[owner:...]` DHT subkeys.

    Raises ValueError for anything that is not an RSA public key.
    """
    key = serialization.load_ssh_public_key(ssh_public_key)
    if not isinstance(key, rsa.RSAPublicKey):
        raise ValueError("not an RSA public key")
    return peer_id_of(key)


@functools.lru_cache(maxsize=4096)
def owner_key_bits(ssh_public_key: bytes) -> int:
    """The size of the OpenSSH-encoded RSA key; ValueError for anything that is not an RSA public key."""
    key = serialization.load_ssh_public_key(ssh_public_key)
    if not isinstance(key, rsa.RSAPublicKey):
        raise ValueError("not an RSA public key")
    return key.key_size
