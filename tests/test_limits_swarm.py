"""A hostile peer process among real `murmur node` processes (vector mode, loopback), against a control
window of the same swarm before it arrives: it floods streams from its own peer id and from two ids
without records, floods pulls and far-future exchange requests, publishes a record whose addresses
route nowhere and that never leaves step 0 / round 0 while it announces the swarm's first round, hangs
every gossip stream to it, and is finally SIGSTOPped. The honest nodes keep their round cadence (no
round waits beyond its deadline), their memory stays bounded, and every attack is counted on
`/metrics` under the names docs/monitor.md gives."""

from __future__ import annotations

import time

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.hostile_flood import HostileProcess, Mode, Target, Victim, watch_rounds
from support.swarm_harness import Node, Swarm, wait_for

pytestmark = pytest.mark.multiprocess

DIM = 1_000_000  # 4 MB a vector: a receiver that read each flooded request whole would hold GBs
EXCHANGE_TIMEOUT_S = 2.0
ROUND_INTERVAL_S = 0.5
# Windows of 20 rounds: one stall of the loaded machine (the other test worker, the flood's own p2pd
# work) that makes a node jump 4 rounds to the present then costs 0.8x, not 0.6x of a 10-round window
WINDOW_S = 10.0
ATTACK_S = 10.0
# A round held to its deadline by the hostile each time would run at most 1 / (2 s + 0.5 s), 0.2x the
# control's cadence; held every other round, 0.33x. Half the control's cadence tells those apart from
# a machine that stalled for a few seconds.
MIN_CADENCE_RATIO = 0.5
# The hostile record lives 3 of its heartbeats (24 s): past the frozen window even when it was last
# published a heartbeat before the freeze, so that window measures a frozen peer still in every view
# (a departure's churn is test_swarm_faults' subject)
HOSTILE_HEARTBEAT_S = 8.0
RSS_GROWTH_BOUND = 150 << 20  # generous: 64 flooded requests read whole would be 256 MB per node


def metrics(node: Node) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    import urllib.request

    with urllib.request.urlopen(node.monitor_url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def counter(values: dict, name: str, **labels: str) -> float:
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


def rss(node: Node) -> int:
    return psutil.Process(node.pid).memory_info().rss


def test_a_hostile_peer_costs_honest_nodes_neither_cadence_nor_memory_and_is_counted(tmp_path):
    began = time.monotonic()
    phases: dict[str, float] = {}
    # started first: its imports, keys and daemons take seconds, while the swarm starts
    with HostileProcess(tmp_path / "hostile", extra_ids=2) as hostile, \
            Swarm(tmp_path, dim=DIM, heartbeat=1, round_interval=ROUND_INTERVAL_S,
                  exchange_timeout=EXCHANGE_TIMEOUT_S, min_peers=3) as swarm:
        nodes = swarm.start(3)
        swarm.wait_rounds(nodes, 3)
        phases["swarm up"] = time.monotonic() - began
        control, control_longest = watch_rounds(nodes, WINDOW_S)
        memory_before = [rss(n) for n in nodes]
        first = nodes[0].status()
        target = Target(swarm=first["swarm"], config_hash=first["config_hash"], dim=DIM,
                        victims=tuple(Victim(n.peer_id, n.maddrs) for n in nodes), workdir=tmp_path / "hostile",
                        modes=tuple(Mode), gossip_from=first["gossip_from"], heartbeat_s=HOSTILE_HEARTBEAT_S,
                        duration_s=ATTACK_S,
                        streams_per_id=64, pullers=3, extra_ids=2, extra_streams=8)
        try:
            hostile.attack(target)
            ready = hostile.ready()
            hostile_id = ready["ready"]
            phases["hostile ready"] = time.monotonic() - began
            # it is a member: its record is in every view (step 0, announcing the swarm's first round)
            wait_for(lambda: all(any(p["peer_id"] == hostile_id for p in n.status()["peers"]) for n in nodes),
                     30, "the hostile record in every view")
            phases["hostile in views"] = time.monotonic() - began
            attacked, attacked_longest = watch_rounds(nodes, ATTACK_S)
            report = hostile.report(30.0)
            memory_after = [rss(n) for n in nodes]
            hostile.freeze()  # SIGSTOP: a frozen peer whose daemon still accepts streams
            frozen, frozen_longest = watch_rounds(nodes, WINDOW_S)
            values = [metrics(n) for n in nodes]
            statuses = [n.status() for n in nodes]
        finally:
            hostile.kill()
        phases["done"] = time.monotonic() - began
        summary = (f"phases {phases}\ncontrol {control} (longest round {control_longest:.2f} s), attacked {attacked} "
                   f"({attacked_longest:.2f} s), frozen {frozen} ({frozen_longest:.2f} s)\nhostile {report}\n"
                   + "\n".join(f"{n.name}: {s['limits']} skipped {s['skipped']}" for n, s in zip(nodes, statuses)))

        # cadence: rounds keep coming at the clock's pace, and none waits beyond its deadline
        for rate_control, rate_attacked, rate_frozen in zip(control, attacked, frozen):
            assert min(rate_attacked, rate_frozen) >= MIN_CADENCE_RATIO * rate_control, summary
        assert max(attacked_longest, frozen_longest) <= EXCHANGE_TIMEOUT_S + 2.0, summary
        # memory: nothing flooded was read beyond its header
        for before, after in zip(memory_before, memory_after):
            assert after - before < RSS_GROWTH_BOUND, (before, after, summary)
        # the attack happened (the hostile saw its streams closed, its pulls limited) ...
        assert report["streams_opened"] > 3 * 64 and report["streams_closed_by_victim"] > 0, summary
        assert report["pulls"].get("rate_limited", 0) > 0 and report["pulls"].get("tensors", 0) > 0, summary
        assert report["exchanges_far_ahead"].get("stale", 0) > 0, summary
        # ... and each victim counted it on /metrics
        for v, s in zip(values, statuses):
            assert counter(v, "murmur_streams_refused_total", reason="not_member") > 0, summary
            assert counter(v, "murmur_streams_refused_total", reason="peer_streams") > 0, summary
            assert counter(v, "murmur_requests_refused_total", reason="rate_limited") > 0, summary
            assert counter(v, "murmur_requests_refused_total", reason="stale") > 0, summary
            assert counter(v, "murmur_dials_total", outcome="refused") >= 1, summary  # no routable address
            assert counter(v, "murmur_skipped_total", reason="stalled") > 0, summary  # left out, not waited for
            assert s["limits"]["open_streams"] < 200, summary
        assert swarm.stop_all(nodes) == [0, 0, 0], swarm.logs()
