"""A failed DHT read is not an empty one (issue 14, "Validators everywhere"; issue 26): Discovery's reads of
the peer view (`_read_view`) and of other per-peer keys (`read_owned`, SPES's expert directory) over a
stand-in for hivemind's DHTNode that answers, fails, hangs, finds nothing, or asks peers none of which
answers (node.net.hivemind_adapter.FindWatch). A failed read is counted and keeps what the node knew;
only a read that finds nothing empties it. SPES's experts are read of the view's members only."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time

from gossip.spes import ExpertRecord
from node.algorithms.spes.directory import DhtExpertDirectory
from node.net.discovery import MEMBERSHIP_BUDGET_MBIT_S, Discovery, DiscoverySettings
from node.net.identity import Identity, create_identity
from node.net.records import (
    PeerRecord,
    ShardedKey,
    encode_expert_records,
    encode_peer_record,
    experts_key,
    peer_shard,
    peers_key,
)

pytestmark = pytest.mark.unit

SWARM = "reads"


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Identity]:
    directory = tmp_path_factory.mktemp("ids")
    return {name: create_identity(directory / f"{name}.key") for name in ("me", "a", "b")}


class StandInDht:
    """What Discovery asks of hivemind's DHTNode for reads: `get(key, latest=True)`. `answer` is what
    the next gets do: a mapping key -> {subkey: value bytes} (a key it lacks: nothing found), an
    exception to raise, or "hang"; an exception in place of one key's entries fails the reads of that key."""

    def __init__(self) -> None:
        self.answer: Mapping[str, Mapping[bytes, bytes] | Exception] | Exception | str = {}
        self.gets = 0

    async def get(self, key: str, latest: bool = False) -> ValueWithExpiration | None:
        self.gets += 1
        if isinstance(self.answer, Exception):
            raise self.answer
        if self.answer == "hang":
            await asyncio.sleep(3600)
        assert isinstance(self.answer, Mapping)
        entries = self.answer.get(key)
        if entries is None:
            return None
        if isinstance(entries, Exception):
            raise entries
        expires = get_dht_time() + 30
        return ValueWithExpiration({subkey: ValueWithExpiration(value, expires)
                                    for subkey, value in entries.items()}, expires)


def subkey(identity: Identity) -> bytes:
    """The signed subkey a peer's values sit in: its public key."""
    return RSASignatureValidator(identity.signing_key).local_public_key


def peer_record(identity: Identity, step: int) -> bytes:
    return encode_peer_record(PeerRecord(peer_id=identity.peer_id, maddrs=(f"/ip4/127.0.0.1/tcp/1/p2p/{identity.peer_id}",),
                                         step=step, round=0, experts=(), capacity=0, version="test", heartbeat=0.0))


def discovery_over(dht: StandInDht, me: Identity) -> Discovery:
    """A Discovery whose DHT is the stand-in (no daemon: its data-plane addresses are given)."""
    settings = DiscoverySettings(SWARM, request_timeout_s=0.2)
    discovery = Discovery(None, me, settings, data_maddrs=(f"/ip4/127.0.0.1/tcp/1/p2p/{me.peer_id}",))  # type: ignore[arg-type]
    discovery._dht = dht  # type: ignore[assignment]
    return discovery


def test_a_failed_or_timed_out_read_of_the_view_keeps_it_and_is_counted_an_empty_one_empties_it(ids) -> None:
    me, a, b = ids["me"], ids["a"], ids["b"]
    dht = StandInDht()
    discovery = discovery_over(dht, me)

    async def read(answer: Mapping[str, Mapping[bytes, bytes]] | Exception | str) -> set[str]:
        dht.answer = answer
        await discovery._refresh_view()
        return {p.peer_id for p in discovery.view()}

    async def scenario() -> None:
        everyone = {me.peer_id, a.peer_id, b.peer_id}
        live = {peers_key(SWARM): {subkey(a): peer_record(a, 5), subkey(b): peer_record(b, 7)}}
        assert await read(live) == everyone
        assert await read(ConnectionError("no DHT peer answered")) == everyone
        assert discovery.errors.get("dht_get_failed") == 1
        assert await read("hang") == everyone  # bounded by request_timeout_s
        assert discovery.errors.get("dht_get_timeout") == 1
        # the peers' steps are still those last read, not lost
        assert {p.peer_id: p.step for p in discovery.view()}[b.peer_id] == 7
        # a read that answers with nothing is no failure: the peers are gone (this node stays)
        assert await read({}) == {me.peer_id}
        assert await read({peers_key(SWARM): {}}) == {me.peer_id}
        assert discovery.errors.get("dht_get_failed") == 1 and discovery.errors.get("dht_get_timeout") == 1
        assert dht.gets == 5

    asyncio.run(scenario())


