"""Contribution scoring (gossip.scoring, node.swarm.contribution): the rating math against an independent
numpy computation, noise that never excludes an honest peer, the exchange's use of the factors, and real
trainers where a peer sending random updates of honest norm is rated below every honest one."""

import asyncio
import collections
import math

import numpy as np
import pytest

from gossip.codecs import get_codec
from gossip.exchange import ExchangeSettings, GossipPeer, Skip
from gossip.memory import InMemoryNetwork
from gossip.scoring import CONFIDENCE, SAMPLE_CLIP, WINDOW, ContributionRatings, ScoreState, ScoringSettings, samples
from topology import PeerRound

pytestmark = pytest.mark.unit


def numpy_samples(own_gains: list[float], gains: dict[str, float], weights: dict[str, float],
                  own_weight: float) -> dict[str, float]:
    """The definition, written again: gain_j / ((w_j / w_own) x median |own gain| of the last WINDOW rounds)."""
    yardstick = np.median(np.abs(np.array(own_gains[-WINDOW:])))
    return {p: float(np.clip(g / (weights[p] / own_weight * yardstick), -SAMPLE_CLIP, SAMPLE_CLIP))
            for p, g in gains.items()}


def test_samples_are_gains_over_the_median_own_gain_of_recent_rounds():
    rng = np.random.default_rng(3)
    window: collections.deque[float] = collections.deque(maxlen=WINDOW)
    own_gains: list[float] = []
    for _ in range(3 * WINDOW):
        own = float(rng.normal(0.5, 1.0))
        own_gains.append(own)
        weights = {p: float(rng.uniform(0.1, 0.5)) for p in "abc"}
        gains = {p: float(rng.normal(0.3, 2.0)) for p in "abc"}
        got = samples(own, gains, weights, 0.25, window)
        want = numpy_samples(own_gains, gains, weights, 0.25)
        assert got.keys() == want.keys()
        np.testing.assert_allclose([got[p] for p in want], list(want.values()), rtol=1e-12, atol=1e-12)
    assert max(abs(v) for v in got.values()) <= SAMPLE_CLIP


def test_a_non_finite_gain_is_the_worst_sample_and_no_yardstick_rates_nothing():
    window: collections.deque[float] = collections.deque(maxlen=WINDOW)
    assert samples(0.0, {"a": 1.0}, {"a": 0.5}, 0.5, window) == {}  # a fresh swarm: nothing moved yet
    assert samples(math.nan, {"a": 1.0}, {"a": 0.5}, 0.5, window) == {}  # our own loss diverged
    got = samples(2.0, {"a": math.inf, "b": math.nan, "c": 1.0}, dict.fromkeys("abc", 0.5), 0.5, window)
    assert got == {"a": -SAMPLE_CLIP, "b": -SAMPLE_CLIP, "c": 1.0}  # the yardstick: the median of 0 and 2


def test_ratings_are_a_bias_corrected_moving_average_and_its_confidence_bound():
    """Score and the low test, against the weighted-average form of the moving average."""
    settings = ScoringSettings(score_alpha=0.1, score_min_rated=1, score_low=-SAMPLE_CLIP)
    ratings = ContributionRatings(settings)
    rng = np.random.default_rng(5)
    drawn: list[float] = []
    for _ in range(40):
        got = ratings.rate(1.0, {"p": float(rng.normal(0.4, 1.0))}, {"p": 0.5}, 0.5)  # yardstick 1: sample = gain
        drawn.append(got["p"])
        n, a = len(drawn), settings.score_alpha
        w = a * (1 - a) ** np.arange(n - 1, -1, -1)
        w = w / w.sum()  # the bias-corrected moving average is this weighted mean
        x = np.array(drawn)
        mean = float(w @ x)
        sd = math.sqrt(max(0.0, float(w @ x**2) - mean**2))
        upper = mean + CONFIDENCE * sd * math.sqrt(float(w @ w))
        score = ratings.scores()["p"]
        assert score.rated_rounds == n
        assert score.score == pytest.approx(mean, rel=1e-9, abs=1e-12)
        assert ratings._upper(ratings._ratings["p"]) == pytest.approx(upper, rel=1e-9, abs=1e-12)


