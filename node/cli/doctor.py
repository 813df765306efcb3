"""`murmur doctor`: can peers reach this node, through what, and how fast?

For a running node (`--url` / `--monitor-port`) it asks the node's monitor (`POST /api/doctor`): the node
asks peers to dial it back, pushes a probe through each relay's circuit, checks its own relay service
and measures each neighbour. Before joining (`--peers`) it starts a throwaway p2pd with the node's
network flags and runs the same checks against the given peers and relays. Either way it prints a
verdict and one line of advice per problem found; docs/deploy.md says what each answer means.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import json
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from node.cli.args import PRECEDENCE, UsageError, add_setting_flag, number, resolve
from node.cli.status import add_monitor_target, monitor_token, no_node, post_monitor, status_url
from node.config import SETTINGS_BY_KEY, Command, NodeConfig

DEFAULT_TIMEOUT_S = 120.0
_LIMITED = "cuts circuits after 128 KiB (p2pd's default relay limits), too little for model exchanges"
_RELAY_HINT = "a `murmur bootstrap` or a public `murmur node --relay-service`"


class Verdict(enum.StrEnum):
    PUBLIC = "public"  # peers dial it directly
    RELAYED = "relayed"  # behind NAT, dialled through a relay whose circuits carry model exchanges
    UNREACHABLE = "unreachable"  # behind NAT and no usable relay: peers cannot dial it
    UNKNOWN = "unknown"  # no peer could check


VERDICT_WORDS = {
    Verdict.PUBLIC: "reachable directly",
    Verdict.RELAYED: "reachable through relays (behind NAT)",
    Verdict.UNREACHABLE: "NOT reachable: peers cannot dial this node",
    Verdict.UNKNOWN: "unknown: no peer could check whether this node is reachable",
}


@dataclass(frozen=True)
class Diagnosis:
    verdict: Verdict
    advice: tuple[str, ...]


class DoctorRefused(Exception):
    """The node answered with an error (an older node, a check already running)."""


def _ports(report: dict[str, Any]) -> str:
    """The TCP ports the node listens on: those to forward (a NAT maps its outgoing ones elsewhere)."""
    return ", ".join(map(str, report.get("ports") or [])) or "its port"


def diagnose(report: dict[str, Any]) -> Diagnosis:
    """The verdict and the advice for a report (a node's `POST /api/doctor` answer, or `check_before_joining`'s)."""
    advice: list[str] = []
    now = report.get("redetected") or {}
    relays = report.get("relays", [])
    carrying = [r for r in relays if r["held"] and r["circuit"] == "carries"]
    if report["reach"] == "private":
        verdict = Verdict.RELAYED if carrying else Verdict.UNREACHABLE
    elif report["reach"] == "public" or now.get("reach") == "public":
        verdict = Verdict.PUBLIC
    else:
        verdict = Verdict.UNKNOWN
    observed = (now.get("observed") or report.get("observed") or ["?"])[0]
    host = observed.split("/")[2] if observed.count("/") >= 2 else "PUBLIC_IP"
    if verdict is Verdict.UNREACHABLE:
        advice.append(f"forward TCP port {_ports(report)} on your router to this machine and restart with "
                      f"--announce /ip4/{host}/tcp/PORT --reachability public, or add a relay: --relays MULTIADDR "
                      f"({_RELAY_HINT})" if relays else
                      f"this node is behind NAT and has no relay: add one with --relays MULTIADDR ({_RELAY_HINT}), "
                      f"or forward TCP port {_ports(report)} on your router and restart with --announce "
                      f"/ip4/{host}/tcp/PORT --reachability public")
    for relay in relays:
        if relay.get("lost_at") is not None and not relay["held"]:
            lost = time.strftime("%H:%M:%S", time.localtime(relay["lost_at"]))
            advice.append(f"relay {relay['peer_id']} was lost at {lost}; p2pd reconnects to it when it is back")
        elif relay["circuit"] == "limited":
            advice.append(f"relay {relay['peer_id']} {_LIMITED}: use {_RELAY_HINT} (docs/deploy.md)")
        elif relay["circuit"] in ("no_slot", "failed") or (relay["circuit"] is None and report["reach"] == "private"):
            advice.append(f"relay {relay['peer_id']} holds no slot for this node ({relay.get('detail') or 'not connected'}): "
                          "is it running, and is the address given to --relays right?")
    if report["reach"] == "public" and now.get("reach") == "private":
        advice.append(f"peers could not dial this node back ({now.get('detail')}): open the firewall for TCP port "
                      f"{_ports(report)} (or forward it on the router), or restart with --reachability auto")
    if verdict is Verdict.UNKNOWN:
        advice.append("no peer answered a dial-back request: give --peers of a bootstrap node (bootstraps dial back)")
    service = report.get("relay_service")
    if service is not None:
        if service["limits_in_force"] is False:
            advice.append(f"this node's relay service {_LIMITED} ({service['detail']}): restart it with "
                          "--reachability public (the configured limits apply only on a node libp2p deems public)")
        if verdict is not Verdict.PUBLIC:
            advice.append("this node serves as a relay but peers cannot dial it directly: relays must be public "
                          "(open or forward its port), or turn the service off (--no-relay-service)")
    for n in report.get("neighbours", []):
        if n.get("error"):
            advice.append(f"neighbour {n['peer_id']} ({n['connection']}) did not answer a probe: {n['error']}")
    return Diagnosis(verdict, tuple(advice))


def _figure(value: float | None, unit: str, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}g} {unit}"


def format_report(report: dict[str, Any]) -> str:
    diagnosis = diagnose(report)
    lines = [f"node       {report.get('peer_id', '?')}", f"verdict    {VERDICT_WORDS[diagnosis.verdict]}"]
    now = report.get("redetected") or {}
    observed = report.get("observed") or now.get("observed") or []
    lines.append(f"observed   {', '.join(observed) or 'n/a (no peer answered)'}")
    lines.append(f"direct     {now.get('reach', report['reach'])}: {now.get('detail') or report.get('detail', '')}")
    for i, relay in enumerate(report.get("relays", [])):
        state = {"carries": "holds a slot; its circuit carries model-sized exchanges",
                 "limited": f"holds a slot but {_LIMITED}", "no_slot": "holds no slot", "failed": "not checked",
                 None: "not connected"}[relay["circuit"]]
        detail = f" ({relay['detail']})" if relay.get("detail") else ""
        lines.append(f"{'relays' if i == 0 else '':<10} {relay['peer_id']} {state}{detail}")
    if not report.get("relays"):
        lines.append("relays     none" + (" (not needed: reachable directly)" if report["reach"] != "private" else ""))
    service = report.get("relay_service")
    if service is not None:
        state = {True: "limits in force", False: "LIMITS NOT IN FORCE", None: "not checked"}[service["limits_in_force"]]
        lines.append(f"relaying   {state}: {service['data_limit_bytes'] >> 20} MiB and {service['time_limit_s']:g} s "
                     f"per circuit ({service['detail']})")
    for n in report.get("neighbours", []):
        lines.append(f"neighbour  {n['peer_id']}  {n['connection']:<11} latency {_figure(n['latency_ms'], 'ms')}  "
                     f"goodput {_figure(n['goodput_mbit_s'], 'Mbit/s')}")
    lines += [f"advice     {line}" for line in diagnosis.advice] or ["advice     none: nothing to fix"]
    return "\n".join(lines)


def _print(report: dict[str, Any], as_json: bool) -> int:
    diagnosis = diagnose(report)
    if as_json:
        print(json.dumps({**report, "verdict": diagnosis.verdict.value, "advice": list(diagnosis.advice)}))
    else:
        print(format_report(report))
    return 0


def request_doctor(url: str, timeout_s: float, token: str | None = None) -> dict[str, Any]:
    """The node's `POST /api/doctor` answer; the request carries its monitor token (POSTs need it)."""
    return post_monitor(f"{url.rstrip('/')}/api/doctor", timeout_s, token, DoctorRefused)


