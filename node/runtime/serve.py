"""The node's start-up wiring and its entry points: `run_node` (`murmur node` / `murmur join`) and
`run_bootstrap` (`murmur bootstrap`). A node is p2pd, DHT discovery, the gossip peer and the local API
in one asyncio process, running its payload (a model, or vector mode) until SIGINT/SIGTERM stops it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from gossip.exchange import ExchangeSettings, GossipPeer
from node.cli.ready_line import format_ready_line
from node.config import NodeConfig
from node.monitor import MonitorServer, start_monitor
from node.runtime.data_plane import advertised_data_maddrs, start_data_plane
from node.runtime.errors import StartupError
from node.runtime.host import identity_and_daemon
from node.runtime.saving import checkpoint_path, final_checkpoint
from node.runtime.shutdown import close, install_stop_signals, shut_down
from node.runtime.status import NodeRuntime
from node.runtime.training import start_training, train_until
from node.runtime.vector import gossip_until, initial_state
from node.training.checkpoint import Checkpoint, CheckpointUnreadable, load_checkpoint
from node.training.recipe import RecipeInvalid, SwarmSettings, check_model_allowed, same_recipe, swarm_document

if TYPE_CHECKING:
    from node.net.discovery import Discovery
    from node.net.records import SwarmConfig

logger = logging.getLogger("murmur.node")

JOIN_CONFIG_TIMEOUT_S = 30.0
BOOTSTRAP_DHT_TIMEOUT_S = 30.0


async def serve_node(config: NodeConfig, founding: bool, stop: asyncio.Event, runtime: NodeRuntime) -> None:
    from node.net.discovery import BootstrapFailed, Discovery, DiscoverySettings

    def data_plane_died() -> None:
        runtime.count("data_plane_died")
        stop.set()

    async with contextlib.AsyncExitStack() as stack:
        claimed, p2p = await identity_and_daemon(config, stack)
        transport = await start_data_plane(config, claimed.identity, p2p, data_plane_died, stack)
        runtime.transport = transport
        stack.push_async_callback(close, transport, "transport")
        discovery = Discovery(p2p, claimed.identity, DiscoverySettings(config.swarm, heartbeat_s=config.heartbeat_s),
                              initial_peers=config.network.initial_peers,
                              data_maddrs=await advertised_data_maddrs(config, transport, claimed.identity.peer_id))
        try:
            await discovery.start()
        except BootstrapFailed as exc:
            raise StartupError(str(exc)) from None
        runtime.discovery = discovery
        stack.push_async_callback(close, discovery, "discovery")
        runtime.maddrs = discovery.dht_maddrs  # what `murmur join --peers` takes; the record has the data plane's

        ckpt_path = checkpoint_path(runtime)
        try:
            checkpoint = load_checkpoint(ckpt_path)
        except CheckpointUnreadable as exc:
            logger.warning("%s; starting fresh", exc)
            checkpoint = None
        swarm = await _swarm_config(discovery, config, founding, checkpoint)
        runtime.config_hash, runtime.swarm_doc = swarm.config_hash, swarm.config
        try:
            settings = SwarmSettings.from_doc(swarm.config)
            if settings.training is not None:
                check_model_allowed(settings.training.model, config.training.model)
        except RecipeInvalid as exc:
            raise StartupError(str(exc)) from None
        exchange = exchange_settings(config, swarm.config_hash, settings)
        training = None
        if settings.training is not None:
            training = await start_training(runtime, settings.training, settings, exchange, checkpoint, stack)
            peer = training.peer
        else:
            if config.training.average_every:
                logger.warning("--average-every is ignored: this swarm trains no model (vector mode)")
            tensors, round_index = initial_state(config, settings, swarm.config_hash, checkpoint)
            peer = runtime.peer = GossipPeer(transport, exchange, tensors)
            peer.round = round_index
        await peer.start()
        api = await _start_api(runtime, config)
        runtime.monitor_url = api.url
        stack.push_async_callback(close, api, "local API")
        stack.push_async_callback(final_checkpoint, runtime, ckpt_path)
        print(format_ready_line(transport.peer_id, config.swarm, api.url, runtime.maddrs), flush=True)
        if training is not None:
            await train_until(stop, runtime, training, settings, ckpt_path)
        else:
            await gossip_until(stop, runtime, settings, ckpt_path)


def exchange_settings(config: NodeConfig, config_hash: str, settings: SwarmSettings) -> ExchangeSettings:
    """The gossip settings: the swarm's codec and staleness bound, and this node's own timeout and mixing
    rule. How a node treats what its neighbours send is its own choice, not the swarm's: a joiner keeps
    its own --mixing (default adaptive_clip), whatever rule the founder's config names."""
    return ExchangeSettings(swarm=config.swarm, config_hash=config_hash, codec=settings.codec,
                            exchange_timeout_s=config.gossip.exchange_timeout_s, max_staleness=settings.max_staleness,
                            rule=config.gossip.mixing)


async def _swarm_config(discovery: Discovery, config: NodeConfig, founding: bool,
                        checkpoint: Checkpoint | None) -> SwarmConfig:
    """A founder publishes its swarm's document (a restarted one keeps its checkpoint's, and so its
    epoch, when the payload is unchanged); a joiner reads it from the DHT."""
    if founding:
        if checkpoint is not None and "swarm_config" in checkpoint.meta:
            doc = json.loads(str(checkpoint.meta["swarm_config"]))
            if same_recipe(doc, config):
                return await discovery.publish_config(doc)  # a restarted founder keeps its swarm's epoch
        return await discovery.publish_config(swarm_document(config, epoch=time.time()))
    deadline = time.monotonic() + JOIN_CONFIG_TIMEOUT_S
    while time.monotonic() < deadline:
        found = await discovery.fetch_config()
        if found is not None:
            return found
        await asyncio.sleep(0.5)
    raise StartupError(f"no config for swarm {config.swarm!r} found through {', '.join(config.network.initial_peers)} "
                       f"within {JOIN_CONFIG_TIMEOUT_S:g} s: is the swarm name right?")


async def _start_api(runtime: NodeRuntime, config: NodeConfig) -> MonitorServer:
    try:
        return await start_monitor(runtime, config.monitor.host, config.monitor.port)
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
        runtime = NodeRuntime(config, founding)
        await serve_node(config, founding, stop, runtime)
        return 0

    return _run(main)


def run_bootstrap(config: NodeConfig) -> int:
    """A DHT-only entry point: no swarm, no gossip; others pass its multiaddr to --peers."""
    _log_to_stderr(config)

    async def main() -> int:
        from hivemind.dht.node import DHTNode

        stop = asyncio.Event()
        install_stop_signals(stop)
        async with contextlib.AsyncExitStack() as stack:
            _, p2p = await identity_and_daemon(config, stack)
            async with asyncio.timeout(BOOTSTRAP_DHT_TIMEOUT_S):
                dht = await DHTNode.create(p2p=p2p, initial_peers=list(config.network.initial_peers) or None)
            stack.push_async_callback(shut_down, dht, "DHT")
            maddrs = [str(a) for a in await p2p.get_visible_maddrs()]
            print(f"murmur: bootstrap peer {p2p.peer_id} ready; maddrs {' '.join(maddrs)}", flush=True)
            await stop.wait()
        return 0

    return _run(main)
