"""The exchange protocol over the in-memory transport: consensus, symmetric pairs, faults and bad peers."""

import asyncio

import numpy as np
import pytest

from gossip.codecs import get_codec
from gossip.exchange import ExchangeSettings, GossipPeer
from gossip.memory import InMemoryNetwork
from gossip.transport import GOSSIP_PROTOCOL
from gossip.wire import encode_message
from topology import MembershipView, build_topology, peer_round

pytestmark = pytest.mark.unit

SWARM, HASH = "test", "c0ffee"
DIM = 257


def settings(**kw) -> ExchangeSettings:
    return ExchangeSettings(**{"swarm": SWARM, "config_hash": HASH, "codec": get_codec("fp32"),
                               "exchange_timeout_s": 1.0, **kw})


def make_swarm(net: InMemoryNetwork, n: int, seed: int = 0, **kw) -> dict[str, GossipPeer]:
    rng = np.random.default_rng(seed)
    return {
        pid: GossipPeer(net.transport(pid), settings(**kw), {"w": rng.standard_normal(DIM).astype(np.float32)})
        for pid in (f"peer{i:02d}" for i in range(n))
    }


async def run_rounds(peers: dict[str, GossipPeer], topology: str, rounds: range, view_ids=None):
    view = MembershipView.of(view_ids or peers)
    topo = build_topology(topology, view.n)
    outcomes = []
    for r in rounds:
        async with asyncio.TaskGroup() as group:
            tasks = {pid: group.create_task(p.run_round(r, peer_round(topo, view, pid, r))) for pid, p in peers.items()}
        outcomes.append({pid: t.result() for pid, t in tasks.items()})
    return outcomes


def stack(peers) -> np.ndarray:
    return np.stack([p.tensors["w"] for p in peers.values()]).astype(np.float64)


@pytest.mark.parametrize("topology,n,rounds", [("one-peer-exp", 8, 3), ("hypercube", 8, 3), ("complete", 5, 1)])
def test_exact_schedules_reach_the_average(topology, n, rounds):
    async def main():
        net = InMemoryNetwork()
        peers = make_swarm(net, n)
        for p in peers.values():
            await p.start()
        start = stack(peers)
        await run_rounds(peers, topology, range(rounds))
        end = stack(peers)
        spread = np.ptp(start, axis=0).max()
        assert np.abs(end - start.mean(axis=0)).max() < 1e-6 * spread
        assert all(p.stats.errors == {} for p in peers.values())

    asyncio.run(main())


@pytest.mark.parametrize("topology", ["ring", "static-exp"])
def test_non_power_of_two_swarms_converge_and_keep_the_average(topology):
    async def main():
        net = InMemoryNetwork()
        peers = make_swarm(net, 6, seed=1)
        for p in peers.values():
            await p.start()
        start = stack(peers)
        await run_rounds(peers, topology, range(80))
        end = stack(peers)
        assert np.ptp(end, axis=0).max() < 1e-4 * np.ptp(start, axis=0).max()
        np.testing.assert_allclose(end.mean(axis=0), start.mean(axis=0), rtol=0, atol=1e-5)

    asyncio.run(main())


def test_symmetric_pairs_share_one_stream_and_directed_pulls_carry_no_tensors():
    async def main():
        net = InMemoryNetwork()
        peers = make_swarm(net, 2)
        for p in peers.values():
            await p.start()
        await run_rounds(peers, "hypercube", range(1))
        a, b = peers.values()
        # one stream: the smaller id sent its tensors once and got the other's once
        frame = DIM * 4
        assert frame < a.stats.bytes_sent < 2 * frame and frame < a.stats.bytes_received < 2 * frame
        np.testing.assert_array_equal(a.tensors["w"], b.tensors["w"])

        net2 = InMemoryNetwork()
        peers = make_swarm(net2, 4)
        for p in peers.values():
            await p.start()
        await run_rounds(peers, "one-peer-exp", range(1))
        for p in peers.values():  # each pulled once (tiny request) and replied once (tensors)
            assert frame < p.stats.bytes_sent < 1.5 * frame
            assert frame < p.stats.bytes_received < 1.5 * frame

    asyncio.run(main())


def test_dead_and_frozen_neighbours_are_skipped_within_the_deadline():
    async def main():
        net = InMemoryNetwork()
        peers = make_swarm(net, 6)
        for p in peers.values():
            await p.start()
        ids = sorted(peers)
        await net.kill(ids[1])
        net.freeze(ids[2])
        alive = {pid: p for pid, p in peers.items() if pid not in ids[1:3]}
        before = {pid: p.tensors["w"].copy() for pid, p in alive.items()}
        started = asyncio.get_running_loop().time()
        outcomes = await run_rounds(alive, "complete", range(1), view_ids=ids)
        assert asyncio.get_running_loop().time() - started < 3.0  # one deadline (1 s) plus slack
        for pid, outcome in outcomes[0].items():
            # on a symmetric edge the smaller id dials: it finds the dead peer unreachable, while a
            # larger id waits for a dial that never comes until its deadline
            assert outcome.skipped[ids[1]] == ("unreachable" if pid < ids[1] else "timeout")
            assert outcome.skipped[ids[2]] == "timeout"
            assert set(outcome.mixed_with) == set(alive) - {pid}
        # the live peers averaged among themselves: weights of the missing went to self
        mean_before = np.mean(list(before.values()), axis=0)
        for p in alive.values():
            assert not np.allclose(p.tensors["w"], before[p.peer_id])
        np.testing.assert_allclose(np.mean([p.tensors["w"] for p in alive.values()], axis=0), mean_before, atol=1e-5)
        net.thaw(ids[2])

    asyncio.run(main())


