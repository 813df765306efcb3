"""The swarm page's data and the contributors behind the export's card (issue 27, items 3 and 5): the work
summary a peer record carries is bounded at decode, claimed tokens are clipped to what the claimed step
allows and counted, the contributor table stays bounded, and `/api/swarm` answers with its schema: every
peer's row, its share and score, and the swarm's loss and throughput over time."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
import msgspec
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time
from test_monitor_node import schema_errors

from gossip.scoring import ScoreState
from node.monitor import Counters, EventLog, HistoryRecorder, start_monitor
from node.monitor.schemas import schema
from node.monitor.swarm_view import SwarmHistory, contribution_points, swarm_peers
from node.net.discovery import Discovery, DiscoverySettings
from node.net.identity import Identity, create_identity
from node.net.records import PeerRecord, ReachedVia, decode_peer_entry, encode_peer_record, peers_key
from node.swarm.contributors import (
    MAX_TOKENS,
    ContributorTable,
    parse_contributors,
    plausible_tokens,
    tokens_from_meta,
)
from node.swarm.joining import plausible_steps
from node.swarm.recipe import TrainingRecipe

pytestmark = pytest.mark.unit

PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def record(**fields: Any) -> PeerRecord:
    base: dict[str, Any] = {"peer_id": PEER, "maddrs": (f"/ip4/127.0.0.1/tcp/1/p2p/{PEER}",), "step": 10, "round": 1,
                            "experts": (), "capacity": 0, "version": "t", "heartbeat": 1.0}
    return PeerRecord(**{**base, **fields})


def raw_with(**fields: Any) -> bytes:
    """A record's bytes with some fields overwritten by anything, as a hostile peer could publish."""
    value = msgspec.to_builtins(record())
    value.update(fields)
    return msgspec.msgpack.encode(value)


# ---- the record -------------------------------------------------------------------------------------

def test_a_records_work_summary_round_trips_and_out_of_bounds_values_refuse_the_record() -> None:
    mine = record(tokens=6400, tokens_per_s=812.5, uptime_s=3600.0, reach="relayed")
    back = decode_peer_entry(encode_peer_record(mine))
    assert back == mine and ReachedVia.of(back.reach) is ReachedVia.RELAYED
    assert len(encode_peer_record(mine)) - len(encode_peer_record(record())) < 80  # the summary stays small
    for bad in ({"tokens": -1}, {"tokens": MAX_TOKENS + 1}, {"tokens": "many"}, {"tokens_per_s": float("nan")},
                {"tokens_per_s": -0.5}, {"tokens_per_s": 1e12}, {"uptime_s": float("inf")}, {"uptime_s": -1.0},
                {"reach": "x" * 17}, {"reach": "Direct"}, {"reach": 7}):
        with pytest.raises(ValueError, match="malformed"):
            decode_peer_entry(raw_with(**bad))


def test_older_and_newer_peers_read_each_others_records() -> None:
    class OlderRecord(msgspec.Struct):  # a peer record as murmur had it before the summary
        peer_id: str
        step: int
        loss: float | None = None

    older = msgspec.msgpack.decode(encode_peer_record(record(tokens=5, reach="direct")), type=OlderRecord)
    assert older.peer_id == PEER and older.step == 10  # the new fields are ignored
    old_bytes = msgspec.msgpack.encode({k: v for k, v in msgspec.to_builtins(record()).items()
                                        if k not in ("tokens", "tokens_per_s", "uptime_s", "reach")})
    read = decode_peer_entry(old_bytes)
    assert (read.tokens, read.tokens_per_s, read.uptime_s, ReachedVia.of(read.reach)) == (0, 0.0, 0.0, ReachedVia.UNKNOWN)
    # a kind some newer murmur publishes does not cost the record
    assert ReachedVia.of(decode_peer_entry(raw_with(reach="carrierpigeon")).reach) is ReachedVia.UNKNOWN
    assert ReachedVia.from_reach("public") is ReachedVia.DIRECT and ReachedVia.from_reach("private") is ReachedVia.RELAYED


# ---- clipping in the view ----------------------------------------------------------------------------

