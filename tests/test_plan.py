"""The runtime model of `murmur plan` (gossip/plan.py) against hand-computed cases and against the bytes
real exchanges count, and the `murmur plan` command line (JSON shape, bad flags)."""

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gossip.choco import ChocoSettings, ChocoState, typical_meta
from gossip.codecs import Int8Codec, TopKCodec, get_codec
from gossip.exchange import DUPLEX, ExchangeSettings, GossipPeer
from gossip.lockstep import Lockstep
from gossip.memory import InMemoryNetwork
from gossip.plan import (
    Algorithm,
    Compression,
    HeaderValues,
    LinkSpec,
    MessageSizes,
    PlanConfig,
    RoleCounts,
    allgather_sync,
    allreduce_sync,
    bytes_per_node,
    fragment_groups,
    gossip_estimate,
    gossip_round,
    make_plan,
    round_roles,
    specs_for_vectors,
)
from gossip.wire import encode_message
from topology import MembershipView, TopologySpec, build_topology, peer_round

pytestmark = pytest.mark.unit

MURMUR = [str(Path(sys.executable).with_name("murmur"))]
LINK = LinkSpec(bandwidth_mbit=8.0, latency_ms=10.0, efficiency=1.0)  # 1 MB/s of message bytes


def config(topology: str = "ring", peers: int = 8, **kw) -> PlanConfig:
    return PlanConfig(specs_for_vectors({"w": 250_000, "b": 1000}), kw.pop("step_time_s", 0.5), kw.pop("link", LINK),
                      peers, TopologySpec(topology), **kw)


def test_ring_allreduce_moves_2_n_minus_1_over_n_of_the_payload():
    for n in (2, 4, 8, 64):
        cost = allreduce_sync(1_000_000, n, LINK)
        assert cost.sent_bytes == cost.received_bytes == pytest.approx(2 * (n - 1) / n * 1_000_000)
        # 2(n-1) steps of one latency and one payload/n chunk at 1 MB/s
        assert cost.time_s == pytest.approx(2 * (n - 1) * (0.010 + 1.0 / n))


def test_sparse_payloads_are_all_gathered():
    cost = allgather_sync(10_000, 8, LINK)
    assert cost.sent_bytes == pytest.approx(7 * 10_000) and cost.time_s == pytest.approx(7 * (0.010 + 0.01))
    plan = make_plan(config(compression=Compression.CHOCO, codec=TopKCodec(0.01)))
    k = 2500 + 10  # top-k keeps ceil(0.01 n) entries of each tensor, 8 bytes each
    assert plan.allreduce.sent_bytes_per_step == pytest.approx(7 * 8 * k)


def test_roles_follow_the_exchange_protocol():
    # ring: symmetric edges, the smaller id asks; rank 0 asks both neighbours, the last rank answers both
    roles = round_roles(build_topology("ring", 8), 0)
    assert roles[0] == RoleCounts(asks=2) and roles[7] == RoleCounts(answers=2)
    assert all(r == RoleCounts(asks=1, answers=1) for r in roles[1:7])
    # one-peer exponential over 8: offsets 1 and 2 are directed pulls, offset 4 pairs i with i + 4 both ways
    topo = build_topology("one-peer-exp", 8)
    assert all(r == RoleCounts(pulls=1, serves=1) for r in round_roles(topo, 0))
    assert all(r == RoleCounts(pulls=1, serves=1) for r in round_roles(topo, 1))
    assert [r.asks for r in round_roles(topo, 2)] == [1, 1, 1, 1, 0, 0, 0, 0]
    # degrees agree with the topology's own
    for name, degree in (("ring", 2), ("torus", 4), ("complete", 7), ("hypercube", 1), ("static-exp", 3)):
        topo = build_topology(name, 9 if name == "torus" else 8)  # a 3 x 3 torus: 4 distinct neighbours
        assert max(r.asks + r.answers + r.pulls for t in range(topo.period) for r in round_roles(topo, t)) == degree
        assert topo.degree == degree


