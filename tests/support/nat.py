"""An internet in network namespaces for the NAT tests and benchmarks: public hosts on a "wan" switch, and
home LANs behind NAT routers.

The switch is a bridge in a namespace of its own; the routers MASQUERADE and drop new connections from the
wan. Needs root, `ip`, `tc` and `iptables` (`iptables` is installed with apt when missing, as the
container test installs podman).

Every namespace and device is created inside namespaces this module makes (a veth pair is created in
one of them and its peer moved to the other), so nothing appears in the host's namespace and no
address used here can leave. Names carry a tag and the creating process's pid; everything is deleted
on exit, also on failure.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from node.runtime.ready_line import find_ready_line
from support.netns import TBF_BURST, TBF_LATENCY, NetnsUnavailable, _call_in_namespace, remove_orphaned_namespaces

T = TypeVar("T")

WAN_SUBNET = "10.200.0"  # public hosts .10+, routers' wan legs .100+
_COMMAND_TIMEOUT_S = 15.0
_APT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Host:
    """One machine: its namespace and the address others see it at (for a home host, its LAN address)."""

    name: str
    namespace: str
    address: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def tcp_maddr(self, port: int = 0) -> str:
        return f"/ip4/{self.address}/tcp/{port}"

    def call_inside(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on a fresh thread moved into this host's namespace (sockets it opens live there)."""
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            return pool.submit(_call_in_namespace, f"/run/netns/{self.namespace}", fn, args).result()


@dataclass(frozen=True)
class Home:
    """A home LAN: its host, and its router, whose wan address is what the internet sees of the home."""

    host: Host
    router: Host  # address: the router's wan address (the home's public address)


@dataclass(frozen=True)
class Internet:
    publics: tuple[Host, ...]
    homes: tuple[Home, ...]
    rate_mbit: float | None


def _run(argv: Sequence[str], what: str) -> str:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsUnavailable(f"{what}: `{' '.join(argv)}` failed: {exc}") from None
    if done.returncode != 0:
        raise NetnsUnavailable(f"{what}: `{' '.join(argv)}` exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def ensure_iptables() -> None:
    """Install iptables with apt when it is missing (Debian's minimal images lack it); fail with apt's output."""
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetnsUnavailable(f"{tool} not found: install iproute2")
    if shutil.which("iptables") is not None:
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "install", "-y", "--no-install-recommends", "iptables"],
                 ["apt-get", "update"],
                 ["apt-get", "install", "-y", "--no-install-recommends", "iptables"]):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_APT_TIMEOUT_S, env=env, check=False)
        if argv[1] == "install" and done.returncode == 0 and shutil.which("iptables"):
            return
    raise NetnsUnavailable(f"iptables is missing and apt-get could not install it: {done.stderr.strip()[-2000:]}")


class _Builder:
    def __init__(self, tag: str) -> None:
        self.prefix = f"murmur-{tag}-{os.getpid()}"
        self.created: list[str] = []

    def namespace(self, name: str) -> str:
        ns = f"{self.prefix}-{name}"
        _run(["ip", "netns", "add", ns], "creating a network namespace")
        self.created.append(ns)
        _run(["ip", "-n", ns, "link", "set", "lo", "up"], "bringing up loopback")
        return ns

    def veth(self, ns_a: str, dev_a: str, ns_b: str, dev_b: str) -> None:
        """A veth pair created inside `ns_a`, its peer moved straight into `ns_b`: never in the host's."""
        _run(["ip", "-n", ns_a, "link", "add", dev_a, "type", "veth", "peer", "name", dev_b, "netns", ns_b],
             "creating a veth pair")

    def cleanup(self) -> None:
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=_COMMAND_TIMEOUT_S, check=False)


def _up(ns: str, dev: str, address: str | None = None) -> None:
    if address is not None:
        _run(["ip", "-n", ns, "addr", "add", address, "dev", dev], "addressing a device")
    _run(["ip", "-n", ns, "link", "set", dev, "up"], "bringing a device up")


def _shape(ns: str, dev: str, rate_mbit: float) -> None:
    _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate_mbit:g}mbit",
          "burst", TBF_BURST, "latency", TBF_LATENCY], f"rate-limiting {dev} with tbf at {rate_mbit:g} Mbit/s")


