"""The node daemon: p2pd, DHT discovery, the gossip peer and the local API in one asyncio process,
running one of two payloads until SIGINT/SIGTERM stops it cleanly:
- a model (the default): training steps with a gossip round after every H of them (node.training.loop);
- `--model vector`: one random vector of `dim` floats gossiped on the swarm's round clock, which
  makes the gossip itself observable (`murmur status` and the checkpoint show it converge).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from gossip.exchange import ExchangeSettings, GossipPeer
from node.cli.ready_line import format_ready_line
from node.config import NodeConfig
from node.monitor import (
    Counters,
    EventLog,
    HistoryRecorder,
    MixingStepEstimate,
    MonitorServer,
    round_graph,
    start_monitor,
)
from node.training.checkpoint import CheckpointUnreadable, load_checkpoint, save_checkpoint
from node.training.recipe import RecipeInvalid, SwarmSettings, check_model_allowed, same_payload, swarm_document
from node.training.rounds import PeerTiming, announce_round, participants, start_round
from topology import MembershipView, Topology, build_topology, peer_round

logger = logging.getLogger("murmur.node")

CHECKPOINT_EVERY_ROUNDS = 10
SWARM_AVERAGE_FILE = "swarm-average.npz"  # in the data directory, beside checkpoint.npz
STOP_TIMEOUT_S = 4.0  # everything below must be gone within the 5 s a user waits after SIGTERM
JOIN_CONFIG_TIMEOUT_S = 30.0


class StartupError(Exception):
    """The node cannot start (identity in use, address in use, no swarm config...): one line, exit 2."""


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
        self.training = None  # node.training.loop.SwarmTraining while a model is trained
        self.swarm_eval = None  # node.training.swarm_eval.SwarmEvaluator while a model is trained
        self.history = HistoryRecorder()  # the monitor's charts; the trainer feeds it through record()
        self.events = EventLog()  # the monitor's recent events and errors
        self._mixing_step = MixingStepEstimate()
        self._topologies: dict[tuple[str, int], Topology] = {}

    def count(self, kind: str) -> None:
        self.node_errors[kind] = self.node_errors.get(kind, 0) + 1

    def record(self, *, step: int, loss: float | None = None, val_loss: float | None = None,
               consensus_distance: float | None = None, tokens: int = 0) -> None:
        """The trainer's report after each step, for the monitor's charts (see node.monitor.history).
        A non-finite value is refused, counted as `monitor_bad_record` and logged; training goes on."""
        try:
            self.history.record(step=step, loss=loss, val_loss=val_loss,
                                consensus_distance=consensus_distance, tokens=tokens)
        except ValueError as exc:
            self.count("monitor_bad_record")
            logger.warning("monitor: step %d not recorded: %s", step, exc)

    @property
    def record_ttl_s(self) -> float:
        from node.net.discovery import DiscoverySettings  # already imported by the running daemon

        return DiscoverySettings(self.config.swarm, heartbeat_s=self.config.heartbeat_s).ttl_s

    def _training_figures(self) -> dict[str, float | None]:
        """loss, val_loss, tokens_per_s and consensus_distance: what the trainer recorded, else what
        its status says, else (vector mode) only the mixing step as the consensus estimate."""
        latest, training = self.history.latest, self.training
        if latest.recorded:
            samples = self.history.samples(limit=1)
            return {"loss": latest.loss, "val_loss": latest.val_loss, "consensus_distance": latest.consensus_distance,
                    "tokens_per_s": latest.tokens_per_s if latest.tokens_per_s is not None
                    else (samples[0].tokens_per_s if samples else None)}
        if training is not None:
            s = training.status
            return {"loss": s.loss, "val_loss": s.val_loss, "consensus_distance": s.consensus_distance,
                    "tokens_per_s": s.tokens_per_s if s.step else None}
        peer = self.peer
        vector = peer.tensors.get("params") if peer else None
        distance = self._mixing_step.update(peer.stats.rounds, vector) if vector is not None else None
        return {"loss": None, "val_loss": None, "tokens_per_s": None, "consensus_distance": distance}

    def _traffic(self) -> tuple[int, int]:
        """Bytes sent and received: the main gossip peer's, plus SPES's own protocols when SPES trains."""
        peer = self.peer
        sent, received = (peer.stats.bytes_sent, peer.stats.bytes_received) if peer else (0, 0)
        spes = self.training.spes_status() if self.training is not None else None
        if spes and spes.get("started"):
            sent, received = sent + spes["bytes_sent"], received + spes["bytes_received"]
        return sent, received

    def counters(self) -> Counters:
        peer, discovery = self.peer, self.discovery
        view = discovery.view() if discovery else ()
        me = self.transport.peer_id if self.transport else ""
        figures = self._training_figures()
        sent, received = self._traffic()
        return Counters(
            step=peer.step if peer else 0, round=peer.round if peer else 0,
            bytes_sent=sent, bytes_received=received,
            peers_alive=len(view),
            peer_loss={p.peer_id: loss for p in view if p.peer_id != me and (loss := _published_loss(p)) is not None},
            loss=figures["loss"], val_loss=figures["val_loss"], tokens_per_s=figures["tokens_per_s"],
            consensus_distance=figures["consensus_distance"],
        )

    def peers(self) -> list[dict[str, Any]]:
        """The membership view for the monitor: each peer's last record."""
        view = self.discovery.view() if self.discovery else ()
        me = self.transport.peer_id if self.transport else ""
        now = time.time()
        return [{"peer_id": p.peer_id, "self": p.peer_id == me, "address": _address(p.maddrs), "maddrs": list(p.maddrs),
                 "step": p.step, "round": p.round, "loss": _published_loss(p), "experts": list(p.experts),
                 "capacity": p.capacity, "version": p.version, "last_seen": p.heartbeat, "age_s": now - p.heartbeat,
                 "gossip_from": p.gossip_from} for p in view]

    def topology(self) -> dict[str, Any]:
        """The current round's graph as this node computes it from its view (see node.monitor.topology_view)."""
        view = self.discovery.view() if self.discovery else ()
        me = self.transport.peer_id if self.transport else ""
        round_index = self.peer.round if self.peer else 0
        if self.training is not None:  # a trained swarm's rounds mix over everyone in view (SwarmTraining.plan_for)
            members = MembershipView.of(p.peer_id for p in view)
        else:
            timings = [PeerTiming(p.peer_id, p.gossip_from) for p in view if p.peer_id != me]
            members = participants([*timings, PeerTiming(me, self.gossip_from)], round_index)
        topo = None
        if members.n and self.swarm_doc:
            key = (self.config_hash, members.n)
            if key not in self._topologies:
                spec = SwarmSettings.from_doc(self.swarm_doc).topology
                self._topologies[key] = build_topology(spec, members.n)
            topo = self._topologies[key]
        return round_graph((p.peer_id for p in view), members, topo, me, round_index)

    async def evaluate_swarm_average(self, save: bool = False) -> dict[str, Any]:
        """`POST /api/eval/average`: the swarm-average model's validation loss (node.training.swarm_eval), with
        this node's latest own validation loss next to it; with `save`, the model is also written to
        SWARM_AVERAGE_FILE. Raises EvalUnavailable or EvalBusy."""
        from node.training.swarm_eval import EvalUnavailable, finite_or_none

        if self.swarm_eval is None or self.training is None:
            raise EvalUnavailable("this node trains no model (vector mode): there is no validation loss to evaluate")
        result = await self.swarm_eval.evaluate(save=save)
        s = self.training.status
        return {**result.as_dict(), "local": {"val_loss": finite_or_none(s.val_loss), "val_step": s.val_step,
                                              "loss": finite_or_none(s.loss), "step": s.step}}

    def status(self) -> dict[str, Any]:
        peer, discovery = self.peer, self.discovery
        view = discovery.view() if discovery else ()
        errors: dict[str, int] = dict(self.node_errors)
        for source in (peer.stats.errors if peer else {}, discovery.errors if discovery else {}):
            for kind, n in source.items():
                errors[kind] = errors.get(kind, 0) + n
        vector = peer.tensors.get("params", np.zeros(0, np.float32)) if peer else np.zeros(0, np.float32)
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
            **dict(zip(("bytes_sent", "bytes_received"), self._traffic(), strict=True)),
            "last_round_s": peer.stats.last_round_s if peer else 0.0,
            "skipped": dict(peer.stats.skipped) if peer else {},
            "errors": errors,
            "payload": {"dim": int(vector.size), "mean": float(vector.mean()) if vector.size else 0.0,
                        "norm": float(np.linalg.norm(vector))},
            "training": self.training.status.as_dict() if self.training is not None else None,
            "spes": self.training.spes_status() if self.training is not None else None,
            **self._training_figures(),
            "version": discovery.local_record.version if discovery else "",
            "experts": list(discovery.local_record.experts) if discovery else [],
            "uptime_s": time.time() - self.started,
        }