class StandInDht:
    """Answers Discovery's `get(key, latest=True)` with fixed subkey values (see tests/test_discovery_reads.py)."""

    def __init__(self, values: Mapping[str, Mapping[bytes, bytes]]) -> None:
        self.values = values

    async def get(self, key: str, latest: bool = False) -> ValueWithExpiration | None:
        expires = get_dht_time() + 30
        found = self.values.get(key)
        return None if found is None else ValueWithExpiration(
            {sub: ValueWithExpiration(value, expires) for sub, value in found.items()}, expires)


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Identity]:
    directory = tmp_path_factory.mktemp("ids")
    return {name: create_identity(directory / f"{name}.key") for name in ("me", "honest", "boaster", "liar")}


def test_a_view_read_clips_tokens_beyond_step_times_tokens_per_step_and_counts_them(ids) -> None:
    me, honest, boaster = ids["me"], ids["honest"], ids["boaster"]

    def claim(identity: Identity, step: int, tokens: int) -> tuple[bytes, bytes]:
        signer = RSASignatureValidator(identity.signing_key)
        value = encode_peer_record(record(peer_id=identity.peer_id, step=step, tokens=tokens,
                                          maddrs=(f"/ip4/127.0.0.1/tcp/1/p2p/{identity.peer_id}",)))
        return signer.local_public_key, value

    swarm = "summary"
    dht = StandInDht({peers_key(swarm): dict([claim(honest, 10, 640), claim(boaster, 10, 10**12)])})
    discovery = Discovery(None, me, DiscoverySettings(swarm, request_timeout_s=0.5),  # type: ignore[arg-type]
                          data_maddrs=(f"/ip4/127.0.0.1/tcp/1/p2p/{me.peer_id}",))
    discovery._dht = dht  # type: ignore[assignment]
    discovery._tokens_per_step = 64  # what enter() takes from the swarm's recipe (batch x context x micro-batches)
    asyncio.run(discovery._refresh_view())
    tokens = {r.peer_id: r.tokens for r in discovery.view()}
    assert tokens[honest.peer_id] == 640  # exactly 10 steps of 64: believed
    assert tokens[boaster.peer_id] == 640  # a trillion after 10 steps: held to what 10 steps allow
    assert discovery.errors.get("peer_record_tokens_clipped") == 1
    assert plausible_tokens(100, 0, 64) == 0 and plausible_tokens(10**20, 10**18, 64) == MAX_TOKENS
    # a claimed step is held too: to the recipe's budget, and to what the swarm can have run since its founding
    liar = ids["liar"]
    dht.values[peers_key(swarm)] = dict([claim(liar, 2**62, 10**15)])  # type: ignore[index]
    founded = time.time()
    discovery._epoch = founded  # what enter() takes from the swarm's config; no step budget
    asyncio.run(discovery._refresh_view())
    claimed = {r.peer_id: r.tokens for r in discovery.view()}[liar.peer_id]
    assert plausible_steps(founded, founded) * 64 <= claimed <= plausible_steps(founded, time.time()) * 64
    discovery._step_budget, discovery._epoch = 1000, founded - 10**6  # an old swarm: its budget bounds the claim
    asyncio.run(discovery._refresh_view())
    assert {r.peer_id: r.tokens for r in discovery.view()}[liar.peer_id] == 1000 * 64
    # a restarted node takes its own count back from its checkpoint, held to its step the same way
    assert tokens_from_meta("640", 10, 64) == 640 and tokens_from_meta(10**9, 10, 64) == 640
    assert tokens_from_meta(None, 10, 64) == 0 and tokens_from_meta("lots", 10, 64) == 0


# ---- the contributor table ---------------------------------------------------------------------------

