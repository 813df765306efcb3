"""Who the monitor answers (node/monitor/access.py, the aiohttp app): Host names, the per-run POST token,
the cap on event-stream clients; and its topology, computed off the event loop and reused."""

from __future__ import annotations

import asyncio
import json
import re
import stat
import threading
import time
from typing import Any

import aiohttp
import pytest

from node.monitor import Counters, EventLog, HistoryRecorder, RoundGraphCache, start_monitor
from node.monitor.access import HostAllowlist, host_name, new_token, remove_token, token_matches, write_token
from topology import MembershipView, TopologySpec

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("header,name", [
    ("localhost:7690", "localhost"), ("LocalHost", "localhost"), ("[::1]:7690", "::1"), ("::1", "::1"),
    ("127.0.0.1:80", "127.0.0.1"), ("evil.example:7690", "evil.example"), ("evil.example", "evil.example"),
])
def test_the_host_header_names_a_host(header, name):
    assert host_name(header) == name


@pytest.mark.parametrize("configured,allowed,refused", [
    ("127.0.0.1", ["localhost:7690", "127.0.0.1:7690", "127.9.9.9:1", "[::1]:7690"],
     ["evil.example:7690", "10.0.0.5:7690", "localhost.evil.example", "", None, "127.0.0.1.nip.io:7690"]),
    ("node.lan", ["node.lan:7690", "NODE.LAN", "localhost"], ["evil.example:7690", "10.0.0.5:7690"]),
    ("10.0.0.5", ["10.0.0.5:7690", "localhost"], ["10.0.0.6:7690", "evil.example"]),
    # every interface: any address literal (the machine's own, however it is reached), no other name
    ("0.0.0.0", ["10.0.0.5:7690", "[fd00::5]:7690", "localhost"], ["evil.example:7690", "node.lan:7690"]),
])
def test_the_host_allowlist_is_loopback_and_the_configured_host(configured, allowed, refused):
    allowlist = HostAllowlist(configured)
    assert all(allowlist.allows(h) for h in allowed)
    assert not any(allowlist.allows(h) for h in refused)


def test_the_token_is_checked_in_full_and_written_for_this_user_only(tmp_path):
    assert token_matches("Bearer abc", "abc") and token_matches("bearer abc ", "abc")
    for header in (None, "", "abc", "Bearer ab", "Bearer abcd", "Basic abc", "Bearer"):
        assert not token_matches(header, "abc"), header
    path = write_token(tmp_path, "t1")
    assert path.read_text() == "t1\n" and stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)
    write_token(tmp_path, "t2")  # replaced whole, and 0600 again
    assert path.read_text() == "t2\n" and stat.S_IMODE(path.stat().st_mode) == 0o600
    remove_token(tmp_path, "t1")  # not this run's: kept
    assert path.exists()
    remove_token(tmp_path, "t2")
    assert not path.exists()


class Node:
    """A stand-in monitor source (NodeRuntime needs p2pd and a DHT)."""

    def __init__(self) -> None:
        self.history = HistoryRecorder()
        self.events = EventLog()
        self.record_ttl_s = 6.0
        self.evaluations = 0

    def status(self) -> dict[str, Any]:
        return {"peer_id": "me", "swarm": "s", "version": "0", "peers": [], "step": 0, "round": 0, "rounds_run": 0,
                "last_round_s": 0.0, "bytes_sent": 0, "bytes_received": 0, "errors": {}, "skipped": {},
                "mixing": {"rule": "adaptive_clip", "clipped": 0}, "gossip_from": 0, "loss": None, "val_loss": None, "tokens_per_s": None, "consensus_distance": None,
                "experts": [], "uptime_s": 1.0}

    def peers(self) -> list[dict[str, Any]]:
        return []

    def topology(self) -> dict[str, Any]:
        return {"rho": None, "nodes": [], "edges": []}

    async def refresh_topology(self) -> None:
        pass

    def counters(self) -> Counters:
        return Counters(step=0, round=0, bytes_sent=0, bytes_received=0, peers_alive=1)

    async def evaluate_swarm_average(self, save: bool = False) -> dict[str, Any]:
        self.evaluations += 1
        return {"loss": 1.0}


def test_a_fresh_token_is_256_bits_that_the_command_line_takes_as_a_value():
    from node.cli.main import build_parser

    parser = build_parser()
    tokens = {new_token() for _ in range(200)}
    assert len(tokens) == 200 and all(re.fullmatch(r"[0-9a-f]{64}", t) for t in tokens)
    for token in tokens:  # a url-safe token starts with "-" one time in 64: argparse took it for a flag
        args = parser.parse_args(["export", "--url", "http://127.0.0.1:1", "--token", token, "--to", "out"])
        assert args.token == token