def _router_rules(ns: str) -> None:
    """A home router: MASQUERADE out of `wan`; forward lan->wan and established replies only; drop new
    connections to the router itself from the wan."""
    ipt = ["ip", "netns", "exec", ns, "iptables", "-w"]
    _run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1"], "enabling forwarding")
    for rule in (["-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE"],
                 ["-P", "FORWARD", "DROP"],
                 ["-A", "FORWARD", "-i", "lan", "-o", "wan", "-j", "ACCEPT"],
                 ["-A", "FORWARD", "-i", "wan", "-o", "lan", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
                  "-j", "ACCEPT"],
                 ["-A", "INPUT", "-i", "wan", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
                 ["-A", "INPUT", "-i", "wan", "-j", "DROP"]):
        _run([*ipt, *rule], "installing the NAT router's rules")


@contextlib.contextmanager
def internet(tag: str, *, publics: int = 1, homes: int = 2, rate_mbit: float | None = None) -> Iterator[Internet]:
    """Build the namespaces, yield the hosts, delete everything on exit (also on failure).

    `rate_mbit` shapes every host's uplink and every router's downlink (tbf on egress), so each path
    between two hosts is limited to that rate in both directions.
    """
    ensure_iptables()
    remove_orphaned_namespaces()
    if publics + homes > 80:
        raise ValueError("at most 80 hosts")
    build = _Builder(tag)
    try:
        wan = build.namespace("wan")
        _run(["ip", "-n", wan, "link", "add", "name", "wanbr", "type", "bridge"], "creating the wan bridge")
        _up(wan, "wanbr")
        public_hosts = []
        for i in range(publics):
            ns, address = build.namespace(f"pub{i}"), f"{WAN_SUBNET}.{10 + i}"
            build.veth(ns, "eth0", wan, f"p{i}")
            _up(ns, "eth0", f"{address}/24")
            _run(["ip", "-n", wan, "link", "set", f"p{i}", "master", "wanbr"], "attaching a host to the bridge")
            _up(wan, f"p{i}")
            if rate_mbit is not None:
                _shape(ns, "eth0", rate_mbit)
                _shape(wan, f"p{i}", rate_mbit)
            public_hosts.append(Host(f"pub{i}", ns, address))
        home_list = []
        for j in range(homes):
            router, home = build.namespace(f"rtr{j}"), build.namespace(f"home{j}")
            wan_address, lan = f"{WAN_SUBNET}.{100 + j}", f"192.168.{j + 1}"
            build.veth(router, "wan", wan, f"r{j}")
            _up(router, "wan", f"{wan_address}/24")
            _run(["ip", "-n", wan, "link", "set", f"r{j}", "master", "wanbr"], "attaching a router to the bridge")
            _up(wan, f"r{j}")
            build.veth(router, "lan", home, "eth0")
            _up(router, "lan", f"{lan}.1/24")
            _up(home, "eth0", f"{lan}.2/24")
            _run(["ip", "-n", home, "route", "add", "default", "via", f"{lan}.1"], "routing the home via its router")
            _router_rules(router)
            if rate_mbit is not None:
                _shape(home, "eth0", rate_mbit)
                _shape(wan, f"r{j}", rate_mbit)
            home_list.append(Home(Host(f"home{j}", home, f"{lan}.2"), Host(f"rtr{j}", router, wan_address)))
        yield Internet(tuple(public_hosts), tuple(home_list), rate_mbit)
    finally:
        build.cleanup()


def tcp_connects(address: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether a TCP connection to address:port opens (run inside a namespace with Host.call_inside)."""
    try:
        with socket.create_connection((address, port), timeout=timeout_s):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def tcp_listener(host: Host) -> Iterator[int]:
    """A TCP listener on `host`'s address (in its namespace) that accepts in the kernel; yields its port."""

    def listen() -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((host.address, 0))
        sock.listen(8)
        return sock

    sock = host.call_inside(listen)
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


# ---- murmur processes on the hosts ------------------------------------------------------------------

MURMUR = str(Path(sys.executable).with_name("murmur"))
READY_TIMEOUT_S = 120.0
_BOOTSTRAP_READY = re.compile(r"^murmur: bootstrap peer (\S+) ready; maddrs (.*)$", re.MULTILINE)


@dataclass
class NatNode:
    """One `murmur` process on a host: its argv, log, and what its ready line said."""

    name: str
    host: Host
    process: subprocess.Popen[bytes]
    log: Path
    peer_id: str = ""
    monitor_url: str = ""
    maddrs: tuple[str, ...] = ()
    invite: str = ""  # NAME@FOUNDER_PEER_ID, from a founder's ready line

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, lines: int = 40) -> str:
        return f"--- {self.name} on {self.host.name} ---\n" + "\n".join(self.output().splitlines()[-lines:])

    def maddr(self) -> str:
        """Its full multiaddr on the host's own address (what others pass to --peers / --relays)."""
        return next(m for m in self.maddrs if m.startswith(f"/ip4/{self.host.address}/"))

    def status(self) -> dict[str, Any]:
        """The node's /api/status, read from inside its namespace (its monitor is on that 127.0.0.1)."""
        def get() -> dict[str, Any]:
            with urllib.request.urlopen(f"{self.monitor_url}/api/status", timeout=10) as response:
                answer: dict[str, Any] = json.load(response)
            return answer

        return self.host.call_inside(get)

    def metrics(self) -> str:
        """The node's /metrics (Prometheus text), read from inside its namespace."""
        def get() -> str:
            with urllib.request.urlopen(f"{self.monitor_url}/metrics", timeout=10) as response:
                return str(response.read().decode())

        return self.host.call_inside(get)


class NatProcesses:
    """The murmur processes of a test, each in its own session, so leaving kills all of them (SIGKILL
    to each process group) even when the test failed."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.nodes: list[NatNode] = []

    def start(self, name: str, host: Host, argv: Sequence[str], env: dict[str, str] | None = None) -> NatNode:
        log = self.root / f"{name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(host.command([MURMUR, *argv]), stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        node = NatNode(name, host, process, log)
        self.nodes.append(node)
        return node

    def wait_ready(self, node: NatNode, timeout_s: float = READY_TIMEOUT_S) -> NatNode:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = node.output()
            ready = find_ready_line(text)
            if ready is not None:
                node.peer_id, node.monitor_url, node.maddrs = ready.peer_id, ready.monitor_url, ready.maddrs
                node.invite = ready.invite
                return node
            boot = _BOOTSTRAP_READY.search(text)
            if boot is not None:
                node.peer_id, node.maddrs = boot[1], tuple(boot[2].split())
                return node
            if node.process.poll() is not None:
                raise AssertionError(f"{node.name} exited with {node.process.returncode}\n{node.tail()}")
            time.sleep(0.2)
        raise AssertionError(f"{node.name} not ready within {timeout_s:g} s\n{node.tail()}")

    def kill(self, node: NatNode) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.process.pid, signal.SIGKILL)
        node.process.wait(10)

    def close(self) -> None:
        for node in self.nodes:
            if node.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(node.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 8
        for node in self.nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.process.wait(max(0.1, deadline - time.monotonic()))
            if node.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(node.process.pid, signal.SIGKILL)
                node.process.wait(10)

    def logs(self) -> str:
        return "\n".join(node.tail() for node in self.nodes)


def forward_port(home: Home, port: int) -> None:
    """Forward TCP `port` of the home's router (its wan address) to the same port of the home's host:
    what a volunteer configures on a home router, for the direct baseline of bench/bench_relay.py."""
    ipt = ["ip", "netns", "exec", home.router.namespace, "iptables", "-w"]
    _run([*ipt, "-t", "nat", "-A", "PREROUTING", "-i", "wan", "-p", "tcp", "--dport", str(port), "-j", "DNAT",
          "--to-destination", f"{home.host.address}:{port}"], "forwarding a port")
    _run([*ipt, "-I", "FORWARD", "-i", "wan", "-o", "lan", "-p", "tcp", "-d", home.host.address, "--dport", str(port),
          "-j", "ACCEPT"], "letting the forwarded port through")
