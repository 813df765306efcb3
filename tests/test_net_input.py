"""No exception from network data stops a node: peer records' addresses are parsed where records are
decoded and validated (random and hostile records end in a record whose every address parses, or in
the declared refusal), dial errors become PeerUnreachable in both transports, a neighbour's stray
error costs only that neighbour (a round, a join download), and supervised background tasks restart."""

from __future__ import annotations

import asyncio
import collections
import shutil
from pathlib import Path
from unittest import mock

import msgpack
import multiaddr
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gossip.codecs import get_codec
from gossip.exchange import ExchangeSettings, GossipPeer, Skip
from gossip.memory import InMemoryNetwork
from gossip.transport import PeerUnreachable
from node.net.hivemind_adapter import maddr_bytes
from node.net.records import (
    MAX_MADDRS,
    BadAddress,
    PeerRecord,
    check_maddr,
    decode_peer_entry,
    encode_peer_record,
)
from node.net.supervise import FAILED, counter_of, supervise
from node.net.transport.libp2p import LibP2PSettings, LibP2PTransport
from node.net.transport.p2pd import P2PDTransport, _transport_part
from node.net.validation import RecordRefusal, RefusalCounts
from node.swarm.joining import JoinRules, Refused, join_swarm, judge_steps
from topology import MembershipView, build_topology, peer_round

pytestmark = pytest.mark.unit

PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
RELAY = "QmcgpsyWgH8Y8ajJz1Cu72KnS5uo2Aa2LpzU7kinSupNKC"
FUZZ = settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
UNPARSEABLE = [f"/ip4/127.0.0.1/tcp/99999/p2p/{PEER}", f"/ip4/999.1.1.1/tcp/1/p2p/{PEER}",
               f"/garbage/1/p2p/{PEER}", f"/ip6/zz::1/tcp/1/p2p/{PEER}", f"/ip4/1.2.3.4/tcp/-1/p2p/{PEER}",
               f"/dns4/exa mple.com/tcp/1/p2p/{PEER}", f"/ip4/1.2.3.4/tcp/1/p2p/{PEER}x"[:-1] + "!"]


# ---- addresses are parsed where records are decoded ------------------------------------------------


def _fields(maddrs: list[object], peer_id: object = PEER) -> dict[str, object]:
    return {"peer_id": peer_id, "maddrs": maddrs, "step": 1, "round": 1, "experts": [], "capacity": 0,
            "version": "t", "heartbeat": 1.0}


def _parses_for_every_dialer(addr: str, peer_id: str) -> bool:
    """The independent oracle: what p2pd's dialer (the binary form of the part before /p2p/<id>) and
    py-libp2p (the multiaddr as a whole) are handed must parse."""
    try:
        multiaddr.Multiaddr(addr).to_bytes()
        maddr_bytes(_transport_part(addr, peer_id))
    except Exception:
        return False
    return True


octet = st.integers(-5, 1000)
port = st.one_of(st.integers(0, 65535), st.integers(-100, 1 << 20))
protocol = st.sampled_from(["ip4", "ip6", "dns4", "dns", "tcp", "udp", "quic-v1", "ws", "p2p", "p2p-circuit",
                            "unix", "onion3", "memory", "garbage", "", "..", "ipfs", "tls", "sni"])
hostile_address = st.one_of(
    st.builds(lambda a, b, c, d, p: f"/ip4/{a}.{b}.{c}.{d}/tcp/{p}/p2p/{PEER}", octet, octet, octet, octet, port),
    st.builds(lambda parts: "/" + "/".join(parts) + f"/p2p/{PEER}",
              st.lists(st.one_of(protocol, st.text(max_size=12), st.integers(-10, 1 << 17).map(str)), max_size=6)),
    st.builds(lambda a, p: f"/ip4/{a}/tcp/{p}/p2p/{RELAY}/p2p-circuit/p2p/{PEER}",
              st.ip_addresses(v=4).map(str), port),
    st.builds(lambda text: text + f"/p2p/{PEER}", st.text(max_size=80)),
    st.text(max_size=120),
    st.sampled_from(UNPARSEABLE),
)
honest_address = st.builds(lambda a, p: f"/ip4/{a}/tcp/{p}/p2p/{PEER}", st.ip_addresses(v=4).map(str),
                           st.integers(0, 65535))
hostile_record = st.builds(
    _fields,
    st.lists(st.one_of(honest_address, hostile_address, st.integers(-(1 << 63), (1 << 64) - 1), st.none(), st.binary(max_size=8)),
             max_size=MAX_MADDRS + 3),
    st.one_of(st.just(PEER), st.text(max_size=10)),
)


