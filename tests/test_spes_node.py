"""SPES on nodes over the in-memory transport (node.algorithms.spes.node): loss parity with dense training, training only
shared + owned parameters, bytes per sync against the analytic figure, unchanged experts never
re-sent, takeover from the freshest copy when all owners of an expert die, and refused bad copies."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from gossip.codecs import get_codec
from gossip.exchange import ExchangeSettings, GossipPeer
from gossip.lockstep import Lockstep
from gossip.memory import InMemoryNetwork, LinkModel
from gossip.optimizers import OptimizerConfig
from gossip.spes import (
    FETCH_PROTOCOL,
    ExpertRecord,
    SpesConfig,
    assign_experts,
    codec_image,
    content_hash,
    expert_label,
    refresh_source,
    sync_bytes_sent,
)
from gossip.transport import Stream
from gossip.wire import Expectation, encode_message, message_nbytes, read_message
from node.algorithms.dsgd import GossipTrainer
from node.algorithms.lockstep import drive
from node.algorithms.spes.node import InMemoryExpertDirectory, SpesNode
from node.algorithms.spes.partition import ModelPartition, spes_average, tensor_manifest
from node.train.data import Corpus, peer_shard
from node.train.models import ModelConfig, build_model
from node.train.trainer import Trainer, TrainerConfig, average_tensors
from topology import PeerRound

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

MOE = ModelConfig(context=32, layers=2, width=32, heads=4, experts=8, top_k=2, expert_hidden=64)
IDS = [f"peer{i}" for i in range(4)]
STEPS = 36
# SGD with momentum, so the optimizer holds state (one float per trained parameter) to assert on.
OPTIMIZER = OptimizerConfig(algorithm="dsgd", lr=0.05, momentum=0.9, warmup_steps=6, total_steps=STEPS, local_steps=2)
SETTINGS = ExchangeSettings(swarm="spes-test", config_hash="c0ffee", codec=get_codec("fp32"), exchange_timeout_s=30.0)
TOPOLOGY = "ring"




def make_trainer(corpus: Corpus, peer_id: str, optimizer: OptimizerConfig = OPTIMIZER) -> Trainer:
    config = TrainerConfig(optimizer=optimizer, batch_size=8, context=MOE.context, device="cpu", precision="fp32",
                           eval_batch_size=64, eval_batches=8)
    return Trainer(build_model(MOE), config, peer_id=peer_id, train_tokens=peer_shard(corpus, peer_id),
                   val_tokens=corpus.val)


async def spes_swarm(corpus: Corpus, config: SpesConfig, capacity: int, net: InMemoryNetwork,
                     directory: InMemoryExpertDirectory, settings: ExchangeSettings = SETTINGS,
                     optimizer: OptimizerConfig = OPTIMIZER) -> list[SpesNode]:
    ownership = assign_experts(IDS, dict.fromkeys(IDS, capacity), MOE.experts, MOE.layers, config.replication)
    nodes = [SpesNode(make_trainer(corpus, pid, optimizer), net.transport(pid), settings, config, ownership, directory)
             for pid in IDS]
    for node in nodes:
        await node.start()
    return nodes


async def run_lockstep(nodes: list[SpesNode], steps: int, lockstep: Lockstep):
    async with asyncio.timeout(900):
        return await drive(nodes, steps, lockstep)


def close(nodes: list[SpesNode]) -> None:
    for node in nodes:
        node.trainer.close()


# ---- parity with dense training, and what each node trains -------------------------------------------

# Adam, as the project's default optimizer: with SGD a CPU-sized run is decided by the embeddings and
# the head alone (dense, SPES and a swarm that never trains an expert all end within 1% of each other),
# so it could not tell SPES from not training experts at all. With Adam the experts matter: the
# frozen-experts control below ends 8-10% behind dense (when this was written).
PARITY_OPTIMIZER = OptimizerConfig(algorithm="dadam", lr=1.5e-2, warmup_steps=6, total_steps=STEPS)


@dataclass(frozen=True)
class DenseRun:
    initial_loss: float
    loss: float
    frozen_experts_loss: float  # the control: the same swarm training only the shared weights
    optimizer_state_bytes: int


@pytest.fixture(scope="module")
def dense(corpus: Corpus) -> DenseRun:
    """Dense decentralized training (DAdam over the same ring) on the same MoE model: every node
    trains and mixes every parameter; and the same with every expert frozen at its initial value."""

    async def run(train_experts: bool) -> tuple[float, float, int]:
        net, nodes = InMemoryNetwork(), []
        for pid in IDS:
            trainer = make_trainer(corpus, pid, PARITY_OPTIMIZER)
            if not train_experts:
                await trainer.set_trainable(set(ModelPartition.of(trainer.model).shared).__contains__)
            peer = GossipPeer(net.transport(pid), SETTINGS, await trainer.tensors())
            await peer.start()
            nodes.append(GossipTrainer(trainer, peer))
        initial = await nodes[0].trainer.evaluate()
        lockstep = Lockstep(IDS, TOPOLOGY)
        async with asyncio.timeout(900):
            await drive(nodes, STEPS, lockstep)
        average = average_tensors([await n.trainer.tensors() for n in nodes])
        loss = await nodes[0].trainer.evaluate(average)
        state_bytes = nodes[0].trainer.optimizer_state_bytes
        for node in nodes:
            node.trainer.close()
        return initial, loss, state_bytes

    async def main() -> DenseRun:
        initial, loss, state_bytes = await run(train_experts=True)
        _, frozen_loss, _ = await run(train_experts=False)
        return DenseRun(initial, loss, frozen_loss, state_bytes)

    return asyncio.run(main())


@pytest.mark.slow
@pytest.mark.parametrize(("replication", "capacity"), [(1, 2), (2, 4)])
def test_spes_stays_within_5_percent_of_dense_training_while_training_only_shared_and_owned_experts(
        corpus: Corpus, dense: DenseRun, replication: int, capacity: int) -> None:
    """4 nodes, 8 experts per layer, each owning 2 (r = 1) or 4 (r = 2); same optimizer, topology,
    sample budget and sync interval (S = 1) as the dense run; merge warm-up on until step 18."""
    config = SpesConfig(sync_every=1, merge_every=5, merge_until=18, alpha0=0.1, replication=replication)

    async def main():
        net, directory = InMemoryNetwork(), InMemoryExpertDirectory()
        nodes = await spes_swarm(corpus, config, capacity, net, directory, optimizer=PARITY_OPTIMIZER)
        reports = await run_lockstep(nodes, STEPS, Lockstep(IDS, TOPOLOGY))
        members = {n.peer_id: await n.trainer.tensors() for n in nodes}
        loss = await nodes[0].trainer.evaluate(spes_average(members, nodes[0].ownership, nodes[0].partition))
        close(nodes)
        return nodes, reports, loss

    nodes, reports, loss = asyncio.run(main())
    # the comparison can tell: not training the experts at all falls outside the 5% band
    assert dense.frozen_experts_loss > 1.05 * dense.loss, (dense.frozen_experts_loss, dense.loss)
    assert loss < dense.initial_loss - 2.0, "the SPES swarm did not learn"
    assert loss <= 1.05 * dense.loss, f"SPES (r={replication}) swarm-average loss {loss:.3f} vs dense {dense.loss:.3f}"

    partition = nodes[0].partition
    sizes = {name: p.numel() for name, p in build_model(MOE).named_parameters()}
    for node in nodes:
        assert len(node.owned) == MOE.layers * capacity
        expected = set(partition.shared) | set(partition.names_of(node.owned))
        assert set(node.trainer.trainable_parameter_names) == expected
        assert node.trainer.optimizer_parameter_names == expected
        # measured: the Adam moments the optimizer really holds, two float32 per trained value
        assert node.trainer.optimizer_state_bytes == 8 * sum(sizes[n] for n in expected)
    expert_share = sum(sizes[n] for names in partition.experts.values() for n in names) / sum(sizes.values())
    ratio = nodes[0].trainer.optimizer_state_bytes / dense.optimizer_state_bytes
    assert ratio == pytest.approx(1 - expert_share * (1 - capacity / MOE.experts), abs=1e-9)

    merges = [(r.sync.step, r.sync.merge_alpha) for r in reports[0] if r.sync is not None and r.sync.merge_alpha > 0]
    assert merges == [(s, pytest.approx(0.1 * (1 - s / 18))) for s in (5, 10, 15)]
    syncs = [r.sync for r in reports[0] if r.sync is not None]
    assert len(syncs) == STEPS and all(not s.refresh_skipped for s in syncs)


def test_frozen_experts_get_no_gradient_and_can_be_stored_in_bf16(corpus: Corpus) -> None:
    config = SpesConfig(replication=1, frozen_bf16=True)

    async def main() -> None:
        ownership = assign_experts(["a", "b"], {"a": 4, "b": 4}, MOE.experts, MOE.layers, 1)
        trainer = make_trainer(corpus, "a")
        fp32_param_bytes = sum(p.nbytes for p in trainer.model.parameters())
        node = SpesNode(trainer, InMemoryNetwork().transport("a"), SETTINGS, config, ownership, InMemoryExpertDirectory())
        await node.start()
        partition = node.partition
        frozen = set(partition.names_of(frozenset(partition.experts) - node.owned))
        before = await trainer.tensors(sorted(frozen))
        stats = await trainer.compute_update()
        params = dict(trainer.model.named_parameters())
        assert np.isfinite(stats.loss)
        assert all(params[n].grad is None and params[n].dtype == torch.bfloat16 for n in frozen)
        trained = [n for n in trainer.trainable_parameter_names if params[n].grad is not None]
        assert set(partition.shared) <= set(trained)
        assert all(params[n].dtype == torch.float32 for n in trainer.trainable_parameter_names)
        await trainer.apply_update()
        after = await trainer.tensors(sorted(frozen))
        assert all(np.array_equal(before[n], after[n]) for n in frozen)
        stored = sum(p.nbytes for p in trainer.model.parameters())
        frozen_values = sum(params[n].numel() for n in frozen)
        assert stored == fp32_param_bytes - 2 * frozen_values
        # taking an expert over makes it float32 and trainable again
        await node.set_ownership(assign_experts(["a"], {"a": 8}, MOE.experts, MOE.layers, 1))
        assert all(params[n].dtype == torch.float32 and params[n].requires_grad for n in frozen)
        trainer.close()

    asyncio.run(main())


# ---- traffic ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_bytes_per_sync_match_the_analytic_figure_and_unchanged_experts_are_never_resent(corpus: Corpus) -> None:
    """r = 2, ring: each node sends its shared weights to 2 neighbours, each owned expert to its
    co-owner and serves the changed frozen copies assigned to it (as int8 deltas, the defaults); a sync
    with nothing changed moves no expert copy at all. Lossless mixing here: a mix in int8 with error
    feedback changes the weights a little at every sync, trained or not."""
    config = SpesConfig(sync_every=1, merge_every=1, merge_until=0, replication=2, shared_codec="fp32",
                        expert_codec="fp32")
    optimizer = OptimizerConfig(algorithm="dsgd", lr=0.05, momentum=0.9)

    async def main() -> None:
        net, directory = InMemoryNetwork(), InMemoryExpertDirectory()
        nodes = await spes_swarm(corpus, config, 4, net, directory, optimizer=optimizer)
        lockstep = Lockstep(IDS, TOPOLOGY)
        await run_lockstep(nodes, 2, lockstep)
        before = {n.peer_id: n.bytes_sent for n in nodes}
        fetched_before = {n.peer_id: n.fetch_stats.fetched for n in nodes}
        reports = await run_lockstep(nodes, 1, lockstep)
        sync_index = reports[0][0].sync.sync_index
        records = await directory.read()
        partition, ownership, trainer = nodes[0].partition, nodes[0].ownership, nodes[0].trainer
        changed = [key for key in partition.experts
                   if all(records[o][key].version == sync_index for o in ownership.owners[key])]
        assert len(changed) == len(partition.experts)  # every expert was trained in that step
        shared_bytes = message_nbytes(tensor_manifest(list(partition.shared), trainer), get_codec(config.shared_codec))
        some_expert = next(iter(partition.experts.values()))
        expert_bytes = message_nbytes(tensor_manifest(list(some_expert), trainer), get_codec(config.expert_codec))
        refresh_bytes = message_nbytes(tensor_manifest(list(some_expert), trainer), get_codec(config.refresh_codec))
        for node in nodes:
            served = sum(1 for key in changed for q in IDS if q not in ownership.owners[key]
                         and refresh_source(key, ownership, records, q) == node.peer_id)
            plan = lockstep.plan(node.peer_id, sync_index)
            analytic = sync_bytes_sent(shared_bytes, len(plan.out_peers), expert_bytes,
                                       [len(ownership.co_owners(k, node.peer_id)) for k in node.owned],
                                       refresh_bytes, served)
            measured = node.bytes_sent - before[node.peer_id]
            assert abs(measured - analytic.total) <= 0.10 * analytic.total, (node.peer_id, measured, analytic)
            fetched = node.fetch_stats.fetched - fetched_before[node.peer_id]
            assert fetched == sum(1 for key in changed if node.peer_id not in ownership.owners[key])
            assert node.fetch_stats.deltas == node.fetch_stats.fetched, "every refresh travelled as a delta"

        # nothing trained since: owners publish the same hashes, so no frozen copy moves
        versions = await directory.read()
        fetch_bytes = {n.peer_id: n.fetch_stats.bytes_sent + n.fetch_stats.bytes_received for n in nodes}
        async with asyncio.TaskGroup() as group:
            again = [group.create_task(n.sync(sync_index + 1, lockstep.plan(n.peer_id, sync_index + 1),
                                              lockstep.published)) for n in nodes]
        assert all(task.result().refreshed == () for task in again)
        assert {n.peer_id: n.fetch_stats.bytes_sent + n.fetch_stats.bytes_received for n in nodes} == fetch_bytes
        assert {p: {k: r.version for k, r in rs.items()} for p, rs in (await directory.read()).items()} == \
               {p: {k: r.version for k, r in rs.items()} for p, rs in versions.items()}
        close(nodes)

    asyncio.run(main())




# ---- churn ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_when_both_owners_of_an_expert_die_a_live_peer_continues_it_from_the_freshest_copy(corpus: Corpus) -> None:
    """r = 2: expert 0 of each layer is owned by peer0 and peer1 only. peer2 misses the last refresh
    (its links to both are down), so its copy is stale while peer3's is current. Both owners are
    killed; the new ownership over {peer2, peer3} gives expert 0 to peer2, which must continue from
    peer3's fresher copy, and training goes on with the expert trained by its new owner."""
    config = SpesConfig(sync_every=1, merge_every=1, merge_until=0, replication=2)
    settings = ExchangeSettings(swarm="spes-test", config_hash="c0ffee", codec=get_codec("fp32"), exchange_timeout_s=2.0)
    key = (0, 0)

    async def main() -> None:
        net, directory = InMemoryNetwork(), InMemoryExpertDirectory()
        nodes = await spes_swarm(corpus, config, 4, net, directory, settings)
        by_id = {n.peer_id: n for n in nodes}
        assert nodes[0].ownership.owners[key] == ("peer0", "peer1")
        lockstep = Lockstep(IDS, TOPOLOGY)
        await run_lockstep(nodes, 2, lockstep)
        stale_version = by_id["peer2"].records()[key].version
        for dead in ("peer0", "peer1"):
            net.set_link("peer2", dead, LinkModel(loss=1.0))
        reports = await run_lockstep(nodes, 1, lockstep)
        fresh = by_id["peer0"].records()[key]
        assert fresh.version > stale_version
        assert reports[2][0].sync.refresh_skipped[key] == "unreachable"
        assert by_id["peer2"].records()[key].version == stale_version
        # peer3's frozen copy is one a live owner published at the freshest version: either co-owner's (their
        # int8-mixed copies may differ in hash at one version; which one it fetched depends on when each
        # published)
        held = by_id["peer3"].records()[key]
        sources = [p for p in ("peer0", "peer1") if by_id[p].records()[key] == ExpertRecord(held.version, held.hash, True)]
        assert not held.owner and held.version >= fresh.version and sources
        names = nodes[0].partition.experts[key]
        published = by_id[sources[0]]._snapshots[key]

        for dead in ("peer0", "peer1"):
            await net.kill(dead)
            directory.withdraw(dead)
            by_id[dead].trainer.close()
        live = ["peer2", "peer3"]
        survivors = [by_id[p] for p in live]
        ownership = assign_experts(live, dict.fromkeys(live, 4), MOE.experts, MOE.layers, 2)
        assert ownership.owners[key] == ("peer2",)
        await asyncio.gather(*(n.set_ownership(ownership) for n in survivors))
        took_over = await by_id["peer2"].trainer.tensors(names)
        assert all(np.array_equal(took_over[n], published[n]) for n in names)
        assert by_id["peer2"].records()[key] == ExpertRecord(held.version, held.hash, True)
        assert by_id["peer2"].fetch_stats.fetched >= 1

        loss_before = await by_id["peer2"].trainer.evaluate()
        after = await run_lockstep(survivors, 6, Lockstep(live, TOPOLOGY))
        assert all(not r.sync.refresh_skipped for rs in after for r in rs)
        trained = await by_id["peer2"].trainer.tensors(names)
        assert not all(np.array_equal(trained[n], published[n]) for n in names)
        assert by_id["peer2"].records()[key].version > held.version
        # peer3's frozen copy follows the new owner: it is exactly the copy peer2 published (a sum of int8
        # deltas, so within the codec's error of peer2's weights)
        copy = await by_id["peer3"].trainer.tensors(names)
        assert content_hash([copy[n] for n in names]) == by_id["peer2"].records()[key].hash
        for n in names:
            np.testing.assert_allclose(copy[n], trained[n], rtol=0, atol=0.02 * np.abs(trained[n]).max())
        assert await by_id["peer2"].trainer.evaluate() < loss_before
        close(survivors)

    asyncio.run(main())


