"""Tests for node.swarm.joining: how a node that starts behind judges the swarm's step claims, which
downloads it refuses by their values and validation loss, how it combines the rest, and the step it adopts."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import numpy as np
import pytest

from gossip.codecs import get_codec
from gossip.errors import WireError
from gossip.exchange import Delivered, ExchangeSettings, GossipPeer, PeerRejected
from gossip.memory import InMemoryNetwork, LinkModel
from gossip.pace import TransferProgress, TransferStalled
from gossip.spes import ExpertKey, ExpertRecord, overclaiming_peers, version_bound
from node.algorithms.spes.swarm import SpesAlgorithm
from node.net.records import PeerRecord
from node.swarm.joining import (
    SPOT_CHECK_BYTES,
    JoinCheck,
    JoinOutcome,
    JoinRules,
    Refused,
    combine,
    join_check,
    join_swarm,
    judge_steps,
    loss_verdicts,
    plausible_steps,
    swarm_left_behind,
)
from node.swarm.loop import SwarmLoop, TrainingStatus

pytestmark = pytest.mark.unit

ME = "me"


def record(peer: str, step: int) -> PeerRecord:
    return PeerRecord(peer_id=peer, maddrs=(f"/ip4/127.0.0.1/tcp/1/p2p/{peer}",), step=step, round=0, experts=(),
                      capacity=0, version="test", heartbeat=0.0)


# ---- claimed steps ---------------------------------------------------------------------------------


def test_a_huge_claim_is_ignored_and_the_reference_is_the_honest_median() -> None:
    view = [record(ME, 0), record("a", 500), record("b", 505), record("c", 498), record("evil", 10**9)]
    judged = judge_steps(view, ME, step=0, margin=2, budget=0)
    assert judged is not None
    assert judged.reference == 500 and judged.ignored == ("evil",)
    assert {p.peer_id for p in judged.candidates} == {"a", "b", "c"}  # all within a band of the reference


def test_joiners_rank_equally_good_donors_each_their_own_way_and_nearer_bands_first() -> None:
    """Donors within step_slack of the reference serve alike: each joiner orders them by its own hash, so
    joiners that start together spread over them (a donor uploads to two at once); a donor a band further
    from the reference comes after them for every joiner."""
    donors = [record(f"d{i}", 500) for i in range(12)]
    far = record("far", 530)
    orders = []
    for joiner in ("j1", "j2", "j3"):
        judged = judge_steps([record(joiner, 0), *donors, far], joiner, step=0, margin=2, budget=0)
        assert judged is not None and judged.reference == 500
        ranked = [p.peer_id for p in judged.candidates]
        assert ranked[-1] == "far" and set(ranked[:-1]) == {p.peer_id for p in donors}
        again = judge_steps([record(joiner, 0), *reversed(donors), far], joiner, step=0, margin=2, budget=0)
        assert again is not None and [p.peer_id for p in again.candidates] == ranked  # not the view's order
        orders.append(tuple(ranked[:3]))
    assert len(set(orders)) == 3, orders  # three joiners, three different first choices of sources


def test_a_node_is_left_behind_only_when_most_of_the_swarm_is_beyond_the_bound() -> None:
    """The DiLoCo laggard rule's input: claimed steps from the view, read from the network."""
    honest = [record(ME, 100), record("a", 140), record("b", 145), record("c", 150)]
    assert swarm_left_behind(honest, ME, step=100, margin=10, budget=0) == 145  # the lower median of all three
    assert swarm_left_behind(honest, ME, step=100, margin=60, budget=0) is None  # within the bound
    # one hostile peer claiming a huge step, or one fast peer, among peers within the bound: not behind
    near = [record(ME, 100), record("a", 104), record("b", 106)]
    assert swarm_left_behind([*near, record("evil", 10**9)], ME, step=100, margin=10, budget=0) is None
    assert swarm_left_behind([*near, record("fast", 300)], ME, step=100, margin=10, budget=0) is None
    # half is not more than half
    assert swarm_left_behind([*near[:2], record("b", 200)], ME, step=100, margin=10, budget=0) is None
    # impossible claims (beyond the budget, beyond what the swarm can have trained) count for nothing
    forged = [record(ME, 100), record("a", 104), record("x", 5000), record("y", 6000)]
    assert swarm_left_behind(forged, ME, step=100, margin=10, budget=1000) is None
    assert swarm_left_behind(forged, ME, step=100, margin=10, budget=0, plausible=2000) is None
    # peers whose budget is spent train no more: a node that still trains is not behind them
    done = [record(ME, 100), record("a", 1000), record("b", 1000)]
    assert swarm_left_behind(done, ME, step=100, margin=10, budget=1000) is None
    assert swarm_left_behind([record(ME, 0)], ME, step=0, margin=10, budget=0) is None  # alone


def test_with_one_honest_peer_ahead_the_lower_median_still_outvotes_a_huge_claim() -> None:
    judged = judge_steps([record("a", 500), record("evil", 10**9)], ME, step=0, margin=2, budget=0)
    assert judged is not None and judged.reference == 500 and judged.ignored == ("evil",)


def test_a_claim_beyond_the_step_budget_is_impossible() -> None:
    judged = judge_steps([record("a", 120), record("evil", 401)], ME, step=0, margin=2, budget=400)
    assert judged is not None and judged.ignored == ("evil",) and [p.peer_id for p in judged.candidates] == ["a"]
    only_impossible = judge_steps([record("evil", 10**9)], ME, step=0, margin=2, budget=400)
    assert only_impossible is not None and only_impossible.candidates == () and only_impossible.ignored == ("evil",)


