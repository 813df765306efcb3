"""The node's start-up wiring and its entry points: `run_node` (`murmur node` / `murmur join`) and
`run_bootstrap` (`murmur bootstrap`).

A node is p2pd, DHT discovery, the gossip peer and the local API in one asyncio process, running its
payload (a model, or vector mode) until SIGINT/SIGTERM stops it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import functools
import logging
import sys
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import numpy as np

from gossip.choco import ChocoState
from gossip.exchange import ExchangeSettings, GossipPeer
from gossip.limits import IncomingGate
from gossip.pace import TransferPace
from node.config import NodeConfig
from node.monitor import MonitorServer, start_monitor
from node.monitor.access import new_token, remove_token, write_token
from node.net.membership import ViewMembership
from node.net.supervise import counter_of, supervise
from node.runtime.data_plane import (
    advertised_data_maddrs,
    follow_child_circuits,
    set_address_book,
    start_data_plane,
    start_dialer,
)
from node.runtime.errors import BootstrapUnreachable, StartupError
from node.runtime.guide import (
    GuideLine,
    bootstrap_failed_line,
    format_line,
    in_order,
    link_line,
    measure_first_peers,
    memory_line,
    memory_unknown_line,
    memory_vector_line,
    model_line,
    reach_line,
    refusal_line,
    settled_reach,
)
from node.runtime.host import start_host
from node.runtime.preflight import CapacityChoice, DoesNotFit, Fit, check_fit
from node.runtime.ready_line import format_ready_line
from node.runtime.saving import CheckpointWriter, checkpoint_path, final_checkpoint
from node.runtime.shutdown import close, install_stop_signals, shut_down
from node.runtime.status import NodeRuntime
from node.runtime.swarm_config import found_swarm, join_swarm, node_admission, why_not_follow
from node.runtime.training import start_training, train_until
from node.runtime.vector import gossip_until, initial_state
from node.swarm.recipe import RecipeInvalid, SwarmSettings, check_model_allowed
from node.train.checkpoint import CheckpointUnreadable, load_checkpoint, switch_checkpoint

if TYPE_CHECKING:
    from hivemind.p2p import P2P

    from node.net.discovery import Discovery
    from node.net.founder import SwarmConfig
    from node.net.identity import Identity
    from node.net.relays import NodeReachability
    from node.net.validation import RefusalCounts

logger = logging.getLogger("murmur.node")

BOOTSTRAP_DHT_TIMEOUT_S = 30.0


class SessionEnd(enum.Enum):
    """Why `serve_node` returned: the node was told to stop, or it follows its founder's newer config
    (run_node then starts a new session under it)."""

    STOPPED = "stopped"
    NEW_CONFIG = "new_config"


async def serve_node(config: NodeConfig, founding: bool, stop: asyncio.Event, runtime: NodeRuntime) -> SessionEnd:
    from node.net.discovery import BootstrapFailed, Discovery, DiscoverySettings
    from node.net.records import ReachedVia

    def data_plane_died() -> None:
        runtime.count("data_plane_died")
        stop.set()

    async with contextlib.AsyncExitStack() as stack:
        try:
            host = await start_host(config, stack)
        except BootstrapUnreachable:
            if not founding:
                _print_guide([bootstrap_failed_line(config.network.initial_peers, "no connection")])
            raise
        claimed, p2p = host.claimed, host.p2p
        runtime.reach = host.reach
        identity = claimed.identity
        # incoming streams are admitted only from peers in view once discovery runs (see below); until
        # then the node serves no protocol
        gate = runtime.gate = IncomingGate()
        relays = host.reach.relay_maddrs if host.reach.private else ()
        transport = await start_data_plane(config, identity, p2p, data_plane_died, stack, gate, relays)
        runtime.transport = transport
        stack.push_async_callback(close, transport, "transport")
        discovery = Discovery(p2p, identity, DiscoverySettings(config.swarm, heartbeat_s=config.heartbeat_s),
                              initial_peers=config.network.initial_peers,
                              data_maddrs=await advertised_data_maddrs(config, transport, identity.peer_id))
        try:
            await discovery.start(publish=False)  # this peer's record waits for the swarm's config and rules
        except BootstrapFailed as exc:
            if not founding:
                _print_guide([bootstrap_failed_line(config.network.initial_peers, "the DHT did not answer")])
            raise StartupError(str(exc)) from None
        runtime.discovery = discovery
        discovery.update(reach=ReachedVia.from_reach(host.reach.detection.reach).value)  # the swarm page shows it
        # the guided join's link check runs while the swarm's config is read
        link = None if founding else asyncio.create_task(measure_first_peers(host.reach, config.network.initial_peers))
        if link is not None:
            stack.callback(link.cancel)
        stack.push_async_callback(close, discovery, "discovery")
        gate.membership = ViewMembership(discovery)
        runtime.dialer = await start_dialer(transport, discovery, stack, runtime.count)
        runtime.maddrs = discovery.dht_maddrs  # what `murmur join --peers` takes; the record has the data plane's
        if config.network.transport == "p2pd":  # the record's addresses follow the relays held (circuits)
            host.reach.publish_to(discovery.set_maddrs)
        else:  # the py-libp2p child holds its own relay slots; its circuits lead the record
            follow_child_circuits(transport, discovery)
        set_address_book(transport, discovery)

        ckpt_path = checkpoint_path(runtime)
        if founding:
            swarm = await found_swarm(discovery, config, identity, ckpt_path)
        else:
            swarm = await join_swarm(discovery, config)
        try:
            settings = SwarmSettings.from_doc(swarm.config)
            if settings.training is not None:
                check_model_allowed(settings.training.model, config.training.model)
        except RecipeInvalid as exc:
            raise StartupError(str(exc)) from None
        admission = node_admission(config, swarm, identity)
        runtime.swarm_config, runtime.config_hash, runtime.swarm_doc = swarm, swarm.config_hash, swarm.config
        moved = switch_checkpoint(ckpt_path, swarm.config_hash)
        if moved:
            logger.info("%s", moved)
        try:
            checkpoint = load_checkpoint(ckpt_path)
        except CheckpointUnreadable as exc:
            logger.warning("%s; starting fresh", exc)
            checkpoint = None
        # before entering the swarm's view: a node that cannot train the model must not be counted in a
        # quorum or paired in rounds, and the gap between a record in the view and the gossip protocol
        # served (neighbours' rounds to it fail at once meanwhile) stays start_training's
        await _preflight(runtime, swarm, settings, host.reach, link)
        await discovery.enter(swarm, admission, watch_config=not founding)
        exchange = dataclasses.replace(exchange_settings(config, swarm.config_hash, settings), admission=admission)
        training = None
        if settings.training is not None:
            training = await start_training(runtime, settings.training, settings, exchange, checkpoint, stack)
            peer = training.peer
        else:
            if config.training.average_every:
                logger.warning("--average-every is ignored: this swarm trains no model (vector mode)")
            tensors, round_index = initial_state(config, settings, swarm.config_hash, checkpoint)
            # vector mode's peers start from different vectors: compressed gossip's anchor is zero
            choco = (ChocoState(settings.choco, {name: np.zeros_like(x) for name, x in tensors.items()})
                     if settings.choco is not None else None)
            peer = runtime.peer = GossipPeer(transport, exchange, tensors, choco=choco)
            peer.round = round_index
        await peer.start()
        api = await _start_api(runtime, config)
        runtime.monitor_url = api.url
        stack.callback(remove_token, config.data_dir, api.token)
        stack.push_async_callback(close, api, "local API")
        checkpoints = CheckpointWriter(runtime, ckpt_path)
        if training is not None:
            stack.push_async_callback(checkpoints.final)
        else:
            stack.push_async_callback(final_checkpoint, runtime, ckpt_path)
        session = asyncio.Event()  # set when this session ends: the node stops, or follows a newer config
        followed: list[SwarmConfig] = []
        follow = functools.partial(_follow_newer_config, discovery, config, identity, runtime, followed, session)
        for watcher in (_when_set(stop, session), supervise("config follow", follow, runtime.count)):
            task = asyncio.create_task(watcher)
            stack.callback(task.cancel)
        invite = f"{config.swarm}@{swarm.founder}"
        print(format_ready_line(transport.peer_id, config.swarm, api.url, runtime.maddrs, invite), flush=True)
        if runtime.maddrs:
            logger.info("invite others: murmur join --invite %s --peers %s", invite, runtime.maddrs[0])
        if training is not None:
            await train_until(session, runtime, training, settings, checkpoints)
        else:
            await gossip_until(session, runtime, settings, ckpt_path)
        if followed and not stop.is_set():
            runtime.next_initial_peers = await _connected_peers(p2p)
            return SessionEnd.NEW_CONFIG
    return SessionEnd.STOPPED


def _print_guide(lines: list[GuideLine]) -> None:
    for line in in_order(lines):
        print(format_line(line), flush=True)


async def _preflight(runtime: NodeRuntime, swarm: SwarmConfig, settings: SwarmSettings, reach: NodeReachability,
                     link: asyncio.Task[dict[str, dict[str, Any]]] | None) -> None:
    """Check that the swarm's model fits here (DoesNotFit otherwise) and settle this node's choices; a
    joiner (`link` is its measurement of the bootstrap peers) also prints the guided join's lines, in
    order, and serves them in the status (node.runtime.guide)."""
    config, recipe = runtime.config, settings.training
    fit: Fit | None = None
    refused: DoesNotFit | None = None
    if recipe is not None:
        try:
            fit = await asyncio.to_thread(check_fit, recipe, settings, config.training.device, config.training.experts,
                                          config.gossip.scoring.enabled)
        except DoesNotFit as exc:
            if link is None:
                raise
            refused = exc
    if fit is not None:
        runtime.memory = fit.as_json()
        if fit.capacity is not None and fit.capacity.choice is CapacityChoice.LARGEST_FITTING:
            runtime.config = dataclasses.replace(config, training=dataclasses.replace(
                config.training, experts=fit.capacity.experts))
    if link is None:  # a founder: the guide is a joiner's
        return
    if recipe is None:
        memory = memory_vector_line(settings.dim)
    elif refused is not None:
        memory = refusal_line(str(refused))
    else:
        memory = memory_line(fit) if fit is not None else memory_unknown_line(recipe.model)
    parameters = fit.footprint.parameters if fit else (refused.parameters if refused else None)
    lines = [model_line(config.swarm, swarm.founder, settings, parameters), memory,
             link_line(await link), reach_line(await settled_reach(reach))]
    runtime.preflight = in_order(lines)
    _print_guide(lines)
    if refused is not None:
        raise refused


def exchange_settings(config: NodeConfig, config_hash: str, settings: SwarmSettings) -> ExchangeSettings:
    """The gossip settings: the swarm's codec and staleness bound, and this node's own timeout and mixing
    rule. How a node treats what its neighbours send is its own choice, not the swarm's: a joiner keeps
    its own --mixing (default adaptive_clip), whatever rule the founder's config names."""
    return ExchangeSettings(swarm=config.swarm, config_hash=config_hash, codec=settings.codec,
                            exchange_timeout_s=config.gossip.exchange_timeout_s, max_staleness=settings.max_staleness,
                            rule=config.gossip.mixing,
                            pace=TransferPace(stall_timeout_s=config.gossip.stall_timeout,
                                              goodput_floor_mbit_s=config.gossip.goodput_floor))


