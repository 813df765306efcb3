"""The node daemon: p2pd, DHT discovery, the gossip peer and the local API in one asyncio process;
gossip rounds on the swarm's clock; a clean stop on SIGINT/SIGTERM.

Until a model is trained (see docs/training.md) the payload is one random vector of `dim` floats,
which makes the gossip itself observable: `murmur status` and the checkpoint show it converge.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

import numpy as np

from gossip.codecs import get_codec
from gossip.exchange import ExchangeSettings, GossipPeer
from gossip.mixing import MixingRule
from node.api import ApiServer, start_api
from node.checkpoint import CheckpointUnreadable, load_checkpoint, save_checkpoint
from node.config import NodeConfig
from node.rounds import PeerTiming, RoundClock, announce_round, participants, start_round
from topology import Topology, TopologySpec, build_topology, peer_round

logger = logging.getLogger("murmur.node")

SWARM_CONFIG_VERSION = 1
CHECKPOINT_EVERY_ROUNDS = 10
STOP_TIMEOUT_S = 4.0  # everything below must be gone within the 5 s a user waits after SIGTERM
JOIN_CONFIG_TIMEOUT_S = 30.0


class StartupError(Exception):
    """The node cannot start (identity in use, address in use, no swarm config...): one line, exit 2."""


def swarm_document(config: NodeConfig, epoch: float) -> dict[str, Any]:
    """What the founder publishes under `<swarm>.config`; joiners take these settings from it."""
    topo = config.gossip.topology
    return {
        "version": SWARM_CONFIG_VERSION,
        "epoch": epoch,
        "payload": {"kind": "vector", "dim": config.dim},
        "gossip": {
            "topology": {"name": topo.name, "weights": topo.weights, "degree": topo.degree, "seed": topo.seed,
                         "rows": topo.rows, "edges": [list(e) for e in topo.edges], "directed": topo.directed},
            "codec": config.gossip.codec,
            "round_interval_s": config.gossip.round_interval_s,
            "max_staleness_rounds": config.gossip.max_staleness_rounds,
            "mixing": asdict(config.gossip.mixing),
        },
    }


class SwarmSettings:
    """The shared settings read back from a swarm document (validated by construction)."""

    def __init__(self, doc: dict[str, Any]) -> None:
        if doc.get("version") != SWARM_CONFIG_VERSION:
            raise StartupError(f"the swarm's config has version {doc.get('version')!r}; this murmur reads {SWARM_CONFIG_VERSION}")
        try:
            g = doc["gossip"]
            t = g["topology"]
            self.topology = TopologySpec(t["name"], weights=t["weights"], degree=t["degree"], seed=t["seed"],
                                         rows=t["rows"], edges=tuple(tuple(e) for e in t["edges"]), directed=t["directed"])
            self.codec = get_codec(g["codec"])
            self.clock = RoundClock(float(doc["epoch"]), float(g["round_interval_s"]))
            self.max_staleness = int(g["max_staleness_rounds"])
            self.mixing = MixingRule(**g["mixing"])
            self.dim = int(doc["payload"]["dim"])
        except (KeyError, TypeError, ValueError) as exc:
            raise StartupError(f"the swarm's config is invalid: {exc}") from None


class NodeRuntime:
    """A running node's parts and counters; `status()` is what the local API serves."""

    def __init__(self, config: NodeConfig, founding: bool) -> None:
        self.config = config
        self.founding = founding
        self.started = time.time()
        self.peer: GossipPeer | None = None
        self.discovery = None
        self.transport = None
        self.maddrs: tuple[str, ...] = ()
        self.config_hash = ""
        self.swarm_doc: dict[str, Any] = {}
        self.monitor_url = ""
        self.node_errors: dict[str, int] = {}
        self.gossip_from = 0

    def count(self, kind: str) -> None:
        self.node_errors[kind] = self.node_errors.get(kind, 0) + 1

    def status(self) -> dict[str, Any]:
        peer, discovery = self.peer, self.discovery
        view = discovery.view() if discovery else ()
        errors: dict[str, int] = dict(self.node_errors)
        for source in (peer.stats.errors if peer else {}, discovery.errors if discovery else {}):
            for kind, n in source.items():
                errors[kind] = errors.get(kind, 0) + n
        vector = peer.tensors["params"] if peer else np.zeros(0, np.float32)
        return {
            "peer_id": self.transport.peer_id if self.transport else "",
            "swarm": self.config.swarm,
            "config_hash": self.config_hash,
            "maddrs": list(self.maddrs),
            "monitor_url": self.monitor_url,
            "peers": [{"peer_id": p.peer_id, "maddrs": list(p.maddrs), "step": p.step, "round": p.round,
                       "last_seen": p.heartbeat, "gossip_from": p.gossip_from} for p in view],
            "step": peer.step if peer else 0,
            "round": peer.round if peer else 0,
            "gossip_from": self.gossip_from,
            "rounds_run": peer.stats.rounds if peer else 0,
            "bytes_sent": peer.stats.bytes_sent if peer else 0,
            "bytes_received": peer.stats.bytes_received if peer else 0,
            "last_round_s": peer.stats.last_round_s if peer else 0.0,
            "skipped": dict(peer.stats.skipped) if peer else {},
            "errors": errors,
            "payload": {"dim": int(vector.size), "mean": float(vector.mean()) if vector.size else 0.0,
                        "norm": float(np.linalg.norm(vector))},
            "uptime_s": time.time() - self.started,
        }


