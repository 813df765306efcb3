"""Which of a peer record's addresses this node may dial: the one routability rule (docs/threat-model.md,
"Resource limits and the monitor").

A record is written by its peer, so its addresses are the peer's word: a hostile record can name a
blackhole (every dial waits out its timeout), this machine's own loopback services, or the private
network the node sits in. A node dials a target only if the target's scope is at least as wide as
the widest scope among the node's own addresses: a node on public addresses dials public targets
only; a node on a private network also dials private ones; a node on loopback (a test swarm on one
machine) dials any. Addresses that route nowhere (unspecified, multicast, reserved, documentation
ranges) are never dialled. A relayed address (`.../p2p/RELAY/p2p-circuit...`) is judged by its relay's
part, the part that is dialled; one that names its relay by id alone is left to the daemon, which
knows that relay already.
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Iterable, Sequence

# never routable, though Python's ipaddress calls them private
_DOCUMENTATION = tuple(ipaddress.ip_network(net) for net in
                       ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "2001:db8::/32"))
_LOCAL_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost"})


class Scope(enum.IntEnum):
    """How far an address reaches, narrowest first (the order the rule compares)."""

    NOWHERE = 0  # unspecified, multicast, reserved, documentation, or not an address we understand
    LOOPBACK = 1
    LINK_LOCAL = 2
    PRIVATE = 3  # RFC 1918, CGNAT, unique-local IPv6
    PUBLIC = 4  # globally routable addresses, DNS names, relays named by id


def address_scope(maddr: str) -> Scope:
    """The scope of a multiaddr's first (dialled) component."""
    parts = maddr.strip("/").split("/")
    if len(parts) < 2:
        return Scope.NOWHERE
    proto, value = parts[0], parts[1]
    if proto == "p2p":
        # /p2p/RELAY/p2p-circuit...: the daemon dials a relay it already knows; nothing else starts so
        return Scope.PUBLIC if "p2p-circuit" in parts else Scope.NOWHERE
    if proto in ("dns", "dns4", "dns6", "dnsaddr"):
        return Scope.LOOPBACK if value.lower() in _LOCAL_NAMES or value.lower().endswith(".localhost") else Scope.PUBLIC
    if proto not in ("ip4", "ip6"):
        return Scope.NOWHERE
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        return Scope.NOWHERE
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:  # before "reserved": ::1 lies in IPv6's reserved ::/8
        return Scope.LOOPBACK
    if ip.is_unspecified or ip.is_multicast or ip.is_reserved or any(ip in net for net in _DOCUMENTATION):
        return Scope.NOWHERE
    if ip.is_link_local:
        return Scope.LINK_LOCAL
    if ip.is_global:
        return Scope.PUBLIC
    return Scope.PRIVATE


def own_reach(own_maddrs: Iterable[str]) -> Scope:
    """The widest scope among this node's own addresses (LOOPBACK when it has none we understand)."""
    return max((address_scope(a) for a in own_maddrs), default=Scope.LOOPBACK) or Scope.LOOPBACK


def dialable_maddrs(targets: Sequence[str], own_maddrs: Iterable[str]) -> tuple[str, ...]:
    """The addresses of `targets` (a peer record's) this node may dial, in their order (module docstring)."""
    reach = own_reach(own_maddrs)
    return tuple(a for a in targets if (scope := address_scope(a)) is not Scope.NOWHERE and scope >= reach)
