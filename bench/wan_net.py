"""An emulated WAN for the benchmarks: N "home" network namespaces joined through one hub namespace, with
shaped links and a one-way delay.

Each home is joined to the hub by a veth pair shaped with tbf in both directions (the home's uplink and
downlink); a user-space relay in the hub (bench/wan_relay.py) adds the delay, since this kernel has no
netem.

Addresses exist only inside the namespaces: home i is 10.80.i.2, its hub leg 10.80.i.1; the hub also holds
the service address 10.81.0.1, where the relay listens on port RELAY_BASE_PORT + i for home i and forwards
to home i's listener. Homes route only to the hub (which does not forward), so every connection between
homes goes through the relay and its delay. Nothing touches the host's namespace; names carry a tag and
the creating process's pid, and everything is deleted on exit. Needs root, `ip` and `tc`.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from tests.support.netns import NetnsUnavailable, _call_in_namespace, _require_tools, _run, remove_orphaned_namespaces

T = TypeVar("T")
SERVICE_ADDRESS = "10.81.0.1"
RELAY_BASE_PORT = 20000
HOME_PORT = 31337  # each home's p2pd listens here, inside its own namespace
TBF_BURST = "64kb"  # about 25 ms at 20 Mbit/s
TBF_LATENCY = "100ms"  # the queue tbf keeps before it drops: what a home router buffers
_COMMAND_TIMEOUT_S = 10.0

__all__ = ["HOME_PORT", "NetnsUnavailable", "Wan", "wan"]


@dataclass(frozen=True)
class Wan:
    hub: str
    homes: tuple[str, ...]
    rate_mbit: float
    delay_ms: float

    def home_address(self, i: int) -> str:
        return f"10.80.{i + 1}.2"

    def hub_leg(self, i: int) -> str:
        return f"10.80.{i + 1}.1"

    def relay_port(self, i: int) -> int:
        return RELAY_BASE_PORT + i

    def listen_maddr(self, i: int, port: int = HOME_PORT) -> str:
        return f"/ip4/{self.home_address(i)}/tcp/{port}"

    def announce_maddr(self, i: int) -> str:
        """Where other homes reach home i: its port on the relay."""
        return f"/ip4/{SERVICE_ADDRESS}/tcp/{self.relay_port(i)}"

    def routes(self, port: int = HOME_PORT) -> list[tuple[str, int, str, int]]:
        """(listen host, listen port, target host, target port) of every relay route."""
        return [(SERVICE_ADDRESS, self.relay_port(i), self.home_address(i), port) for i in range(len(self.homes))]

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.homes[i], *argv]

    def hub_command(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.hub, *argv]

    def call_inside(self, i: int, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on a thread moved into home i's namespace (for its monitor on its own loopback)."""
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            return pool.submit(_call_in_namespace, f"/run/netns/{self.homes[i]}", fn, args).result()


@contextlib.contextmanager
def wan(tag: str, homes: int, *, rate_mbit: float, delay_ms: float) -> Iterator[Wan]:
    """Create the hub and `homes` homes, shape every leg at `rate_mbit` both ways; delete all on exit.
    The relay that adds `delay_ms` is started by the caller (bench/wan_relay.py) in `hub`."""
    _require_tools()
    remove_orphaned_namespaces()  # of a bench run killed before its cleanup
    if not 1 <= homes <= 200:
        raise ValueError(f"between 1 and 200 homes, got {homes}")
    pid = os.getpid()
    net = Wan(hub=f"murmur-{tag}-{pid}-hub", homes=tuple(f"murmur-{tag}-{pid}-h{i}" for i in range(homes)),
              rate_mbit=rate_mbit, delay_ms=delay_ms)
    created: list[str] = []
    try:
        for ns in (net.hub, *net.homes):
            _run(["ip", "netns", "add", ns], "creating a network namespace")
            created.append(ns)
            _run(["ip", "-n", ns, "link", "set", "lo", "up"], "bringing up loopback")
        _run(["ip", "-n", net.hub, "addr", "add", f"{SERVICE_ADDRESS}/32", "dev", "lo"], "the relay's address")
        for i, home in enumerate(net.homes):
            hub_dev, home_dev = f"wh{pid % 100000}{tag}{i}"[:15], f"wm{pid % 100000}{tag}{i}"[:15]
            # created inside the hub, the home end moved straight into its namespace: never in the host's
            _run(["ip", "-n", net.hub, "link", "add", hub_dev, "type", "veth", "peer", "name", home_dev,
                  "netns", home], "creating a veth pair")
            _run(["ip", "-n", net.hub, "addr", "add", f"{net.hub_leg(i)}/24", "dev", hub_dev], "addressing the hub leg")
            _run(["ip", "-n", home, "addr", "add", f"{net.home_address(i)}/24", "dev", home_dev], "addressing the home")
            _run(["ip", "-n", net.hub, "link", "set", hub_dev, "up"], "bringing up the hub leg")
            _run(["ip", "-n", home, "link", "set", home_dev, "up"], "bringing up the home end")
            _run(["ip", "-n", home, "route", "add", f"{SERVICE_ADDRESS}/32", "via", net.hub_leg(i)], "routing to the relay")
            for ns, dev in ((home, home_dev), (net.hub, hub_dev)):  # the home's uplink, then its downlink
                _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                      f"{rate_mbit:g}mbit", "burst", TBF_BURST, "latency", TBF_LATENCY],
                     f"shaping with tbf at {rate_mbit:g} Mbit/s")
        yield net
    finally:
        for ns in reversed(created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=_COMMAND_TIMEOUT_S, check=False)