async def _raw_request(net, victim: str, frames) -> bytes:
    attacker = net.transport("zz-attacker")
    stream = await attacker.open_stream(victim, GOSSIP_PROTOCOL)
    for f in frames:
        await stream.write(f)
    await stream.close()
    return b""


@pytest.mark.parametrize(
    "case,kind",
    [
        ("garbage", "too_large"),
        ("wrong_hash", "wrong_swarm"),
        ("wrong_manifest", "manifest_mismatch"),
        ("nan", "non_finite"),
        ("half", "truncated"),
        ("not_a_request", "bad_schema"),
    ],
)
def test_bad_requests_are_counted_and_leave_honest_tensors_alone(case, kind):
    async def main():
        net = InMemoryNetwork()
        peers = make_swarm(net, 2)
        for p in peers.values():
            await p.start()
        victim_id, other_id = sorted(peers)
        victim = peers[victim_id]
        before = victim.tensors["w"].copy()
        good = {"w": np.ones(DIM, np.float32)}
        common = dict(swarm=SWARM, config_hash=HASH, sender="zz-attacker", round=0, step=0)
        fp32 = get_codec("fp32")
        if case == "garbage":
            frames = [b"\xff" * 64]
        elif case == "wrong_hash":
            frames = encode_message(good, fp32, **{**common, "config_hash": "other"}, kind="exchange")
        elif case == "wrong_manifest":
            frames = encode_message({"w": np.ones(DIM + 1, np.float32)}, fp32, **common, kind="exchange")
        elif case == "nan":
            frames = encode_message(good, fp32, **common, kind="exchange")
            body = bytearray(b"".join(bytes(f) for f in frames))
            body[-4:] = np.array([np.nan], np.float32).tobytes()
            frames = [bytes(body)]
        elif case == "half":
            whole = b"".join(bytes(f) for f in encode_message(good, fp32, **common, kind="exchange"))
            frames = [whole[: len(whole) // 2]]
        else:
            frames = encode_message(good, fp32, **common, kind="reply")
        await _raw_request(net, victim_id, frames)
        for _ in range(50):
            if victim.stats.errors:
                break
            await asyncio.sleep(0.02)
        assert victim.stats.errors == {kind: 1}
        np.testing.assert_array_equal(victim.tensors["w"], before)
        # and it still gossips with honest peers afterwards
        await run_rounds(peers, "complete", range(1))
        np.testing.assert_array_equal(victim.tensors["w"], peers[other_id].tensors["w"])

    asyncio.run(main())


def _pair(a_kw, b_kw, a_dim=DIM, b_dim=DIM):
    net = InMemoryNetwork()
    a = GossipPeer(net.transport("a"), settings(**a_kw), {"w": np.zeros(a_dim, np.float32)})
    b = GossipPeer(net.transport("b"), settings(**b_kw), {"w": np.ones(b_dim, np.float32)})
    plan = peer_round(build_topology("static-exp", 2), MembershipView.of(["a", "b"]), "a", 0)
    return a, b, plan


def test_a_peer_with_another_model_is_rejected_and_told_why():
    async def main():
        a, b, plan = _pair({}, {}, b_dim=DIM + 1)
        await a.start()
        await b.start()
        outcome = await a.run_round(0, plan)
        assert outcome.skipped == {"b": "rejected: manifest_mismatch"}
        assert b.stats.errors == {"manifest_mismatch": 1}
        np.testing.assert_array_equal(a.tensors["w"], 0)

    asyncio.run(main())


def test_peers_of_different_swarm_configs_refuse_each_other():
    async def main():
        a, b, plan = _pair({}, {"config_hash": "different"})
        await a.start()
        await b.start()
        outcome = await a.run_round(0, plan)
        # b refuses a's request, and a refuses b's answer (it is signed with b's config hash)
        assert outcome.skipped == {"b": "wrong_swarm"}
        assert a.stats.errors == {"wrong_swarm": 1} and b.stats.errors == {"wrong_swarm": 1}
        np.testing.assert_array_equal(a.tensors["w"], 0)
        np.testing.assert_array_equal(b.tensors["w"], 1)

    asyncio.run(main())


def test_neighbours_beyond_the_staleness_bound_are_skipped():
    async def main():
        net = InMemoryNetwork()
        peers = make_swarm(net, 2, max_staleness=2)
        for p in peers.values():
            await p.start()
        a, b = (peers[k] for k in sorted(peers))
        b.round = 10  # b is far ahead; a pulls from it on a directed graph
        view = MembershipView.of(peers)
        plan = peer_round(build_topology("static-exp", 2), view, a.peer_id, 0)
        before = a.tensors["w"].copy()
        outcome = await a.run_round(0, plan)
        assert outcome.skipped == {b.peer_id: "stale"}
        np.testing.assert_array_equal(a.tensors["w"], before)

    asyncio.run(main())