def test_message_sizes_are_the_wire_sizes():
    header = HeaderValues(swarm="s", config_hash="c" * 64, sender="Q" * 46, round=700, step=70_000)
    tensors = {"w": np.ones(3000, np.float32), "b": np.ones(17, np.float32)}
    specs = specs_for_vectors({"w": 3000, "b": 17})
    for codec in (get_codec("fp32"), get_codec("bf16"), Int8Codec(), TopKCodec(0.1)):
        sizes = MessageSizes.of(specs, codec, header, typical_meta(5), duplex=False)  # CHOCO: no duplex flag

        def wire(kind, tensors, meta=None):
            frames = encode_message(tensors, codec, swarm="s", config_hash="c" * 64, sender="Q" * 46, round=700,
                                    step=70_000, kind=kind, meta=meta)
            return sum(len(f) for f in frames)

        assert sizes.exchange == wire("exchange", tensors, typical_meta(5))
        assert sizes.reply == wire("reply", tensors, typical_meta(5))
        assert sizes.ack == wire("ack", {}) and sizes.pull == wire("pull", {})
        # a dense exchange's request carries the asker's duplex flag (gossip.exchange.DUPLEX), its reply not
        dense = MessageSizes.of(specs, codec, header)
        assert dense.exchange == wire("exchange", tensors, {DUPLEX: True}) and dense.reply == wire("reply", tensors)


def test_ring_round_by_hand():
    sizes = MessageSizes(exchange=1_000_000, reply=1_000_000, ack=100, pull=90)
    cost = gossip_round(build_topology("ring", 8), sizes, LINK)
    # every edge carries a request, its ack and a reply; 8 edges over 8 nodes
    assert cost.sent_bytes == cost.received_bytes == pytest.approx(2_000_100)
    # rank 0 sends both requests and receives both replies at once (duplex): 2 messages in a row each way
    # at 1 MB/s, plus 3 round trips; compressed gossip's exchanges answer after the request: 4 in a row
    assert cost.time_s == pytest.approx(2.0 + 3 * 0.020)
    sequential = gossip_round(build_topology("ring", 8), dataclasses.replace(sizes, duplex=False), LINK)
    assert sequential.time_s == pytest.approx(4.0 + 3 * 0.020)


def test_pull_round_by_hand():
    sizes = MessageSizes(exchange=1_000_000, reply=1_000_000, ack=100, pull=90)
    cost = gossip_round(build_topology("static-exp", 7), sizes, LINK)
    # offsets 1, 2, 4 mod 7 never pair up: every rank pulls from 3 and serves 3, 3 replies out and 3 in
    # concurrently; 2 round trips
    assert cost.sent_bytes == pytest.approx(3 * 1_000_090)
    assert cost.time_s == pytest.approx(3.0 + 2 * 0.020)


def test_step_times_by_algorithm():
    base = config("hypercube", step_time_s=0.5)
    sync = gossip_estimate(base).sync_s
    assert sync > 0.5  # a pair exchange of 1 MB each way takes about 2 s on this link
    assert gossip_estimate(base).step_s == pytest.approx(max(0.5, sync))  # dadam overlaps the round
    dsgd = gossip_estimate(config("hypercube", algorithm=Algorithm.DSGD, local_steps=4))
    assert dsgd.step_s == pytest.approx(0.5 + sync / 4)
    dadam_h = gossip_estimate(config("hypercube", local_steps=4))
    assert dadam_h.step_s == pytest.approx((3 * 0.5 + max(0.5, sync)) / 4)
    # DiLoCo without anchor rounds: one round of the pseudo-gradients per sync, in the same codec
    diloco = gossip_estimate(config("hypercube", algorithm=Algorithm.DILOCO, local_steps=2, anchor_every=0,
                                    overlap=True))
    assert diloco.sync_s == pytest.approx(sync)
    assert diloco.step_s == pytest.approx(max(0.5, sync / 2))  # overlapped with the next inner phase
    serial = gossip_estimate(config("hypercube", algorithm=Algorithm.DILOCO, local_steps=2, anchor_every=0))
    assert serial.step_s == pytest.approx(0.5 + sync / 2)  # the daemon's default: not overlapped


