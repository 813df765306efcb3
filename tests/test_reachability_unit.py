"""Reachability without a network: connection kinds, the dial-back server's bounds (against real TCP
listeners on loopback), `murmur doctor`'s verdicts and advice, `murmur status`'s lines, goodput."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
from test_monitor_access import Node

from node.cli.doctor import Verdict, diagnose, format_report, run_doctor_node
from node.cli.status import format_status
from node.monitor import start_monitor
from node.net.dialback import MAX_PORTS, DialbackRequest, DialbackServer, ObservedAddress
from node.net.reachability import ConnectionKind, connection_kind, tcp_ports
from node.net.transport.goodput import GoodputMeter, StreamTiming

pytestmark = pytest.mark.unit

ME, PEER, RELAY = "QmMe", "QmPeer", "QmRelay"
CIRCUIT = f"/ip4/10.0.0.1/tcp/4001/p2p/{RELAY}/p2p-circuit"


def test_connection_kinds() -> None:
    nat_peer = [f"{CIRCUIT}/p2p/{PEER}", f"/ip4/192.168.1.2/tcp/5/p2p/{PEER}"]
    public_peer = [f"/ip4/10.0.0.9/tcp/5/p2p/{PEER}"]
    assert connection_kind([], public_peer, self_private=False) is ConnectionKind.NONE
    assert connection_kind([CIRCUIT], nat_peer, self_private=True) is ConnectionKind.RELAYED
    assert connection_kind(["/ip4/10.0.0.9/tcp/5"], public_peer, self_private=True) is ConnectionKind.DIRECT
    # a direct connection beside a relayed one: streams take the direct one
    assert connection_kind([CIRCUIT, "/ip4/10.0.0.9/tcp/5"], public_peer, False) is ConnectionKind.DIRECT
    # both behind NAT and direct: a punched hole (at the peer's router's address) ...
    assert connection_kind(["/ip4/203.0.113.5/tcp/40000"], nat_peer, self_private=True) is ConnectionKind.HOLEPUNCHED
    # ... unless it goes to an address the peer listens on: the two share a LAN
    assert connection_kind(["/ip4/192.168.1.2/tcp/5"], nat_peer, self_private=True) is ConnectionKind.DIRECT
    # a NAT'd peer that dialled a public node is a plain direct connection for that node
    assert connection_kind(["/ip4/203.0.113.5/tcp/40000"], nat_peer, self_private=False) is ConnectionKind.DIRECT


def test_tcp_ports_and_observed_addresses() -> None:
    maddrs = ["/ip4/127.0.0.1/tcp/4001/p2p/X", "/ip4/10.0.0.2/tcp/4001/p2p/X", f"{CIRCUIT}/p2p/X",
              "/ip4/10.0.0.2/udp/4002/quic-v1", *(f"/ip4/1.2.3.4/tcp/{p}" for p in range(5000, 5010))]
    assert tcp_ports(maddrs) == (4001, 5000, 5001, 5002)[:MAX_PORTS]
    assert ObservedAddress.of("/ip4/203.0.113.5/tcp/40000") == ObservedAddress("203.0.113.5", 40000, False)
    assert ObservedAddress.of("/ip6/::1/tcp/7") == ObservedAddress("::1", 7, False)
    assert ObservedAddress.of(CIRCUIT).relayed
    assert ObservedAddress.of("/ip4/999.1.1.1/tcp/1") is None and ObservedAddress.of("/dns4/x/tcp/1") is None


def test_the_dial_back_server_dials_only_the_asker_and_only_a_few_times() -> None:
    async def main() -> None:
        server = DialbackServer(p2p=None)  # only its answers are exercised: no daemon needed
        with socket.socket() as listening, socket.socket() as closed:
            listening.bind(("127.0.0.1", 0))
            listening.listen(4)
            closed.bind(("127.0.0.1", 0))  # bound, not listening: refused
            ports = (listening.getsockname()[1], closed.getsockname()[1])
            reply = await server._reply("asker", "/ip4/127.0.0.1/tcp/40000", DialbackRequest(1, ports))
            assert reply.reachable == (ports[0],) and reply.refused == ""
            assert reply.observed == "/ip4/127.0.0.1/tcp/40000"
            relayed = await server._reply("asker", f"{CIRCUIT}/p2p/X", DialbackRequest(1, ports))
            assert relayed.reachable == () and relayed.refused == "relayed"
            for _ in range(3):
                await server._reply("asker", "/ip4/127.0.0.1/tcp/40000", DialbackRequest(1, ports))
            busy = await server._reply("asker", "/ip4/127.0.0.1/tcp/40000", DialbackRequest(1, ports))
            assert busy.refused == "busy" and busy.reachable == ()  # its fifth within 30 s
            other = await server._reply("other", "/ip4/127.0.0.1/tcp/40001", DialbackRequest(1, ports))
            assert other.reachable == (ports[0],)  # another asker on the same address is answered

    asyncio.run(main())


def test_a_dial_back_request_is_declared_and_bounded() -> None:
    import msgspec

    from node.net.dialback import _REQUEST, _frame

    assert _REQUEST.decode(_frame(DialbackRequest(1, (1, 2)))[4:]) == DialbackRequest(1, (1, 2))
    for bad in ({"v": 1, "ports": []}, {"v": 1, "ports": [1, 2, 3, 4, 5]}, {"v": 1, "ports": [0]},
                {"v": 2, "ports": [1]}, {"v": 1, "ports": [1], "more": 1}):
        with pytest.raises(msgspec.ValidationError):
            _REQUEST.decode(msgspec.msgpack.encode(bad))


def _relay(peer: str, circuit: str | None, held: bool, lost_at: float | None = None) -> dict:
    return {"peer_id": peer, "maddr": f"/ip4/10.0.0.1/tcp/4001/p2p/{peer}", "connected": held, "held": held,
            "circuit": circuit, "detail": "", "lost_at": lost_at}


def _report(**overrides) -> dict:
    report = {"peer_id": ME, "mode": "auto", "reach": "public", "observed": ["/ip4/203.0.113.5/tcp/31337"],
              "ports": [41000],
              "confirmed_by": [PEER], "detail": "dialled back by 1 of 1", "relays": [], "relays_held": 0,
              "circuits": [], "relay_service": None,
              "redetected": {"reach": "public", "observed": ["/ip4/203.0.113.5/tcp/31337"], "confirmed_by": [PEER],
                             "detail": "dialled back by 1 of 1"},
              "neighbours": [{"peer_id": PEER, "connection": "direct", "latency_ms": 3.0, "goodput_mbit_s": 90.0,
                              "error": None}]}
    report.update(overrides)
    return report


def test_doctor_verdicts_and_advice() -> None:
    public = diagnose(_report())
    assert (public.verdict, public.advice) == (Verdict.PUBLIC, ())
    private = {"reach": "private", "redetected": {"reach": "private", "observed": ["/ip4/203.0.113.5/tcp/41000"],
                                                  "confirmed_by": [], "detail": "1 peer(s) could not dial back"}}
    relayed = diagnose(_report(**private, relays=[_relay(RELAY, "carries", True)]))
    assert relayed.verdict is Verdict.RELAYED and relayed.advice == ()
    limited = diagnose(_report(**private, relays=[_relay(RELAY, "limited", True)]))
    assert limited.verdict is Verdict.UNREACHABLE
    assert any("cuts circuits after 128 KiB" in a for a in limited.advice)
    assert any("forward TCP port 41000" in a and "--announce /ip4/203.0.113.5/tcp/PORT" in a for a in limited.advice)
    lost = diagnose(_report(**private, relays=[_relay(RELAY, None, False, lost_at=time.time()),
                                               _relay("QmOther", "carries", True)]))
    assert lost.verdict is Verdict.RELAYED and any(f"relay {RELAY} was lost" in a for a in lost.advice)
    alone = diagnose(_report(**private, relays=[]))
    assert alone.verdict is Verdict.UNREACHABLE and "has no relay" in alone.advice[0]
    unknown = diagnose(_report(reach="unknown", redetected={"reach": "unknown", "observed": [], "confirmed_by": [],
                                                            "detail": "none answered"}))
    assert unknown.verdict is Verdict.UNKNOWN and "give --peers of a bootstrap" in unknown.advice[-1]
    firewall = diagnose(_report(mode="public", redetected=private["redetected"]))
    assert firewall.verdict is Verdict.PUBLIC and any("open the firewall for TCP port 41000" in a for a in firewall.advice)
    service = {"data_limit_bytes": 1 << 33, "time_limit_s": 3600.0, "limits_in_force": False, "check": "limited",
               "detail": "cut", "checked_at": 1.0}
    cut = diagnose(_report(relay_service=service))
    assert any("relay service cuts circuits" in a for a in cut.advice)
    broken = diagnose(_report(neighbours=[{"peer_id": PEER, "connection": "none", "latency_ms": None,
                                           "goodput_mbit_s": None, "error": "timed out"}]))
    assert broken.advice == (f"neighbour {PEER} (none) did not answer a probe: timed out",)
    text = format_report(_report(**private, relays=[_relay(RELAY, "carries", True)]))
    assert "verdict    reachable through relays" in text and "holds a slot; its circuit carries" in text


def test_status_says_how_the_node_is_reached_and_each_link() -> None:
    status = {"peer_id": ME, "swarm": "s", "maddrs": [], "round": 1, "step": 1, "bytes_sent": 0,
              "bytes_received": 0, "errors": {}, "training": None, "loss": None,
              "peers": [{"peer_id": ME, "connection": None, "goodput_mbit_s": None},
                        {"peer_id": PEER, "connection": "relayed", "goodput_mbit_s": 92.5}],
              "reachability": {"mode": "auto", "reach": "private", "detail": "",
                               "relays": [_relay(RELAY, "carries", True),
                                          _relay("QmGone", None, False, lost_at=time.time())],
                               "relay_service": None}}
    text = format_status(status)
    assert f"reach    behind NAT: through 1 relay(s): {RELAY}" in text
    assert "relay    QmGone LOST at" in text
    assert f"link     {PEER}   relayed   goodput 92.5 Mbit/s" in text


def test_goodput_is_bytes_over_the_payload_span_and_ignores_small_transfers() -> None:
    meter = GoodputMeter()
    meter.add_sample("p", 100, 0.001)  # too small to say anything
    assert meter.mbit_s("p") is None
    meter.add_sample("p", 10_000_000, 1.0)
    assert meter.mbit_s("p") == pytest.approx(80.0)
    meter.add_sample("p", 10_000_000, 0.5)
    assert meter.mbit_s("p") == pytest.approx(0.7 * 80 + 0.3 * 160)
    timing = StreamTiming()
    timing.read(100)  # a header: starts the clock, not counted
    time.sleep(0.05)
    timing.read(1 << 20)
    assert timing.nbytes == 1 << 20 and 0.04 < timing.seconds < 1.0


def test_doctor_asks_a_running_node_with_its_monitor_token(capsys: pytest.CaptureFixture[str]) -> None:
    """`murmur doctor --url` is a POST to the node's monitor: it carries the node's per-run token (the
    monitor answers 401 without it, and doctor says so in one line, exit 1)."""
    class Doctored(Node):
        checks = 0

        async def doctor(self) -> dict:
            self.checks += 1
            return _report(peer_id=ME)

    async def main() -> None:
        node = Doctored()
        server = await start_monitor(node, "127.0.0.1", 0, interval_s=60, token="the-token")
        try:
            refused = await asyncio.to_thread(run_doctor_node, server.url, True, 10.0, None)
            assert refused == 1 and node.checks == 0
            assert "refused" in capsys.readouterr().err
            answered = await asyncio.to_thread(run_doctor_node, server.url, True, 10.0, "the-token")
            assert answered == 0 and node.checks == 1
            assert json.loads(capsys.readouterr().out)["verdict"] == Verdict.PUBLIC.value
        finally:
            await server.close()

    asyncio.run(main())
