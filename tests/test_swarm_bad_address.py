"""A hostile process publishes its own, validly signed peer record whose addresses do not parse, next
to two honest nodes on loopback: the honest nodes refuse the record as a whole
(`dht_refused_bad_address`), never hold it in their views, and keep gossiping
(tests/support/hostile_address.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from support.swarm_harness import Swarm, wait_for

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[1]
HOSTILE_ADDRESS = [sys.executable, str(REPO / "tests" / "support" / "hostile_address.py")]


def test_a_record_with_unparseable_addresses_is_refused_and_the_swarm_keeps_stepping(tmp_path: Path) -> None:
    with Swarm(tmp_path, round_interval=0.5, swarm="addr1") as swarm:
        founder = swarm.found()
        member = swarm.spawn("n1", seed=1, join=founder)
        swarm.wait_ready([member])
        honest = [founder, member]
        before = {n.name: s["rounds_run"] for n, s in zip(honest, swarm.statuses(honest), strict=True)}

        report_path = tmp_path / "hostile.json"
        hostile = swarm.launch("hostile", [*HOSTILE_ADDRESS, "--swarm", "addr1", "--peers", founder.maddrs[0],
                                           "--identity", str(tmp_path / "hostile.key"), "--report", str(report_path),
                                           "--config-hash", founder.status()["config_hash"], "--duration", "3"])
        assert hostile.process.wait(120) == 0, hostile.log_tail()
        report = json.loads(report_path.read_text())
        assert report["stores"], report

        def refused() -> int:
            return sum(s["errors"].get("dht_refused_bad_address", 0) for s in swarm.statuses(honest))

        wait_for(lambda: refused() >= 1, 30, "the honest nodes to refuse the record with bad addresses")
        assert not any(report["stores"]), report  # no honest DHT node stored it
        for status in swarm.statuses(honest):
            assert report["peer_id"] not in {p["peer_id"] for p in status["peers"]}
        wait_for(lambda: all(s["rounds_run"] >= before[n.name] + 3 for n, s in
                             zip(honest, swarm.statuses(honest), strict=True)), 60, "rounds after the attack")
        assert all(n.alive() for n in honest)
        assert swarm.stop_all(honest) == [0, 0], [n.log_tail() for n in honest]