def _raw(fields: dict[str, object]) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


@FUZZ
@given(fields=hostile_record)
def test_hostile_records_are_refused_or_every_address_parses(fields: dict[str, object]) -> None:
    try:
        entry = decode_peer_entry(_raw(fields))
    except ValueError:
        return  # the declared refusal (BadAddress among them)
    assert isinstance(entry, PeerRecord)
    assert all(_parses_for_every_dialer(addr, entry.peer_id) for addr in entry.maddrs), entry.maddrs


@FUZZ
@given(raw=st.one_of(st.binary(max_size=300), hostile_record.map(_raw)))
def test_the_swarm_validator_refuses_hostile_records_and_never_raises(raw: bytes) -> None:
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils.serializer import MSGPackSerializer
    from hivemind.utils.timed_storage import get_dht_time

    from node.net.records import peers_key
    from node.net.validation import SwarmMembership, SwarmRules

    refused = RefusalCounts()
    rules = SwarmRules("fuzz", SwarmMembership(), refused)
    record = DHTRecord(DHTID.generate(source=peers_key("fuzz")).to_bytes(), MSGPackSerializer.dumps(b"[owner:PEER]"),
                       MSGPackSerializer.dumps(raw), get_dht_time() + 10.0)
    # the subkey's owner is PEER (its signature is RSASignatureValidator's to check, not this rule's)
    with mock.patch("node.net.validation.owner_peer_id", lambda subkey: PEER):
        accepted = rules.validate(record)  # never raises
    try:
        entry = decode_peer_entry(raw)
    except BadAddress as exc:
        assert not accepted
        reason = RecordRefusal.BAD_ADDRESS if exc.peer_id == PEER else RecordRefusal.NOT_OWNER
        assert refused.counts == {reason: 1}
    except ValueError:
        assert not accepted
        assert sum(refused.counts.values()) == 1 and refused.counts[RecordRefusal.BAD_ADDRESS] == 0
    else:
        assert accepted == (entry.peer_id == PEER)
        assert all(_parses_for_every_dialer(addr, entry.peer_id) for addr in entry.maddrs)


def test_a_record_nested_past_the_stack_is_refused_as_malformed() -> None:
    """msgspec recurses into an unknown field's nesting and raises RecursionError past the stack's depth;
    a record like that, stored in the DHT, once made every view read fail and froze the view."""
    fields = _fields([f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}"]) | {"x": "DEEP"}
    raw = _raw(fields).replace(_raw("DEEP"), b"\x91" * 20_000 + b"\xc0")
    with pytest.raises(ValueError, match="malformed"):
        decode_peer_entry(raw)


@pytest.mark.parametrize("addr", UNPARSEABLE + [f"/unix/tmp/sock/p2p/{PEER}", f"/p2p/{RELAY}/p2p-circuit/p2p/{PEER}",
                                                f"/ip4/1.2.3.4/tcp/1/p2p/{PEER}" + "/" * 600])
def test_an_unparseable_address_refuses_the_whole_record(addr: str) -> None:
    good = f"/ip4/127.0.0.1/tcp/1/p2p/{PEER}"
    with pytest.raises(ValueError):
        decode_peer_entry(_raw(_fields([good, addr])))


@pytest.mark.parametrize("addr", [f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}", f"/ip6/::1/tcp/4001/p2p/{PEER}",
                                  f"/ip4/1.2.3.4/udp/4001/quic-v1/p2p/{PEER}", f"/dns4/example.com/tcp/443/wss/p2p/{PEER}",
                                  f"/ip4/1.2.3.4/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{PEER}"])
def test_addresses_honest_peers_publish_are_kept(addr: str) -> None:
    check_maddr(addr, PEER)
    record = decode_peer_entry(encode_peer_record(PeerRecord(peer_id=PEER, maddrs=(addr,), step=0, round=0,
                                                             experts=(), capacity=0, version="t", heartbeat=1.0)))
    assert isinstance(record, PeerRecord) and record.maddrs == (addr,)


def test_the_validator_logs_a_peers_bad_records_once(caplog: pytest.LogCaptureFixture) -> None:
    refused = RefusalCounts()
    with caplog.at_level("WARNING", logger="node.net.validation"):
        for _ in range(3):
            refused.refuse_logged(RecordRefusal.BAD_ADDRESS, PEER, "unparseable multiaddr")
    assert refused.counts[RecordRefusal.BAD_ADDRESS] == 3
    assert sum(PEER in r.getMessage() for r in caplog.records) == 1