def test_a_rounds_local_work_adds_to_the_step():
    sync = gossip_estimate(config("hypercube")).sync_s
    dadam = gossip_estimate(config("hypercube", round_cpu_s=0.3))
    assert dadam.step_s == pytest.approx(max(0.5, sync) + 0.3)  # on the cores that compute, not hidden
    dsgd = gossip_estimate(config("hypercube", algorithm=Algorithm.DSGD, local_steps=4, round_cpu_s=0.3))
    assert dsgd.step_s == pytest.approx(0.5 + (sync + 0.3) / 4)
    diloco = gossip_estimate(config("hypercube", algorithm=Algorithm.DILOCO, local_steps=10, round_cpu_s=0.3,
                                    anchor_every=0, overlap=True))
    assert diloco.step_s == pytest.approx(max(0.5 + 0.03, (sync + 0.3) / 10))


def test_measured_local_work_of_a_round():
    from node.cli.plan import Measure, measure_costs

    specs = specs_for_vectors({"w": 200_000})
    only_rounds = Measure(None, 0, 4, 32, 1, "dadam", 1, round_repeats=1)
    hypercube = measure_costs(only_rounds, specs, get_codec("fp32"), Compression.NONE, build_topology("hypercube", 8))
    assert hypercube.step is None and 0 < hypercube.round_cpu_s < 30
    choco = measure_costs(only_rounds, specs, TopKCodec(0.05), Compression.CHOCO, build_topology("ring", 8))
    assert 0 < choco.round_cpu_s < 30


def test_fragments_split_bytes_and_syncs():
    specs = specs_for_vectors({f"t{i}": 1000 * (i + 1) for i in range(6)})
    one_cfg = PlanConfig(specs, 0.1, LINK, 4, TopologySpec("ring"), algorithm=Algorithm.DILOCO, local_steps=30)
    groups = fragment_groups(dataclasses.replace(one_cfg, fragments=3))
    # the daemon's cut (gossip.diloco.fragment_partition): largest tensor first into the lightest group
    assert sorted(s for g in groups for s in g) == sorted(specs) and all(groups)
    assert [[s.name for s in g] for g in groups] == [["t0", "t5"], ["t1", "t4"], ["t2", "t3"]]
    one = gossip_estimate(one_cfg)
    three = gossip_estimate(dataclasses.replace(one_cfg, fragments=3))
    assert three.syncs_per_step == pytest.approx(3 * one.syncs_per_step)
    # the same tensors cross once per period either way; fragments only add two headers' worth each
    assert three.sent_bytes_per_step == pytest.approx(one.sent_bytes_per_step, rel=0.05)
    assert three.sync_s < one.sync_s


def test_winner_and_speedup():
    slow_link = config("one-peer-exp", peers=64, link=LinkSpec(1.0, 50.0, 1.0))
    plan = make_plan(slow_link)
    # all-reduce: 2*63 steps of latency; gossip: one pull per round
    assert plan.winner == "gossip" and plan.speedup > 1.5
    assert plan.speedup == pytest.approx(plan.allreduce.step_s / plan.gossip.step_s)
    complete = make_plan(config("complete", peers=16))
    assert complete.winner == "allreduce" and complete.speedup < 1


def test_bytes_per_node_after_steps():
    c = config("ring", peers=4)
    e = gossip_estimate(c)
    assert bytes_per_node(c, 10) == pytest.approx(10 * (e.sent_bytes_per_step + e.received_bytes_per_step))


def test_bad_configs_are_refused():
    for bad in ({"local_steps": 0}, {"fragments": 2}, {"peers": 1}, {"step_time_s": -1.0},
                {"algorithm": Algorithm.DILOCO, "compression": Compression.CHOCO}):
        kw = dict(bad)
        with pytest.raises(ValueError):
            config(peers=kw.pop("peers", 8), **kw)


