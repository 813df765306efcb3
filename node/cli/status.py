"""`murmur status`: read a running node's monitor API (`/api/status`) and report it; and how the
commands that ask a running node (status, eval, doctor, export) find its monitor and token."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from node.cli.args import PRECEDENCE, add_config_flag, add_setting_flag, resolve
from node.config import SETTINGS_BY_KEY, Command, ConfigError
from node.config.settings import MONITOR_TOKEN_FILE

TIMEOUT_S = 5.0


def auth_headers(token: str | None) -> dict[str, str]:
    """The header that carries a node's monitor token (its POST endpoints need it)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def post_monitor(url: str, timeout_s: float, token: str | None, refused: type[Exception]) -> dict[str, Any]:
    """A node's JSON answer to a POST at `url` (its monitor token in the request: POSTs need it); an
    error answer raises `refused` with the node's message; URLError, OSError or ValueError otherwise."""
    request = urllib.request.Request(url, data=b"", method="POST", headers=auth_headers(token))
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            answer: dict[str, Any] = json.load(response)
    except urllib.error.HTTPError as exc:
        try:
            message = json.load(exc)["error"]
        except (ValueError, KeyError, TypeError):
            message = f"HTTP {exc.code} {exc.reason}"
        raise refused(message) from None
    return answer


def fetch_status(url: str, token: str | None = None) -> dict[str, Any]:
    """The node's `/api/status` answer; raises URLError, OSError or ValueError."""
    request = urllib.request.Request(f"{url.rstrip('/')}/api/status", headers=auth_headers(token))
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        status: dict[str, Any] = json.load(response)
    return status


def _figure(value: float | None, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}g}"


