"""Topology families, mixing weights and spectral figures against their known properties."""

import math

import numpy as np
import pytest

from topology import TOPOLOGY_NAMES, MembershipView, TopologySpec, build_topology, graphs, peer_round, spectral
from topology.weights import mixing_matrix

pytestmark = pytest.mark.unit

SIZES = (1, 2, 3, 5, 6, 8, 12, 16, 30)
SYMMETRIC_FAMILIES = ("ring", "torus", "complete", "star", "hypercube", "random-regular", "custom")


def _spec(name: str, n: int) -> TopologySpec:
    if name == "custom":
        return TopologySpec("custom", edges=tuple((i, i + 1) for i in range(n - 1)) + ((0, n - 1),) if n > 1 else ((0, 0),))
    return TopologySpec(name)


def _topologies():
    for name in TOPOLOGY_NAMES:
        for n in SIZES:
            if name == "custom" and n == 1:
                continue
            yield name, n


@pytest.mark.parametrize("name,n", list(_topologies()))
def test_every_family_mixes_with_stochastic_weights(name, n):
    topo = build_topology(_spec(name, n), n)
    for t in range(topo.period):
        w = topo.mixing_matrix(t)
        assert w.shape == (n, n)
        assert np.all(w >= 0)
        np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-12)
        # every default scheme of every family is doubly stochastic, so gossip preserves the average
        np.testing.assert_allclose(w.sum(axis=0), 1.0, atol=1e-12)
        if name in SYMMETRIC_FAMILIES:
            np.testing.assert_allclose(w, w.T, atol=1e-15)
    assert topo.is_doubly_stochastic()
    assert 0.0 <= topo.rho <= 1.0 + 1e-12


@pytest.mark.parametrize("scheme", ["uniform", "max-degree", "metropolis-hastings"])
@pytest.mark.parametrize("name", ["ring", "torus", "complete", "star", "random-regular"])
def test_every_scheme_gives_row_stochastic_weights(name, scheme):
    topo = build_topology(TopologySpec(name, weights=scheme), 10)
    w = topo.mixing_matrix(0)
    assert spectral.is_row_stochastic(w)
    # max-degree and Metropolis-Hastings are doubly stochastic on any undirected graph
    if scheme != "uniform":
        assert spectral.is_doubly_stochastic(w)


def test_doubly_stochastic_check_rejects_uniform_weights_on_a_star():
    topo = build_topology(TopologySpec("star", weights="uniform"), 6)
    assert spectral.is_row_stochastic(topo.mixing_matrix(0))
    assert not topo.is_doubly_stochastic()


@pytest.mark.parametrize("n", [2, 4, 6, 8, 10, 64, 100, 1024])
def test_static_exponential_rho_matches_closed_form(n):
    expected = 1 - 2 / (1 + math.ceil(math.log2(n)))
    assert build_topology("static-exp", n).rho == pytest.approx(expected, abs=1e-9)


def test_static_exponential_reference_values():
    assert build_topology("static-exp", 8).rho == pytest.approx(0.5, abs=1e-9)
    assert build_topology("static-exp", 1024).rho == pytest.approx(0.818182, abs=1e-6)
    assert build_topology("static-exp", 1024).degree == 10


@pytest.mark.parametrize("name", ["one-peer-exp", "hypercube"])
@pytest.mark.parametrize("k", range(1, 11))
def test_pairwise_schedules_average_exactly_after_log2_n_rounds(name, k):
    n = 2**k
    topo = build_topology(name, n)
    assert topo.period == k
    x = np.random.default_rng(k).normal(size=(n, 3))
    spread = np.ptp(x, axis=0).max()
    mean = x.mean(axis=0)
    for t in range(k):
        g = topo.graph(t)
        assert all(g.in_degree(i) == 1 for i in range(n))
        x = topo.mixing_matrix(t) @ x
    assert np.abs(x - mean).max() < 1e-6 * spread


@pytest.mark.parametrize("name", ["one-peer-exp", "hypercube"])
def test_exact_schedules_report_rho_zero(name):
    assert build_topology(name, 64).rho == 0.0


def test_time_varying_rho_is_per_round_rate_of_the_period_product():
    topo = build_topology("one-peer-exp", 6)  # not a power of two: no exact averaging
    product_rho = spectral.rho(topo.period_matrix())
    assert 0 < product_rho < 1
    assert topo.rho == pytest.approx(product_rho ** (1 / topo.period))


