"""Which network a peer's record says it is on, so that a joiner takes its step votes and parameter
downloads from distinct networks: one operator's many identities on one /24 (IPv4) or /48 (IPv6) count once
(docs/threat-model.md, "Sybils")."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from typing import TypeVar

from node.swarm.peers import PeerRecordLike

IPV4_PREFIX = 24
IPV6_PREFIX = 48

P = TypeVar("P", bound=PeerRecordLike)


def address_prefix(maddr: str) -> str | None:
    """The network of a multiaddr's first (host) part: `a.b.c.0/24`, `x:y:z::/48`, or `dns:<name>` (a name
    counts as its own network); None when it starts with neither. A relay circuit's first part is the
    relay's address, so a relayed peer counts as the relay's network: all peers behind one relay share it."""
    parts = maddr.split("/")
    if len(parts) < 3 or parts[0]:
        return None
    kind, host = parts[1], parts[2]
    try:
        if kind == "ip4":
            return str(ipaddress.ip_network(f"{host}/{IPV4_PREFIX}", strict=False))
        if kind == "ip6":
            return str(ipaddress.ip_network(f"{host}/{IPV6_PREFIX}", strict=False))
    except ValueError:
        return None
    if kind in ("dns", "dns4", "dns6", "dnsaddr"):
        return f"dns:{host.lower()}"
    return None


def record_prefixes(maddrs: Iterable[str]) -> frozenset[str]:
    """Every network a record's addresses name (a record naming none has the empty network "")."""
    found = frozenset(p for p in map(address_prefix, maddrs) if p is not None)
    return found or frozenset({""})


def _loopback(maddr: str) -> bool:
    parts = maddr.split("/")
    try:
        return len(parts) > 2 and parts[1] in ("ip4", "ip6") and ipaddress.ip_address(parts[2]).is_loopback
    except ValueError:
        return False


def one_per_prefix(records: Sequence[P]) -> tuple[list[P], list[P]]:
    """`records` (in order) split into those kept, at most one per network (two records that share any
    network count as one: the first keeps its place), and those left out. Off when every address of
    every record is on loopback (one machine: a test, a local demo), where nothing tells operators apart."""
    if all(_loopback(addr) for record in records for addr in record.maddrs):
        return list(records), []
    taken: set[str] = set()
    kept: list[P] = []
    dropped: list[P] = []
    for record in records:
        prefixes = record_prefixes(record.maddrs)
        if prefixes & taken:
            dropped.append(record)
        else:
            kept.append(record)
            taken |= prefixes
    return kept, dropped