def _duration(seconds: float) -> str:
    s = int(seconds)
    hours, minutes = divmod(s // 60, 60)
    return f"{hours} h {minutes} min" if hours else f"{minutes} min {s % 60} s" if minutes else f"{s} s"


def format_status(status: dict[str, Any]) -> str:
    """The human-readable report: one aligned line per topic."""
    lines = [f"peer     {status['peer_id']}", f"swarm    {status['swarm']}"]
    if status.get("invite"):
        behind = status.get("config_not_followed")
        lines.append(f"invite   {status['invite']}   (config version {status.get('config_version')}, admission "
                     f"{status.get('admission')}{'; not following ' + behind if behind else ''})")
    lines += [f"address  {addr}" for addr in status["maddrs"]]
    lines.append(f"round    {status['round']}   step {status['step']}   peers {len(status['peers'])}")
    if status.get("loss") is not None or status.get("training"):
        lines.append(f"loss     {_figure(status.get('loss'))}   val loss {_figure(status.get('val_loss'))}   "
                     f"tokens/s {_figure(status.get('tokens_per_s'), 3)}")
    else:
        lines.append("loss     n/a (vector mode: no model is trained)")
    join = status.get("join")
    if join:  # a catch-up's downloads are running (node.swarm.joining.JoinProgress)
        share = join["bytes_done"] / join["bytes_total"] if join["bytes_total"] else 0.0
        eta = f", {_duration(join['eta_s'])} left" if join.get("eta_s") is not None else ""
        lines.append(f"download {join['bytes_done'] / 1e6:.1f} / {join['bytes_total'] / 1e6:.1f} MB ({100 * share:.0f}%) "
                     f"at {join['rate_bps'] / 1e6:.2f} MB/s{eta} from {', '.join(join['donors'])}")
    if status.get("consensus_distance") is not None:
        lines.append(f"consensus distance {_figure(status['consensus_distance'])}")
    experts = status.get("experts") or []
    spes = status.get("spes") or {}
    if experts or spes:
        capacity = f"   (SPES capacity {spes['capacity']} per layer)" if spes.get("capacity") is not None else ""
        lines.append(f"experts  {', '.join(map(str, experts)) or 'none yet'}{capacity}")
    memory = status.get("memory")
    if memory:
        lines.append(f"memory   ~{memory['host_bytes'] / 2**30:.1f} GiB RAM ({memory['host_bytes_per_parameter']:g} B/param), "
                     f"~{memory['device_bytes'] / 2**30:.1f} GiB GPU ({memory['device_bytes_per_parameter']:g} B/param) "
                     f"for {memory['parameters']:,} parameters")
    # a joiner's guided-join checks as it printed them at start (node.runtime.guide)
    lines += [f"joined   {c['check']:<6} {c['verdict']}: {c['text']}" for c in status.get("preflight") or []]
    lines += _reach_lines(status.get("reachability"))
    for peer in status["peers"]:
        if peer.get("connection"):
            goodput = peer.get("goodput_mbit_s")
            rate = f"   goodput {goodput:.3g} Mbit/s" if goodput is not None else ""
            lines.append(f"link     {peer['peer_id']}   {peer['connection']}{rate}")
    for peer, entry in sorted((status.get("contribution") or {}).items()):
        lines.append(f"score    {peer}   {entry['score']:+.2f} over {entry['rated_rounds']} rounds   {entry['state']}")
    lines.append(f"traffic  {status['bytes_sent']:,} bytes sent, {status['bytes_received']:,} received")
    errors = ", ".join(f"{kind}: {n}" for kind, n in sorted(status["errors"].items())) or "none"
    lines.append(f"errors   {errors}")
    if "uptime_s" in status:
        lines.append(f"uptime   {_duration(status['uptime_s'])}")
    if status.get("monitor_url"):
        lines.append(f"monitor  {status['monitor_url']}")
    return "\n".join(lines)


def _reach_lines(reach: dict[str, Any] | None) -> list[str]:
    """Whether peers can dial the node, through which relays, and its relay service."""
    if not reach:
        return []
    if reach["reach"] == "public":
        lines = [f"reach    directly ({reach['detail']})"]
    elif reach["reach"] == "unknown":
        lines = [f"reach    unknown ({reach['detail']})"]
    else:
        held = [r["peer_id"] for r in reach["relays"] if r["held"]]
        lines = [f"reach    behind NAT: through {len(held)} relay(s)" + (f": {', '.join(held)}" if held else
                                                                        " - peers cannot dial this node")]
        for relay in reach["relays"]:
            if relay["lost_at"] is not None and not relay["held"]:
                lost = time.strftime("%H:%M:%S", time.localtime(relay["lost_at"]))
                lines.append(f"relay    {relay['peer_id']} LOST at {lost}")
            elif relay["circuit"] == "limited":
                lines.append(f"relay    {relay['peer_id']} cuts circuits after 128 KiB (p2pd's default limits)")
    service = reach.get("relay_service")
    if service is not None:
        state = {True: "limits in force", False: "LIMITS NOT IN FORCE", None: "not checked yet"}[service["limits_in_force"]]
        lines.append(f"relaying {state} ({service['data_limit_bytes'] >> 20} MiB, {service['time_limit_s']:g} s "
                     "per circuit)")
    return lines


def no_node(command: str, url: str, exc: Exception) -> int:
    """Say in one line that nothing answers at `url` (for `murmur status` and `murmur eval`); exit 1."""
    reason = getattr(exc, "reason", exc)
    print(f"murmur {command}: error: no node answers at {url} ({reason})", file=sys.stderr)
    return 1


def print_answer(command: str, url: str, answer: dict[str, Any], as_json: bool,
                 format_answer: Callable[[dict[str, Any]], str]) -> int:
    """Print a node's JSON answer as it came (--json) or formatted; an answer the formatter cannot
    read (a node of another version) is one line and exit 1, not a traceback."""
    if as_json:
        print(json.dumps(answer))
        return 0
    try:
        print(format_answer(answer))
    except (KeyError, TypeError) as exc:
        print(f"murmur {command}: error: the node at {url} answered an unexpected {command} ({exc!r})",
              file=sys.stderr)
        return 1
    return 0


def run_status(url: str, as_json: bool, token: str | None = None) -> int:
    try:
        status = fetch_status(url, token)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return no_node("status", url, exc)
    return print_answer("status", url, status, as_json, format_status)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    status = commands.add_parser(
        Command.STATUS, help="report a running node", epilog=PRECEDENCE,
        description="Report a running node from its monitor's JSON API: peer id, swarm, multiaddrs, peers, "
        "step, round, bytes sent and received, errors. Without --url it asks the monitor at "
        "http://MONITOR-HOST:MONITOR-PORT.",
    )
    add_monitor_target(status)
    status.add_argument("--json", action="store_true",
                        help="print one JSON object: peer_id, swarm, maddrs, peers, step, round, bytes_sent, "
                        "bytes_received, errors")
    status.set_defaults(run=_run_status)


def _run_status(args: argparse.Namespace) -> int:
    url = status_url(args, os.environ)
    return run_status(url, args.json, token=monitor_token(args, os.environ, url))


def add_monitor_target(parser: argparse.ArgumentParser) -> None:
    """The flags that find a running node (`status`, `eval`, `doctor`): its monitor's port and host, or
    --url; and its monitor token (from its data dir, or --token)."""
    add_config_flag(parser)
    target = parser.add_mutually_exclusive_group()
    add_setting_flag(target, SETTINGS_BY_KEY["monitor.port"], help="TCP port of the node's monitor page")
    target.add_argument("--url", help="monitor URL of the node, e.g. http://127.0.0.1:7690 (instead of "
                        "--monitor-host/--monitor-port)")
    add_setting_flag(parser, SETTINGS_BY_KEY["monitor.host"], help="host of the node's monitor page")
    add_setting_flag(parser, SETTINGS_BY_KEY["data_dir"], help="the node's data directory, where its monitor "
                     "token is (monitor.token)")
    parser.add_argument("--token", help="the node's monitor token (default: read from <data-dir>/monitor.token; "
                        "a node's POST endpoints need it)")


def status_url(args: argparse.Namespace, env: Mapping[str, str]) -> str:
    """The monitor URL a parsed `status` or `eval` command line asks; raises ConfigError."""
    if args.url is not None:
        if SETTINGS_BY_KEY["monitor.host"].dest in vars(args):
            raise ConfigError("--monitor-host cannot be combined with --url")
        url = urllib.parse.urlsplit(args.url)
        try:
            url.port  # noqa: B018 - raises ValueError for a port that is not a number in range
        except ValueError as exc:
            raise ConfigError(f"--url: {args.url!r} has a bad port: {exc}") from None
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ConfigError(f"--url: {args.url!r} is not an http(s) URL like http://127.0.0.1:7690")
        return str(args.url).rstrip("/")
    resolved = resolve(args, env)
    if resolved.config.monitor.port == 0:
        raise ConfigError(f"{resolved.source('monitor.port')}: port 0 means the node picked a free port; "
                          "pass the port it reported with --monitor-port, or --url")
    return resolved.config.monitor.url


def monitor_token(args: argparse.Namespace, env: Mapping[str, str], url: str) -> str | None:
    """The monitor token a parsed `status`, `eval` or `doctor` command line sends: --token, else the one in the
    data directory. The data directory's token goes only to a loopback URL unless the data directory
    was named (flag, environment, config file): a node elsewhere must not learn this machine's token."""
    if args.token is not None:
        return str(args.token).strip()
    resolved = resolve(args, env)
    if "data_dir" in resolved.sources:
        return _read_token(resolved.config.data_dir)
    return loopback_token(url, resolved.config.data_dir)


def loopback_token(url: str, data_dir: Path) -> str | None:
    """The token in `data_dir`, if `url` is on this machine's loopback (else None: not sent elsewhere)."""
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if host not in ("localhost", "::1") and not host.startswith("127."):
        return None
    return _read_token(data_dir)


def _read_token(data_dir: Path) -> str | None:
    try:
        return (data_dir / MONITOR_TOKEN_FILE).read_text().strip() or None
    except OSError:
        return None