@contextlib.asynccontextmanager
async def _bounded_cleanup(what: str, timeout_s: float = STOP_TIMEOUT_S) -> AsyncIterator[None]:
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except Exception as exc:  # noqa: BLE001 - shutdown goes on whatever one part does
        logger.warning("stopping %s: %s", what, exc or type(exc).__name__)


async def serve_node(config: NodeConfig, founding: bool, stop: asyncio.Event, runtime: NodeRuntime) -> None:
    from node.discovery import BootstrapFailed, Discovery, DiscoverySettings
    from node.transport.p2pd import P2PDTransport

    async with contextlib.AsyncExitStack() as stack:
        claimed, p2p = await _identity_and_daemon(config, stack)
        transport = P2PDTransport(p2p)
        runtime.transport = transport
        stack.push_async_callback(_close, transport, "transport")
        discovery = Discovery(p2p, claimed.identity, DiscoverySettings(config.swarm, heartbeat_s=config.heartbeat_s),
                              initial_peers=config.network.initial_peers)
        try:
            await discovery.start()
        except BootstrapFailed as exc:
            raise StartupError(str(exc)) from None
        runtime.discovery = discovery
        stack.push_async_callback(_close, discovery, "discovery")
        runtime.maddrs = discovery.local_record.maddrs

        ckpt_path = config.data_dir / "checkpoint.npz"
        try:
            checkpoint = load_checkpoint(ckpt_path)
        except CheckpointUnreadable as exc:
            logger.warning("%s; starting fresh", exc)
            checkpoint = None
        swarm = await _swarm_config(discovery, config, founding, checkpoint)
        runtime.config_hash, runtime.swarm_doc = swarm.config_hash, swarm.config
        settings = SwarmSettings(swarm.config)
        tensors, round_index = _initial_state(config, settings, swarm.config_hash, checkpoint)
        peer = GossipPeer(transport, ExchangeSettings(
            swarm=config.swarm, config_hash=swarm.config_hash, codec=settings.codec,
            exchange_timeout_s=config.gossip.exchange_timeout_s, max_staleness=settings.max_staleness,
            rule=settings.mixing), tensors)
        peer.round = round_index
        runtime.peer = peer
        await peer.start()
        api = await _start_api(runtime, config)
        runtime.monitor_url = api.url
        stack.push_async_callback(_close, api, "local API")
        stack.push_async_callback(_final_checkpoint, runtime, ckpt_path)
        print(f"murmur: peer {transport.peer_id} in swarm {config.swarm!r} ready; monitor {api.url}; "
              f"maddrs {' '.join(runtime.maddrs)}", flush=True)
        await _gossip_until(stop, runtime, settings, ckpt_path)