def test_the_contributor_table_keeps_the_highest_claims_of_at_most_cap_peers_evicting_the_smallest() -> None:
    table = ContributorTable(cap=3)
    for peer, tokens in [("a", 100), ("b", 50), ("c", 70), ("a", 40), ("b", 60)]:
        table.observe(peer, tokens)
    assert table.as_dict() == {"a": 100, "b": 60, "c": 70}  # a's later, lower figure does not lower it
    table.observe("d", 10)  # smaller than everyone kept: refused
    table.observe("e", 65)  # evicts the smallest (b, 60)
    assert table.as_dict() == {"a": 100, "c": 70, "e": 65} and table.evicted == 2
    table.observe("f", 0)
    table.observe("", 10**6)
    assert len(table) == 3
    # what the checkpoint carries reads back the same, and garbage in a file is left out
    assert ContributorTable.from_meta(table.to_meta(), cap=3).as_dict() == table.as_dict()
    assert parse_contributors(json.dumps({"a": 5, "b": -1, "c": "x", "d": True, "e": 2**70})) == {"a": 5, "e": MAX_TOKENS}
    assert parse_contributors("not json") == {} and parse_contributors(None) == {}
    # the same claims in any order leave the same table on every node
    claims = [("p", 5), ("q", 5), ("r", 5), ("s", 5)]
    tables = [ContributorTable(cap=2), ContributorTable(cap=2)]
    for peer, tokens in claims:
        tables[0].observe(peer, tokens)
    for peer, tokens in reversed(claims):
        tables[1].observe(peer, tokens)
    assert tables[0].as_dict() == tables[1].as_dict()
    assert [c.peer_id for c in table.ranked()] == ["a", "c", "e"]


# ---- the swarm view ----------------------------------------------------------------------------------

PEERS = [
    {"peer_id": "me", "self": True, "step": 12, "loss": 2.0, "tokens": 300, "tokens_per_s": 100.0, "uptime_s": 60.0,
     "reach": "unknown", "connection": None},
    {"peer_id": "p1", "self": False, "step": 11, "loss": 3.0, "tokens": 100, "tokens_per_s": 50.0, "uptime_s": 30.0,
     "reach": "direct", "connection": "direct"},
    {"peer_id": "p2", "self": False, "step": 0, "loss": None, "tokens": 0, "tokens_per_s": 0.0, "uptime_s": 1.0,
     "reach": "relayed", "connection": "relayed"},
]


def test_the_swarm_rows_share_the_points_and_show_scores_only_where_the_status_has_them() -> None:
    scores = {"p1": {"score": 0.75, "rated_rounds": 4, "state": "down_weighted"}, "p2": {"score": "high"}}
    rows = {r.peer_id: r for r in swarm_peers(PEERS, scores)}
    # points: me unrated (300), p1 rated 0.75 (75 of its 100 tokens), p2 nothing trained
    assert [rows[p].points for p in ("me", "p1", "p2")] == [300.0, 75.0, 0.0]
    assert [rows[p].share for p in ("me", "p1", "p2")] == [0.8, 0.2, 0.0]
    assert [r.share for r in swarm_peers(PEERS, None)] == [0.75, 0.25, 0.0]  # no scores: the tokens' shares
    assert (rows["p1"].score, rows["p1"].rated_rounds, rows["p1"].score_state) == (0.75, 4, "down_weighted")
    assert rows["p2"].score is None and rows["me"].score is None  # a malformed entry, and no entry
    assert all(r.score is None for r in swarm_peers(PEERS, None))  # no contribution key at all
    history = SwarmHistory(capacity=3)
    for t in range(5):
        point = history.tick(list(rows.values()), float(t))
    assert [p.t for p in history.points()] == [2.0, 3.0, 4.0] and [p.t for p in history.points(limit=1)] == [4.0]
    assert (point.loss, point.tokens_per_s, point.tokens, point.peers) == (2.5, 150.0, 400, 3)


class SwarmNode:
    """The monitor's source with a fixed view of three peers and, once set, contribution scores."""

    def __init__(self) -> None:
        self.history = HistoryRecorder()
        self.events = EventLog()
        self.record_ttl_s = 6.0
        self.contribution: dict[str, Any] | None = None

    def status(self) -> dict[str, Any]:
        status = {"peer_id": "me", "peers": [{"peer_id": p["peer_id"]} for p in PEERS], "errors": {}, "skipped": {},
                  "gossip_from": 0}
        if self.contribution is not None:
            status["contribution"] = self.contribution
        return status

    def peers(self) -> list[dict[str, Any]]:
        return [dict(p) for p in PEERS]

    def topology(self) -> dict[str, Any]:
        return {"nodes": [], "edges": []}

    async def refresh_topology(self) -> None:
        pass

    def counters(self) -> Counters:
        return Counters(step=12, round=1, bytes_sent=0, bytes_received=0, peers_alive=3)


