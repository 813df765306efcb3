"""`/metrics`: the node's figures in Prometheus text format, read from the monitor source at each
scrape (a collector on a registry of the server's own, so nothing is module-level state)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from node.monitor.source import MonitorSource

# Every family name as it appears in the exposition (counters get their `_total` suffix there).
METRIC_NAMES = (
    "murmur_node_info",
    "murmur_uptime_seconds",
    "murmur_resident_memory_bytes",
    "murmur_step",
    "murmur_round",
    "murmur_rounds_total",
    "murmur_last_round_seconds",
    "murmur_bytes_sent_total",
    "murmur_bytes_received_total",
    "murmur_peers_alive",
    "murmur_errors_total",
    "murmur_skipped_total",
    "murmur_mixing_clipped_total",
    "murmur_loss",
    "murmur_val_loss",
    "murmur_tokens_per_second",
    "murmur_consensus_distance",
    "murmur_experts_owned",
    "murmur_bytes_per_token",
    "murmur_outer_step",
    "murmur_fragments_in_flight",
    "murmur_topology_rho",
    "murmur_monitor_bad_requests_total",
    "murmur_monitor_refused_total",
    "murmur_streams_refused_total",
    "murmur_requests_refused_total",
    "murmur_incoming_streams",
    "murmur_dials_total",
    "murmur_dials_backing_off",
    "murmur_view_overflow",
    "murmur_peer_connections",
    "murmur_peer_goodput_mbit_per_second",
    "murmur_reachability_info",
    "murmur_relays_held",
    "murmur_relay_service_limits_in_force",
)
CONNECTION_KINDS = ("direct", "relayed", "holepunched")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class NodeCollector(Collector):
    def __init__(self, source: MonitorSource, bad_requests: Callable[[], int],
                 refused: Callable[[], dict[str, int]]) -> None:
        self._source = source
        self._bad_requests = bad_requests
        self._refused = refused

    def collect(self) -> Iterator[Metric]:
        s = self._source.status()
        rho = self._source.topology()["rho"]
        info = InfoMetricFamily("murmur_node", "this node's identity",
                                value={"peer_id": s["peer_id"], "swarm": s["swarm"], "version": s["version"]})
        yield info
        yield GaugeMetricFamily("murmur_uptime_seconds", "seconds since the node started", value=s["uptime_s"])
        yield _optional(GaugeMetricFamily("murmur_resident_memory_bytes", "resident memory of the node's process "
                                          "(absent where /proc is not)", labels=[]), resident_memory_bytes())
        yield GaugeMetricFamily("murmur_step", "training step (optimizer steps taken)", value=s["step"])
        yield GaugeMetricFamily("murmur_round", "current gossip round", value=s["round"])
        yield CounterMetricFamily("murmur_rounds", "gossip rounds run", value=s["rounds_run"])
        yield GaugeMetricFamily("murmur_last_round_seconds", "duration of the last gossip round", value=s["last_round_s"])
        yield CounterMetricFamily("murmur_bytes_sent", "gossip bytes sent", value=s["bytes_sent"])
        yield CounterMetricFamily("murmur_bytes_received", "gossip bytes received", value=s["bytes_received"])
        yield GaugeMetricFamily("murmur_peers_alive", "peers in the membership view, this one included",
                                value=len(s["peers"]))
        yield _labelled(CounterMetricFamily("murmur_errors", "rejected input and failures", labels=["kind"]), s["errors"])
        yield _labelled(CounterMetricFamily("murmur_skipped", "neighbours left out of a round", labels=["reason"]),
                        s["skipped"])
        yield CounterMetricFamily("murmur_mixing_clipped", "neighbour values mixed after clipping (robust mixing)",
                                  value=s["mixing"]["clipped"])
        for name, key, doc in (("murmur_loss", "loss", "last training loss (absent while nothing is trained)"),
                               ("murmur_val_loss", "val_loss", "last validation loss"),
                               ("murmur_tokens_per_second", "tokens_per_s", "training throughput"),
                               ("murmur_consensus_distance", "consensus_distance",
                                "the node's estimate of its distance to the swarm's average")):
            yield _optional(GaugeMetricFamily(name, doc, labels=[]), s[key])
        yield GaugeMetricFamily("murmur_experts_owned", "experts this node owns", value=len(s["experts"]))
        training = s.get("training") or {}
        outer = training.get("diloco") or {}
        yield _optional(GaugeMetricFamily("murmur_bytes_per_token", "gossip bytes sent and received per training "
                                          "token", labels=[]), training.get("bytes_per_token"))
        yield _optional(GaugeMetricFamily("murmur_outer_step", "gossip DiLoCo: outer steps taken", labels=[]),
                        outer.get("outer_step"))
        yield _optional(GaugeMetricFamily("murmur_fragments_in_flight", "gossip DiLoCo: fragment exchanges "
                                          "running", labels=[]), outer.get("fragments_in_flight"))
        yield _optional(GaugeMetricFamily("murmur_topology_rho", "rho of the current round's topology", labels=[]), rho)
        yield CounterMetricFamily("murmur_monitor_bad_requests", "monitor requests refused with 400",
                                  value=self._bad_requests())
        yield _labelled(CounterMetricFamily("murmur_monitor_refused", "monitor requests refused before handling: "
                                            "foreign Host, POST without the token, too many event streams",
                                            labels=["reason"]), self._refused())
        limits = s.get("limits") or {}
        yield _labelled(CounterMetricFamily("murmur_streams_refused", "incoming streams closed before a byte was "
                                            "read: per-peer or total cap, or a peer not in view", labels=["reason"]),
                        limits.get("streams_refused", {}))
        yield _labelled(CounterMetricFamily("murmur_requests_refused", "requests answered with a reject after "
                                            "their header: rate limits, rounds out of bounds, timing",
                                            labels=["reason"]), limits.get("requests_refused", {}))
        yield GaugeMetricFamily("murmur_incoming_streams", "incoming streams open now",
                                value=limits.get("open_streams", 0))
        yield _labelled(CounterMetricFamily("murmur_dials", "dials of the view's peers, by outcome",
                                            labels=["outcome"]), limits.get("dials", {}))
        yield GaugeMetricFamily("murmur_dials_backing_off", "peers whose last dial failed, waiting to be retried",
                                value=limits.get("dials_backing_off", 0))
        yield GaugeMetricFamily("murmur_view_overflow", "live peer records left out of the view by its cap",
                                value=limits.get("view_overflow", 0))
        yield from _reachability(s)


def _reachability(s: dict[str, Any]) -> Iterator[Metric]:
    """Connections to neighbours by kind, their goodput, and this node's reachability and relays."""
    others = [p for p in s["peers"] if p.get("connection")]
    connections = GaugeMetricFamily("murmur_peer_connections", "neighbours in view by how this node is connected "
                                    "to them", labels=["kind"])
    for kind in CONNECTION_KINDS:
        connections.add_metric([kind], sum(p["connection"] == kind for p in others))
    yield connections
    goodput = GaugeMetricFamily("murmur_peer_goodput_mbit_per_second", "how fast each neighbour's gossip payloads "
                                "arrived lately", labels=["peer_id", "kind"])
    for p in others:
        if p.get("goodput_mbit_s") is not None:
            goodput.add_metric([p["peer_id"], p["connection"]], p["goodput_mbit_s"])
    yield goodput
    reach = s.get("reachability") or {}
    if reach:
        yield InfoMetricFamily("murmur_reachability", "whether peers can dial this node directly (reach) and how it "
                               "was decided (mode)", value={"mode": reach["mode"], "reach": reach["reach"]})
    yield _optional(GaugeMetricFamily("murmur_relays_held", "relays holding a slot for this node (a probe came "
                                      "through their circuit)", labels=[]), reach.get("relays_held"))
    service = reach.get("relay_service") or {}
    in_force = service.get("limits_in_force")
    yield _optional(GaugeMetricFamily("murmur_relay_service_limits_in_force", "1 if a model-sized push went through "
                                      "a circuit of this node's relay service at start, 0 if it was cut; absent "
                                      "without a relay service", labels=[]),
                    None if in_force is None else int(in_force))


def resident_memory_bytes(statm: Path = Path("/proc/self/statm")) -> int | None:
    """This process's resident set in bytes (the second field of statm, in pages); None without /proc."""
    try:
        return int(statm.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _labelled(family: CounterMetricFamily, counts: dict[str, int]) -> CounterMetricFamily:
    for label, n in sorted(counts.items()):
        family.add_metric([label], n)
    return family


def _optional(family: GaugeMetricFamily, value: float | None) -> GaugeMetricFamily:
    if value is not None:  # an unknown figure is absent, not NaN, as Prometheus expects
        family.add_metric([], value)
    return family


def metrics_registry(source: MonitorSource, bad_requests: Callable[[], int],
                     refused: Callable[[], dict[str, int]] = dict) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(source, bad_requests, refused))
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