def test_a_fresh_swarm_cannot_have_trained_a_huge_step_and_one_plausible_peer_ahead_is_believed() -> None:
    founded = 1000.0
    plausible = plausible_steps(founded, now=founded + 30.0)  # (30 s + 300 s of clock skew) x 100 steps/s + 20
    assert plausible == 33_020
    fresh = [record("n1", 0), record("n2", 0), record("evil", 10**9)]
    judged = judge_steps(fresh, ME, step=0, margin=2, budget=0, plausible=plausible)
    assert judged is not None and judged.candidates == () and judged.ignored == ("evil",)
    # a founder that trained alone for a while, and two joiners arriving together: the founder is believed
    running = [record("founder", 500), record("other-joiner", 0)]
    judged = judge_steps(running, ME, step=0, margin=2, budget=0, plausible=plausible_steps(0.0, now=3600.0))
    assert judged is not None and [p.peer_id for p in judged.candidates] == ["founder"] and judged.reference == 500


def test_peers_within_the_margin_or_behind_are_no_reason_to_catch_up() -> None:
    assert judge_steps([record(ME, 100), record("a", 101), record("b", 3)], ME, step=100, margin=2, budget=0) is None


def test_claims_a_little_ahead_of_the_reference_stay_believable() -> None:
    judged = judge_steps([record(p, s) for p, s in [("a", 400), ("b", 410), ("c", 490)]], ME, 0, 2, 0)
    assert judged is not None and judged.ignored == ()  # 490 <= 410 + max(20, 0.25 * 410)


# ---- validation losses -----------------------------------------------------------------------------


def test_a_download_far_worse_than_the_others_or_than_the_own_model_is_refused() -> None:
    own = 5.5  # the seeded initial model
    verdicts = loss_verdicts(own, {"a": 2.50, "b": 2.55, "stale": 5.5, "noise": 9.0, "nan": math.nan})
    assert verdicts == {"a": True, "b": True, "stale": False, "noise": False, "nan": False}
    assert loss_verdicts(own, {"a": 6.0, "b": 7.0}) == {"a": False, "b": False}  # nothing beats the own model


def test_early_in_training_a_download_close_to_the_initial_model_is_still_accepted() -> None:
    assert loss_verdicts(5.5, {"a": 5.40, "b": 5.45}) == {"a": True, "b": True}


def test_a_lone_download_must_beat_the_own_model_not_just_match_it() -> None:
    assert loss_verdicts(5.5, {"stale": 5.5}) == {"stale": False}  # the seeded model served back
    assert loss_verdicts(5.5, {"stale": 5.5, "noise": 9.0}) == {"stale": False, "noise": False}
    assert loss_verdicts(2.50, {"swarm": 2.49}) == {"swarm": True}  # a restarted node, slightly behind


# ---- combining -------------------------------------------------------------------------------------


def test_the_median_of_three_keeps_every_coordinate_between_the_honest_two() -> None:
    rng = np.random.default_rng(0)
    honest = [{"w": rng.standard_normal((4, 8)).astype(np.float32)} for _ in range(2)]
    hostile = {"w": (1e3 * rng.standard_normal((4, 8))).astype(np.float32)}
    combined = combine([honest[0], hostile, honest[1]])["w"]
    low, high = np.minimum(honest[0]["w"], honest[1]["w"]), np.maximum(honest[0]["w"], honest[1]["w"])
    assert combined.shape == (4, 8) and np.all(low <= combined) and np.all(combined <= high)


def test_a_combination_into_one_of_the_downloads_replaces_its_tensors_and_reads_the_others_first() -> None:
    """The joiner combines in place of one download's tensors (one tensor beyond the downloads, not a
    fourth copy): the result is the same as a fresh combination, and the other downloads are untouched."""
    rng = np.random.default_rng(5)
    downloads = [{"w": rng.standard_normal(64).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}
                 for _ in range(3)]
    originals = [{n: t.copy() for n, t in d.items()} for d in downloads]
    fresh = combine(originals)
    into = combine(downloads, downloads[1])
    assert into is downloads[1]
    for name in ("w", "b"):
        np.testing.assert_array_equal(into[name], fresh[name])
        np.testing.assert_array_equal(downloads[0][name], originals[0][name])
        np.testing.assert_array_equal(downloads[2][name], originals[2][name])


def test_a_combination_into_a_download_allocates_about_one_tensor_not_a_copy_of_the_model() -> None:
    """What the in-place combination is for: at 1B parameters a fourth copy is 4 GB. Numpy's allocations
    while combining 64 tensors into one of three downloads peak near one tensor (plus the median's blocks),
    far below the model's size."""
    import tracemalloc

    rng = np.random.default_rng(6)
    model_bytes = 64 * 100_000 * 4
    tracemalloc.start()  # before the downloads exist: the frees of their replaced tensors count too
    try:
        downloads = [{f"t{i}": rng.standard_normal(100_000).astype(np.float32) for i in range(64)} for _ in range(3)]
        held, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        combine(downloads, downloads[0])
        after, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - held < model_bytes / 4 and after - held < model_bytes / 100, (held, peak, after, model_bytes)


def test_two_downloads_are_averaged_and_one_is_copied() -> None:
    a, b = {"w": np.array([1.0, 3.0], np.float32)}, {"w": np.array([3.0, 5.0], np.float32)}
    np.testing.assert_array_equal(combine([a, b])["w"], [2.0, 4.0])
    one = combine([a])["w"]
    np.testing.assert_array_equal(one, a["w"])
    assert one is not a["w"]


# ---- the whole catch-up ----------------------------------------------------------------------------


class Swarm:
    """Peers that answer downloads with a vector and a step, and a loss that is the vector's distance
    from the "trained" point (the own model sits at the initial point)."""

    def __init__(self, answers: dict[str, tuple[np.ndarray | Exception, int]]) -> None:
        self.answers = answers
        self.asked: list[str] = []
        self.trained = np.full(16, 1.0, np.float32)

    async def fetch(self, peer: str, progress: object = None, *, start: int = 0, stop: int | None = None,
                    delivered: object = None) -> tuple[dict[str, np.ndarray], int, int]:
        self.asked.append(peer)
        value, step = self.answers[peer]
        if isinstance(value, Exception):
            raise value
        return {"w": value}, 0, step

    async def evaluate(self, tensors: object) -> float:
        x = np.zeros(16, np.float32) if tensors is None else tensors["w"]  # type: ignore[index]
        return 1.0 + float(np.linalg.norm(x - self.trained))


