"""Real `murmur` node processes on loopback reach consensus by gossip alone and keep the swarm's
average: one-peer exponential with 4 nodes and static exponential with 6 (not a power of two), on p2pd.
The graphs differ only in whom a node asks, which the backend does not see: py-libp2p's exact average
is test_swarm_libp2p's (an all-libp2p swarm under garbage, and both backends in one swarm), and rings
gossip in test_swarm_choco, test_swarm_spes and test_swarm_libp2p's frozen-node test."""

import pytest

from support.swarm_harness import Swarm, check_consensus, summary

pytestmark = pytest.mark.multiprocess

DIM = 256


@pytest.fixture
def swarm(tmp_path, transport):
    # the default 2 s heartbeat: on a busy machine a 1 s one lets records lapse now and then, and a
    # node that misses a peer for a round mixes over another graph than the rest
    with Swarm(tmp_path, dim=DIM, heartbeat=2, transport=transport) as s:
        yield s


@pytest.mark.parametrize(
    "transport,topology,n,rounds,round_interval",
    [
        # n = 4 is a power of two: one period (2 rounds) averages exactly; two show it stays there
        ("p2pd", "one-peer-exp", 4, 4, 0.4),
        # rho is 1/2 for static-exp with n = 6: 1e-6 takes ~20 rounds
        ("p2pd", "static-exp", 6, 25, 0.3),
    ],
)
def test_gossip_alone_reaches_the_average(swarm, topology, n, rounds, round_interval):
    # a quorum of all n: every node gossips from the same round on, over the same graph; a node
    # that a busy machine holds back a few rounds catches up on them instead of skipping them
    nodes = swarm.start(n, topology=topology, min_peers=n, round_interval=round_interval, max_staleness=4)
    swarm.wait_views(nodes, nodes)
    swarm.wait_rounds(nodes, rounds, timeout_s=60 + 2 * rounds * round_interval)
    report = summary(nodes, swarm.statuses(nodes))
    assert swarm.stop_all(nodes) == [0] * n, swarm.logs()

    # every pair averages the inputs of one round (a request early for its round waits for it), so
    # mixing is doubly stochastic and the average only moves by float32 rounding
    check_consensus(nodes, report, swarm.logs())
