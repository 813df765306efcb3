"""One sybil operator against an open swarm of real `murmur` processes (vector mode, loopback): ~300
record-only identities of its own, most of them paying the swarm's proof of work (a low test difficulty),
the rest not, stored in the DHT and kept live. The unpaid ones never reach a view and are counted on
`/metrics`; the paid ones fill the views beyond their cap, yet a new honest node joins, enters the honest
nodes' views and they its, and no honest node stops (docs/threat-model.md, "Sybils")."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from node.net.view import MAX_VIEW
from support.attacks import fetch_metrics, metric
from support.swarm_harness import Node, Swarm, wait_for

pytestmark = pytest.mark.multiprocess

HOSTILE_DHT = [sys.executable, str(Path(__file__).resolve().parent / "support" / "hostile_dht.py")]
SWARM = "sybils"
WORK_BITS = 8  # ~256 hashes an identity: cheap for the test's operator, and what the founder asks
SYBILS = 300
UNPAID = 20  # of them without a proof
# the operator keeps its records live this long (each stored for 60 s, the DHT's bound being 120 s): past
# the new node's start on a loaded machine; the test kills it when done
FLOOD_S = 300.0


def test_a_new_node_joins_an_open_swarm_past_300_sybil_records(tmp_path):
    with Swarm(tmp_path, round_interval=0.5, swarm=SWARM) as swarm:
        founder = swarm.found(identity_work=WORK_BITS)
        member = swarm.spawn("n1", seed=1, join=founder)
        swarm.wait_ready([member])
        honest = [founder, member]
        swarm.wait_views(honest, honest)
        config_hash = founder.status()["config_hash"]

        # the operator stores its records and keeps storing them (the process ends after FLOOD_S)
        flooding = swarm.launch("sybils", hostile_dht_argv(swarm, config_hash, founder))

        members = {founder.peer_id, member.peer_id}

        # at one moment, each view capped with both members in it (a member out of a view for good, pushed
        # out by the flood, fails the wait; one whose record lapsed for a moment is read again)
        def capped() -> bool:
            seen = {n.name: (view_of(n), metric(fetch_metrics(n), "murmur_view_overflow")) for n in honest}
            counts = {name: (len(view), sorted(members - view), over) for name, (view, over) in seen.items()}
            assert all(size == MAX_VIEW and not missing and over > 0 for size, missing, over in counts.values()), counts
            return True

        wait_for(capped, 120, "the honest views at their cap with both members in them, sybil records left out")

        # a new honest node, started while the flood fills every view
        late = swarm.spawn("n2", seed=2, join=founder)
        swarm.wait_ready([late])
        assert flooding.process.poll() is None, "the flood ended before the new node was up: the test proves nothing"
        everyone = {*members, late.peer_id}
        wait_for(lambda: all(everyone <= view_of(n) for n in [*honest, late]), 60,
                 "the new node in the honest views and they in its")
        assert flooding.process.poll() is None, "the flood ended before the new node was in the views"
        # the unpaid identities are refused and counted, on /metrics too
        for node in [*honest, late]:
            errors = node.status()["errors"]
            assert errors.get("peer_record_no_work", 0) >= 1, (node.name, errors)
            assert metric(fetch_metrics(node), "murmur_errors_total", '{kind="peer_record_no_work"}') >= 1
        # the new node gossips with the swarm, and nobody stopped
        swarm.wait_rounds([*honest, late], 3)
        assert all(n.alive() for n in [*honest, late]), swarm.logs()
        assert swarm.stop_all([*honest, late]) == [0, 0, 0], swarm.logs()
        flooding.process.kill()
        flooding.process.wait(30)


def view_of(node: Node) -> set[str]:
    return {p["peer_id"] for p in node.status()["peers"]}


def hostile_dht_argv(swarm: Swarm, config_hash: str, founder: Node) -> list[str]:
    """The operator: SYBILS real-keyed records of its own, all but UNPAID with a proof of WORK_BITS."""
    return [*HOSTILE_DHT, "--mode", "flood-records", "--identity", str(swarm.root / "sybils.key"),
            "--report", str(swarm.root / "sybils.json"), "--swarm", SWARM, "--peers", founder.maddrs[0],
            "--count", str(SYBILS), "--keys", str(SYBILS), "--paid", str(SYBILS - UNPAID),
            "--work-bits", str(WORK_BITS), "--config-hash", config_hash, "--duration", str(FLOOD_S), "--every", "5"]
