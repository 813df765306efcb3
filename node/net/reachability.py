"""Whether others can dial this node directly, and what each connection to a neighbour is.

`--reachability auto` asks a few of the swarm's peers to dial back (node.net.dialback); `public` and
`private` say it outright. A private node is dialled through relays (node.net.relays); see
docs/architecture.md, "Reachability".
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gossip.transport import PeerUnreachable, StreamClosed
from node.net.dialback import DIALBACK_PROTOCOL, MAX_PORTS, ask_dialback
from node.net.hivemind_adapter import is_circuit, peer_of
from node.net.reach_mode import ReachMode
from node.net.transport.p2pd import P2PDTransport

logger = logging.getLogger(__name__)

__all__ = ["CONNECTION_KINDS", "ConnectionKind", "Detection", "Reach", "ReachMode", "connection_kind", "detect",
           "tcp_ports"]

DETECT_TIMEOUT_S = 12.0
MAX_ASKED = 3  # peers asked to dial back


class Reach(enum.StrEnum):
    """What is known about this node's direct reachability."""

    PUBLIC = "public"  # a peer dialled it back, or the user says so
    PRIVATE = "private"  # every peer asked failed to dial back, or the user says so
    UNKNOWN = "unknown"  # nobody answered (a founder without --peers, or peers that do not dial back)


class ConnectionKind(enum.StrEnum):
    """How this node is connected to a neighbour (murmur_peer_connections{kind=...})."""

    DIRECT = "direct"
    RELAYED = "relayed"
    HOLEPUNCHED = "holepunched"  # direct, between two nodes behind NAT: a punched hole (DCUtR)
    NONE = "none"  # no connection right now


CONNECTION_KINDS = (ConnectionKind.DIRECT, ConnectionKind.RELAYED, ConnectionKind.HOLEPUNCHED)


@dataclass(frozen=True)
class Detection:
    reach: Reach
    observed: tuple[str, ...] = ()  # this node's address(es) as the peers that answered saw it
    confirmed_by: tuple[str, ...] = ()  # peers whose dial-back reached this node
    detail: str = ""


def tcp_ports(maddrs: Iterable[str]) -> tuple[int, ...]:
    """The TCP ports of this node's direct addresses, at most MAX_PORTS."""
    ports: list[int] = []
    for maddr in maddrs:
        parts = maddr.strip("/").split("/")
        if not is_circuit(maddr) and len(parts) >= 4 and parts[2] == "tcp" and parts[3].isdigit():
            port = int(parts[3])
            if port and port not in ports:
                ports.append(port)
    return tuple(ports[:MAX_PORTS])


async def detect(transport: P2PDTransport, peers: Sequence[str], ports: tuple[int, ...],
                 timeout_s: float = DETECT_TIMEOUT_S) -> Detection:
    """Ask up to MAX_ASKED of `peers` (full multiaddrs) to dial this node back at `ports`."""
    asked = [p for p in dict.fromkeys(peers) if peer_of(p) is not None and not is_circuit(p)][:MAX_ASKED]
    if not asked or not ports:
        return Detection(Reach.UNKNOWN, detail="no peer to ask" if not asked else "no TCP port to check")

    async def ask(maddr: str) -> tuple[str, str, tuple[int, ...]] | None:
        peer = peer_of(maddr)
        assert peer is not None
        try:
            async with asyncio.timeout(timeout_s):
                await transport.connect(peer, [maddr])
                stream = await transport.open_stream(peer, DIALBACK_PROTOCOL)
                try:
                    reply = await ask_dialback(stream, ports)
                finally:
                    stream.abort()
        except (PeerUnreachable, StreamClosed, TimeoutError, ConnectionError, ValueError) as exc:
            logger.debug("dial-back through %s: no answer: %s", peer, exc)
            return None
        if reply.refused:
            logger.debug("dial-back through %s refused: %s", peer, reply.refused)
            return None
        return peer, reply.observed, reply.reachable

    answers = [a for a in await asyncio.gather(*(ask(p) for p in asked)) if a is not None]
    observed = tuple(dict.fromkeys(obs for _, obs, _ in answers))
    confirmed = tuple(peer for peer, _, reachable in answers if reachable)
    if confirmed:
        return Detection(Reach.PUBLIC, observed, confirmed, f"dialled back by {len(confirmed)} of {len(answers)}")
    if answers:
        return Detection(Reach.PRIVATE, observed, (), f"{len(answers)} peer(s) could not dial back ports "
                         f"{', '.join(map(str, ports))}")
    return Detection(Reach.UNKNOWN, detail=f"none of {len(asked)} peer(s) answered a dial-back request")


def connection_kind(connection_addrs: Sequence[str], peer_maddrs: Sequence[str], self_private: bool) -> ConnectionKind:
    """What the connections to a peer (their remote addresses, from p2pd) make it.

    Direct beats relayed (libp2p opens new streams on a direct connection when it has one). A direct
    connection between two nodes behind NAT (the peer's record lists circuits) is a punched hole,
    unless it goes to one of the addresses the peer listens on (the two share a LAN).
    """
    direct = [a for a in connection_addrs if not is_circuit(a)]
    if not direct:
        return ConnectionKind.RELAYED if connection_addrs else ConnectionKind.NONE
    peer_private = any(is_circuit(m) for m in peer_maddrs)
    listening = {m.split("/p2p/")[0] for m in peer_maddrs if not is_circuit(m)}
    if self_private and peer_private and not any(a in listening for a in direct):
        return ConnectionKind.HOLEPUNCHED
    return ConnectionKind.DIRECT
