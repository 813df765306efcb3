"""Swarm discovery on hivemind's DHT: peer records (format, ownership), and live swarms of real daemons
on loopback: peers appear, update, withdraw, expire when killed, and cannot be impersonated."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import msgpack
import msgspec
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from node.config import NodeConfig, TrainingConfig
from node.net.discovery import Discovery, DiscoverySettings
from node.net.founder import sign_config
from node.net.identity import ClaimedIdentity, Identity, claim_identity, create_identity
from node.net.proc import create_subprocess_exec
from node.net.records import (
    PeerRecord,
    Withdrawal,
    config_hash,
    decode_peer_entry,
    encode_peer_record,
    encode_withdrawal,
    peers_key,
)
from node.net.transport.p2pd import P2PSettings, start_p2pd
from node.net.validation import make_record_validator
from node.runtime.founding import swarm_document

REPO = Path(__file__).resolve().parents[1]
SWARM = "testswarm"
# real peer ids (base58 multihashes): a record's addresses must parse as multiaddrs
PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
OTHER = "QmcgpsyWgH8Y8ajJz1Cu72KnS5uo2Aa2LpzU7kinSupNKC"
# DHT misses that a loaded machine or a departing peer causes: counted, but no sign of a fault
TRANSIENT_DHT_MISSES = frozenset({"dht_store_rejected", "dht_store_timeout", "dht_get_timeout", "dht_get_unanswered"})


def _record(peer_id: str, **changes: object) -> PeerRecord:
    record = PeerRecord(
        peer_id=peer_id,
        maddrs=(f"/ip4/127.0.0.1/tcp/4001/p2p/{peer_id}",),
        step=12,
        round=3,
        experts=(0, 5, 9),
        capacity=4,
        version="0.1.0",
        heartbeat=1_700_000_000.5,
    )
    return msgspec.structs.replace(record, **changes)


# ---- records and their validation (no network) ---------------------------------------------------


@pytest.mark.unit
def test_peer_record_round_trips() -> None:
    record = _record(PEER)
    assert decode_peer_entry(encode_peer_record(record)) == record
    with_loss = msgspec.structs.replace(record, loss=2.5)
    assert decode_peer_entry(encode_peer_record(with_loss)) == with_loss
    assert decode_peer_entry(encode_withdrawal(PEER)) == Withdrawal(PEER)


@pytest.mark.unit
def test_newer_fields_are_ignored_but_known_ones_checked() -> None:
    fields = msgpack.unpackb(encode_peer_record(_record(PEER)))
    fields["added_in_v2"] = [1, 2]
    assert decode_peer_entry(msgpack.packb(fields)) == _record(PEER)


@pytest.mark.unit
@pytest.mark.parametrize(
    "mutate",
    [
        lambda f: f.update(maddrs=[f"/ip4/127.0.0.1/tcp/4001/p2p/{OTHER}"]),
        lambda f: f.update(maddrs=[]),
        lambda f: f.update(step=-1),
        lambda f: f.update(round=True),
        lambda f: f.update(experts="0,5"),
        lambda f: f.update(experts=[1, -2]),
        lambda f: f.update(heartbeat=float("nan")),
        lambda f: f.pop("version"),
        lambda f: f.update(peer_id=""),
        lambda f: f.update(loss=float("inf")),
        lambda f: f.update(loss="low"),
        lambda f: f.update(maddrs=[f"/ip4/127.0.0.1/tcp/99999/p2p/{PEER}"]),
        lambda f: f.update(maddrs=[f"/ip4/999.1.1.1/tcp/1/p2p/{PEER}"]),
        lambda f: f.update(maddrs=[f"/garbage/1/p2p/{PEER}"]),
        lambda f: f.update(maddrs=[f"/unix/tmp/sock/p2p/{PEER}"]),
    ],
    ids=["foreign-maddr", "no-maddrs", "negative-step", "bool-round", "experts-str", "negative-expert",
         "nan-heartbeat", "no-version", "empty-peer-id", "inf-loss", "str-loss",
         "port-out-of-range", "bad-ip4", "unknown-protocol", "unix-socket"],
)
def test_malformed_peer_records_are_rejected(mutate: Callable[[dict], object]) -> None:
    fields = msgpack.unpackb(encode_peer_record(_record(PEER)))
    mutate(fields)
    with pytest.raises(ValueError):
        decode_peer_entry(msgpack.packb(fields))


@pytest.mark.unit
def test_non_records_are_rejected() -> None:
    for raw in (b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"peer_id": "Qm", "x": b"0" * 70_000})):
        with pytest.raises(ValueError):
            decode_peer_entry(raw)


@pytest.mark.unit
def test_config_hash_ignores_key_order_only() -> None:
    assert config_hash({"model": {"d": 64, "layers": 2}, "lr": 0.1}) == config_hash(
        {"lr": 0.1, "model": {"layers": 2, "d": 64}}
    )
    assert config_hash({"lr": 0.1}) != config_hash({"lr": 0.2})


@pytest.mark.unit
def test_bad_swarm_names_are_refused() -> None:
    for name in ("", "has space", "-lead", "x" * 65, "a/b"):
        with pytest.raises(ValueError):
            DiscoverySettings(swarm=name)


def _owner_subkey(identity: Identity) -> bytes:
    return RSASignatureValidator(identity.signing_key).local_public_key


def _signed(signer: Identity, subkey: bytes, entry: bytes, key: str = peers_key(SWARM)) -> DHTRecord:
    """A DHT record as it travels: serialized subkey and value, value signed by `signer`'s key."""
    record = DHTRecord(
        key=DHTID.generate(source=key).to_bytes(),
        subkey=MSGPackSerializer.dumps(subkey),
        value=MSGPackSerializer.dumps(entry),
        expiration_time=get_dht_time() + 60,
    )
    signature = signer.signing_key.sign(MSGPackSerializer.dumps(dataclasses.astuple(record)))
    return dataclasses.replace(record, value=record.value + b"[signature:" + signature + b"]")