def _published_loss(record) -> float | None:
    """The latest training loss a peer's record carries (validated finite by node.net.discovery)."""
    return record.loss


def _address(maddrs) -> str | None:
    return maddrs[0].split("/p2p/")[0] if maddrs else None


@contextlib.asynccontextmanager
async def _bounded_cleanup(what: str, timeout_s: float = STOP_TIMEOUT_S) -> AsyncIterator[None]:
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except Exception as exc:
        logger.warning("stopping %s: %s", what, exc or type(exc).__name__)


async def serve_node(config: NodeConfig, founding: bool, stop: asyncio.Event, runtime: NodeRuntime) -> None:
    from node.net.discovery import BootstrapFailed, Discovery, DiscoverySettings

    async with contextlib.AsyncExitStack() as stack:
        claimed, p2p = await _identity_and_daemon(config, stack)
        transport = await _data_plane(config, claimed.identity, p2p, stop, runtime, stack)
        runtime.transport = transport
        stack.push_async_callback(_close, transport, "transport")
        discovery = Discovery(p2p, claimed.identity, DiscoverySettings(config.swarm, heartbeat_s=config.heartbeat_s),
                              initial_peers=config.network.initial_peers,
                              data_maddrs=await _advertised_data_maddrs(config, transport, claimed.identity.peer_id))
        try:
            await discovery.start()
        except BootstrapFailed as exc:
            raise StartupError(str(exc)) from None
        runtime.discovery = discovery
        stack.push_async_callback(_close, discovery, "discovery")
        runtime.maddrs = discovery.dht_maddrs  # what `murmur join --peers` takes; the record has the data plane's

        ckpt_path = config.data_dir / "checkpoint.npz"
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
        exchange = ExchangeSettings(
            swarm=config.swarm, config_hash=swarm.config_hash, codec=settings.codec,
            exchange_timeout_s=config.gossip.exchange_timeout_s, max_staleness=settings.max_staleness,
            rule=settings.mixing)
        if settings.training is not None:
            training = await _start_training(runtime, settings, exchange, checkpoint, stack)
        else:
            if config.training.average_every:
                logger.warning("--average-every is ignored: this swarm trains no model (vector mode)")
            tensors, round_index = _initial_state(config, settings, swarm.config_hash, checkpoint)
            runtime.peer = GossipPeer(transport, exchange, tensors)
            runtime.peer.round = round_index
        await runtime.peer.start()
        api = await _start_api(runtime, config)
        runtime.monitor_url = api.url
        stack.push_async_callback(_close, api, "local API")
        stack.push_async_callback(_final_checkpoint, runtime, ckpt_path)
        print(format_ready_line(transport.peer_id, config.swarm, api.url, runtime.maddrs), flush=True)
        if settings.training is not None:
            await _train_until(stop, runtime, training, settings, ckpt_path)
        else:
            await _gossip_until(stop, runtime, settings, ckpt_path)