def near(offset: float) -> np.ndarray:
    return np.full(16, 1.0 + offset, np.float32)


def run_join(swarm: Swarm, records: list[PeerRecord], rules: JoinRules = JoinRules()):
    judged = judge_steps(records, ME, step=0, margin=2, budget=0, rules=rules)
    assert judged is not None
    own = {"w": np.zeros(16, np.float32)}
    return asyncio.run(join_swarm(judged, swarm.fetch, swarm.evaluate, own, rules))


def test_a_noisy_peer_among_the_sources_is_refused_by_loss_and_the_next_one_stands_in() -> None:
    swarm = Swarm({"a": (near(0.01), 300), "b": (near(-0.01), 302), "noise": (near(5.0), 301),
                   "c": (near(0.02), 299)})
    outcome = run_join(swarm, [record(p, s) for p, s in [("a", 300), ("b", 302), ("noise", 301), ("c", 299)]])
    # the closest claims first: a (300), noise (301), c (299); b (302) stands in for the refused one
    assert swarm.asked == ["a", "noise", "c", "b"]
    assert outcome.refused == {"noise": Refused.LOSS}
    assert outcome.sources == ("a", "b", "c") and outcome.step == 300
    assert outcome.describe() == "peers a, b, c at step 300"
    np.testing.assert_allclose(outcome.tensors["w"], near(0.01), atol=1e-6)  # the median of three


def test_a_failed_download_is_replaced_by_the_next_candidate() -> None:
    # a, gone and bad claim the reference step (the first band of candidates, asked first); b and c are a
    # band further (21 and 25 steps on) and stand in for the two that fail
    swarm = Swarm({"a": (near(0.0), 300), "gone": (ConnectionError("down"), 300), "b": (near(0.01), 321),
                   "c": (near(-0.01), 325), "bad": (WireError("broken"), 300)})
    outcome = run_join(swarm, [record(p, s) for p, s in [("a", 300), ("gone", 300), ("b", 321), ("c", 325),
                                                         ("bad", 300)]])
    assert outcome.refused == {"gone": Refused.UNREACHABLE, "bad": "wire_error"}
    assert outcome.sources == ("a", "b", "c") and outcome.step == 321  # the median of 300, 321, 325


NAMES = ("x", "y", "z")


class PartsSwarm(Swarm):
    """Peers serving a three-tensor model from any start; a peer in `breaks` sends that many tensors of
    it whole and then breaks off with the given error, as a donor that dies or stalls mid-download."""

    def __init__(self, answers: dict[str, tuple[np.ndarray | Exception, int]],
                 breaks: dict[str, tuple[int, Exception]], names: tuple[str, ...] = NAMES) -> None:
        super().__init__(answers)
        self.breaks = breaks
        self.names = names
        self.starts: list[tuple[str, int]] = []
        self.ranges: list[tuple[str, int, int]] = []  # (peer, start, stop) of every fetch
        self.trained = np.full(len(names) * 16, 1.0, np.float32)

    async def fetch(self, peer: str, progress: object = None, *, start: int = 0, stop: int | None = None,
                    delivered: Delivered | None = None) -> tuple[dict[str, np.ndarray], int, int]:
        self.asked.append(peer)
        self.starts.append((peer, start))
        self.ranges.append((peer, start, len(self.names) if stop is None else stop))
        value, step = self.answers[peer]
        assert isinstance(value, np.ndarray)
        tensors = {name: value.copy() for name in self.names[start:stop]}
        if peer in self.breaks:
            assert delivered is not None
            sent, error = self.breaks[peer]
            delivered.step, delivered.tensors = step, dict(list(tensors.items())[:sent])
            raise error
        return tensors, 0, step

    async def evaluate(self, tensors: object) -> float:
        if tensors is None:
            return 1.0 + float(np.linalg.norm(self.trained))
        joined = np.concatenate([tensors[name] for name in self.names])  # type: ignore[index]
        return 1.0 + float(np.linalg.norm(joined - self.trained))


def run_parts_join(swarm: PartsSwarm, claims: list[tuple[str, int]], rules: JoinRules = JoinRules()) -> JoinOutcome:
    judged = judge_steps([record(p, s) for p, s in claims], ME, step=0, margin=2, budget=0)
    assert judged is not None
    own = {name: np.zeros(16, np.float32) for name in swarm.names}
    return asyncio.run(join_swarm(judged, swarm.fetch, swarm.evaluate, own, rules))


SPOT = JoinRules(check=JoinCheck.SPOT)


def ranked(peers: list[str], step: int = 300) -> list[str]:
    """The order this joiner asks equally good donors in (its own hash order, judge_steps)."""
    judged = judge_steps([record(p, step) for p in peers], ME, step=0, margin=2, budget=0)
    assert judged is not None
    return [r.peer_id for r in judged.candidates]


def test_a_spot_checked_join_downloads_one_copy_and_a_block_of_it_from_two_other_donors() -> None:
    """`--join-check spot` with one stripe: one whole copy from the first donor and one block of it from two
    other donors (not three copies); the block keeps the median of the three, the rest is the donor's."""
    first, second, third, fourth = ranked(["a", "b", "c", "d"])
    values = {first: near(0.01), second: near(-0.01), third: near(0.03), fourth: near(0.0)}
    swarm = PartsSwarm({p: (v, 300) for p, v in values.items()}, breaks={})
    outcome = run_parts_join(swarm, [(p, 300) for p in values], JoinRules(check=JoinCheck.SPOT, stripes=1))
    assert outcome.check == JoinCheck.SPOT and outcome.sources == (first,) and outcome.refused == {}
    assert outcome.checked == {first: [second, third]} and outcome.as_dict()["check"] == "spot"
    (block,) = {(a, b) for p, a, b in swarm.ranges if p != first}
    assert sorted(swarm.ranges) == sorted([(first, 0, 3), (second, *block), (third, *block)]) and block[1] - block[0] == 1
    assert outcome.tensors is not None
    assert outcome.loss == outcome.losses[first] and outcome.as_dict()["loss"] == outcome.loss  # the copy's, as checked
    for i, name in enumerate(NAMES):
        expected = near(0.01) if i != block[0] else np.median([values[first], values[second], values[third]], axis=0)
        np.testing.assert_allclose(outcome.tensors[name], expected, atol=1e-7)


