"""The reachability modes a node runs in (--reachability), apart from node.net.reachability so the
config reads them without importing the network stack."""

from __future__ import annotations

from enum import StrEnum


class ReachMode(StrEnum):
    """The choices of --reachability (node.net.reachability)."""

    AUTO = "auto"  # ask peers to dial back at start
    PUBLIC = "public"  # reachable directly: a public address, or a forwarded port
    PRIVATE = "private"  # behind NAT: reachable only through relays
