"""`murmur status`: read a running node's monitor API (`/api/status`) and report it."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from typing import Any

TIMEOUT_S = 5.0


def fetch_status(url: str) -> dict:
    with urllib.request.urlopen(f"{url.rstrip('/')}/api/status", timeout=TIMEOUT_S) as response:
        return json.load(response)


def _figure(value: float | None, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}g}"


def _duration(seconds: float) -> str:
    s = int(seconds)
    hours, minutes = divmod(s // 60, 60)
    return f"{hours} h {minutes} min" if hours else f"{minutes} min {s % 60} s" if minutes else f"{s} s"


def format_status(status: dict[str, Any]) -> str:
    """The human-readable report: one aligned line per topic."""
    lines = [f"peer     {status['peer_id']}", f"swarm    {status['swarm']}"]
    lines += [f"address  {addr}" for addr in status["maddrs"]]
    lines.append(f"round    {status['round']}   step {status['step']}   peers {len(status['peers'])}")
    if status.get("loss") is not None or status.get("training"):
        lines.append(f"loss     {_figure(status.get('loss'))}   val loss {_figure(status.get('val_loss'))}   "
                     f"tokens/s {_figure(status.get('tokens_per_s'), 3)}")
    else:
        lines.append("loss     n/a (vector mode: no model is trained)")
    if status.get("consensus_distance") is not None:
        lines.append(f"consensus distance {_figure(status['consensus_distance'])}")
    experts = status.get("experts") or []
    if experts:
        lines.append(f"experts  {', '.join(map(str, experts))}")
    lines.append(f"traffic  {status['bytes_sent']:,} bytes sent, {status['bytes_received']:,} received")
    errors = ", ".join(f"{kind}: {n}" for kind, n in sorted(status["errors"].items())) or "none"
    lines.append(f"errors   {errors}")
    if "uptime_s" in status:
        lines.append(f"uptime   {_duration(status['uptime_s'])}")
    if status.get("monitor_url"):
        lines.append(f"monitor  {status['monitor_url']}")
    return "\n".join(lines)


def run_status(url: str, as_json: bool) -> int:
    try:
        status = fetch_status(url)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        print(f"murmur status: error: no node answers at {url} ({reason})", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(status))
        return 0
    try:
        print(format_status(status))
    except (KeyError, TypeError) as exc:
        print(f"murmur status: error: the node at {url} answered an unexpected status ({exc!r})", file=sys.stderr)
        return 1
    return 0