def test_a_spot_checked_copy_is_striped_over_several_donors_at_once_each_part_checked_by_two_others() -> None:
    order = ranked(["a", "b", "c", "d"])
    swarm = PartsSwarm({p: (near(0.01 * i), 300) for i, p in enumerate(order)}, breaks={})
    outcome = run_parts_join(swarm, [(p, 300) for p in order], SPOT)
    # three tensors: three stripes of one tensor each, from the first three donors; the fourth only checks
    donors = {p: (a, b) for p, a, b in swarm.ranges if b - a == 1 and p in order[:3] and (p, a) in swarm.starts[:3]}
    assert outcome.sources == tuple(sorted(order[:3])) and outcome.refused == {}
    assert sorted(donors.values()) == [(0, 1), (1, 2), (2, 3)], swarm.ranges
    assert all(len(set(c)) == 2 and donor not in c for donor, c in outcome.checked.items()) and len(outcome.checked) == 3


@pytest.mark.parametrize("stripes,hostile_at", [(1, 0), (1, 1), (1, 2), (4, 0), (4, 2)])
def test_a_spot_check_refuses_a_far_donor_and_a_far_checker_cannot_frame_an_honest_one(stripes: int,
                                                                                        hostile_at: int) -> None:
    """A donor whose part is far from the swarm's (within the value bound) is refused by the spot check
    and its range comes from the next candidate; a far checker does not get an honest donor refused."""
    order = ranked(["a", "b", "c", "d", "e"])
    hostile = order[hostile_at]
    swarm = PartsSwarm({p: (near(3.0) if p == hostile else near(0.01 * i), 300) for i, p in enumerate(order)},
                       breaks={})
    outcome = run_parts_join(swarm, [(p, 300) for p in order], JoinRules(check=JoinCheck.SPOT, stripes=stripes))
    assert outcome.check == JoinCheck.SPOT and hostile not in outcome.sources
    serving = order[:min(stripes, 3)]  # the stripes' first donors (3 tensors: at most 3 stripes)
    if hostile in serving:
        assert outcome.refused == {hostile: Refused.SPOT_CHECK}, outcome
        assert set(outcome.sources) == {*serving, order[len(serving)]} - {hostile}
    else:
        assert outcome.refused == {} and set(outcome.sources) == set(serving)
    assert outcome.tensors is not None and all(np.abs(t - 1.0).max() < 0.05 for t in outcome.tensors.values())


def test_a_spot_checked_copy_that_does_not_beat_the_own_model_falls_back_to_three_copies() -> None:
    order = ranked(["a", "b", "c", "d"])
    swarm = PartsSwarm({p: (near(-3.0 - 0.01 * i), 300) for i, p in enumerate(order)}, breaks={})
    outcome = run_parts_join(swarm, [(p, 300) for p in order], SPOT)
    assert outcome.check == JoinCheck.MEDIAN and outcome.tensors is None
    assert outcome.refused[order[0]] == Refused.LOSS and set(outcome.refused) == set(order)


def test_after_a_spot_checked_copy_fails_its_loss_check_its_donors_still_serve_whole_copies() -> None:
    """Which part of a striped copy let its loss down is not known (a donor may alter tensors outside its
    block): its donors are not refused for it, and the three whole copies may come from them."""
    order = ranked(["a", "b", "c", "d"])

    class FirstCopyBad(PartsSwarm):
        copies = 0

        async def evaluate(self, tensors: object) -> float:
            if tensors is not None:
                self.copies += 1
                if self.copies == 1:  # the spot-checked copy
                    return 1e9
            return await super().evaluate(tensors)

    swarm = FirstCopyBad({p: (near(0.001 * i), 300) for i, p in enumerate(order)}, breaks={})
    outcome = run_parts_join(swarm, [(p, 300) for p in order], SPOT)
    assert outcome.check == JoinCheck.MEDIAN and outcome.refused == {} and len(outcome.sources) == 3
    assert set(outcome.sources) <= set(order) and outcome.checked  # the spot check ran first


def test_a_stripe_whose_donor_breaks_off_is_finished_by_a_donor_that_finished_its_own() -> None:
    """With no candidate left, a range whose donor broke off is sent by a donor that completed its own
    range (each part is checked on its own); a part checked by two of the others keeps its median."""
    order = ranked(["a", "b", "c", "d"])  # four donors, four ranges of one tensor: no candidate to spare
    victim = order[1]
    swarm = PartsSwarm({p: (near(0.01 * i), 300) for i, p in enumerate(order)},
                       breaks={victim: (0, TransferStalled("no piece for 10 s"))}, names=("w", "x", "y", "z"))
    outcome = run_parts_join(swarm, [(p, 300) for p in order], SPOT)
    assert outcome.check == JoinCheck.SPOT and outcome.refused == {victim: Refused.STALLED}
    # the four ranges, then the victim's again (before any check), from a donor that finished another
    stripes, (again, start, stop) = swarm.ranges[:4], swarm.ranges[4]
    assert sorted((a, b) for _, a, b in stripes) == [(0, 1), (1, 2), (2, 3), (3, 4)] and (victim, 1, 2) in stripes
    assert (start, stop) == (1, 2) and again in set(order) - {victim}, swarm.ranges
    assert outcome.sources == tuple(sorted(set(order) - {victim})), outcome
    assert outcome.tensors is not None and all(np.abs(t - 1.0).max() < 0.05 for t in outcome.tensors.values())


