"""A hostile neighbour under compressed gossip (gossip/choco.py): each node keeps its own --mixing on the
per-edge differences (centered clipping at its adaptive radius by default), and differences that break the
value bound are refused before either end commits them. In-process GossipPeers on an in-memory ring of
five, one of them hostile, against a control run with the same seeds where that node is honest
(docs/threat-model.md, "Compressed gossip")."""

import asyncio

import numpy as np
import pytest

from gossip.choco import ChocoSettings, ChocoState
from gossip.codecs import Fp32Codec
from gossip.errors import OutOfRange
from gossip.exchange import ExchangeSettings, GossipPeer
from gossip.memory import InMemoryNetwork, LinkModel
from gossip.mixing import MixingKind, MixingRule
from gossip.robust import ValueBound
from topology import MembershipView, build_topology, peer_round

pytestmark = pytest.mark.unit

SIZES = {"w": 400, "b": 7}
IDS = [f"p{i}" for i in range(5)]
HOSTILE = "p2"  # p1 asks it (the hostile answers), it asks p3 (the hostile's differences arrive as a request)
HONEST = [pid for pid in IDS if pid != HOSTILE]
ROUNDS = 30
ADAPTIVE, WEIGHTED = MixingRule(MixingKind.ADAPTIVE_CLIP), MixingRule(MixingKind.WEIGHTED)


def _zeros() -> dict[str, np.ndarray]:
    return {n: np.zeros(s, np.float32) for n, s in SIZES.items()}