# ---- dial errors are the peer's PeerUnreachable ------------------------------------------------------


class _NoDaemon:
    """A P2P whose daemon cannot be reached: what a transport does before it asks matters here."""

    @property
    def daemon_listen_maddr(self) -> dict[str, str]:
        raise OSError("no daemon")


@pytest.mark.parametrize("addr", UNPARSEABLE)
def test_p2pd_connect_with_an_unparseable_address_is_peer_unreachable(addr: str) -> None:
    transport = P2PDTransport(_NoDaemon())  # type: ignore[arg-type]
    with pytest.raises(PeerUnreachable):
        asyncio.run(transport.connect(PEER, [addr]))
    with pytest.raises(PeerUnreachable):  # a peer id that is no base58 multihash
        asyncio.run(transport.connect("not a peer id!", [f"/ip4/127.0.0.1/tcp/1/p2p/{PEER}"]))


def test_p2pd_open_stream_re_dials_a_bad_address_book_entry_as_peer_unreachable() -> None:
    transport = P2PDTransport(_NoDaemon())  # type: ignore[arg-type]
    transport.set_address_book(lambda peer: UNPARSEABLE)
    with pytest.raises(PeerUnreachable):
        asyncio.run(transport.open_stream(PEER, "/murmur/test"))

    def broken(peer: str) -> list[str]:
        raise KeyError(peer)

    transport.set_address_book(broken)
    with pytest.raises(PeerUnreachable):
        asyncio.run(transport.open_stream(PEER, "/murmur/test"))


class _StrayWriter:
    def write(self, data: bytes) -> None:
        raise ValueError("a stray error while sending the request")


def test_libp2p_connect_turns_a_stray_error_into_peer_unreachable(tmp_path: Path) -> None:
    transport = LibP2PTransport(LibP2PSettings(identity_path=tmp_path / "id.key", peer_id=PEER), None)
    try:
        transport._control_writer = _StrayWriter()  # type: ignore[assignment]
        with pytest.raises(PeerUnreachable):
            asyncio.run(transport.connect(PEER, [f"/ip4/127.0.0.1/tcp/99999/p2p/{PEER}"]))
    finally:
        shutil.rmtree(transport._dir, ignore_errors=True)


# ---- a neighbour's stray error costs only that neighbour -----------------------------------------------


def test_a_round_survives_a_neighbour_whose_dial_raises_a_stray_value_error() -> None:
    async def main() -> None:
        net = InMemoryNetwork()
        rng = np.random.default_rng(0)
        ids = [f"peer{i:02d}" for i in range(4)]
        exchange = ExchangeSettings(swarm="s", config_hash="h", codec=get_codec("fp32"), exchange_timeout_s=1.0)
        peers = {pid: GossipPeer(net.transport(pid), exchange, {"w": rng.standard_normal(8).astype(np.float32)})
                 for pid in ids}
        for p in peers.values():
            await p.start()
        transport = peers["peer00"]._transport
        honest_open = transport.open_stream

        async def open_stream(peer_id: str, protocol: str):  # type: ignore[no-untyped-def]
            if peer_id == "peer03":
                raise ValueError("bad multiaddr '/ip4/999.1.1.1/tcp/1'")
            return await honest_open(peer_id, protocol)

        transport.open_stream = open_stream  # type: ignore[method-assign]
        view = MembershipView.of(ids)
        topology = build_topology("complete", view.n)
        async with asyncio.TaskGroup() as group:
            tasks = {pid: group.create_task(p.run_round(0, peer_round(topology, view, pid, 0)))
                     for pid, p in peers.items()}
        outcome = tasks["peer00"].result()
        assert outcome.mixed_with == ("peer01", "peer02")
        assert outcome.skipped["peer03"].startswith(Skip.FAILED)
        assert peers["peer00"].stats.skipped[Skip.FAILED] == 1
        assert set(tasks["peer01"].result().mixed_with) >= {"peer00"}  # the others' rounds went on too
        # and the next round runs
        again = await peers["peer00"].run_round(1, peer_round(topology, view, "peer00", 1))
        assert again.round == 1 and "peer03" in again.skipped

    asyncio.run(main())