async def _connected_peers(p2p: P2P) -> tuple[str, ...]:
    """Full multiaddrs of the DHT peers this node is connected to: where a new session joins the DHT
    (the peers it started with may be gone, as a restarted founder's old address is)."""
    try:
        async with asyncio.timeout(5.0):
            peers = await p2p.list_peers()
    except Exception as exc:  # the daemon is in trouble: the new session starts from the configured peers
        logger.warning("could not list the connected DHT peers: %s", exc)
        return ()
    return tuple(f"{addr}/p2p/{info.peer_id.to_base58()}" for info in peers for addr in info.addrs
                 if "/p2p" not in str(addr))


async def _when_set(event: asyncio.Event, then: asyncio.Event) -> None:
    await event.wait()
    then.set()


async def _follow_newer_config(discovery: Discovery, config: NodeConfig, identity: Identity, runtime: NodeRuntime,
                               followed: list[SwarmConfig], session: asyncio.Event) -> None:
    """End the session when the founder publishes a newer config this node can run; else say, once per
    version, why it keeps running the one it has (a log line, `config_not_followed`, status)."""
    while True:
        newer = await discovery.newer_config()
        reason = why_not_follow(newer, config, identity)
        if reason is None:
            logger.warning("the founder published version %d of the swarm's config (hash %s): following it "
                           "(this node restarts its part in the swarm)", newer.version, newer.config_hash[:12])
            followed.append(newer)
            session.set()
            return
        runtime.count("config_not_followed")
        runtime.config_not_followed = f"version {newer.version}: {reason}"
        logger.error("not following version %d of the swarm's config (hash %s): %s; this node keeps running "
                     "version %d", newer.version, newer.config_hash[:12], reason,
                     runtime.swarm_config.version if runtime.swarm_config else 0)