# ---- bad copies -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("lie", ["hash", "expert", "manifest", "delta_hash", "delta_base", "delta_codec"])
def test_a_copy_that_is_not_what_was_asked_for_is_refused_and_counted(corpus: Corpus, lie: str) -> None:
    """A peer listed as an owner answers a fetch with values that do not hash to what it declares,
    with another expert, with another manifest, or with a delta whose sum does not hash as declared,
    that applies to another copy than the asker's, or that travels in another codec than the refresh
    codec: the copy is refused, the error counted by kind, and the local copy stays as it was."""
    config = SpesConfig(replication=1)
    delta = lie.startswith("delta")

    async def main() -> None:
        net, directory = InMemoryNetwork(), InMemoryExpertDirectory()
        ownership = assign_experts(["a", "liar"], {"a": 4, "liar": 4}, MOE.experts, MOE.layers, 1)
        key = min(ownership.owned_by("liar"))
        node = SpesNode(make_trainer(corpus, "a"), net.transport("a"), SETTINGS, config, ownership, directory)
        await node.start()
        names = node.partition.experts[key]
        sizes = {n: p.numel() for n, p in node.trainer.model.named_parameters()}
        values = {n: np.full(sizes[n], 0.5, np.float32) for n in names}
        declared = content_hash(codec_image(list(values.values()), config.image_codec))
        held = node.records()[key].hash
        if delta:  # a delta the asker's copy plus which is declared to hash to `declared`: it does not
            declared = "f" * 64 if lie == "delta_hash" else declared
        await directory.publish("liar", {key: ExpertRecord(1, "f" * 64 if lie == "hash" else declared, True)})
        if lie == "manifest":
            values = {f"{n}.x": v for n, v in values.items()}
        label = expert_label(key if lie != "expert" else (key[0], key[1] + 1))
        liar = net.transport("liar")

        async def serve(stream: Stream) -> None:
            await read_message(stream.read_exactly, expected=Expectation("spes-test", "c0ffee"), timeout=5)
            meta = {"expert": label, "version": 1, "hash": "f" * 64 if lie == "hash" else declared}
            kind, codec = "expert", get_codec(config.image_codec)
            if delta:
                meta["base"] = "e" * 64 if lie == "delta_base" else held
                kind, codec = "delta", get_codec("bf16" if lie == "delta_codec" else config.refresh_codec)
            for frame in encode_message(values, codec, swarm="spes-test", config_hash="c0ffee",
                                        sender="liar", round=0, step=0, kind=kind, meta=meta):
                await stream.write(frame)

        await liar.serve(FETCH_PROTOCOL, serve)
        before = await node.trainer.tensors(names)
        report = await node.sync(1, PeerRound(1.0, {}, ()))
        kind = {"hash": "hash_mismatch", "expert": "bad_schema", "manifest": "manifest_mismatch",
                "delta_hash": "hash_mismatch", "delta_base": "bad_schema", "delta_codec": "unknown_codec"}[lie]
        assert report.refresh_skipped[key] == kind
        assert node.fetch_stats.errors[kind] == 1
        assert node.records()[key].version == 0
        after = await node.trainer.tensors(names)
        assert all(np.array_equal(before[n], after[n]) for n in names)
        node.trainer.close()

    asyncio.run(main())