def test_a_join_download_that_raises_a_stray_error_is_that_peers_failure() -> None:
    trained = np.full(4, 1.0, np.float32)

    async def fetch(peer: str, progress: object = None, *, start: int = 0, stop: int | None = None,
                    delivered: object = None) -> tuple[dict[str, np.ndarray], int, int]:
        if peer == "odd":
            raise ValueError("bad multiaddr")
        return {"w": trained.copy()}, 0, 300

    async def evaluate(tensors: object) -> float:
        x = np.zeros(4, np.float32) if tensors is None else tensors["w"]  # type: ignore[index]
        return 1.0 + float(np.linalg.norm(x - trained))

    records = [PeerRecord(peer_id=p, maddrs=(f"/ip4/127.0.0.1/tcp/1/p2p/{p}",), step=300, round=0, experts=(),
                          capacity=0, version="t", heartbeat=1.0) for p in ("a", "odd", "b")]
    judged = judge_steps(records, "me", step=0, margin=2, budget=0, rules=JoinRules())
    assert judged is not None
    outcome = asyncio.run(join_swarm(judged, fetch, evaluate, {"w": np.zeros(4, np.float32)}, JoinRules(sources=3)))
    assert outcome.refused == {"odd": Refused.FAILED}
    assert outcome.sources == ("a", "b")


# ---- supervised background tasks ------------------------------------------------------------------------


def test_a_supervised_task_that_raises_is_restarted_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    counts: collections.Counter[str] = collections.Counter()
    runs: list[int] = []

    async def body() -> None:
        runs.append(len(runs))
        if len(runs) <= 3:
            raise RuntimeError(f"failure {len(runs)}")
        # the fourth run lives on until cancelled

        await asyncio.Event().wait()

    async def main() -> None:
        task = asyncio.create_task(supervise("test loop", body, counter_of(counts), backoff_s=0.01, max_backoff_s=0.02))
        while len(runs) < 4:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with caplog.at_level("ERROR", logger="node.net.supervise"):
        asyncio.run(asyncio.wait_for(main(), 10.0))
    assert counts[FAILED] == 3 and counts[f"{FAILED}_test_loop"] == 3
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and all("RuntimeError" in line and "test loop" in line for line in lines)


def test_a_supervised_task_that_returns_is_done_and_cancellation_is_not_swallowed() -> None:
    counts: dict[str, int] = {}

    async def done() -> None:
        return None

    async def cancelled() -> None:
        raise asyncio.CancelledError

    asyncio.run(supervise("done", done, counter_of(counts)))
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(supervise("cancelled", cancelled, counter_of(counts)))
    assert counts == {}


# ---- discovery's loops and view reads --------------------------------------------------------------------


class _EmptyDht:
    """What Discovery's view read asks of a DHTNode: nothing is ever found."""

    async def get(self, key: str, latest: bool = False) -> None:
        return None


def _discovery(tmp_path: Path, heartbeat_s: float = 2.0):  # type: ignore[no-untyped-def]
    from node.net.discovery import Discovery, DiscoverySettings
    from node.net.identity import create_identity

    me = create_identity(tmp_path / "me.key")
    discovery = Discovery(None, me, DiscoverySettings("netinput", heartbeat_s=heartbeat_s),  # type: ignore[arg-type]
                          data_maddrs=(f"/ip4/127.0.0.1/tcp/1/p2p/{me.peer_id}",))
    discovery._dht = _EmptyDht()  # type: ignore[assignment]
    return discovery


def test_a_failing_discovery_heartbeat_is_restarted_and_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import node.net.supervise

    monkeypatch.setattr(node.net.supervise, "BACKOFF_S", 0.01)
    discovery = _discovery(tmp_path, heartbeat_s=0.02)
    published: list[int] = []

    async def publish() -> None:
        published.append(len(published))
        if len(published) <= 2:
            raise struct_error("a stray error from a DHT store")

    discovery._publish_record = publish  # type: ignore[method-assign]

    async def main() -> None:
        runner = asyncio.create_task(discovery._run())
        while len(published) < 5:
            await asyncio.sleep(0.01)
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner

    asyncio.run(asyncio.wait_for(main(), 20.0))
    errors = discovery.errors
    assert errors[FAILED] == 2 and errors[f"{FAILED}_discovery_heartbeat"] == 2, errors


def struct_error(message: str) -> Exception:
    import struct

    return struct.error(message)


def test_a_failing_view_read_keeps_the_view_and_is_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import node.net.discovery

    discovery = _discovery(tmp_path)
    before = discovery.view()

    def broken(*args: object, **kwargs: object) -> object:
        raise TypeError("a bug in the view's cap")

    monkeypatch.setattr(node.net.discovery, "cap_view", broken)
    asyncio.run(discovery._refresh_view())  # does not raise
    assert discovery.view() == before and discovery.errors["view_read_failed"] == 1
