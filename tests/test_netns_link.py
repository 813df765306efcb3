"""Two `murmur` nodes on two "hosts" (network namespaces joined by a veth pair, rate-limited to
100 Mbit/s with tc tbf): they find each other across the link, their gossip exchange completes, and
its goodput is measured from what the nodes themselves report and printed; on either data-plane backend.

Needs root, `ip` and `tc` (as in CI); a kernel without the tbf qdisc fails the test, it does not skip.
All traffic stays inside the two namespaces: p2pd listens on the link's 10.77.x.y addresses and each
monitor on 127.0.0.1 of its own namespace.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from node.net.proc import popen
from node.runtime.ready_line import find_ready_line
from support.netns import VethLink, remove_orphaned_namespaces, veth_link

pytestmark = pytest.mark.multiprocess

MURMUR = str(Path(sys.executable).with_name("murmur"))
LINK_MBIT = 100
DIM = 3_000_000  # 12 MB of float32 per vector: unshaped, p2pd moves that in ~0.1 s, so the link decides
PAYLOAD_BYTES = 4 * DIM
# With two peers the one-peer exponential graph pairs them every round: one stream carries the
# request with one vector and the reply with the other at once (a duplex exchange), so a round moves
# 12 MB each way over the link (about 1 s at 100 Mbit/s).
ROUND_INTERVAL_S = 3.0
EXCHANGE_TIMEOUT_S = 20.0
READY_TIMEOUT_S = 60.0
ROUNDS_TIMEOUT_S = 60.0
ROUNDS_WANTED = 3  # the best of them is reported: CPU starvation on a shared machine only slows rounds
STATUS_TIMEOUT_S = 5.0
TRANSIENT_DHT_ERRORS = frozenset({"dht_store_rejected", "dht_store_timeout", "dht_get_timeout"})
MAX_DHT_MISSES = 3  # of the ~20 heartbeats and ~40 view reads a node makes while watched


@dataclass(frozen=True)
class NodeProcess:
    side: int
    process: subprocess.Popen
    log: Path

    def log_tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass(frozen=True)
class ReadyNode:
    node: NodeProcess
    peer_id: str
    monitor_url: str
    maddrs: tuple[str, ...]
    invite: str


def start_node(link: VethLink, side: int, command: str, data_dir: Path, *args: str) -> NodeProcess:
    log = data_dir.with_suffix(".log")
    argv = [MURMUR, command, "--listen", link.tcp_maddr(side), "--data-dir", str(data_dir), "--monitor-port", "0",
            "--seed", str(side + 1), "--min-peers", "2", "--heartbeat", "1", "--exchange-timeout",
            str(EXCHANGE_TIMEOUT_S), *args]
    with log.open("wb") as out:
        process = popen(link.command(side, argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return NodeProcess(side, process, log)


def wait_ready(node: NodeProcess) -> ReadyNode:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        found = find_ready_line(node.log.read_text(errors="replace"))
        if found:
            return ReadyNode(node, found.peer_id, found.monitor_url, found.maddrs, found.invite)
        if node.process.poll() is not None:
            pytest.fail(f"node {node.side} exited with {node.process.returncode}:\n{node.log_tail()}")
        time.sleep(0.2)
    pytest.fail(f"node {node.side} not ready within {READY_TIMEOUT_S:g} s:\n{node.log_tail()}")


def fetch_status(link: VethLink, ready: ReadyNode) -> dict:
    """The node's /api/status, read from inside its namespace (its monitor is on that 127.0.0.1)."""

    def get() -> dict:
        with urllib.request.urlopen(f"{ready.monitor_url}/api/status", timeout=STATUS_TIMEOUT_S) as response:
            return json.load(response)

    try:
        return link.call_inside(ready.node.side, get)
    except OSError as exc:
        pytest.fail(f"status of node {ready.node.side} unreadable: {exc}\n{ready.node.log_tail()}")


def stop(nodes: list[NodeProcess]) -> None:
    """SIGTERM all at once (each writes its final checkpoint), then wait; SIGKILL what hangs."""
    for node in nodes:
        if node.process.poll() is None:
            node.process.send_signal(signal.SIGTERM)
    for node in nodes:
        try:
            node.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            node.process.kill()
            node.process.wait(timeout=10)


def watch_rounds(link: VethLink, nodes: list[ReadyNode]) -> tuple[dict[str, float], list[float], dict[str, dict],
                                                                 dict[str, set[str]]]:
    """Poll both nodes until each ran ROUNDS_WANTED rounds: their initial payload norms, the round
    times the initiator (smaller id) reported, the final statuses, and the peers each node's view held
    in any poll (a heartbeat that misses on the saturated link can lapse a record for a moment)."""
    initial = {r.peer_id: fetch_status(link, r)["payload"]["norm"] for r in nodes}
    initiator = min(nodes, key=lambda r: r.peer_id)
    round_times: dict[int, float] = {}
    seen: dict[str, set[str]] = {r.peer_id: set() for r in nodes}
    deadline = time.monotonic() + ROUNDS_TIMEOUT_S
    while True:
        status = {r.peer_id: fetch_status(link, r) for r in nodes}
        for pid, s in status.items():
            seen[pid].update(p["peer_id"] for p in s["peers"])
        mine = status[initiator.peer_id]
        if mine["rounds_run"]:
            round_times[mine["rounds_run"]] = mine["last_round_s"]
        if all(s["rounds_run"] >= ROUNDS_WANTED for s in status.values()):
            return initial, [round_times[k] for k in sorted(round_times)], status, seen
        if time.monotonic() > deadline:
            logs = "\n".join(f"node {r.node.side}:\n{r.node.log_tail()}" for r in nodes)
            progress = {pid[-6:]: (s["rounds_run"], s["skipped"], s["errors"]) for pid, s in status.items()}
            pytest.fail(f"fewer than {ROUNDS_WANTED} rounds each within {ROUNDS_TIMEOUT_S:g} s: {progress}\n{logs}")
        for r in nodes:
            assert r.node.process.poll() is None, f"node {r.node.side} died:\n{r.node.log_tail()}"
        time.sleep(0.25)


