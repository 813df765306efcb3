"""Contribution scoring of neighbours (Gauntlet-style): the rating math. Each scored round a node measures
how much each neighbour's value would lower its held-out loss (the measuring is node.swarm.contribution's);
`ContributionRatings` turns those improvements into per-round samples, rates each peer over time, and
says how much of its mixing weight a peer keeps: all, `score_down_weight` of it, or none (excluded).

docs/threat-model.md ("Useless updates") says what this bounds; docs/training.md the knobs.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated

import msgspec
import numpy as np

SAMPLE_CLIP = 4.0  # a sample is at most this many spreads from the median, either way
WINDOW = 64  # recent improvements (over every neighbour rated) the median and spread come from
TRACKED = 1024  # peers rated at most; the one rated least recently is forgotten first
MAD_TO_SIGMA = 1.4826  # the median absolute deviation of a normal distribution, in standard deviations


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
        description="score what each neighbour's value does to this node's held-out loss every K-th round "
                    "(dsgd and dadam without --gossip-compression), rate peers over time, and down-weight, then "
                    "exclude, those whose updates do not help; 0: off",
    )] = 4
    score_alpha: Annotated[float, msgspec.Meta(
        gt=0.0, le=1.0, extra={"metavar": "ALPHA"},
        description="weight of the newest sample in a peer's contribution rating (an exponential moving average)",
    )] = 0.2
    score_min_rated: Annotated[int, msgspec.Meta(
        ge=1, le=10**6, extra={"metavar": "N", "noun": "rating count"},
        description="ratings a peer needs before its score changes its mixing weight",
    )] = 4
    score_low: Annotated[float, msgspec.Meta(
        ge=-SAMPLE_CLIP, le=0.0, extra={"metavar": "SCORE"},
        description="a contribution rating below this (in spreads of recent improvements from their median) "
                    "down-weights the peer",
    )] = -1.0
    score_down_weight: Annotated[float, msgspec.Meta(
        ge=0.0, le=1.0, extra={"metavar": "FACTOR"},
        description="the factor a down-weighted peer's mixing weight is scaled by",
    )] = 0.5
    score_exclude_after: Annotated[int, msgspec.Meta(
        ge=1, le=10**6, extra={"metavar": "N", "noun": "rating count"},
        description="a peer rated below --score-low this many times in a row is excluded (not mixed) until its "
                    "rating recovers",
    )] = 3

    @property
    def enabled(self) -> bool:
        return self.score_every > 0

    def scored(self, round_index: int) -> bool:
        """Whether round `round_index` is one whose neighbours are scored."""
        return self.enabled and round_index % self.score_every == 0


class PeerScore(msgspec.Struct, frozen=True):
    """One peer's entry in the status document's `contribution` (schemas/status.json)."""

    score: float  # the rating: an average of samples, each in [-SAMPLE_CLIP, SAMPLE_CLIP]
    rated_rounds: int
    state: ScoreState


def samples(improvements: Mapping[str, float], window: collections.deque[float]) -> dict[str, float]:
    """Each neighbour's sample of one scored round: its improvement (held-out loss before minus after moving
    toward its value) as a robust z-score, (d - median) / (1.4826 x median absolute deviation), over the
    recent improvements of every neighbour rated, this round's appended to `window` first; clipped to
    +-SAMPLE_CLIP. A non-finite improvement (the move made the loss inf or nan) samples -SAMPLE_CLIP; while
    the spread is 0 (identical values: a fresh swarm from one seed) every sample is 0, since nothing tells
    the neighbours apart."""
    finite = {peer: d for peer, d in improvements.items() if math.isfinite(d)}
    window.extend(finite[peer] for peer in sorted(finite))
    out = dict.fromkeys(improvements, -SAMPLE_CLIP)
    if not finite:
        return out
    recent = np.fromiter(window, dtype=np.float64)
    median = float(np.median(recent))
    spread = MAD_TO_SIGMA * float(np.median(np.abs(recent - median)))
    for peer, d in finite.items():
        z = (d - median) / spread if spread > 0.0 else 0.0
        out[peer] = min(SAMPLE_CLIP, max(-SAMPLE_CLIP, z))
    return out


class _Rating:
    __slots__ = ("low_run", "rated", "score", "state")

    def __init__(self) -> None:
        self.score = 0.0  # the moving average starts neutral: a new peer is neither good nor bad
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

    def rate(self, improvements: Mapping[str, float]) -> dict[str, float]:
        """Rate one scored round's neighbours by their improvements; returns their samples."""
        s = self.settings
        drawn = samples(improvements, self._window)
        for peer in sorted(drawn):
            rating = self._ratings.get(peer)
            if rating is None:
                rating = self._ratings[peer] = _Rating()
                while len(self._ratings) > self._tracked:
                    self._ratings.popitem(last=False)
            self._ratings.move_to_end(peer)
            rating.score = (1.0 - s.score_alpha) * rating.score + s.score_alpha * drawn[peer]
            rating.rated += 1
            low = rating.rated >= s.score_min_rated and rating.score < s.score_low
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
        return {peer: PeerScore(r.score, r.rated, r.state) for peer, r in sorted(self._ratings.items())}
