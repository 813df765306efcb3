"""Real `murmur` node processes with `--transport libp2p` on loopback: a mixed swarm (3 nodes on p2pd,
3 on py-libp2p) reaches consensus; an all-libp2p swarm reaches the exact average while a hostile peer
sends it garbage; a frozen node, a killed backend child and a killed node behave as on p2pd, and a
newcomer joins the survivor; a node's `--data-announce` is what its record advertises."""

import asyncio
import dataclasses
import signal
import socket
import time

import psutil
import pytest
from test_swarm_bad_peers import WIRE_ATTACKS, attack, wire_errors

from support.swarm_harness import Node, Swarm, check_consensus, summary, wait_for

pytestmark = pytest.mark.multiprocess

CHILD_MODULE = "node.net.transport.libp2p_child"


def libp2p_child(node: Node) -> psutil.Process:
    """The node's py-libp2p child process (started by the node, not by the test)."""
    for child in psutil.Process(node.pid).children(recursive=True):
        if CHILD_MODULE in " ".join(child.cmdline()):
            return child
    raise AssertionError(f"{node.name} has no py-libp2p child")


def data_maddrs(node: Node) -> tuple[str, ...]:
    """What the node's own peer record advertises for gossip (its DHT maddrs are what it printed)."""
    status = node.status()
    return tuple(next(p["maddrs"] for p in status["peers"] if p["peer_id"] == status["peer_id"]))


def gone(process: psutil.Process) -> bool:
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_three_p2pd_and_three_libp2p_nodes_reach_consensus_together(tmp_path):
    rounds, interval = 25, 0.5  # 0.3 s rounds at load 14 made peers skip each other as stale
    with Swarm(tmp_path, dim=256, heartbeat=2) as swarm:
        flags = dict(topology="static-exp", min_peers=6, round_interval=interval, max_staleness=4)
        founder = swarm.found(**flags)  # on p2pd
        joiners = [swarm.spawn(f"n{seed}", seed=seed, join=founder, transport="libp2p" if seed % 2 else "p2pd",
                               **flags) for seed in range(1, 6)]
        swarm.wait_ready(joiners)
        nodes = [founder, *joiners]
        libp2p_nodes = [n for n in nodes if "libp2p" in n.argv]
        assert len(libp2p_nodes) == 3
        swarm.wait_views(nodes, nodes)
        # p2pd nodes learn from the records where the libp2p nodes gossip: their children's hosts,
        # under the node's own peer id (their p2pd runs under a key of its own, for the DHT only)
        seen_by_founder = {p["peer_id"]: p["maddrs"] for p in founder.status()["peers"]}
        for node in libp2p_nodes:
            assert seen_by_founder[node.peer_id] == list(data_maddrs(node))
            assert all(addr.endswith(f"/p2p/{node.peer_id}") for addr in seen_by_founder[node.peer_id])
            assert not any(addr.endswith(f"/p2p/{node.peer_id}") for addr in node.maddrs)
        swarm.wait_rounds(nodes, rounds, timeout_s=60 + 2 * rounds * interval)
        report = summary(nodes, swarm.statuses(nodes))
        assert all(s["bytes_received"] > 0 for s in swarm.statuses(libp2p_nodes)), report
        assert swarm.stop_all(nodes, timeout_s=30) == [0] * 6, swarm.logs()
    check_consensus(nodes, report, swarm.logs())


def test_a_libp2p_swarm_reaches_the_exact_average_while_a_peer_sends_it_garbage(tmp_path):
    # one-peer-exp over 4 (a power of two) averages exactly every 2 rounds, whoever is attacked meanwhile
    with Swarm(tmp_path, dim=64, heartbeat=2, round_interval=0.4) as swarm:
        nodes = swarm.start(4, topology="one-peer-exp", min_peers=4, transport="libp2p")
        swarm.wait_views(nodes, nodes)
        swarm.wait_rounds(nodes, 2, timeout_s=90)
        victim = nodes[1]
        status = victim.status()
        # the attacker runs p2pd and dials the victim's child, where the victim's record says it gossips
        asyncio.run(attack(dataclasses.replace(victim, maddrs=data_maddrs(victim)), tmp_path / "attacker.key",
                           status["swarm"], status["config_hash"], dht_maddrs=victim.maddrs))
        assert sum(wire_errors(victim).values()) == len(WIRE_ATTACKS)
        ran = max(s["rounds_run"] for s in swarm.statuses(nodes))
        swarm.wait_rounds(nodes, ran + 2, timeout_s=60)
        report = summary(nodes, swarm.statuses(nodes))
        assert all(wire_errors(n) == {} for n in nodes if n is not victim), report
        children = [libp2p_child(n) for n in nodes]
        assert swarm.stop_all(nodes, timeout_s=30) == [0] * 4, swarm.logs()
        wait_for(lambda: all(gone(c) for c in children), 5, "the children to stop with their nodes (SIGTERM)")
    check_consensus(nodes, report, swarm.logs())