def test_a_busy_checker_is_passed_over_not_refused_and_checks_spread_over_the_candidates() -> None:
    """A checker that refuses a block (busy uploading to others, or rate-limited) is not at fault: the next
    one checks instead and it stays a candidate. The checks of several parts rotate over the candidates."""
    order = ranked(["a", "b", "c", "d", "e", "f", "g", "h"])
    busy = order[1]

    class Busy(PartsSwarm):
        async def fetch(self, peer, progress=None, *, start=0, stop=None, delivered=None):
            if peer == busy and len(self.ranges) >= 4:  # after the four ranges: it refuses every block
                self.ranges.append((peer, start, stop))
                raise PeerRejected("uploading")
            return await super().fetch(peer, progress, start=start, stop=stop, delivered=delivered)

    swarm = Busy({p: (near(0.01 * i), 300) for i, p in enumerate(order)}, breaks={}, names=("w", "x", "y", "z"))
    outcome = run_parts_join(swarm, [(p, 300) for p in order], SPOT)
    assert outcome.check == JoinCheck.SPOT and outcome.refused == {} and busy in outcome.sources
    assert all(busy not in checkers for checkers in outcome.checked.values()) and len(outcome.checked) == 4
    checks = [p for checkers in outcome.checked.values() for p in checkers]
    # each part's checks start further along the candidates: no peer checks more than two of the four
    assert max(checks.count(p) for p in checks) <= 2 and len(set(checks)) >= 5, outcome.checked


def test_a_spot_check_that_cannot_find_two_checkers_falls_back_to_whole_copies_from_the_donors_left() -> None:
    order = ranked(["a", "b", "c"])
    victim = order[0]
    swarm = PartsSwarm({p: (near(0.01 * i), 300) for i, p in enumerate(order)},
                       breaks={victim: (0, ConnectionError("reset"))})
    outcome = run_parts_join(swarm, [(p, 300) for p in order], SPOT)
    assert outcome.check == JoinCheck.MEDIAN and outcome.sources == tuple(sorted(order[1:]))
    assert outcome.refused == {victim: Refused.UNREACHABLE}


def test_with_fewer_than_three_donors_a_spot_check_join_takes_the_median_of_what_there_is() -> None:
    swarm = PartsSwarm({"a": (near(0.01), 300), "b": (near(-0.01), 300)}, breaks={})
    outcome = run_parts_join(swarm, [("a", 300), ("b", 300)], SPOT)
    assert outcome.check == JoinCheck.MEDIAN and outcome.sources == ("a", "b") and not outcome.checked


def test_auto_spot_checks_a_model_of_a_quarter_gib_and_more() -> None:
    big = SPOT_CHECK_BYTES // 4
    assert join_check(JoinCheck.AUTO, big - 1) is JoinCheck.MEDIAN and join_check(JoinCheck.AUTO, big) is JoinCheck.SPOT
    assert join_check(JoinCheck.MEDIAN, big) is JoinCheck.MEDIAN and join_check(JoinCheck.SPOT, 4) is JoinCheck.SPOT


def test_a_copy_whose_donor_breaks_off_is_finished_by_the_next_donor_from_the_first_missing_tensor() -> None:
    """A donor that dies or stalls mid-download leaves the tensors it sent whole: the next candidate
    sends only the rest of that copy, and both are its sources (its loss is theirs)."""
    swarm = PartsSwarm({"a": (near(0.01), 300), "b": (near(-0.01), 300), "c": (near(0.0), 300),
                        "d": (near(0.02), 321)}, breaks={"a": (2, TransferStalled("no piece for 10 s"))})
    outcome = run_parts_join(swarm, [("a", 300), ("b", 300), ("c", 300), ("d", 321)])
    assert sorted(swarm.starts) == [("a", 0), ("b", 0), ("c", 0), ("d", 2)]
    assert outcome.sources == ("a", "b", "c", "d") and outcome.refused == {}
    assert outcome.losses["a"] == outcome.losses["d"] and outcome.step == 300


def test_a_copy_no_donor_is_left_to_finish_is_dropped_and_its_donor_reported_as_broken_off() -> None:
    swarm = PartsSwarm({"a": (near(0.01), 300), "b": (near(-0.01), 300)},
                       breaks={"a": (1, ConnectionError("reset"))})
    outcome = run_parts_join(swarm, [("a", 300), ("b", 300)])
    assert outcome.sources == ("b",) and outcome.refused == {"a": Refused.UNREACHABLE} and "a" not in outcome.losses


@pytest.mark.parametrize("case", ["out_of_range", "step_out_of_bounds"])
def test_what_a_donor_sent_before_breaking_off_is_kept_only_if_its_values_and_step_pass(case: str) -> None:
    """A hostile donor cannot slip a few tensors into a copy by breaking off after them: they are checked
    like a whole download's, and a copy whose donor failed a check starts over with the next one."""
    value, step = (near(0.0) * 1e5, 300) if case == "out_of_range" else (near(0.0), 10**9)
    swarm = PartsSwarm({"bad": (value, step), "b": (near(-0.01), 300), "c": (near(0.0), 300),
                        "d": (near(0.02), 321)}, breaks={"bad": (2, TimeoutError())})
    outcome = run_parts_join(swarm, [("bad", 300), ("b", 300), ("c", 300), ("d", 321)])
    assert ("d", 0) in swarm.starts and outcome.refused == {"bad": case}
    assert outcome.sources == ("b", "c", "d") and "bad" not in outcome.losses