async def _identity_and_daemon(config: NodeConfig, stack: contextlib.AsyncExitStack):
    """Claim the node's identity and start its p2pd; both are released when `stack` closes."""
    from node.identity import IdentityError, claim_identity
    from node.transport.p2pd import P2PSettings, start_p2pd

    config.data_dir.mkdir(parents=True, exist_ok=True)
    try:
        claimed = claim_identity(config.identity_path)
    except IdentityError as exc:
        raise StartupError(str(exc)) from None
    stack.callback(claimed.release)
    try:
        p2p = await start_p2pd(P2PSettings(
            identity_path=config.identity_path, host_maddrs=config.network.listen,
            announce_maddrs=config.network.announce, initial_peers=config.network.initial_peers,
            nat_port_map=config.network.nat_port_map,
        ))
    except Exception as exc:  # p2pd reports a busy port or a bad address only as its own failure
        raise StartupError(f"p2pd could not start on {', '.join(config.network.listen)}: {exc}") from None
    stack.push_async_callback(_shutdown_p2p, p2p)
    return claimed, p2p


async def _swarm_config(discovery, config: NodeConfig, founding: bool, checkpoint):
    from node.discovery import SwarmConfig

    if founding:
        if checkpoint is not None and "swarm_config" in checkpoint.meta:
            doc = json.loads(str(checkpoint.meta["swarm_config"]))
            if doc.get("payload", {}).get("dim") == config.dim:
                return await discovery.publish_config(doc)  # a restarted founder keeps its swarm's epoch
        return await discovery.publish_config(swarm_document(config, epoch=time.time()))
    deadline = time.monotonic() + JOIN_CONFIG_TIMEOUT_S
    while time.monotonic() < deadline:
        found: SwarmConfig | None = await discovery.fetch_config()
        if found is not None:
            return found
        await asyncio.sleep(0.5)
    raise StartupError(f"no config for swarm {config.swarm!r} found through {', '.join(config.network.initial_peers)} "
                       f"within {JOIN_CONFIG_TIMEOUT_S:g} s: is the swarm name right?")


def _initial_state(config: NodeConfig, settings: SwarmSettings, config_hash: str, checkpoint):
    if checkpoint is not None:
        if checkpoint.meta.get("config_hash") == config_hash and "params" in checkpoint.tensors:
            logger.info("resuming from checkpoint at round %s", checkpoint.meta.get("round"))
            return {"params": checkpoint.tensors["params"]}, int(checkpoint.meta.get("round", 0))
        logger.warning("the checkpoint belongs to another swarm config; starting fresh (it stays as checkpoint.npz.prev)")
    rng = np.random.default_rng(config.seed)
    return {"params": rng.standard_normal(settings.dim).astype(np.float32)}, 0


async def _start_api(runtime: NodeRuntime, config: NodeConfig) -> ApiServer:
    try:
        return await start_api(runtime.status, config.monitor.host, config.monitor.port)
    except OSError as exc:
        raise StartupError(f"monitor port {config.monitor.host}:{config.monitor.port} unavailable: {exc.strerror}") from None