def test_read_owned_returns_none_on_a_failed_read_and_an_empty_mapping_when_nothing_is_found(ids) -> None:
    me, a = ids["me"], ids["a"]
    dht = StandInDht()
    discovery = discovery_over(dht, me)
    key = ShardedKey(experts_key(SWARM))

    async def values() -> Mapping[str, bytes] | None:
        found = await discovery.read_owned(key, what="expert records")
        return None if found is None else found.values

    async def scenario() -> None:
        dht.answer = {peers_key(SWARM): {subkey(a): peer_record(a, 1)}}
        await discovery._refresh_view()  # a is a member: its values are read
        dht.answer = {key.base: {subkey(a): b"a's value", b"no owner": b"x"}}
        assert await values() == {a.peer_id: b"a's value"}
        assert discovery.errors.get("expert_records_invalid") == 1  # the subkey naming no owner
        dht.answer = RuntimeError("boom")
        assert await values() is None
        dht.answer = "hang"
        assert await values() is None
        assert discovery.errors.get("dht_get_failed") == 1 and discovery.errors.get("dht_get_timeout") == 1
        dht.answer = {}
        assert await values() == {}

    asyncio.run(scenario())


def test_the_spes_directory_keeps_its_last_read_when_a_read_fails_and_forgets_on_an_empty_one(ids) -> None:
    me, a = ids["me"], ids["a"]
    dht = StandInDht()
    discovery = discovery_over(dht, me)
    directory = DhtExpertDirectory(discovery, SWARM, heartbeat_s=1e-9, ttl_s=10.0)  # every read goes to the DHT
    records = {(0, 1): ExpertRecord(3, "ab" * 32, True)}
    key = experts_key(SWARM)

    async def scenario() -> None:
        dht.answer = {peers_key(SWARM): {subkey(a): peer_record(a, 1)}}
        await discovery._refresh_view()
        dht.answer = {key: {subkey(a): encode_expert_records(records)}}
        assert (await directory.read())[a.peer_id] == records
        dht.answer = ConnectionError("down")
        assert (await directory.read())[a.peer_id] == records  # kept
        dht.answer = "hang"
        assert (await directory.read())[a.peer_id] == records  # kept
        assert discovery.errors.get("dht_get_failed") == 1 and discovery.errors.get("dht_get_timeout") == 1
        dht.answer = {}
        assert a.peer_id not in await directory.read()
        assert dht.gets == 5

    asyncio.run(scenario())


def test_an_experts_entry_of_an_owner_without_a_peer_record_in_the_view_is_ignored_and_counted(ids) -> None:
    """SPES's `<swarm>.experts` is membership-checked in an open swarm too: any DHT node may store signed
    expert records, but only an owner whose peer record the view holds owns experts."""
    me, a, b = ids["me"], ids["a"], ids["b"]
    dht = StandInDht()
    discovery = discovery_over(dht, me)
    directory = DhtExpertDirectory(discovery, SWARM, heartbeat_s=1e-9, ttl_s=10.0)
    records = {(0, 1): ExpertRecord(3, "ab" * 32, True)}
    key = experts_key(SWARM)

    async def scenario() -> None:
        dht.answer = {peers_key(SWARM): {subkey(a): peer_record(a, 1)}}  # a is a member, b only a DHT node
        await discovery._refresh_view()
        dht.answer = {key: {subkey(a): encode_expert_records(records), subkey(b): encode_expert_records(records)}}
        found = await directory.read()
        assert found.get(a.peer_id) == records and b.peer_id not in found
        assert discovery.errors.get("expert_records_not_member") == 1
        # once b's record is in the view, its experts are read
        dht.answer = {peers_key(SWARM): {subkey(a): peer_record(a, 1), subkey(b): peer_record(b, 1)}}
        await discovery._refresh_view()
        dht.answer = {key: {subkey(a): encode_expert_records(records), subkey(b): encode_expert_records(records)}}
        assert (await directory.read()).get(b.peer_id) == records
        assert discovery.errors.get("expert_records_not_member") == 1

    asyncio.run(scenario())


def sharded_discovery(dht: StandInDht, me: Identity, a: Identity, b: Identity) -> tuple[Discovery, int]:
    """A Discovery entered into a swarm whose per-peer keys are split so that `a` and `b` sit in different
    shards (the fewest shards that do), as `enter` sets it from the config."""
    shards = next(n for n in range(2, 17) if peer_shard(a.peer_id, n) != peer_shard(b.peer_id, n))
    discovery = discovery_over(dht, me)
    discovery._membership.shards = shards
    return discovery, shards


