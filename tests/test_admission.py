"""Swarm identity and admission without a network: invites, the founder's signed config, membership
certificates, swarm-key proofs (right key, wrong key, replayed for another peer id), the swarm key file,
and the gossip and SPES protocols refusing non-members over the in-memory transport."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from gossip.codecs import get_codec
from gossip.errors import NotMember
from gossip.exchange import ExchangeSettings, GossipPeer, PeerRejected
from gossip.memory import InMemoryNetwork
from gossip.wire import Header, HeaderFields
from node.config import NodeConfig, TrainingConfig
from node.net.admission import (
    MEMBER_META,
    PROOF_META,
    Admission,
    SwarmKeyError,
    create_swarm_key,
    key_check,
    load_swarm_key,
    read_certificate,
    record_proof,
    stream_proof,
)
from node.net.founder import (
    ConfigRefusal,
    ConfigRefused,
    NotAdmitted,
    issue_certificate,
    parse_certificate,
    parse_invite,
    sign_config,
    verify_config,
    verify_membership,
)
from node.net.identity import Identity, create_identity
from node.runtime.founding import swarm_document
from topology import MembershipView, build_topology, peer_round

pytestmark = pytest.mark.unit

SWARM = "adm"
KEY = b"0123456789abcdef" * 4
DOC = swarm_document(NodeConfig(training=TrainingConfig(model="vector"), dim=8), epoch=1.0)


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Identity]:
    directory = tmp_path_factory.mktemp("ids")
    return {name: create_identity(directory / f"{name}.key") for name in ("founder", "a", "b", "stranger")}


# ---- invites ------------------------------------------------------------------------------------


def test_an_invite_names_the_swarm_and_its_founder(ids):
    founder = ids["founder"].peer_id
    invite = parse_invite(f" my.swarm-1@{founder}\n")
    assert (invite.swarm, invite.founder, str(invite)) == ("my.swarm-1", founder, f"my.swarm-1@{founder}")


@pytest.mark.parametrize("text, problem", [
    ("myswarm", "is not an invite: expected NAME@FOUNDER_PEER_ID"),
    ("@QmYnxgpEdmYVuTF64A6NX13npKSBp2dV21p5PQmbjAJpkS", "is not an invite"),
    ("myswarm@", "is not an invite"),
    ("my swarm@QmYnxgpEdmYVuTF64A6NX13npKSBp2dV21p5PQmbjAJpkS", "invalid swarm name"),
    ("myswarm@not-a-peer-id", "is not a peer id"),
    ("myswarm@QmYnxgpEdmYVuTF64A6NX13npKSBp2dV21p5PQmbjAJpk0", "is not a peer id"),  # 0 is not base58
    ("myswarm@1111111111111111111111111", "not a base58 multihash"),
])
def test_a_bad_invite_says_what_is_wrong(text, problem):
    with pytest.raises(ValueError, match=problem):
        parse_invite(text)


def test_the_cli_takes_the_invite_and_refuses_a_contradiction(ids, tmp_path):
    from node.cli.main import parse_node_config
    from node.config import ConfigError

    peer = f"/ip4/127.0.0.1/tcp/1/p2p/{ids['a'].peer_id}"
    founder = ids["founder"].peer_id
    base = ["join", "--peers", peer, "--data-dir", str(tmp_path)]
    config = parse_node_config([*base, "--invite", f"s1@{founder}"], {})
    assert (config.swarm, config.founder) == ("s1", founder)
    assert parse_node_config([*base, "--invite", f"s1@{founder}", "--swarm", "s1"], {}).swarm == "s1"
    assert parse_node_config(base, {"MURMUR_INVITE": f"s2@{founder}"}).swarm == "s2"
    with pytest.raises(ConfigError, match=r"--swarm: 's2' differs from the invite's 's1' \(--invite\)"):
        parse_node_config([*base, "--invite", f"s1@{founder}", "--swarm", "s2"], {})
    with pytest.raises(ConfigError, match="--founder: .* differs from the invite's"):
        parse_node_config([*base, "--invite", f"s1@{founder}", "--founder", ids["a"].peer_id], {})
    with pytest.raises(ConfigError, match="--invite: unknown invite 'nope'"):
        parse_node_config([*base, "--invite", "nope"], {})


# ---- the signed config --------------------------------------------------------------------------


def test_the_founders_signed_config_is_verified_and_pinned(ids):
    f, s = ids["founder"], ids["stranger"]
    signed = sign_config(f.signing_key, SWARM, 4, DOC)
    got = verify_config(signed.signed, SWARM, f.peer_id)
    assert (got.config, got.version, got.founder, got.config_hash) == (DOC, 4, f.peer_id, signed.config_hash)
    assert verify_config(signed.signed, SWARM, None).founder == f.peer_id  # no pin: whoever signed it
    cases = [
        (sign_config(s.signing_key, SWARM, 5, DOC).signed, f.peer_id, ConfigRefusal.NOT_FOUNDER),
        (signed.signed, s.peer_id, ConfigRefusal.NOT_FOUNDER),
        (sign_config(f.signing_key, "other", 4, DOC).signed, f.peer_id, ConfigRefusal.WRONG_SWARM),
        (b"plain", f.peer_id, ConfigRefusal.MALFORMED),
        ("not bytes", f.peer_id, ConfigRefusal.MALFORMED),
    ]
    envelope = msgspec.msgpack.decode(signed.signed)
    # a replica that changes the version, the document or the key the founder signed with
    for field, value in (("version", 5), ("config", signed.signed[:10]),
                         ("founder_key", s.signing_key.get_public_key().to_bytes())):
        cases.append((msgspec.msgpack.encode({**envelope, field: value}), None, ConfigRefusal.BAD_SIGNATURE))
    for value, founder, reason in cases:
        with pytest.raises(ConfigRefused) as refused:
            verify_config(value, SWARM, founder)
        assert refused.value.reason is reason, (value[:40], refused.value)


def test_the_config_hash_is_the_documents_whatever_its_version(ids):
    one = sign_config(ids["founder"].signing_key, SWARM, 1, DOC)
    two = sign_config(ids["founder"].signing_key, SWARM, 2, DOC)
    assert one.config_hash == two.config_hash and one.signed != two.signed
    with pytest.raises(ValueError, match="version 0 outside"):
        sign_config(ids["founder"].signing_key, SWARM, 0, DOC)


# ---- membership certificates -------------------------------------------------------------------


def test_a_certificate_admits_exactly_its_peer_in_its_swarm_until_it_expires(ids):
    f, a, b = ids["founder"], ids["a"], ids["b"]
    founder_key = f.signing_key.get_public_key().to_bytes()
    expires = int(time.time()) + 60
    certificate = issue_certificate(f.signing_key, SWARM, a.peer_id, expires)
    verify_membership(certificate.token, SWARM, a.peer_id, founder_key)  # valid
    assert parse_certificate(certificate.text) == certificate
    refusals = {
        "wrong founder": (issue_certificate(b.signing_key, SWARM, a.peer_id, expires).token, a.peer_id, "bad_signature"),
        "wrong peer": (certificate.token, b.peer_id, "bad_signature"),
        "wrong swarm": (issue_certificate(f.signing_key, "other", a.peer_id, expires).token, a.peer_id,
                        "bad_signature"),
        "expired": (issue_certificate(f.signing_key, SWARM, a.peer_id, int(time.time()) - 1).token, a.peer_id,
                    "expired"),
        "later expiry claimed": (f"{expires + 10**6}.{certificate.signature}", a.peer_id, "bad_signature"),
        "malformed": ("garbage", a.peer_id, "malformed"),
        "missing": (None, a.peer_id, "malformed"),
    }
    for what, (token, peer, reason) in refusals.items():
        with pytest.raises(NotAdmitted) as refused:
            verify_membership(token, SWARM, peer, founder_key)
        assert refused.value.reason == reason, what
    with pytest.raises(NotAdmitted, match="expired"):
        verify_membership(certificate.token, SWARM, a.peer_id, founder_key, now=expires + 1)


def test_a_certificate_file_is_checked_for_this_node(ids, tmp_path):
    f, a, b = ids["founder"], ids["a"], ids["b"]
    founder_key = f.signing_key.get_public_key().to_bytes()
    path = tmp_path / "a.cert"
    path.write_text(issue_certificate(f.signing_key, SWARM, a.peer_id, 2**35).text)
    certificate = read_certificate(path)
    assert Admission.with_allowlist(SWARM, f.peer_id, founder_key, a.peer_id, certificate).credentials(
        _fields(a.peer_id)) == {MEMBER_META: certificate.token}
    with pytest.raises(NotAdmitted, match=f"for peer {a.peer_id} in swarm 'adm', not for this node"):
        Admission.with_allowlist(SWARM, f.peer_id, founder_key, b.peer_id, certificate)
    with pytest.raises(NotAdmitted, match="admits only peers with a certificate"):
        Admission.with_allowlist(SWARM, f.peer_id, founder_key, b.peer_id, None)
    assert Admission.with_allowlist(SWARM, f.peer_id, founder_key, f.peer_id, None).credentials(_fields(f.peer_id)) == {}
    path.write_text("something else")
    with pytest.raises(ValueError, match="not a murmur membership certificate"):
        read_certificate(path)


# ---- swarm-key proofs ---------------------------------------------------------------------------


def _fields(peer: str, **changes: object) -> HeaderFields:
    fields: HeaderFields = {"swarm": SWARM, "config_hash": "c0ffee", "sender": peer, "round": 7, "step": 3,
                            "kind": "pull"}
    return {**fields, **changes}  # type: ignore[return-value, typeddict-item]


def _header(fields: HeaderFields, meta: dict) -> Header:
    return Header(version=1, codec="fp32", codec_opts={}, manifest=(), meta=meta, **fields)


def test_key_proofs_hold_for_the_right_key_and_this_peer_only(ids):
    a, b = ids["a"].peer_id, ids["b"].peer_id
    admission = Admission.with_key(SWARM, KEY, key_check(KEY, SWARM))
    now = time.time()
    admission.check_record(a, now, record_proof(KEY, SWARM, a, now))  # right key
    for credential, peer in ((record_proof(b"w" * 64, SWARM, a, now), a),  # wrong key
                             (record_proof(KEY, SWARM, a, now), b),  # replayed for another peer id
                             (record_proof(KEY, "other", a, now), a),  # another swarm's
                             ("é" * 64, a),  # characters compare_digest refuses to compare as str
                             ("", a), (None, a)):
        with pytest.raises(NotAdmitted):
            admission.check_record(peer, now, credential)
    fields = _fields(a)
    meta = admission.credentials(fields)
    assert set(meta) == {PROOF_META} and KEY.decode() not in str(meta)
    admission.admit(_header(fields, dict(meta)))
    for changed in ({"sender": b}, {"round": 8}, {"kind": "exchange"}, {"config_hash": "other"}):
        with pytest.raises(NotMember, match="proves another key"):  # a proof is for one sender, round, kind, config
            admission.admit(_header(_fields(a, **changed), dict(meta)))
    with pytest.raises(NotMember, match="proves no swarm key"):
        admission.admit(_header(fields, {}))
    with pytest.raises(NotMember, match="proves another key"):
        admission.admit(_header(fields, {PROOF_META: "é" * 64}))
    wrong = Admission.with_key(SWARM, b"w" * 64, key_check(b"w" * 64, SWARM))
    with pytest.raises(NotMember):
        admission.admit(_header(fields, dict(wrong.credentials(fields))))
    assert stream_proof(KEY, fields) == meta[PROOF_META]


def test_a_member_given_another_key_learns_it_at_start():
    with pytest.raises(SwarmKeyError, match="this swarm key is not the key of swarm 'adm'"):
        Admission.with_key(SWARM, b"w" * 64, key_check(KEY, SWARM))
    with pytest.raises(SwarmKeyError):
        Admission.with_key(SWARM, KEY, None)


def test_the_swarm_key_file(tmp_path: Path, caplog):
    path = tmp_path / "swarm.key"
    key = create_swarm_key(path)
    assert len(key) == 64 and os.stat(path).st_mode & 0o777 == 0o600
    assert load_swarm_key(path) == key
    with pytest.raises(FileExistsError):
        create_swarm_key(path)
    path.write_bytes(b"short\n")
    with pytest.raises(SwarmKeyError, match="holds 5 bytes; a swarm key has at least 32"):
        load_swarm_key(path)
    with pytest.raises(SwarmKeyError, match="cannot read the swarm key file"):
        load_swarm_key(tmp_path / "missing")
    path.write_bytes(b"x" * 40)
    path.chmod(0o644)
    assert load_swarm_key(path) == b"x" * 40
    assert "readable by other users" in caplog.text


# ---- the protocols refuse non-members ------------------------------------------------------------


def test_gossip_and_pulls_from_a_non_member_are_refused_and_counted(ids):
    """Members of a key swarm exchange and pull as usual; a peer without the key (or with another one) is
    refused with `not_member` from its header, before any tensor is read, and nothing it sends is mixed."""
    members = {ids["a"].peer_id: 1.0, ids["b"].peer_id: 3.0}
    stranger = ids["stranger"].peer_id
    key_admission = Admission.with_key(SWARM, KEY, key_check(KEY, SWARM))
    wrong_key = Admission.with_key(SWARM, b"w" * 64, key_check(b"w" * 64, SWARM))

    def settings(admission) -> ExchangeSettings:
        return ExchangeSettings(swarm=SWARM, config_hash="c0ffee", codec=get_codec("fp32"), exchange_timeout_s=1.0,
                                admission=admission)

    async def main() -> None:
        net = InMemoryNetwork()
        peers = {pid: GossipPeer(net.transport(pid), settings(key_admission), {"w": np.full(4, v, np.float32)})
                 for pid, v in members.items()}
        intruder = GossipPeer(net.transport(stranger), settings(wrong_key), {"w": np.full(4, 1000.0, np.float32)})
        for p in (*peers.values(), intruder):
            await p.start()
        view = MembershipView.of(members)
        topology = build_topology("ring", 2)
        async with asyncio.TaskGroup() as group:
            for pid, p in peers.items():
                group.create_task(p.run_round(0, peer_round(topology, view, pid, 0)))
        for p in peers.values():
            np.testing.assert_array_equal(p.tensors["w"], np.full(4, 2.0, np.float32))  # the members mixed
        # the intruder pulls from a member and offers an exchange: both refused outright
        # (the member's reject does not admit it either: it proves a key the intruder does not hold)
        with pytest.raises((NotMember, PeerRejected)):
            await intruder.fetch(ids["a"].peer_id)
        intruder_view = MembershipView.of([*members, stranger])
        # a directed graph: the intruder pulls from its in-neighbour (a symmetric one would have the larger id
        # wait for requests instead)
        plan = peer_round(build_topology("one-peer-exp", 3), intruder_view, stranger, 1)
        outcome = await intruder.run_round(1, plan)
        assert outcome.mixed_with == () and all("not_member" in why for why in outcome.skipped.values()), outcome
        refused = sum(p.stats.errors["not_member"] for p in peers.values())
        assert refused >= 2, [dict(p.stats.errors) for p in peers.values()]
        for p in peers.values():
            np.testing.assert_array_equal(p.tensors["w"], np.full(4, 2.0, np.float32))  # nothing of it mixed

    asyncio.run(main())


def test_the_spes_fetch_protocol_serves_members_only(ids):
    """An expert copy is served to a member; a non-member's fetch is refused (`not_member`) and counted."""
    from gossip.spes import ExpertRecord, ServedCopy, content_hash
    from gossip.spes.fetch import ExpertFetch, RefreshFailed

    copy = {"w1": np.arange(4, dtype=np.float32)}
    key_admission = Admission.with_key(SWARM, KEY, key_check(KEY, SWARM))
    wrong_key = Admission.with_key(SWARM, b"w" * 64, key_check(b"w" * 64, SWARM))

    class Holder:
        def holds(self, key) -> bool:
            return key == (0, 1)

        async def served_copy(self, key, have=None):
            from gossip.codecs import get_codec as codec

            rounded = {n: codec("bf16").decode(codec("bf16").encode(a), a.size).reshape(a.shape)
                       for n, a in copy.items()}
            return ServedCopy(rounded, ExpertRecord(2, content_hash(list(rounded.values())), True))

    def fetcher(net, pid, admission) -> ExpertFetch:
        settings = ExchangeSettings(swarm=SWARM, config_hash="c0ffee", codec=get_codec("fp32"),
                                    exchange_timeout_s=1.0, admission=admission)
        return ExpertFetch(net.transport(pid), settings, "bf16", lambda: 0)

    async def main() -> None:
        net = InMemoryNetwork()
        owner = fetcher(net, ids["a"].peer_id, key_admission)
        await owner.serve(Holder())
        member = fetcher(net, ids["b"].peer_id, key_admission)
        intruder = fetcher(net, ids["stranger"].peer_id, wrong_key)
        tensors, record = await member.fetch(ids["a"].peer_id, (0, 1), copy, 2)
        assert record.version == 2 and tensors["w1"].shape == (4,)
        with pytest.raises(RefreshFailed):
            await intruder.fetch(ids["a"].peer_id, (0, 1), copy, 2)
        assert owner.stats.errors["not_member"] == 1 and owner.stats.served == 1

    asyncio.run(main())


def test_murmur_invite_writes_the_founders_certificate_or_exits_2(ids, tmp_path, capsys):
    from node.cli.main import main

    founder, a = ids["founder"], ids["a"]
    out = tmp_path / "a.cert"
    assert main(["invite", a.peer_id, "--swarm", SWARM, "--identity", str(founder.path), "--out", str(out),
                 "--valid-days", "2"]) == 0
    certificate = read_certificate(out)
    assert (certificate.swarm, certificate.peer_id) == (SWARM, a.peer_id)
    assert 86400 < certificate.expires - time.time() <= 2 * 86400
    verify_membership(certificate.token, SWARM, a.peer_id, founder.signing_key.get_public_key().to_bytes())
    assert f"murmur join --invite {SWARM}@{founder.peer_id} --certificate FILE" in capsys.readouterr().err
    assert main(["invite", "not-a-peer", "--identity", str(founder.path)]) == 2
    assert main(["invite", a.peer_id, "--data-dir", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("murmur invite: error: 'not-a-peer' is not a peer id")
    assert err[1].startswith("murmur invite: error: no founder identity at") and len(err) == 2
    assert not (tmp_path / "nowhere" / "identity.key").exists()  # it never makes a founder up
