"""The swarm simulator against the spectral theory of its topologies, under loss and churn."""

import math

import numpy as np
import pytest

from gossip.memory import LinkModel
from gossip.sim import SimConfig, simulate
from topology import TOPOLOGY_NAMES, TopologySpec, build_topology, spectral

pytestmark = pytest.mark.unit


def _spec(name: str, n: int) -> TopologySpec:
    if name == "custom":
        return TopologySpec("custom", edges=tuple((i, (i + 1) % n) for i in range(n)) + ((0, n // 2),))
    return TopologySpec(name)


def _errors(config: SimConfig) -> list[float]:
    return [r.consensus_error for r in simulate(config)]


@pytest.mark.parametrize("name", TOPOLOGY_NAMES)
@pytest.mark.parametrize("n", [8, 12])
def test_consensus_error_never_exceeds_the_spectral_bound(name, n):
    spec = _spec(name, n)
    topo = build_topology(spec, n)
    errors = _errors(SimConfig(peers=n, topology=spec, rounds=30, dim=64, dtype="float64", codec="fp32", seed=n))
    e0 = errors[0]
    tol = 1e-6 * e0  # the fp32 codec rounds what is sent
    for t in range(1, len(errors)):
        # one round contracts by at most that round's rho ...
        assert errors[t] <= spectral.rho(topo.mixing_matrix(t - 1)) * errors[t - 1] + tol
        # ... and the error after t rounds is within rho^t of the start (whole periods for schedules)
        if t % topo.period == 0:
            assert errors[t] <= topo.rho**t * e0 + tol


@pytest.mark.parametrize(
    "name,n", [("ring", 8), ("torus", 64), ("static-exp", 64)]
)
def test_fitted_contraction_matches_rho(name, n):
    topo = build_topology(name, n)
    errors = np.array(_errors(SimConfig(peers=n, topology=TopologySpec(name), rounds=40, dim=256, dtype="float64", seed=1)))
    rounds = np.arange(10, 41)
    slope = np.polyfit(rounds, np.log(errors[10:41]), 1)[0]
    assert math.exp(slope) == pytest.approx(topo.rho, rel=0.05)


def test_complete_graph_averages_in_one_round():
    errors = _errors(SimConfig(peers=10, topology=TopologySpec("complete"), rounds=1, dim=100, dtype="float32"))
    assert errors[1] < 1e-6 * errors[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["static-exp", "one-peer-exp", "random-regular"])
def test_contracts_100x_under_loss_and_churn(name):
    reports = list(simulate(SimConfig(peers=256, topology=TopologySpec(name), rounds=60, dim=32,
                                      drop=0.1, churn=0.1, seed=7)))
    assert reports[-1].consensus_error <= reports[0].consensus_error / 100
    assert sum(r.dropped for r in reports) > 0
    assert all(r.peers == 256 for r in reports)  # as many join as leave


def test_bytes_count_delivered_messages_of_the_codec_size():
    from gossip.codecs import get_codec
    from gossip.wire import message_nbytes

    for codec in ("fp32", "fp16", "int8"):
        size = message_nbytes({"params": ((500,), "float32")}, get_codec(codec))
        reports = list(simulate(SimConfig(peers=16, topology=TopologySpec("one-peer-exp"), rounds=3, dim=500,
                                          codec=codec, dtype="float32")))
        assert all(r.messages == 16 and r.bytes == 16 * size for r in reports[1:])
    assert message_nbytes({"params": ((500,), "float32")}, get_codec("fp16")) < 0.6 * message_nbytes(
        {"params": ((500,), "float32")}, get_codec("fp32")
    )


def test_lossy_codecs_still_reach_consensus_near_their_precision():
    errors = _errors(SimConfig(peers=32, topology=TopologySpec("one-peer-exp"), rounds=15, dim=256, codec="int8"))
    assert errors[-1] < 1e-2 * errors[0]


def test_link_model_sets_the_round_time():
    link = LinkModel(latency_s=0.05, bandwidth_bytes_per_s=1e6)
    reports = list(simulate(SimConfig(peers=8, topology=TopologySpec("static-exp"), rounds=2, dim=1000, link=link)))
    per_message = reports[1].bytes / reports[1].messages
    # static-exp over 8: every peer sends to 3 others through its one uplink
    assert reports[1].sim_time_s == pytest.approx(0.05 + 3 * per_message / 1e6)


def test_same_seed_same_run_and_different_seed_differs():
    cfg = SimConfig(peers=20, topology=TopologySpec("random-regular"), rounds=5, dim=16, drop=0.2, churn=0.1, seed=3)
    assert _errors(cfg) == _errors(cfg)
    assert _errors(cfg) != _errors(SimConfig(**{**cfg.__dict__, "seed": 4}))


@pytest.mark.parametrize(
    "kwargs,needle",
    [({"peers": 0}, "--peers"), ({"drop": 1.0}, "--drop"), ({"codec": "topk"}, "top-k"), ({"codec": "zip"}, "zip")],
)
def test_bad_configs_are_refused(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SimConfig(**{"peers": 4, "topology": TopologySpec("ring"), "rounds": 1, **kwargs})
