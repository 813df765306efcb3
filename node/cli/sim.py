"""`murmur sim`: simulate N peers gossiping random vectors over a topology in one process, with
message loss, churn and a link model, and print consensus error and bytes per round."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, TextIO

from gossip.mixing import MIXING_KINDS
from node.cli.args import (
    add_topology_options,
    non_negative_float,
    non_negative_int,
    number,
    positive_int,
    probability,
    topology_spec,
    values_checked,
)
from node.config import STATE_CODECS, Command
from topology import TOPOLOGY_NAMES, build_topology

if TYPE_CHECKING:
    from gossip.sim import RoundReport, SimConfig


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sim = commands.add_parser(Command.SIM, help="simulate gossip over a topology in one process",
                              description="Simulate N peers gossiping random vectors over a topology, with "
                              "message loss, churn and a link model; print consensus error and bytes per round.")
    sim.add_argument("--peers", type=positive_int, required=True, help="number of peers N")
    sim.add_argument("--topology", choices=TOPOLOGY_NAMES, default="one-peer-exp", help="topology family (default one-peer-exp)")
    sim.add_argument("--rounds", type=non_negative_int, default=20, help="gossip rounds (default 20)")
    sim.add_argument("--drop", type=probability, default=0.0, help="probability a message is lost (default 0)")
    sim.add_argument("--churn", type=probability, default=0.0,
                     help="per-round probability that a peer leaves; as many new peers join (default 0)")
    sim.add_argument("--dim", type=positive_int, default=1000, help="parameters per peer (default 1000)")
    sim.add_argument("--codec", choices=STATE_CODECS, default="fp32", help="wire codec (default fp32)")
    sim.add_argument("--mixing", choices=MIXING_KINDS, default="weighted",
                     help="mixing rule (default weighted)")
    sim.add_argument("--tau", type=number(float, lo=1e-12), help="clipping radius for --mixing clipped")
    sim.add_argument("--trim", type=number(float, lo=0.0, hi=0.5, hi_open=True), default=0.2,
                     help="fraction trimmed per side for --mixing trimmed_mean (default 0.2)")
    sim.add_argument("--latency-ms", type=non_negative_float, default=0.0, help="one-way link latency (default 0)")
    sim.add_argument("--bandwidth-mbit", type=number(float, lo=1e-6), help="link bandwidth in Mbit/s (default unlimited)")
    sim.add_argument("--seed", type=non_negative_int, default=0, help="random seed (default 0)")
    sim.add_argument("--json", action="store_true", help='print {"rounds": [{"round", "consensus_error", "bytes", ...}]}')
    add_topology_options(sim)
    sim.set_defaults(run=_run_sim)


def _run_sim(args: argparse.Namespace) -> int:
    from gossip.memory import LinkModel
    from gossip.mixing import MixingRule
    from gossip.sim import SimConfig, simulate

    bandwidth = args.bandwidth_mbit * 1e6 / 8 if args.bandwidth_mbit else float("inf")
    with values_checked():
        config = SimConfig(
            peers=args.peers, topology=topology_spec(args, args.topology), rounds=args.rounds, dim=args.dim,
            drop=args.drop, churn=args.churn, codec=args.codec, seed=args.seed,
            link=LinkModel(latency_s=args.latency_ms / 1000, bandwidth_bytes_per_s=bandwidth),
            rule=MixingRule(kind=args.mixing, tau=args.tau, trim=args.trim),
        )
        build_topology(config.topology, config.peers)  # a bad combination fails here, before round 1
    print_sim(config, simulate(config), as_json=args.json)
    return 0


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