def free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def test_frozen_node_killed_child_and_killed_node_on_libp2p(tmp_path):
    with Swarm(tmp_path, heartbeat=1, exchange_timeout=2) as swarm:
        flags = dict(topology="ring", min_peers=3, transport="libp2p")
        n0 = swarm.found(**flags)
        n1 = swarm.spawn("n1", seed=1, join=n0, **flags)
        # n2's data plane listens on two loopback hosts and announces one: its record must carry just that
        # one, and the ring's exchanges with n2 then go through it
        port_a, port_b = free_port("127.0.0.1"), free_port("127.0.0.3")
        announced = f"/ip4/127.0.0.3/tcp/{port_b}"
        n2 = swarm.spawn("n2", seed=2, join=n0, extra_args=[
            "--data-listen", f"/ip4/127.0.0.1/tcp/{port_a}", "--data-listen", announced,
            "--data-announce", announced], **flags)
        nodes = [n0, n1, n2]
        swarm.wait_ready([n1, n2])
        swarm.wait_views(nodes, nodes)
        assert data_maddrs(n2) == (f"{announced}/p2p/{n2.peer_id}",)
        assert next(p["maddrs"] for p in n0.status()["peers"] if p["peer_id"] == n2.peer_id) == list(data_maddrs(n2))
        swarm.wait_rounds(nodes, 2, timeout_s=90)
        assert all(s["skipped"].get("unreachable", 0) == 0 for s in swarm.statuses([n0, n1])), swarm.logs()

        # frozen: the others skip it and go on; thawed, it gossips again
        n2.signal(signal.SIGSTOP)
        try:
            ran = [s["rounds_run"] for s in swarm.statuses([n0, n1])]
            wait_for(lambda: all(s["rounds_run"] >= r + 3 for s, r in zip(swarm.statuses([n0, n1]), ran)), 60,
                     "rounds without the frozen node")
            assert sum(n0.status()["skipped"].values()) > 0
        finally:
            n2.signal(signal.SIGCONT)
        ran = n2.status()["rounds_run"]
        wait_for(lambda: n2.status()["rounds_run"] >= ran + 2, 60, "the thawed node to gossip again")

        # its backend child killed: the node says so and stops (status 2), taking its p2pd along
        child = libp2p_child(n1)
        others = [c for c in psutil.Process(n1.pid).children(recursive=True) if c.pid != child.pid]
        child.kill()
        started = time.monotonic()
        assert n1.process.wait(20) == 2, n1.log_tail()
        assert time.monotonic() - started < 10
        assert "py-libp2p child" in n1.stderr() and "is gone" in n1.stderr()
        wait_for(lambda: all(gone(p) for p in others), 5, "n1's p2pd to stop with it")

        # the node SIGKILLed: its child dies with it
        child = libp2p_child(n2)
        n2.process.kill()
        n2.process.wait(10)
        wait_for(lambda: gone(child), 5, "n2's py-libp2p child to die with it")

        ran = n0.status()["rounds_run"]
        wait_for(lambda: n0.status()["rounds_run"] >= ran + 2, 30, "the survivor to keep running rounds")
        assert n0.alive()

        # a newcomer joins the survivor and gossips with it
        n3 = swarm.spawn("n3", seed=3, join=n0, **{**flags, "min_peers": 2})
        swarm.wait_ready([n3])
        wait_for(lambda: {p["peer_id"] for p in n0.status()["peers"]} == {n0.peer_id, n3.peer_id}, 30,
                 "the dead nodes to leave n0's view and the newcomer to enter it")
        got = [s["bytes_received"] for s in swarm.statuses([n0, n3])]
        wait_for(lambda: all(s["bytes_received"] > b for s, b in zip(swarm.statuses([n0, n3]), got))
                 and n3.status()["rounds_run"] >= 2, 60, "the newcomer and the survivor to exchange")