async def _start_training(runtime: NodeRuntime, settings: SwarmSettings, exchange: ExchangeSettings, checkpoint,
                          stack: contextlib.AsyncExitStack):
    """Build the trainer and its gossip peer; restore this node's checkpoint when it is of this swarm."""
    from node.training.loop import SwarmTraining, TrainingSetupError, build_trainer, checkpoint_matches, last_round_at

    config, me = runtime.config, runtime.transport.peer_id
    try:
        trainer = await asyncio.to_thread(build_trainer, config, settings.training, me)
    except TrainingSetupError as exc:
        raise StartupError(f"cannot train the swarm's model here: {exc}") from None
    stack.push_async_callback(_close_trainer, trainer)
    resumed = checkpoint_matches(checkpoint, runtime.config_hash)
    if resumed:
        await trainer.restore(checkpoint.tensors)
        logger.info("resuming from checkpoint at step %d", trainer.step)
    elif checkpoint is not None:
        logger.warning("the checkpoint belongs to another swarm config; starting fresh (it stays as checkpoint.npz.prev)")
    runtime.peer = GossipPeer(runtime.transport, exchange, await trainer.tensors(), step=trainer.step)
    runtime.peer.round = last_round_at(trainer.step, settings.training)
    topologies: dict[int, Topology] = {}
    connected: set[str] = set()

    def topology_for(n: int) -> Topology:
        if n not in topologies:
            topologies[n] = build_topology(settings.topology, n)
        return topologies[n]

    async def connect(view) -> None:
        await _connect_new(runtime.transport, view, me, connected)

    local_steps = settings.training.optimizer.local_steps
    # DHT records lag by up to a heartbeat: the window leaves room for that beyond the staleness bound
    lag_window = max(10, 2 * (settings.max_staleness + 1) * local_steps)
    if settings.training.spes is not None:
        from node.spes.training import SpesSwarmTraining, saved_records

        try:
            training = SpesSwarmTraining(
                trainer, runtime.peer, runtime.discovery, settings.training, config, topology_for, connect, lag_window,
                record=runtime.record, transport=runtime.transport, exchange=exchange, heartbeat_s=config.heartbeat_s,
                ttl_s=runtime.record_ttl_s, swarm=config.swarm, capacity=config.training.experts,
                saved=saved_records(checkpoint.meta) if resumed else None)
        except ValueError as exc:  # a model without MoE layers
            raise StartupError(f"cannot train the swarm's model with SPES here: {exc}") from None
    else:
        training = SwarmTraining(trainer, runtime.peer, runtime.discovery, settings.training, config, topology_for,
                                 connect, lag_window, record=runtime.record)
    training.status.started_from = "checkpoint" if resumed else "init"
    runtime.training = training
    from node.training.swarm_eval import SwarmEvaluator

    async def dial(record) -> None:
        await runtime.transport.connect(record.peer_id, record.maddrs)

    runtime.swarm_eval = SwarmEvaluator(trainer, runtime.peer, runtime.discovery.view, connect=dial, count=runtime.count,
                                        average=getattr(training, "swarm_average", None),
                                        save=functools.partial(_save_swarm_average, runtime))
    stack.push_async_callback(runtime.swarm_eval.close)
    return training


