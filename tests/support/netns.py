"""Two network namespaces joined by a veth pair, optionally rate-limited with `tc tbf`: two "hosts" on
one machine for the multi-process tests and the exchange benchmarks (needs root, `ip` and `tc`).

The addresses (10.77.<x>.1 and .2) exist only inside the namespaces, so nothing reaches the host's
own interfaces. Names carry the creating process's pid and a tag, so concurrent runs do not collide.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

TBF_BURST = "256kb"
TBF_LATENCY = "50ms"
_COMMAND_TIMEOUT_S = 10.0
_CLONE_NEWNET = 0x40000000

T = TypeVar("T")


class NetnsUnavailable(RuntimeError):
    """The namespaces, the veth pair or the rate limit could not be set up (no root, no `tc`, no tbf...)."""


@dataclass(frozen=True)
class VethLink:
    """Side 0 and side 1 of the link: namespace, device inside it, and its IPv4 address."""

    namespaces: tuple[str, str]
    devices: tuple[str, str]
    addresses: tuple[str, str]
    rate_mbit: float | None  # the tbf rate on the limited sides; None: no limit
    limited_sides: tuple[int, ...]  # sides whose egress (traffic *from* that side) is rate-limited

    def command(self, side: int, argv: Sequence[str]) -> list[str]:
        """`argv` run inside side `side`'s namespace (`ip netns exec` execs it: the pid is argv's own)."""
        return ["ip", "netns", "exec", self.namespaces[side], *argv]

    def tcp_maddr(self, side: int, port: int = 0) -> str:
        return f"/ip4/{self.addresses[side]}/tcp/{port}"

    def call_inside(self, side: int, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on a fresh thread moved into side `side`'s namespace (sockets it opens live there).

        A network namespace belongs to a thread, not a process, so this costs no process start; the
        thread ends with the call, so no other code ever runs inside the namespace by accident.
        """
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            return pool.submit(_call_in_namespace, f"/run/netns/{self.namespaces[side]}", fn, args).result()


def _call_in_namespace(path: str, fn: Callable[..., T], args: tuple[object, ...]) -> T:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({path})")
    finally:
        os.close(fd)
    return fn(*args)


def _run(argv: Sequence[str], what: str) -> None:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsUnavailable(f"{what}: `{' '.join(argv)}` failed: {exc}") from None
    if done.returncode != 0:
        raise NetnsUnavailable(f"{what}: `{' '.join(argv)}` exited {done.returncode}: {done.stderr.strip()}")


_OURS = re.compile(r"^murmur-[A-Za-z0-9]+-(\d+)-")


def remove_orphaned_namespaces() -> list[str]:
    """Delete the namespaces an earlier test or bench process left behind (it was killed before its
    cleanup ran): ours are named murmur-<tag>-<pid>-..., and a namespace whose pid no longer runs has no
    owner. A live pid keeps its namespaces (another run, or a reused pid: left alone). Returns what went."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S,
                            check=False)
    removed = []
    for line in listed.stdout.splitlines():
        name = line.split(" ", 1)[0]
        match = _OURS.match(name)
        if match is None or _pid_runs(int(match.group(1))):
            continue
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=_COMMAND_TIMEOUT_S, check=False)
        removed.append(name)
    return removed


def _pid_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _require_tools() -> None:
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetnsUnavailable(f"{' and '.join(missing)} not found: install iproute2")
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root")


@contextlib.contextmanager
def veth_link(
    tag: str, *, rate_mbit: float | None = None, limited_sides: tuple[int, ...] = (0,)
) -> Iterator[VethLink]:
    """Create the namespaces and the link, yield it, and delete both on exit (also on failure).

    `tag` (a few letters) tells apart several links of one process. A rate limit that cannot be
    installed (no `sch_tbf` in the kernel) raises NetnsUnavailable rather than leaving the link fast.
    """
    _require_tools()
    remove_orphaned_namespaces()
    pid = os.getpid()
    subnet = f"10.77.{pid % 250 + 1}"
    link = VethLink(
        namespaces=(f"murmur-{tag}-{pid}-a", f"murmur-{tag}-{pid}-b"),
        devices=(f"mv{pid}{tag}a"[:15], f"mv{pid}{tag}b"[:15]),  # interface names are at most 15 bytes
        addresses=(f"{subnet}.1", f"{subnet}.2"),
        rate_mbit=rate_mbit,
        limited_sides=limited_sides if rate_mbit is not None else (),
    )
    if link.devices[0] == link.devices[1]:
        raise ValueError(f"tag {tag!r} is too long for interface names")
    created: list[str] = []
    try:
        for ns in link.namespaces:
            _run(["ip", "netns", "add", ns], "creating a network namespace")
            created.append(ns)
            _run(["ip", "-n", ns, "link", "set", "lo", "up"], "bringing up loopback in the namespace")
        # create the pair inside side 0's namespace, so no end ever appears among the host's interfaces
        _run(["ip", "-n", link.namespaces[0], "link", "add", link.devices[0], "type", "veth",
              "peer", "name", link.devices[1], "netns", link.namespaces[1]], "creating the veth pair")
        for side in (0, 1):
            ns, dev = link.namespaces[side], link.devices[side]
            _run(["ip", "-n", ns, "addr", "add", f"{link.addresses[side]}/24", "dev", dev], "addressing the veth end")
            _run(["ip", "-n", ns, "link", "set", dev, "up"], "bringing up the veth end")
        for side in link.limited_sides:
            _run(link.command(side, ["tc", "qdisc", "add", "dev", link.devices[side], "root", "tbf",
                                     "rate", f"{rate_mbit:g}mbit", "burst", TBF_BURST, "latency", TBF_LATENCY]),
                 f"rate-limiting with the tbf qdisc (is sch_tbf in this kernel?) at {rate_mbit:g} Mbit/s")
        yield link
    finally:
        for ns in reversed(created):
            # deleting the namespace destroys the veth end inside it, and with it the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=_COMMAND_TIMEOUT_S, check=False)