def test_scaled_parameters_are_refused_by_the_value_bound_before_they_are_evaluated() -> None:
    swarm = Swarm({"a": (near(0.0), 300), "scaled": (near(0.0) * 1e5, 300)})
    outcome = run_join(swarm, [record("a", 300), record("scaled", 300)])
    assert outcome.refused == {"scaled": "out_of_range"} and "scaled" not in outcome.losses
    assert outcome.sources == ("a",)


def test_a_reply_claiming_another_step_than_the_record_is_refused() -> None:
    swarm = Swarm({"a": (near(0.0), 300), "liar": (near(0.0), 10**9)})
    outcome = run_join(swarm, [record("a", 300), record("liar", 300)])
    assert outcome.refused == {"liar": Refused.STEP_OUT_OF_BOUNDS} and outcome.sources == ("a",)


def test_when_every_download_is_worse_than_the_own_model_nothing_is_adopted() -> None:
    swarm = Swarm({"a": (near(-3.0), 300), "b": (near(-4.0), 300)})
    outcome = run_join(swarm, [record("a", 300), record("b", 300)])
    assert outcome.tensors is None and outcome.refused == {"a": Refused.LOSS, "b": Refused.LOSS}


def test_a_combination_worse_than_its_parts_falls_back_to_the_best_download() -> None:
    # two good copies on either side of the optimum average to something worse (a loss with two minima)
    class TwoMinima(Swarm):
        async def evaluate(self, tensors: object) -> float:
            x = np.zeros(16, np.float32) if tensors is None else tensors["w"]  # type: ignore[index]
            return 1.0 + min(float(np.linalg.norm(x - 1.0)), float(np.linalg.norm(x + 1.0)) + 0.01)

    swarm = TwoMinima({"a": (np.full(16, 1.0, np.float32), 300), "b": (np.full(16, -1.0, np.float32), 300)})
    outcome = run_join(swarm, [record("a", 300), record("b", 300)])
    assert outcome.sources == ("a",) and outcome.combined_loss is not None and outcome.combined_loss > 4.0


def test_a_combination_that_gives_up_what_the_copies_trained_falls_back_to_the_best_download() -> None:
    # each copy passes the per-download limit (own 5.0, best 2.0: up to 2.75), but their mean evaluates
    # 8% above the best copy: within the per-download limit, beyond the combination's (5% of the best)
    losses = {1.0: 2.0, 1.2: 2.4, 1.1: 2.16}

    class Valley(Swarm):
        async def evaluate(self, tensors: object) -> float:
            return 5.0 if tensors is None else losses[round(float(tensors["w"][0]), 1)]  # type: ignore[index]

    swarm = Valley({"a": (np.full(16, 1.0, np.float32), 300), "b": (np.full(16, 1.2, np.float32), 300)})
    outcome = run_join(swarm, [record("a", 300), record("b", 300)])
    assert outcome.losses == {"a": 2.0, "b": 2.4} and outcome.combined_loss == 2.16
    assert outcome.sources == ("a",) and np.array_equal(outcome.tensors["w"], np.full(16, 1.0, np.float32))
    assert JoinRules().combined_limit(5.0, 2.0) == 2.1
    assert outcome.loss == 2.0  # the adopted copy's, as evaluated: the node does not evaluate it again


def test_the_outcome_carries_the_loss_of_what_it_adopts_as_the_check_measured_it() -> None:
    """The node reports it as its validation loss after the download instead of evaluating again."""
    losses = {1.0: 2.0, 1.1: 2.1, 1.2: 2.2, 9.0: 7.0}  # 9.0: worse than the own model (5.0)

    class Measured(Swarm):
        async def evaluate(self, tensors: object) -> float:
            return 5.0 if tensors is None else losses[round(float(tensors["w"][0]), 2)]  # type: ignore[index]

    one = run_join(Measured({"a": (np.full(16, 1.0, np.float32), 300)}), [record("a", 300)])
    assert one.sources == ("a",) and one.loss == 2.0 and one.combined_loss is None
    three = Measured({p: (np.full(16, v, np.float32), 300) for p, v in (("a", 1.0), ("b", 1.1), ("c", 1.2))})
    outcome = run_join(three, [record(p, 300) for p in "abc"])
    assert outcome.sources == ("a", "b", "c") and outcome.loss == outcome.combined_loss == 2.1  # the median, 1.1
    nothing = run_join(Measured({"a": (np.full(16, 9.0, np.float32), 300)}), [record("a", 300)])
    assert nothing.tensors is None and nothing.loss is None


def test_a_joiner_of_an_int8_swarm_starts_from_its_donors_exact_parameters() -> None:
    """The downloads of a D-SGD joiner run over real gossip peers whose rounds gossip int8: what it adopts
    is the median of its donors' fp32 parameters, bit for bit, not of their int8 images."""
    rng = np.random.default_rng(7)
    trained = rng.standard_normal(4096).astype(np.float32)
    donors = {p: (trained + 0.01 * rng.standard_normal(4096)).astype(np.float32) for p in ("a", "b", "c")}

    async def main() -> JoinOutcome:
        net = InMemoryNetwork()
        settings = ExchangeSettings(swarm="s", config_hash="h", codec=get_codec("int8"), exchange_timeout_s=2.0)
        me = GossipPeer(net.transport(ME), settings, {"w": np.zeros(4096, np.float32)})
        peers = [GossipPeer(net.transport(p), settings, {"w": w}, step=300) for p, w in donors.items()]
        for peer in (me, *peers):
            await peer.start()

        async def evaluate(tensors: object) -> float:
            x = np.zeros(4096, np.float32) if tensors is None else tensors["w"]  # type: ignore[index]
            return 1.0 + float(np.linalg.norm(x - trained))

        judged = judge_steps([record(p, 300) for p in donors], ME, step=0, margin=2, budget=0)
        assert judged is not None
        return await asyncio.wait_for(join_swarm(judged, me.fetch, evaluate, me.tensors), 20)

    outcome = asyncio.run(main())
    assert outcome.sources == ("a", "b", "c") and outcome.tensors is not None
    np.testing.assert_array_equal(outcome.tensors["w"], combine([{"w": w} for w in donors.values()])["w"])


