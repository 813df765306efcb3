"""A joiner's catch-up: `--join-check median` (three whole copies, their coordinate-wise median) against
`--join-check spot` (one copy, a block of each donor's part checked against two other donors), run in the
same command on the same donors.

In-process GossipPeers on an in-memory network (gossip.memory): four donors holding N float32 parameters
near a target, one joiner; each donor's link to the joiner is shaped to --mbit. The validation loss is a
mock (the distance to the target: no model is computed). Per check it reports the payload bytes the joiner
received, the peak of the host memory allocated during the catch-up (tracemalloc, which counts nothing
allocated before it), the wall time with every donor's link its own, and the time the bytes take through one
shared downlink of --mbit (a home link: the donors' transfers share it), bytes over that rate.

Run from the repository root: .venv/bin/python -m bench.bench_join [--params 2e7] [--mbit 200] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import time
import tracemalloc

import numpy as np

from gossip.codecs import get_codec
from gossip.exchange import ExchangeSettings, GossipPeer
from gossip.memory import InMemoryNetwork, LinkModel
from node.net.records import PeerRecord
from node.swarm.joining import JoinCheck, JoinOutcome, JoinRules, join_swarm, judge_steps

TENSOR_PARAMS = 1 << 19  # a model's parameters come as many tensors (2 MiB each)
DONORS = ("d0", "d1", "d2", "d3")
JOINER = "joiner"


def _parameters(total: int, seed: int, spread: float, target: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    count = max(1, total // TENSOR_PARAMS)
    if target is None:
        return {f"layer{i}.weight": rng.standard_normal(TENSOR_PARAMS, dtype=np.float32) for i in range(count)}
    return {name: (t + spread * rng.standard_normal(t.size, dtype=np.float32)).astype(np.float32)
            for name, t in target.items()}


def _record(peer: str) -> PeerRecord:
    return PeerRecord(peer_id=peer, maddrs=(f"/ip4/127.0.0.1/tcp/1/p2p/{peer}",), step=300, round=0, experts=(),
                      capacity=0, version="bench", heartbeat=0.0)


async def catch_up(params: int, mbit: float, check: JoinCheck) -> dict[str, float]:
    target = _parameters(params, 0, 0.0, None)
    net = InMemoryNetwork()
    settings = ExchangeSettings(swarm="bench-join", config_hash="0" * 64, codec=get_codec("fp32"),
                                exchange_timeout_s=30.0)
    donors = [GossipPeer(net.transport(p), settings, _parameters(params, i + 1, 0.01, target), step=300)
              for i, p in enumerate(DONORS)]
    own = {name: np.zeros_like(t) for name, t in target.items()}
    joiner = GossipPeer(net.transport(JOINER), settings, own)
    for peer in (*donors, joiner):
        await peer.start()
    for donor in DONORS:
        net.set_link(donor, JOINER, LinkModel(bandwidth_bytes_per_s=mbit * 1e6 / 8))

    async def evaluate(tensors: object) -> float:  # mocked: the distance to the target
        values = own if tensors is None else tensors
        return 1.0 + float(np.sqrt(sum(np.sum(np.square(values[n] - t)) for n, t in target.items())))  # type: ignore[index]

    judged = judge_steps([_record(p) for p in DONORS], JOINER, step=0, margin=2, budget=0)
    assert judged is not None
    tracemalloc.start()  # what is allocated from here on: the peers' parameters made before are not counted
    received = joiner.stats.bytes_received
    started = time.perf_counter()
    outcome: JoinOutcome = await join_swarm(judged, joiner.fetch, evaluate, joiner.tensors, JoinRules(check=check))
    seconds = time.perf_counter() - started
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert outcome.tensors is not None and outcome.check == check, outcome.as_dict()
    nbytes = joiner.stats.bytes_received - received
    for peer in (*donors, joiner):
        await net.kill(peer.peer_id)
    return {"bytes": nbytes, "peak": peak, "seconds": seconds, "shared_s": nbytes / (mbit * 1e6 / 8),
            "loss": await evaluate(outcome.tensors)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=2e7)
    parser.add_argument("--mbit", type=float, default=200.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    params = int(args.params)
    runs: dict[JoinCheck, list[dict[str, float]]] = {JoinCheck.MEDIAN: [], JoinCheck.SPOT: []}
    for _ in range(args.repeats):  # interleaved: load on a shared machine hits both alike
        for check in runs:
            runs[check].append(asyncio.run(catch_up(params, args.mbit, check)))
    copy = 4 * max(1, params // TENSOR_PARAMS) * TENSOR_PARAMS
    print(f"{platform.processor() or platform.machine()}, {copy // 4:,} parameters ({copy / 1e6:.0f} MB fp32), "
          f"{len(DONORS)} donors, links of {args.mbit:g} Mbit/s, median of {args.repeats}")
    print("| check | received MB | / one copy | peak host MB | / one copy | time s (own links) | "
          "time s (one shared downlink) | mocked loss |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for check, rows in runs.items():
        med = {k: float(np.median([r[k] for r in rows])) for k in rows[0]}
        print(f"| {check} | {med['bytes'] / 1e6:.1f} | {med['bytes'] / copy:.2f} | {med['peak'] / 1e6:.0f} | "
              f"{med['peak'] / copy:.2f} | {med['seconds']:.1f} | {med['shared_s']:.1f} | {med['loss']:.3f} |")
    spot, median = (float(np.median([r["bytes"] for r in runs[c]])) for c in (JoinCheck.SPOT, JoinCheck.MEDIAN))
    print(f"spot / median bytes: {spot / median:.2f}")


if __name__ == "__main__":
    main()