@pytest.mark.parametrize("compression", [Compression.NONE, Compression.CHOCO])
def test_predicted_bytes_equal_counted_bytes_of_real_rounds(compression):
    """Four GossipPeers over the in-memory transport run rounds on a ring; the bytes they count equal the
    plan's prediction for the same manifest and header fields, to the byte."""
    n, rounds, step = 4, 3, 5000
    ids = [f"Qm{i:044d}" for i in range(n)]
    sizes = {"w": 4000, "b": 10}
    codec = TopKCodec(0.05) if compression is Compression.CHOCO else get_codec("fp16")
    plan = PlanConfig(specs_for_vectors(sizes), 0.1, LINK, n, TopologySpec("ring"), codec=codec,
                      compression=compression,
                      header=HeaderValues(swarm="plan", config_hash="h" * 64, sender=ids[0], round=3000, step=step),
                      meta=typical_meta(1) if compression is Compression.CHOCO else None)
    predicted = gossip_estimate(plan)

    async def run() -> list[int]:
        net = InMemoryNetwork()
        rng = np.random.default_rng(0)
        settings = ExchangeSettings(swarm="plan", config_hash="h" * 64, codec=codec if compression is Compression.NONE
                                    else get_codec("fp32"), exchange_timeout_s=10)
        anchor = {name: np.zeros(size, np.float32) for name, size in sizes.items()}
        peers = []
        for pid in ids:
            choco = ChocoState(ChocoSettings(codec, 0.5), anchor) if compression is Compression.CHOCO else None
            tensors = {name: rng.standard_normal(size).astype(np.float32) for name, size in sizes.items()}
            peer = GossipPeer(net.transport(pid), settings, tensors, step=step, choco=choco)
            await peer.start()
            peers.append(peer)
        topo, view = build_topology("ring", n), MembershipView.of(ids)
        for r in range(3000, 3000 + rounds):
            outcomes = await asyncio.gather(*(p.run_round(r, peer_round(topo, view, p.peer_id, r)) for p in peers))
            assert all(not o.skipped for o in outcomes), [o.skipped for o in outcomes]
        return [p.stats.bytes_sent + p.stats.bytes_received for p in peers]

    counted = asyncio.run(run())
    # meta edge counts 0..2 take one byte like the predicted 1
    assert sum(counted) / n == pytest.approx(rounds * (predicted.sent_bytes_per_step + predicted.received_bytes_per_step))


def test_diloco_syncs_send_anchors_in_a_second_round_unless_fused():
    """DiLoCo's defaults (outer lr 0.7, momentum 0.9, anchors in int8 at every sync) run two rounds per
    sync; every other sync with --anchor-every 2; one with outer lr 1, no momentum and one codec (fused)."""
    base = config("ring", peers=4, algorithm=Algorithm.DILOCO, codec=Int8Codec(), local_steps=10, anchor_every=0)
    one = gossip_estimate(base).sent_bytes_per_step
    two = gossip_estimate(dataclasses.replace(base, anchor_every=1))
    # the anchor messages carry a config hash 7 characters longer
    assert two.sent_bytes_per_step == pytest.approx(2 * one, rel=1e-3) and two.sent_bytes_per_step > 2 * one
    half = gossip_estimate(dataclasses.replace(base, anchor_every=2)).sent_bytes_per_step
    assert half == pytest.approx((one + two.sent_bytes_per_step) / 2)
    fused = dataclasses.replace(base, anchor_every=1, outer_lr=1.0, outer_momentum=0.0)
    assert fused.diloco_fused and gossip_estimate(fused).sent_bytes_per_step == pytest.approx(one, rel=1e-3)
    # the two rounds run at once: their transfers share the link, their round trips overlap
    single = gossip_estimate(base).sync_s
    assert single < two.sync_s < 2 * single
    # fp32 anchors beside int8 pseudo-gradients: about 1 + 4 / (1 + 4 / 256) times the bytes
    mixed = gossip_estimate(dataclasses.replace(base, anchor_every=1, anchor_codec=get_codec("fp32")))
    assert mixed.sent_bytes_per_step == pytest.approx(one * (1 + 4 / (1 + 4 / 256)), rel=0.01)


