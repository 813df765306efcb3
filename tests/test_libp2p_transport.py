"""The py-libp2p backend against real processes on loopback: gossip exchanges between a py-libp2p child
and a p2pd daemon, a frozen peer costing one timeout, the node noticing its child's death at once, the
child dying with a SIGKILLed node, the control protocol refusing garbage, and no process importing both
hivemind and libp2p (bulk bytes and dead, unknown or unserved peers: tests/test_transport_contract.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_transport_contract import libp2p_transport, transport_of

from gossip.codecs import get_codec
from gossip.exchange import ExchangeSettings, GossipPeer
from gossip.transport import Stream, StreamClosed
from node.net.identity import claim_identity
from node.net.transport import control
from node.net.transport.libp2p import ChildFailed, LibP2PSettings, LibP2PTransport
from topology import MembershipView, build_topology, peer_round

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[1]
PROTOCOL = "/murmur/test/1"


async def connect_all(transports) -> None:
    for a in transports:
        for b in transports:
            if a is not b:
                await a.connect(b.peer_id, await b.maddrs())


# ---- interop through the gossip protocol ------------------------------------------------------------


@pytest.mark.parametrize(
    "kinds,topology",
    [
        # two peers on one-peer-exp pull from each other: a libp2p host opens /murmur/gossip/1 to p2pd and back
        (("libp2p", "p2pd"), "one-peer-exp"),
        # complete over four: symmetric exchanges, each pair on one stream opened by the smaller id
        (("libp2p", "libp2p", "p2pd", "p2pd"), "complete"),
    ],
)
def test_gossip_peers_on_both_backends_reach_the_exact_average(tmp_path: Path, kinds, topology) -> None:
    async def scenario() -> None:
        async with contextlib.AsyncExitStack() as stack:
            transports = [await stack.enter_async_context(transport_of(kind, tmp_path / f"{i}.key"))
                          for i, kind in enumerate(kinds)]
            await connect_all(transports)
            rng = np.random.default_rng(7)
            settings = ExchangeSettings(swarm="mix", config_hash="c0ffee", codec=get_codec("fp32"),
                                        exchange_timeout_s=10.0)
            peers = {t.peer_id: GossipPeer(t, settings, {"w": rng.standard_normal(1000).astype(np.float32)})
                     for t in transports}
            for peer in peers.values():
                await peer.start()
            start = np.stack([p.tensors["w"] for p in peers.values()]).astype(np.float64)
            view = MembershipView.of(peers)
            graph = build_topology(topology, view.n)
            async with asyncio.timeout(60), asyncio.TaskGroup() as group:
                tasks = [group.create_task(p.run_round(0, peer_round(graph, view, pid, 0))) for pid, p in peers.items()]
            for task in tasks:
                assert task.result().skipped == {}, task.result()
            end = np.stack([p.tensors["w"] for p in peers.values()]).astype(np.float64)
            np.testing.assert_allclose(end, np.broadcast_to(start.mean(axis=0), end.shape), atol=1e-6)
            assert all(p.stats.errors == {} for p in peers.values())
            for transport in transports:  # every node both sent and received its tensors over its backend
                assert transport.bytes_sent > 4000 and transport.bytes_received > 4000

    asyncio.run(scenario())


# ---- bytes, failures, timeouts ---------------------------------------------------------------------


def test_a_frozen_peer_costs_one_timeout_and_nothing_else(tmp_path: Path) -> None:
    """SIGSTOP the server's child mid-stream: the client's read ends at the caller's deadline, the
    stream is torn down, and the client's own child still serves other peers at once."""

    async def scenario() -> None:
        async def reply_once(stream: Stream) -> None:
            await stream.write(await stream.read_exactly(1))
            with contextlib.suppress(StreamClosed):
                await stream.read_exactly(1)

        async with libp2p_transport(tmp_path / "c.key") as client, \
                libp2p_transport(tmp_path / "frozen.key") as frozen, \
                libp2p_transport(tmp_path / "ok.key") as healthy:
            for server in (frozen, healthy):
                await server.serve(PROTOCOL, reply_once)
                await client.connect(server.peer_id, await server.maddrs())
            stream = await client.open_stream(frozen.peer_id, PROTOCOL)
            os.kill(frozen.pid, signal.SIGSTOP)
            try:
                await stream.write(b"a")
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(1.5):
                        await stream.read_exactly(1)
                with pytest.raises(StreamClosed):
                    await stream.read_exactly(1)
                async with asyncio.timeout(5):
                    other = await client.open_stream(healthy.peer_id, PROTOCOL)
                    await other.write(b"b")
                    assert await other.read_exactly(1) == b"b"
                    await other.close()
            finally:
                os.kill(frozen.pid, signal.SIGCONT)

    asyncio.run(scenario())


def test_the_node_notices_at_once_when_its_child_dies(tmp_path: Path) -> None:
    async def scenario() -> None:
        blocked_forever = asyncio.Event()

        async def hold(stream: Stream) -> None:
            await stream.write(b"x")
            await blocked_forever.wait()

        died = asyncio.Event()
        with claim_identity(tmp_path / "n.key") as claimed:
            node = await LibP2PTransport.start(LibP2PSettings(claimed.identity.path, claimed.identity.peer_id),
                                               on_death=died.set)
            try:
                async with libp2p_transport(tmp_path / "s.key") as server:
                    await server.serve(PROTOCOL, hold)
                    await node.connect(server.peer_id, await server.maddrs())
                    stream = await node.open_stream(server.peer_id, PROTOCOL)
                    assert await stream.read_exactly(1) == b"x"
                    os.kill(node.pid, signal.SIGKILL)
                    async with asyncio.timeout(2):  # no heartbeat to miss: the socketpair closes with the child
                        await died.wait()
                    assert "gone" in node.died
                    with pytest.raises(StreamClosed):
                        await stream.read_exactly(1)
                    with pytest.raises(ChildFailed):
                        await node.open_stream(server.peer_id, PROTOCOL)
            finally:
                await node.close()

    asyncio.run(scenario())