def test_a_sharded_view_reads_every_shard_and_a_failed_shard_keeps_only_its_own_peers(ids) -> None:
    """`<swarm>.peers` split over shards (issues 24 and 26: no key outgrows what a DHT node answers): each
    peer's record is in its own shard's key, the view is the union of all shards, and a shard whose read
    fails keeps its peers of the last view while the others' changes are taken."""
    me, a, b = ids["me"], ids["a"], ids["b"]
    dht = StandInDht()
    discovery, shards = sharded_discovery(dht, me, a, b)
    key = ShardedKey(peers_key(SWARM), shards)
    assert len(set(key.shard_keys())) == shards and peers_key(SWARM) not in key.shard_keys()

    async def read(answer: Mapping[str, Mapping[bytes, bytes] | Exception] | Exception) -> dict[str, int]:
        dht.answer = answer
        await discovery._refresh_view()
        return {p.peer_id: p.step for p in discovery.view()}

    async def scenario() -> None:
        both = {key.key_of(a.peer_id): {subkey(a): peer_record(a, 5)}, key.key_of(b.peer_id): {subkey(b): peer_record(b, 7)}}
        assert await read(both) == {me.peer_id: 0, a.peer_id: 5, b.peer_id: 7}
        assert dht.gets == shards  # one read of each shard
        # a's shard fails, b's moves on: a is kept as last read, b's new step is taken
        moved = {key.key_of(a.peer_id): ConnectionError("down"), key.key_of(b.peer_id): {subkey(b): peer_record(b, 9)}}
        assert await read(moved) == {me.peer_id: 0, a.peer_id: 5, b.peer_id: 9}
        assert discovery.errors.get("dht_get_failed") == 1
        # b's shard answers empty: b is gone; a's shard still fails: a stays
        gone = {key.key_of(a.peer_id): ConnectionError("down"), key.key_of(b.peer_id): {}}
        assert await read(gone) == {me.peer_id: 0, a.peer_id: 5}
        # every shard failing keeps the whole view, as an unsharded key's failed read does
        assert await read(RuntimeError("boom")) == {me.peer_id: 0, a.peer_id: 5}
        # a record under the unsharded key is not where a sharded swarm looks
        assert await read({peers_key(SWARM): {subkey(a): peer_record(a, 6)}}) == {me.peer_id: 0}

    asyncio.run(scenario())


def test_a_sharded_spes_directory_keeps_a_failed_shards_peers_and_forgets_an_empty_shards(ids) -> None:
    me, a, b = ids["me"], ids["a"], ids["b"]
    dht = StandInDht()
    discovery, shards = sharded_discovery(dht, me, a, b)
    directory = DhtExpertDirectory(discovery, SWARM, heartbeat_s=1e-9, ttl_s=10.0)
    peers, experts = ShardedKey(peers_key(SWARM), shards), ShardedKey(experts_key(SWARM), shards)
    records = {(0, 1): ExpertRecord(3, "ab" * 32, True)}

    async def scenario() -> None:
        dht.answer = {peers.key_of(a.peer_id): {subkey(a): peer_record(a, 1)},
                      peers.key_of(b.peer_id): {subkey(b): peer_record(b, 1)}}
        await discovery._refresh_view()
        dht.answer = {experts.key_of(a.peer_id): {subkey(a): encode_expert_records(records)},
                      experts.key_of(b.peer_id): {subkey(b): encode_expert_records(records)}}
        found = await directory.read()
        assert found.get(a.peer_id) == records and found.get(b.peer_id) == records
        dht.answer = {experts.key_of(a.peer_id): ConnectionError("down"), experts.key_of(b.peer_id): {}}
        found = await directory.read()
        assert found.get(a.peer_id) == records and b.peer_id not in found  # a's shard kept, b's emptied

    asyncio.run(scenario())


def test_a_shard_near_the_dht_response_limit_is_warned_of_once(ids, caplog: pytest.LogCaptureFixture) -> None:
    me, a, b = ids["me"], ids["a"], ids["b"]
    dht = StandInDht()
    discovery, shards = sharded_discovery(dht, me, a, b)
    key = ShardedKey(peers_key(SWARM), shards)
    # values the validators would refuse (the stand-in validates nothing): only their size counts here
    stuffed = {key.key_of(a.peer_id): {f"filler {i}".encode(): b"x" * (64 << 10) for i in range(40)}}

    async def scenario() -> None:
        for _ in range(2):
            dht.answer = stuffed
            await discovery._refresh_view()

    with caplog.at_level("WARNING", logger="node.net.discovery"):
        asyncio.run(scenario())
    warned = [r.getMessage() for r in caplog.records if "membership-shards" in r.getMessage()]
    assert len(warned) == 1 and key.key_of(a.peer_id) in warned[0]
    assert discovery.errors.get("dht_shard_near_limit") == 1


