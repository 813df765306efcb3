"""Tests for gossip.mixing: renormalised weighted mixing and the robust rules (clipping, median, trimmed mean)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gossip import mixing
from gossip.mixing import MixingRule, effective_weights, mix

pytestmark = pytest.mark.unit

ROBUST_RULES = [MixingRule("median"), MixingRule("trimmed_mean", trim=0.2)]
CONVEX_RULES = [MixingRule("weighted"), MixingRule("clipped", tau=0.5), *ROBUST_RULES]


@st.composite
def rounds(draw: st.DrawFn) -> tuple[np.ndarray, dict[str, np.ndarray], float, dict[str, float]]:
    """A local vector, the weights of a round over 0-6 neighbours, and a random subset that arrived."""
    n = draw(st.integers(1, 40))
    degree = draw(st.integers(0, 6))
    raw = draw(st.lists(st.floats(0.0, 1.0), min_size=degree + 1, max_size=degree + 1))
    if sum(raw) == 0:
        raw[0] = 1.0
    total = sum(raw)
    ids = [f"p{j}" for j in range(degree)]
    weights = {peer: w / total for peer, w in zip(ids, raw[1:])}
    self_weight = 1.0 - sum(weights.values())
    arrived = draw(st.lists(st.sampled_from(ids), unique=True)) if ids else []
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    scale = draw(st.sampled_from([1e-3, 1.0, 1e6]))
    own = rng.standard_normal(n) * scale
    received = {peer: rng.standard_normal(n) * scale for peer in arrived}
    return own, received, max(self_weight, 0.0), weights


@pytest.mark.parametrize("rule", CONVEX_RULES, ids=lambda r: r.kind)
@settings(max_examples=150, deadline=None)
@given(case=rounds())
def test_result_lies_within_coordinatewise_range_of_inputs(rule: MixingRule, case) -> None:
    own, received, self_weight, weights = case
    stack = np.stack([own, *received.values()])
    low, high = stack.min(axis=0), stack.max(axis=0)
    slack = 1e-12 * np.abs(stack).max(axis=0) + 1e-300

    result = mix(own, received, self_weight, weights, rule)

    assert result.shape == own.shape and result.dtype == own.dtype
    assert np.all(result >= low - slack) and np.all(result <= high + slack)


def test_missing_neighbours_weight_moves_to_self() -> None:
    self_w, kept = effective_weights(0.4, {"a": 0.2, "b": 0.15, "c": 0.25}, ["b"])

    assert self_w == pytest.approx(0.4 + 0.2 + 0.25)
    assert kept == pytest.approx({"b": 0.15})


def test_weighted_mix_equals_renormalised_formula() -> None:
    rng = np.random.default_rng(1)
    own, xa, xc = rng.standard_normal((3, 1000))

    result = mix(own, {"a": xa, "c": xc}, 0.25, {"a": 0.25, "b": 0.25, "c": 0.25})

    np.testing.assert_allclose(result, 0.5 * own + 0.25 * xa + 0.25 * xc, rtol=1e-12, atol=1e-15)


def test_weights_within_tolerance_are_rescaled_to_sum_one() -> None:
    self_w, kept = effective_weights(0.5, {"a": 0.5 + 5e-7}, ["a"])

    assert self_w + kept["a"] == pytest.approx(1.0, abs=1e-15)
    assert self_w / kept["a"] == pytest.approx(0.5 / (0.5 + 5e-7), rel=1e-15)


def test_full_arrival_on_doubly_stochastic_cycle_preserves_average_and_reaches_consensus() -> None:
    # 4-cycle with Metropolis-Hastings weights: every row and column sums to 1.
    n = 4
    neighbours = {i: [(i - 1) % n, (i + 1) % n] for i in range(n)}
    rng = np.random.default_rng(2)
    vectors = [rng.standard_normal(257) for _ in range(n)]
    average = np.mean(vectors, axis=0)

    for _ in range(60):
        vectors = [
            mix(
                vectors[i],
                {str(j): vectors[j] for j in neighbours[i]},
                1 / 3,
                {str(j): 1 / 3 for j in neighbours[i]},
            )
            for i in range(n)
        ]
        np.testing.assert_allclose(np.mean(vectors, axis=0), average, rtol=1e-10, atol=1e-12)

    for vector in vectors:
        np.testing.assert_allclose(vector, average, atol=1e-6)


def test_clipping_bounds_move_by_tau_times_arrived_weight() -> None:
    rng = np.random.default_rng(3)
    own = rng.standard_normal(5000)
    received = {"a": own + 100.0, "b": own - 50.0 * rng.standard_normal(5000)}
    weights = {"a": 0.3, "b": 0.2, "c": 0.1}
    tau = 0.7

    result = mix(own, received, 0.4, weights, MixingRule("clipped", tau=tau))

    assert np.linalg.norm(result - own) <= tau * (0.3 + 0.2) * (1 + 1e-12)
    # Both differences are far longer than tau, so each contributes exactly w_ij * tau along it.
    expected = own.copy()
    for peer, vector in received.items():
        diff = vector - own
        expected += weights[peer] * tau * diff / np.linalg.norm(diff)
    np.testing.assert_allclose(result, expected, rtol=1e-10, atol=1e-12)


def test_clipping_with_neighbours_inside_radius_equals_weighted_mix() -> None:
    rng = np.random.default_rng(4)
    own = rng.standard_normal(300)
    received = {"a": own + 1e-3 * rng.standard_normal(300), "b": own + 1e-3 * rng.standard_normal(300)}
    weights = {"a": 0.25, "b": 0.25, "c": 0.25}

    clipped = mix(own, received, 0.25, weights, MixingRule("clipped", tau=10.0))
    weighted = mix(own, received, 0.25, weights)

    np.testing.assert_allclose(clipped, weighted, rtol=1e-12, atol=1e-14)


def _honest_and_byzantine(seed: int) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, float]]:
    rng = np.random.default_rng(seed)
    own = rng.standard_normal(1000).astype(np.float32)
    received = {f"h{j}": rng.standard_normal(1000).astype(np.float32) for j in range(4)}
    received["byz"] = np.full(1000, 1e9, np.float32)
    weights = {peer: 1 / 6 for peer in received}
    return own, received, weights


@pytest.mark.parametrize("rule", ROBUST_RULES, ids=lambda r: r.kind)
def test_robust_rules_ignore_one_byzantine_vector_among_five_honest(rule: MixingRule) -> None:
    own, received, weights = _honest_and_byzantine(5)
    honest = np.stack([own, *(v for peer, v in received.items() if peer != "byz")])

    result = mix(own, received, 1 / 6, weights, rule)

    assert np.all(result >= honest.min(axis=0)) and np.all(result <= honest.max(axis=0))


def test_weighted_mix_is_dragged_by_byzantine_vector() -> None:
    # The contrast that makes the robust test meaningful: plain mixing moves by ~1e9 / 6.
    own, received, weights = _honest_and_byzantine(5)

    result = mix(own, received, 1 / 6, weights)

    assert np.all(result > 1e8)


def test_trimmed_mean_with_too_few_vectors_is_plain_mean() -> None:
    own = np.array([0.0, 3.0])
    received = {"a": np.array([1.0, 6.0]), "b": np.array([1e9, 9.0])}

    # floor(0.2 * 3) = 0: nothing is trimmed, as documented on MixingRule.
    result = mix(own, received, 1 / 3, {"a": 1 / 3, "b": 1 / 3}, MixingRule("trimmed_mean", trim=0.2))

    np.testing.assert_allclose(result, [(1e9 + 1.0) / 3, 6.0])


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("trim", [0.0, 0.1, 0.25, 0.45])
def test_median_and_trimmed_mean_match_sort_reference_across_blocks(count: int, trim: float) -> None:
    rng = np.random.default_rng(count)
    n = 2 * mixing._BLOCK + 17
    own = rng.standard_normal(n).astype(np.float32)
    received = {f"p{j}": rng.standard_normal(n).astype(np.float32) for j in range(count)}
    weights = {peer: 1 / (count + 1) for peer in received}
    stacked = np.sort(np.stack([own, *(received[p] for p in sorted(received))]).astype(np.float64), axis=0)
    m = count + 1
    k = int(np.floor(trim * m + 1e-9))

    median = mix(own, received, 1 / m, weights, MixingRule("median"))
    trimmed = mix(own, received, 1 / m, weights, MixingRule("trimmed_mean", trim=trim))

    np.testing.assert_allclose(median, np.median(stacked, axis=0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(trimmed, stacked[k : m - k].mean(axis=0), rtol=1e-5, atol=1e-6)


def test_weighted_and_clipped_match_reference_across_blocks() -> None:
    rng = np.random.default_rng(6)
    n = 3 * mixing._BLOCK + 5
    own = rng.standard_normal(n)
    received = {"a": rng.standard_normal(n), "b": own + 1e-4}
    weights = {"a": 0.3, "b": 0.5}
    diff_a = received["a"] - own
    tau = 2.0

    weighted = mix(own, received, 0.2, weights)
    clipped = mix(own, received, 0.2, weights, MixingRule("clipped", tau=tau))

    np.testing.assert_allclose(weighted, 0.2 * own + 0.3 * received["a"] + 0.5 * received["b"], rtol=1e-12)
    expected = own + 0.3 * diff_a * tau / np.linalg.norm(diff_a) + 0.5 * 1e-4
    np.testing.assert_allclose(clipped, expected, rtol=1e-10)


@pytest.mark.parametrize("rule", CONVEX_RULES, ids=lambda r: r.kind)
def test_inputs_are_not_modified_and_result_is_a_new_array(rule: MixingRule) -> None:
    rng = np.random.default_rng(7)
    own = rng.standard_normal(100).astype(np.float32)
    received = {"a": rng.standard_normal(100).astype(np.float32), "b": rng.standard_normal(100).astype(np.float32)}
    own_before, received_before = own.copy(), {p: v.copy() for p, v in received.items()}

    result = mix(own, received, 0.4, {"a": 0.3, "b": 0.3}, rule)
    alone = mix(own, {}, 0.4, {"a": 0.3, "b": 0.3}, rule)

    np.testing.assert_array_equal(own, own_before)
    for peer, vector in received.items():
        np.testing.assert_array_equal(vector, received_before[peer])
    assert not np.shares_memory(result, own) and not np.shares_memory(alone, own)
    np.testing.assert_array_equal(alone, own)


@pytest.mark.parametrize("rule", CONVEX_RULES, ids=lambda r: r.kind)
def test_result_does_not_depend_on_arrival_order(rule: MixingRule) -> None:
    rng = np.random.default_rng(8)
    own = rng.standard_normal(500).astype(np.float32)
    vectors = {f"p{j}": rng.standard_normal(500).astype(np.float32) for j in range(5)}
    weights = {peer: 0.15 for peer in vectors}

    forward = mix(own, dict(sorted(vectors.items())), 0.25, weights, rule)
    backward = mix(own, dict(sorted(vectors.items(), reverse=True)), 0.25, weights, rule)

    np.testing.assert_array_equal(forward, backward)


def test_float16_vectors_keep_their_dtype_and_are_accumulated_precisely() -> None:
    own = np.full(10, 1.0, np.float16)
    received = {f"p{j}": np.full(10, 1.0 + 2**-10, np.float16) for j in range(8)}

    result = mix(own, received, 0.2, {peer: 0.1 for peer in received})

    assert result.dtype == np.float16
    np.testing.assert_allclose(result.astype(np.float64), 1.0 + 0.8 * 2**-10, rtol=2**-11)


@pytest.mark.parametrize(
    ("self_weight", "weights", "message"),
    [
        (0.6, {"a": -0.1, "b": 0.5}, r"weight of neighbour 'a' is -0\.1"),
        (float("nan"), {"a": 0.5}, r"weight of self is nan"),
        (0.5, {"a": 0.4}, r"weights sum to 0\.9.*not 1"),
        (0.5, {"a": 0.6}, r"weights sum to 1\.1.*not 1"),
    ],
)
def test_invalid_weights_are_rejected(self_weight: float, weights: dict[str, float], message: str) -> None:
    own = np.zeros(3)
    with pytest.raises(ValueError, match=message):
        mix(own, {}, self_weight, weights)


def test_vector_from_unknown_sender_is_rejected() -> None:
    own = np.zeros(3)
    with pytest.raises(ValueError, match=r"not neighbours this round: \['mallory'\]"):
        mix(own, {"a": np.zeros(3), "mallory": np.zeros(3)}, 0.5, {"a": 0.5})


@pytest.mark.parametrize(
    ("vector", "message"),
    [
        (np.zeros(4), r"vector from 'a' has shape \(4,\), expected \(3,\)"),
        (np.zeros(3, np.float32), r"vector from 'a' has dtype float32, expected float64"),
        ([0.0, 0.0, 0.0], r"vector from 'a' is a list, not a numpy array"),
    ],
)
def test_mismatched_vectors_are_rejected(vector, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mix(np.zeros(3), {"a": vector}, 0.5, {"a": 0.5})


@pytest.mark.parametrize("own", [np.zeros((2, 2)), np.zeros(3, np.int64)], ids=["2-d", "integer"])
def test_own_vector_must_be_flat_floating(own: np.ndarray) -> None:
    with pytest.raises(ValueError, match="own vector must be a 1-D floating numpy array"):
        mix(own, {}, 1.0, {})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "mean"}, "unknown mixing kind 'mean'"),
        ({"kind": "clipped"}, "needs a clipping radius tau"),
        ({"kind": "clipped", "tau": 0.0}, "tau must be > 0"),
        ({"kind": "clipped", "tau": float("nan")}, "tau must be > 0"),
        ({"kind": "trimmed_mean", "trim": 0.5}, r"trim fraction must be in \[0, 0\.5\)"),
        ({"kind": "trimmed_mean", "trim": -0.1}, r"trim fraction must be in \[0, 0\.5\)"),
    ],
)
def test_invalid_mixing_rules_are_rejected(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MixingRule(**kwargs)


def test_arrived_as_single_string_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="not a single string"):
        effective_weights(0.5, {"ab": 0.5}, "ab")


def test_float32_ring_rounds_keep_the_average_to_float32_rounding() -> None:
    """Weights multiply in float64: were 1/3 rounded to float32 first, every ring round would scale the
    vectors by 3 * float32(1/3) = 1 + 3e-8 and 40 rounds would move the average by ~1e-6."""
    rng = np.random.default_rng(3)
    n, rounds = 6, 40
    xs = [rng.standard_normal(1000).astype(np.float32) for _ in range(n)]
    start = np.mean(np.stack(xs).astype(np.float64), axis=0)
    third = 1.0 / 3.0
    for _ in range(rounds):
        xs = [mix(xs[i], {"l": xs[(i - 1) % n], "r": xs[(i + 1) % n]}, third, {"l": third, "r": third}, MixingRule())
              for i in range(n)]
    end = np.mean(np.stack(xs).astype(np.float64), axis=0)
    assert np.linalg.norm(end - start) / np.linalg.norm(start) < 3e-7


def test_float32_halves_round_once_and_keep_pairwise_averages() -> None:
    """Weights a float32 holds exactly (1/2 on pairwise schedules) mix in float32: each result is the
    exact 0.5 a + 0.5 b rounded once (within half an ulp), and the pair's sum moves only by that."""
    rng = np.random.default_rng(4)
    a = rng.standard_normal(200_000).astype(np.float32) * np.float32(1e3)
    b = rng.standard_normal(200_000).astype(np.float32)
    got = mix(a, {"b": b}, 0.5, {"b": 0.5})
    exact = 0.5 * a.astype(np.float64) + 0.5 * b.astype(np.float64)
    assert got.dtype == np.float32
    assert np.all(np.abs(got - exact) <= 0.5 * np.spacing(np.abs(got)))
    assert np.array_equal(got, mix(b, {"a": a}, 0.5, {"a": 0.5}))  # both ends of the pair agree to the bit
    drift = abs(2 * got.astype(np.float64).sum() - (a.astype(np.float64).sum() + b.sum()))
    assert drift / np.abs(exact).sum() < 1e-7


