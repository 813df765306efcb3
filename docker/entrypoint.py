"""The image's entrypoint: runs `murmur ARGS...`, after one optional step for container swarms:
with MURMUR_PEERS_FROM=URL, a `join` without peers takes them from the running node at URL, and,
when it was given no invite or founder either, that node's invite (NAME@FOUNDER_PEER_ID).

Compose cannot know a founder's peer id before it starts, so a joiner asks the founder's monitor
API (`URL/api/status`) for its multiaddrs and invite, waiting for it to come up. Setting
MURMUR_PEERS_FROM is trusting that URL to name the swarm's founder: use it on a network you control
(a compose network), not across the internet. Everything else is `murmur`'s.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit, urlunsplit

PEERS_FROM = "MURMUR_PEERS_FROM"
PEERS_FROM_TIMEOUT = "MURMUR_PEERS_FROM_TIMEOUT"
DEFAULT_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 5.0
RETRY_EVERY_S = 1.0
LOOPBACK_PREFIXES = ("/ip4/127.", "/ip6/::1/", "/dns4/localhost/", "/dns6/localhost/", "/dns/localhost/")


class PeersUnavailable(Exception):
    """The node at MURMUR_PEERS_FROM did not give its addresses in time."""


class BadTimeout(Exception):
    """MURMUR_PEERS_FROM_TIMEOUT is not a positive number."""


def needs_peers(argv: Sequence[str], env: Mapping[str, str]) -> bool:
    """Only a `join` that got no peer from its flags or MURMUR_PEERS asks the other node; a config
    file's initial_peers is not looked at, so MURMUR_PEERS_FROM wins over it."""
    if not env.get(PEERS_FROM, "").strip() or not argv or argv[0] != "join":
        return False
    if any(arg in ("-h", "--help") or arg == "--peers" or arg.startswith("--peers=") for arg in argv[1:]):
        return False
    return not env.get("MURMUR_PEERS", "").strip()


def needs_invite(argv: Sequence[str], env: Mapping[str, str]) -> bool:
    """A `join` that names no founder (flag, MURMUR_INVITE or MURMUR_FOUNDER) takes the node's invite too."""
    flags = ("--invite", "--founder")
    if any(arg in flags or arg.startswith(tuple(f"{f}=" for f in flags)) for arg in argv[1:]):
        return False
    return not (env.get("MURMUR_INVITE", "").strip() or env.get("MURMUR_FOUNDER", "").strip())


def invite_of(status: Mapping[str, object]) -> str | None:
    invite = status.get("invite")
    return invite if isinstance(invite, str) and "@" in invite else None


def by_address(url: str) -> str:
    """`url` with its host name resolved to an address: the monitor answers only Host headers naming
    loopback, its --monitor-host or (bound to a wildcard) an address literal, never another name
    (DNS rebinding: docs/monitor.md), so a container asks its neighbour by address. OSError if the
    name does not resolve (yet)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        ipaddress.ip_address(host)
        return url
    except ValueError:
        pass
    address = socket.getaddrinfo(host, parts.port or 80, type=socket.SOCK_STREAM)[0][4][0]
    literal = f"[{address}]" if ":" in address else address
    return urlunsplit(parts._replace(netloc=f"{literal}:{parts.port}" if parts.port else literal))


def _api_status(url: str) -> object:
    with urllib.request.urlopen(f"{by_address(url).rstrip('/')}/api/status", timeout=REQUEST_TIMEOUT_S) as response:
        return json.load(response)


def fetch_invite(url: str) -> str | None:
    """The invite the node at `url` reports (it is up: its addresses were just read); None if it gives none."""
    try:
        status = _api_status(url)
        return invite_of(status) if isinstance(status, dict) else None
    except (urllib.error.URLError, OSError, ValueError):
        return None


def dialable_maddrs(status: Mapping[str, object]) -> list[str]:
    """The node's full multiaddrs other containers can dial: its loopback ones lead to the dialler."""
    maddrs = status.get("maddrs")
    if not isinstance(maddrs, list):
        return []
    return [a for a in maddrs if isinstance(a, str) and "/p2p/" in a and not a.startswith(LOOPBACK_PREFIXES)]


def fetch_maddrs(url: str, timeout_s: float, retry_every_s: float = RETRY_EVERY_S) -> list[str]:
    """Poll `url`/api/status until it lists a dialable multiaddr; PeersUnavailable after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while True:
        try:
            status = _api_status(url)
            maddrs = dialable_maddrs(status) if isinstance(status, dict) else []
            if maddrs:
                return maddrs
            last = "it lists no multiaddr other containers can dial (give it --announce)"
        except (urllib.error.URLError, OSError, ValueError) as exc:
            last = str(getattr(exc, "reason", exc))
        if time.monotonic() + retry_every_s > deadline:
            raise PeersUnavailable(f"{PEERS_FROM}: no peer addresses from {url} within {timeout_s:g} s ({last})")
        time.sleep(retry_every_s)


def _timeout_s(env: Mapping[str, str]) -> float:
    text = env.get(PEERS_FROM_TIMEOUT, "").strip()
    try:
        value = float(text) if text else DEFAULT_TIMEOUT_S
    except ValueError:
        value = -1.0
    if not value > 0:
        raise BadTimeout(f"{PEERS_FROM_TIMEOUT}: {text!r} is not a number of seconds > 0")
    return value


def main(argv: Sequence[str]) -> int:
    env = dict(os.environ)
    if needs_peers(argv, env):
        url = env[PEERS_FROM].strip()
        try:
            maddrs = fetch_maddrs(url, _timeout_s(env))
        except BadTimeout as exc:
            print(f"murmur join: error: {exc}", file=sys.stderr)
            return 2
        except PeersUnavailable as exc:
            print(f"murmur join: error: {exc}", file=sys.stderr)
            return 1
        print(f"murmur: joining through {' '.join(maddrs)} (from {url})", file=sys.stderr, flush=True)
        env["MURMUR_PEERS"] = " ".join(maddrs)
        if needs_invite(argv, env):
            invite = fetch_invite(url)
            if invite is not None:
                print(f"murmur: joining swarm {invite} (the invite of {url})", file=sys.stderr, flush=True)
                env["MURMUR_INVITE"] = invite
    os.execvpe("murmur", ["murmur", *argv], env)
    return 127  # not reached: exec replaces this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