@pytest.fixture(scope="module")
def three_identities(tmp_path_factory: pytest.TempPathFactory) -> tuple[Identity, Identity, Identity]:
    directory = tmp_path_factory.mktemp("identities")
    return tuple(create_identity(directory / f"{name}.key") for name in "abc")  # type: ignore[return-value]


@pytest.mark.unit
def test_validator_accepts_only_what_a_peer_says_about_itself(
    three_identities: tuple[Identity, Identity, Identity],
) -> None:
    a, b, c = three_identities
    validator = make_record_validator(RSASignatureValidator(c.signing_key), SWARM)  # as peer c checks
    b_record = encode_peer_record(_record(b.peer_id))

    assert validator.validate(_signed(b, _owner_subkey(b), b_record))
    assert validator.validate(_signed(b, _owner_subkey(b), encode_withdrawal(b.peer_id)))
    # a forges b's subkey: the signature does not match the key in the subkey.
    assert not validator.validate(_signed(a, _owner_subkey(b), b_record))
    assert not validator.validate(_signed(a, _owner_subkey(b), encode_withdrawal(b.peer_id)))
    # a signs correctly under its own subkey, but claims to be b.
    assert not validator.validate(_signed(a, _owner_subkey(a), b_record))
    # Unowned subkeys and malformed values have no place under <swarm>.peers, nor anywhere else
    # (tests/test_validation.py checks every rule).
    assert not validator.validate(_signed(b, b"no owner here", b_record))
    assert not validator.validate(_signed(b, _owner_subkey(b), b"not a record"))
    assert not validator.validate(_signed(b, b"no owner here", b"anything", key=f"{SWARM}.experts"))


# ---- live swarms (real p2pd on loopback) ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Member:
    claimed: ClaimedIdentity
    p2p: P2P
    discovery: Discovery

    @property
    def peer_id(self) -> str:
        return self.claimed.identity.peer_id

    def view_ids(self) -> list[str]:
        return [record.peer_id for record in self.discovery.view()]

    def record_of(self, peer_id: str) -> PeerRecord | None:
        return next((r for r in self.discovery.view() if r.peer_id == peer_id), None)


@contextlib.asynccontextmanager
async def member(
    identity_path: Path, settings: DiscoverySettings, initial_peers: Sequence[str] = ()
) -> AsyncIterator[Member]:
    with claim_identity(identity_path) as claimed:
        p2p = await start_p2pd(P2PSettings(identity_path=claimed.identity.path, initial_peers=tuple(initial_peers)))
        try:
            discovery = Discovery(p2p, claimed.identity, settings, initial_peers=initial_peers)
            await discovery.start()
            try:
                yield Member(claimed, p2p, discovery)
            finally:
                await discovery.close()
        finally:
            await p2p.shutdown()