@pytest.mark.parametrize("weights", [(0.5, 0.5), (1 / 3, 2 / 3), (0.25, 0.75)])
def test_mixing_span_by_span_gives_the_same_bits_as_one_call(weights: tuple[float, float]) -> None:
    rng = np.random.default_rng(5)
    n = 3 * mixing._BLOCK + 123
    own, other = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    whole = mix(own, {"p": other}, weights[0], {"p": weights[1]})
    spans = np.empty_like(own)
    cuts = [0, *sorted(rng.choice(np.arange(1, n), 7, replace=False).tolist()), n]
    for lo, hi in zip(cuts, cuts[1:]):
        mixing.weighted_sum_into(spans[lo:hi], own[lo:hi], weights[0], [weights[1]], [other[lo:hi]])
    assert np.array_equal(whole, spans)


def test_incremental_mix_equals_mix_once_every_value_arrived_in_order() -> None:
    rng = np.random.default_rng(6)
    own = {"a": rng.standard_normal((40, 30)).astype(np.float32), "empty": np.zeros(0, np.float32)}
    other = {name: rng.standard_normal(x.shape).astype(np.float32) for name, x in own.items()}
    running = mixing.IncrementalMix(own, 1 / 3, 2 / 3)
    flat = other["a"].reshape(-1)
    for lo, hi in ((0, 7), (7, 700), (700, 1200)):
        assert running.result() is None  # not complete yet
        running.add("a", lo, flat[lo:hi])
    got = running.result()
    assert got is not None and got["a"].shape == (40, 30) and got["empty"].size == 0
    assert np.array_equal(got["a"].reshape(-1), mix(own["a"].reshape(-1), {"p": flat}, 1 / 3, {"p": 2 / 3}))


@pytest.mark.parametrize("bad", ["gap", "overlap", "unknown", "dtype", "too_long"])
def test_incremental_mix_refuses_values_that_do_not_continue_the_tensor(bad: str) -> None:
    own = {"a": np.zeros(100, np.float32)}
    running = mixing.IncrementalMix(own, 0.5, 0.5)
    running.add("a", 0, np.ones(50, np.float32))
    start, values, name = {
        "gap": (60, np.ones(40, np.float32), "a"),
        "overlap": (40, np.ones(60, np.float32), "a"),
        "unknown": (50, np.ones(50, np.float32), "b"),
        "dtype": (50, np.ones(50, np.float64), "a"),
        "too_long": (50, np.ones(51, np.float32), "a"),
    }[bad]
    running.add(name, start, values)
    running.add("a", 50, np.ones(50, np.float32))  # the right values afterwards do not repair it
    assert running.result() is None