async def _start_api(runtime: NodeRuntime, config: NodeConfig) -> MonitorServer:
    """The monitor, with this run's POST token written to <data-dir>/monitor.token (0600) first."""
    token = new_token()
    try:
        write_token(config.data_dir, token)
    except OSError as exc:
        raise StartupError(f"cannot write the monitor token to {config.data_dir}: {exc.strerror or exc}") from None
    try:
        return await start_monitor(runtime, config.monitor.host, config.monitor.port, token=token)
    except OSError as exc:
        raise StartupError(f"monitor port {config.monitor.host}:{config.monitor.port} unavailable: {exc.strerror}") from None


def _run(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    runner: Callable[[Coroutine[Any, Any, int]], int]
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency; this keeps odd platforms working
        runner = asyncio.run
    try:
        return runner(main())
    except StartupError as exc:
        print(f"murmur: error: {exc}", file=sys.stderr)
        return 2


def _log_to_stderr(config: NodeConfig) -> None:
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run_node(config: NodeConfig, founding: bool) -> int:
    _log_to_stderr(config)

    async def main() -> int:
        stop = asyncio.Event()
        install_stop_signals(stop)
        session_config = config
        while True:
            runtime = NodeRuntime(session_config, founding)
            if await serve_node(session_config, founding, stop, runtime) is not SessionEnd.NEW_CONFIG:
                return 0
            logger.info("starting again under the swarm's new config")
            peers = tuple(dict.fromkeys((*runtime.next_initial_peers, *config.network.initial_peers)))
            session_config = dataclasses.replace(config, network=dataclasses.replace(config.network,
                                                                                     initial_peers=peers))

    return _run(main)


REFUSALS_REPORT_S = 5.0


async def _report_refusals(refused: RefusalCounts, stop: asyncio.Event) -> None:
    """Log the DHT values refused so far, when they changed, every few seconds and at the end (a
    bootstrap has no monitor: this is where its refusals are counted)."""
    reported: dict[str, int] = {}
    while True:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(REFUSALS_REPORT_S):
                await stop.wait()
        counts = dict(refused.counts)
        if counts != reported:
            logger.warning("murmur bootstrap: refused DHT values: %s",
                           ", ".join(f"{reason}={n}" for reason, n in sorted(counts.items())))
            reported = counts
        if stop.is_set():
            return


def run_bootstrap(config: NodeConfig) -> int:
    """A DHT-only entry point: no swarm, no gossip; others pass its multiaddr to --peers."""
    _log_to_stderr(config)

    async def main() -> int:
        from hivemind.dht.crypto import RSASignatureValidator
        from hivemind.dht.node import DHTNode

        from node.net.hivemind_adapter import guard_dht_node
        from node.net.validation import RefusalCounts, make_record_validator

        stop = asyncio.Event()
        install_stop_signals(stop)
        refused = RefusalCounts()
        async with contextlib.AsyncExitStack() as stack:
            host = await start_host(config, stack, bootstrap=True)
            claimed, p2p = host.claimed, host.p2p
            # the rules for every key (node.net.validation): a bootstrap knows no swarm, so no swarm's own rules
            validator = make_record_validator(RSASignatureValidator(claimed.identity.signing_key), refused=refused)
            async with asyncio.timeout(BOOTSTRAP_DHT_TIMEOUT_S):
                dht = await DHTNode.create(p2p=p2p, initial_peers=list(config.network.initial_peers) or None,
                                           record_validator=validator)
            stack.push_async_callback(shut_down, dht, "DHT")
            # a bootstrap is the first DHT node strangers reach: the same store guard and storage bound
            guard = await guard_dht_node(dht, refused)
            stack.callback(guard.close)
            maddrs = [str(a) for a in await p2p.get_visible_maddrs()]
            print(f"murmur: bootstrap peer {p2p.peer_id} ready; maddrs {' '.join(maddrs)}", flush=True)
            print(f"murmur: {host.reach.service_line()}", flush=True)
            reporter = asyncio.create_task(supervise("refusal report", functools.partial(_report_refusals, refused, stop),
                                                     counter_of(refused.counts)))
            await stop.wait()
            await reporter
        return 0

    return _run(main)
