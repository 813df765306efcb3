"""The exchange protocol over the in-memory transport: consensus, symmetric pairs, faults and bad peers."""

import asyncio
import itertools

import numpy as np
import pytest

from gossip.codecs import get_codec
from gossip.errors import ManifestMismatch, Truncated
from gossip.exchange import CODEC, CURRENT, FROM, PULL, UNTIL, Delivered, ExchangeSettings, GossipPeer
from gossip.memory import InMemoryNetwork, LinkModel
from gossip.stream import MessageStream
from gossip.transport import GOSSIP_PROTOCOL
from gossip.wire import encode_message
from topology import MembershipView, PeerRound, build_topology, peer_round

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


async def _raw_request(net, victim: str, frames, *, sender: str = "zz-attacker", read_answer: bool = False) -> bytes:
    """Write `frames` on a gossip stream from `sender`; with `read_answer`, read the answer's header
    frame before closing."""
    stream = await net.transport(sender).open_stream(victim, GOSSIP_PROTOCOL)
    answer = b""
    for f in frames:
        if read_answer:
            try:
                await stream.write(f)
            except ConnectionError:
                break  # the victim hung up before reading it all: the point of some tests
        else:
            await stream.write(f)
    if read_answer:
        async with asyncio.timeout(5):
            length = int.from_bytes(await stream.read_exactly(8), "big")
            answer = await stream.read_exactly(length)
    await stream.close()
    return answer