def test_spes_refuses_a_dense_model(corpus: Corpus) -> None:
    with pytest.raises(ValueError, match="mixture-of-experts"):
        ModelPartition.of(build_model(ModelConfig(context=32, layers=1, width=32, heads=4)))


def test_a_restarted_node_keeps_a_copys_version_only_if_its_content_still_matches(corpus: Corpus) -> None:
    async def main() -> None:
        ownership = assign_experts(["a", "b"], {"a": 4, "b": 4}, MOE.experts, MOE.layers, 1)
        node = SpesNode(make_trainer(corpus, "a"), InMemoryNetwork().transport("a"), SETTINGS, SpesConfig(replication=1),
                        ownership, InMemoryExpertDirectory())
        kept, changed = sorted(node.partition.experts)[:2]
        first = SpesNode(make_trainer(corpus, "a"), InMemoryNetwork().transport("a"), SETTINGS,
                         SpesConfig(replication=1), ownership, InMemoryExpertDirectory())
        await first.start()
        records = first.records()
        saved = {kept: replace(records[kept], version=7), changed: ExpertRecord(9, "e" * 64, False)}
        await node.start(saved)
        assert node.records()[kept].version == 7
        assert node.records()[changed].version == 0
        for n in (first, node):
            n.trainer.close()

    asyncio.run(main())


