"""What a running node shows: `NodeRuntime` holds the node's parts and counters and answers the
monitor (node.monitor.source.MonitorSource) and `murmur status` from them."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from gossip.exchange import GossipPeer
from node.config import NodeConfig
from node.monitor import Counters, EventLog, HistoryRecorder, MixingStepEstimate, RoundGraphCache, round_graph
from node.monitor.source import DoctorUnavailable
from node.runtime.guide import GuideLine
from node.runtime.guide import as_json as guide_json
from node.swarm.recipe import SwarmSettings
from node.swarm.rounds import PeerTiming, participants
from topology import MembershipView, TopologySpec

if TYPE_CHECKING:
    from gossip.limits import IncomingGate
    from node.net.dialer import Dialer
    from node.net.discovery import Discovery
    from node.net.founder import SwarmConfig
    from node.net.records import PeerRecord
    from node.net.relays import NodeReachability
    from node.runtime.data_plane import DataPlane
    from node.swarm.contribution import ContributionScorer
    from node.swarm.loop import SwarmLoop
    from node.swarm.swarm_eval import SwarmEvaluator

logger = logging.getLogger("murmur.node")

MAX_DOCTOR_NEIGHBOURS = 16  # neighbours `murmur doctor` measures


class NodeRuntime:
    """A running node's parts and counters; `status()` is what the local API serves."""

    def __init__(self, config: NodeConfig, founding: bool) -> None:
        self.config = config
        self.founding = founding
        self.started = time.time()
        self.peer: GossipPeer | None = None
        self.discovery: Discovery | None = None
        self.transport: DataPlane | None = None
        self.reach: NodeReachability | None = None
        self.gate: IncomingGate | None = None  # admission of incoming streams (gossip.limits)
        self.dialer: Dialer | None = None  # background dials of the view's peers
        self.maddrs: tuple[str, ...] = ()
        self.config_hash = ""
        self.swarm_doc: Mapping[str, Any] = {}
        self.swarm_config: SwarmConfig | None = None  # the founder's signed config this session runs
        self.config_not_followed: str | None = None  # why a newer config of the founder is not followed
        self.next_initial_peers: tuple[str, ...] = ()  # where the next session (a followed config) joins the DHT
        self.monitor_url = ""
        self.node_errors: dict[str, int] = {}
        self.gossip_from = 0
        self.training: SwarmLoop | None = None  # while a model is trained
        self.swarm_eval: SwarmEvaluator | None = None  # while a model is trained
        self.contribution: ContributionScorer | None = None  # while neighbours' contributions are scored
        self.history = HistoryRecorder()  # the monitor's charts; the trainer feeds it through record()
        self.events = EventLog()  # the monitor's recent events and errors
        self._mixing_step = MixingStepEstimate()
        self._graphs = RoundGraphCache()  # the monitor's topology, computed off the event loop
        self._spec: tuple[str, TopologySpec] | None = None  # (config hash, its topology)
        self._doctor_running = False
        self.memory: dict[str, Any] | None = None  # the preflight's footprint (node.runtime.preflight)
        self.preflight: list[GuideLine] | None = None  # a joiner's guided-join lines (node.runtime.guide)

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

    def _view(self) -> tuple[PeerRecord, ...]:
        return self.discovery.view() if self.discovery else ()

    def _me(self) -> str:
        return self.transport.peer_id if self.transport else ""

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
        distance = self._mixing_step.update(peer.stats.rounds, vector) if peer and vector is not None else None
        return {"loss": None, "val_loss": None, "tokens_per_s": None, "consensus_distance": distance}

    def _traffic(self) -> tuple[int, int]:
        """Bytes sent and received: the main gossip peer's, plus the training's own protocols (SPES, DiLoCo)."""
        peer = self.peer
        sent, received = (peer.stats.bytes_sent, peer.stats.bytes_received) if peer else (0, 0)
        if self.training is not None:
            more_sent, more_received = self.training.extra_traffic()
            sent, received = sent + more_sent, received + more_received
        return sent, received

    def _mixing(self) -> dict[str, Any]:
        """This node's own mixing rule and how many neighbour values it clipped (SPES's peers included)."""
        peer = self.peer
        clipped = peer.stats.clipped if peer else 0
        spes = self.training.spes_status() if self.training is not None else None
        if spes and spes.get("started"):
            clipped += spes["clipped"]
        return {"rule": str(self.config.gossip.mixing.kind), "clipped": clipped}

    def counters(self) -> Counters:
        peer, view, me = self.peer, self._view(), self._me()
        figures = self._training_figures()
        sent, received = self._traffic()
        return Counters(
            step=peer.step if peer else 0, round=peer.round if peer else 0,
            bytes_sent=sent, bytes_received=received,
            peers_alive=len(view),
            peer_loss={p.peer_id: p.loss for p in view if p.peer_id != me and p.loss is not None},
            loss=figures["loss"], val_loss=figures["val_loss"], tokens_per_s=figures["tokens_per_s"],
            consensus_distance=figures["consensus_distance"],
        )

    def links(self) -> dict[str, dict[str, Any]]:
        """Per neighbour in view: the kind of this node's connection to it (direct, relayed,
        holepunched, none) and the goodput of what it sent lately (Mbit/s, None before a large transfer)."""
        view, me, reach, transport = self._view(), self._me(), self.reach, self.transport
        if self.config.network.transport == "p2pd" and reach is not None:
            kinds = {peer: kind.value for peer, kind in
                     reach.connection_kinds({p.peer_id: p.maddrs for p in view if p.peer_id != me}).items()}
        else:  # the py-libp2p child says which peers it reaches only through a relay
            relayed: frozenset[str] = getattr(transport, "relayed", frozenset())
            kinds = {p.peer_id: "relayed" if p.peer_id in relayed else "direct" for p in view if p.peer_id != me}
        goodput = getattr(transport, "goodput_mbit_s", None)
        return {peer: {"connection": kind, "goodput_mbit_s": goodput(peer) if goodput else None}
                for peer, kind in kinds.items()}

    def reachability(self) -> dict[str, Any] | None:
        return self.reach.status() if self.reach is not None else None

    def peers(self) -> list[dict[str, Any]]:
        """The membership view for the monitor: each peer's last record (its loss validated finite, its
        tokens clipped to its step by node.net.discovery) and this node's link to it."""
        from node.net.records import ReachedVia  # imported by the running daemon already
        me, now, links = self._me(), time.time(), self.links()
        return [{"peer_id": p.peer_id, "self": p.peer_id == me, "address": _address(p.maddrs), "maddrs": list(p.maddrs),
                 "step": p.step, "round": p.round, "loss": p.loss, "experts": list(p.experts),
                 "capacity": p.capacity, "version": p.version, "last_seen": p.heartbeat, "age_s": now - p.heartbeat,
                 "gossip_from": p.gossip_from, "tokens": p.tokens, "tokens_per_s": p.tokens_per_s,
                 "uptime_s": p.uptime_s, "reach": ReachedVia.of(p.reach).value,
                 **links.get(p.peer_id, {"connection": None, "goodput_mbit_s": None})}
                for p in self._view()]

    def _graph_inputs(self) -> tuple[list[str], MembershipView, TopologySpec | None, str, int]:
        """What the current round's graph depends on: the view, the round's members (as the round loop
        takes them: when training, the peers in view that serve their rounds and have steps left, else the
        peers with 0 < gossip_from <= round), the swarm's topology, this node and the round."""
        view, me = self._view(), self._me()
        round_index = self.peer.round if self.peer else 0
        if self.training is not None:
            members = self.training.round_members(view)
        else:
            timings = [PeerTiming(p.peer_id, p.gossip_from) for p in view if p.peer_id != me]
            members = participants([*timings, PeerTiming(me, self.gossip_from)], round_index)
        spec = None
        if self.swarm_doc:
            if self._spec is None or self._spec[0] != self.config_hash:
                self._spec = (self.config_hash, SwarmSettings.from_doc(self.swarm_doc).topology)
            spec = self._spec[1]
        return [p.peer_id for p in view], members, spec, me, round_index

    async def refresh_topology(self) -> None:
        await self._graphs.refresh(*self._graph_inputs())

    def topology(self) -> dict[str, Any]:
        """The current round's graph as this node computes it from its view (node.monitor.topology_view),
        as of the last refresh_topology; before the first, the view's nodes without edges."""
        view_ids, members, _, me, round_index = self._graph_inputs()
        return self._graphs.latest(round_index) or round_graph(view_ids, members, None, me, round_index)

    async def doctor(self) -> dict[str, Any]:
        """`POST /api/doctor` (`murmur doctor`): ask peers to dial this node back (the bootstrap peers and
        relays first), push a probe through each relay's circuit, check the relay service, and measure
        each neighbour. Takes seconds; raises DoctorUnavailable when one runs already."""
        from node.net.hivemind_adapter import is_circuit
        from node.net.reach import dialable_maddrs

        reach = self.reach
        if reach is None:
            raise DoctorUnavailable("this node has no p2pd host yet")
        if self._doctor_running:
            raise DoctorUnavailable("a check is already running")
        me, view = self._me(), [p for p in self._view() if p.peer_id != self._me()]
        network = self.config.network
        # the --peers and --relays are the user's word; the view's addresses are their peers' word, so
        # only those the routability rule lets this node dial (node.net.reach)
        own = (*self.discovery.local_record.maddrs, *self.discovery.dht_maddrs) if self.discovery else self.maddrs
        ask = [*network.initial_peers, *network.relays,
               *(m for p in view for m in dialable_maddrs(p.maddrs, own) if not is_circuit(m))]
        neighbours = {p.peer_id: p.maddrs for p in view[:MAX_DOCTOR_NEIGHBOURS]}
        goodput = getattr(self.transport, "goodput_mbit_s", None)
        self._doctor_running = True
        try:
            report = await reach.refresh(ask, neighbours, goodput or (lambda _: None))
        finally:
            self._doctor_running = False
        return {"peer_id": me, "swarm": self.config.swarm, "maddrs": list(self.maddrs), **report}

    async def evaluate_swarm_average(self, save: bool = False) -> dict[str, Any]:
        """`POST /api/eval/average`: the swarm-average model's validation loss (node.swarm.swarm_eval), with
        this node's latest own validation loss next to it; with `save`, the model is also written to
        node.runtime.saving.SWARM_AVERAGE_FILE. Raises EvalUnavailable or EvalBusy."""
        from node.swarm.swarm_eval import EvalUnavailable, finite_or_none

        if self.swarm_eval is None or self.training is None:
            raise EvalUnavailable("this node trains no model (vector mode): there is no validation loss to evaluate")
        result = await self.swarm_eval.evaluate(save=save)
        s = self.training.status
        return {**result.as_dict(), "local": {"val_loss": finite_or_none(s.val_loss), "val_step": s.val_step,
                                              "loss": finite_or_none(s.loss), "step": s.step}}

    def limits(self) -> dict[str, Any]:
        """What the resource limits refused and hold (docs/monitor.md): incoming streams refused before a
        byte was read, requests refused after their header, dials, the view's overflow."""
        gate, dialer, discovery, peer = self.gate, self.dialer, self.discovery, self.peer
        requests: dict[str, int] = dict(peer.stats.refused) if peer else {}
        spes = self.training.spes_status() if self.training is not None else None
        for reason, n in ((spes or {}).get("refused") or {}).items():
            requests[reason] = requests.get(reason, 0) + n
        return {
            "streams_refused": dict(gate.refused) if gate else {},
            "requests_refused": requests,
            "open_streams": gate.open_streams if gate else 0,
            "dials": dict(dialer.counts) if dialer else {},
            "dials_backing_off": dialer.backing_off if dialer else 0,
            "view_overflow": discovery.view_overflow if discovery else 0,
            "membership_shards": discovery.shards if discovery else 1,
        }

    def _skipped(self) -> dict[str, int]:
        """Neighbours left out of this node's rounds, by reason: the main peer's and the algorithm's own
        (DiLoCo's fragment rounds, whose main peer runs none)."""
        skipped: dict[str, int] = dict(self.peer.stats.skipped) if self.peer else {}
        for reason, n in (self.training.extra_skipped() if self.training is not None else {}).items():
            skipped[reason] = skipped.get(reason, 0) + n
        return skipped

    def status(self) -> dict[str, Any]:
        peer, discovery, view = self.peer, self.discovery, self._view()
        errors: dict[str, int] = dict(self.node_errors)
        extra = self.training.extra_errors() if self.training is not None else {}
        for source in (peer.stats.errors if peer else {}, discovery.errors if discovery else {}, extra):
            for kind, n in source.items():
                errors[kind] = errors.get(kind, 0) + n
        vector = peer.tensors.get("params", np.zeros(0, np.float32)) if peer else np.zeros(0, np.float32)
        links = self.links()
        return {
            "peer_id": self._me(),
            "swarm": self.config.swarm,
            "config_hash": self.config_hash,
            **self._identity_status(),
            "maddrs": list(self.maddrs),
            "monitor_url": self.monitor_url,
            "peers": [{"peer_id": p.peer_id, "maddrs": list(p.maddrs), "step": p.step, "round": p.round,
                       "last_seen": p.heartbeat, "gossip_from": p.gossip_from,
                       **links.get(p.peer_id, {"connection": None, "goodput_mbit_s": None})} for p in view],
            "reachability": self.reachability(),
            "step": peer.step if peer else 0,
            "round": peer.round if peer else 0,
            "gossip_from": self.gossip_from,
            "rounds_run": peer.stats.rounds if peer else 0,
            **dict(zip(("bytes_sent", "bytes_received"), self._traffic(), strict=True)),
            "last_round_s": peer.stats.last_round_s if peer else 0.0,
            "skipped": self._skipped(),
            "errors": errors,
            "mixing": self._mixing(),
            "payload": {"dim": int(vector.size), "mean": float(vector.mean()) if vector.size else 0.0,
                        "norm": float(np.linalg.norm(vector))},
            "training": self.training.status_dict() if self.training is not None else None,
            "join": self._join_progress(),
            "spes": self.training.spes_status() if self.training is not None else None,
            "contribution": self.contribution.status() if self.contribution is not None else {},
            "contribution_exclusions": self.contribution.ratings.exclusions if self.contribution is not None else 0,
            **self._training_figures(),
            "version": discovery.local_record.version if discovery else "",
            "experts": list(discovery.local_record.experts) if discovery else [],
            "uptime_s": time.time() - self.started,
            "limits": self.limits(),
            "memory": self.memory,
            "preflight": guide_json(self.preflight) if self.preflight is not None else None,
        }


    def _join_progress(self) -> dict[str, Any] | None:
        """A running catch-up's downloads (node.swarm.joining.JoinProgress); None when none runs."""
        progress = self.training.join_progress() if self.training is not None else None
        return msgspec.to_builtins(progress) if progress is not None else None

    def _identity_status(self) -> dict[str, Any]:
        """The swarm's identity and config version: what `murmur join --invite` takes, and whether this
        node runs the founder's latest config (and why not)."""
        swarm, discovery = self.swarm_config, self.discovery
        latest = discovery.latest_config if discovery is not None else None
        admission = SwarmSettings.from_doc(self.swarm_doc).admission.value if swarm is not None else None
        return {"invite": f"{self.config.swarm}@{swarm.founder}" if swarm is not None else None,
                "founder": swarm.founder if swarm is not None else None,
                "config_version": swarm.version if swarm is not None else None,
                "config_latest_version": latest.version if latest is not None else None,
                "config_not_followed": self.config_not_followed,
                "admission": admission}


def _address(maddrs: Sequence[str]) -> str | None:
    """A peer's host address: its first multiaddr without the /p2p/ part."""
    return maddrs[0].split("/p2p/")[0] if maddrs else None