def _bad_frames(case: str, sender: str) -> list:
    good = {"w": np.ones(DIM, np.float32)}
    common = dict(swarm=SWARM, config_hash=HASH, sender=sender, round=0, step=0)
    fp32 = get_codec("fp32")
    if case == "garbage":
        return [b"\xff" * 64]
    if case == "wrong_hash":
        return encode_message(good, fp32, **{**common, "config_hash": "other"}, kind="exchange")
    if case == "wrong_manifest":
        return encode_message({"w": np.ones(DIM + 1, np.float32)}, fp32, **common, kind="exchange")
    if case == "nan":
        body = bytearray(b"".join(bytes(f) for f in encode_message(good, fp32, **common, kind="exchange")))
        body[-4:] = np.array([np.nan], np.float32).tobytes()
        return [bytes(body)]
    if case == "half":
        whole = b"".join(bytes(f) for f in encode_message(good, fp32, **common, kind="exchange"))
        return [whole[: len(whole) // 2]]
    return encode_message(good, fp32, **common, kind="reply")


@pytest.mark.parametrize(
    "case,kind",
    [
        ("garbage", "too_large"),
        ("wrong_hash", "wrong_swarm"),
        ("wrong_manifest", "manifest_mismatch"),
        ("not_a_request", "bad_schema"),
    ],
)
def test_bad_request_headers_are_counted_and_leave_honest_tensors_alone(case, kind):
    async def main():
        net = InMemoryNetwork()
        peers = make_swarm(net, 2)
        for p in peers.values():
            await p.start()
        victim_id, other_id = sorted(peers)
        victim = peers[victim_id]
        before = victim.tensors["w"].copy()
        await _raw_request(net, victim_id, _bad_frames(case, "zz-attacker"))
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


@pytest.mark.parametrize("case,kind", [("nan", "non_finite"), ("half", "truncated")])
def test_a_partner_whose_tensors_are_bad_is_counted_and_skipped(case, kind):
    """The payload of an exchange is read only once the round has claimed it for that partner; a bad
    one is then refused by kind, and the round skips the partner."""
    async def main():
        net = InMemoryNetwork()
        victim = GossipPeer(net.transport("victim"), settings(), {"w": np.zeros(DIM, np.float32)})
        await victim.start()
        # "attacker" < "victim": the victim waits for the attacker's exchange request of round 0
        plan = PeerRound(0.5, {"attacker": 0.5}, ("attacker",))
        round_task = asyncio.create_task(victim.run_round(0, plan))
        await asyncio.sleep(0.05)
        await _raw_request(net, "victim", _bad_frames(case, "attacker"), sender="attacker")
        outcome = await round_task
        assert victim.stats.errors == {kind: 1}
        assert outcome.skipped == {"attacker": kind}
        np.testing.assert_array_equal(victim.tensors["w"], 0)

    asyncio.run(main())


@pytest.mark.parametrize("case", ["nan", "half"])
def test_an_exchange_no_round_waits_for_is_refused_before_its_payload_is_read(case):
    """A non-partner's exchange is refused on its header alone: not a byte of its tensors is read, so
    what they hold (NaN here, or a cut) is never seen and never counted as an error."""
    async def main():
        net = InMemoryNetwork()
        victim = GossipPeer(net.transport("victim"), settings(), {"w": np.zeros(DIM, np.float32)})
        await victim.start()
        await victim.run_round(0, PeerRound(1.0, {}, ()))  # round 0 has begun, and waits for no one
        frames = _bad_frames(case, "zz-attacker")
        header_bytes = 8 + int.from_bytes(bytes(frames[0])[:8], "big")
        answer = await _raw_request(net, "victim", frames, read_answer=True)
        assert victim.stats.errors == {}
        assert victim.stats.refused == {"not_partner": 1}
        assert victim.stats.bytes_received == header_bytes
        assert b"not_partner" in answer  # the reject says why

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
        b.round = 10  # b is far ahead; with two peers the edge is symmetric, so a sends an exchange
        view = MembershipView.of(peers)
        plan = peer_round(build_topology("static-exp", 2), view, a.peer_id, 0)
        before = a.tensors["w"].copy()
        outcome = await a.run_round(0, plan)
        assert outcome.skipped == {b.peer_id: "stale"}
        np.testing.assert_array_equal(a.tensors["w"], before)

    asyncio.run(main())


# ---- symmetric exchanges whose peers are not in step ---------------------------------------------


def _two(net: InMemoryNetwork, a_value: float, b_value: float, a_timeout_s: float = 5.0,
         b_timeout_s: float = 5.0) -> tuple[GossipPeer, GossipPeer, dict]:
    a = GossipPeer(net.transport("a"), settings(exchange_timeout_s=a_timeout_s), {"w": np.full(DIM, a_value, "f4")})
    b = GossipPeer(net.transport("b"), settings(exchange_timeout_s=b_timeout_s), {"w": np.full(DIM, b_value, "f4")})
    view = MembershipView.of(["a", "b"])
    topo = build_topology("ring", 2)  # one symmetric edge: a (the smaller id) sends the exchange
    return a, b, {pid: (lambda r, pid=pid: peer_round(topo, view, pid, r)) for pid in ("a", "b")}


async def _in_step(a: GossipPeer, b: GossipPeer, plan: dict, round_index: int) -> None:
    """Both run `round_index` at once: a pair in step averages its values (here 0 and 1) exactly."""
    async with asyncio.TaskGroup() as group:
        group.create_task(a.run_round(round_index, plan["a"](round_index)))
        group.create_task(b.run_round(round_index, plan["b"](round_index)))
    np.testing.assert_array_equal(a.tensors["w"], 0.5)
    np.testing.assert_array_equal(b.tensors["w"], 0.5)


async def _until(condition, timeout_s: float = 2.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


def test_an_exchange_that_arrives_before_the_partner_begins_the_round_gets_its_input_to_that_round():
    # A trainer-driven pair a step apart: b takes its training step (new values) only after a's
    # request of the round has reached it. The pair must average a's and b's inputs to that round.
    async def main():
        net = InMemoryNetwork()
        a, b, plan = _two(net, 0.0, 1.0)
        await a.start()
        await b.start()
        asking = asyncio.create_task(a.run_round(0, plan["a"](0)))
        # a's request is in: its header (b reads its tensors only once its round claims the exchange)
        await _until(lambda: b.stats.bytes_received > 0)
        await asyncio.sleep(0.05)
        b.set_tensors({"w": np.full(DIM, 3.0, np.float32)}, step=1)  # b's step, then its round
        outcome_b = await b.run_round(0, plan["b"](0))
        outcome_a = await asking
        assert outcome_a.mixed_with == ("b",) and outcome_b.mixed_with == ("a",)
        # both mixed 0 and 3, so the pair's sum (the swarm's average) is what went into the round
        np.testing.assert_array_equal(a.tensors["w"], 1.5)
        np.testing.assert_array_equal(b.tensors["w"], 1.5)

    asyncio.run(main())


def test_free_running_peers_a_step_apart_keep_the_average_on_a_ring():
    # Each peer runs its own loop of (training step, round), as GossipTrainer does, at its own pace
    # and over links of different latency, so requests often reach a partner still in the previous
    # round. The average must move by exactly the steps' mean, and no exchange may be lost.
    n, rounds = 6, 20

    async def main():
        net = InMemoryNetwork()
        peers = make_swarm(net, n, seed=3, exchange_timeout_s=5.0)
        ids = sorted(peers)
        for i, j in itertools.combinations(range(n), 2):  # one-way latencies of 2 to 10 ms
            net.set_link(ids[i], ids[j], LinkModel(latency_s=0.002 * (1 + (3 * i + j) % 5)))
        for p in peers.values():
            await p.start()
        view = MembershipView.of(peers)
        topo = build_topology("ring", n)
        rng = np.random.default_rng(4)
        pauses = rng.uniform(0, 0.03, size=(n, rounds))
        steps = rng.standard_normal((n, rounds)).astype(np.float32)
        expected = stack(peers).mean(axis=0) + steps.astype(np.float64).sum(axis=1).mean()
        skipped = []

        async def loop(i: int, peer: GossipPeer) -> None:
            for r in range(rounds):
                await asyncio.sleep(pauses[i, r])
                peer.set_tensors({"w": peer.tensors["w"] + steps[i, r]}, step=r + 1)
                outcome = await peer.run_round(r, peer_round(topo, view, peer.peer_id, r))
                skipped.extend(outcome.skipped.values())

        async with asyncio.TaskGroup() as group:
            for i, p in enumerate(peers.values()):
                group.create_task(loop(i, p))
        drift = np.linalg.norm(stack(peers).mean(axis=0) - expected)
        assert drift < 1e-6 * np.linalg.norm(expected), f"average moved by {drift:.3g}; skipped {skipped}"
        assert skipped == []

    asyncio.run(main())


def test_an_exchange_for_a_round_the_partner_already_gave_up_on_is_refused_and_neither_mixes():
    async def main():
        net = InMemoryNetwork()
        a, b, plan = _two(net, 0.0, 1.0, b_timeout_s=1.0)
        await a.start()
        await b.start()
        outcome_b = await b.run_round(0, plan["b"](0))  # a never comes: b's wait ends at its deadline
        assert outcome_b.skipped == {"a": "timeout"}
        outcome_a = await a.run_round(0, plan["a"](0))  # a's late request: b's round 0 is over
        assert outcome_a.skipped == {"b": "rejected: late"}
        assert b.stats.refused == {"late": 1}
        np.testing.assert_array_equal(a.tensors["w"], 0.0)
        np.testing.assert_array_equal(b.tensors["w"], 1.0)
        await _in_step(a, b, plan, 1)  # and the next round, in step again, averages

    asyncio.run(main())


def test_a_partner_that_moved_on_ends_the_wait_for_its_request_at_once():
    async def main():
        net = InMemoryNetwork()
        a, b, plan = _two(net, 0.0, 1.0, a_timeout_s=1.0, b_timeout_s=30.0)
        await a.start()
        await b.start()
        # b is busy elsewhere for longer than a's deadline: a gives up on round 0 ...
        assert (await a.run_round(0, plan["a"](0))).skipped == {"b": "timeout"}
        first = b.stats.bytes_received  # the header of a's request of round 0
        # ... and asks for round 1, which tells b that a is done with round 0
        asking = asyncio.create_task(a.run_round(1, plan["a"](1)))
        await _until(lambda: b.stats.bytes_received > first)  # that request's header is in
        started = asyncio.get_running_loop().time()
        outcome_b0 = await b.run_round(0, plan["b"](0))
        assert outcome_b0.skipped == {"a": "moved_on"}
        assert asyncio.get_running_loop().time() - started < 10.0  # not its 30 s deadline
        outcome_b1 = await b.run_round(1, plan["b"](1))
        outcome_a1 = await asking
        assert outcome_a1.mixed_with == ("b",) and outcome_b1.mixed_with == ("a",)
        np.testing.assert_array_equal(a.tensors["w"], 0.5)
        np.testing.assert_array_equal(b.tensors["w"], 0.5)

    asyncio.run(main())


def test_a_request_from_a_partner_far_ahead_ends_the_wait_for_its_earlier_rounds_at_once():
    # Two halves of a swarm more than the staleness bound apart: the one behind must not wait out its
    # deadline, round after round, for requests the one ahead will never send (it is past those
    # rounds), or the halves stay apart for good at a deadline per round.
    async def main():
        net = InMemoryNetwork()
        a, b, plan = _two(net, 0.0, 1.0, a_timeout_s=5.0, b_timeout_s=30.0)
        await a.start()
        await b.start()
        ahead = settings().max_staleness + 6
        outcome_a = await a.run_round(ahead, plan["a"](ahead))  # b is at round 0: too old to mix
        assert outcome_a.skipped == {"b": "stale"} and b.stats.refused == {"stale": 1}
        started = asyncio.get_running_loop().time()
        outcome_b = await b.run_round(0, plan["b"](0))
        assert outcome_b.skipped == {"a": "moved_on"}
        assert asyncio.get_running_loop().time() - started < 10.0  # not its 30 s deadline
        np.testing.assert_array_equal(b.tensors["w"], 1.0)
        await _in_step(a, b, plan, ahead + 1)  # once b has caught up, the pair mixes again

    asyncio.run(main())


def test_an_exchange_from_a_peer_the_round_does_not_wait_for_is_refused_and_not_mixed():
    async def main():
        net = InMemoryNetwork()
        a, b, plan = _two(net, 0.0, 1.0)
        await a.start()
        await b.start()
        alone = peer_round(build_topology("ring", 1), MembershipView.of(["b"]), "b", 0)  # b's view lacks a
        async with asyncio.TaskGroup() as group:
            asking = group.create_task(a.run_round(0, plan["a"](0)))
            group.create_task(b.run_round(0, alone))
        assert asking.result().skipped == {"b": "rejected: not_partner"}
        assert b.stats.refused == {"not_partner": 1}
        np.testing.assert_array_equal(a.tensors["w"], 0.0)
        np.testing.assert_array_equal(b.tensors["w"], 1.0)

    asyncio.run(main())


# ---- answers cut short -------------------------------------------------------------------------


def test_a_pull_reply_sent_late_in_the_deadline_is_not_cut_short():
    # b answers a pull only once it begins the round, a third of the way into its 3 s deadline; its
    # reply (8 chunk frames) then takes ~2.6 s, longer than the time left but within a deadline of
    # its own. The asker, with a longer deadline, must get all of it, not a message cut off halfway.
    async def main():
        net = InMemoryNetwork(LinkModel(bandwidth_bytes_per_s=3.2e6))
        big = 1 << 21  # 8 MiB of float32: 8 chunk frames of ~0.33 s each on this link
        a = GossipPeer(net.transport("a"), settings(exchange_timeout_s=20.0), {"w": np.zeros(big, np.float32)})
        b = GossipPeer(net.transport("b"), settings(exchange_timeout_s=3.0), {"w": np.ones(big, np.float32)})
        await a.start()
        await b.start()
        pull_only = PeerRound(0.5, {"b": 0.5}, ())  # a directed edge b -> a
        asking = asyncio.create_task(a.run_round(1, pull_only))
        await asyncio.sleep(1.0)
        await b.run_round(1, PeerRound(1.0, {}, ("a",)))
        outcome = await asking
        assert outcome.skipped == {} and a.stats.errors == {}
        np.testing.assert_array_equal(a.tensors["w"], 0.5)

    asyncio.run(main())


@pytest.mark.parametrize("sent,skip,counted", [("nothing", "unreachable", {}), ("half", "truncated", {"truncated": 1})])
def test_a_peer_that_hangs_up_without_answering_is_not_a_truncated_reply(sent, skip, counted):
    async def main():
        net = InMemoryNetwork()
        a = GossipPeer(net.transport("a"), settings(), {"w": np.zeros(DIM, np.float32)})
        fake = net.transport("b")
        reply = b"".join(bytes(f) for f in encode_message(
            {"w": np.ones(DIM, np.float32)}, get_codec("fp32"), swarm=SWARM, config_hash=HASH, sender="b",
            round=0, step=0, kind="reply"))

        async def hang_up(stream) -> None:
            await stream.read_exactly(64)  # some of the request, then the answer (if any) and close
            if sent == "half":
                await stream.write(reply[: len(reply) // 2])

        await fake.serve(GOSSIP_PROTOCOL, hang_up)
        outcome = await a.run_round(0, PeerRound(0.5, {"b": 0.5}, ()))
        assert outcome.skipped == {"b": skip}
        assert a.stats.errors == counted
        np.testing.assert_array_equal(a.tensors["w"], 0.0)

    asyncio.run(main())


@pytest.mark.parametrize("fault,counted", [("cut", "truncated"), ("nan", "non_finite")])
def test_a_reply_that_fails_after_most_of_its_values_arrived_mixes_none_of_them(fault, counted):
    """A one-neighbour round mixes the reply's values as they arrive; a reply that then fails (cut short,
    or a NaN in its last chunk) must leave the local values exactly as they were."""
    big = 3 * (1 << 18) + 5  # a little over three 1 MiB chunks of float32

    async def main():
        net = InMemoryNetwork()
        own = np.arange(big, dtype=np.float32)
        a = GossipPeer(net.transport("a"), settings(), {"w": own})
        values = np.ones(big, np.float32)
        frames = [bytes(f) for f in encode_message(
            {"w": values}, get_codec("fp32"), swarm=SWARM, config_hash=HASH, sender="b", round=0, step=0,
            kind="reply")]
        reply = b"".join(frames)
        if fault == "cut":
            reply = reply[: len(reply) * 9 // 10]
        else:  # the last float of the payload becomes a NaN
            reply = reply[:-4] + np.array([np.nan], np.float32).tobytes()

        async def answer(stream) -> None:
            await stream.read_exactly(64)
            await stream.write(reply)

        await net.transport("b").serve(GOSSIP_PROTOCOL, answer)
        outcome = await a.run_round(0, PeerRound(0.5, {"b": 0.5}, ()))
        assert outcome.mixed_with == () and outcome.skipped == {"b": counted}
        assert a.stats.errors == {counted: 1}
        np.testing.assert_array_equal(a.tensors["w"], own)

    asyncio.run(main())


def test_fetch_gets_the_current_tensors_and_step_at_once_whatever_round_the_peer_is_in():
    """A joiner's download (and the swarm-average evaluation) must get what the peer holds now: not
    its input to round 0 while that is still kept, and without waiting for a round to begin."""
    async def main():
        net = InMemoryNetwork()
        a = GossipPeer(net.transport("a"), settings(), {"w": np.zeros(DIM, np.float32)})
        b = GossipPeer(net.transport("b"), settings(), {"w": np.full(DIM, 1.0, np.float32)})
        for peer in (a, b):
            await peer.start()
        # b has begun no round yet: a round-0 pull would wait for it, a fetch does not
        tensors, _, step = await asyncio.wait_for(a.fetch("b"), 2)
        np.testing.assert_array_equal(tensors["w"], 1.0)
        await b.run_round(0, PeerRound(1.0, {}, ()))  # b keeps its input to round 0 for late pulls
        b.set_tensors({"w": np.full(DIM, 7.0, np.float32)}, step=12)
        tensors, round_index, step = await asyncio.wait_for(a.fetch("b"), 2)
        np.testing.assert_array_equal(tensors["w"], 7.0)
        assert (round_index, step) == (0, 12)

    asyncio.run(main())


def _three(value: float, size: int = DIM) -> dict[str, np.ndarray]:
    return {name: np.full(size, value, np.float32) for name in ("a", "b", "c")}


async def _started_pair(net: InMemoryNetwork, size: int = DIM, step: int = 0) -> tuple[GossipPeer, GossipPeer]:
    """Peers "a" (three tensors of zeros) and "b" (of twos, at `step`), both serving."""
    a = GossipPeer(net.transport("a"), settings(), _three(0.0, size))
    b = GossipPeer(net.transport("b"), settings(), _three(2.0, size), step=step)
    for peer in (a, b):
        await peer.start()
    return a, b


def test_a_fetch_from_a_start_gets_the_tail_and_a_cut_one_keeps_what_arrived_whole():
    """A joiner resumes a download where a dead donor's broke off: `start` asks the next donor for the
    tensors from that index on, and `delivered` keeps the tensors a broken-off reply had completed
    (and its step), while the tensor cut partway is not among them."""
    async def main():
        net = InMemoryNetwork()
        a, _ = await _started_pair(net, 300_000, step=9)
        delivered = Delivered()
        tensors, _, step = await asyncio.wait_for(a.fetch("b", start=1, delivered=delivered), 2)
        assert list(tensors) == ["b", "c"] and step == 9 and delivered.step == 9
        np.testing.assert_array_equal(tensors["c"], 2.0)
        assert list(delivered.tensors) == ["b", "c"]
        # a donor that dies inside the third tensor (its payload framed in 1 MiB chunks, the fourth cut):
        # the first two arrived whole and are kept
        big = 300_000  # 1.2 MB a tensor
        whole = b"".join(bytes(f) for f in encode_message(
            _three(5.0, big), get_codec("fp32"), swarm=SWARM, config_hash=HASH, sender="c", round=0, step=4,
            kind="reply"))

        async def dying(stream) -> None:
            await stream.read_exactly(64)
            await stream.write(whole[: len(whole) - big])
            await stream.close()

        await net.transport("c").serve(GOSSIP_PROTOCOL, dying)
        cut = Delivered()
        with pytest.raises(Truncated):
            await asyncio.wait_for(a.fetch("c", delivered=cut), 2)
        assert cut.step == 4 and list(cut.tensors) == ["a", "b"]
        np.testing.assert_array_equal(cut.tensors["b"], 5.0)

    asyncio.run(main())


@pytest.mark.parametrize("start,stop", [(3, None), (-1, None), ("1", None), (1.0, None), (1, 1), (0, 4), (2, "3")])
def test_a_pull_of_a_range_that_is_no_range_of_our_tensors_is_refused_and_counted(start, stop):
    """A `from` / `until` that name no non-empty range of our tensors (past the end, negative, empty, not
    ints) are a malformed request: refused as such, counted, and nothing is sent."""
    async def main():
        net = InMemoryNetwork()
        a, b = await _started_pair(net)
        frames = a._frames({}, 0, PULL, {CURRENT: True, FROM: start, **({UNTIL: stop} if stop is not None else {})})
        stream = MessageStream(await a._transport.open_stream("b", GOSSIP_PROTOCOL), a._accounting)
        await stream.send(frames)
        answer = await asyncio.wait_for(stream.read(a._request_limits, None), 2)
        await stream.close()
        assert answer.header.kind == "reject" and answer.header.meta["error"] == "bad_schema"
        assert b.stats.errors == {"bad_schema": 1} and b.stats.bytes_sent < 1024

    asyncio.run(main())


async def _serve_as_an_older_donor(net: InMemoryNetwork) -> None:
    """Peer "old": a donor of an older murmur, which answers any pull with all three tensors at step 2."""
    whole = b"".join(bytes(f) for f in encode_message(
        _three(3.0), get_codec("fp32"), swarm=SWARM, config_hash=HASH, sender="old", round=0, step=2, kind="reply"))

    async def old(stream) -> None:
        await stream.read_exactly(64)
        await stream.write(whole)

    await net.transport("old").serve(GOSSIP_PROTOCOL, old)


def test_a_fetch_of_a_range_gets_those_tensors_only_and_a_donor_answering_more_is_refused():
    """A spot check asks a donor for a few tensors: it gets exactly those; an answer with others (a peer
    that ignores `until`) is a manifest mismatch, not a download of the rest of the model."""
    async def main():
        net = InMemoryNetwork()
        a, b = await _started_pair(net)
        tensors, _, _ = await asyncio.wait_for(a.fetch("b", start=1, stop=2), 2)
        assert list(tensors) == ["b"] and b.stats.bytes_sent < 2 * 4 * DIM
        tensors, _, _ = await asyncio.wait_for(a.fetch("b", stop=1), 2)
        assert list(tensors) == ["a"]
        await _serve_as_an_older_donor(net)
        with pytest.raises(ManifestMismatch):
            await asyncio.wait_for(a.fetch("old", start=1, stop=2), 2)
        with pytest.raises(ValueError):
            await a.fetch("b", start=2, stop=2)

    asyncio.run(main())


def test_a_resumed_fetch_takes_a_whole_answer_from_a_donor_that_ignores_the_start():
    """A donor of an older murmur knows no `from` and answers the whole model: accepted, all of it."""
    async def main():
        net = InMemoryNetwork()
        a = GossipPeer(net.transport("a"), settings(), _three(0.0))
        await _serve_as_an_older_donor(net)
        await a.start()
        tensors, _, step = await asyncio.wait_for(a.fetch("old", start=2), 2)
        assert list(tensors) == ["a", "b", "c"] and step == 2

    asyncio.run(main())


@pytest.mark.parametrize("codec", ["int8", "bf16", "fp16"])
def test_a_fetch_is_exact_whatever_codec_the_rounds_use(codec):
    """A joiner (or a node catching up) starts from an exact copy of its donor's parameters, not the
    round codec's lossy image of them; the rounds themselves keep the swarm's codec."""
    async def main():
        net = InMemoryNetwork()
        donor = np.random.default_rng(3).standard_normal(DIM).astype(np.float32)
        a = GossipPeer(net.transport("a"), settings(codec=get_codec(codec)), {"w": np.zeros(DIM, np.float32)})
        b = GossipPeer(net.transport("b"), settings(codec=get_codec(codec)), {"w": donor})
        for peer in (a, b):
            await peer.start()
        tensors, _, _ = await asyncio.wait_for(a.fetch("b"), 2)
        assert tensors["w"].dtype == np.float32
        np.testing.assert_array_equal(tensors["w"], donor)
        assert b.stats.bytes_sent > 4 * DIM  # the whole fp32 payload left b
        # a round's pull of b's input still travels in the swarm's (lossy) codec
        async with asyncio.TaskGroup() as group:
            group.create_task(b.run_round(0, PeerRound(1.0, {}, ())))
            group.create_task(a.run_round(0, PeerRound(0.0, {"b": 1.0}, ())))
        mixed = a.tensors["w"]
        assert not np.array_equal(mixed, donor)
        np.testing.assert_allclose(mixed, donor, atol=0.05 * float(np.abs(donor).max()))

    asyncio.run(main())


def test_own_tensors_that_turn_out_non_finite_halfway_are_cut_off_not_sent():
    """A NaN in our own tensors is found while the message is already going out (encoding runs as the
    chunks are written): the message is cut off, the receiver counts it truncated and mixes nothing,
    and the sender counts it `unsendable` rather than blaming the receiver."""
    big = 3 * (1 << 18)

    async def main():
        net = InMemoryNetwork()
        bad = np.ones(big, np.float32)
        bad[-1] = np.nan
        a = GossipPeer(net.transport("a"), settings(), {"w": np.zeros(big, np.float32)})
        b = GossipPeer(net.transport("b"), settings(), {"w": bad})
        for peer in (a, b):
            await peer.start()
        await b.run_round(0, PeerRound(1.0, {}, ()))
        outcome = await a.run_round(0, PeerRound(0.5, {"b": 0.5}, ()))
        assert outcome.skipped == {"b": "truncated"} and a.stats.errors == {"truncated": 1}
        np.testing.assert_array_equal(a.tensors["w"], 0.0)
        # a cut answer is asked for once more (it might be a relay that died): cut off again, counted again
        assert a.stats.retried == 1 and b.stats.errors == {"unsendable": 2}

    asyncio.run(main())


class _CutFirstStream:
    """A transport whose first `streams` incoming streams are cut after `after` bytes of their answer, as
    when the relay they ran through dies; later streams pass through."""

    def __init__(self, inner, after: int, streams: int = 1) -> None:
        self._inner, self._after, self._streams, self.cut = inner, after, streams, 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def serve(self, protocol, handler) -> None:
        async def wrapped(stream) -> None:
            if self.cut < self._streams:
                self.cut += 1
                stream = _Cut(stream, self._after)
            await handler(stream)

        await self._inner.serve(protocol, wrapped)


class _Cut:
    def __init__(self, stream, after: int) -> None:
        self._stream, self._left = stream, after

    def __getattr__(self, name):
        return getattr(self._stream, name)

    async def write(self, data) -> None:
        data = memoryview(data).cast("B")
        if len(data) > self._left:
            await self._stream.write(data[: self._left])
            await self._stream.close()
            raise ConnectionResetError("the relay went away")
        self._left -= len(data)
        await self._stream.write(data)


def test_an_exchange_whose_stream_is_cut_is_asked_again_and_both_mix_once():
    """A symmetric pair's stream is cut halfway through the answer (a relay dies): the asker asks again
    on a new stream within the same deadline, the answering peer's round takes that second request, and
    both mix exactly once, so the pair's average is kept and nothing counts as skipped."""
    big = 3 * (1 << 18)

    async def main():
        net = InMemoryNetwork()
        a = GossipPeer(net.transport("a"), settings(exchange_timeout_s=5.0), {"w": np.zeros(big, np.float32)})
        b_transport = _CutFirstStream(net.transport("b"), after=1 << 20)
        b = GossipPeer(b_transport, settings(exchange_timeout_s=5.0), {"w": np.full(big, 2.0, np.float32)})
        for peer in (a, b):
            await peer.start()
        plan = PeerRound(0.5, {"a": 0.5}, ("a",)), PeerRound(0.5, {"b": 0.5}, ("b",))
        out_b, out_a = await asyncio.gather(b.run_round(0, plan[0]), a.run_round(0, plan[1]))
        assert b_transport.cut == 1 and a.stats.retried == 1
        assert out_a.mixed_with == ("b",) and out_b.mixed_with == ("a",), (out_a.skipped, out_b.skipped)
        np.testing.assert_array_equal(a.tensors["w"], 1.0)
        np.testing.assert_array_equal(b.tensors["w"], 1.0)
        assert a.stats.skipped == {} and b.stats.skipped == {} and a.stats.errors == {}

    asyncio.run(main())


def test_a_partner_whose_second_try_is_cut_too_is_skipped_after_a_short_grace():
    """The asker asks once more only; its second stream cut as well, the answering peer's round waits
    a short grace for a third request, not its whole deadline, and skips the partner as unreachable."""
    big = 3 * (1 << 18)

    async def main():
        net = InMemoryNetwork()
        a = GossipPeer(net.transport("a"), settings(exchange_timeout_s=8.0), {"w": np.zeros(big, np.float32)})
        b_transport = _CutFirstStream(net.transport("b"), after=1 << 20, streams=2)
        b = GossipPeer(b_transport, settings(exchange_timeout_s=8.0), {"w": np.full(big, 2.0, np.float32)})
        for peer in (a, b):
            await peer.start()
        plan = PeerRound(0.5, {"a": 0.5}, ("a",)), PeerRound(0.5, {"b": 0.5}, ("b",))
        out_b, out_a = await asyncio.gather(b.run_round(0, plan[0]), a.run_round(0, plan[1]))
        assert b_transport.cut == 2 and a.stats.retried == 1
        # the cut is seen by the read of the request (truncated) or by the duplex reply's write (unreachable)
        assert set(out_b.skipped) == {"a"} and out_b.skipped["a"] in ("unreachable", "truncated"), out_b.skipped
        assert out_a.mixed_with == ()
        assert out_b.duration_s < 8.0 / 2, out_b.duration_s  # the grace, not the deadline
        np.testing.assert_array_equal(b.tensors["w"], 2.0)
        np.testing.assert_array_equal(a.tensors["w"], 0.0)

    asyncio.run(main())


@pytest.mark.parametrize("codec,ratio", [("int8", 0.27), ("bf16", 0.51), ("fp32", 1.0)])
def test_past_round_inputs_are_kept_in_the_wire_codec_and_a_pull_of_them_gets_that_image(codec, ratio):
    # b has moved two rounds on; a pulls b's input to round 0. b keeps that input as the codec's wire
    # bytes (a lossy codec's size, not float32's), and what a mixes is the codec's image of it: the
    # same as if b had answered in round 0.
    async def main():
        net = InMemoryNetwork()
        rng = np.random.default_rng(3)
        inputs = [{"w": rng.standard_normal(4096).astype(np.float32)} for _ in range(3)]
        a = GossipPeer(net.transport("a"), settings(codec=get_codec(codec), max_staleness=2),
                       {"w": np.zeros(4096, np.float32)})
        b = GossipPeer(net.transport("b"), settings(codec=get_codec(codec), max_staleness=2), inputs[0])
        await a.start()
        await b.start()
        alone = PeerRound(1.0, {}, ())
        for r in range(3):
            b.set_tensors(inputs[r], step=r)
            await b.run_round(r, alone)
        kept = b._round_inputs
        assert sorted(kept) == [0, 1, 2] and kept[2] is not None and isinstance(kept[2]["w"], np.ndarray)
        past = sum(getattr(kept[r], "nbytes", None) or kept[r]["w"].nbytes for r in (0, 1))
        assert past <= ratio * 2 * inputs[0]["w"].nbytes
        outcome = await a.run_round(0, PeerRound(0.5, {"b": 0.5}, ()))
        assert outcome.mixed_with == ("b",)
        wire = get_codec(codec)
        image = wire.decode(wire.encode(inputs[0]["w"]), 4096)
        np.testing.assert_allclose(a.tensors["w"], 0.5 * image, rtol=0, atol=1e-7)

    asyncio.run(main())


def test_a_fetch_may_ask_for_a_state_codec_and_gets_its_image_in_its_bytes():
    """A joiner takes outer state that is only a starting point (DiLoCo's momentum) in int8: the donor
    answers in the codec asked for, a quarter of fp32's bytes; a codec that drops entries, an unknown
    one, or one named in a round's pull is a malformed request, refused and counted."""
    async def main():
        net = InMemoryNetwork()
        rng = np.random.default_rng(4)
        a = GossipPeer(net.transport("a"), settings(), {"w": np.zeros(4096, np.float32)})
        b = GossipPeer(net.transport("b"), settings(), {"w": rng.standard_normal(4096).astype(np.float32)})
        for peer in (a, b):
            await peer.start()
        exact, _, _ = await a.fetch("b")
        fp32_bytes = a.stats.bytes_received
        np.testing.assert_array_equal(exact["w"], b.tensors["w"])
        image, _, _ = await a.fetch("b", codec="int8")
        int8 = get_codec("int8")
        np.testing.assert_array_equal(image["w"], int8.decode(int8.encode(b.tensors["w"]), 4096))
        assert a.stats.bytes_received - fp32_bytes < 0.3 * fp32_bytes
        with pytest.raises(ValueError, match="carry every element"):
            await a.fetch("b", codec="topk")
        for meta in ({CURRENT: True, CODEC: "topk"}, {CURRENT: True, CODEC: "nonsense"}, {CODEC: "int8"}):
            stream = MessageStream(await a._transport.open_stream("b", GOSSIP_PROTOCOL), a._accounting)
            await stream.send(a._frames({}, 0, PULL, meta))
            answer = await asyncio.wait_for(stream.read(a._request_limits, None), 2)
            await stream.close()
            assert answer.header.kind == "reject" and answer.header.meta["error"] == "bad_schema", meta
        assert b.stats.errors == {"bad_schema": 3}

    asyncio.run(main())


# ---- values that cover part of a phase (SHARE) ---------------------------------------------------


@pytest.mark.parametrize("topology", ["ring", "static-exp"], ids=["exchange", "pulls"])
def test_values_that_cover_part_of_a_phase_are_weighed_by_their_share(topology):
    """a's values (0) cover a quarter of a phase, b's (1) all of it: each side weighs them w_ij s_j / sum_k w_ik s_k
    (gossip.mixing.token_weights), so both land on 0.5 / 0.625 = 0.8 instead of the plain average 0.5; a
    round whose shares are all 1 mixes as before."""
    async def main():
        net = InMemoryNetwork()
        a = GossipPeer(net.transport("a"), settings(), {"w": np.zeros(DIM, np.float32)})
        b = GossipPeer(net.transport("b"), settings(), {"w": np.ones(DIM, np.float32)})
        for p in (a, b):
            await p.start()
        view, topo = MembershipView.of(["a", "b"]), build_topology(topology, 2)
        a.share = 0.25
        async with asyncio.TaskGroup() as group:
            for pid, p in (("a", a), ("b", b)):
                group.create_task(p.run_round(0, peer_round(topo, view, pid, 0)))
        np.testing.assert_allclose(a.tensors["w"], 0.8, rtol=1e-6)
        np.testing.assert_allclose(b.tensors["w"], 0.8, rtol=1e-6)
        a.share = 1.0
        b.set_tensors({"w": np.ones(DIM, np.float32)})
        a.set_tensors({"w": np.zeros(DIM, np.float32)})
        async with asyncio.TaskGroup() as group:
            for pid, p in (("a", a), ("b", b)):
                group.create_task(p.run_round(1, peer_round(topo, view, pid, 1)))
        np.testing.assert_array_equal(a.tensors["w"], 0.5)
        with pytest.raises(ValueError):
            a.share = 0.0

    asyncio.run(main())


@pytest.mark.parametrize("bad", [0.0, 1.5, float("nan"), "half", True])
@pytest.mark.parametrize("hostile", ["a", "b"], ids=["asker", "answerer"])
def test_a_share_that_is_no_share_of_a_phase_is_refused_and_nothing_is_mixed(bad, hostile):
    """A peer claiming a SHARE outside (0, 1] (to weigh its values above a full phase's, say): its request,
    or its reply before the ack, is refused as bad_schema and counted, and the honest side mixes nothing."""
    from gossip.exchange import SHARE

    async def main():
        net = InMemoryNetwork()
        a, b, plan = _two(net, 0.0, 1.0, a_timeout_s=1.0, b_timeout_s=1.0)
        for p in (a, b):
            await p.start()
        liar, honest = (a, b) if hostile == "a" else (b, a)
        liar._share_meta = lambda round_index: {SHARE: bad}
        async with asyncio.TaskGroup() as group:
            group.create_task(a.run_round(0, plan["a"](0)))
            group.create_task(b.run_round(0, plan["b"](0)))
        assert honest.stats.errors == {"bad_schema": 1}
        np.testing.assert_array_equal(honest.tensors["w"], 1.0 if honest is b else 0.0)

    asyncio.run(main())
