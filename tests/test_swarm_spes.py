"""SPES through the daemon: four real `murmur` node processes on loopback train a tiny MoE with
`--spes --experts 2`; ownership covers every expert and all nodes agree on it, each node trains and
holds optimizer state for the shared weights and its owned experts only; when the only two owners of
an expert are killed mid-run a live peer takes it over from the freshest copy and trains it on; a
killed node restarted from its checkpoint gets experts again. Also: the expert directory over real
DHT nodes, the SPES settings, the capacity rule on CPU."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from node.algorithms.spes.partition import ModelPartition
from node.algorithms.spes.swarm import saved_records
from node.cli.main import parse_node_config
from node.config import ConfigError
from node.runtime.founding import swarm_document
from node.swarm.recipe import SwarmSettings
from node.train.checkpoint import load_checkpoint
from support.swarm_harness import MURMUR, Swarm, wait_for
from support.tiny_moe import TINY_MOE, build

SUPPORT = Path(__file__).parent / "support"
EXPERTS = TINY_MOE.experts
CAPACITY = 2  # 4 nodes x 2 experts = 4 experts x r 2
RECIPE = {"model": "tiny_moe:build", "context": TINY_MOE.context, "batch_size": 8, "optimizer": "dadam", "lr": 3e-3,
          "warmup_steps": 5, "steps": 0, "topology": "ring", "spes_sync_every": 1, "spes_merge_every": 4,
          "spes_merge_until": 1000}
NODE = {"threads": 1, "eval_every": 50, "checkpoint_every": 5, "exchange_timeout": 3, "experts": CAPACITY,
        "min_peers": 4}
HEARTBEAT_S = 1
SHARDS = 3  # `<swarm>.peers` and `<swarm>.experts` split over 3 DHT keys each: the swarm must work the same


@pytest.fixture
def swarm(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH")])))
    with Swarm(tmp_path, heartbeat=HEARTBEAT_S) as s:
        yield s


def expected_trainable(owned: int) -> int:
    model = build()
    partition = ModelPartition.of(model)
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    shared = sum(sizes[n] for n in partition.shared)
    per_index = sum(sizes[n] for (_, e), names in partition.experts.items() if e == 0 for n in names)
    return shared + owned * per_index


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_spes_swarm_trains_only_owned_experts_and_survives_losing_both_owners(swarm):
    founder = swarm.found(**RECIPE, **NODE, membership_shards=SHARDS, extra_args=["--spes"])
    nodes = [founder, *(swarm.spawn(f"n{i}", seed=i, join=founder, **NODE, model=RECIPE["model"]) for i in range(1, 4))]
    swarm.wait_ready(nodes[1:])
    ids = sorted(n.peer_id for n in nodes)

    def settled() -> list[dict] | None:
        statuses = swarm.statuses(nodes)
        ok = all(s["spes"] and s["spes"].get("started") and s["spes"]["peers"] == ids and s["training"]["step"] >= 8
                 for s in statuses)
        return statuses if ok and len({str(s["spes"]["owners"]) for s in statuses}) == 1 else None

    agreed = wait_for(settled, 120, "every node training with SPES over all four peers, agreeing on ownership")
    owners = agreed[0]["spes"]["owners"]

    def stepped_since() -> list[dict] | None:
        # Adam makes a parameter's state at its first step: an expert gained in the last ownership change
        # has optimizer state once its owner has stepped since, so the check below reads statuses from then
        statuses = swarm.statuses(nodes)
        return statuses if all(s["training"]["step"] >= a["training"]["step"] + 2 and s["spes"]["owners"] == owners
                               for s, a in zip(statuses, agreed)) else None

    statuses = wait_for(stepped_since, 60, "every node two steps further under the same ownership")
    # ownership covers every expert, r = 2 owners each, and no node beyond its capacity
    assert sorted(owners) == [str(e) for e in range(EXPERTS)]
    assert all(len(set(o)) == 2 and set(o) <= set(ids) for o in owners.values()), owners
    for node, s in zip(nodes, statuses):
        mine = s["spes"]["owned_experts"]
        assert mine == sorted(int(e) for e, o in owners.items() if node.peer_id in o)
        assert len(mine) == CAPACITY and s["spes"]["capacity"] == CAPACITY
        # the optimizer holds state for shared + owned experts only; trainable parameters are exactly those
        assert set(s["spes"]["optimizer_experts"]) == set(s["spes"]["owned"]), s["spes"]
        assert s["training"]["trainable_params"] == expected_trainable(CAPACITY)
        # Adam: two float32 moments per trained parameter, nothing for a frozen expert
        assert s["training"]["optimizer_state_bytes"] == 8 * expected_trainable(CAPACITY), s["training"]
        assert s["experts"] == mine  # published in the node's <swarm>.peers record too
        assert s["limits"]["membership_shards"] == SHARDS  # the founder's, taken by every joiner from the config
        # SPES traffic (its own protocols) shows in the node's byte counters
        assert s["bytes_sent"] >= s["spes"]["bytes_sent"] > 0 and s["bytes_received"] >= s["spes"]["bytes_received"] > 0
        refused = {"hash_mismatch", "bad_schema", "manifest_mismatch", "expert_records_invalid"}
        assert not refused & set(s["spes"]["errors"]), s["spes"]["errors"]
    # the monitor's peers page shows each peer's owned experts and capacity from its record
    peers = {p["peer_id"]: p for p in statuses[0]["peers"]}
    assert set(peers) == set(ids)
    # the swarm-average loss on request (SPES's average: each expert over its owners) covers all four
    asked = subprocess.run([MURMUR, "eval", "--url", founder.monitor_url, "--data-dir", str(founder.data_dir), "--json"],
                           capture_output=True, text=True,
                           timeout=120)
    assert asked.returncode == 0, asked.stderr
    answer = json.loads(asked.stdout)
    assert sorted(p["peer_id"] for p in answer["peers"]) == ids and answer["failed"] == {}, answer
    assert answer["loss"] is not None and 0 < answer["loss"] < 6, answer

    # kill the only two owners of one expert (not the founder, so the swarm keeps its bootstrap address)
    target = next(e for e, o in owners.items() if founder.peer_id not in o)
    label = f"0.{target}"
    victims = [n for n in nodes if n.peer_id in owners[target]]
    survivors = [n for n in nodes if n not in victims]
    before = swarm.statuses(survivors)
    freshest_before = max(s["spes"]["records"][label][0] for s in before)
    for victim in victims:
        victim.process.kill()
    for victim in victims:
        victim.process.wait(10)
    live = sorted(n.peer_id for n in survivors)

    def taken_over() -> list[dict] | None:
        statuses = swarm.statuses(survivors)
        ok = all(s["spes"]["peers"] == live and set(s["spes"]["owners"][target]) and
                 set(s["spes"]["owners"][target]) <= set(live) for s in statuses)
        # the ownership map changes first; the new owner takes the expert's record over at its next step
        # (on a loaded machine a status can fall in between: wait for the record, then check what it holds)
        return statuses if ok and all(s["spes"]["records"][label][1] for n, s in zip(survivors, statuses)
                                      if n.peer_id in s["spes"]["owners"][target]) else None

    # a record expires 3 heartbeats after its peer died; the takeover follows at the next step
    after = wait_for(taken_over, 12 * HEARTBEAT_S + 30, f"expert {target} to move to live peers")
    new_owner = next(n for n, s in zip(survivors, after) if n.peer_id in s["spes"]["owners"][target])
    record = after[survivors.index(new_owner)]["spes"]["records"][label]
    assert record[1] is True and record[0] >= freshest_before, (record, freshest_before)
    steps_then = {n.peer_id: s["training"]["step"] for n, s in zip(survivors, after)}

    def trained_on() -> dict | None:
        s = new_owner.status()
        return s if (s["training"]["step"] >= steps_then[new_owner.peer_id] + 10
                     and s["spes"]["records"][label][0] > record[0]) else None

    # training continues, and the taken-over expert is trained again (its version moves on)
    s = wait_for(trained_on, 60, f"the new owner to train expert {target} on")
    assert set(s["spes"]["optimizer_experts"]) == set(s["spes"]["owned"])
    assert int(target) in s["spes"]["owned_experts"]
    # a killed owner comes back with its identity: it resumes from its checkpoint (expert records
    # included), catches up with the swarm, announces its capacity and gets experts again
    back = swarm.spawn(victims[0].name, seed=victims[0].seed, join=founder, data_dir=victims[0].data_dir, **NODE,
                       model=RECIPE["model"])
    swarm.wait_ready([back])
    everyone = [*survivors, back]
    ids = sorted(n.peer_id for n in everyone)

    def rejoined() -> list[dict] | None:
        statuses = swarm.statuses(everyone)
        ok = all(s["spes"].get("started") and s["spes"]["peers"] == ids for s in statuses)
        if not ok or len({str(s["spes"]["owners"]) for s in statuses}) != 1:
            return None
        # ... and each node has taken over what the map gives it (a node adopts a new map before its
        # experts: it first fetches their fresher copies)
        owners = statuses[0]["spes"]["owners"]
        held = all(sorted(s["spes"]["owned_experts"]) == sorted(int(e) for e, o in owners.items() if n.peer_id in o)
                   for n, s in zip(everyone, statuses, strict=True))
        return statuses if held else None

    statuses = wait_for(rejoined, 90, "the restarted node to join the expert table")
    owners = statuses[0]["spes"]["owners"]
    assert all(owners[str(e)] for e in range(EXPERTS)) and sum(map(len, owners.values())) == CAPACITY * 3
    assert len(statuses[-1]["spes"]["owned_experts"]) == CAPACITY
    assert "resuming from checkpoint" in back.stderr()
    assert swarm.stop_all(everyone) == [0] * len(everyone), swarm.logs()
    # the final checkpoint carries the node's expert records with the trainer state
    for node in everyone:
        saved = saved_records(load_checkpoint(node.data_dir / "checkpoint.safetensors").meta)
        assert saved is not None and len(saved) == EXPERTS * TINY_MOE.layers
        assert sum(r.owner for r in saved.values()) >= CAPACITY * TINY_MOE.layers
    saved = saved_records(load_checkpoint(new_owner.data_dir / "checkpoint.safetensors").meta)
    assert saved[(0, int(target))].version > record[0]  # trained on after the takeover


@pytest.mark.unit
def test_spes_settings_are_checked_with_one_line(tmp_path):
    def parse(*argv: str):
        return parse_node_config(["node", "--data-dir", str(tmp_path), "--monitor-port", "0", *argv], {})

    bad = {("--model", "dense", "--spes"): "SPES syncs the experts of a mixture-of-experts model",
           ("--model", "vector", "--spes"): "SPES syncs the experts",
           ("--spes", "--spes-sync-every", "3", "--spes-merge-every", "10"): "multiple of the sync interval",
           ("--spes", "--experts", "0"): "--experts",
           ("--spes", "--spes-refresh-codec", "fp8"): "refresh codec",
           ("--spes", "--spes-expert-codec", "topk"): "expert codec",
           ("--spes", "--spes-alpha0", "2"): "--spes-alpha0",
           ("--spes", "--spes-replication", "0"): "--spes-replication"}
    for argv, words in bad.items():
        with pytest.raises(ConfigError, match=words) as caught:
            parse(*argv)
        assert "\n" not in str(caught.value)
    config = parse("--spes", "--experts", "3", "--spes-replication", "1", "--spes-refresh-codec", "int8",
                   "--spes-merge-until", "40", "--spes-expert-codec", "bf16")
    assert config.training.spes and config.training.experts == 3
    recipe = SwarmSettings.from_doc(swarm_document(config, 1.0)).training
    assert recipe.spes is not None
    assert (recipe.spes.replication, recipe.spes.refresh_codec, recipe.spes.merge_until) == (1, "int8", 40)
    assert recipe.spes.expert_codec == "bf16"
    defaults = SwarmSettings.from_doc(swarm_document(parse("--spes"), 1.0)).training.spes
    # the defaults: int8 with error feedback everywhere, frozen copies refreshed by int8 deltas (<= 0.4x
    # the reference SPES's bytes; docs/spes.md)
    assert (defaults.expert_codec, defaults.shared_codec, defaults.refresh_codec, defaults.delta_refresh) == \
        ("int8", "int8", "int8", True)
    tuned = parse("--spes", "--spes-shared-codec", "fp32", "--no-spes-delta-refresh", "--spes-outer-lr", "0.7",
                  "--spes-outer-momentum", "0.5", "--spes-anchor-every", "2")
    spes = SwarmSettings.from_doc(swarm_document(tuned, 1.0)).training.spes
    assert (spes.shared_codec, spes.delta_refresh, spes.outer_lr, spes.outer_momentum, spes.anchor_every) == \
        ("fp32", False, 0.7, 0.5, 2)
    # without SPES the swarm document has no spes entry, so existing swarms keep their config hash
    assert "spes" not in swarm_document(parse(), 1.0)["payload"]
    assert SwarmSettings.from_doc(swarm_document(parse(), 1.0)).training.spes is None


@pytest.mark.multiprocess
def test_expert_directory_over_the_dht_publishes_signed_records_and_refuses_malformed_ones(tmp_path):
    import asyncio

    from test_discovery import member

    from gossip.spes import ExpertRecord
    from node.algorithms.spes.directory import DhtExpertDirectory
    from node.net.discovery import DiscoverySettings
    from node.net.records import experts_key

    heartbeat = 0.5
    settings = DiscoverySettings(swarm="spesdir", heartbeat_s=heartbeat)
    records_ttl_s = 12 * heartbeat
    records = {(0, e): ExpertRecord(e, f"{e:064x}", e % 2 == 0) for e in range(4)}

    async def until(check, timeout_s: float):
        async with asyncio.timeout(timeout_s):
            while not (found := await check()):
                await asyncio.sleep(0.1)
            return found

    async def scenario() -> None:
        async with member(tmp_path / "a.key", settings) as a, \
                member(tmp_path / "b.key", settings, a.discovery.local_record.maddrs) as b:
            # records live 12 heartbeats: the read below, after the keeper stops, must not race their expiry
            mine = DhtExpertDirectory(a.discovery, "spesdir", heartbeat, records_ttl_s)
            theirs = DhtExpertDirectory(b.discovery, "spesdir", heartbeat, records_ttl_s)
            async with asyncio.TaskGroup() as group:
                keeper = group.create_task(mine.run())
                await mine.publish(a.peer_id, records)
                with pytest.raises(ValueError):
                    await mine.publish(b.peer_id, records)  # a directory speaks for its own peer only
                seen = await until(lambda: _read_peer(theirs, a.peer_id), 15)
                assert seen == records
                keeper.cancel()
            # a malformed value, even in a's own signed subkey, is refused by every DHT node (node.net.validation)
            # and counted; a's last valid records stand until they expire
            await a.discovery.store_own(experts_key("spesdir"), b"\x93not-records", settings.ttl_s, what="test")
            refused = a.discovery.errors.get("dht_refused_malformed", 0) + b.discovery.errors.get(
                "dht_refused_malformed", 0)
            assert refused >= 1 and a.discovery.errors.get("dht_store_rejected", 0) >= 1
            await asyncio.sleep(heartbeat)
            assert (await theirs.read()).get(a.peer_id) == records and theirs.errors["expert_records_invalid"] == 0
            # nobody re-publishes: the record expires after its time to live
            await until(lambda: _absent(theirs, a.peer_id), records_ttl_s + 10)

    asyncio.run(scenario())


async def _read_peer(directory, peer_id: str):
    return (await directory.read()).get(peer_id)


async def _absent(directory, peer_id: str) -> bool:
    return peer_id not in await directory.read()


@pytest.mark.unit
def test_capacity_defaults_to_every_expert_on_cpu_and_saved_records_parse_or_are_ignored(tmp_path):
    import asyncio
    import json

    from gossip.spes import ExpertRecord, records_to_wire
    from node.algorithms.spes.swarm import CHECKPOINT_META_KEY, capacity_for
    from node.swarm.recipe import optimizer_config
    from node.train.data import load_corpus
    from node.train.trainer import Trainer, TrainerConfig

    corpus = load_corpus(None, tmp_path)
    config = TrainerConfig(optimizer=optimizer_config("dadam", 1e-3, 0, 0, 1, 1), batch_size=2,
                           context=TINY_MOE.context, device="cpu")
    trainer = Trainer(build(), config, peer_id="p", train_tokens=corpus.train, val_tokens=corpus.val)
    try:
        partition = ModelPartition.of(trainer.model)
        assert asyncio.run(capacity_for(trainer, partition, None)) == EXPERTS  # CPU: every expert
        assert asyncio.run(capacity_for(trainer, partition, 3)) == 3
        assert asyncio.run(capacity_for(trainer, partition, 99)) == EXPERTS  # at most the experts of a layer
    finally:
        trainer.close()
    records = {(0, 1): ExpertRecord(4, "ab" * 32, True)}
    assert saved_records({CHECKPOINT_META_KEY: json.dumps(records_to_wire(records))}) == records
    assert saved_records({}) is None
    assert saved_records({CHECKPOINT_META_KEY: json.dumps({"0.1": [-1, "x", True]})}) is None  # logged, ignored


@pytest.mark.unit
def test_murmur_status_text_names_the_owned_experts_and_the_capacity():
    from node.cli.status import format_status

    status = {"peer_id": "Qm1", "swarm": "s", "maddrs": [], "round": 3, "step": 9, "peers": [], "loss": 2.5,
              "training": {}, "bytes_sent": 1, "bytes_received": 2, "errors": {}, "experts": [1, 3],
              "spes": {"capacity": 2}}
    assert "experts  1, 3   (SPES capacity 2 per layer)" in format_status(status).splitlines()
    waiting = format_status({**status, "experts": []})
    assert "experts  none yet   (SPES capacity 2 per layer)" in waiting.splitlines()
    assert not any(line.startswith("experts") for line in format_status({**status, "experts": [], "spes": None})
                   .splitlines())
