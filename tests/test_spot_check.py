"""Tests for node.swarm.spot_check: where a spot check's block falls, and which of three copies of it is an
outlier (against independent numpy computations)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from node.swarm.spot_check import SpotRules, choose_block, compare_block, split_ranges

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("seed", range(20))
def test_a_block_lies_in_its_part_holds_its_share_of_the_bytes_and_moves_with_the_draw(seed: int) -> None:
    rng = random.Random(seed)
    nbytes = [rng.choice([4, 400, 4000, 400_000]) for _ in range(40)]
    start = rng.randrange(0, 30)
    stop = rng.randrange(start + 1, 41)
    share = rng.choice([0.01, 0.05, 0.5, 1.0])
    first, end = choose_block(nbytes, start, stop, share, random.Random(seed + 1000))
    assert start <= first < end <= stop
    assert sum(nbytes[first:end]) >= min(share * sum(nbytes[start:stop]), nbytes[first])
    # no tensor could be left off either end and still hold the share (it is no larger than needed) ...
    wanted = share * sum(nbytes[start:stop])
    assert end - first == 1 or sum(nbytes[first:end - 1]) < wanted or sum(nbytes[first + 1:end]) < wanted
    # ... and the draw decides where it falls
    starts = {choose_block(nbytes, 0, 40, 0.01, random.Random(s))[0] for s in range(50)}
    assert len(starts) > 10


@pytest.mark.parametrize("seed", range(20))
def test_stripes_cover_the_manifest_in_order_with_about_equal_bytes(seed: int) -> None:
    rng = random.Random(seed)
    nbytes = [rng.choice([4, 400, 4000, 400_000]) for _ in range(rng.randrange(1, 60))]
    parts = rng.randrange(1, 8)
    ranges = split_ranges(nbytes, parts)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(nbytes) and len(ranges) <= min(parts, len(nbytes))
    assert all(a < b for a, b in ranges) and all(b == c for (_, b), (c, _) in zip(ranges, ranges[1:]))
    share = sum(nbytes) / parts
    assert all(sum(nbytes[a:b]) <= share + max(nbytes[a:b]) for a, b in ranges)
    if all(n == nbytes[0] for n in nbytes) and len(nbytes) >= parts:  # equal tensors: exactly `parts` stripes
        assert len(ranges) == parts


def test_a_block_outside_the_manifest_is_an_error() -> None:
    with pytest.raises(ValueError):
        choose_block([4, 4], 1, 3, 0.5, random.Random(0))


def _copies(rng: np.random.Generator, spread: float) -> list[dict[str, np.ndarray]]:
    trained = {"w": rng.standard_normal(500).astype(np.float32), "b": rng.standard_normal(7).astype(np.float32)}
    return [{n: (t + spread * rng.standard_normal(t.shape)).astype(np.float32) for n, t in trained.items()}
            for _ in range(3)]


@pytest.mark.parametrize("far", [None, 0, 1, 2])
def test_only_a_far_copy_is_an_outlier_and_only_when_it_is_the_donors(far: int | None) -> None:
    """Three honest copies pass; a far one (noise of the values' size) is the donor's outlier when the donor
    sent it, and a checker that sent it cannot make the honest donor one; the medians are numpy's."""
    rng = np.random.default_rng(3)
    copies = _copies(rng, 0.01)
    own = {n: np.zeros_like(t) for n, t in copies[0].items()}
    if far is not None:
        copies[far] = {n: (t + rng.standard_normal(t.shape)).astype(np.float32) for n, t in copies[far].items()}
    verdict = compare_block(copies[0], copies[1], copies[2], own)
    assert verdict.outlier is (far == 0)
    for name in own:
        np.testing.assert_array_equal(verdict.medians[name], np.median(np.stack([c[name] for c in copies]), axis=0))
    flat = [np.concatenate([c[n] for n in own]) for c in copies]
    median = np.median(np.stack(flat), axis=0)
    assert verdict.distance == pytest.approx(float(np.linalg.norm(flat[0] - median)), rel=1e-5)
    assert verdict.spread == pytest.approx(sum(float(np.linalg.norm(f - median)) for f in flat[1:]), rel=1e-5)


def test_an_honest_donor_a_phase_behind_identical_checkers_passes_for_a_fresh_joiner_but_not_a_close_node() -> None:
    """Checkers whose copies are identical (synced DiLoCo anchors) have no spread: a donor a little behind
    them is judged against how far the swarm moved from the node's own values. For a fresh joiner (its own
    values the initial ones) that is far, and the donor passes; for a node already at the swarm's values
    it is not (it is refused, and the next donor serves: bytes, not a wrong model)."""
    rng = np.random.default_rng(4)
    synced = {"w": rng.standard_normal(500).astype(np.float32)}
    behind = {"w": (synced["w"] + 0.01 * rng.standard_normal(500)).astype(np.float32)}
    fresh = {"w": np.zeros(500, np.float32)}
    assert not compare_block(behind, synced, dict(synced), fresh).outlier
    assert compare_block(behind, synced, dict(synced), {"w": synced["w"] + np.float32(0.001)}).outlier
    assert not compare_block(synced, dict(synced), dict(synced), fresh).outlier  # identical: distance 0


def test_spot_rules_are_checked() -> None:
    for bad in ({"share": 0.0}, {"share": 1.5}, {"spread": 0.0}, {"moved": -1.0}):
        with pytest.raises(ValueError):
            SpotRules(**bad)
