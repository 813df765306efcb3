"""The image's entrypoint (docker/entrypoint.py) in-process: when a `join` asks another node for its
peers (MURMUR_PEERS_FROM), which addresses it takes, and how it fails. The container test runs it for real."""

from __future__ import annotations

import importlib.util
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

_SPEC = importlib.util.spec_from_file_location(
    "murmur_docker_entrypoint", Path(__file__).resolve().parent.parent / "docker" / "entrypoint.py")
entrypoint = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(entrypoint)

PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
FROM = {"MURMUR_PEERS_FROM": "http://murmur-a:7690"}


@pytest.mark.parametrize("argv,env,expected", [
    (["join"], FROM, True),
    (["join", "--announce", "/dns4/b/tcp/31337"], FROM, True),
    (["join"], {}, False),                                          # no MURMUR_PEERS_FROM
    (["join"], {"MURMUR_PEERS_FROM": "  "}, False),                 # empty counts as unset
    (["node"], FROM, False),                                        # a founder needs no peer
    (["join", "--peers", f"/ip4/10.0.0.2/tcp/1/p2p/{PEER}"], FROM, False),
    (["join", f"--peers=/ip4/10.0.0.2/tcp/1/p2p/{PEER}"], FROM, False),
    (["join"], {**FROM, "MURMUR_PEERS": f"/ip4/10.0.0.2/tcp/1/p2p/{PEER}"}, False),
    (["join", "--help"], FROM, False),                              # help must not wait for a node
    ([], FROM, False),
])
def test_only_a_join_without_peers_asks_another_node(argv, env, expected) -> None:
    assert entrypoint.needs_peers(argv, env) is expected


@pytest.mark.parametrize("argv,env,expected", [
    (["join"], {}, True),
    (["join", "--invite", f"s@{PEER}"], {}, False),
    (["join", f"--founder={PEER}"], {}, False),
    (["join"], {"MURMUR_INVITE": f"s@{PEER}"}, False),
    (["join"], {"MURMUR_FOUNDER": PEER}, False),
])
def test_a_join_naming_no_founder_takes_the_nodes_invite(argv, env, expected, status_server) -> None:
    assert entrypoint.needs_invite(argv, env) is expected
    url, answers = status_server
    answers.append({"maddrs": [], "invite": f"local@{PEER}"})
    assert entrypoint.fetch_invite(url) == f"local@{PEER}"
    assert entrypoint.invite_of({"invite": None}) is None and entrypoint.invite_of({}) is None


def test_loopback_and_malformed_addresses_are_not_taken() -> None:
    status = {"maddrs": [f"/ip4/127.0.0.1/tcp/31337/p2p/{PEER}", f"/dns4/murmur-a/tcp/31337/p2p/{PEER}",
                         f"/ip4/10.89.0.2/tcp/31337/p2p/{PEER}", f"/ip6/::1/tcp/31337/p2p/{PEER}",
                         "/ip4/10.89.0.2/tcp/31337", 7, f"/dns4/localhost/tcp/1/p2p/{PEER}"]}
    assert entrypoint.dialable_maddrs(status) == [f"/dns4/murmur-a/tcp/31337/p2p/{PEER}",
                                                  f"/ip4/10.89.0.2/tcp/31337/p2p/{PEER}"]
    assert entrypoint.dialable_maddrs({"maddrs": "not a list"}) == []
    assert entrypoint.dialable_maddrs({}) == []


@pytest.fixture
def status_server() -> Iterator[tuple[str, list[dict]]]:
    """A stand-in for a node's monitor: serves the statuses in the list, one per request, the last forever."""
    answers: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(answers.pop(0) if len(answers) > 1 else answers[0]).encode()
            self.send_response(200 if self.path == "/api/status" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", answers
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_waits_until_the_node_lists_a_dialable_address(status_server) -> None:
    url, answers = status_server
    answers += [{"maddrs": []}, {"maddrs": [f"/ip4/127.0.0.1/tcp/1/p2p/{PEER}"]},
                {"maddrs": [f"/dns4/murmur-a/tcp/31337/p2p/{PEER}"]}]
    maddrs = entrypoint.fetch_maddrs(url + "/", timeout_s=30, retry_every_s=0.05)
    assert maddrs == [f"/dns4/murmur-a/tcp/31337/p2p/{PEER}"]


def test_a_node_with_only_loopback_addresses_fails_with_a_hint(status_server) -> None:
    url, answers = status_server
    answers.append({"maddrs": [f"/ip4/127.0.0.1/tcp/1/p2p/{PEER}"]})
    with pytest.raises(entrypoint.PeersUnavailable, match="--announce"):
        entrypoint.fetch_maddrs(url, timeout_s=0.5, retry_every_s=0.05)


def test_no_node_fails_naming_the_url(unused_tcp_port_url: str) -> None:
    with pytest.raises(entrypoint.PeersUnavailable, match=unused_tcp_port_url.replace(".", r"\.")):
        entrypoint.fetch_maddrs(unused_tcp_port_url, timeout_s=0.5, retry_every_s=0.05)


@pytest.fixture
def unused_tcp_port_url() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("value", ["soon", "0", "-3", "nan"])
def test_a_bad_timeout_exits_2_with_one_line(value, monkeypatch, capsys) -> None:
    monkeypatch.setenv("MURMUR_PEERS_FROM", "http://murmur-a:7690")
    monkeypatch.setenv("MURMUR_PEERS_FROM_TIMEOUT", value)
    monkeypatch.delenv("MURMUR_PEERS", raising=False)
    assert entrypoint.main(["join"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("murmur join: error: MURMUR_PEERS_FROM_TIMEOUT"), err


def test_the_founder_is_asked_by_address_which_its_monitor_answers_unlike_a_name() -> None:
    """A compose joiner asks http://murmur-a:7690: the founder's monitor (bound to 0.0.0.0) refuses the
    Host `murmur-a` (DNS rebinding) and answers an address literal, so the name is resolved first."""
    from urllib.parse import urlsplit

    from node.monitor.access import HostAllowlist

    asked = entrypoint.by_address("http://localhost:7690/")
    host = urlsplit(asked).netloc
    assert urlsplit(asked).hostname in ("127.0.0.1", "::1") and asked.endswith(":7690/")
    founders_monitor = HostAllowlist("0.0.0.0")
    assert founders_monitor.allows(host) and not founders_monitor.allows("murmur-a:7690")
    assert entrypoint.by_address("http://10.88.0.5:7690") == "http://10.88.0.5:7690"
