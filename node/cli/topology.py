"""`murmur topology`: describe a gossip topology over N peers (degree, rho, spectral gap)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TextIO

from node.cli.args import add_topology_options, positive_int, topology_spec, values_checked
from node.config import Command
from topology import TOPOLOGY_NAMES, Topology, build_topology


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    topo = commands.add_parser(Command.TOPOLOGY, help="describe a topology: degree, rho, spectral gap",
                               description="Describe a gossip topology over N peers: degree, rho = "
                               "||W - 11^T/n||_2 (per-round rate for time-varying schedules) and spectral gap.")
    topo.add_argument("name", choices=TOPOLOGY_NAMES, help="topology family")
    topo.add_argument("--peers", type=positive_int, required=True, help="number of peers N")
    topo.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_topology_options(topo)
    topo.set_defaults(run=_run_topology)


def _run_topology(args: argparse.Namespace) -> int:
    with values_checked():
        topology = build_topology(topology_spec(args, args.name), args.peers)
    print_topology(topology, as_json=args.json)
    return 0


def print_topology(topology: Topology, as_json: bool, out: TextIO = sys.stdout) -> None:
    info = topology.describe()
    if as_json:
        print(json.dumps(info), file=out)
        return
    print(f"{info['name']} over {info['n']} peers ({info['weights']} weights)", file=out)
    schedule = f"time-varying, period {info['period']} rounds" if info["time_varying"] else "static"
    print(f"  schedule      {schedule}", file=out)
    print(f"  degree        {info['degree']}", file=out)
    print(f"  rho           {info['rho']:.6f}", file=out)
    print(f"  spectral gap  {info['spectral_gap']:.6f}", file=out)