def test_the_spes_swarm_average_takes_shared_weights_from_everyone_and_each_expert_from_its_owners() -> None:
    partition = ModelPartition(shared=("emb",), experts={(0, 0): ("e0.w1", "e0.w2"), (0, 1): ("e1.w1", "e1.w2")},
                               experts_per_layer=2, layers=1)
    rng = np.random.default_rng(0)
    members = {p: {name: rng.standard_normal(50).astype(np.float32) for name in ("emb", "e0.w1", "e0.w2", "e1.w1", "e1.w2")}
               for p in ("a", "b", "c")}

    @dataclass(frozen=True)
    class Owners:
        owners: dict

    # expert 0 is owned by a and c; expert 1's owner ("gone") did not answer: every member's copy counts
    average = spes_average(members, Owners({(0, 0): ("a", "c"), (0, 1): ("gone",)}), partition)

    def mean(name: str, peers: tuple[str, ...]) -> np.ndarray:
        return np.mean(np.stack([members[p][name].astype(np.float64) for p in peers]), axis=0)

    expected = {"emb": mean("emb", ("a", "b", "c")), "e0.w1": mean("e0.w1", ("a", "c")),
                "e0.w2": mean("e0.w2", ("a", "c")), "e1.w1": mean("e1.w1", ("a", "b", "c")),
                "e1.w2": mean("e1.w2", ("a", "b", "c"))}
    assert sorted(average) == sorted(expected)
    for name, values in expected.items():
        assert average[name].dtype == np.float32
        np.testing.assert_allclose(average[name], values, rtol=0, atol=1e-6, err_msg=name)


