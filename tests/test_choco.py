"""Compressed gossip of differences (gossip/choco.py) inside real GossipPeer exchanges: the rounds against an
independent numpy computation of per-edge CHOCO, the average it keeps, failed and out-of-step exchanges,
the bounded memory, what it refuses, and the recipe and config knobs that turn it on."""

import asyncio
import math

import numpy as np
import pytest

from gossip.choco import ChocoSettings, ChocoState, anchor_digest, check_topology, default_gamma
from gossip.codecs import Fp32Codec, Int8Codec, TopKCodec, get_codec
from gossip.exchange import ExchangeSettings, GossipPeer, PeerRejected
from gossip.memory import InMemoryNetwork, LinkModel
from gossip.mixing import MixingRule
from topology import MembershipView, TopologySpec, build_topology, peer_round

pytestmark = pytest.mark.unit

SIZES = {"w": 3000, "b": 7}
IDS = [f"peer{i}" for i in range(4)]


def _initial(seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {pid: {n: rng.standard_normal(s).astype(np.float32) for n, s in SIZES.items()} for pid in IDS}


def _zeros() -> dict[str, np.ndarray]:
    return {n: np.zeros(s, np.float32) for n, s in SIZES.items()}


class Swarm:
    """Four GossipPeers with compressed gossip on an in-memory ring, rounds run together."""

    def __init__(self, codec, gamma: float, start: dict, anchors: dict | None = None, rule=MixingRule()):
        self.net = InMemoryNetwork(LinkModel())
        # a partner whose dial failed is waited for until this deadline
        settings = ExchangeSettings(swarm="t", config_hash="h", codec=Fp32Codec(), exchange_timeout_s=0.5)
        self.states = {pid: ChocoState(ChocoSettings(codec, gamma, rule=rule), (anchors or {}).get(pid, _zeros()))
                       for pid in IDS}
        self.peers = {pid: GossipPeer(self.net.transport(pid), settings, start[pid], choco=self.states[pid])
                      for pid in IDS}
        self.topology, self.view = build_topology("ring", len(IDS)), MembershipView.of(IDS)
        self.round = 0

    async def start(self):
        for peer in self.peers.values():
            await peer.start()
        return self

    async def run_round(self):
        r, self.round = self.round, self.round + 1
        outcomes = await asyncio.gather(*(p.run_round(r, peer_round(self.topology, self.view, pid, r))
                                          for pid, p in self.peers.items()))
        return dict(zip(self.peers, outcomes))

    def tensors(self):
        return {pid: p.tensors for pid, p in self.peers.items()}


def numpy_topk(v: np.ndarray, ratio: float) -> np.ndarray:
    """Top-k by an independent route: a stable sort of magnitudes, as float32."""
    k = min(v.size, max(1, math.ceil(ratio * v.size)))
    keep = np.argsort(-np.abs(v), kind="stable")[:k]
    out = np.zeros_like(v)
    out[keep] = v[keep]
    return out


def numpy_choco(start, rounds: int, ratio: float, gamma: float):
    """Per-edge CHOCO on the ring written out in numpy: est[(i, j)] is j's estimate of x_i."""
    topology, view = build_topology("ring", len(IDS)), MembershipView.of(IDS)
    x = {pid: {n: v.astype(np.float64) for n, v in t.items()} for pid, t in start.items()}
    est = {}
    for r in range(rounds):
        plans = {pid: peer_round(topology, view, pid, r) for pid in IDS}
        q = {}
        for i in IDS:
            for j in plans[i].in_weights:
                mine = est.get((i, j), {n: np.zeros(s, np.float32) for n, s in SIZES.items()})
                q[(i, j)] = {n: numpy_topk((x[i][n].astype(np.float32) - mine[n]).astype(np.float32), ratio)
                             for n in SIZES}
        for (i, j), qs in q.items():
            mine = est.get((i, j), {n: np.zeros(s, np.float32) for n, s in SIZES.items()})
            est[(i, j)] = {n: (mine[n] + qs[n]).astype(np.float32) for n in SIZES}
        new = {}
        for i in IDS:
            new[i] = {}
            for n in SIZES:
                move = sum(w * (est[(j, i)][n].astype(np.float64) - est[(i, j)][n].astype(np.float64))
                           for j, w in plans[i].in_weights.items())
                new[i][n] = (x[i][n] + gamma * move).astype(np.float32).astype(np.float64)
        x = new
    return x


def test_rounds_match_an_independent_numpy_computation():
    start, rounds, ratio, gamma = _initial(), 6, 0.1, 0.3

    async def run():
        swarm = await Swarm(TopKCodec(ratio), gamma, start).start()
        for _ in range(rounds):
            outcomes = await swarm.run_round()
            assert all(not o.skipped and len(o.mixed_with) == 2 for o in outcomes.values())
        return swarm

    swarm = asyncio.run(run())
    expected = numpy_choco(start, rounds, ratio, gamma)
    for pid, tensors in swarm.tensors().items():
        for name in SIZES:
            np.testing.assert_allclose(tensors[name], expected[pid][name], rtol=1e-5, atol=1e-6, err_msg=pid)
    # both ends of every edge hold the same estimates, bit for bit
    for pid, state in swarm.states.items():
        for other in state.edges:
            mine, theirs = state._edges[other], swarm.states[other]._edges[pid]
            assert mine.count == theirs.count == rounds
            for name in SIZES:
                np.testing.assert_array_equal(mine.mine[name], theirs.theirs[name])
                np.testing.assert_array_equal(mine.theirs[name], theirs.mine[name])


@pytest.mark.parametrize("codec,gamma", [(Int8Codec(), 1.0), (TopKCodec(0.1), 0.2), (get_codec("bf16"), 1.0)])
def test_consensus_converges_and_keeps_the_average(codec, gamma):
    start = _initial(1)
    mean0 = {n: np.mean([start[p][n].astype(np.float64) for p in IDS], axis=0) for n in SIZES}

    def spread(tensors):
        return math.sqrt(sum(float(np.sum((t[n] - mean0[n]) ** 2)) for t in tensors.values() for n in SIZES))

    async def run():
        swarm = await Swarm(codec, gamma, start).start()
        first = spread(swarm.tensors())
        for _ in range(40):
            await swarm.run_round()
        return first, swarm.tensors()

    first, final = asyncio.run(run())
    assert spread(final) < 0.05 * first
    for n in SIZES:
        mean = np.mean([final[p][n].astype(np.float64) for p in IDS], axis=0)
        np.testing.assert_allclose(mean, mean0[n], atol=1e-4)


def test_a_failed_exchange_updates_neither_end_and_gossip_goes_on():
    start = _initial(2)

    async def run():
        swarm = await Swarm(Int8Codec(), 1.0, start).start()
        await swarm.run_round()
        # the link between peer0 and peer1 fails for one round: no stream opens
        swarm.net.set_link("peer0", "peer1", LinkModel(loss=1.0))
        outcomes = await swarm.run_round()
        assert outcomes["peer0"].skipped and outcomes["peer1"].skipped
        assert swarm.states["peer0"].count("peer1") == swarm.states["peer1"].count("peer0") == 1
        swarm.net.set_link("peer0", "peer1", LinkModel())
        for _ in range(3):
            outcomes = await swarm.run_round()
            assert all(not o.skipped for o in outcomes.values())
        return swarm

    swarm = asyncio.run(run())
    assert swarm.states["peer0"].count("peer1") == 4 and swarm.states["peer0"].resets == 0
    for n in SIZES:
        mean0 = np.mean([start[p][n].astype(np.float64) for p in IDS], axis=0)
        np.testing.assert_allclose(np.mean([swarm.tensors()[p][n] for p in IDS], axis=0), mean0, atol=1e-4)


@pytest.mark.parametrize("tamper", ["restart", "ack_lost"])
def test_out_of_step_estimates_reset_both_ends(tamper):
    start = _initial(3)

    async def run():
        swarm = await Swarm(TopKCodec(0.2), 0.4, start).start()
        for _ in range(2):
            await swarm.run_round()
        a, b = swarm.states["peer0"], swarm.states["peer1"]
        if tamper == "restart":  # peer1 lost its estimates (a restart, or an edge dropped for memory)
            b.reset("peer0")
        else:  # peer0 counted one more exchange than peer1 (an ack lost after it was written)
            a._edges["peer1"].count += 1
        before = {pid: {n: t.copy() for n, t in ts.items()} for pid, ts in swarm.tensors().items()}
        outcomes = await swarm.run_round()
        assert outcomes["peer0"].skipped.get("peer1") == "desync"
        assert outcomes["peer1"].skipped.get("peer0") == "desync"
        assert "peer1" not in a.edges and "peer0" not in b.edges  # both ends start the edge over
        # the pair moved only along its other edges: the swarm's average is unchanged
        after = swarm.tensors()
        for n in SIZES:
            np.testing.assert_allclose(np.mean([after[p][n] for p in IDS], axis=0),
                                       np.mean([before[p][n] for p in IDS], axis=0), atol=1e-5)
        outcomes = await swarm.run_round()
        assert all(not o.skipped for o in outcomes.values())
        assert a.count("peer1") == b.count("peer0") == 1

    asyncio.run(run())


def test_peers_with_different_anchors_never_mix_with_each_other():
    start = _initial(4)
    other = {n: np.ones(s, np.float32) for n, s in SIZES.items()}

    async def run():
        swarm = await Swarm(Int8Codec(), 1.0, start, anchors={"peer0": other}).start()
        for _ in range(2):
            outcomes = await swarm.run_round()
            assert set(outcomes["peer0"].skipped.values()) == {"desync"} and not outcomes["peer0"].mixed_with
        return swarm

    swarm = asyncio.run(run())
    for n in SIZES:
        np.testing.assert_array_equal(swarm.tensors()["peer0"][n], start["peer0"][n])


def test_round_pulls_are_refused_and_downloads_are_whole():
    start = _initial(5)

    async def run():
        net = InMemoryNetwork()
        settings = ExchangeSettings(swarm="t", config_hash="h", codec=Fp32Codec(), exchange_timeout_s=5.0)
        server = GossipPeer(net.transport("a"), settings, start["peer0"],
                            choco=ChocoState(ChocoSettings(TopKCodec(0.01), 0.02), _zeros()))
        client = GossipPeer(net.transport("b"), settings, start["peer1"])
        await server.start()
        await client.start()
        await server.run_round(0, peer_round(build_topology("ring", 1), MembershipView.of(["a"]), "a", 0))
        from topology import PeerRound

        outcome = await client.run_round(0, PeerRound(0.5, {"a": 0.5}, ()))
        assert outcome.skipped == {"a": "rejected: unsupported"}
        tensors, _, _ = await client.fetch("a")
        return tensors

    tensors = asyncio.run(run())
    for n in SIZES:
        np.testing.assert_array_equal(tensors[n], start["peer0"][n])


def test_estimates_are_bounded_by_max_edges():
    state = ChocoState(ChocoSettings(Int8Codec(), 1.0, max_edges=2), _zeros())
    x = _initial()["peer0"]
    for peer in ("a", "b", "c"):
        out = state.prepare(peer, x)
        state.commit(out, x)
    assert state.edges == ("b", "c")
    # two estimates per kept edge beyond the anchor
    assert state.memory_bytes() == 2 * 2 * sum(4 * s for s in SIZES.values())


def test_anchor_digest_and_defaults():
    assert anchor_digest(_zeros()) == anchor_digest({k: v.copy() for k, v in reversed(_zeros().items())})
    assert anchor_digest(_zeros()) != anchor_digest({**_zeros(), "b": np.ones(7, np.float32)})
    assert default_gamma(Int8Codec()) == 1.0 and default_gamma(TopKCodec(0.01)) == pytest.approx(0.1)
    assert default_gamma(TopKCodec(0.2)) == 0.5
    with pytest.raises(ValueError, match="symmetric"):
        check_topology(TopologySpec("one-peer-exp"))
    with pytest.raises(ValueError, match="symmetric weights"):
        check_topology(TopologySpec("star", weights="uniform"))
    check_topology(TopologySpec("ring"))
    with pytest.raises(ValueError, match="whole vectors"):
        ChocoSettings(Int8Codec(), rule=MixingRule(kind="median"))
    with pytest.raises(ValueError, match="gamma"):
        ChocoSettings(Int8Codec(), gamma=0.0)


def test_clipped_rule_bounds_each_edges_pull():
    state = ChocoState(ChocoSettings(Fp32Codec(), 1.0, rule=MixingRule(kind="clipped", tau=1.0)), _zeros())
    x = {n: np.zeros(s, np.float32) for n, s in SIZES.items()}
    far = {n: np.full(s, 100.0, np.float32) for n, s in SIZES.items()}
    state.commit(state.prepare("h", x), far)  # a hostile neighbour's estimate jumps far away
    moved = state.step(x, {"h": 0.5}).tensors
    for n in SIZES:
        assert np.linalg.norm(moved[n]) == pytest.approx(0.5, rel=1e-5)


# ---- the knobs: config, recipe ---------------------------------------------------------------------


def _config(*flags):
    from node.cli.main import parse_node_config

    return parse_node_config(["node", *flags], {})


def test_config_refuses_unsound_combinations():
    from node.config import ConfigError

    cases = [
        (["--codec", "topk"], "sound on differences only"),
        (["--gossip-compression", "choco"], "symmetric"),  # the default topology is one-peer-exp
        (["--gossip-compression", "choco", "--topology", "ring", "--mixing", "median"], "whole vectors"),
        (["--gossip-compression", "choco", "--topology", "ring", "--mixing", "weighted", "--spes"], "SPES"),
        (["--gossip-compression", "choco", "--topology", "ring", "--choco-gamma", "1.5"], "--choco-gamma"),
        (["--gossip-compression", "zip"], "--gossip-compression"),
        (["--gossip-compression", "choco", "--topology", "ring", "--optimizer", "diloco"], "dsgd and dadam"),
    ]
    for flags, needle in cases:
        with pytest.raises(ConfigError, match=needle) as refused:
            _config(*flags)
        assert "\n" not in str(refused.value)  # one line


def test_topk_is_allowed_on_differences_only():
    """One --topk-ratio setting; --codec topk with compressed gossip or with gossip DiLoCo's pseudo-gradients,
    refused (naming both) for whole parameters."""
    from node.config import ConfigError
    from node.runtime.founding import swarm_document
    from node.swarm.recipe import RecipeInvalid, SwarmSettings

    for optimizer in ("dsgd", "dadam"):
        with pytest.raises(ConfigError, match="--optimizer diloco .* or --gossip-compression choco"):
            _config("--optimizer", optimizer, "--codec", "topk")
    diloco = _config("--optimizer", "diloco", "--local-steps", "10", "--codec", "topk", "--topk-ratio", "0.02")
    settings = SwarmSettings.from_doc(swarm_document(diloco, 0.0))
    assert settings.codec == TopKCodec(0.02) and settings.choco is None
    choco = _config("--gossip-compression", "choco", "--topology", "ring", "--mixing", "weighted", "--codec", "topk",
                    "--topk-ratio", "0.02")
    assert SwarmSettings.from_doc(swarm_document(choco, 0.0)).choco.codec == TopKCodec(0.02)
    # --topk-packed travels in the recipe (joiners take it); written only when set, so older configs keep
    # their document and hash
    assert "topk_packed" not in swarm_document(choco, 0.0)["gossip"]
    packed = _config("--gossip-compression", "choco", "--topology", "ring", "--mixing", "weighted", "--codec", "topk",
                     "--topk-ratio", "0.02", "--topk-packed")
    document = swarm_document(packed, 0.0)
    assert document["gossip"]["topk_packed"] is True
    assert SwarmSettings.from_doc(document).choco.codec == TopKCodec(0.02, packed=True)
    assert "topk_elias_fano" not in document["gossip"]
    # --topk-elias-fano brings the packed layout with it, and travels the same way
    elias_fano = swarm_document(_config("--gossip-compression", "choco", "--topology", "ring", "--mixing", "weighted",
                                        "--codec", "topk", "--topk-ratio", "0.02", "--topk-elias-fano"), 0.0)
    assert elias_fano["gossip"]["topk_packed"] is True and elias_fano["gossip"]["topk_elias_fano"] is True
    assert SwarmSettings.from_doc(elias_fano).choco.codec == TopKCodec(0.02, packed=True, elias_fano=True)
    # a forged document: top-k on whole parameters, and compressed gossip under diloco, are refused by joiners
    forged = swarm_document(choco, 0.0)
    del forged["gossip"]["compression"]
    with pytest.raises(RecipeInvalid, match="sound on differences only"):
        SwarmSettings.from_doc(forged)
    forged = swarm_document(diloco, 0.0)
    forged["gossip"]["compression"] = {"kind": "choco"}
    forged["gossip"]["topology"]["name"] = "ring"
    with pytest.raises(RecipeInvalid, match="dsgd and dadam"):
        SwarmSettings.from_doc(forged)


def test_recipe_carries_compression_to_joiners():
    from node.runtime.founding import swarm_document
    from node.swarm.recipe import SwarmSettings

    config = _config("--gossip-compression", "choco", "--topology", "ring", "--mixing", "weighted", "--codec", "topk",
                     "--topk-ratio", "0.05")
    settings = SwarmSettings.from_doc(swarm_document(config, 0.0))
    assert settings.codec.name == "fp32"  # whole tensors (downloads) stay exact
    assert settings.choco is not None and settings.choco.codec == TopKCodec(0.05)
    assert settings.choco.gamma == pytest.approx(0.5)
    plain = swarm_document(_config(), 0.0)
    assert "compression" not in plain["gossip"] and "codec_options" not in plain["gossip"]
    forged = swarm_document(config, 0.0)
    forged["gossip"]["topology"]["name"] = "one-peer-exp"
    from node.swarm.recipe import RecipeInvalid

    with pytest.raises(RecipeInvalid, match="symmetric"):
        SwarmSettings.from_doc(forged)


def test_peer_rejected_carries_desync():
    assert PeerRejected("desync").reason == "desync"