async def eventually(condition: Callable[[], bool], timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.05)


@pytest.mark.multiprocess
def test_peers_find_each_other_share_config_and_withdraw_on_close(tmp_path: Path) -> None:
    # A long TTL, so that a peer vanishing quickly can only be its withdrawal.
    settings = DiscoverySettings(swarm=SWARM, heartbeat_s=0.5, ttl_heartbeats=60)
    swarm_config = swarm_document(NodeConfig(training=TrainingConfig(model="vector"), dim=8), epoch=1.0)

    async def scenario() -> None:
        async with contextlib.AsyncExitStack() as stack:
            founder = await stack.enter_async_context(member(tmp_path / "0.key", settings))
            signed = sign_config(founder.claimed.identity.signing_key, SWARM, 1, swarm_config)
            published = await founder.discovery.publish_config(signed)
            bootstrap = founder.discovery.local_record.maddrs
            joiner = await stack.enter_async_context(member(tmp_path / "1.key", settings, bootstrap))
            leaver = await stack.enter_async_context(member(tmp_path / "2.key", settings, bootstrap))
            everyone = sorted(m.peer_id for m in (founder, joiner, leaver))

            await eventually(lambda: all(m.view_ids() == everyone for m in (founder, joiner, leaver)), 10)
            for observer in (founder, joiner):
                for subject in (founder, joiner, leaver):
                    assert observer.record_of(subject.peer_id).maddrs == subject.discovery.local_record.maddrs
                    assert all(a.endswith(f"/p2p/{subject.peer_id}") for a in subject.discovery.local_record.maddrs)

            read = await joiner.discovery.read_config(founder.peer_id)
            fetched = read.config
            assert fetched is not None and read.failed is None and read.founders == {founder.peer_id}
            assert fetched.config_hash == published.config_hash == config_hash(swarm_config)
            assert fetched.config == swarm_config and fetched.version == 1 and fetched.founder == founder.peer_id

            leaver.discovery.update(step=7, round=3, experts=[1, 4])
            await eventually(
                lambda: (r := founder.record_of(leaver.peer_id)) is not None and (r.step, r.round, r.experts)
                == (7, 3, (1, 4)),
                5,
            )

            seen: list[list[str]] = []

            async def watch() -> None:
                async for view in founder.discovery.changes():
                    seen.append([r.peer_id for r in view])

            watcher = asyncio.create_task(watch())
            await asyncio.sleep(0.2)
            await leaver.discovery.close()
            remaining = sorted([founder.peer_id, joiner.peer_id])
            # Well inside the 30 s TTL: the withdrawal, not the expiry, removed it.
            await eventually(lambda: founder.view_ids() == remaining and joiner.view_ids() == remaining, 15)
            await eventually(lambda: seen[-1:] == [remaining], 5)  # the watcher may run a loop pass later
            assert seen[0] == everyone

            await founder.discovery.close()
            async with asyncio.timeout(2):
                await watcher  # the subscription ends with discovery
            # a heartbeat that no DHT peer took, or a DHT call that timed out while the others came and
            # went (or the machine was loaded), is a transient miss: the views above show every record and
            # the withdrawal arrived. Anything else (a refused record or config, a failed read) is an error
            for m in (founder, joiner):
                assert {k: n for k, n in m.discovery.errors.items() if k not in TRANSIENT_DHT_MISSES} == {}

    asyncio.run(scenario())


class _ForgingSigner(RecordValidatorBase):
    """An attacker's DHT node: signs every value with its own key and accepts anything."""

    def __init__(self, attacker: Identity) -> None:
        self._attacker = attacker

    def validate(self, record: DHTRecord) -> bool:
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        signature = self._attacker.signing_key.sign(MSGPackSerializer.dumps(dataclasses.astuple(record)))
        return record.value + b"[signature:" + signature + b"]"


