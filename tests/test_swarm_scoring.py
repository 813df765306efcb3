"""Contribution scoring among real `murmur` processes: one hostile node among five serves plausible but useless
updates (support.hostile's `useless`: its last value plus a random update of its honest update's norm, which
the value screen and the clipping radius both let through; in gossip DiLoCo a random pseudo-gradient of its
honest one's norm; under compressed gossip it claims such parameters and encodes them as differences).
Every honest node rates it below every honest peer within a bounded number of scored
rounds, excludes it, counts that on /metrics, and excludes no honest peer meanwhile."""

from __future__ import annotations

import os
import re
import time

import pytest
from test_monitor_node import schema_errors

from node.monitor.schemas import schema
from support.attacks import fetch_metrics, metric, with_support_path
from support.hostile import Mode, hostile_argv, hostile_counts
from support.swarm_harness import Swarm, wait_for
from support.tiny_model import TINY

pytestmark = pytest.mark.multiprocess

# complete graph: every round a node mixes with (and scores) all four others; every round is scored
RECIPE = {"model": "tiny_model:build", "context": TINY.context, "batch_size": 16, "optimizer": "dadam", "lr": 1.5e-2,
          "warmup_steps": 8, "steps": 0, "topology": "complete", "min_peers": 5}
# gossip DiLoCo: an outer round every 2 inner steps (every round scored), its default outer Nesterov step, so
# its rounds of plain anchors are weighed without being scored
DILOCO = {**RECIPE, "optimizer": "diloco", "inner_optimizer": "adam", "local_steps": 2, "codec": "int8"}
# compressed gossip: each neighbour scored by the node's estimate of its parameters (the hostile claims its
# useless parameters and encodes them as CHOCO differences honestly, so its edges stay in step)
CHOCO = {**RECIPE, "gossip_compression": "choco", "codec": "int8"}
NODE = {"threads": 1, "eval_every": 1000, "checkpoint_every": 1000, "exchange_timeout": 3, "heartbeat": 1,
        "score_every": 1}
# defaults: 4 ratings before any action, excluded at the 3rd low rating in a row, so at the 6th at the
# earliest; allow that many again for rounds whose scoring was skipped or whose exchange missed
MAX_RATINGS = 12
# under CHOCO a neighbour's estimate starts at the anchor and catches up with its parameters over the first
# rounds (each moves it by one compressed difference): the first ratings measure that catching up, which
# helps whoever the neighbour is (the hostile's rose to 0.6 around its 11th rating in every run), so the
# exclusion comes later: after 10 ratings on a quiet machine, 35-45 in a loaded suite run
MAX_RATINGS_CHOCO = 60
HOSTILE, HONEST = "n3", ("n0", "n1", "n2", "n4")


def judged(status: dict, hostile: str) -> bool:
    """This node has excluded the hostile and rates it below every honest peer it rated."""
    scores = status.get("contribution") or {}
    mine = scores.get(hostile)
    honest = [s["score"] for p, s in scores.items() if p != hostile]
    return (mine is not None and mine["state"] == "excluded" and len(honest) >= 3
            and all(mine["score"] < s for s in honest))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("recipe", [RECIPE, DILOCO, CHOCO], ids=["dadam", "diloco", "choco"])
def test_a_useless_updater_is_rated_below_every_honest_peer_and_excluded(tmp_path, monkeypatch, recipe):
    monkeypatch.setenv("PYTHONPATH", with_support_path(os.environ))
    model = {"model": RECIPE["model"]}
    with Swarm(tmp_path) as swarm:
        n0 = swarm.found("n0", seed=0, **recipe, **NODE)
        nodes = {"n0": n0}
        for i in (1, 2, 3, 4):
            name = f"n{i}"
            nodes[name] = swarm.spawn(name, seed=i, join=n0, min_peers=RECIPE["min_peers"], **model, **NODE,
                                      hostile=hostile_argv([Mode.USELESS]) if name == HOSTILE else ())
        swarm.wait_ready(list(nodes.values())[1:])
        hostile = nodes[HOSTILE].peer_id
        honest = [nodes[n] for n in HONEST]
        honest_ids = {n.peer_id for n in honest}
        seen_states: dict[str, set[str]] = {}  # honest peer -> the states any honest node gave it

        def all_judged() -> bool:
            done = True
            for node in honest:
                status = node.status()
                for peer, score in (status.get("contribution") or {}).items():
                    if peer in honest_ids:
                        seen_states.setdefault(peer, set()).add(score["state"])
                done = done and judged(status, hostile)
            return done

        started = time.monotonic()
        wait_for(all_judged, 420, "every honest node excluding the useless updater", interval_s=0.5)
        print(f"judged in {time.monotonic() - started:.0f} s")

        def left_out() -> bool:  # a round after the exclusion leaves it out of the mix
            return all_judged() and all(n.status()["skipped"].get("excluded", 0) >= 1 for n in honest)

        wait_for(left_out, 120, "a round of every honest node leaving the useless updater out", interval_s=0.5)
        statuses = {n.name: n.status() for n in honest}
        metrics = {n.name: fetch_metrics(n) for n in honest}
        counts = hostile_counts(nodes[HOSTILE].stderr())
        logs = {n.name: n.stderr() for n in honest}
        assert swarm.stop_all(list(nodes.values())) == [0] * len(nodes), swarm.logs()

    assert sum(counts.get(f"useless: tampered {what}", 0) for what in ("exchange", "reply", "choco claim")) >= 1, counts
    for name, status in statuses.items():
        scores = status["contribution"]
        assert schema_errors(status, schema("status")) == [], name  # the declared shape the swarm page reads
        # within a bounded number of ratings, as the node logged it at the exclusion (an excluded peer is
        # still rated, so the status's count keeps rising while the others catch up)
        excluded_after = re.findall(rf"contribution of {hostile}: \S+ -> excluded \(score \S+ after (\d+) ratings\)",
                                    logs[name])
        bound = MAX_RATINGS_CHOCO if recipe is CHOCO else MAX_RATINGS
        assert excluded_after and int(excluded_after[0]) <= bound, (name, excluded_after, scores)
        assert scores[hostile]["rated_rounds"] >= int(excluded_after[0]), (name, scores)
        assert status["contribution_exclusions"] >= 1 and status["skipped"].get("excluded", 0) >= 1, (name, status)
        text = metrics[name]
        assert metric(text, "murmur_peer_exclusions_total") >= 1, text
        assert f'murmur_peer_contribution_score{{peer_id="{hostile}"}}' in text, text
        assert metric(text, "murmur_skipped_total", '{reason="excluded"}') >= 1  # DiLoCo's fragment rounds too
    # no honest peer was ever excluded (each was seen rated by the others all along)
    assert set(seen_states) == honest_ids, seen_states
    assert all("excluded" not in states for states in seen_states.values()), seen_states
