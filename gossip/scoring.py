"""Contribution scoring of neighbours (Gauntlet-style): the rating math. Every scored round a node measures
how much each neighbour's update lowers its held-out loss, against its own update (node.swarm.contribution
measures); `samples` turns those gains into one sample per neighbour, and `ContributionRatings` rates each
peer over time and says how much of its mixing weight it keeps: all, `score_down_weight` of it, or none.

docs/threat-model.md ("Useless updates") says what this bounds; docs/training.md the knobs and the cost.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated

import msgspec
import numpy as np

SAMPLE_CLIP = 4.0  # a sample is at most this many times the yardstick, either way
CONFIDENCE = 2.0  # standard errors a low score must be below score_low by (ContributionRatings._upper)
WINDOW = 8  # scored rounds whose own gains the yardstick is the median of
TRACKED = 1024  # peers rated at most; the one rated least recently is forgotten first


class ScoreState(StrEnum):
    """Where a peer stands by its rating (the `state` of the status document's `contribution`)."""

    RATED = "rated"  # full mixing weight
    DOWN_WEIGHTED = "down_weighted"  # rating below score_low: its weight scaled by score_down_weight
    EXCLUDED = "excluded"  # below score_low for score_exclude_after ratings in a row: not mixed


class ScoringSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Contribution scoring's knobs, each declared once (gossip.knobs): the node's settings `gossip.score_*`
    with their flags and variables (node.config.table), hence docs/cli.md's table. Each node's own choice."""

    score_every: Annotated[int, msgspec.Meta(
        ge=0, le=10**6, extra={"metavar": "K", "noun": "round count"},
        description="score what each neighbour's update does to this node's held-out loss every K-th round "
                    "(dsgd and dadam without --gossip-compression, and diloco's outer rounds), rate peers over time, "
                    "and down-weight, then exclude, those whose updates do not help; 0: off",
    )] = 8
    score_alpha: Annotated[float, msgspec.Meta(
        gt=0.0, le=1.0, extra={"metavar": "ALPHA"},
        description="weight of the newest sample in a peer's contribution rating (an exponential moving average)",
    )] = 0.1
    score_min_rated: Annotated[int, msgspec.Meta(
        ge=1, le=10**6, extra={"metavar": "N", "noun": "rating count"},
        description="ratings a peer needs before its score changes its mixing weight",
    )] = 4
    score_low: Annotated[float, msgspec.Meta(
        ge=-SAMPLE_CLIP, le=SAMPLE_CLIP, extra={"metavar": "SCORE"},
        description="a contribution rating below this down-weights the peer (1: its updates lower this node's "
                    "held-out loss as much as its own do; 0: not at all, as noise)",
    )] = 0.25
    score_down_weight: Annotated[float, msgspec.Meta(
        ge=0.0, le=1.0, extra={"metavar": "FACTOR"},
        description="the factor a down-weighted peer's mixing weight is scaled by",
    )] = 0.5
    score_exclude_after: Annotated[int, msgspec.Meta(
        ge=1, le=10**6, extra={"metavar": "N", "noun": "rating count"},
        description="a peer rated below --score-low this many times in a row is excluded (not mixed) until its "
                    "rating recovers",
    )] = 3
    score_sequences: Annotated[int, msgspec.Meta(
        ge=1, le=4096, extra={"metavar": "N", "noun": "sequence count"},
        description="held-out sequences (of the swarm's context, drawn across the validation split with a fixed "
                    "seed) each loss of a scored round is measured on; a scored round costs 2 + neighbours forward "
                    "passes over them",
    )] = 16

    @property
    def enabled(self) -> bool:
        return self.score_every > 0

    def scored(self, round_index: int) -> bool:
        """Whether round `round_index` is one whose neighbours are scored."""
        return self.enabled and round_index % self.score_every == 0


class PeerScore(msgspec.Struct, frozen=True):
    """One peer's entry in the status document's `contribution` (schemas/status.json)."""

    score: float  # the rating: an average of samples, each in [-SAMPLE_CLIP, SAMPLE_CLIP] (1: as good as own updates)
    rated_rounds: int
    state: ScoreState


def samples(own_gain: float, gains: Mapping[str, float], weights: Mapping[str, float], own_weight: float,
            window: collections.deque[float]) -> dict[str, float]:
    """Each neighbour's sample of one scored round. A gain is how much moving the node's base (its value
    after the last round's mix, before its own update) toward a value lowers the held-out loss: toward
    neighbour j's value by j's weight w_j (`gains`), toward the node's own updated value by `own_weight`
    (`own_gain`). The yardstick is the median of |own_gain| over the last `window` scored rounds (this
    round's appended first): the node's own updates, which no peer sends, so no peer can inflate it. Then

        sample_j = clip(gain_j / ((w_j / own_weight) * yardstick), -SAMPLE_CLIP, SAMPLE_CLIP):

    about 1 for a neighbour whose update helps as the node's own do, about 0 for one whose update is noise
    (a random direction barely moves the loss), below 0 for one that undoes training. A non-finite gain
    samples -SAMPLE_CLIP. Nothing is sampled (an empty answer) while the yardstick is 0 or unknown."""
    if math.isfinite(own_gain):
        window.append(abs(own_gain))
    yardstick = float(np.median(np.fromiter(window, dtype=np.float64))) if window else 0.0
    if not yardstick > 0.0:
        return {}
    out = {}
    for peer, gain in gains.items():
        relative = weights[peer] / own_weight if own_weight > 0.0 else 1.0
        z = gain / (relative * yardstick) if math.isfinite(gain) and relative > 0.0 else -SAMPLE_CLIP
        out[peer] = min(SAMPLE_CLIP, max(-SAMPLE_CLIP, z))
    return out


class _Rating:
    __slots__ = ("average", "low_run", "rated", "square", "state")

    def __init__(self) -> None:
        self.average = 0.0  # the moving average, before its correction for its start at 0
        self.square = 0.0  # the moving average of the squared samples, likewise
        self.rated = 0
        self.low_run = 0  # ratings in a row below score_low (counted once score_min_rated are in)
        self.state = ScoreState.RATED


class ContributionRatings:
    """Per peer, an exponential moving average of its samples (`samples`) and a count of the rounds rated;
    from those its state and the factor its mixing weight is scaled by. Not thread-safe: one owner."""

    def __init__(self, settings: ScoringSettings | None = None, *, window: int = WINDOW,
                 tracked: int = TRACKED) -> None:
        self.settings = settings or ScoringSettings()
        self._window: collections.deque[float] = collections.deque(maxlen=window)
        self._tracked = tracked
        self._ratings: collections.OrderedDict[str, _Rating] = collections.OrderedDict()
        self.exclusions = 0  # times a peer became excluded

    def rate(self, own_gain: float, gains: Mapping[str, float], weights: Mapping[str, float],
             own_weight: float) -> dict[str, float]:
        """Rate one scored round's neighbours by their gains (see `samples`); returns their samples."""
        s = self.settings
        drawn = samples(own_gain, gains, weights, own_weight, self._window)
        for peer in sorted(drawn):
            rating = self._ratings.get(peer)
            if rating is None:
                rating = self._ratings[peer] = _Rating()
                while len(self._ratings) > self._tracked:
                    self._ratings.popitem(last=False)
            self._ratings.move_to_end(peer)
            rating.average = (1.0 - s.score_alpha) * rating.average + s.score_alpha * drawn[peer]
            rating.square = (1.0 - s.score_alpha) * rating.square + s.score_alpha * drawn[peer] ** 2
            rating.rated += 1
            low = rating.rated >= s.score_min_rated and self._upper(rating) < s.score_low
            rating.low_run = rating.low_run + 1 if low else 0
            before = rating.state
            if not low:
                rating.state = ScoreState.RATED
            elif rating.low_run >= s.score_exclude_after:
                rating.state = ScoreState.EXCLUDED
            else:
                rating.state = ScoreState.DOWN_WEIGHTED
            if rating.state is ScoreState.EXCLUDED and before is not ScoreState.EXCLUDED:
                self.exclusions += 1
        return drawn

    def _score(self, rating: _Rating) -> float:
        """The moving average corrected for its start at 0 (as Adam's moments): the plain mean of the
        samples at first, an exponential average later."""
        return rating.average / (1.0 - (1.0 - self.settings.score_alpha) ** rating.rated)

    def _upper(self, rating: _Rating) -> float:
        """The score plus CONFIDENCE standard errors: a peer counts as low only when even this is below
        score_low, so an honest peer whose samples are noisy (late in training one update's gain on a
        held-out batch is mostly noise) is not taken for a useless one, whose samples sit near 0.

        The samples' variance is the corrected moving average of their squares less the score's square;
        the average's effective sample count is 1 / sum of its weights squared,
        (1 - b^n)^2 (1 - b^2) / (a^2 (1 - b^2n)) with a = score_alpha, b = 1 - a, n = ratings."""
        a, n = self.settings.score_alpha, rating.rated
        b = 1.0 - a
        corrected = 1.0 - b**n
        mean = rating.average / corrected
        variance = max(0.0, rating.square / corrected - mean * mean)
        effective = corrected**2 * (1.0 - b * b) / (a * a * (1.0 - b ** (2 * n))) if a < 1.0 else 1.0
        return mean + CONFIDENCE * math.sqrt(variance / effective)

    def state(self, peer: str) -> ScoreState:
        rating = self._ratings.get(peer)
        return rating.state if rating is not None else ScoreState.RATED

    def factor(self, peer: str) -> float:
        """What `peer`'s mixing weight is scaled by: 1 (rated or never rated), score_down_weight, or 0."""
        state = self.state(peer)
        if state is ScoreState.EXCLUDED:
            return 0.0
        return self.settings.score_down_weight if state is ScoreState.DOWN_WEIGHTED else 1.0

    def scores(self) -> dict[str, PeerScore]:
        return {peer: PeerScore(self._score(r), r.rated, r.state) for peer, r in sorted(self._ratings.items())}