def test_ring_and_torus_rho_match_their_eigenvalues():
    # ring with Metropolis-Hastings: W = I/3 + shifts/3, eigenvalues 1/3 + 2/3 cos(2 pi j / n)
    assert build_topology("ring", 8).rho == pytest.approx(1 / 3 + 2 / 3 * math.cos(2 * math.pi / 8))
    # torus 8x8: W = I/5 + neighbours/5, second eigenvalue 1/5 + (2 cos(2pi/8) + 2)/5
    assert build_topology("torus", 64).rho == pytest.approx(1 / 5 + (2 * math.cos(2 * math.pi / 8) + 2) / 5)
    assert build_topology("complete", 9).rho == pytest.approx(0.0, abs=1e-12)


def test_random_regular_is_regular_connected_and_reproducible():
    a = build_topology(TopologySpec("random-regular", degree=5, seed=3), 40)
    b = build_topology(TopologySpec("random-regular", degree=5, seed=3), 40)
    c = build_topology(TopologySpec("random-regular", degree=5, seed=4), 40)
    ga, gb, gc = a.graph(0), b.graph(0), c.graph(0)
    assert ga == gb and ga != gc
    assert all(ga.in_degree(i) == 5 for i in range(40)) and ga.is_symmetric()
    assert a.rho < 1  # connected: a repeated eigenvalue 1 would make rho 1


def test_random_regular_degree_is_adjusted_for_small_or_odd_swarms():
    assert build_topology(TopologySpec("random-regular", degree=4), 3).degree == 2
    assert build_topology(TopologySpec("random-regular", degree=3), 7).degree == 2
    with pytest.raises(ValueError, match="degree must be >= 2"):
        build_topology(TopologySpec("random-regular", degree=1), 8)


def test_torus_shape_and_bad_rows():
    assert graphs.torus_shape(64) == (8, 8)
    assert graphs.torus_shape(12) == (3, 4)
    with pytest.raises(ValueError, match="does not divide"):
        build_topology(TopologySpec("torus", rows=5), 12)


def test_custom_edges_are_validated():
    topo = build_topology(TopologySpec("custom", edges=((0, 1), (1, 2), (2, 3))), 4)
    assert topo.graph(0).in_neighbours == ((1,), (0, 2), (1, 3), (2,))
    with pytest.raises(ValueError, match="does not connect"):
        build_topology(TopologySpec("custom", edges=((0, 1), (2, 3))), 4)
    with pytest.raises(ValueError, match="ranks must be distinct"):
        build_topology(TopologySpec("custom", edges=((0, 4),)), 4)


def test_bad_names_and_schemes_are_refused():
    with pytest.raises(ValueError, match="unknown topology 'mesh'"):
        TopologySpec("mesh")
    with pytest.raises(ValueError, match="unknown weight scheme"):
        build_topology(TopologySpec("ring", weights="magic"), 4)
    with pytest.raises(ValueError, match="need an undirected graph"):
        build_topology(TopologySpec("static-exp", weights="metropolis-hastings"), 8)
    with pytest.raises(ValueError, match="at least 1 peer"):
        build_topology("ring", 0)


def test_equal_views_compute_equal_rounds():
    ids = [f"Qm{c}" for c in "zyxwvuts"]
    view_a = MembershipView.of(ids)
    view_b = MembershipView.of(reversed(ids + ids[:2]))
    assert view_a == view_b and view_a.n == 8
    topo = build_topology("one-peer-exp", 8)
    for t in range(5):
        for pid in ids:
            assert peer_round(topo, view_a, pid, t) == peer_round(topo, view_b, pid, t)


def test_peer_round_in_and_out_neighbours_agree():
    view = MembershipView.of(f"peer{i:02d}" for i in range(6))
    topo = build_topology("static-exp", 6)
    rounds = {pid: peer_round(topo, view, pid, 0) for pid in view.peer_ids}
    for pid, r in rounds.items():
        for out in r.out_peers:
            assert pid in rounds[out].in_weights
        assert r.self_weight + sum(r.in_weights.values()) == pytest.approx(1.0)
    with pytest.raises(KeyError, match="not in the membership view"):
        view.rank_of("stranger")
    with pytest.raises(ValueError, match="view of 6 peers"):
        peer_round(build_topology("ring", 5), view, "peer00", 0)


def test_mixing_matrix_of_a_graph_matches_rows():
    g = graphs.star(5)
    w = mixing_matrix(g, "metropolis-hastings")
    assert w[0, 0] == pytest.approx(1 - 4 / 5) and w[1, 0] == pytest.approx(1 / 5) and w[1, 1] == pytest.approx(4 / 5)
