"""The line a node prints on stdout once it serves (`murmur: peer ID in swarm 'NAME' ready; monitor
URL; maddrs ...`), and its parser, for what starts nodes and waits for them: `murmur demo`, the tests."""

from __future__ import annotations

import re
from dataclasses import dataclass

_PATTERN = re.compile(r"^murmur: peer (\S+) in swarm '([^']*)' ready; monitor (\S+); maddrs (.*)$", re.MULTILINE)


@dataclass(frozen=True)
class ReadyLine:
    peer_id: str
    swarm: str
    monitor_url: str
    maddrs: tuple[str, ...]  # where `murmur join --peers` reaches the node's DHT


def format_ready_line(peer_id: str, swarm: str, monitor_url: str, maddrs: tuple[str, ...]) -> str:
    return f"murmur: peer {peer_id} in swarm '{swarm}' ready; monitor {monitor_url}; maddrs {' '.join(maddrs)}"


def find_ready_line(output: str) -> ReadyLine | None:
    """The first ready line in a node's output so far; None while it is not ready."""
    found = _PATTERN.search(output)
    if found is None:
        return None
    return ReadyLine(found[1], found[2], found[3], tuple(found[4].split()))