def test_over_real_gossip_peers_a_donor_killed_mid_download_leaves_its_whole_tensors_and_the_next_sends_the_rest(
) -> None:
    """Four donors, three copies wanted: the donor on a slow link killed once it sent more than one of the
    three 1.2 MB tensors leaves those it sent whole (its stream cut inside the next), and the fourth donor
    is asked only from the first tensor missing; the copy's tensors are the first donor's, then the
    fourth's, exactly."""
    size = 300_000
    rng = np.random.default_rng(11)
    trained = {name: rng.standard_normal(size).astype(np.float32) for name in NAMES}
    donors = {p: {name: (w + 0.01 * rng.standard_normal(size)).astype(np.float32) for name, w in trained.items()}
              for p in ("a", "b", "c", "d")}
    starts: list[tuple[str, int]] = []

    async def main() -> JoinOutcome:
        net = InMemoryNetwork()
        settings = ExchangeSettings(swarm="s", config_hash="h", codec=get_codec("fp32"), exchange_timeout_s=2.0)
        me = GossipPeer(net.transport(ME), settings, {name: np.zeros(size, np.float32) for name in NAMES})
        peers = [GossipPeer(net.transport(p), settings, tensors, step=300) for p, tensors in donors.items()]
        for peer in (me, *peers):
            await peer.start()
        net.set_link("a", ME, LinkModel(bandwidth_bytes_per_s=2e6))  # ~1.8 s for a's 3.6 MB

        async def kill_a_after(progress: TransferProgress) -> None:
            while progress.bytes_done < 2_600_000:  # more than two 1 MiB chunks: tensor x whole, y not
                await asyncio.sleep(0.005)
            await net.kill("a")

        async def fetch(peer: str, progress: TransferProgress | None = None, *, start: int = 0,
                        stop: int | None = None, delivered: Delivered | None = None
                        ) -> tuple[dict[str, np.ndarray], int, int]:
            starts.append((peer, start))
            assert progress is not None
            killer = asyncio.create_task(kill_a_after(progress)) if peer == "a" else None
            try:
                return await me.fetch(peer, progress, start=start, stop=stop, delivered=delivered)
            finally:
                if killer is not None:
                    await asyncio.wait_for(killer, 10)

        async def evaluate(tensors: object) -> float:
            got = {name: np.zeros(size, np.float32) for name in NAMES} if tensors is None else tensors
            return 1.0 + sum(float(np.linalg.norm(got[n] - trained[n])) for n in NAMES)  # type: ignore[index]

        judged = judge_steps([record(p, 300) for p in ("a", "b", "c")] + [record("d", 321)], ME, step=0, margin=2,
                             budget=0)
        assert judged is not None
        return await asyncio.wait_for(join_swarm(judged, fetch, evaluate, me.tensors), 30)

    outcome = asyncio.run(main())
    # a is killed inside its third 1 MiB chunk, or (on a loaded machine) a little later: inside y or z
    resume_at = dict(starts)["d"]
    assert sorted(starts) == [("a", 0), ("b", 0), ("c", 0), ("d", resume_at)] and resume_at in (1, 2), starts
    assert outcome.sources == ("a", "b", "c", "d") and outcome.refused == {} and outcome.tensors is not None
    resumed = {name: donors["a" if i < resume_at else "d"][name] for i, name in enumerate(NAMES)}
    expected = combine([donors["b"], donors["c"], resumed])
    for name in NAMES:
        np.testing.assert_array_equal(outcome.tensors[name], expected[name])


# ---- records that claim what no honest peer does (SPES) ---------------------------------------------


def spes_record(peer: str, step: int, capacity: int) -> PeerRecord:
    return PeerRecord(peer_id=peer, maddrs=(f"/ip4/127.0.0.1/tcp/1/p2p/{peer}",), step=step, round=0, experts=(0,),
                      capacity=capacity, version="test", heartbeat=0.0)


def expert_records(version: int) -> dict[ExpertKey, ExpertRecord]:
    return {(0, e): ExpertRecord(version, "ab" * 32, True) for e in range(4)}


def test_a_capacity_above_the_layer_or_a_version_beyond_the_bound_marks_a_peer_as_overclaiming() -> None:
    capacities = {"a": 4, "b": 1, "starting": 0, "huge-capacity": 2**62}
    records = {"a": expert_records(30), "b": expert_records(89), "huge-versions": expert_records(2**62),
               "one-too-far": {**expert_records(3), (1, 0): ExpertRecord(90, "cd" * 32, False)}}
    bound = version_bound(step=100, sync_every=4, slack=64)  # 25 + 64 = 89
    assert overclaiming_peers(capacities, records, 4, bound) == {"huge-capacity", "huge-versions", "one-too-far"}
    assert overclaiming_peers({"a": 4}, {"a": expert_records(89)}, 4, bound) == frozenset()


def test_a_refused_record_is_no_candidate_and_its_step_claim_counts_for_nothing() -> None:
    view = [record("a", 300), record("b", 310), record("hostile", 900), record("behind", 1)]
    refused = {"hostile": str(Refused.RECORD_OUT_OF_BOUNDS), "behind": str(Refused.RECORD_OUT_OF_BOUNDS)}
    judged = judge_steps(view, ME, step=0, margin=2, budget=0, refused=refused)
    assert judged is not None
    # without it, the lower median of 300, 310, 900 would be 310; "behind" is not ahead, but its record
    # was refused all the same, and the joiner's report says so
    assert judged.reference == 300 and [p.peer_id for p in judged.candidates] == ["a", "b"]
    assert judged.ignored == ()
    assert judged.refused == {"hostile": Refused.RECORD_OUT_OF_BOUNDS, "behind": Refused.RECORD_OUT_OF_BOUNDS}
    assert judged.refusals() == {"hostile": "record_out_of_bounds", "behind": "record_out_of_bounds"}
    only_refused = judge_steps([record("hostile", 300)], ME, step=0, margin=2, budget=0, refused=refused)
    assert only_refused is not None and only_refused.candidates == ()
    assert only_refused.refusals() == {"hostile": "record_out_of_bounds"}


