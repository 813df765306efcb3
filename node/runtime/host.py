"""The node's host: claim its identity (one process per identity), start its p2pd (the daemon the DHT,
and by default the data plane, runs on) as reachable as this network allows, and keep it so.

`--reachability auto` starts p2pd as a public node and asks the bootstrap peers to dial back; if none
can, p2pd restarts behind-NAT style: reserving slots at the relays (`--relays`, else the `--peers`)
and dialled through them. `public` and `private` skip the question. See docs/architecture.md,
"Reachability".
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from node.config import NodeConfig
from node.net.reach_mode import ReachMode
from node.runtime.errors import BootstrapUnreachable, StartupError
from node.runtime.shutdown import shut_down

if TYPE_CHECKING:
    from hivemind.p2p import P2P

    from node.net.hivemind_adapter import RelayLimits
    from node.net.identity import ClaimedIdentity
    from node.net.reachability import Detection
    from node.net.relays import NodeReachability
    from node.net.transport.p2pd import P2PSettings

logger = logging.getLogger("murmur.node")

# p2pd starts until its relay service's limits are in force (node.net.probe). Workaround 3
# (node.net.hivemind_adapter) still loses its race often on an oversubscribed CPU (see
# docs/benchmarks.md, "Relay service limits at p2pd start-up"); each check takes a few seconds, and 16
# leave about one start in a thousand without them at the oversubscribed machine's rate measured there
RELAY_SERVICE_ATTEMPTS = 16
# A dial-back nobody answered (the bootstraps start too, or restart) is asked again this many times
DETECT_ATTEMPTS = 3
DETECT_PAUSE_S = 2.0
# what p2pd says when it reaches none of its bootstrap peers (it reports nothing more structured)
P2PD_NO_BOOTSTRAP = "failed to connect to bootstrap peers"


@dataclass(frozen=True)
class Host:
    claimed: ClaimedIdentity
    p2p: P2P
    reach: NodeReachability


def p2pd_identity_path(config: NodeConfig) -> Path:
    """The key p2pd runs under: the node's own, unless the py-libp2p child has it (then p2pd's own)."""
    if config.network.transport == "p2pd":
        return config.identity_path
    from node.net.transport.libp2p import dht_identity_path

    return dht_identity_path(config.identity_path)


def relay_limits(config: NodeConfig, bootstrap: bool) -> RelayLimits | None:
    """The limits of this node's relay service, or None if it serves none."""
    from node.net.hivemind_adapter import RelayLimits

    network = config.network
    if not network.serves_relay(bootstrap):
        return None
    return RelayLimits(data_bytes=network.relay_data_limit_mb << 20, duration_s=network.relay_time_limit_s)


async def start_host(config: NodeConfig, stack: contextlib.AsyncExitStack, *, bootstrap: bool = False,
                     identity_path: Path | None = None, claim: bool = True) -> Host:
    """Claim the identity (unless `claim` is false: `murmur doctor`'s throwaway host) and start p2pd
    with its reachability settled; everything is released when `stack` closes."""
    from node.net.identity import IdentityError, claim_identity
    from node.net.probe import relay_limits_in_force
    from node.net.reachability import Detection, Reach, detect, tcp_ports
    from node.net.relays import NodeReachability, relay_candidates
    from node.net.transport.p2pd import P2PDTransport, P2PSettings

    claimed = None
    if claim:
        config.data_dir.mkdir(parents=True, exist_ok=True)
        try:
            claimed = claim_identity(config.identity_path)
        except IdentityError as exc:
            raise StartupError(str(exc)) from None
        stack.callback(claimed.release)
    network, mode = config.network, ReachMode(config.network.reachability)
    service = relay_limits(config, bootstrap)
    relays = relay_candidates(network.relays, network.initial_peers)
    base = P2PSettings(
        identity_path=identity_path if not claim else p2pd_identity_path(config), host_maddrs=network.listen,
        announce_maddrs=network.announce, initial_peers=network.initial_peers, nat_port_map=network.nat_port_map,
        relay_service=service, hole_punching=service is not None,
        force_reachability="public" if mode is ReachMode.PUBLIC else None)
    behind_nat = dataclasses.replace(base, relays=relays, force_reachability="private", hole_punching=True)
    detection: Detection
    if mode is ReachMode.PRIVATE:
        p2p = await _start(behind_nat, stack)
        detection = Detection(Reach.PRIVATE, detail="--reachability private")
    else:
        p2p = await _start(base, stack)
        detection = Detection(Reach.PUBLIC, detail="--reachability public")
        if mode is ReachMode.AUTO:
            visible = tuple(str(a) for a in await p2p.get_visible_maddrs())
            asker = P2PDTransport(p2p)
            try:
                for attempt in range(DETECT_ATTEMPTS):
                    detection = await detect(asker, network.initial_peers, tcp_ports(network.announce or visible))
                    if detection.reach is not Reach.UNKNOWN or not network.initial_peers:
                        break
                    if attempt + 1 < DETECT_ATTEMPTS:
                        await asyncio.sleep(DETECT_PAUSE_S)
            finally:
                await asker.close()
            logger.info("reachability: %s (%s)", detection.reach.value, detection.detail)
            if detection.reach is Reach.PRIVATE and service is not None:
                logger.warning("peers cannot dial this node back (%s), yet it serves as a relay: relays must be "
                               "reachable directly (open or forward its port)", detection.detail)
            elif detection.reach is Reach.PRIVATE:
                logger.info("not reachable directly: restarting p2pd to be dialled through %s",
                            ", ".join(relays) or "relays (none known: give --relays)")
                await _stop(p2p, stack)
                p2p = await _start(behind_nat, stack)
    service_check = None
    if service is not None:
        async def restart(old: P2P) -> P2P:
            await _stop(old, stack)
            return await _start(base, stack)

        p2p, service_check = await relay_limits_in_force(p2p, restart, RELAY_SERVICE_ATTEMPTS)
    reach = NodeReachability(p2p, detection, relays=relays if detection.reach is Reach.PRIVATE else (),
                             relay_service=service, service_check=service_check, mode=mode.value)
    if detection.reach is Reach.PRIVATE and not relays:
        logger.warning("this node is behind NAT and knows no relay: peers cannot dial it; give --relays (a "
                       "`murmur bootstrap` or a public node with --relay-service), or forward a port and "
                       "pass --announce")
    await reach.start()
    stack.push_async_callback(reach.close)
    return Host(claimed, p2p, reach)  # type: ignore[arg-type]  # claimed is None only for doctor's host


async def _start(settings: P2PSettings, stack: contextlib.AsyncExitStack) -> P2P:
    from node.net.transport.p2pd import start_p2pd

    try:
        p2p = await start_p2pd(settings)
    except Exception as exc:  # p2pd reports a busy port or a bad address only as its own failure
        if settings.initial_peers and P2PD_NO_BOOTSTRAP in str(exc):
            raise BootstrapUnreachable(f"none of the --peers answered ({', '.join(settings.initial_peers)}): "
                                       "check each address, the firewall and that the node runs") from None
        raise StartupError(f"p2pd could not start on {', '.join(settings.host_maddrs)}: {exc}") from None
    stack.push_async_callback(shut_down, p2p, "p2pd")
    return p2p


async def _stop(p2p: P2P, stack: contextlib.AsyncExitStack) -> None:
    """Shut down a daemon started by `_start` now (its callback on `stack` then finds it gone)."""
    await shut_down(p2p, "p2pd")