# Started as a separate process: starts a LibP2PTransport, prints the child's pid, sleeps.
NODE_SCRIPT = """
import asyncio, sys
from pathlib import Path
from node.net.identity import claim_identity
from node.net.transport.libp2p import LibP2PSettings, LibP2PTransport

async def main():
    claimed = claim_identity(Path(sys.argv[1]))
    transport = await LibP2PTransport.start(LibP2PSettings(claimed.identity.path, claimed.identity.peer_id))
    print(transport.pid, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def test_sigkilled_node_takes_its_child_down(tmp_path: Path) -> None:
    node = subprocess.Popen([sys.executable, "-c", NODE_SCRIPT, str(tmp_path / "n.key")], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    child_pid = None
    try:
        assert node.stdout is not None
        child_pid = int(node.stdout.readline())
        assert _alive(child_pid)
        node.send_signal(signal.SIGKILL)
        node.wait(timeout=10)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and _alive(child_pid):
            time.sleep(0.05)
        assert not _alive(child_pid), "the py-libp2p child outlived its SIGKILLed node"
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()
        if child_pid is not None and _alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


# ---- the control protocol ----------------------------------------------------------------------


def test_garbage_on_the_childs_stream_socket_is_refused_and_the_child_goes_on(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with libp2p_transport(tmp_path / "a.key") as a, libp2p_transport(tmp_path / "b.key") as b:
            await b.serve(PROTOCOL, lambda stream: stream.close())
            await a.connect(b.peer_id, await b.maddrs())
            for garbage in (b"\x00\x00\x00\x05hello", b"\xff\xff\xff\xff", control.encode("stop"),
                            b"\x00\x00\x00\x01"):
                reader, writer = await asyncio.open_unix_connection(str(a._stream_socket))
                writer.write(garbage)
                writer.write_eof()
                async with asyncio.timeout(5):
                    assert await reader.read() == b""  # the child hangs up without an answer
                writer.close()
            stream = await a.open_stream(b.peer_id, PROTOCOL)
            with pytest.raises(StreamClosed):
                await stream.read_exactly(1)
            assert a.died is None

    asyncio.run(scenario())


def _body(frame: bytes) -> bytes:
    return frame[control.LENGTH_BYTES:]


@pytest.mark.parametrize(
    "body,error",
    [
        (b"\xc1", "not msgpack"),
        (b"\x93\x01\x02\x03", "not a map"),
        (_body(control.encode("stop")).replace(b"\xa1v\x01", b"\xa1v\x02"), "version 2"),
        (_body(control.encode("stop")).replace(b"stop", b"kill"), "unknown control op 'kill'"),
        (_body(control.encode("result", id=1, ok=True, error="")).replace(b"\xc3", b"\x01"),
         "'ok' missing or not bool"),
    ],
)
def test_control_frames_are_validated(body: bytes, error: str) -> None:
    with pytest.raises(control.ControlError, match=error):
        control.decode_body(body)


def test_control_frames_round_trip_and_enforce_limits() -> None:
    frame = control.encode("open", peer="Qm123", protocol="/murmur/gossip/1", timeout=2.5)
    assert control.frame_length(frame[:4]) == len(frame) - 4
    decoded = control.decode_body(_body(frame), ("open",))
    assert isinstance(decoded, control.Open)
    assert (decoded.op, decoded.peer, decoded.timeout) == ("open", "Qm123", 2.5)
    with pytest.raises(control.ControlError, match="expected opened"):
        control.decode_body(_body(frame), ("opened",))
    with pytest.raises(control.ControlError, match="exceeds"):
        control.frame_length((control.MAX_FRAME_BYTES + 1).to_bytes(4, "big"))
    with pytest.raises(control.ControlError, match="'id'"):
        control.encode("serve", id=True, protocol="/x")
    with pytest.raises(control.ControlError, match="at most"):
        control.encode("connect", id=1, peer="Qm", maddrs=["/ip4/127.0.0.1/tcp/1"] * 65, timeout=1)


# ---- hivemind and libp2p stay apart ------------------------------------------------------------------


def test_no_process_imports_both_hivemind_and_libp2p(tmp_path: Path) -> None:
    # The child, with its host built (py-libp2p imports much lazily), has no hivemind in it ...
    child_check = (
        "import sys; from pathlib import Path\n"
        "from node.net.transport import libp2p_child as c\n"
        "s = c.ChildSettings(0, Path(sys.argv[1]), '', ('/ip4/127.0.0.1/tcp/0',), Path('x'), Path('y'), 1.0, 1.0)\n"
        "c.make_host(c.load_key_pair(s.identity_path), s)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('hivemind', 'libp2p'))[:1])\n"
    )
    with claim_identity(tmp_path / "k.key") as claimed:
        out = subprocess.run([sys.executable, "-c", child_check, str(claimed.identity.path)], cwd=REPO,
                             capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == "['libp2p']", out
    # ... and this test process, which ran p2pd, hivemind and the node side of the backend, has no libp2p.
    assert "hivemind" in sys.modules and not any(m.split(".")[0] == "libp2p" for m in sys.modules)
    # Why the separation exists: the two cannot share a process (both define protobuf `crypto.pb`).
    clash = subprocess.run([sys.executable, "-c", "import hivemind, libp2p.crypto.pb.crypto_pb2"], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert clash.returncode != 0 and "crypto.pb" in clash.stderr
