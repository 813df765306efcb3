"""One hostile node among five real `murmur` processes (an open swarm), against a control run of the same
swarm with an honest node in its place (same identities, seeds and recipe). The hostile node claims step
10^9 and serves, by turns, noise, its parameters x 1000, its updates reversed and its initial parameters
(support.hostile), and forges the swarm's config in the DHT. No honest node installs its parameters (a node joining mid-run ignores its claim and
downloads from the honest ones), the honest nodes' validation loss after a fixed number of steps stays
within 10% of the control's, they keep their rounds and the founder's config, and the hostile traffic
shows on /metrics.
bench/bench_attacks.py runs every mode on its own, for longer (figures in docs/benchmarks.md)."""

from __future__ import annotations

import os

import pytest

from support.attacks import FOUNDING_HONEST, HOSTILE, AttackSetup, SwarmRun, metric, run_swarm, with_support_path
from support.hostile import Mode, hostile_argv
from support.tiny_model import TINY
from support.tiny_moe import TINY_MOE

pytestmark = pytest.mark.multiprocess

STEPS = 60
# until stopped (steps 0): with a step budget, a node claiming a step beyond it counts as done and is
# left out of the rounds, so its tensors would never be mixed; here they are
RECIPE = {"model": "tiny_model:build", "context": TINY.context, "batch_size": 16, "optimizer": "dadam", "lr": 1.5e-2,
          "warmup_steps": 8, "steps": 0, "topology": "one-peer-exp", "min_peers": 4}
NODE = {"threads": 1, "eval_every": STEPS, "checkpoint_every": 1000, "exchange_timeout": 3, "heartbeat": 1}
CONTROL = AttackSetup(RECIPE, NODE, steps=STEPS, join_at=12)
# it also forges the swarm's config in the DHT meanwhile (a few times, from 2 s after it started)
ATTACK = AttackSetup(RECIPE, NODE, steps=STEPS, join_at=12, hostile=hostile_argv(
    [Mode.HUGE_STEP, Mode.NOISE, Mode.SCALED, Mode.SIGN_FLIP, Mode.STALE_REPLAY, Mode.FORGE_CONFIG], cycle_rounds=4,
    options={"attack-after": 2, "duration": 15, "every": 5}))
LOSS_RATIO = 1.10


def check_honest_sources(joined: dict, hostile: str, evaluated: int = 2) -> None:
    """The joiner downloaded nothing from the hostile, and at least `evaluated` honest copies, and kept
    only honest ones. How many it kept is not asserted: one honest copy that lags far behind is refused
    for its loss, and two that do not average well are replaced by the better one (node.swarm.joining);
    on a loaded machine either can happen to honest copies, attack or not."""
    assert hostile not in joined["losses"] and len(joined["losses"]) >= evaluated, joined
    assert joined["sources"] and hostile not in joined["sources"], joined
    assert set(joined["sources"]) <= set(joined["losses"]), joined


def check_no_takeover(attack: SwarmRun) -> None:
    counts = attack.hostile_counts
    for mode in ("noise", "scaled", "sign-flip", "stale-replay"):
        assert any(k.startswith(f"{mode}: tampered") for k in counts), f"{mode} was never served: {counts}"
    assert counts.get("huge-step: record claims", 0) >= 1, counts
    hostile = attack.nodes[HOSTILE].peer_id
    for name in FOUNDING_HONEST:
        # they start from the seed, or (one that started late on a loaded machine) from honest peers
        training = attack.statuses[name]["training"]
        assert training["started_from"] == "init" or hostile not in training["joined"]["sources"], training
    training = attack.statuses["n4"]["training"]
    joined = training["joined"]
    assert joined["refused"].get(hostile) == "step_out_of_bounds", joined
    check_honest_sources(joined, hostile)
    assert training["started_from"].startswith("peer") and joined["step"] < 10**6, training


def check_config_kept(attack: SwarmRun) -> None:
    """The forged configs were tried, no honest node stored any, and every honest node (n4 joined after
    the forgeries began) runs the founder's config; the refusals are counted."""
    counts = attack.hostile_counts
    for forged in ("plain", "own_key_far_expiration", "claims_founder", "oversized"):
        assert counts.get(f"forge-config: {forged} refused", 0) >= 1, counts
        assert f"forge-config: {forged} stored" not in counts, counts
    honest = [*FOUNDING_HONEST, "n4"]
    founder = attack.statuses["n0"]
    for name in honest:
        status = attack.statuses[name]
        assert (status["config_hash"], status["config_version"]) == (founder["config_hash"], 1), (name, status)
    errors = {kind: sum(attack.statuses[n]["errors"].get(kind, 0) for n in honest)
              for kind in ("dht_refused_unsigned", "dht_refused_expiration", "dht_refused_too_large")}
    assert all(errors.values()), errors


