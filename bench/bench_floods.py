"""Honest nodes under a hostile peer: the round cadence and memory of real `murmur node` processes, against
a control run of the same swarm (same seeds, same flags) with no hostile peer, in the same command.

The nodes run in vector mode on loopback while tests/support/hostile_flood.py floods streams and pulls,
publishes an unroutable record that never moves and is then SIGSTOPped.

Printed per run: rounds per second of each honest node over the window, the longest round any of them
reported, RSS growth of the node processes, and the hostile traffic each counted on /metrics; then the
ratios attack / control. Bounded: `--window` seconds per run (the flood lasts that long, then the
hostile process is frozen for `--frozen` more seconds).

Run from the repository root: .venv/bin/python -m bench.bench_floods [--nodes 4] [--window 30]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
from pathlib import Path

import psutil

from tests.support.hostile_flood import HostileProcess, Mode, Target, Victim, watch_rounds
from tests.support.swarm_harness import Node, Swarm, wait_for


def rss_mb(nodes: list[Node]) -> list[float]:
    return [psutil.Process(n.pid).memory_info().rss / 2**20 for n in nodes]


def run(root: Path, args: argparse.Namespace, attack: bool) -> dict[str, object]:
    flags = dict(dim=args.dim, heartbeat=1, round_interval=args.round_interval, exchange_timeout=args.exchange_timeout,
                 min_peers=args.nodes)
    # started with the swarm, so its start-up overlaps the nodes'; it attacks only once told to
    hostile = HostileProcess(root / "hostile", args.extra_ids) if attack else None
    with Swarm(root, **flags) as swarm, contextlib.ExitStack() as stack:
        if hostile:
            stack.callback(hostile.kill)
        nodes = swarm.start(args.nodes)
        swarm.wait_rounds(nodes, 3)
        memory_before = rss_mb(nodes)
        if hostile:
            first = nodes[0].status()
            hostile.attack(Target(swarm=first["swarm"], config_hash=first["config_hash"], dim=args.dim,
                                  victims=tuple(Victim(n.peer_id, n.maddrs) for n in nodes), workdir=root / "hostile",
                                  modes=tuple(Mode), gossip_from=first["gossip_from"], heartbeat_s=2.0,
                                  duration_s=args.window, streams_per_id=args.streams, pullers=args.pullers,
                                  extra_ids=args.extra_ids, extra_streams=args.extra_streams))
            hostile_id = hostile.ready()["ready"]
            wait_for(lambda: all(any(p["peer_id"] == hostile_id for p in n.status()["peers"]) for n in nodes),
                     60, "the hostile record in every view")
        try:
            rates, longest = watch_rounds(nodes, args.window)
            memory_after = rss_mb(nodes)
            report = hostile.report(args.window + 30) if hostile else {}
            if hostile:
                hostile.freeze()
            frozen, frozen_longest = watch_rounds(nodes, args.frozen)
            limits = [n.status()["limits"] for n in nodes]
            skipped = [n.status()["skipped"] for n in nodes]
        finally:
            if hostile:
                hostile.kill()
    return {"rates": rates, "longest": longest, "frozen": frozen, "frozen_longest": frozen_longest,
            "rss_growth_mb": [a - b for a, b in zip(memory_after, memory_before)], "limits": limits,
            "skipped": skipped, "hostile": report}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--dim", type=int, default=1_000_000)
    parser.add_argument("--round-interval", type=float, default=0.5)
    parser.add_argument("--exchange-timeout", type=float, default=2.0)
    parser.add_argument("--window", type=float, default=30.0)
    parser.add_argument("--frozen", type=float, default=15.0)
    parser.add_argument("--streams", type=int, default=128, help="held streams per victim from the member id")
    parser.add_argument("--pullers", type=int, default=4)
    parser.add_argument("--extra-ids", type=int, default=3)
    parser.add_argument("--extra-streams", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-floods-") as tmp:
        control = run(Path(tmp) / "control", args, attack=False)
        attacked = run(Path(tmp) / "attack", args, attack=True)
    for name, result in (("control", control), ("attack", attacked)):
        print(f"{name}: rounds/s {[round(r, 2) for r in result['rates']]} (longest round {result['longest']:.2f} s); "
              f"frozen phase {[round(r, 2) for r in result['frozen']]} ({result['frozen_longest']:.2f} s); "
              f"RSS growth MB {[round(m, 1) for m in result['rss_growth_mb']]}")
    print("attack counters per node:")
    for limits, skipped in zip(attacked["limits"], attacked["skipped"]):
        print("  " + json.dumps({**limits, "skipped": skipped}))
    print("hostile saw: " + json.dumps(attacked["hostile"]))
    ratio = statistics.mean(attacked["rates"]) / statistics.mean(control["rates"])
    frozen_ratio = statistics.mean(attacked["frozen"]) / statistics.mean(control["frozen"])
    print(f"cadence ratio attack/control: {ratio:.2f} during the floods, {frozen_ratio:.2f} with the hostile frozen")


if __name__ == "__main__":
    main()