def test_a_refused_record_is_never_downloaded_from_and_is_reported_with_its_reason() -> None:
    swarm = Swarm({"a": (near(0.01), 300), "b": (near(-0.01), 301), "c": (near(0.0), 302), "hostile": (near(0.0), 300)})
    view = [record(p, s) for p, s in [("a", 300), ("b", 301), ("c", 302), ("hostile", 300)]]
    judged = judge_steps(view, ME, step=0, margin=2, budget=0, refused={"hostile": Refused.RECORD_OUT_OF_BOUNDS})
    assert judged is not None
    outcome = asyncio.run(join_swarm(judged, swarm.fetch, swarm.evaluate, {"w": np.zeros(16, np.float32)}))
    assert "hostile" not in swarm.asked and outcome.sources == ("a", "b", "c")
    assert outcome.as_dict()["refused"] == {"hostile": "record_out_of_bounds"}


class _Directory:
    def __init__(self, records: dict[str, dict[ExpertKey, ExpertRecord]]) -> None:
        self.records = records

    async def read(self) -> dict[str, dict[ExpertKey, ExpertRecord]]:
        return self.records


class _Peer:
    """The node's gossip peer as a catch-up uses it: downloads from the stand-in swarm."""

    def __init__(self, swarm: Swarm) -> None:
        self.peer_id, self.round, self.swarm = ME, 0, swarm
        self.tensors = {"w": np.zeros(16, np.float32)}
        self.fetch = swarm.fetch

    def set_tensors(self, tensors: dict[str, np.ndarray], step: int, moved: bool) -> None:
        self.tensors = tensors


class _Trainer:
    def __init__(self, swarm: Swarm) -> None:
        self.step, self.swarm, self.loaded = 0, swarm, None

    async def evaluate(self, tensors: object = None) -> float:
        return await self.swarm.evaluate(tensors)

    async def load_tensors(self, tensors: dict[str, np.ndarray]) -> None:
        self.loaded = tensors

    async def start_from_download(self, step: int) -> None:
        self.step = step


def spes_joiner(view: list[PeerRecord], directory: dict[str, dict[ExpertKey, ExpertRecord]],
                swarm: Swarm) -> SwarmLoop:
    """A SwarmLoop with SPES's algorithm, with stand-ins for what its catch-up touches (4 experts per
    layer, a sync every step): the DHT view and expert directory, the gossip peer's downloads, the trainer."""
    joiner = object.__new__(SwarmLoop)
    joiner.peer, joiner.trainer = _Peer(swarm), _Trainer(swarm)  # type: ignore[assignment]
    joiner.discovery = SimpleNamespace(view=lambda: view)  # type: ignore[assignment]
    joiner.recipe = SimpleNamespace(steps=0, optimizer=SimpleNamespace(local_steps=1))  # type: ignore[assignment]
    joiner.settings = SimpleNamespace(join_check="auto")  # type: ignore[assignment]
    joiner.status = TrainingStatus(model="m", optimizer="adamw", steps_target=0, trainable_params=16)
    joiner.must_download, joiner._record_sample, joiner._catch_up_with = False, None, None
    spes = joiner.algorithm = object.__new__(SpesAlgorithm)
    spes.peer = joiner.peer
    spes.directory = _Directory(directory)  # type: ignore[assignment]
    spes.partition = SimpleNamespace(experts_per_layer=4)  # type: ignore[assignment]
    spes.spes_config = SimpleNamespace(sync_every=1)  # type: ignore[assignment]

    async def connect(records: object) -> None:
        return None

    joiner._connect = connect
    return joiner


@pytest.mark.parametrize("claim", ["capacity", "versions"])
def test_a_spes_joiner_takes_nothing_from_a_peer_claiming_capacity_2_62_or_versions_2_62(claim: str) -> None:
    """The hostile peer serves the best parameters of all, at an honest step: only its record gives it
    away (a capacity above the layer's 4 experts, or expert versions far beyond step 300's bound)."""
    swarm = Swarm({"a": (near(0.01), 300), "b": (near(-0.01), 301), "c": (near(0.02), 299),
                   "hostile": (near(0.0), 300)})
    capacity = 2**62 if claim == "capacity" else 4
    view = [spes_record("a", 300, 4), spes_record("b", 301, 2), spes_record("c", 299, 4),
            spes_record("hostile", 300, capacity), spes_record(ME, 0, 0)]
    directory = {"a": expert_records(300), "b": expert_records(301), "c": expert_records(299),
                 "hostile": expert_records(2**62 if claim == "versions" else 300), ME: expert_records(0)}
    joiner = spes_joiner(view, directory, swarm)
    asyncio.run(joiner.catch_up(asyncio.Event(), margin=2, look=False))
    joined = joiner.status.joined
    assert joined is not None and joined["refused"] == {"hostile": "record_out_of_bounds"}, joined
    assert "hostile" not in swarm.asked and joined["sources"] == ["a", "b", "c"], (swarm.asked, joined)
    assert joiner.status.started_from == "peers a, b, c at step 300"
    np.testing.assert_allclose(joiner.trainer.loaded["w"], near(0.01), atol=1e-6)  # the median of the honest three
    # the same swarm with an honest record in its place: it is a source, closest to the reference
    honest = spes_joiner([*view[:3], spes_record("hostile", 300, 4), view[4]],
                         {**directory, "hostile": expert_records(300)}, Swarm(dict(swarm.answers)))
    asyncio.run(honest.catch_up(asyncio.Event(), margin=2, look=False))
    assert honest.status.joined is not None and "hostile" in honest.status.joined["sources"], honest.status.joined