def test_predicted_diloco_bytes_equal_counted_bytes_of_real_outer_syncs():
    """Four OuterGroups (the daemon's DiLoCo sync of one fragment: pseudo-gradients, anchors on a second
    peer) over the in-memory transport run syncs on a one-peer exponential graph; the bytes their peers
    count equal the plan's prediction, to the byte, for DiLoCo's defaults and for a fused sync."""
    from gossip.diloco import OuterNesterov
    from node.algorithms.outer_group import OuterGroup

    n, syncs, step, first = 4, 4, 5000, 3000
    ids = [f"Qm{i:044d}" for i in range(n)]
    sizes = {"w": 4000, "b": 10}
    for outer_lr, momentum in ((0.7, 0.9), (1.0, 0.0)):
        plan = PlanConfig(specs_for_vectors(sizes), 0.1, LINK, n, TopologySpec("one-peer-exp"),
                          algorithm=Algorithm.DILOCO, codec=Int8Codec(), local_steps=1, outer_lr=outer_lr,
                          outer_momentum=momentum, anchor_every=1, anchor_codec=Int8Codec(),
                          header=HeaderValues(swarm="plan", config_hash="h" * 64, sender=ids[0], round=first,
                                              step=step))
        predicted = gossip_estimate(plan)

        async def run(outer_lr: float = outer_lr, momentum: float = momentum) -> list[int]:
            net = InMemoryNetwork()
            rng = np.random.default_rng(0)
            settings = ExchangeSettings(swarm="plan", config_hash="h" * 64, codec=Int8Codec(), exchange_timeout_s=10)
            groups = []
            for pid in ids:
                group = OuterGroup(net.transport(pid), settings, Int8Codec(), tuple(sizes), protocol="/plan/g/1",
                                   anchor_protocol="/plan/a/1", outer=OuterNesterov(outer_lr, momentum),
                                   anchor_every=1)
                await group.start({name: rng.standard_normal(size).astype(np.float32) for name, size in sizes.items()},
                                  step, first - 1)
                groups.append(group)
            lockstep = Lockstep(ids, "one-peer-exp")
            for r in range(first, first + syncs):
                async def plan_for(pid: str, r: int = r):
                    return lockstep.plan(pid, r)

                results = await asyncio.gather(*(g.exchange(r, {name: rng.standard_normal(size).astype(np.float32)
                                                                for name, size in sizes.items()}, step,
                                                            lambda pid=pid: plan_for(pid))
                                                  for g, pid in zip(groups, ids, strict=True)))
                for sync in results:
                    for outcome in (sync.outcome, sync.anchors):
                        assert outcome is None or not outcome.skipped, outcome.skipped
            return [sum(p.stats.bytes_sent + p.stats.bytes_received for p in g.peers) for g in groups]

        counted = asyncio.run(run())
        # one-peer-exp over 4 has a period of 2: the syncs cover it twice
        assert sum(counted) / n == syncs * (predicted.sent_bytes_per_step + predicted.received_bytes_per_step), \
            (outer_lr, momentum)


# ---- the command line ----------------------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(MURMUR + ["plan", *args], capture_output=True, text=True, timeout=120, env={**os.environ})