def test_a_foreign_host_is_refused_for_every_endpoint_and_a_post_needs_the_token():
    async def main() -> None:
        node = Node()
        server = await start_monitor(node, "127.0.0.1", 0, interval_s=60, token="the-token")
        port = server.url.rsplit(":", 1)[1]
        evil = {"Host": f"evil.example:{port}"}
        try:
            async with aiohttp.ClientSession() as session:
                for path in ("/", "/api/status", "/api/topology", "/api/events", "/metrics", "/nope"):
                    async with session.get(server.url + path, headers=evil) as answer:
                        assert answer.status == 403, path
                        assert "evil.example" in (await answer.json())["error"]
                async with session.post(server.url + "/api/eval/average",
                                        headers={**evil, "Authorization": "Bearer the-token"}) as answer:
                    assert answer.status == 403  # the token does not make a foreign Host acceptable
                async with session.post(server.url + "/api/eval/average") as answer:
                    assert answer.status == 401 and answer.headers["WWW-Authenticate"] == "Bearer"
                    assert "monitor.token" in (await answer.json())["error"]
                async with session.post(server.url + "/api/eval/average",
                                        headers={"Authorization": "Bearer wrong"}) as answer:
                    assert answer.status == 401
                assert node.evaluations == 0
                async with session.post(server.url + "/api/eval/average",
                                        headers={"Authorization": "Bearer the-token"}) as answer:
                    assert answer.status == 200 and node.evaluations == 1
                async with session.post(server.url + "/api/status") as answer:
                    assert answer.status == 405  # a method no endpoint has: the router's answer, token or not
                async with session.get(server.url + "/api/status", headers={"Host": f"localhost:{port}"}) as answer:
                    assert answer.status == 200
                async with session.get(server.url + "/metrics") as answer:
                    text = await answer.text()
                assert 'murmur_monitor_refused_total{reason="host"} 7.0' in text
                assert 'murmur_monitor_refused_total{reason="token"} 2.0' in text
        finally:
            await server.close()

    asyncio.run(main())


def test_event_stream_clients_are_capped_and_a_closed_one_frees_its_place():
    async def main() -> None:
        server = await start_monitor(Node(), "127.0.0.1", 0, interval_s=0.2, max_event_clients=2)
        try:
            async with aiohttp.ClientSession() as session:
                first = await session.get(server.url + "/api/events")
                second = await session.get(server.url + "/api/events")
                assert first.status == second.status == 200
                async with session.get(server.url + "/api/events") as third:
                    assert third.status == 503 and third.headers["Retry-After"]
                first.close()  # the node notices at its next write (one interval)
                async with asyncio.timeout(5):
                    while True:
                        await asyncio.sleep(0.3)
                        async with session.get(server.url + "/api/events") as again:
                            if again.status == 200:
                                break
                second.close()
                # a page elsewhere cannot take the places: its cross-origin EventSource carries its Origin
                for _ in range(3):
                    async with session.get(server.url + "/api/events",
                                           headers={"Origin": "https://evil.example"}) as foreign:
                        assert foreign.status == 403 and "evil.example" in (await foreign.json())["error"]
                async with asyncio.timeout(5):  # the monitor's own page, same origin (once a place is free)
                    while True:
                        await asyncio.sleep(0.3)
                        async with session.get(server.url + "/api/events", headers={"Origin": server.url}) as own:
                            if own.status == 200:
                                break
                async with session.get(server.url + "/metrics") as answer:
                    text = await answer.text()
                    assert 'murmur_monitor_refused_total{reason="event_clients"}' in text
                    assert 'murmur_monitor_refused_total{reason="origin"} 3.0' in text
        finally:
            await server.close()

    asyncio.run(main())


def test_the_round_graph_is_computed_off_the_event_loop_and_only_when_its_inputs_change(monkeypatch):
    import node.monitor.topology_view as topology_view

    threads: list[int] = []
    real = topology_view.round_graph

    def recording(*args: Any, **kwargs: Any) -> dict[str, Any]:
        threads.append(threading.get_ident())
        if len(threads) == 1:
            # the first computation takes long enough to count the loop's ticks meanwhile: run on the
            # loop, it would let none through (a count, not a wall-clock gap: the machine may be loaded)
            time.sleep(0.3)
        return real(*args, **kwargs)

    monkeypatch.setattr(topology_view, "round_graph", recording)

    async def main() -> None:
        cache = RoundGraphCache()
        members = MembershipView.of(f"p{i:03d}" for i in range(160))
        spec = TopologySpec("complete")
        # the event loop keeps ticking while the graph of 160 peers is computed
        ticks: list[float] = []
        stop = asyncio.Event()

        async def ticker() -> None:
            while not stop.is_set():
                ticks.append(time.monotonic())
                await asyncio.sleep(0.005)

        ticking = asyncio.create_task(ticker())
        await asyncio.sleep(0)  # the ticker's first tick
        started = time.monotonic()
        await cache.refresh(members.peer_ids, members, spec, "p000", 7)
        ended = time.monotonic()
        stop.set()
        await ticking
        assert threads and threads[0] != threading.get_ident()
        # the loop was never held for the computation: it ticked all along (nominally 60 times)
        during = [t for t in ticks if started < t < ended]
        assert len(during) >= 5, (len(during), ended - started)
        graph = cache.latest(7)
        assert graph is not None and graph["rho"] is not None and len(graph["edges"]) == 160 * 159
        for round_index in (8, 9, 10):  # a static topology: the next rounds reuse it
            await cache.refresh(members.peer_ids, members, spec, "p000", round_index)
        assert cache.computed == 1 and cache.latest(10)["round"] == 10  # type: ignore[index]
        smaller = MembershipView.of(members.peer_ids[:-1])
        await cache.refresh(smaller.peer_ids, smaller, spec, "p000", 10)  # the view changed: computed again
        assert cache.computed == 2
        one_peer = TopologySpec("one-peer-exp")
        small = MembershipView.of(["a", "b", "c", "d"])
        for round_index in range(6):  # a schedule of period 2 over 4 peers: two graphs, then reuse
            await cache.refresh(small.peer_ids, small, one_peer, "a", round_index)
        assert cache.computed == 2 + 6  # the key changes every round (its place in the period) ...
        edges = {json.dumps(cache.latest(0)["edges"])}  # type: ignore[index]
        assert edges  # ... and each answer is that round's graph

    asyncio.run(main())