async def _save_swarm_average(runtime: NodeRuntime, tensors, result) -> str:
    """Write the swarm-average model beside the checkpoint, atomically, with what it averaged; OSError
    leaves the previous file as it was."""
    path = runtime.config.data_dir / SWARM_AVERAGE_FILE
    meta = {"kind": "swarm-average", **_swarm_meta(runtime), "written_by": result.self_id, "written_at": time.time(),
            "val_loss": result.loss, "min_step": result.min_step, "max_step": result.max_step,
            "peers": json.dumps([p.peer_id for p in result.included])}
    await asyncio.to_thread(save_checkpoint, path, tensors, meta)
    return str(path)


async def _train_until(stop: asyncio.Event, runtime: NodeRuntime, training, settings: SwarmSettings, ckpt_path) -> None:
    """Catch up with the swarm if it is ahead (a joiner, or a node that was down), wait for the quorum of
    a fresh swarm, train, and keep serving parameters once the step budget is spent."""
    await training.catch_up(stop, margin=settings.max_staleness * settings.training.optimizer.local_steps,
                            look=not (runtime.founding and training.trainer.step == 0))
    if training.trainer.step == 0:
        await training.wait_for_quorum(stop)
    try:
        # --average-every: the evaluator writes the swarm average in the background, training goes on
        await training.run(stop, lambda: _checkpoint(runtime, ckpt_path), average=runtime.swarm_eval.save_in_background)
    except Exception as exc:
        runtime.count("training_failed")
        logger.error("training stopped at step %d: %s: %s; the node keeps serving its last parameters",
                     training.trainer.step, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        training.peer.park()
    await stop.wait()


async def _data_plane(config: NodeConfig, identity, p2p, stop: asyncio.Event, runtime: NodeRuntime,
                      stack: contextlib.AsyncExitStack):
    """The gossip transport `--transport` selects: p2pd's own streams, or a py-libp2p child process
    under the node's identity (see docs/architecture.md, "Data-plane backends")."""
    if config.network.transport == "p2pd":
        from node.net.transport.p2pd import P2PDTransport

        return P2PDTransport(p2p)
    from node.net.transport.libp2p import ChildFailed, LibP2PSettings, LibP2PTransport, data_listen_maddrs

    def child_died() -> None:
        runtime.count("data_plane_died")
        stop.set()

    if config.network.announce and not config.network.data_announce:
        logger.warning("--announce covers the DHT only: peers will dial the py-libp2p data plane at its listen "
                       "addresses; give --data-announce (and --data-listen) for NAT or port forwarding")
    listen = config.network.data_listen or data_listen_maddrs(config.network.listen)
    try:
        transport = await LibP2PTransport.start(LibP2PSettings(identity.path, identity.peer_id, listen=listen),
                                                on_death=child_died)
    except ChildFailed as exc:
        raise StartupError(str(exc)) from None
    stack.push_async_callback(_stopped_by_dead_child, transport)  # runs once the node's parts have stopped
    return transport


async def _advertised_data_maddrs(config: NodeConfig, transport, peer_id: str) -> tuple[str, ...]:
    """Where this node's record tells peers to open gossip streams: `--data-announce` when given,
    else the data plane's own (for p2pd, the daemon's visible ones, `--announce` included)."""
    if config.network.data_announce:
        return tuple(f"{addr}/p2p/{peer_id}" for addr in config.network.data_announce)
    return await transport.maddrs()


async def _stopped_by_dead_child(transport) -> None:
    if transport.died:
        raise StartupError(f"{transport.died}; the node stopped (its final checkpoint is written)")


def _p2pd_identity_path(config: NodeConfig):
    if config.network.transport == "p2pd":
        return config.identity_path
    from node.net.transport.libp2p import dht_identity_path

    return dht_identity_path(config.identity_path)


async def _identity_and_daemon(config: NodeConfig, stack: contextlib.AsyncExitStack):
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
            identity_path=_p2pd_identity_path(config), host_maddrs=config.network.listen,
            announce_maddrs=config.network.announce, initial_peers=config.network.initial_peers,
            nat_port_map=config.network.nat_port_map,
        ))
    except Exception as exc:  # p2pd reports a busy port or a bad address only as its own failure
        raise StartupError(f"p2pd could not start on {', '.join(config.network.listen)}: {exc}") from None
    stack.push_async_callback(_shutdown_p2p, p2p)
    return claimed, p2p


