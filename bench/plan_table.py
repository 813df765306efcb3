"""The table of docs/plan.md: `murmur plan`'s predictions over a grid of models, links, swarm sizes and
algorithms (the model alone, gossip/plan.py: no network, nothing measured; step times are given).

Run from the repository root: .venv/bin/python -m bench.plan_table
"""

from __future__ import annotations

from dataclasses import dataclass

from gossip.codecs import TopKCodec, get_codec
from gossip.plan import Algorithm, Compression, LinkSpec, PlanConfig, make_plan, specs_for_vectors
from gossip.wire import TensorSpec
from topology import TopologySpec


@dataclass(frozen=True)
class Model:
    name: str
    specs: tuple[TensorSpec, ...]
    step_s: float  # compute per step on one node (given)
    tokens: int


def moe_specs() -> tuple[TensorSpec, ...]:
    from node.cli.plan import model_specs

    return model_specs("moe")


def rows() -> list[tuple[str, PlanConfig]]:
    moe = Model("embedded MoE, 2.45M params, 0.4 s/step (CPU)", moe_specs(), 0.4, 16 * 128)
    big = Model("1B params (200 tensors), 2 s/step (GPU)", specs_for_vectors({f"t{i}": 5_000_000 for i in range(200)}),
                2.0, 8 * 2048)
    setups = [
        ("DAdam fp32, one-peer-exp", {"topology": TopologySpec("one-peer-exp")}),
        ("DAdam + choco top-k 1%, hypercube", {"topology": TopologySpec("hypercube"), "codec": TopKCodec(0.01),
                                                "compression": Compression.CHOCO}),
        # DiLoCo's outer step and int8 anchors at every sync (the defaults): two int8 rounds per sync
        ("DiLoCo H=100 int8, one-peer-exp", {"topology": TopologySpec("one-peer-exp"), "algorithm": Algorithm.DILOCO,
                                             "codec": get_codec("int8"), "local_steps": 100}),
        ("DiLoCo H=100 int8, overlapped, P=4 fragments", {"topology": TopologySpec("one-peer-exp"),
                                                          "algorithm": Algorithm.DILOCO, "codec": get_codec("int8"),
                                                          "local_steps": 100, "fragments": 4, "overlap": True}),
    ]
    out = []
    for model in (moe, big):
        for link in (LinkSpec(20.0, 25.0), LinkSpec(100.0, 25.0)):
            for peers in (8, 64):
                for label, options in setups:
                    config = PlanConfig(model.specs, model.step_s, link, peers, tokens_per_step=model.tokens, **options)
                    out.append((f"{model.name} | {link.bandwidth_mbit:g} Mbit/s | {peers} | {label}", config))
    return out


def table() -> list[str]:
    lines = ["| model | link | peers | configuration | gossip s/step | ring all-reduce s/step (same codec, period) | "
             "winner | speed-up | MB sent/step (gossip) | bytes/token | data-parallel fp32 s/step |",
             "|---|---|---:|---|---:|---:|---|---:|---:|---:|---:|"]
    for label, config in rows():
        plan = make_plan(config)
        speed = plan.speedup if plan.winner != "allreduce" else 1 / plan.speedup
        lines.append(f"| {label} | {plan.gossip.step_s:.2f} | {plan.allreduce.step_s:.2f} | {plan.winner} | "
                     f"{speed:.2f}x | {plan.gossip.sent_bytes_per_step / 1e6:.3f} | {plan.gossip.bytes_per_token:.1f} | "
                     f"{plan.data_parallel.step_s:.2f} |")
    return lines


if __name__ == "__main__":
    print("\n".join(table()))