# ---- hostile records ------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["directory", "reply"])
def test_versions_beyond_the_sync_index_bound_are_ignored_and_counted(corpus: Corpus, where: str) -> None:
    """A peer that owns experts claims version 2^62 for them, in its directory records or only in its
    fetch replies: the node neither fetches from it nor adopts the version, and counts the claims."""
    config = SpesConfig(replication=1)
    huge = 2**62

    async def main() -> None:
        net, directory = InMemoryNetwork(), InMemoryExpertDirectory()
        ownership = assign_experts(["a", "liar"], {"a": 4, "liar": 4}, MOE.experts, MOE.layers, 1)
        node = SpesNode(make_trainer(corpus, "a"), net.transport("a"), SETTINGS, config, ownership, directory)
        await node.start()
        keys = sorted(ownership.owned_by("liar"))
        sizes = {n: p.numel() for n, p in node.trainer.model.named_parameters()}
        copies = {key: {n: np.full(sizes[n], 0.5, np.float32) for n in node.partition.experts[key]} for key in keys}
        hashes = {key: content_hash(codec_image(list(copies[key].values()), config.image_codec)) for key in keys}
        listed = huge if where == "directory" else 1
        await directory.publish("liar", {key: ExpertRecord(listed, hashes[key], True) for key in keys})
        asked: list[str] = []

        async def serve(stream: Stream) -> None:
            request = await read_message(stream.read_exactly, expected=Expectation("spes-test", "c0ffee"), timeout=5)
            label = str(request.header.meta["expert"])
            asked.append(label)
            key = next(k for k in keys if expert_label(k) == label)
            meta = {"expert": label, "version": huge, "hash": hashes[key]}
            for frame in encode_message(copies[key], get_codec(config.image_codec), swarm="spes-test",
                                        config_hash="c0ffee", sender="liar", round=0, step=0, kind="expert",
                                        meta=meta):
                await stream.write(frame)

        await net.transport("liar").serve(FETCH_PROTOCOL, serve)
        before = await node.trainer.tensors(node.partition.names_of(frozenset(keys)))
        report = await node.sync(1, PeerRound(1.0, {}, ()))
        if where == "directory":
            assert asked == [] and node.fetch_stats.errors["version_out_of_bounds"] == len(keys)
            assert set(report.refresh_skipped.values()) == {"no_record"}
        else:
            assert len(asked) == len(keys)
            assert set(report.refresh_skipped.values()) == {"version_out_of_bounds"}
        assert all(r.version <= node.version_bound() for r in node.records().values())
        after = await node.trainer.tensors(node.partition.names_of(frozenset(keys)))
        assert all(np.array_equal(before[n], after[n]) for n in before)
        node.trainer.close()

    asyncio.run(main())