@pytest.mark.parametrize("transport", ["p2pd", "libp2p"])
def test_two_nodes_exchange_across_a_rate_limited_link(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                       transport: str) -> None:
    swarm = f"netns-{os.getpid()}"
    started: list[NodeProcess] = []
    # Both ends shaped, so the link is 100 Mbit/s each way: the pair's exchange sends one vector each
    # way at once, and the round time then measures the link in both directions together.
    with veth_link("t", rate_mbit=LINK_MBIT, limited_sides=(0, 1)) as link:
        try:
            started.append(start_node(link, 0, "node", tmp_path / "founder", "--swarm", swarm, "--model", "vector",
                                      "--dim", str(DIM), "--round-interval", str(ROUND_INTERVAL_S),
                                      "--transport", transport))
            founder = wait_ready(started[0])
            link_maddrs = [m for m in founder.maddrs if m.startswith(f"/ip4/{link.addresses[0]}/")]
            assert link_maddrs, f"the founder announces no address on the link: {founder.maddrs}"
            started.append(start_node(link, 1, "join", tmp_path / "joiner", "--invite", founder.invite,
                                      "--peers", link_maddrs[0], "--transport", transport))
            joiner = wait_ready(started[1])
            initial, rounds, final, seen = watch_rounds(link, [founder, joiner])
        finally:
            stop(started)

    for pid, s in final.items():
        other = next(p for p in final if p != pid)
        assert other in seen[pid], f"{pid} never saw {other} across the link"
        # A DHT heartbeat shares the saturated link with the vectors (on p2pd, the very same connection),
        # so one can now and then miss its 2 s RPC timeout; the next beat stores the record again, so a
        # view may lack the other node at one poll but not at every poll. Anything else is a failure.
        exchange_errors = {k: n for k, n in s["errors"].items() if k not in TRANSIENT_DHT_ERRORS}
        dht_misses = sum(n for k, n in s["errors"].items() if k in TRANSIENT_DHT_ERRORS)
        assert exchange_errors == {} and s["skipped"] == {}, f"{pid}: errors {s['errors']}, skipped {s['skipped']}"
        assert dht_misses <= MAX_DHT_MISSES, f"{pid}: the DHT missed {dht_misses} times: {s['errors']}"
        assert s["bytes_received"] >= ROUNDS_WANTED * PAYLOAD_BYTES, s["bytes_received"]
        assert s["maddrs"] and all(m.startswith("/ip4/10.77.") for m in s["maddrs"]), s["maddrs"]
    # The vectors crossed: two independent random vectors, averaged by the pair, become equal and about
    # 1/sqrt(2) as long.
    norms = [s["payload"]["norm"] for s in final.values()]
    assert norms[0] == pytest.approx(norms[1], rel=1e-6)
    assert all(norms[0] < 0.8 * n for n in initial.values()), (initial, norms)

    # The smaller id opens the stream: its round is the request and the reply across the link at once, then the mix.
    best_round_s = min(rounds)
    goodput_mbit = PAYLOAD_BYTES * 8 / best_round_s / 1e6  # each way: both vectors cross at once
    with capsys.disabled():
        print(f"\n[netns link, {transport}] rounds of {PAYLOAD_BYTES / 1e6:.0f} MB each way took "
              f"{', '.join(f'{r:.2f}' for r in rounds)} s; best: goodput {goodput_mbit:.1f} Mbit/s "
              f"= {goodput_mbit / LINK_MBIT:.2f} of the {LINK_MBIT} Mbit/s link")
    assert 0.5 * LINK_MBIT < goodput_mbit < LINK_MBIT, rounds


def test_namespaces_left_by_a_dead_run_are_removed_and_a_live_runs_are_kept() -> None:
    """A test or bench process killed before its cleanup leaves murmur-<tag>-<pid>-... namespaces; the
    next run's set-up removes those whose pid no longer runs, and only those."""
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that ran and is gone (reaped)
    orphan, live, foreign = f"murmur-orph-{dead.pid}-a", f"murmur-orph-{os.getpid()}-a", f"other-orph-{dead.pid}-a"
    for ns in (orphan, live, foreign):
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
    try:
        removed = remove_orphaned_namespaces()
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
        names = {line.split(" ", 1)[0] for line in listed.splitlines()}
        assert orphan in removed and orphan not in names
        assert live in names and foreign in names and live not in removed
    finally:
        for ns in (orphan, live, foreign):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
