"""The node's host: claim its identity (one process per identity) and start its p2pd, the daemon the
DHT (and by default the data plane) runs on."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

from node.config import NodeConfig
from node.runtime.errors import StartupError
from node.runtime.shutdown import shut_down

if TYPE_CHECKING:
    from hivemind.p2p import P2P

    from node.net.identity import ClaimedIdentity


def p2pd_identity_path(config: NodeConfig) -> Path:
    """The key p2pd runs under: the node's own, unless the py-libp2p child has it (then p2pd's own)."""
    if config.network.transport == "p2pd":
        return config.identity_path
    from node.net.transport.libp2p import dht_identity_path

    return dht_identity_path(config.identity_path)


async def identity_and_daemon(config: NodeConfig, stack: contextlib.AsyncExitStack) -> tuple[ClaimedIdentity, P2P]:
    """Claim the node's identity and start its p2pd; both are released when `stack` closes."""
    from node.net.identity import IdentityError, claim_identity
    from node.net.transport.p2pd import P2PSettings, start_p2pd

    config.data_dir.mkdir(parents=True, exist_ok=True)
    try:
        claimed = claim_identity(config.identity_path)
    except IdentityError as exc:
        raise StartupError(str(exc)) from None
    stack.callback(claimed.release)
    try:
        p2p = await start_p2pd(P2PSettings(
            identity_path=p2pd_identity_path(config), host_maddrs=config.network.listen,
            announce_maddrs=config.network.announce, initial_peers=config.network.initial_peers,
            nat_port_map=config.network.nat_port_map,
        ))
    except Exception as exc:  # p2pd reports a busy port or a bad address only as its own failure
        raise StartupError(f"p2pd could not start on {', '.join(config.network.listen)}: {exc}") from None
    stack.push_async_callback(shut_down, p2p, "p2pd")
    return claimed, p2p
