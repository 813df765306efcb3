"""Rendering of offline analyses for the terminal: `murmur topology` and `murmur sim` output."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from typing import TextIO

from gossip.sim import RoundReport, SimConfig
from topology import Topology


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


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def print_sim(config: SimConfig, rounds: Iterable[RoundReport], as_json: bool, out: TextIO = sys.stdout) -> None:
    """A table streamed round by round, or one JSON object at the end."""
    if as_json:
        config_json = {"peers": config.peers, "topology": config.topology.name, "rounds": config.rounds,
                       "dim": config.dim, "drop": config.drop, "churn": config.churn, "codec": config.codec,
                       "mixing": config.rule.kind, "seed": config.seed}
        print(json.dumps({"config": config_json, "rounds": [r.as_json() for r in rounds]}), file=out)
        return
    print(f"{config.peers} peers, {config.topology.name}, {config.dim} parameters, codec {config.codec}, "
          f"drop {config.drop}, churn {config.churn}", file=out)
    print(f"{'round':>5}  {'peers':>5}  {'consensus_error':>15}  {'bytes':>10}  {'dropped':>7}  {'sim_time':>9}", file=out)
    for r in rounds:
        print(f"{r.round:>5}  {r.peers:>5}  {r.consensus_error:>15.6e}  {_human_bytes(r.bytes):>10}  "
              f"{r.dropped:>7}  {r.sim_time_s:>8.3f}s", file=out, flush=True)