def test_plan_json_shape():
    out = run_cli("--params", "1000000", "--step-time", "0.5", "--peers", "16", "--bandwidth-mbit", "20",
                  "--latency-ms", "30", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert {"inputs", "numel", "gossip", "allreduce", "data_parallel", "winner", "speedup", "bytes_ratio"} <= doc.keys()
    assert doc["numel"] == 1_000_000 and doc["inputs"]["peers"] == 16 and doc["inputs"]["step_time_source"] == "given"
    for key in ("gossip", "allreduce", "data_parallel"):
        assert {"step_s", "sync_s", "sent_bytes_per_step", "received_bytes_per_step", "bytes_per_token"} <= doc[key].keys()
    assert doc["winner"] in ("gossip", "allreduce", "tie")
    # fp32 all-reduce of 4 MB over 16 peers: 2 * 15/16 of the payload per node
    assert doc["allreduce"]["sent_bytes_per_step"] == pytest.approx(2 * 15 / 16 * 4_000_000)


def test_the_membership_a_node_reads_grows_with_the_swarm_and_the_plan_says_what_it_costs():
    """Every node reads every peer record (and hivemind stores what it read back once), every half
    heartbeat or as often as the membership budget allows: the plan counts it from a real encoded record,
    says how often a node reads it, and how many shards keep each DHT key readable."""
    from node.cli.plan import DEFAULT_HEARTBEAT_S, membership
    from node.net.discovery import MEMBERSHIP_BUDGET_MBIT_S, SHARD_WARN_BYTES

    small, big = membership(10), membership(1000)
    assert big.read_bytes == 100 * small.read_bytes and 600 < small.record_bytes < 4096
    assert big.mbit_s(DEFAULT_HEARTBEAT_S) == pytest.approx(2 * big.read_bytes * 8 / DEFAULT_HEARTBEAT_S / 1e6)
    assert small.read_interval_s(DEFAULT_HEARTBEAT_S) == DEFAULT_HEARTBEAT_S / 2  # as before
    # spaced so a read costs the budget: the node then moves the budget each way
    every = big.read_interval_s(DEFAULT_HEARTBEAT_S)
    assert big.read_bytes * 8 / every / 1e6 == pytest.approx(MEMBERSHIP_BUDGET_MBIT_S) and every > 5
    assert small.shards == big.shards == 1
    many = membership(2 * SHARD_WARN_BYTES // big.record_bytes + 10)
    assert many.shards == 3 and many.read_bytes > 2 * SHARD_WARN_BYTES
    out = run_cli("--params", "1000000", "--step-time", "0.5", "--peers", "1000", "--bandwidth-mbit", "20")
    assert out.returncode == 0, out.stderr
    line = next(line for line in out.stdout.splitlines() if line.startswith("membership: 1000 peer records"))
    assert f"a node reads it every {every:.1f} s" in line, line
    doc = json.loads(run_cli("--params", "1000000", "--step-time", "0.5", "--peers", "1000", "--json").stdout)
    assert doc["membership"]["read_bytes"] == big.read_bytes


def test_the_plan_gives_a_catch_ups_copies_and_time_through_the_joiners_link_for_the_auto_check():
    """A catch-up's downloads run at once and share the joiner's link: three copies below the spot-check
    size, one and the checked blocks above it; the text and the JSON say the same."""
    from node.cli.plan import catch_up
    from node.swarm.joining import SPOT_CHECK_BYTES

    link = LinkSpec(50.0)
    for params, check, copies in ((10_000_000, "median", 3.0), (SPOT_CHECK_BYTES // 4, "spot", 1.1)):
        config = PlanConfig(specs_for_vectors({"w": params}), 0.5, link, 16, TopologySpec("one-peer-exp"))
        plan = make_plan(config)
        up = catch_up(plan, config)
        assert str(up.check) == check and up.copies == pytest.approx(copies) and up.momentum_copies == 0
        assert up.nbytes == pytest.approx(copies * plan.download.nbytes)
        # the copies beyond the first cross the same link after it
        assert up.seconds == pytest.approx(plan.download.seconds + (copies - 1) * plan.download.nbytes / link.bytes_per_s)
        # gossip DiLoCo with outer momentum then fetches the momentum whole from 3 of the vouchers
        diloco = dataclasses.replace(config, algorithm=Algorithm.DILOCO, local_steps=100)
        outer = catch_up(make_plan(diloco), diloco)
        # in int8: about a quarter of an fp32 copy each
        assert outer.momentum_copies == 3
        assert outer.nbytes == pytest.approx((copies + 3 * (1 + 4 / 256) / 4) * plan.download.nbytes, rel=1e-3)
        assert catch_up(make_plan(lean := dataclasses.replace(diloco, outer_momentum=0.0)), lean).momentum_copies == 0
    out = run_cli("--params", str(params), "--step-time", "0.5", "--bandwidth-mbit", "50")
    assert "(--join-check auto: spot) moves one such copy" in out.stdout and "(1.1 fp32 copies)" in out.stdout, out.stdout
    doc = json.loads(run_cli("--params", str(params), "--step-time", "0.5", "--bandwidth-mbit", "50", "--json").stdout)
    up, download = doc["catch_up"], doc["download"]
    assert up["check"] == "spot" and up["bytes"] == pytest.approx(1.1 * download["bytes"])
    assert f"in about {up['seconds']:.0f} s through the joiner's link" in out.stdout


def test_plan_text_names_the_winner():
    out = run_cli("--params", "50000000", "--step-time", "0.2", "--peers", "64", "--latency-ms", "80")
    assert out.returncode == 0, out.stderr
    assert "gossip wins:" in out.stdout and "| ring all-reduce |" in out.stdout


@pytest.mark.parametrize(("args", "outer"), [
    (["--codec", "sparseloco"], "outer lr 1 momentum 0"),
    (["--codec", "sparseloco", "--outer-momentum", "0.5"], "outer lr 1 momentum 0.5"),
    (["--codec", "int8"], "outer lr 0.7 momentum 0.9")])
def test_plan_takes_the_outer_step_a_node_would(args, outer):
    """A plan models the swarm a founder's flags make: SparseLoCo payloads without a named outer step
    average plainly there (node.config.layers), so the plan says so."""
    out = run_cli("--params", "1000000", "--step-time", "0.5", "--optimizer", "diloco", *args)
    assert out.returncode == 0, out.stderr
    assert f", {outer}," in out.stdout, out.stdout


def test_plan_counts_the_models_parameters():
    out = run_cli("--model", "dense", "--step-time", "0.3", "--json")
    assert out.returncode == 0, out.stderr
    from node.train.models import build_named_model

    assert json.loads(out.stdout)["numel"] == sum(p.numel() for p in build_named_model("dense", seed=0).parameters())


@pytest.mark.parametrize("args,needle", [
    (["--params", "100"], "--step-time"),
    (["--params", "0", "--step-time", "1"], "--params"),
    (["--step-time", "1", "--codec", "topk"], "sound on differences only"),
    (["--step-time", "1", "--gossip-compression", "choco"], "symmetric"),
    (["--step-time", "1", "--fragments", "2"], "diloco"),
    (["--step-time", "1", "--optimizer", "diloco", "--gossip-compression", "choco", "--topology", "ring"], "dsgd and dadam"),
    (["--step-time", "1", "--bandwidth-mbit", "0"], "--bandwidth-mbit"),
    (["--step-time", "1", "--round-cpu", "soon"], "--round-cpu"),
    (["--step-time", "1", "--peers", "1"], "--peers"),
    (["--step-time", "1", "--topology", "mesh"], "invalid choice"),
    (["--step-time", "1", "--model", "nope.module:build"], "--model"),
])
def test_bad_plan_flags_exit_2_with_one_line(args, needle, capsys):
    # in process (the console script itself is run by the tests above): main() returns 2 or argparse exits 2
    from node.cli.main import main

    try:
        status = main(["plan", *args])
    except SystemExit as exc:
        status = exc.code
    out = capsys.readouterr()
    assert status == 2, out.out
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], out.err


def test_a_diloco_plan_suggests_the_wall_clock_phase_that_fits_h_steps_of_its_compute():
    """`--phase-seconds` for volunteers of unequal speed: H steps of the planned step time with PHASE_ROOM, in
    the text and the JSON; a per-step algorithm has no phases to suggest."""
    from gossip.diloco import PHASE_ROOM

    args = ("--params", "1000000", "--step-time", "0.4", "--optimizer", "diloco", "--local-steps", "50")
    doc = json.loads(run_cli(*args, "--json").stdout)
    assert doc["phase_seconds"] == pytest.approx(PHASE_ROOM * 50 * 0.4)
    assert f"--phase-seconds {PHASE_ROOM * 50 * 0.4:.3g} fits H = 50 steps" in run_cli(*args).stdout
    assert "phase_seconds" not in json.loads(run_cli("--params", "1000000", "--step-time", "0.4", "--json").stdout)