@pytest.mark.multiprocess
def test_a_peer_cannot_publish_records_for_another(tmp_path: Path) -> None:
    # genuine records outlive a loaded machine's late heartbeat: the single read below sees them
    settings = DiscoverySettings(swarm=SWARM, heartbeat_s=0.5, ttl_heartbeats=20)

    async def scenario() -> None:
        async with contextlib.AsyncExitStack() as stack:
            honest = await stack.enter_async_context(member(tmp_path / "0.key", settings))
            bootstrap = honest.discovery.local_record.maddrs
            victim = await stack.enter_async_context(member(tmp_path / "1.key", settings, bootstrap))
            await eventually(lambda: honest.view_ids() == sorted([honest.peer_id, victim.peer_id]), 10)

            attacker = stack.enter_context(claim_identity(tmp_path / "attacker.key")).identity
            p2p = await start_p2pd(P2PSettings(identity_path=attacker.path, initial_peers=bootstrap))
            stack.push_async_callback(p2p.shutdown)
            async with asyncio.timeout(10):
                dht = await DHTNode.create(
                    p2p=p2p, initial_peers=list(bootstrap), record_validator=_ForgingSigner(attacker)
                )
            stack.push_async_callback(dht.shutdown)

            fake_victim = _record(victim.peer_id, maddrs=(f"/ip4/6.6.6.6/tcp/1/p2p/{victim.peer_id}",))
            expiration = get_dht_time() + 120  # newer than any genuine record, so it would win if accepted
            async with asyncio.timeout(10):
                await dht.store(peers_key(SWARM), encode_peer_record(fake_victim), expiration,
                                subkey=_owner_subkey(victim.claimed.identity))
                await dht.store(peers_key(SWARM), encode_withdrawal(victim.peer_id), expiration + 1,
                                subkey=_owner_subkey(victim.claimed.identity))
                await dht.store(peers_key(SWARM), encode_peer_record(fake_victim), expiration,
                                subkey=_owner_subkey(attacker))

            await asyncio.sleep(4 * settings.refresh_s)
            for observer in (honest, victim):
                assert observer.view_ids() == sorted([honest.peer_id, victim.peer_id])
                assert observer.record_of(victim.peer_id).maddrs == victim.discovery.local_record.maddrs

    asyncio.run(scenario())


# A peer in its own process, so that it can be SIGKILLed: joins the swarm, prints its peer id, waits.
PEER_SCRIPT = """
import asyncio, sys
from pathlib import Path
from node.net.discovery import Discovery, DiscoverySettings
from node.net.identity import claim_identity
from node.net.transport.p2pd import P2PSettings, start_p2pd

async def main():
    identity_path, heartbeat_s, ttl_heartbeats, *bootstrap = sys.argv[1:]
    claimed = claim_identity(Path(identity_path))
    p2p = await start_p2pd(P2PSettings(identity_path=claimed.identity.path, initial_peers=tuple(bootstrap)))
    settings = DiscoverySettings(swarm=SWARM, heartbeat_s=float(heartbeat_s), ttl_heartbeats=int(ttl_heartbeats))
    await Discovery(p2p, claimed.identity, settings, initial_peers=bootstrap).start()
    print(claimed.identity.peer_id, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
""".replace("SWARM", repr(SWARM), 1)


@pytest.mark.multiprocess
def test_a_killed_peer_stays_while_alive_and_expires_after_its_ttl(tmp_path: Path) -> None:
    # 6 heartbeats of lifetime: a loaded machine can delay one or two (the record stamps the peer's)
    settings = DiscoverySettings(swarm=SWARM, heartbeat_s=0.5, ttl_heartbeats=6)

    async def scenario() -> None:
        async with member(tmp_path / "0.key", settings) as observer:
            peer = await create_subprocess_exec(
                sys.executable, "-c", PEER_SCRIPT, str(tmp_path / "peer.key"), str(settings.heartbeat_s),
                str(settings.ttl_heartbeats),
                *observer.discovery.local_record.maddrs,
                cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=asyncio.subprocess.PIPE,
            )
            try:
                async with asyncio.timeout(60):
                    peer_id = (await peer.stdout.readline()).decode().strip()
                assert peer_id, "the peer process did not start"
                await eventually(lambda: peer_id in observer.view_ids(), 10)
                # Heartbeats keep it in view well past one TTL.
                await asyncio.sleep(2 * settings.ttl_s)
                assert peer_id in observer.view_ids()

                peer.send_signal(signal.SIGKILL)
                await peer.wait()
                # Gone one TTL after its last heartbeat, plus a view refresh and some slack.
                await eventually(lambda: peer_id not in observer.view_ids(), settings.ttl_s + 10)
            finally:
                if peer.returncode is None:
                    peer.kill()
                    await peer.wait()

    asyncio.run(scenario())
