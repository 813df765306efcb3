"""The p2pd transport between real daemons on loopback: stalled reads torn down on both ends, closing
ends handlers and streams, and no daemon left behind when the node is SIGKILLed (the contract all
transports keep is tests/test_transport_contract.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_transport_contract import p2pd_transport

from gossip.transport import Stream, StreamClosed
from node.net.identity import claim_identity
from node.net.transport.p2pd import P2PDTransport

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[1]
PROTOCOL = "/murmur/test/1"


async def connect(client: P2PDTransport, server: P2PDTransport) -> None:
    await client.connect(server.peer_id, await server.maddrs())


def test_timed_out_read_tears_the_stream_down_on_both_ends(tmp_path: Path) -> None:
    """A read cancelled by asyncio.timeout must not leave the stream half-open: the local stream is
    unusable afterwards and the remote handler sees the end of the stream."""

    async def scenario() -> None:
        handler_outcome: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        async def silent(stream: Stream) -> None:
            await stream.write(b"x")  # one byte, so the client's stream is known to be up
            try:
                await stream.read_exactly(1)
                handler_outcome.set_result("read data")
            except StreamClosed:
                handler_outcome.set_result("closed")

        async with p2pd_transport(tmp_path / "a.key") as server, p2pd_transport(tmp_path / "b.key") as client:
            await server.serve(PROTOCOL, silent)
            await connect(client, server)
            stream = await client.open_stream(server.peer_id, PROTOCOL)
            assert await stream.read_exactly(1) == b"x"
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.3):
                    await stream.read_exactly(10)
            with pytest.raises(StreamClosed):
                await stream.read_exactly(1)
            with pytest.raises(StreamClosed):
                await stream.write(b"late")
            async with asyncio.timeout(5):
                assert await handler_outcome == "closed"
            assert client.bytes_received == 1 and client.bytes_sent == 0

    asyncio.run(scenario())


def test_closing_the_transport_ends_its_handlers_and_streams(tmp_path: Path) -> None:
    async def scenario() -> None:
        handler_started = asyncio.Event()
        handler_cancelled = asyncio.Event()

        async def blocked(stream: Stream) -> None:
            handler_started.set()
            try:
                await stream.read_exactly(1)
            except asyncio.CancelledError:
                handler_cancelled.set()
                raise

        async with p2pd_transport(tmp_path / "a.key") as server, p2pd_transport(tmp_path / "b.key") as client:
            await server.serve(PROTOCOL, blocked)
            await connect(client, server)
            stream = await client.open_stream(server.peer_id, PROTOCOL)
            async with asyncio.timeout(5):
                await handler_started.wait()
                await server.close()
                assert handler_cancelled.is_set()
                with pytest.raises(StreamClosed):
                    await stream.read_exactly(1)
            with pytest.raises(RuntimeError):
                await server.open_stream(client.peer_id, PROTOCOL)

    asyncio.run(scenario())


# Started as a separate Python process: claims an identity, starts p2pd and a `sleep` child through
# node.net.proc, then forks a worker that inherits the daemon's control socket (as torch DataLoader
# workers or hivemind's DHT process would). p2pd exits on its own when its last client connection
# closes, so only PR_SET_PDEATHSIG can stop it while such a fork holds the socket open.
NODE_SCRIPT = """
import asyncio, os, sys, time
from pathlib import Path
from node.net.identity import claim_identity
from node.net.proc import popen
from node.net.transport.p2pd import P2PSettings, start_p2pd

async def main():
    claimed = claim_identity(Path(sys.argv[1]))
    await start_p2pd(P2PSettings(identity_path=claimed.identity.path))
    popen(["sleep", "600"])
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
    print("ready", flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def _children(pid: int) -> dict[int, str]:
    """pid -> command name of the live children of `pid`."""
    children = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children[int(entry.name)] = comm
    return children


def _is_dead(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")  # a zombie has exited; only its reaping is pending


def test_sigkilled_node_takes_p2pd_and_its_children_down(tmp_path: Path) -> None:
    identity_path = tmp_path / "node.key"
    node = subprocess.Popen(
        [sys.executable, "-c", NODE_SCRIPT, str(identity_path)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
    )
    children: dict[int, str] = {}
    try:
        assert node.stdout is not None
        assert node.stdout.readline().strip() == "ready"
        children = _children(node.pid)
        by_name = {name: pid for pid, name in children.items()}
        assert {"p2pd", "sleep", "python"} <= set(by_name), children

        node.send_signal(signal.SIGKILL)
        node.wait(timeout=10)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and not (_is_dead(by_name["p2pd"]) and _is_dead(by_name["sleep"])):
            time.sleep(0.05)
        assert _is_dead(by_name["p2pd"]), "p2pd outlived the SIGKILLed node"
        assert _is_dead(by_name["sleep"]), "a child started with node.net.proc.popen outlived the node"
        assert not _is_dead(by_name["python"])  # the fork holding the daemon socket is still there

        # The kernel dropped the identity lock with the node; its children never held it.
        with claim_identity(identity_path):
            pass
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()
        for pid in children:
            if not _is_dead(pid):
                os.kill(pid, signal.SIGKILL)