async def _gossip_until(stop: asyncio.Event, runtime: NodeRuntime, settings: SwarmSettings, ckpt_path) -> None:
    """Run round after round on the swarm's clock until `stop` is set."""
    peer, discovery, config = runtime.peer, runtime.discovery, runtime.config
    me = peer.peer_id
    clock = settings.clock
    lead_s = 4 * config.heartbeat_s + 1.0
    announced, start, waiting_since = 0, None, time.monotonic()
    topologies: dict[int, Topology] = {}
    connected: set[str] = set()
    last_round = -1
    while not stop.is_set():
        next_round = clock.next_round(time.time(), last_round, settings.max_staleness)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, clock.start_of(next_round) - time.time())):
                await stop.wait()
        if stop.is_set():
            return
        last_round = next_round
        view = discovery.view()
        timings = [PeerTiming(p.peer_id, p.gossip_from) for p in view if p.peer_id != me]
        if not announced and len(view) >= config.gossip.min_peers:
            announced = announce_round(clock, time.time(), lead_s)
            discovery.update(gossip_from=announced)
            runtime.gossip_from = announced
            waiting_since = time.monotonic()
        if announced and start is None:
            start = start_round(timings, announced)
            if start is None and time.monotonic() - waiting_since > 2 * lead_s:
                # a peer that never announces (it waits for a larger quorum) must not hold us back
                start = start_round([t for t in timings if t.gossip_from], announced)
            if start is not None:
                logger.info("gossip starts at round %d (now %d)", start, next_round)
                # our tensors are our input to that round: label replies so, not as `stale`
                peer.round = max(peer.round, start - 1)
        # dial before the first gossip round, so that round is not late for the dialling
        await _connect_new(runtime.transport, view, me, connected)
        if start is None or next_round < start:
            continue
        members = participants([*timings, PeerTiming(me, announced)], next_round)
        if me not in members.peer_ids:
            continue
        if members.n not in topologies:
            topologies[members.n] = build_topology(settings.topology, members.n)
        plan = peer_round(topologies[members.n], members, me, next_round)
        outcome = await peer.run_round(next_round, plan)
        discovery.update(round=next_round, step=peer.step)
        if outcome.skipped:
            logger.info("round %d: mixed with %d, skipped %s", next_round, len(outcome.mixed_with), outcome.skipped)
        if next_round % CHECKPOINT_EVERY_ROUNDS == 0:
            await _checkpoint(runtime, ckpt_path)


async def _connect_new(transport, view, me: str, connected: set[str]) -> None:
    """Give p2pd the addresses of peers it has not dialled yet (from their DHT records)."""
    new = [p for p in view if p.peer_id != me and p.peer_id not in connected]
    if not new:
        return

    async def dial(record) -> None:
        try:
            await transport.connect(record.peer_id, record.maddrs)
            connected.add(record.peer_id)
        except (ConnectionError, TimeoutError, ValueError) as exc:
            logger.info("could not dial %s yet: %s", record.peer_id, exc)

    async with asyncio.TaskGroup() as group:
        for record in new:
            group.create_task(dial(record))


async def _checkpoint(runtime: NodeRuntime, path) -> None:
    peer = runtime.peer
    meta = {"round": peer.round, "step": peer.step, "config_hash": runtime.config_hash, "swarm": runtime.config.swarm,
            "swarm_config": json.dumps(runtime.swarm_doc)}
    try:
        await asyncio.to_thread(save_checkpoint, path, peer.tensors, meta)
    except OSError as exc:
        runtime.count("checkpoint_failed")
        logger.error("checkpoint not written (%s); the previous one is kept", exc)


async def _final_checkpoint(runtime: NodeRuntime, path) -> None:
    async with _bounded_cleanup("final checkpoint"):
        await _checkpoint(runtime, path)


async def _close(part, what: str) -> None:
    async with _bounded_cleanup(what):
        await part.close()


async def _shutdown_p2p(p2p) -> None:
    async with _bounded_cleanup("p2pd"):
        await p2p.shutdown()


def _install_stop_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


def _run(main) -> int:
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


def run_node(config: NodeConfig, founding: bool) -> int:
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def main() -> int:
        stop = asyncio.Event()
        _install_stop_signals(stop)
        runtime = NodeRuntime(config, founding)
        await serve_node(config, founding, stop, runtime)
        return 0

    return _run(main)


def run_bootstrap(config: NodeConfig) -> int:
    """A DHT-only entry point: no swarm, no gossip; others pass its multiaddr to --peers."""
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def main() -> int:
        from hivemind.dht.node import DHTNode

        stop = asyncio.Event()
        _install_stop_signals(stop)
        async with contextlib.AsyncExitStack() as stack:
            _, p2p = await _identity_and_daemon(config, stack)
            async with asyncio.timeout(30):
                dht = await DHTNode.create(p2p=p2p, initial_peers=list(config.network.initial_peers) or None)
            stack.push_async_callback(_close_dht, dht)
            maddrs = [str(a) for a in await p2p.get_visible_maddrs()]
            print(f"murmur: bootstrap peer {p2p.peer_id} ready; maddrs {' '.join(maddrs)}", flush=True)
            await stop.wait()
        return 0

    return _run(main)


async def _close_dht(dht) -> None:
    async with _bounded_cleanup("DHT"):
        await dht.shutdown()
