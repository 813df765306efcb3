"""`murmur status`: read a running node's local API and report it."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request

TIMEOUT_S = 5.0


def fetch_status(url: str) -> dict:
    with urllib.request.urlopen(f"{url.rstrip('/')}/api/status", timeout=TIMEOUT_S) as response:
        return json.load(response)


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
    print(f"peer     {status['peer_id']}")
    print(f"swarm    {status['swarm']}")
    for addr in status["maddrs"]:
        print(f"address  {addr}")
    print(f"round    {status['round']}   step {status['step']}   peers {len(status['peers'])}")
    print(f"traffic  {status['bytes_sent']:,} bytes sent, {status['bytes_received']:,} received")
    errors = ", ".join(f"{kind}: {n}" for kind, n in sorted(status["errors"].items())) or "none"
    print(f"errors   {errors}")
    return 0
