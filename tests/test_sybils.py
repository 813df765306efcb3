"""Sybil defences in process (docs/threat-model.md, "Sybils"): an open swarm's proof of work per identity
(node.net.work) and its check on records, the view's cap by standing and recency (node.net.view), and a
joiner's votes and sources from distinct networks (node.swarm.prefixes). Whole processes under a flood
of sybil records: test_sybils_swarm.py."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from node.net.records import PeerRecord, decode_peer_entry, encode_peer_record
from node.net.view import FirstSeen, cap_view
from node.net.work import MAX_NONCE_CHARS, cache_path_for, cached_work, check_work, identity_work_bits, mint_work
from node.swarm.joining import Refused, judge_steps
from node.swarm.prefixes import address_prefix, one_per_prefix, record_prefixes

pytestmark = pytest.mark.unit

BITS = 10  # ~1000 hashes: fast, and a random nonce passes with probability 2^-10
PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


# ---- proof of work ----------------------------------------------------------------------------------

def test_a_minted_proof_holds_for_its_swarm_and_peer_only() -> None:
    nonce = mint_work("swarm", "QmPeer", BITS)
    assert check_work("swarm", "QmPeer", nonce, BITS)
    assert check_work("swarm", "QmPeer", nonce, BITS - 3)  # serves a lower difficulty too
    assert not check_work("other", "QmPeer", nonce, BITS) or not check_work("swarm", "QmOther", nonce, BITS)
    wrong = [check_work("other", "QmPeer", mint_work("swarm", "QmPeer", BITS), BITS) for _ in range(8)]
    assert sum(wrong) <= 1, "a proof for one swarm works in another"
    stolen = [check_work("swarm", "QmThief", mint_work("swarm", "QmPeer", BITS), BITS) for _ in range(8)]
    assert sum(stolen) <= 1, "a proof for one peer id works for another"


def test_a_missing_malformed_or_oversized_nonce_is_no_proof() -> None:
    nonce = mint_work("swarm", PEER, BITS)
    assert not check_work("swarm", PEER, "", BITS)
    assert not check_work("swarm", "QmPeer", "zz" * 8, BITS)
    assert not check_work("swarm", "QmPeer", "0" + nonce, BITS)  # odd length
    assert not check_work("swarm", "QmPeer", nonce + "00" * 100, BITS)  # over the bound: not even hashed
    assert check_work("swarm", "QmPeer", "", 0)  # a swarm that asks for none
    # the record's field is bounded by its schema: a longer nonce makes the record malformed
    record = PeerRecord(peer_id=PEER, maddrs=(f"/ip4/1.2.3.4/tcp/1/p2p/{PEER}",), step=0, round=0, experts=(),
                        capacity=0, version="t", heartbeat=1.0, work="ab" * (MAX_NONCE_CHARS // 2 + 1))
    with pytest.raises(ValueError, match="malformed"):
        decode_peer_entry(encode_peer_record(record))
    assert decode_peer_entry(encode_peer_record(msgspec.structs.replace(record, work=nonce))).work == nonce


def test_the_proof_is_minted_once_per_identity_and_swarm(tmp_path: Path) -> None:
    identity = tmp_path / "identity.key"
    first = cached_work(identity, "swarm", "QmPeer", BITS)
    assert check_work("swarm", "QmPeer", first, BITS)
    assert cached_work(identity, "swarm", "QmPeer", BITS) == first  # a restart does not mint again
    other = cached_work(identity, "second", "QmPeer", BITS)
    assert check_work("second", "QmPeer", other, BITS) and cached_work(identity, "swarm", "QmPeer", BITS) == first
    cache_path_for(identity).write_text("not json")
    assert check_work("swarm", "QmPeer", cached_work(identity, "swarm", "QmPeer", BITS), BITS)


def test_the_config_says_how_much_work_and_a_bad_value_asks_none() -> None:
    assert identity_work_bits({"identity_work": 12}) == 12
    assert identity_work_bits({}) == 0
    assert identity_work_bits({"identity_work": True}) == 0
    assert identity_work_bits({"identity_work": 99}) == 0


def test_an_old_document_without_the_field_keeps_its_hash_and_asks_no_work() -> None:
    from node.net.records import config_hash
    from node.swarm.recipe import RecipeInvalid, document_dict, parse_document
    from tests.test_recipe import MODEL_DOC

    assert "identity_work" not in MODEL_DOC and parse_document(MODEL_DOC).identity_work == 0
    assert config_hash(document_dict(parse_document(MODEL_DOC))) == config_hash(MODEL_DOC)

    with pytest.raises(RecipeInvalid, match="identity_work"):
        parse_document({**MODEL_DOC, "identity_work": 33})


def test_discovery_leaves_records_without_the_swarms_proof_out_of_the_view_and_counts_them(tmp_path: Path) -> None:
    from hivemind.dht.crypto import RSASignatureValidator

    from node.net.discovery import Discovery, DiscoverySettings
    from node.net.identity import create_identity

    me = create_identity(tmp_path / "me.key")
    peer = create_identity(tmp_path / "peer.key")
    discovery = Discovery(None, me, DiscoverySettings("sybils"),  # type: ignore[arg-type]
                          data_maddrs=(f"/ip4/127.0.0.1/tcp/1/p2p/{me.peer_id}",))
    discovery._work_bits = BITS
    subkey = RSASignatureValidator(peer.signing_key).local_public_key
    record = PeerRecord(peer_id=peer.peer_id, maddrs=(f"/ip4/1.2.3.4/tcp/1/p2p/{peer.peer_id}",), step=0, round=0,
                        experts=(), capacity=0, version="t", heartbeat=1.0)
    assert discovery._live_record(subkey, encode_peer_record(record), 1e12, 0.0) is None
    assert discovery.errors["peer_record_no_work"] == 1
    paid = msgspec.structs.replace(record, work=mint_work("sybils", peer.peer_id, BITS))
    assert discovery._live_record(subkey, encode_peer_record(paid), 1e12, 0.0) == paid
    other_swarm = msgspec.structs.replace(record, work=mint_work("elsewhere", peer.peer_id, BITS + 4))
    if not check_work("sybils", peer.peer_id, other_swarm.work, BITS):
        assert discovery._live_record(subkey, encode_peer_record(other_swarm), 1e12, 0.0) is None
        assert discovery.errors["peer_record_no_work"] == 2


# ---- the view's cap ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rec:
    step: int = 0
    gossip_from: int = 0
    round: int = 0


def test_the_view_cap_keeps_standing_peers_and_admits_a_newcomer_past_a_flood_in_the_view() -> None:
    honest = {f"honest{i}": Rec(step=10 + i) for i in range(5)}  # training: no claim to serve needed
    # a flood that claims to serve, at a constant step: no standing
    sybils = {f"sybil{i:03d}": Rec(step=10**9, gossip_from=1) for i in range(300)}
    # the flood already fills the view, seen before the honest peers (the worst case for them)
    seen = {p: FirstSeen(1.0, 10**9) for p in sybils} | {p: FirstSeen(2.0, 9) for p in honest}
    view = {*honest, *list(sybils)[:250]}
    rng = random.Random(0)
    entered = 0
    for _ in range(20):
        kept, left_out = cap_view({**honest, **sybils, "new": Rec()}, "honest0", view, seen, 256, "swarm", rng)
        assert len(kept) == 256 and left_out == 306 - 256
        assert set(honest) <= set(kept), "a progressing peer lost its place to record-only identities"
        entered += "new" in kept
    assert entered == 20, "a newcomer never got past 250 record-only identities in the view"


def test_identities_claiming_progress_stand_after_the_older_standing_peers_and_leave_newcomers_a_share() -> None:
    # (a claim that rises with every heartbeat: each record re-signed each time)
    liars = {f"liar{i:03d}": Rec(step=6, gossip_from=1) for i in range(400)}
    honest = {f"honest{i}": Rec(step=6) for i in range(3)}
    newcomers = {f"new{i:02d}": Rec() for i in range(10)}
    seen = {p: FirstSeen(5.0, 5) for p in liars} | {p: FirstSeen(1.0, 5) for p in honest}
    kept, _ = cap_view({**liars, **honest, **newcomers, "me": Rec()}, "me", set(liars) | set(honest), seen, 40,
                       "swarm", random.Random(1))
    assert len(kept) == 40 and "me" in kept
    assert set(honest) <= set(kept), "identities claiming progress pushed out peers that stood before them"
    assert set(newcomers) <= set(kept), "identities claiming progress took the newcomers' share"


def test_a_member_that_has_not_progressed_yet_keeps_its_place_and_a_newcomers_progress_counts_from_first_sight() \
        -> None:
    # a member seen before the flood but not yet progressing (waiting for a quorum) outranks later identities
    member = {"member": Rec()}
    flood = {f"f{i}": Rec(step=3) for i in range(10)}
    seen = {"member": FirstSeen(0.0, 0)} | {p: FirstSeen(5.0, 3) for p in flood}
    kept, left_out = cap_view({**member, **flood, "me": Rec()}, "me", {"member", *flood}, seen, 8, "swarm",
                              random.Random(2))
    assert "member" in kept and left_out == 4
    # a newcomer left out of the view earlier stands once its step rose since this node first saw it
    grown = {"new": Rec(step=2), **flood, "me": Rec()}
    kept, _ = cap_view(grown, "me", set(flood), {"new": FirstSeen(9.0, 1)} | seen, 4, "swarm", random.Random(3))
    assert "new" in kept
    # a claim to serve at a constant step costs nothing to hold: it does not stand; a rising round does
    peers = {"claims": Rec(step=1, gossip_from=1), "gossips": Rec(round=7), "me": Rec()}
    at = {"claims": FirstSeen(0.0, 1), "gossips": FirstSeen(9.0, 0, 1)}
    assert set(cap_view(peers, "me", set(peers), at, 2, "swarm", random.Random(4))[0]) == {"me", "gossips"}
    assert cap_view({"a": Rec(), "b": Rec()}, "a", set(), {}, 10, "swarm", random.Random(5)) == \
        ({"a": Rec(), "b": Rec()}, 0)


# ---- distinct networks ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Peer:
    peer_id: str
    maddrs: tuple[str, ...]
    step: int = 0


def test_addresses_are_grouped_by_their_24_or_48_and_a_relay_circuit_by_the_relays() -> None:
    assert address_prefix("/ip4/203.0.113.7/tcp/1/p2p/Qm") == "203.0.113.0/24"
    assert address_prefix("/ip6/2001:db8:1:2::5/udp/1/quic-v1/p2p/Qm") == "2001:db8:1::/48"
    assert address_prefix("/ip4/198.51.100.1/tcp/4001/p2p/QmRelay/p2p-circuit/p2p/Qm") == "198.51.100.0/24"
    assert address_prefix("/dns4/Example.org/tcp/1/p2p/Qm") == "dns:example.org"
    assert address_prefix("/ip4/999.1.1.1/tcp/1") is None and address_prefix("garbage") is None
    assert record_prefixes(["/ip4/10.0.0.1/tcp/1", "/ip4/10.0.0.9/udp/1"]) == {"10.0.0.0/24"}


def test_one_peer_per_network_is_kept_and_loopback_only_swarms_keep_every_peer() -> None:
    a = Peer("a", ("/ip4/203.0.113.7/tcp/1/p2p/a",))
    b = Peer("b", ("/ip4/203.0.113.8/tcp/1/p2p/b",))  # a's /24
    c = Peer("c", ("/ip4/198.51.100.1/tcp/1/p2p/c", "/ip4/203.0.113.9/tcp/1/p2p/c"))  # shares a's too
    d = Peer("d", ("/ip6/2001:db8:2::1/tcp/1/p2p/d",))
    assert one_per_prefix([a, b, c, d]) == ([a, d], [b, c])
    local = [Peer(p, (f"/ip4/127.0.0.1/tcp/{i}/p2p/{p}",)) for i, p in enumerate("xyz")]
    assert one_per_prefix(local) == (local, [])
    assert one_per_prefix([*local, d]) == ([local[0], d], local[1:])  # one real address turns it on


def test_two_identities_on_one_network_claiming_the_reference_step_count_once() -> None:
    def rec(peer: str, step: int, ip: str) -> PeerRecord:
        return PeerRecord(peer_id=peer, maddrs=(f"/ip4/{ip}/tcp/1/p2p/{peer}",), step=step, round=0, experts=(),
                          capacity=0, version="t", heartbeat=1.0)

    honest = [rec("me", 0, "192.0.2.1"), rec("h1", 100, "203.0.113.1"), rec("h2", 101, "198.51.100.1")]
    # one operator's two identities claim the reference step (candidates near it rank first as sources)
    sybils = [rec("s1", 101, "100.64.0.1"), rec("s2", 101, "100.64.0.2")]
    judgement = judge_steps([*honest, *sybils], "me", 0, margin=5, budget=0)
    assert judgement is not None and judgement.reference == 101
    assert {r.peer_id for r in judgement.candidates[:3]} == {"h1", "h2", "s1"}
    assert judgement.refusals()["s2"] == Refused.SAME_PREFIX
    # the control: the same claims from two networks take 2 of the 3 sources
    apart = [rec("s1", 101, "100.64.0.1"), rec("s2", 101, "100.65.0.2")]
    control = judge_steps([*honest, *apart], "me", 0, margin=5, budget=0)
    assert control is not None and {r.peer_id for r in control.candidates} == {"h1", "h2", "s1", "s2"}
    assert "s2" not in control.refusals()