class AskingDht(StandInDht):
    """A stand-in that, like hivemind's DHTNode.get, asks each of its peers through
    `_call_find_with_blacklist` (None: that peer did not answer) and reports None both when they had
    nothing and when none answered. `peers` maps each to what it holds (key -> entries), or None when it
    does not answer (unreachable, or its value over p2pd's message limit)."""

    def __init__(self) -> None:
        super().__init__()
        self.peers: dict[str, Mapping[str, Mapping[bytes, bytes]] | None] = {}

    async def _call_find_with_blacklist(self, peer: str, keys: list[DHTID]) -> dict[DHTID, object] | None:
        held = self.peers[peer]
        return None if held is None else {key: held for key in keys}

    async def get(self, key: str, latest: bool = False) -> ValueWithExpiration | None:
        self.gets += 1
        found: dict[bytes, bytes] = {}
        for peer in self.peers:
            response = await self._call_find_with_blacklist(peer, [DHTID.generate(source=key)])
            if response is not None:
                found.update(self.peers[peer].get(key, {}))  # type: ignore[union-attr]
        if not found:
            return None
        expires = get_dht_time() + 30
        return ValueWithExpiration({s: ValueWithExpiration(v, expires) for s, v in found.items()}, expires)


def test_a_read_no_dht_peer_answered_keeps_the_view_and_is_counted_one_they_answered_empty_empties_it(ids) -> None:
    me, a, b = ids["me"], ids["a"], ids["b"]
    dht = AskingDht()
    discovery = discovery_over(dht, me)
    live = {peers_key(SWARM): {subkey(a): peer_record(a, 5), subkey(b): peer_record(b, 7)}}

    async def view(peers: dict[str, Mapping[str, Mapping[bytes, bytes]] | None]) -> set[str]:
        dht.peers = peers
        await discovery._refresh_view()
        return {p.peer_id for p in discovery.view()}

    async def scenario() -> None:
        everyone = {me.peer_id, a.peer_id, b.peer_id}
        assert await view({"r1": live, "r2": None}) == everyone
        # every replica fails (e.g. the value grew past the response limit): hivemind finds "nothing"
        assert await view({"r1": None, "r2": None}) == everyone
        assert discovery.errors.get("dht_get_unanswered") == 1
        assert await discovery.read_owned(ShardedKey(experts_key(SWARM)), what="expert records") is None
        assert discovery.errors.get("dht_get_unanswered") == 2
        # a replica that answers with nothing is an answer: the peers are gone
        assert await view({"r1": {}, "r2": None}) == {me.peer_id}
        assert discovery.errors.get("dht_get_unanswered") == 2
        # a node with no DHT peer to ask has only itself to go by
        assert await view({"r1": live}) == everyone
        assert await view({}) == {me.peer_id} and discovery.errors.get("dht_get_unanswered") == 2

    asyncio.run(scenario())


def test_background_reads_of_a_big_view_are_spaced_to_the_membership_budget(ids) -> None:
    """Every node reads the whole membership: a big swarm's view is read less often than every half
    heartbeat, so the reads (and hivemind's store-backs) cost about MEMBERSHIP_BUDGET_MBIT_S each way; a
    small one's as before."""
    me, a, b = ids["me"], ids["a"], ids["b"]
    dht = StandInDht()
    discovery = discovery_over(dht, me)
    refresh = discovery._settings.refresh_s

    async def scenario() -> tuple[float, float]:
        dht.answer = {peers_key(SWARM): {subkey(a): peer_record(a, 1), subkey(b): peer_record(b, 1)}}
        await discovery._refresh_view()
        small = discovery.read_interval_s()
        # values the validators would refuse (the stand-in validates nothing): only their size counts here
        dht.answer = {peers_key(SWARM): {f"filler {i}".encode(): b"x" * 1000 for i in range(2000)}}
        await discovery._refresh_view()
        return small, discovery.read_interval_s()

    small, big = asyncio.run(scenario())
    assert small == refresh
    read = sum(1000 + len(f"filler {i}") for i in range(2000))
    assert big == pytest.approx(read * 8 / (MEMBERSHIP_BUDGET_MBIT_S * 1e6)) and big > refresh



def test_a_stop_during_a_view_read_ends_the_read_even_when_the_dht_closes_under_it(ids) -> None:
    """Discovery.close() marks the node closed and cancels its reads. A read whose per-shard tasks start
    after that must end cancelled, not as one more failed read the loop retries for ever (a TaskGroup
    gives its tasks' errors priority over a cancel of its own task): close() awaits the loop."""
    me, a, b = ids["me"], ids["a"], ids["b"]
    dht = StandInDht()
    discovery, shards = sharded_discovery(dht, me, a, b)

    async def scenario() -> None:
        reading = asyncio.create_task(discovery._read_shards(ShardedKey(peers_key(SWARM), shards), "reading"))
        await asyncio.sleep(0)  # the read has made its per-shard tasks; they have not run yet
        discovery._closed = True
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(reading, 5)
        # the loop that reads the view ends once the node is closed
        await asyncio.wait_for(discovery._watch_loop(), 5)

    asyncio.run(scenario())