def test_a_peer_is_down_weighted_then_excluded_and_recovers_when_its_updates_help_again():
    settings = ScoringSettings(score_alpha=0.5, score_min_rated=2, score_exclude_after=3, score_down_weight=0.5)
    ratings = ContributionRatings(settings)
    states, factors = [], []
    for gain in [0.0] * 5 + [1.0] * 6:  # useless for 5 rounds (sample 0, no spread), then as good as ours
        ratings.rate(1.0, {"p": gain}, {"p": 0.5}, 0.5)
        states.append(ratings.state("p"))
        factors.append(ratings.factor("p"))
    R, D, X = ScoreState.RATED, ScoreState.DOWN_WEIGHTED, ScoreState.EXCLUDED
    assert states[:5] == [R, D, D, X, X]  # at min_rated it is low; the 3rd low rating in a row excludes it
    assert factors[:5] == [1.0, 0.5, 0.5, 0.0, 0.0]
    assert states[-1] is R and factors[-1] == 1.0  # its rating rose above score_low again
    assert ratings.exclusions == 1
    assert ratings.state("never-seen") is R and ratings.factor("never-seen") == 1.0


def test_ratings_remember_a_bounded_number_of_peers():
    ratings = ContributionRatings(tracked=3)
    for i in range(10):
        ratings.rate(1.0, {f"p{i}": 1.0}, {f"p{i}": 0.5}, 0.5)
    assert list(ratings.scores()) == ["p7", "p8", "p9"]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("snr", [2.0, 1.0, 0.6])
def test_noise_never_excludes_an_honest_peer_and_a_useless_one_is_excluded_within_bounded_ratings(seed, snr):
    """Honest gains are drawn like the node's own (mean 1, standard deviation 1/snr: late in training one
    update's gain on a held-out batch is mostly noise); the useless peer's sit near 0 (a random direction
    barely moves the loss). Over 500 ratings with the default knobs no honest peer is excluded and the
    useless one is, within min_rated + exclude_after - 1 ratings."""
    settings = ScoringSettings()
    ratings = ContributionRatings(settings)
    rng = np.random.default_rng(seed)
    excluded_at = None
    for t in range(500):
        gains = {p: float(rng.normal(1.0, 1.0 / snr)) for p in "bcd"}
        gains["useless"] = float(rng.normal(-0.02, 0.05))
        ratings.rate(float(rng.normal(1.0, 1.0 / snr)), gains, dict.fromkeys(gains, 0.25), 0.25)
        for p in "bcd":
            assert ratings.state(p) is not ScoreState.EXCLUDED, (t, p, ratings.scores()[p])
        if excluded_at is None and ratings.state("useless") is ScoreState.EXCLUDED:
            excluded_at = t + 1
    assert excluded_at is not None and excluded_at <= settings.score_min_rated + settings.score_exclude_after - 1
    assert ratings.exclusions == 1


# ---- the knobs, the status and the metrics -----------------------------------------------------------


def test_the_knobs_are_flags_and_variables_and_make_the_scoring_settings(tmp_path, monkeypatch):
    from node.cli import main as cli
    from node.config import SETTINGS_BY_KEY

    monkeypatch.chdir(tmp_path)
    for field in ScoringSettings.__struct_fields__:
        setting = SETTINGS_BY_KEY[f"gossip.{field}"]
        assert setting.flag == "--" + field.replace("_", "-") and setting.env == "MURMUR_" + field.upper()
    config = cli.parse_node_config(["node", "--score-every", "0", "--score-low", "-0.5", "--score-sequences", "8"], {})
    assert config.gossip.scoring == ScoringSettings(score_every=0, score_low=-0.5, score_sequences=8)
    assert not config.gossip.scoring.enabled
    assert cli.parse_node_config(["node"], {"MURMUR_SCORE_ALPHA": "0.3"}).gossip.scoring.score_alpha == 0.3
    from node.config import ConfigError

    with pytest.raises(ConfigError, match="--score-down-weight: 1.5 is out of range"):
        cli.parse_node_config(["node", "--score-down-weight", "1.5"], {})