def _start(seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {pid: {n: rng.standard_normal(s).astype(np.float32) for n, s in SIZES.items()} for pid in IDS}


class Ring:
    """Five GossipPeers with compressed gossip (fp32 differences, gamma 1) on an in-memory ring; the honest
    ones mix with `rule` (their own --mixing). `attack(round) -> tensors` (None: honest) is what the hostile
    node claims its parameters are each round: it runs the CHOCO encoding honestly on them, so its
    differences pass every check of the edge and only their values are hostile."""

    def __init__(self, rule: MixingRule, attack=None, seed: int = 0):
        self.net = InMemoryNetwork(LinkModel())
        self.attack = attack
        start = _start(seed)
        self.peers = {}
        for pid in IDS:
            settings = ExchangeSettings(swarm="t", config_hash="h", codec=Fp32Codec(), exchange_timeout_s=2.0,
                                        rule=rule)
            state = ChocoState(ChocoSettings(Fp32Codec(), 1.0), _zeros())
            self.peers[pid] = GossipPeer(self.net.transport(pid), settings, start[pid], choco=state)
        self.states = {pid: p._choco for pid, p in self.peers.items()}
        # where an honest swarm's consensus ends: the average of the honest nodes' starts
        self.target = {n: np.mean([start[pid][n] for pid in (HONEST if attack else IDS)], axis=0) for n in SIZES}
        self.topology, self.view = build_topology("ring", len(IDS)), MembershipView.of(IDS)

    async def run(self, rounds: int = ROUNDS):
        for peer in self.peers.values():
            await peer.start()
        outcomes = []
        for r in range(rounds):
            if self.attack is not None:
                self.peers[HOSTILE].set_tensors(self.attack(r))
            outcomes.append(dict(zip(self.peers, await asyncio.gather(
                *(p.run_round(r, peer_round(self.topology, self.view, pid, r)) for pid, p in self.peers.items())))))
        return outcomes

    def distance(self) -> float:
        """The largest distance of an honest node from the honest nodes' starting average."""
        return max(float(np.sqrt(sum(np.sum((self.peers[pid].tensors[n] - self.target[n]) ** 2) for n in SIZES)))
                   for pid in HONEST)


def _far(r: int) -> dict[str, np.ndarray]:
    """A stubborn hostile: the same far point every round (within the value bound: a hundred times the
    honest values' magnitude)."""
    return {n: np.full(s, 40.0, np.float32) for n, s in SIZES.items()}


def _noise(r: int) -> dict[str, np.ndarray]:
    """A noisy hostile: a fresh far random point every round."""
    rng = np.random.default_rng(1000 + r)
    return {n: (30.0 * rng.standard_normal(s)).astype(np.float32) for n, s in SIZES.items()}


@pytest.mark.parametrize("attack", [_far, _noise], ids=["far", "noise"])
def test_a_hostile_choco_neighbour_moves_honest_nodes_a_bounded_distance(attack):
    """The honest nodes' own adaptive clipping keeps them near the honest average (a control run with the
    same seeds and no hostile converges there); plain CHOCO (`weighted`, what the founder's rule imposed on
    every node before) is dragged to the hostile's values."""
    control = Ring(ADAPTIVE)
    asyncio.run(control.run())
    guarded = Ring(ADAPTIVE, attack)
    outcomes = asyncio.run(guarded.run())
    plain = Ring(WEIGHTED, attack)
    asyncio.run(plain.run())
    spread = float(np.sqrt(sum(np.sum((_start()[IDS[0]][n] - guarded.target[n]) ** 2) for n in SIZES)))
    # the control reaches consensus; the guarded run stays within a fraction of the start's spread of it ...
    assert control.distance() < 0.1 * spread
    assert guarded.distance() < 0.5 * spread, (guarded.distance(), spread)
    # ... while the same attack on nodes that mix plainly moves them many times further
    assert plain.distance() > 5 * spread, (plain.distance(), spread)
    # the hostile took part in rounds and both its honest neighbours clipped its pull (the noisy one's
    # largest values broke the value bound in some rounds too: refused, counted, and not mixed)
    for neighbour in ("p1", "p3"):
        mixed = sum(HOSTILE in o[neighbour].mixed_with for o in outcomes)
        refused = guarded.peers[neighbour].stats.errors["out_of_range"]
        # a round whose exchange with the hostile the deadline cut (a loaded machine) is neither
        timed_out = sum(o[neighbour].skipped.get(HOSTILE, "").startswith("timeout") for o in outcomes)
        assert mixed > ROUNDS // 3 and mixed + refused + timed_out == ROUNDS, (mixed, refused, timed_out)
        assert guarded.peers[neighbour].stats.clipped >= mixed - 2
    # honest neighbours among themselves are rarely clipped
    assert guarded.peers["p0"].stats.clipped <= ROUNDS // 2


def _huge(r: int) -> dict[str, np.ndarray]:
    return {n: np.full(s, 1e6, np.float32) for n, s in SIZES.items()}


def test_out_of_bound_differences_are_refused_before_either_end_commits():
    """Differences beyond the value bound are refused, counted as out_of_range on the side that reads them
    (p1 reads the hostile's reply, p3 its request), and touch no estimate: the edges stay at the anchor
    with no exchange counted, on both ends, and the honest nodes converge as in the control."""
    ring = Ring(ADAPTIVE, _huge)
    outcomes = asyncio.run(ring.run(8))  # each refused reply costs the hostile's round a retry grace
    for neighbour in ("p1", "p3"):
        peer, state = ring.peers[neighbour], ring.states[neighbour]
        assert peer.stats.errors["out_of_range"] > 0, peer.stats.errors
        assert all(HOSTILE not in o[neighbour].mixed_with for o in outcomes)
        assert state.count(HOSTILE) == 0 and ring.states[HOSTILE].count(neighbour) == 0
        theirs = state._edges[HOSTILE].theirs  # the estimate of the hostile: still the anchor
        assert all(np.array_equal(theirs[n], np.zeros(s, np.float32)) for n, s in SIZES.items())
    spread = float(np.sqrt(sum(np.sum((_start()[IDS[0]][n] - ring.target[n]) ** 2) for n in SIZES)))
    assert ring.distance() < 0.5 * spread


def test_a_non_finite_or_out_of_bound_difference_leaves_the_estimate_unchanged():
    state = ChocoState(ChocoSettings(Fp32Codec(), 1.0), _zeros())
    x = {n: np.ones(s, np.float32) for n, s in SIZES.items()}
    sent = state.prepare("h", x)
    state.commit(sent, {n: np.full(s, 2.0, np.float32) for n, s in SIZES.items()})
    before = {n: v.copy() for n, v in state._edges["h"].theirs.items()}
    limits = ValueBound().limits(x)
    nan = {n: np.full(s, np.nan, np.float32) for n, s in SIZES.items()}
    big = {n: np.full(s, 2e3, np.float32) for n, s in SIZES.items()}
    for bad in (nan, big):
        with pytest.raises(OutOfRange):
            state.screen("h", bad, limits)
    # a difference within the bound whose estimate would not be: refused too
    with pytest.raises(OutOfRange):
        state.screen("h", {n: np.full(s, 99.0, np.float32) for n, s in SIZES.items()}, limits)
    state.screen("h", {n: np.full(s, 3.0, np.float32) for n, s in SIZES.items()}, limits)
    assert state.count("h") == 1
    assert all(np.array_equal(state._edges["h"].theirs[n], before[n]) for n in SIZES)


def test_a_node_keeps_its_own_mixing_whatever_the_swarms_rule():
    """The swarm's `clipped` rule (the recipe's) still applies on top; the node's own rule is applied too, and
    a whole-vector rule (median) clips each edge at the adaptive radius."""
    from gossip.robust import Mixer

    state = ChocoState(ChocoSettings(Fp32Codec(), 1.0, rule=MixingRule(MixingKind.CLIPPED, tau=1.0)), _zeros())
    x = _zeros()
    far = {n: np.full(s, 100.0, np.float32) for n, s in SIZES.items()}
    state.commit(state.prepare("h", x), far)
    swarm_only = state.step(x, {"h": 0.5}, Mixer(WEIGHTED))
    for n in SIZES:
        assert np.linalg.norm(swarm_only.tensors[n]) == pytest.approx(0.5, rel=1e-5)
    assert swarm_only.clipped == ()
    # the node's median has no per-edge form: adaptive clipping, whose radius is 0 before any history
    median = state.step(x, {"h": 0.5}, Mixer(MixingRule(MixingKind.MEDIAN)))
    assert median.clipped == ("h",)
    assert all(np.array_equal(median.tensors[n], x[n]) for n in SIZES)


def test_the_default_mixing_is_accepted_with_compressed_gossip():
    from node.cli.main import parse_node_config

    config = parse_node_config(["node", "--gossip-compression", "choco", "--topology", "ring"], {})
    assert config.gossip.mixing.kind is MixingKind.ADAPTIVE_CLIP


class _Excluding:
    """A contribution judge (gossip.exchange.Judge) that excludes one peer and records what it was shown."""

    def __init__(self, excluded: str) -> None:
        self.excluded = excluded
        self.shown: list[dict[str, dict[str, np.ndarray]]] = []

    def weigh(self, round_index, own, base, received, weights):
        self.shown.append({p: {n: np.array(x) for n, x in t.items()} for p, t in received.items()})
        return {p: 0.0 if p == self.excluded else 1.0 for p in received}


def test_a_scored_choco_round_shows_the_estimates_and_an_excluded_neighbour_moves_nothing_but_stays_in_step():
    """Contribution scoring under compressed gossip: the judge is shown each neighbour's estimate (the
    hostile's claimed parameters exactly, fp32 differences), and a neighbour it excludes moves the node
    nothing, even under plain `weighted` mixing that the same attack drags many times away, while its
    differences are still committed at both ends (no edge is reset, the hostile keeps taking part)."""
    guarded = Ring(WEIGHTED, _far)
    judges = {pid: _Excluding(HOSTILE) for pid in ("p1", "p3")}
    for pid, judge in judges.items():
        guarded.peers[pid].judge = judge
    outcomes = asyncio.run(guarded.run())
    spread = float(np.sqrt(sum(np.sum((_start()[IDS[0]][n] - guarded.target[n]) ** 2) for n in SIZES)))
    assert guarded.distance() < 0.5 * spread, (guarded.distance(), spread)
    for pid, judge in judges.items():
        shown = [r[HOSTILE] for r in judge.shown if HOSTILE in r]
        assert len(shown) > ROUNDS // 2
        for n in SIZES:  # the estimate of the hostile is the point it claims, once its first difference crossed
            np.testing.assert_allclose(shown[-1][n], _far(0)[n], rtol=1e-6)
        excluded = sum(o[pid].skipped.get(HOSTILE) == "excluded" for o in outcomes)
        assert excluded == len(shown) and all(HOSTILE not in o[pid].mixed_with for o in outcomes)
        assert guarded.states[pid].resets == 0 and guarded.states[HOSTILE].resets == 0
        # the hostile's own end committed every exchange the honest end did: the edge counts agree
        assert guarded.states[pid].count(HOSTILE) == guarded.states[HOSTILE].count(pid) >= len(shown)
