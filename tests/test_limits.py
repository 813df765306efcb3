"""Resource limits in process (gossip/limits.py and where the protocols use it): incoming streams per
peer and in all, membership, pull rates, SPES fetches per version, and per-round bookkeeping (the
view's cap: test_sybils.py). The network limits (dials, routability) are in test_dialer.py; the monitor's in
test_monitor_access.py; whole processes under attack in test_limits_swarm.py."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pytest

from gossip.codecs import get_codec
from gossip.exchange import ExchangeSettings, GossipPeer
from gossip.limits import CountPerKey, IncomingGate, IncomingLimits, LruTable, PeerBuckets, StreamRefusal
from gossip.memory import InMemoryNetwork, InMemoryTransport
from gossip.spes import ExpertFetch, ExpertRecord, ServedCopy, codec_image, content_hash
from gossip.spes.fetch import RefreshFailed
from gossip.transport import GOSSIP_PROTOCOL, Stream
from gossip.wire import iter_message
from topology import PeerRound

pytestmark = pytest.mark.unit

SWARM, HASH = "limits", "c0ffee"
DIM = 64


def settings(**kw: object) -> ExchangeSettings:
    return ExchangeSettings(**{"swarm": SWARM, "config_hash": HASH, "codec": get_codec("fp32"),  # type: ignore[arg-type]
                               "exchange_timeout_s": 1.0, **kw})


class Members:
    """A view as last read (`peers`) and as the next read will show it (`next_read`)."""

    def __init__(self, *peers: str) -> None:
        self.peers = set(peers)
        self.next_read: set[str] = set()
        self.asked: list[str] = []
        self.read = asyncio.Event()
        self.read.set()

    def knows(self, peer: str) -> bool:
        return peer in self.peers

    async def admits(self, peer: str) -> bool:
        self.asked.append(peer)
        await self.read.wait()
        self.peers |= self.next_read
        return peer in self.peers


# ---- the stream gate ------------------------------------------------------------------------------

def test_the_gate_caps_streams_per_peer_and_in_all_and_gives_slots_back():
    gate = IncomingGate(IncomingLimits(per_peer_streams=2, total_streams=3, per_protocol_streams=0))
    assert gate.try_open("a") is None and gate.try_open("a") is None
    assert gate.try_open("a") is StreamRefusal.PEER_STREAMS
    assert gate.try_open("b") is None
    assert gate.try_open("c") is StreamRefusal.TOTAL_STREAMS
    assert gate.open_streams == 3 and dict(gate.refused) == {"peer_streams": 1, "total_streams": 1}
    gate.close("a")
    assert gate.try_open("c") is None  # a slot given back is free again
    for peer in ("a", "b", "c"):
        gate.close(peer)
    assert gate.open_streams == 0 and not gate._open  # no per-peer entry outlives its streams


def test_each_served_protocol_widens_the_caps():
    gate = IncomingGate(IncomingLimits(per_peer_streams=4, total_streams=10, per_protocol_streams=2))

    async def handler(stream: Stream) -> None:
        pass

    before = (gate.peer_cap, gate.total_cap)
    for _ in range(3):
        gate.guard(handler)
    assert (gate.peer_cap, gate.total_cap) == (before[0] + 6, before[1] + 24)


def test_streams_beyond_a_peers_cap_and_from_non_members_are_closed_unread():
    async def main() -> None:
        net = InMemoryNetwork()
        members = Members("member")
        gate = IncomingGate(IncomingLimits(per_peer_streams=2, per_protocol_streams=0), members)
        victim = net.transport("victim", gate)
        held: list[Stream] = []
        release = asyncio.Event()

        async def handler(stream: Stream) -> None:
            held.append(stream)
            await release.wait()

        await victim.serve(GOSSIP_PROTOCOL, handler)
        member, stranger = net.transport("member"), net.transport("stranger")
        streams = [await member.open_stream("victim", GOSSIP_PROTOCOL) for _ in range(3)]
        outsider = await stranger.open_stream("victim", GOSSIP_PROTOCOL)
        for stream in (streams[2], outsider):
            await stream.write(b"x" * 100)
            with pytest.raises(ConnectionError):
                async with asyncio.timeout(2):
                    await stream.read_exactly(1)  # closed by the victim without an answer
        assert len(held) == 2 and gate.open_streams == 2
        assert dict(gate.refused) == {"peer_streams": 1, "not_member": 1}
        assert gate.admitted == 2
        release.set()
        await asyncio.sleep(0.05)
        assert gate.open_streams == 0

    asyncio.run(main())


def test_a_peer_not_in_the_view_waits_for_the_next_read_in_a_bounded_number_of_places():
    async def main() -> None:
        members = Members("member")
        members.read.clear()  # the next read of the view takes a while
        members.next_read = {"joiner"}  # and will show a joiner whose record is newer than the last read
        gate = IncomingGate(IncomingLimits(unknown_streams=2), members)
        outcomes: dict[str, StreamRefusal | None] = {}

        async def arrive(name: str, peer: str) -> None:
            async with gate.admit(peer) as refusal:
                outcomes[name] = refusal

        waiting = [asyncio.create_task(arrive("joiner", "joiner")), asyncio.create_task(arrive("stranger", "stranger"))]
        await asyncio.sleep(0.01)
        await arrive("flood", "flooder")  # both places taken: refused at once, without waiting
        await arrive("member", "member")  # a member in the last read never waits
        assert outcomes == {"flood": StreamRefusal.NOT_MEMBER, "member": None}
        members.read.set()
        await asyncio.gather(*waiting)
        assert outcomes["joiner"] is None and outcomes["stranger"] is StreamRefusal.NOT_MEMBER
        assert gate.refused == {"not_member": 2} and gate.open_streams == 0 and gate._unknown == 0

    asyncio.run(main())


def test_view_membership_waits_for_a_read_that_began_after_the_stream():
    from node.net.membership import ViewMembership

    class View:
        def __init__(self) -> None:
            self.records: tuple[SimpleRecord, ...] = (SimpleRecord("a"),)
            self.asked: list[float] = []

        def view(self) -> tuple[SimpleRecord, ...]:
            return self.records

        async def read_after(self, since: float, min_interval_s: float) -> None:
            self.asked.append(since)
            await asyncio.sleep(0.01)
            self.records = (*self.records, SimpleRecord("joiner"))

    async def main() -> None:
        view = View()
        membership = ViewMembership(view)
        assert membership.knows("a") and not membership.knows("joiner")
        assert await membership.admits("a") and view.asked == []  # no read for a known member
        assert await membership.admits("joiner") and len(view.asked) == 1
        assert not await membership.admits("stranger")

    asyncio.run(main())


@dataclass(frozen=True)
class SimpleRecord:
    peer_id: str


# ---- bookkeeping that a flood cannot grow -----------------------------------------------------------

def test_bounded_tables_drop_the_least_recently_used():
    table: LruTable[str, int] = LruTable(2)
    table.put("a", 1)
    table.put("b", 2)
    assert table.get("a") == 1  # a is now the most recent
    table.put("c", 3)
    assert "b" not in table and "a" in table and len(table) == 2
    counts: CountPerKey[tuple[str, int]] = CountPerKey(limit=2, capacity=100)
    assert counts.take(("p", 1)) and counts.take(("p", 1)) and not counts.take(("p", 1))
    assert counts.take(("p", 2))
    counts.prune(lambda key: key[1] >= 2)
    assert len(counts) == 1 and counts.take(("p", 1))  # pruned: counted afresh


def test_token_buckets_allow_a_burst_then_the_rate_per_peer():
    now = [0.0]
    buckets = PeerBuckets(rate_per_s=0.5, burst=3, capacity=10, clock=lambda: now[0])
    assert [buckets.take("a") for _ in range(4)] == [True, True, True, False]
    assert buckets.take("b")  # another peer has its own bucket
    now[0] = 1.9
    assert not buckets.take("a")  # 0.95 of a token
    now[0] = 2.1
    assert buckets.take("a") and not buckets.take("a")
    for i in range(50):
        buckets.take(f"flood{i}")
    assert len(buckets) == 10


# ---- pulls ---------------------------------------------------------------------------------------

def vector(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full(DIM, value, np.float32)}


class Net:
    """An in-memory network whose transports are made on first use."""

    def __init__(self) -> None:
        self.net = InMemoryNetwork()
        self.transports: dict[str, InMemoryTransport] = {}

    def __call__(self, peer: str, gate: IncomingGate | None = None) -> InMemoryTransport:
        if peer not in self.transports:
            self.transports[peer] = self.net.transport(peer, gate)
        return self.transports[peer]


async def pull_answer(net: Net, sender: str, victim: str, round_index: int, *,
                      current: bool = False) -> tuple[str, int]:
    """One raw pull; the answer's kind (or the reject's error) and its bytes."""
    from gossip.wire import MessageReader

    stream = await net(sender).open_stream(victim, GOSSIP_PROTOCOL)
    for frame in iter_message({}, get_codec("fp32"), swarm=SWARM, config_hash=HASH, sender=sender,
                              round=round_index, step=0, kind="pull", meta={"current": True} if current else None):
        await stream.write(frame)
    received = [0]

    async def read_exactly(n: int) -> bytes:
        data = await stream.read_exactly(n)
        received[0] += n
        return data

    async with asyncio.timeout(5):
        reader = MessageReader(read_exactly)
        header = await reader.header()
        await reader.rest()
    await stream.close()
    return (str(header.meta["error"]) if header.kind == "reject" else header.kind), received[0]


def test_a_round_is_answered_twice_per_asker_and_a_round_out_of_bounds_with_a_reject_not_tensors():
    async def main() -> None:
        net = Net()
        peer = GossipPeer(net("victim"), settings(max_staleness=2), vector(1.0))
        await peer.start()
        await peer.run_round(10, PeerRound(1.0, {}, ()))
        answers = [await pull_answer(net, "asker", "victim", 10) for _ in range(3)]
        assert [a for a, _ in answers] == ["reply", "reply", "rate_limited"]
        assert answers[0][1] > DIM * 4 > answers[2][1]
        assert (await pull_answer(net, "other", "victim", 10))[0] == "reply"  # per asker
        assert (await pull_answer(net, "asker", "victim", 9))[0] == "reply"  # per round
        far, nbytes = await pull_answer(net, "asker", "victim", 10**12)
        assert far == "stale" and nbytes < DIM * 4  # no tensors the asker would drop
        assert (await pull_answer(net, "asker", "victim", 7))[0] == "stale"
        assert dict(peer.stats.refused) == {"rate_limited": 1, "stale": 2} and peer.stats.errors == {}
        # bookkeeping follows the rounds: once they pass, the counts go
        for r in range(11, 16):
            await peer.run_round(r, PeerRound(1.0, {}, ()))
        assert len(peer._round_pulls) == 0

    asyncio.run(main())


def test_pulls_of_the_current_tensors_are_rate_limited_per_asker():
    async def main() -> None:
        net = Net()
        incoming = IncomingLimits(current_pulls_burst=2, current_pulls_per_s=0.01)
        peer = GossipPeer(net("victim"), settings(incoming=incoming), vector(1.0))
        await peer.start()
        kinds = [(await pull_answer(net, "asker", "victim", 0, current=True))[0] for _ in range(4)]
        assert kinds == ["reply", "reply", "rate_limited", "rate_limited"]
        assert (await pull_answer(net, "joiner", "victim", 0, current=True))[0] == "reply"
        # the fetch API sees the refusal as a rejected pull, not as garbage
        fetcher = GossipPeer(net("asker"), settings(), vector(0.0))
        from gossip.exchange import PeerRejected

        with pytest.raises(PeerRejected, match="rate_limited"):
            await fetcher.fetch("victim")

    asyncio.run(main())


def test_exchange_requests_for_far_rounds_keep_bounded_bookkeeping():
    """A flood of exchange requests for far-future rounds from many senders: each is refused as stale
    on its header, its round is kept clamped just past ours, at most `tracked_peers` senders are kept,
    and all of it goes as our rounds pass."""
    async def main() -> None:
        net = InMemoryNetwork()
        incoming = IncomingLimits(tracked_peers=5)
        peer = GossipPeer(net.transport("victim"), settings(max_staleness=2, incoming=incoming), vector(1.0))
        await peer.start()
        await peer.run_round(100, PeerRound(1.0, {}, ()))
        header = None
        for i in range(12):
            sender = f"flood{i:02d}"
            stream = await net.transport(sender).open_stream("victim", GOSSIP_PROTOCOL)
            frames = iter_message(vector(0.0), get_codec("fp32"), swarm=SWARM, config_hash=HASH, sender=sender,
                                  round=10**15, step=0, kind="exchange")
            header = next(iter(frames))
            await stream.write(header)  # the header alone: the payload is never asked for
            async with asyncio.timeout(2):
                length = int.from_bytes(await stream.read_exactly(8), "big")
                assert b"stale" in await stream.read_exactly(length)
            await stream.close()
        assert peer.stats.refused == {"stale": 12} and peer.stats.errors == {}
        assert len(peer._latest_request) == 5
        assert max(peer._latest_request.values()) <= 100 + 2 + 1
        for r in range(101, 105):
            await peer.run_round(r, PeerRound(1.0, {}, ()))
        assert peer._latest_request == {}

    asyncio.run(main())


# ---- SPES fetches ----------------------------------------------------------------------------------

class Holder:
    def __init__(self, tensors: Mapping[str, np.ndarray], version: int) -> None:
        self.tensors, self.version = dict(tensors), version

    def holds(self, key: tuple[int, int]) -> bool:
        return key == (0, 1)

    async def served_copy(self, key: tuple[int, int], have: str | None = None) -> ServedCopy:
        image = codec_image(list(self.tensors.values()), "bf16")
        return ServedCopy(dict(zip(self.tensors, image)), ExpertRecord(self.version, content_hash(image), True))


def test_an_expert_copy_is_served_twice_per_version_to_one_asker():
    async def main() -> None:
        net = InMemoryNetwork()
        tensors = {"e.w": np.linspace(-1, 1, 32, dtype=np.float32)}
        holder = Holder(tensors, version=3)
        server = ExpertFetch(net.transport("owner"), settings(), "bf16", lambda: 0)
        await server.serve(holder)
        asker = ExpertFetch(net.transport("asker"), settings(), "bf16", lambda: 0)
        for _ in range(2):
            await asker.fetch("owner", (0, 1), tensors, min_version=3)
        with pytest.raises(RefreshFailed, match="rate_limited"):
            await asker.fetch("owner", (0, 1), tensors, min_version=3)
        holder.version = 4  # a new version may be fetched again
        await asker.fetch("owner", (0, 1), tensors, min_version=4)
        assert server.stats.served == 3 and server.stats.refused == {"rate_limited": 1}
        assert server.stats.errors == {}

    asyncio.run(main())


def test_fetch_requests_are_gated_like_gossip():
    async def main() -> None:
        net = InMemoryNetwork()
        gate = IncomingGate(IncomingLimits(), Members())
        server = ExpertFetch(net.transport("owner", gate), settings(), "bf16", lambda: 0)
        await server.serve(Holder({"e.w": np.zeros(4, np.float32)}, 1))
        asker = ExpertFetch(net.transport("asker"), settings(), "bf16", lambda: 0)
        with pytest.raises(RefreshFailed, match="unreachable"):
            await asker.fetch("owner", (0, 1), {"e.w": np.zeros(4, np.float32)}, min_version=1)
        assert gate.refused == {"not_member": 1} and server.stats.bytes_received == 0

    asyncio.run(main())


def test_blobs_are_served_at_the_rate_of_current_pulls():
    from gossip.blob import BlobFailed, fetch_blob, serve_blobs

    async def main() -> None:
        import hashlib

        net = Net()
        data = b"tokenizer" * 100
        sha = hashlib.sha256(data).hexdigest()

        async def source(sha256: str) -> bytes | None:
            return data if sha256 == sha else None

        await serve_blobs(net("server"), source, limits=IncomingLimits(current_pulls_burst=2, current_pulls_per_s=0.01))
        for _ in range(2):
            assert await fetch_blob(net("asker"), "server", sha, len(data)) == data
        with pytest.raises(BlobFailed, match="rate_limited"):
            await fetch_blob(net("asker"), "server", sha, len(data))
        assert await fetch_blob(net("other"), "server", sha, len(data)) == data  # per asker

    asyncio.run(main())