def test_the_scores_are_in_the_status_murmur_status_and_metrics():
    from test_monitor_node import schema_errors

    from node.cli.status import format_status
    from node.monitor.metrics import _contribution
    from node.monitor.schemas import schema
    from node.swarm.contribution import ContributionScorer

    scorer = ContributionScorer(None, ScoringSettings(score_min_rated=1, score_exclude_after=1))  # type: ignore[arg-type]
    scorer.ratings.rate(1.0, {"QmGood": 1.0, "QmUseless": 0.0}, {"QmGood": 0.5, "QmUseless": 0.5}, 0.5)
    contribution = scorer.status()
    assert contribution == {"QmGood": {"score": pytest.approx(1.0), "rated_rounds": 1, "state": "rated"},
                            "QmUseless": {"score": 0.0, "rated_rounds": 1, "state": "excluded"}}
    properties = schema("status")["properties"]
    assert schema_errors(contribution, properties["contribution"]) == []
    assert schema_errors({"p": {"score": 1.0, "rated_rounds": 1, "state": "trusted"}}, properties["contribution"])
    assert schema_errors(scorer.ratings.exclusions, properties["contribution_exclusions"]) == []
    status = {"peer_id": "QmMe", "swarm": "s", "maddrs": [], "round": 0, "step": 0, "peers": [], "bytes_sent": 0,
              "bytes_received": 0, "errors": {}, "contribution": contribution}
    lines = [line for line in format_status(status).splitlines() if line.startswith("score")]
    assert lines == ["score    QmGood   +1.00 over 1 rounds   rated",
                     "score    QmUseless   +0.00 over 1 rounds   excluded"]

    families = {f.name: f for f in _contribution({"contribution": contribution, "contribution_exclusions": 1})}
    scores = {s.labels["peer_id"]: s.value for s in families["murmur_peer_contribution_score"].samples}
    assert scores == {"QmGood": pytest.approx(1.0), "QmUseless": 0.0}
    assert families["murmur_peer_exclusions"].samples[0].value == 1


# ---- the exchange applies the factors ---------------------------------------------------------------


class FixedJudge:
    def __init__(self, factors: dict[str, float]) -> None:
        self.factors = factors
        self.seen: list[tuple[int, set[str], bool]] = []

    def weigh(self, round_index, own, base, received, weights):
        self.seen.append((round_index, set(received), base is not None))
        return self.factors


def test_a_round_scales_a_down_weighted_neighbour_and_leaves_an_excluded_one_out():
    async def main():
        net = InMemoryNetwork()
        settings = ExchangeSettings(swarm="t", config_hash="c0ffee", codec=get_codec("fp32"), exchange_timeout_s=5.0)
        values = {"a": 0.0, "b": 4.0, "c": 8.0}
        peers = {p: GossipPeer(net.transport(p), settings, {"x": np.full(3, v, np.float32)}) for p, v in values.items()}
        for peer in peers.values():
            await peer.start()
        judge = peers["a"].judge = FixedJudge({"b": 0.5, "c": 0.0})
        plans = {"a": PeerRound(0.5, {"b": 0.25, "c": 0.25}, ()),  # a pulls from b and c
                 "b": PeerRound(1.0, {}, ()), "c": PeerRound(1.0, {}, ())}
        async with asyncio.TaskGroup() as group:
            tasks = {p: group.create_task(peer.run_round(0, plans[p])) for p, peer in peers.items()}
        outcome = tasks["a"].result()
        # b keeps half of its 0.25, c none: a = (0.5 + 0.125 + 0.25) * 0 + 0.125 * 4
        np.testing.assert_allclose(peers["a"].tensors["x"], 0.5, rtol=1e-6)
        assert outcome.mixed_with == ("b",) and outcome.skipped == {"c": str(Skip.EXCLUDED)}
        assert peers["a"].stats.skipped[str(Skip.EXCLUDED)] == 1
        assert judge.seen == [(0, {"b", "c"}, False)]  # no own update yet: nothing to compare with

    asyncio.run(main())


# ---- real trainers ---------------------------------------------------------------------------------


def tiny_trainers(corpus, ids: list[str]) -> dict:
    """One tiny-model DAdam trainer per id, each on its own shard, all from the same initial model."""
    from gossip.optimizers import OptimizerConfig
    from node.train.data import peer_shard
    from node.train.models import build_model
    from node.train.trainer import Trainer, TrainerConfig
    from support.tiny_model import TINY

    config = TrainerConfig(optimizer=OptimizerConfig(algorithm="dadam", lr=1.5e-2, warmup_steps=8), batch_size=8,
                           context=TINY.context, device="cpu", precision="fp32", eval_batch_size=16, eval_batches=2)
    return {p: Trainer(build_model(TINY, seed=0), config, peer_id=p, train_tokens=peer_shard(corpus, p),
                       val_tokens=corpus.val) for p in ids}


