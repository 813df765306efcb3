"""The monitor's parts in-process: the history ring buffer and what a sample holds, the event log,
the round graph with its weights and rho, the server's live updates over server-sent events, a
failing data source answered with 500 while the rest goes on, and NodeRuntime.record()."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import Any

import aiohttp
import numpy as np
import pytest

from node.config import NodeConfig
from node.monitor import Counters, EventLog, HistoryRecorder, MixingStepEstimate, round_graph, start_monitor
from node.monitor.eventlog import LogCapture, Snapshot, log_changes
from node.runtime.status import NodeRuntime
from topology import MembershipView, build_topology

pytestmark = pytest.mark.unit

COUNTERS = Counters(step=3, round=7, bytes_sent=100, bytes_received=50, peers_alive=2)


# ---- history --------------------------------------------------------------------------------------

def test_the_history_keeps_only_the_newest_samples_in_order():
    history = HistoryRecorder(capacity=5)
    for i in range(8):
        history.tick(Counters(step=i, round=i, bytes_sent=i, bytes_received=0, peers_alive=1), now=100.0 + i)
    assert [s.step for s in history.samples()] == [3, 4, 5, 6, 7]
    assert [s.step for s in history.samples(since=105.0)] == [6, 7]
    assert [s.step for s in history.samples(limit=2)] == [6, 7]


def test_a_sample_averages_the_losses_of_its_interval_and_rates_the_tokens():
    history = HistoryRecorder()
    history.tick(COUNTERS, now=10.0)
    for step, loss in enumerate((3.0, 2.0, 1.0), start=4):
        history.record(step=step, loss=loss, tokens=500)
    history.record(step=6, val_loss=2.5, consensus_distance=0.25)
    sample = history.tick(COUNTERS, now=12.0)
    assert sample.loss == pytest.approx(2.0)
    assert sample.val_loss == 2.5 and sample.consensus_distance == 0.25
    assert sample.tokens_per_s == pytest.approx(1500 / 2.0)
    assert sample.step == 6 and sample.round == 7 and sample.bytes_sent == 100
    # the next interval recorded nothing: no loss point, no validation point, zero throughput
    quiet = history.tick(COUNTERS, now=13.0)
    assert quiet.loss is None and quiet.val_loss is None and quiet.tokens_per_s == 0.0
    assert history.latest.loss == 1.0 and history.latest.val_loss == 2.5


def test_a_non_finite_figure_is_refused_whole_and_counted():
    history = HistoryRecorder()
    with pytest.raises(ValueError, match="loss is not finite"):
        history.record(step=1, loss=math.nan, tokens=100)
    with pytest.raises(ValueError, match="tokens"):
        history.record(step=1, loss=1.0, tokens=-1)
    assert history.rejected == 2 and history.latest.recorded == 0
    history.tick(COUNTERS, now=1.0)
    sample = history.tick(COUNTERS, now=2.0)
    assert sample.loss is None and sample.tokens_per_s is None
    json.dumps(sample.as_json(), allow_nan=False)  # what the API sends stays valid JSON


def test_without_record_calls_a_sample_takes_the_nodes_own_figures():
    history = HistoryRecorder()
    own = Counters(step=9, round=9, bytes_sent=0, bytes_received=0, peers_alive=3, loss=1.5, tokens_per_s=40.0,
                   consensus_distance=0.1, peer_loss={"peer-b": 1.7})
    sample = history.tick(own, now=1.0)
    assert (sample.loss, sample.tokens_per_s, sample.consensus_distance) == (1.5, 40.0, 0.1)
    assert sample.peer_loss == {"peer-b": 1.7}
    assert history.tick(own, now=2.0).loss is None  # no step since: no new loss point


def test_the_mixing_step_estimate_is_per_round_and_idempotent_between_rounds():
    estimate = MixingStepEstimate()
    x0 = np.array([3.0, 4.0], np.float32)
    assert estimate.update(0, x0) is None
    assert estimate.update(2, np.zeros(2, np.float32)) == pytest.approx(5.0 / 2)  # two rounds moved it by 5
    assert estimate.update(2, np.zeros(2, np.float32)) == pytest.approx(2.5)  # same round: same value
    assert estimate.update(3, np.zeros(2, np.float32)) == 0.0  # consensus: mixing no longer moves it


# ---- event log ------------------------------------------------------------------------------------

def test_changes_between_snapshots_become_log_entries():
    log = EventLog(capacity=50)
    before = Snapshot(frozenset({"a", "b"}), {"timeout": 1}, {}, 0)
    after = Snapshot(frozenset({"b", "c"}), {"timeout": 3, "bad_schema": 1}, {"stale": 2}, 12)
    log_changes(log, None, before, now=1.0)  # the first snapshot is the baseline, not news
    assert log.entries() == []
    log_changes(log, before, after, now=2.0)
    kinds = [(e.kind, e.message) for e in log.entries()]
    assert ("peer_joined", "peer c joined") in kinds
    assert any(k == "peer_left" and "peer a" in m for k, m in kinds)
    assert ("error", "timeout: 2 more (total 3)") in kinds and ("error", "bad_schema: 1 more (total 1)") in kinds
    assert any(k == "skipped" and "stale" in m for k, m in kinds)
    assert ("gossip_started", "announced gossip from round 12") in kinds
    last = log.entries()[-1].id
    log.add(3.0, "info", "log", "later")
    assert [e.message for e in log.entries(after=last)] == ["later"]


def test_the_log_is_bounded_and_captures_only_the_nodes_own_warnings():
    log = EventLog(capacity=3)
    capture = LogCapture(log)
    loggers = [logging.getLogger(name) for name in ("murmur.test_monitor", "gossip.test_monitor", "hivemind.test_monitor")]
    for logger in loggers:
        logger.setLevel(logging.DEBUG)
        logger.addHandler(capture)
    try:
        loggers[0].warning("careful %s", 1)
        loggers[1].error("broken")
        loggers[2].warning("not ours")
        loggers[0].info("too small to show")
    finally:
        for logger in loggers:
            logger.removeHandler(capture)
    assert [(e.level, e.message) for e in log.entries()] == [
        ("warning", "murmur.test_monitor: careful 1"), ("error", "gossip.test_monitor: broken")]
    for i in range(5):
        log.add(float(i), "info", "log", str(i))
    assert [e.message for e in log.entries()] == ["2", "3", "4"]


# ---- round graph ----------------------------------------------------------------------------------

def test_the_round_graph_carries_the_topologys_edges_weights_and_rho():
    members = MembershipView.of(["p1", "p2", "p3"])
    ring = build_topology("ring", 3)
    graph = round_graph(["p1", "p2", "p3", "late"], members, ring, "p2", round_index=5)
    w = ring.mixing_matrix(5)
    assert graph["rho"] == pytest.approx(ring.rho) and graph["topology"] == "ring"
    assert {(e["source"], e["target"]) for e in graph["edges"]} == {
        (a, b) for a in members.peer_ids for b in members.peer_ids if a != b}
    for e in graph["edges"]:
        i, j = members.rank_of(e["target"]), members.rank_of(e["source"])
        assert e["weight"] == pytest.approx(w[i, j])
    assert graph["self_weight"] == pytest.approx(w[1, 1])
    ranks = {n["peer_id"]: n["rank"] for n in graph["nodes"]}
    assert ranks == {"p1": 0, "p2": 1, "p3": 2, "late": None}  # in view, not in this round
    assert [n["peer_id"] for n in graph["nodes"] if n["self"]] == ["p2"]


def test_a_time_varying_graph_changes_with_the_round_and_none_before_gossip():
    members = MembershipView.of(f"p{i}" for i in range(4))
    one_peer = build_topology("one-peer-exp", 4)
    edges = [{(e["source"], e["target"]) for e in round_graph(members.peer_ids, members, one_peer, "p0", r)["edges"]}
             for r in (0, 1)]
    assert edges[0] and edges[1] and edges[0] != edges[1]
    idle = round_graph(["p0", "p1"], MembershipView.of([]), None, "p0", 0)
    assert idle["edges"] == [] and idle["rho"] is None and len(idle["nodes"]) == 2


# ---- the server -----------------------------------------------------------------------------------

class FakeNode:
    """Stands in for NodeRuntime, which needs p2pd and a DHT; the server and sampler are the real ones."""

    def __init__(self) -> None:
        self.history = HistoryRecorder()
        self.events = EventLog()
        self.record_ttl_s = 6.0
        self.view = ["me"]
        self.failing_topology = False

    def status(self) -> dict[str, Any]:
        return {"peer_id": "me", "swarm": "s", "version": "0", "peers": [{"peer_id": p} for p in self.view],
                "step": 0, "round": 0, "rounds_run": 0, "last_round_s": 0.0, "bytes_sent": 0, "bytes_received": 0,
                "errors": {}, "skipped": {}, "mixing": {"rule": "adaptive_clip", "clipped": 0}, "gossip_from": 0, "loss": None, "val_loss": None, "tokens_per_s": None,
                "consensus_distance": None, "experts": [], "uptime_s": 1.0}

    def peers(self) -> list[dict[str, Any]]:
        return [{"peer_id": p, "self": p == "me"} for p in self.view]

    def topology(self) -> dict[str, Any]:
        if self.failing_topology:
            raise RuntimeError("broken on purpose")
        return {"rho": None, "nodes": [{"peer_id": p} for p in self.view], "edges": []}

    async def refresh_topology(self) -> None:
        pass

    def counters(self) -> Counters:
        return Counters(step=0, round=0, bytes_sent=0, bytes_received=0, peers_alive=len(self.view))


async def next_update(lines: aiohttp.StreamReader) -> dict:
    while True:
        line = (await lines.readline()).decode()
        if not line:
            raise ConnectionError("the event stream ended")
        if line.startswith("data: "):
            return json.loads(line[len("data: "):])


def test_server_sent_events_carry_a_change_within_the_next_interval():
    async def main() -> None:
        node = FakeNode()
        server = await start_monitor(node, "127.0.0.1", 0, interval_s=0.2)
        try:
            async with aiohttp.ClientSession() as session, session.get(f"{server.url}/api/events") as events:
                assert events.headers["Content-Type"].startswith("text/event-stream")
                async with asyncio.timeout(5):
                    first = await next_update(events.content)
                assert [p["peer_id"] for p in first["peers"]] == ["me"]
                node.view = ["me", "other"]
                async with asyncio.timeout(2):
                    while True:
                        update = await next_update(events.content)
                        if len(update["peers"]) == 2:
                            break
                assert any(e["kind"] == "peer_joined" for e in update["log"])
                assert update["sample"]["peers_alive"] == 2
        finally:
            await server.close()

    asyncio.run(main())


def test_a_failing_source_answers_500_and_everything_else_goes_on():
    async def main() -> None:
        node = FakeNode()
        server = await start_monitor(node, "127.0.0.1", 0, interval_s=0.1)
        try:
            node.failing_topology = True
            async with aiohttp.ClientSession() as session:
                async with session.get(f"{server.url}/api/topology") as broken:
                    assert broken.status == 500 and (await broken.json())["status"] == 500
                await asyncio.sleep(0.35)  # a few sampler ticks fail meanwhile
                assert server.sampler.failures >= 2
                node.failing_topology = False
                before = len(node.history.samples())
                await asyncio.sleep(0.35)
                assert len(node.history.samples()) > before  # the sampler went on
                async with session.get(f"{server.url}/api/status") as status:
                    assert status.status == 200 and (await status.json())["peer_id"] == "me"
        finally:
            await server.close()

    asyncio.run(main())


def test_closing_ends_open_event_streams_and_frees_the_port():
    async def main() -> None:
        server = await start_monitor(FakeNode(), "127.0.0.1", 0, interval_s=0.2)
        async with aiohttp.ClientSession() as session, session.get(f"{server.url}/api/events") as events:
            async with asyncio.timeout(5):
                await next_update(events.content)
                await server.close()  # within its own 5 s bound, with a client still attached
                with pytest.raises((ConnectionError, aiohttp.ClientError)):
                    while True:
                        await next_update(events.content)
        with pytest.raises(aiohttp.ClientConnectionError):
            async with aiohttp.ClientSession() as session, session.get(f"{server.url}/api/status"):
                pass

    asyncio.run(main())


# ---- NodeRuntime.record ---------------------------------------------------------------------------

def test_node_runtime_records_training_figures_and_counts_bad_ones():
    runtime = NodeRuntime(NodeConfig(), founding=True)
    assert runtime.status()["loss"] is None
    runtime.record(step=1, loss=2.5, tokens=64)
    runtime.record(step=2, loss=float("inf"), tokens=64)  # refused, counted, and training goes on
    status = runtime.status()
    assert status["loss"] == 2.5 and status["errors"] == {"monitor_bad_record": 1}
    json.dumps(status, allow_nan=False)


def test_the_docs_name_every_metric_and_endpoint():
    from pathlib import Path

    from node.monitor.metrics import METRIC_NAMES
    from node.monitor.schemas import JSON_ENDPOINTS

    page = (Path(__file__).resolve().parents[1] / "docs" / "monitor.md").read_text()
    missing = [name for name in METRIC_NAMES if f"`{name}" not in page]
    missing += [path for path in JSON_ENDPOINTS if f"`GET {path}`" not in page]
    assert missing == [], f"docs/monitor.md does not document {missing}"
