"""Every hostile mode of tests/support/hostile.py, one at a time, as 1 hostile node among 5 real `murmur`
processes, against a control run with an honest node in its place.

The swarm is open, and the control has the same identities, seeds and recipe (tests/support/attacks.py).
Printed per mode:

- the founding honest nodes' validation loss after S steps, attack / control (target: <= 1.10);
- whether any honest node installed the hostile node's parameters (the mid-run joiner's sources);
- cadence: the founding honest nodes' seconds from their first step to step S, attack / control;
- the hostile traffic the honest nodes counted (`out_of_range` refusals, clipped values, SPES versions,
  rounds that went on without waiting for a laggard whose wait budget was spent: `laggard_wait_spent`);
- creeping: the founding honest nodes' extra seconds to step S over the control, against the most the
  wait budget allows (node.swarm.progress: WAIT_BUDGET_S, plus its refill over the attack run).

The dense modes run on the tests' tiny GPT (DAdam by default); spes-capacity on the tiny MoE with SPES.
Run from the repository root: .venv/bin/python -m bench.bench_attacks [--modes noise,scaled] [--steps 200]
[--optimizer dadam|dsgd] [--gossip-compression choco] (the dense modes against CHOCO nodes on a ring). Figures go to docs/benchmarks.md ("Attacks").
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # support.*: the harness, the hostile node, the tiny models

from node.swarm.progress import WAIT_BUDGET_S, WAIT_BUDGET_WINDOW_S  # noqa: E402
from support.attacks import FOUNDING_HONEST, HOSTILE, AttackSetup, SwarmRun, metric, run_swarm, with_support_path  # noqa: E402
from support.hostile import Mode, hostile_argv  # noqa: E402
from support.tiny_model import TINY  # noqa: E402
from support.tiny_moe import TINY_MOE  # noqa: E402

LOSS_TARGET = 1.10
DENSE_MODES = (Mode.HUGE_STEP, Mode.NOISE, Mode.SCALED, Mode.SIGN_FLIP, Mode.STALE_REPLAY, Mode.USELESS,
               Mode.CREEPING)
SPES_MODES = (Mode.SPES_CAPACITY,)


def recipes(optimizer: str, lr: float, compression: str | None = None) -> dict[str, dict[str, object]]:
    common: dict[str, object] = {"batch_size": 16, "optimizer": optimizer, "lr": lr, "warmup_steps": 10, "steps": 0,
                                 "topology": "one-peer-exp", "min_peers": 4}
    if compression is not None:
        # compressed gossip runs on symmetric edges; the hostile's tensor modes then replace its differences,
        # and each honest node mixes with its own --mixing (the default adaptive_clip)
        common = {**common, "topology": "ring", "gossip_compression": compression, "codec": "int8"}
    return {"dense": {"model": "tiny_model:build", "context": TINY.context, **common},
            # the founder adds --spes; a sync every step, as the hostile's versions meet every sync
            "spes": {"model": "tiny_moe:build", "context": TINY_MOE.context, "spes_sync_every": 1, **common}}


def node_flags(steps: int, spes_experts: int | None) -> dict[str, object]:
    # SPES: every node at its default capacity (every expert on a CPU) unless --spes-experts says less
    return {"threads": 1, "eval_every": steps, "checkpoint_every": 100_000, "exchange_timeout": 3, "heartbeat": 1,
            "experts": spes_experts}


def summarize(mode: str, control: SwarmRun, attack: SwarmRun) -> dict[str, object]:
    hostile = attack.nodes[HOSTILE].peer_id
    joined = attack.statuses["n4"]["training"]["joined"] or {}
    ratios = {n: attack.val_loss(n) / control.val_loss(n) for n in FOUNDING_HONEST}
    cadence = statistics.median(attack.seconds[n] / control.seconds[n] for n in FOUNDING_HONEST)
    refused = sum(metric(t, "murmur_errors_total", '{kind="out_of_range"}') for t in attack.metrics.values())
    clipped = sum(metric(t, "murmur_mixing_clipped_total") for t in attack.metrics.values())
    spent = sum(metric(t, "murmur_skipped_total", '{reason="laggard_wait_spent"}') for t in attack.metrics.values())
    # the longest a node's rounds can be held for the hostile: the whole budget, and its refill meanwhile
    extra = {n: round(attack.seconds[n] - control.seconds[n], 1) for n in FOUNDING_HONEST}
    bound = {n: round(WAIT_BUDGET_S * (1 + attack.seconds[n] / WAIT_BUDGET_WINDOW_S), 1) for n in FOUNDING_HONEST}
    versions = sum(int(((s.get("spes") or {}).get("errors") or {}).get("version_out_of_bounds", 0))
                   for s in attack.statuses.values())
    return {
        "mode": mode,
        "control": {n: round(control.val_loss(n), 4) for n in FOUNDING_HONEST},
        "attack": {n: round(attack.val_loss(n), 4) for n in FOUNDING_HONEST},
        "worst_ratio": max(ratios.values()),
        "installed": hostile in joined.get("sources", ()) or any(
            attack.statuses[n]["training"]["started_from"] != "init" for n in FOUNDING_HONEST),
        "joiner_sources": len(joined.get("sources", ())),
        "joiner_refused_hostile": joined.get("refused", {}).get(hostile, "-"),
        "cadence": cadence,
        "out_of_range": refused, "clipped": clipped, "version_out_of_bounds": versions, "wait_spent": spent,
        "extra_s": extra, "wait_bound_s": bound,
        "hostile_acts": sum(attack.hostile_counts.values()),
    }


def table(rows: list[dict[str, object]], steps: int) -> list[str]:
    lines = [f"| mode | control val loss at step {steps} (n0, n1, n2) | attack | worst ratio | installed? | "
             "joiner: sources, hostile refused as | cadence (attack / control) | out_of_range / clipped / "
             "versions refused | laggard waits spent |", "|---|---|---|---:|---|---|---:|---|---:|"]
    for r in rows:
        control, attack = r["control"], r["attack"]
        assert isinstance(control, dict) and isinstance(attack, dict)
        ratio = float(r["worst_ratio"])  # type: ignore[arg-type]
        lines.append(
            f"| {r['mode']} | {', '.join(f'{v:.3f}' for v in control.values())} | "
            f"{', '.join(f'{v:.3f}' for v in attack.values())} | {ratio:.3f} "
            f"({'met' if ratio <= LOSS_TARGET else 'MISSED'}) | {'YES' if r['installed'] else 'no'} | "
            f"{r['joiner_sources']}, {r['joiner_refused_hostile']} | {float(r['cadence']):.2f} | "  # type: ignore[arg-type]
            f"{r['out_of_range']:.0f} / {r['clipped']:.0f} / {r['version_out_of_bounds']} | {r['wait_spent']:.0f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_attacks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default=",".join(m.value for m in (*DENSE_MODES, *SPES_MODES)))
    parser.add_argument("--steps", type=int, default=200, help="S: losses are compared at this step")
    parser.add_argument("--optimizer", choices=("dadam", "dsgd"), default="dadam")
    parser.add_argument("--lr", type=float, help="default: 1.5e-2 for dadam, 0.5 for dsgd")
    parser.add_argument("--spes-experts", type=int, help="the honest SPES nodes' capacity (default: every expert)")
    parser.add_argument("--gossip-compression", choices=("choco",),
                        help="the dense modes under compressed gossip (ring, int8 differences; SPES is refused)")
    parser.add_argument("--dir", type=Path, help="keep the runs' logs here (default: a temporary directory)")
    args = parser.parse_args(argv)
    modes = [Mode(m) for m in args.modes.split(",")]
    lr = args.lr or (1.5e-2 if args.optimizer == "dadam" else 0.5)
    os.environ["PYTHONPATH"] = with_support_path(os.environ)
    if args.gossip_compression and any(m in SPES_MODES for m in modes):
        parser.error("compressed gossip does not cover SPES: pick --modes among the dense ones")
    print(f"# bench_attacks on {platform.node()}: {args.optimizer} lr {lr}, S = {args.steps}, "
          f"compression {args.gossip_compression or 'none'}, modes "
          f"{', '.join(modes)}", flush=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-attacks-") as scratch:
        root = args.dir or Path(scratch)
        ids = root / "identities"
        rows = []
        controls: dict[str, SwarmRun] = {}
        for mode in modes:
            kind = "spes" if mode in SPES_MODES else "dense"
            recipe = recipes(args.optimizer, lr, args.gossip_compression)[kind]
            setup = AttackSetup(recipe, node_flags(args.steps, args.spes_experts if kind == "spes" else None), steps=args.steps, join_at=args.steps // 5,
                                timeout_s=1800.0, founder_args=("--spes",) if kind == "spes" else ())
            if kind not in controls:
                controls[kind] = run_swarm(root / f"control-{kind}", ids / kind, setup)
                print(f"  control ({kind}): {[round(controls[kind].val_loss(n), 4) for n in FOUNDING_HONEST]}",
                      flush=True)
            attack = run_swarm(root / f"attack-{mode}", ids / kind, replace(setup, hostile=hostile_argv([mode])))
            rows.append(summarize(str(mode), controls[kind], attack))
            print(f"  {mode}: {rows[-1]}", flush=True)
    print("\n".join(table(rows, args.steps)))
    for r in rows:
        if r["mode"] == Mode.CREEPING:
            print(f"creeping: extra seconds to step {args.steps} over the control {r['extra_s']}, "
                  f"at most (wait budget and its refill) {r['wait_bound_s']}")
    print(f"\n({time.monotonic() - started:.0f} s; command: python -m bench.bench_attacks "
          f"{' '.join(argv if argv is not None else sys.argv[1:])})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
