"""The line a node prints on stdout once it serves (`murmur: peer ID in swarm 'NAME' ready; monitor
URL; invite NAME@FOUNDER; maddrs ...`), and its parser, for what starts nodes and waits for them:
`murmur demo`, the tests. A node that follows a new config of its swarm prints it again."""

from __future__ import annotations

import re
from dataclasses import dataclass

_PATTERN = re.compile(r"^murmur: peer (\S+) in swarm '([^']*)' ready; monitor (\S+); invite (\S+); maddrs (.*)$",
                      re.MULTILINE)


@dataclass(frozen=True)
class ReadyLine:
    peer_id: str
    swarm: str
    monitor_url: str
    maddrs: tuple[str, ...]  # where `murmur join --peers` reaches the node's DHT
    invite: str = ""  # NAME@FOUNDER_PEER_ID: what `murmur join --invite` takes


def format_ready_line(peer_id: str, swarm: str, monitor_url: str, maddrs: tuple[str, ...], invite: str) -> str:
    return (f"murmur: peer {peer_id} in swarm '{swarm}' ready; monitor {monitor_url}; invite {invite}; "
            f"maddrs {' '.join(maddrs)}")


def find_ready_line(output: str, latest: bool = False) -> ReadyLine | None:
    """The first (or, with `latest`, the last) ready line in a node's output so far; None while it is not ready."""
    matches = list(_PATTERN.finditer(output))
    if not matches:
        return None
    found = matches[-1] if latest else matches[0]
    return ReadyLine(found[1], found[2], found[3], tuple(found[5].split()), found[4])
