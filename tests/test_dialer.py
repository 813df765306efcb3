"""Dials of the view's peers (node/net/dialer.py) and the routability rule (node/net/reach.py): in the
background, a few at a time, backed off on failure, never of addresses that route nowhere or narrower
than this node's own; a round never waits for them."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from node.net.dialer import Dialer, DialSettings
from node.net.reach import Scope, address_scope, dialable_maddrs, own_reach

pytestmark = pytest.mark.unit

RELAY = "QmRelay1111111111111111111111111111111111111111"
PEER = "QmPeer11111111111111111111111111111111111111111"


@pytest.mark.parametrize("maddr,scope", [
    ("/ip4/127.0.0.1/tcp/4001", Scope.LOOPBACK),
    ("/ip4/127.8.0.1/tcp/4001", Scope.LOOPBACK),
    ("/ip6/::1/tcp/4001", Scope.LOOPBACK),
    ("/dns4/localhost/tcp/4001", Scope.LOOPBACK),
    ("/ip4/169.254.3.4/tcp/4001", Scope.LINK_LOCAL),
    ("/ip6/fe80::1/tcp/4001", Scope.LINK_LOCAL),
    ("/ip4/10.1.2.3/tcp/4001", Scope.PRIVATE),
    ("/ip4/192.168.1.5/udp/4001/quic-v1", Scope.PRIVATE),
    ("/ip4/100.64.0.1/tcp/4001", Scope.PRIVATE),  # carrier-grade NAT
    ("/ip6/fd00::1/tcp/4001", Scope.PRIVATE),
    ("/ip4/8.8.8.8/tcp/4001", Scope.PUBLIC),
    ("/ip6/2606:4700::1/tcp/4001", Scope.PUBLIC),
    ("/dns4/relay.example.org/tcp/4001", Scope.PUBLIC),
    ("/ip4/0.0.0.0/tcp/4001", Scope.NOWHERE),
    ("/ip4/224.0.0.1/tcp/4001", Scope.NOWHERE),
    ("/ip4/192.0.2.1/tcp/4001", Scope.NOWHERE),  # documentation
    ("/ip4/240.0.0.1/tcp/4001", Scope.NOWHERE),  # reserved
    ("/ip4/not-an-ip/tcp/4001", Scope.NOWHERE),
    ("/unix/tmp/sock", Scope.NOWHERE),
    ("", Scope.NOWHERE),
    # relayed addresses are judged by the relay's part, which is what is dialled
    (f"/ip4/8.8.8.8/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{PEER}", Scope.PUBLIC),
    (f"/ip4/10.0.0.1/tcp/4001/p2p/{RELAY}/p2p-circuit", Scope.PRIVATE),
    (f"/p2p/{RELAY}/p2p-circuit/p2p/{PEER}", Scope.PUBLIC),  # a relay the daemon knows by id
    (f"/p2p/{PEER}", Scope.NOWHERE),
])
def test_each_address_has_its_scope(maddr, scope):
    assert address_scope(maddr) is scope


RECORD = ("/ip4/127.0.0.1/tcp/1", "/ip4/169.254.1.1/tcp/1", "/ip4/10.0.0.1/tcp/1", "/ip4/8.8.8.8/tcp/1",
          f"/ip4/10.0.0.2/tcp/1/p2p/{RELAY}/p2p-circuit", "/ip4/192.0.2.1/tcp/1", "/ip4/0.0.0.0/tcp/1")


@pytest.mark.parametrize("own,dialled", [
    # a node on public addresses dials public targets only (and relays on them)
    (("/ip4/8.8.4.4/tcp/4001", "/ip4/127.0.0.1/tcp/4001"), {"/ip4/8.8.8.8/tcp/1"}),
    # a node on a private network dials private and public targets, not loopback or link-local
    (("/ip4/10.9.9.9/tcp/4001",),
     {"/ip4/10.0.0.1/tcp/1", "/ip4/8.8.8.8/tcp/1", f"/ip4/10.0.0.2/tcp/1/p2p/{RELAY}/p2p-circuit"}),
    # a test swarm on loopback dials everything that routes somewhere
    (("/ip4/127.0.0.1/tcp/4001",), set(RECORD[:5])),
    ((), set(RECORD[:5])),  # no address of its own (not started): as on loopback
])
def test_a_node_dials_only_targets_as_wide_as_its_own_addresses(own, dialled):
    assert set(dialable_maddrs(RECORD, own)) == dialled
    assert list(dialable_maddrs(RECORD, own)) == [a for a in RECORD if a in dialled]  # the record's order


def test_own_reach_is_the_widest_own_address():
    assert own_reach(["/ip4/127.0.0.1/tcp/1", "/ip4/10.0.0.1/tcp/1"]) is Scope.PRIVATE
    assert own_reach(["/ip4/0.0.0.0/tcp/1"]) is Scope.LOOPBACK


@dataclass(frozen=True)
class Record:
    peer_id: str
    maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/1",)


class Connector:
    """A data plane whose dials hang until released, fail, or succeed, as a test says."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[str, ...]]] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.release = asyncio.Event()
        self.failing: set[str] = set()

    async def connect(self, peer_id: str, maddrs: Sequence[str]) -> None:
        self.calls.append((peer_id, tuple(maddrs)))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if peer_id in self.failing:
                raise ConnectionError("no route")
            await self.release.wait()
        finally:
            self.in_flight -= 1