def test_a_swarm_point_over_huge_published_figures_stays_finite_json() -> None:
    """Each record's loss and rate are finite, but two near the float maximum once summed to inf, and the
    page's JSON (no NaN or inf) then failed every sample while that point stayed in the history."""
    from node.monitor.swarm_view import swarm_point

    peers = [{"peer_id": f"p{i}", "step": 1, "loss": 1.7e308, "tokens_per_s": 1.7e308, "tokens": 1} for i in range(3)]
    point = swarm_point(swarm_peers(peers), 0.0)
    assert point.loss == pytest.approx(1.7e308) and point.tokens_per_s == 0.0  # the sum overflows: no figure
    json.dumps(msgspec.to_builtins(point), allow_nan=False)
    honest = swarm_point(swarm_peers([{"peer_id": "a", "loss": 2.0, "tokens_per_s": 10.0},
                                      {"peer_id": "b", "loss": 3.0, "tokens_per_s": 30.0}]), 0.0)
    assert (honest.loss, honest.tokens_per_s) == (2.5, 40.0)


def test_api_swarm_answers_with_its_schema_and_the_event_stream_carries_each_new_point() -> None:
    async def main() -> None:
        node = SwarmNode()
        server = await start_monitor(node, "127.0.0.1", 0, interval_s=0.1)
        try:
            async with aiohttp.ClientSession() as session:
                async with asyncio.timeout(10):
                    while len(server.sampler.swarm.points()) < 3:
                        await asyncio.sleep(0.05)
                node.contribution = {"p1": {"score": 1.5, "rated_rounds": 2, "state": "rated"}}
                async with session.get(f"{server.url}/api/swarm?limit=2") as answer:
                    assert answer.status == 200
                    doc = await answer.json()
                async with session.get(f"{server.url}/api/swarm?limit=0") as bad:
                    assert bad.status == 400
                async with session.get(f"{server.url}/api/openapi.json") as openapi:
                    assert "/api/swarm" in (await openapi.json())["paths"]
            assert schema_errors(doc, schema("swarm")) == []
            assert doc["self"] == "me" and len(doc["history"]) == 2
            assert [p["peer_id"] for p in doc["peers"]] == ["me", "p1", "p2"]
            assert (doc["loss"], doc["tokens_per_s"], doc["tokens"]) == (2.5, 150.0, 400)
            assert [p["score"] for p in doc["peers"]] == [None, 1.5, None]
            message = json.loads(server.sampler.message)
            assert schema_errors(message["swarm"], schema("swarm")) == [] and len(message["swarm"]["history"]) == 1
        finally:
            await server.close()

    asyncio.run(main())


@pytest.mark.parametrize(("score", "state", "points"), [
    (None, None, 200.0), (1.0, ScoreState.RATED, 200.0), (1.7, ScoreState.RATED, 200.0),
    (0.5, ScoreState.DOWN_WEIGHTED, 100.0), (-0.3, ScoreState.RATED, 0.0), (0.9, ScoreState.EXCLUDED, 0.0),
    (None, ScoreState.EXCLUDED, 0.0)])
def test_contribution_points_weigh_tokens_by_the_score_and_give_an_excluded_peer_none(score, state, points) -> None:
    assert contribution_points(200, score, state) == points


def test_tokens_per_second_spans_a_whole_phase_so_a_diloco_sync_step_does_not_read_as_the_rate() -> None:
    from node.swarm.loop import THROUGHPUT_MAX_STEPS, THROUGHPUT_MIN_STEPS, throughput_window, tokens_per_second
    from node.swarm.recipe import optimizer_config

    def window(local_steps: int) -> int:
        return throughput_window(TrainingRecipe(model="dense", seed=1, batch_size=2, context=128, steps=0,
                                                optimizer=optimizer_config("dadam", 1e-3, 0, 0, local_steps, 1)))

    assert (window(1), window(25), window(10**6)) == (THROUGHPUT_MIN_STEPS, 25, THROUGHPUT_MAX_STEPS)
    # nine 1 s inner steps and the step that ends the phase, which waited 31 s for the outer exchange:
    # 256 tokens a step over the phase's 40 s, not the 8 tokens/s of the last step alone
    phase = [1.0] * 9 + [31.0]
    assert tokens_per_second(256, phase) == pytest.approx(256 * 10 / 40)
    assert tokens_per_second(256, phase[:1]) == pytest.approx(256.0)
    assert tokens_per_second(256, []) == 0.0 and tokens_per_second(256, [0.0, -1.0]) == 0.0