@pytest.mark.timeout(1500)
def test_one_hostile_node_among_five_neither_takes_over_nor_poisons_the_honest_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", with_support_path(os.environ))
    ids = tmp_path / "identities"  # the same peer ids in both runs: the same shards and topology ranks
    control = run_swarm(tmp_path / "control", ids, CONTROL)
    attack = run_swarm(tmp_path / "attack", ids, ATTACK)

    report = {name: (round(control.val_loss(name), 4), round(attack.val_loss(name), 4)) for name in FOUNDING_HONEST}
    print(f"validation loss at step {STEPS}, control and attack: {report}")
    for name, (base, attacked) in report.items():
        assert attacked <= LOSS_RATIO * base, f"{name}: val loss {attacked} under attack vs {base}; all: {report}"
    check_no_takeover(attack)
    check_config_kept(attack)
    # a joiner's model right after its download (the combination it adopted, or the one copy it kept) is
    # as good as the honest models it came from. Its status's val_loss is not that model's once it trained
    # on: on a loaded machine it may join near the end, and an evaluation right after its first step, which
    # runs with Adam moments as fresh as a founder's at step 0, measured 2.94 against the copies' 2.49
    for run in (control, attack):
        joined = run.statuses["n4"]["training"]["joined"]
        best_source = min(joined["losses"][p] for p in joined["sources"])
        adopted = joined["combined_loss"] if len(joined["sources"]) > 1 else joined["losses"][joined["sources"][0]]
        assert adopted <= LOSS_RATIO * best_source, joined
    # honest nodes kept their rounds: every step had its round, and the attacker (which answers at once)
    # cost no exchange deadlines; one that did would be a neighbour in a third of the rounds (~20 here),
    # while a loaded machine makes a few honest exchanges miss theirs in any run
    for name in FOUNDING_HONEST:
        status = attack.statuses[name]
        started = status["training"]["started_from"]
        first = int(started.rsplit(" ", 1)[1]) if started.startswith("peer") else 0  # a late start downloaded
        ran, waited = status["rounds_run"], status["skipped"].get("timeout", 0)
        allowed = max(10, 2 * control.statuses[name]["skipped"].get("timeout", 0))
        assert ran >= STEPS - first - 1 and waited <= allowed, (name, started, ran, status["skipped"])
    # the hostile traffic is counted: its scaled values refused, the rest clipped
    refused = sum(metric(t, "murmur_errors_total", '{kind="out_of_range"}') for t in attack.metrics.values())
    clipped = sum(metric(t, "murmur_mixing_clipped_total") for t in attack.metrics.values())
    assert refused >= 1 and clipped >= 1, (refused, clipped)


SPES_STEPS = 30
# a sync every step, so that the 30 steps hold 30 syncs for the hostile to disturb
SPES_RECIPE = {**RECIPE, "model": "tiny_moe:build", "context": TINY_MOE.context, "spes_sync_every": 1}
# every node at its default capacity (every expert on a CPU): the most an honest node claims, and what
# the hostile's 2^62 counts as (docs/threat-model.md, "What is not bounded")
SPES_NODE = {**NODE, "eval_every": SPES_STEPS}
SPES_ATTACK = AttackSetup(SPES_RECIPE, SPES_NODE, steps=SPES_STEPS, join_at=8, founder_args=("--spes",),
                          hostile=hostile_argv([Mode.SPES_CAPACITY]))


@pytest.mark.timeout(900)
def test_a_hostile_spes_member_claiming_capacity_2_62_and_huge_versions_is_bounded(tmp_path):
    """SPES (tiny MoE): the hostile node claims capacity 2^62 in its record and version 2^62 for every
    expert record it publishes and every copy it serves. Its capacity counts as the layer's expert count
    (every expert keeps honest owners, every honest node owns experts), no honest node takes a version
    beyond its bound (they are refused and counted), the joiner n4 does not download from it (its record
    is refused: `record_out_of_bounds`), and the honest nodes train. No control run: at 30
    steps a SPES swarm's validation loss varies between runs of the same seeds by more than the 10%
    the issue allows (ownership changes when the joiner arrives, at a step the machine's load decides),
    so the loss ratio is bench/bench_attacks.py's, over longer runs (docs/benchmarks.md)."""
    os.environ["PYTHONPATH"] = with_support_path(os.environ)
    attack = run_swarm(tmp_path / "attack", tmp_path / "identities", SPES_ATTACK)

    counts = attack.hostile_counts
    assert counts.get("spes-capacity: record claims", 0) >= 1 and counts.get(
        "spes-capacity: expert records inflated", 0) >= 1, counts
    hostile = attack.nodes[HOSTILE].peer_id
    honest_ids = {attack.nodes[n].peer_id for n in (*FOUNDING_HONEST, "n4")}
    refused = 0
    for name in FOUNDING_HONEST:
        status = attack.statuses[name]
        spes = status["spes"]
        assert hostile in spes["peers"], spes  # it takes part, with a capped share
        for expert, owners in spes["owners"].items():
            assert honest_ids & set(owners), (name, expert, owners)  # never owned by the hostile alone
        assert len(spes["owned_experts"]) >= 1, spes
        assert all(version < 10**6 for version, _ in spes["records"].values()), spes["records"]
        refused += spes["errors"].get("version_out_of_bounds", 0)
        # it trains: the loss at step 30 is far below an untrained model's ln(256 bytes) = 5.5
        assert status["training"]["val_loss"] < 3.5, status["training"]
    assert refused >= 1, "no honest node counted the hostile's versions as out of bounds"
    # the joiner took nothing from it: its record's capacity (and versions) are beyond what any honest
    # peer claims, so it is refused as a download source whatever its step (node.swarm.joining)
    training = attack.statuses["n4"]["training"]
    joined = training["joined"]
    assert joined["refused"].get(hostile) == "record_out_of_bounds", joined
    # one honest copy is enough here: the SPES joiner comes at step 8, and on a loaded machine it has found
    # a single honest peer at the swarm's step (the others not yet there); that the hostile's record is
    # refused whatever its step is what this test is for
    check_honest_sources(joined, hostile, evaluated=1)
    assert training["started_from"].startswith("peer"), training
    print(f"SPES under attack: validation loss at step {SPES_STEPS}: "
          f"{ {n: round(attack.val_loss(n), 4) for n in FOUNDING_HONEST} }")