def run_doctor_node(url: str, as_json: bool, timeout_s: float = DEFAULT_TIMEOUT_S, token: str | None = None) -> int:
    """Exit 0 with the report (whatever the verdict), 1 when the node did not answer or refused."""
    try:
        report = request_doctor(url, timeout_s, token)
    except DoctorRefused as exc:
        print(f"murmur doctor: error: the node at {url} refused: {exc}", file=sys.stderr)
        return 1
    except TimeoutError:
        print(f"murmur doctor: error: no answer from {url} within {timeout_s:g} s (--timeout)", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return no_node("doctor", url, exc)
    return _print(report, as_json)


async def check_before_joining(config: NodeConfig) -> dict[str, Any]:
    """The report for a node that would start with `config`'s network settings: a throwaway p2pd (a
    fresh identity) asks the peers to dial it back, reserves at the relays and probes their circuits,
    and measures the peers."""
    from node.net.hivemind_adapter import peer_of
    from node.runtime.host import start_host

    async with contextlib.AsyncExitStack() as stack:
        host = await start_host(config, stack, claim=False)
        neighbours = {peer: [addr] for addr in config.network.initial_peers if (peer := peer_of(addr))}
        report = await host.reach.refresh(config.network.initial_peers, neighbours, lambda _: None, redetect=False)
        report["peer_id"] = host.reach.peer_id
        return report


def run_doctor_before_joining(config: NodeConfig, as_json: bool, timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    from node.runtime.errors import StartupError

    async def main() -> dict[str, Any]:
        async with asyncio.timeout(timeout_s):
            return await check_before_joining(config)

    try:
        report = asyncio.run(main())
    except StartupError as exc:
        print(f"murmur doctor: error: {exc}", file=sys.stderr)
        return 1
    except TimeoutError:
        print(f"murmur doctor: error: the checks took longer than {timeout_s:g} s (--timeout)", file=sys.stderr)
        return 1
    return _print(report, as_json)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    doctor = commands.add_parser(
        Command.DOCTOR, help="check whether peers can reach a node, through what, and how fast", epilog=PRECEDENCE,
        description="Check a node's reachability and print a verdict (reachable directly, through relays, not "
        "reachable) with one line of advice per problem: its observed public address, whether peers can dial it "
        "directly, the relays it holds slots at and whether their circuits carry model-sized exchanges, its own "
        "relay service's limits, and the latency and goodput to each neighbour. Without --peers it asks a running "
        "node (its monitor at http://MONITOR-HOST:MONITOR-PORT, or --url). With --peers it checks before joining: "
        "a throwaway p2pd with this machine's --listen/--announce asks those peers to dial it back and reserves at "
        "the relays (--relays, else the peers). docs/deploy.md says what each answer means.")
    add_monitor_target(doctor)
    joining = doctor.add_argument_group("before joining (instead of asking a running node)")
    for key in ("network.initial_peers", "network.relays", "network.listen", "network.announce",
                "network.reachability"):
        add_setting_flag(joining, SETTINGS_BY_KEY[key])
    doctor.add_argument("--timeout", type=number(float, lo=1.0), default=120.0, metavar="SECONDS",
                        help="how long the checks may take (default 120)")
    doctor.add_argument("--json", action="store_true",
                        help="print one JSON object: the node's report (peer_id, mode, reach, observed, relays, "
                        "relay_service, redetected, neighbours) with the verdict and the advice lines")
    doctor.set_defaults(run=_run_doctor)


def _run_doctor(args: argparse.Namespace) -> int:
    given = vars(args)
    if SETTINGS_BY_KEY["network.initial_peers"].dest not in given:
        url = status_url(args, os.environ)
        return run_doctor_node(url, args.json, args.timeout, token=monitor_token(args, os.environ, url))
    if args.url is not None or SETTINGS_BY_KEY["monitor.port"].dest in given:
        raise UsageError("--peers checks before joining; --url and --monitor-port ask a running node: give one or the other")
    return run_doctor_before_joining(resolve(args, os.environ).config, args.json, args.timeout)