@pytest.mark.slow
def test_with_real_trainers_random_updates_of_honest_norm_rate_below_every_honest_peer(corpus):
    """Five tiny-model trainers on their own shards mix uniformly every step (as a complete graph); "e" serves
    its last mix plus a random update of its honest update's norm. Node "a" scores its four neighbours
    every round: within 12 rounds e's score is below every honest peer's, e is excluded, and no honest
    peer is excluded or down-weighted."""
    from node.swarm.contribution import ContributionScorer
    from support.hostile import random_of_norm

    ids = ["a", "b", "c", "d", "e"]
    rng = np.random.default_rng(0)

    async def main():
        trainers = tiny_trainers(corpus, ids)
        try:
            scorer = ContributionScorer(trainers["a"], ScoringSettings(score_every=1))
            last_mix = await trainers["a"].tensors()
            below = None
            for r in range(12):
                served = {}
                for p, trainer in trainers.items():
                    await trainer.train_step()
                    served[p] = await trainer.tensors()
                served["e"] = {n: last_mix[n] + random_of_norm(rng, t.shape, float(np.linalg.norm(t - last_mix[n])))
                               for n, t in served["e"].items()}
                scorer.weigh(r, served["a"], last_mix, {p: served[p] for p in "bcde"}, dict.fromkeys("bcde", 0.2))
                await scorer.wait_idle()
                last_mix = {n: np.mean([served[p][n] for p in ids], axis=0) for n in served["a"]}
                for trainer in trainers.values():
                    await trainer.load_tensors(last_mix)
                scores = scorer.status()
                assert all(scores[p]["state"] == "rated" for p in "bcd"), scores
                if below is None and all(scores["e"]["score"] < scores[p]["score"] for p in "bcd"):
                    below = r
            assert below is not None and below <= 3, scores
            assert scores["e"]["state"] == "excluded" and scores["e"]["rated_rounds"] == 12, scores
            assert scorer.ratings.exclusions == 1 and scorer.scored_rounds == 12
            assert all(scores["e"]["score"] < scores[p]["score"] for p in "bcd"), scores
        finally:
            for trainer in trainers.values():
                trainer.close()

    asyncio.run(main())


def test_a_round_with_many_neighbours_scores_a_few_in_turns():
    from node.swarm.contribution import MAX_SCORED, ContributionScorer

    class Losses:
        def __init__(self) -> None:
            self.scored: list[int] = []

        async def moved_losses(self, own, toward, sequences, budget_s):
            self.scored.append(len(toward) - 1)
            return 1.0, [0.5] * len(toward)

    async def main():
        trainer = Losses()
        scorer = ContributionScorer(trainer, ScoringSettings(score_every=1))
        x = {"w": np.zeros(2, np.float32)}
        received = {f"p{i:02d}": x for i in range(3 * MAX_SCORED)}
        for r in range(3):
            scorer.weigh(r, x, x, received, dict.fromkeys(received, 0.05))
            await scorer.wait_idle()
        assert trainer.scored == [MAX_SCORED] * 3
        assert set(scorer.status()) == set(received)  # three rounds rated each of the twelve once
        assert all(s["rated_rounds"] == 1 for s in scorer.status().values())

    asyncio.run(main())


# ---- gossip DiLoCo's outer rounds ------------------------------------------------------------------


