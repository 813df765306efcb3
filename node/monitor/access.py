"""Who the monitor answers: Host headers naming this machine, POSTs with the node's per-run token, and a
bounded number of event-stream clients.

A Host header must name this machine's loopback or the configured `--monitor-host`, so a DNS-rebinding
page, whose requests carry its own name, is refused.

The token is drawn at each start and written to `<data-dir>/monitor.token` (mode 0600), where
`murmur eval` reads it; the page itself makes no POST, so it never needs or sees it (docs/monitor.md).
"""

from __future__ import annotations

import contextlib
import enum
import hmac
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from node.config.settings import MONITOR_TOKEN_FILE

MAX_EVENT_CLIENTS = 16  # event streams served at once; the page holds one per open tab
_LOOPBACK_NAMES = frozenset({"localhost"})
_WILDCARDS = frozenset({"0.0.0.0", "::", ""})


class AccessRefusal(enum.StrEnum):
    """Why the monitor refused a request before handling it (murmur_monitor_refused_total)."""

    HOST = "host"  # 403: a Host header that names neither loopback nor --monitor-host
    TOKEN = "token"  # 401: a POST without this run's token
    EVENT_CLIENTS = "event_clients"  # 503: MAX_EVENT_CLIENTS event streams are open already
    ORIGIN = "origin"  # 403: an event stream asked for by a page of another origin


def host_name(host_header: str) -> str:
    """The name or address part of a Host header ("[::1]:7690" -> "::1"), lower case."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:host.index("]")] if "]" in host else host
    name, colon, port = host.rpartition(":")
    return name if colon and port.isdigit() and ":" not in name else host


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


@dataclass(frozen=True)
class HostAllowlist:
    """The Host names the monitor answers to: loopback names and addresses, and the configured
    `--monitor-host`; when that is a wildcard (0.0.0.0, ::), also any IP address literal (the machine is
    reached by one of its addresses, and a literal address cannot be rebound to another host)."""

    configured: str

    def allows(self, host_header: str | None) -> bool:
        if not host_header:
            return False
        name = host_name(host_header)
        ip = _ip(name)
        if name in _LOOPBACK_NAMES or (ip is not None and ip.is_loopback):
            return True
        configured = self.configured.strip().lower().strip("[]")
        if configured in _WILDCARDS:
            return ip is not None
        if ip is not None and _ip(configured) is not None:
            return ip == _ip(configured)
        return name == configured


def new_token() -> str:
    """256 random bits in hex: a url-safe token starts with "-" one time in 64, and `--token -k_q...` then
    reads as a flag to argparse (murmur export, eval, doctor)."""
    return secrets.token_hex(32)


def token_matches(authorization: str | None, token: str) -> bool:
    """Whether an `Authorization: Bearer <token>` header carries `token` (compared in constant time)."""
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


def token_path(data_dir: Path) -> Path:
    return data_dir / MONITOR_TOKEN_FILE


def write_token(data_dir: Path, token: str) -> Path:
    """Write this run's token to `<data_dir>/monitor.token`, readable by this user only: created 0600
    under a temporary name and renamed over the last run's, so no other user ever reads it."""
    path = token_path(data_dir)
    temp = path.with_name(f".{path.name}.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        temp.unlink()
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, f"{token}\n".encode())
        os.fchmod(fd, 0o600)  # whatever the umask
    finally:
        os.close(fd)
    os.replace(temp, path)
    return path


def remove_token(data_dir: Path, token: str) -> None:
    """Remove the token file at a clean stop, if it is still this run's."""
    path = token_path(data_dir)
    with contextlib.suppress(OSError):
        if path.read_text().strip() == token:
            path.unlink()