def test_dials_run_in_the_background_a_few_at_a_time_and_hanging_ones_time_out():
    async def main() -> None:
        connector = Connector()
        dialer = Dialer(connector, "me", lambda: ("/ip4/127.0.0.1/tcp/9",),
                        DialSettings(concurrency=3, timeout_s=0.3))
        view = [Record("me"), *(Record(f"p{i}") for i in range(10))]
        started = asyncio.get_running_loop().time()
        dialer.update(view)
        assert asyncio.get_running_loop().time() - started < 0.05  # nothing waited for a dial
        await asyncio.sleep(0.1)
        assert connector.most_in_flight == 3
        await asyncio.sleep(1.5)
        assert connector.most_in_flight == 3 and len(connector.calls) == 10  # all tried, none twice yet
        assert dialer.counts == {"failed": 10} and dialer.backing_off == 10
        await dialer.close()

    asyncio.run(main())


def test_a_failed_dial_is_retried_after_a_doubling_backoff_and_new_addresses_start_afresh():
    async def main() -> None:
        now = [0.0]
        connector = Connector()
        connector.failing.add("bad")
        connector.release.set()
        dialer = Dialer(connector, "me", lambda: (), DialSettings(backoff_s=2.0, max_backoff_s=5.0),
                        clock=lambda: now[0])
        view = [Record("bad"), Record("good")]

        async def tick(at: float) -> None:
            now[0] = at
            dialer.update(view)
            await asyncio.sleep(0.02)

        for at in (0.0, 1.0, 1.9, 2.1, 3.0, 6.0, 6.2, 11.0, 11.2, 16.5):
            await tick(at)
        tries = [i for i, (peer, _) in enumerate(connector.calls) if peer == "bad"]
        # tries at 0, 2.1 (after 2 s), 6.2 (after 4 s), 11.2 (after 5 s: the cap), 16.5 (5 s)
        assert len(tries) == 5, connector.calls
        assert [p for p, _ in connector.calls].count("good") == 1  # connected once, not dialled again
        assert dialer.counts == {"ok": 1, "failed": 5} and dialer.connected("good")
        view[0] = Record("bad", ("/ip4/127.0.0.2/tcp/1",))  # its record names new addresses: dialled now
        await tick(16.6)
        assert connector.calls[-1] == ("bad", ("/ip4/127.0.0.2/tcp/1",))
        view.pop(0)  # gone from the view: its state goes too
        await tick(17.0)
        assert set(dialer._peers) == {"good"}
        await dialer.close()

    asyncio.run(main())


def test_a_record_with_no_routable_address_is_refused_once_and_never_dialled():
    async def main() -> None:
        connector = Connector()
        connector.release.set()
        dialer = Dialer(connector, "me", lambda: ("/ip4/8.8.4.4/tcp/4001",))
        view = [Record("private", ("/ip4/10.0.0.1/tcp/1", "/ip4/127.0.0.1/tcp/1")),
                Record("mixed", ("/ip4/127.0.0.1/tcp/1", "/ip4/8.8.8.8/tcp/1")),
                Record("nowhere", ())]
        for _ in range(3):
            dialer.update(view)
            await asyncio.sleep(0.02)
        assert connector.calls == [("mixed", ("/ip4/8.8.8.8/tcp/1",))]  # only its public address
        assert dialer.counts == {"refused": 2, "ok": 1}
        await dialer.close()

    asyncio.run(main())


def test_ensure_dials_now_and_waits_at_most_its_timeout():
    async def main() -> None:
        connector = Connector()
        dialer = Dialer(connector, "me", lambda: (), DialSettings(timeout_s=10.0))
        loop = asyncio.get_running_loop()
        started = loop.time()
        await dialer.ensure([Record("slow")], timeout_s=0.2)
        assert 0.15 < loop.time() - started < 1.0 and connector.calls == [("slow", ("/ip4/127.0.0.1/tcp/1",))]
        connector.release.set()
        await asyncio.sleep(0.05)
        assert dialer.connected("slow")
        await dialer.ensure([Record("slow")], timeout_s=5.0)  # connected: no second dial
        assert len(connector.calls) == 1
        await dialer.close()

    asyncio.run(main())