def test_a_diloco_fragments_messages_are_scored_as_the_models_they_lead_to_from_the_anchor():
    """A fragment round's values are messages m (pseudo-gradients): the scorer measures from the node's
    anchor A (whole), toward A - m_i (its own) and A - m_j (each neighbour's), for the fragment's tensors
    only; a judge with no values (rounds of plain anchors) only answers the ratings."""
    from node.algorithms.diloco.scoring import FragmentJudge, models_from_messages
    from node.swarm.contribution import ContributionScorer

    class Losses:
        def __init__(self) -> None:
            self.calls: list[tuple[dict, list]] = []

        async def moved_losses(self, own, toward, sequences, budget_s):
            self.calls.append((own, toward))
            return 1.0, [0.5] * len(toward)

    async def main():
        trainer = Losses()
        scorer = ContributionScorer(trainer, ScoringSettings(score_every=1))
        anchor = {"a": np.full(2, 1.0, np.float32), "b": np.full(3, 5.0, np.float32)}  # fragment: "a"
        judge = FragmentJudge(scorer, lambda: dict(anchor), models_from_messages)
        own, theirs = {"a": np.full(2, 0.25, np.float32)}, {"a": np.full(2, -0.5, np.float32)}
        assert judge.weigh(0, own, None, {"p": theirs}, {"p": 0.5}) == {"p": 1.0}
        anchor["a"] = np.zeros(2, np.float32)  # replaced after the round's values arrived: not what is measured
        await scorer.wait_idle()
        (base, toward), = trainer.calls
        assert base["b"] is not None and set(base) == {"a", "b"}
        np.testing.assert_allclose(base["a"], 1.0)
        (own_model, own_weight), (their_model, weight) = toward
        assert set(own_model) == set(their_model) == {"a"} and (own_weight, weight) == (0.5, 0.5)
        np.testing.assert_allclose(own_model["a"], 0.75)
        np.testing.assert_allclose(their_model["a"], 1.5)
        assert scorer.status()["p"]["rated_rounds"] == 1
        weighed_only = FragmentJudge(scorer, lambda: dict(anchor), None)
        assert weighed_only.weigh(1, own, None, {"p": theirs}, {"p": 0.5}) == {"p": 1.0}
        await scorer.wait_idle()
        assert len(trainer.calls) == 1  # not scored
        # an anchor not known yet (nothing to measure from): not rated
        empty = FragmentJudge(scorer, dict, models_from_messages)
        empty.weigh(2, own, None, {"p": theirs}, {"p": 0.5})
        await scorer.wait_idle()
        assert len(trainer.calls) == 1 and scorer.status()["p"]["rated_rounds"] == 1

    asyncio.run(main())


@pytest.mark.slow
def test_with_real_trainers_a_diloco_neighbours_random_pseudo_gradients_rate_below_every_honest_one(corpus):
    """Gossip DiLoCo's outer rounds: five tiny-model trainers run H = 4 inner steps from a shared anchor on
    their own shards, then average their pseudo-gradients (outer lr 1, a complete graph); "e" sends a random
    pseudo-gradient of its honest one's norm. Node "a" scores its four neighbours' messages every round from
    the anchor: e falls below every honest peer within 3 rounds and is excluded; no honest peer is
    down-weighted or excluded."""
    from node.algorithms.diloco.scoring import FragmentJudge, models_from_messages
    from node.swarm.contribution import ContributionScorer
    from support.hostile import random_of_norm

    ids = ["a", "b", "c", "d", "e"]
    rng = np.random.default_rng(0)

    async def main():
        trainers = tiny_trainers(corpus, ids)
        try:
            scorer = ContributionScorer(trainers["a"], ScoringSettings(score_every=1))
            anchor = await trainers["a"].tensors()
            judge = FragmentJudge(scorer, lambda: dict(anchor), models_from_messages)
            below = None
            for r in range(10):
                messages = {}
                for p, trainer in trainers.items():
                    for _ in range(4):
                        await trainer.train_step()
                    x = await trainer.tensors()
                    messages[p] = {n: anchor[n] - x[n] for n in anchor}
                messages["e"] = {n: random_of_norm(rng, m.shape, float(np.linalg.norm(m))) for n, m in messages["e"].items()}
                judge.weigh(r, messages["a"], None, {p: messages[p] for p in "bcde"}, dict.fromkeys("bcde", 0.2))
                await scorer.wait_idle()
                anchor = {n: anchor[n] - np.mean([messages[p][n] for p in ids], axis=0) for n in anchor}
                for trainer in trainers.values():
                    await trainer.load_tensors(anchor)
                scores = scorer.status()
                assert all(scores[p]["state"] == "rated" for p in "bcd"), scores
                if below is None and all(scores["e"]["score"] < scores[p]["score"] for p in "bcd"):
                    below = r
            assert below is not None and below <= 2, scores
            assert scores["e"]["state"] == "excluded" and scorer.ratings.exclusions == 1, scores
        finally:
            for trainer in trainers.values():
                trainer.close()

    asyncio.run(main())
