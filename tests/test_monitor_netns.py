"""The monitor binds to 127.0.0.1 unless told otherwise: a real `murmur node` in a network namespace
answers on its loopback and not on the namespace's other address, neither from inside nor from the
other end of a veth link; the same node started with `--monitor-host 0.0.0.0` does answer there (so
the test can tell the two apart). Needs root, `ip` and `tc` (as in CI); without them it fails."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from node.net.proc import popen
from node.runtime.ready_line import find_ready_line
from support.netns import VethLink, veth_link

pytestmark = pytest.mark.multiprocess

MURMUR = str(Path(sys.executable).with_name("murmur"))
READY_TIMEOUT_S = 90.0
CONNECT_TIMEOUT_S = 3.0


def start_node(link: VethLink, data_dir: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    log = data_dir.with_suffix(".log")
    argv = [MURMUR, "node", "--model", "vector", "--dim", "16", "--listen", link.tcp_maddr(0),
            "--data-dir", str(data_dir), "--monitor-port", "0", "--swarm", data_dir.name, *args]
    with log.open("wb") as out:
        process = popen(link.command(0, argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return process, log


def wait_port(process: subprocess.Popen, log: Path) -> tuple[str, int]:
    """The monitor's host and port from the node's ready line."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        found = find_ready_line(log.read_text(errors="replace"))
        if found:
            url = urllib.parse.urlsplit(found.monitor_url)
            return url.hostname, url.port
        if process.poll() is not None:
            pytest.fail(f"the node exited with {process.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)
    pytest.fail(f"the node was not ready within {READY_TIMEOUT_S:g} s:\n{log.read_text(errors='replace')[-3000:]}")


def answers(host: str, port: int) -> bool:
    """Whether an HTTP GET of /api/status at host:port gets the node's answer (run inside a namespace)."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/api/status", timeout=CONNECT_TIMEOUT_S) as response:
            return response.status == 200 and b'"peer_id"' in response.read()
    except OSError:
        return False


def refused(host: str, port: int) -> bool:
    """Whether a TCP connection to host:port is actively refused (nothing listens there)."""
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            return False
    except ConnectionRefusedError:
        return True


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def test_the_monitor_is_reachable_only_on_loopback_by_default(tmp_path: Path) -> None:
    with veth_link("m") as link:
        outside = link.addresses[0]  # the namespace's own address on the link
        started = [start_node(link, tmp_path / "local"),
                   start_node(link, tmp_path / "exposed", "--monitor-host", "0.0.0.0")]
        try:
            (host, port), (_, exposed_port) = (wait_port(*node) for node in started)
            assert host == "127.0.0.1"
            assert link.call_inside(0, answers, "127.0.0.1", port)
            assert link.call_inside(0, refused, outside, port), "the monitor listens on the link address"
            assert link.call_inside(1, refused, outside, port), "the monitor is reachable from the other host"
            # asked for, it is reachable from the other end of the link: the checks above can fail
            assert link.call_inside(1, answers, outside, exposed_port)
        finally:
            for process, _ in started:
                stop(process)