async def _swarm_config(discovery, config: NodeConfig, founding: bool, checkpoint):
    from node.net.discovery import SwarmConfig

    if founding:
        if checkpoint is not None and "swarm_config" in checkpoint.meta:
            doc = json.loads(str(checkpoint.meta["swarm_config"]))
            if same_payload(doc, config):
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


async def _start_api(runtime: NodeRuntime, config: NodeConfig) -> MonitorServer:
    try:
        return await start_monitor(runtime, config.monitor.host, config.monitor.port)
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
    peer, training = runtime.peer, runtime.training
    tensors = await training.trainer.state() if training is not None else peer.tensors
    step = training.trainer.step if training is not None else peer.step
    meta = {"round": peer.round, "step": step, **_swarm_meta(runtime),
            **(training.checkpoint_meta() if training is not None else {})}
    try:
        await asyncio.to_thread(save_checkpoint, path, tensors, meta)
    except OSError as exc:
        runtime.count("checkpoint_failed")
        logger.error("checkpoint not written (%s); the previous one is kept", exc)


def _swarm_meta(runtime: NodeRuntime) -> dict[str, str]:
    """What a file this node writes carries of the swarm it belongs to (a checkpoint, the swarm average)."""
    return {"swarm": runtime.config.swarm, "config_hash": runtime.config_hash,
            "swarm_config": json.dumps(runtime.swarm_doc)}


async def _final_checkpoint(runtime: NodeRuntime, path) -> None:
    async with _bounded_cleanup("final checkpoint"):
        await _checkpoint(runtime, path)


async def _close_trainer(trainer) -> None:
    async with _bounded_cleanup("trainer"):
        await asyncio.to_thread(trainer.close)


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
