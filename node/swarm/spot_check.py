"""Checking one downloaded copy of the swarm's parameters against a sample of it from two other donors, instead
of downloading three whole copies (docs/training.md, "Joining mid-run": `--join-check spot`)."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from gossip.mixing import coordinate_median

Tensors = Mapping[str, np.ndarray]


@dataclass(frozen=True)
class SpotRules:
    """How much of a donor's part of a copy is checked, and how far from the checkers it may be."""

    share: float = 0.05  # of the part's bytes, at least one tensor, as one block of consecutive tensors
    # a part is refused when its block's distance from the three-way median exceeds both `spread` x the
    # two checkers' distances from it and `moved` x the median's distance from the node's own values
    spread: float = 2.0
    moved: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 < self.share <= 1.0 or self.spread <= 0.0 or self.moved <= 0.0:
            raise ValueError(f"spot rules need 0 < share <= 1 and positive bounds, got {self}")


DEFAULT_SPOT = SpotRules()


def split_ranges(nbytes: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """The manifest cut into up to `parts` consecutive, non-empty ranges [a, b) of about equal bytes (a
    tensor is never split: one larger than a share makes its range larger)."""
    total, count = sum(nbytes), len(nbytes)
    parts = max(1, min(parts, count))
    ranges: list[tuple[int, int]] = []
    start, held = 0, 0
    for i, size in enumerate(nbytes):
        held += size
        left = parts - len(ranges) - 1  # ranges still to cut after this one
        if left and count - (i + 1) >= left and held * parts >= total * (len(ranges) + 1):
            ranges.append((start, i + 1))
            start = i + 1
    ranges.append((start, count))
    return ranges


def choose_block(nbytes: Sequence[int], start: int, stop: int, share: float, rng: random.Random) -> tuple[int, int]:
    """Consecutive tensors [a, b) of [start, stop) holding at least `share` of their bytes (at least one
    tensor), at a position drawn by `rng`: one request per checker, and a donor that cannot know where
    the block falls must serve every tensor honestly to pass."""
    if not 0 <= start < stop <= len(nbytes):
        raise ValueError(f"tensors {start} to {stop} are not a range of {len(nbytes)}")
    wanted = share * sum(nbytes[start:stop])
    first = rng.randrange(start, stop)
    end, held = first, 0
    while end < stop and (end == first or held < wanted):
        held += nbytes[end]
        end += 1
    while held < wanted and first > start:  # the draw fell near the end: grow the block backwards
        first -= 1
        held += nbytes[first]
    return first, end


@dataclass(frozen=True)
class BlockVerdict:
    """A block compared: whether the donor's values are an outlier, the distances that decided it, and the
    coordinate-wise median of the three copies of each tensor (what the copy keeps when they are not)."""

    outlier: bool
    distance: float  # of the donor's values from the median
    spread: float  # the checkers' distances from it, summed
    moved: float  # the median's distance from the node's own values
    medians: dict[str, np.ndarray]


def compare_block(donor: Tensors, first: Tensors, second: Tensors, own: Tensors,
                  rules: SpotRules = DEFAULT_SPOT) -> BlockVerdict:
    """The donor's tensors against two checkers' copies of them: with one of the three hostile, the
    coordinate-wise median stays between the honest two, so an honest donor sits about as close to it as
    the checkers do (or, where honest copies are identical, close next to how far training moved the
    values from the node's own), and a hostile one does not, whichever of the three is hostile."""
    medians: dict[str, np.ndarray] = {}
    squares = np.zeros(4, np.float64)  # distance, first checker's, second's, moved
    for name, x in donor.items():
        flat = [np.asarray(t, np.float32).reshape(-1) for t in (x, first[name], second[name])]
        median = coordinate_median(flat)
        mine = np.asarray(own[name], np.float32).reshape(-1)
        for i, other in enumerate((*flat, mine)):
            squares[i] += float(np.sum(np.square(other - median, dtype=np.float64)))
        medians[name] = median.reshape(np.shape(x))
    distance, first_d, second_d, moved = (math.sqrt(v) for v in squares)
    spread = first_d + second_d
    outlier = distance > max(rules.spread * spread, rules.moved * moved)
    return BlockVerdict(outlier, distance, spread, moved, medians)
