"""Memory and time of a whole-model exchange at real model sizes: two node processes on loopback, each a
GossipPeer on its own p2pd with N float32 parameters (mocked compute: parameters only), run symmetric
gossip rounds with each other.

Per node it reports the resident memory once the parameters are built and served (the baseline), the peak
during the rounds beyond it (the kernel's high-water mark, reset after set-up), and that peak over the wire
payload of one message (target: at most 3 copies of the payload beyond the parameters); per round its time,
and the payload's goodput against a raw p2pd stream of the same bytes between the same two processes, run
in the same command.

Run from the repository root: .venv/bin/python -m bench.bench_scale [--params 1e9] [--codec int8] [--rounds 2]
[--baseline] (--baseline: the same pair again, keeping past round inputs in float32, in the same command)
(1e9 parameters need about 2 x (4 GB + 3 payloads) of free memory.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.bench_exchange import (
    RAW_PROTOCOL,
    REPO,
    _run_async,
    _wait_for_file,
    _write_json,
    p2pd_daemons,
    raw_pull,
    raw_server,
    stop_children,
    transports_on,
)
from gossip.codecs import get_codec
from gossip.exchange import ExchangeSettings, GossipPeer
from gossip.wire.encode import message_nbytes
from topology import PeerRound

SWARM, CONFIG_HASH = "bench-scale", "0" * 64
TENSOR_PARAMS = 64 << 20  # a model's parameters come as many tensors; 64 Mi elements each (a large embedding)
START_TIMEOUT_S = 600.0  # building 1e9 random parameters on a loaded 2-core machine
ROUND_TIMEOUT_S = 1800.0
TARGET_COPIES = 3.0


def _rss_bytes(field: str) -> int:
    """VmRSS or VmHWM (the peak since the last reset) of this process, from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    """Make VmHWM start again from the current RSS (Linux >= 4.0: `5` to clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def _parameters(total: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tensors, left, index = {}, total, 0
    while left > 0:
        n = min(TENSOR_PARAMS, left)
        tensors[f"layer{index}.weight"] = rng.standard_normal(n, dtype=np.float32)
        left, index = left - n, index + 1
    return tensors


async def node_role(spec: dict) -> None:
    """One node: its parameters, a GossipPeer serving them and a raw stream of the payload's size; it runs
    the rounds the coordinator announces with the other node and reports its memory and times."""
    workdir, index, codec = Path(spec["workdir"]), spec["index"], spec["codec"]
    async with p2pd_daemons(1, workdir / f"node{index}") as p2ps, transports_on(p2ps) as (transport,):
        settings = ExchangeSettings(swarm=SWARM, config_hash=CONFIG_HASH, codec=get_codec(codec),
                                    exchange_timeout_s=spec["exchange_timeout_s"])
        tensors = _parameters(spec["params"], seed=index)
        payload = message_nbytes({n: (t.shape, t.dtype) for n, t in tensors.items()}, get_codec(codec))
        peer_type: type[GossipPeer] = GossipPeer
        if spec.get("float_inputs"):
            from bench.bench_exchange import FloatInputsPeer
            peer_type = FloatInputsPeer
        peer = peer_type(transport, settings, tensors)
        await peer.start()
        raw = np.zeros(payload // 4 + 1, np.float32)
        await transport.serve(RAW_PROTOCOL, raw_server(raw))
        _write_json(workdir / f"ready{index}.json", {"peer_id": transport.peer_id,
                                                     "maddrs": list(await transport.maddrs())})
        other = (await asyncio.to_thread(_wait_for_file, workdir / "members.json", START_TIMEOUT_S))[1 - index]
        if index == 0:
            await transport.connect(other["peer_id"], other["maddrs"])
        del tensors
        baseline = _rss_bytes("VmRSS")
        _reset_peak()
        plan = PeerRound(self_weight=0.5, in_weights={other["peer_id"]: 0.5}, out_peers=(other["peer_id"],))
        rounds: list[dict] = []
        for r in range(spec["rounds"]):
            go = await asyncio.to_thread(_wait_for_file, workdir / f"go{r}.json", ROUND_TIMEOUT_S)
            await asyncio.sleep(max(0.0, go["start"] - time.time()))
            started = time.monotonic()
            outcome = await peer.run_round(r, plan)
            rounds.append({"s": time.monotonic() - started, "mixed": len(outcome.mixed_with),
                           "skipped": list(outcome.skipped.values())})
            _write_json(workdir / f"done{r}-{index}.json", {})
        peak = _rss_bytes("VmHWM")
        raw_s = None
        if index == 1:  # after the rounds, the same bytes as a raw stream from the other node (the baseline)
            raw_s = await raw_pull(transport, other["peer_id"], payload)
        _write_json(workdir / f"report{index}.json", {
            "baseline": baseline, "peak": peak, "payload": payload, "rounds": rounds, "raw_s": raw_s,
            "bytes_sent": peer.stats.bytes_sent, "bytes_received": peer.stats.bytes_received})
        await asyncio.to_thread(_wait_for_file, workdir / "stop.json", ROUND_TIMEOUT_S)


def run_pair(params: int, codec: str, rounds: int, exchange_timeout_s: float, workdir: Path,
             float_inputs: bool = False) -> list[dict]:
    from node.net.proc import popen

    workdir.mkdir(parents=True)
    spec = {"workdir": str(workdir), "codec": codec, "params": params, "rounds": rounds,
            "exchange_timeout_s": exchange_timeout_s, "float_inputs": float_inputs}
    children: list[subprocess.Popen] = []
    try:
        for i in range(2):
            command = [sys.executable, "-m", "bench.bench_scale", "--role", "node", "--spec",
                       json.dumps({**spec, "index": i})]
            children.append(popen(command, cwd=REPO, stdin=subprocess.DEVNULL))
        ready = [_wait_for_file(workdir / f"ready{i}.json", START_TIMEOUT_S, children) for i in range(2)]
        _write_json(workdir / "members.json", ready)
        time.sleep(2.0)  # the dial
        for r in range(rounds):
            _write_json(workdir / f"go{r}.json", {"start": time.time() + 0.5})
            for i in range(2):
                _wait_for_file(workdir / f"done{r}-{i}.json", ROUND_TIMEOUT_S, children)
        reports = [_wait_for_file(workdir / f"report{i}.json", ROUND_TIMEOUT_S, children) for i in range(2)]
        _write_json(workdir / "stop.json", {})
        for child in children:
            child.wait(timeout=60)
        return reports
    finally:
        stop_children(children, 30.0)


def report(params: int, codec: str, reports: list[dict]) -> list[str]:
    gib = 1 << 30
    payload = reports[0]["payload"]
    lines = [f"{params:,} float32 parameters ({params * 4 / gib:.2f} GiB), codec {codec}: one message "
             f"{payload / gib:.2f} GiB", "",
             "| node | RSS after set-up GiB (baseline) | peak beyond it GiB | / payload | "
             f"target <= {TARGET_COPIES:g} | round s | mixed, skipped |", "|---|---:|---:|---:|---|---|---|"]
    for i, r in enumerate(reports):
        beyond = max(0, r["peak"] - r["baseline"])
        copies = beyond / payload
        times = ", ".join(f"{x['s']:.1f}" for x in r["rounds"])
        outcomes = "; ".join(f"{x['mixed']}, {x['skipped'] or '-'}" for x in r["rounds"])
        lines.append(f"| {i} | {r['baseline'] / gib:.2f} | {beyond / gib:.2f} | {copies:.2f} | "
                     f"{'met' if copies <= TARGET_COPIES else 'MISSED'} | {times} | {outcomes} |")
    raw_s = reports[1]["raw_s"]
    best = min(x["s"] for r in reports for x in r["rounds"])
    lines += ["", f"raw p2pd stream of one payload (baseline): {raw_s:.1f} s; the fastest round moved a payload "
                  f"each way in {best:.1f} s: {best / raw_s:.2f}x the raw one-way time"]
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.bench_scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=1e9, help="float32 parameters per node (default 1e9)")
    parser.add_argument("--codec", default="int8", help="the wire codec (default int8)")
    parser.add_argument("--rounds", type=int, default=2, help="symmetric rounds (default 2)")
    parser.add_argument("--exchange-timeout", type=float, default=600.0,
                        help="each node's --exchange-timeout in seconds (default 600)")
    parser.add_argument("--baseline", action="store_true",
                        help="run the pair again with each peer keeping its past round inputs in float32 (murmur "
                             "before it kept them in the wire codec), in the same command")
    parser.add_argument("--role", choices=("node",), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "node":
        _run_async(lambda: node_role(json.loads(args.spec)))
        return 0
    params = int(args.params)
    print(f"command: .venv/bin/python -m bench.bench_scale {' '.join(argv)}".rstrip())
    print(f"python {platform.python_version()}, numpy {np.__version__}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f} at start\n", flush=True)
    with tempfile.TemporaryDirectory(prefix="murmur-scale-") as tmp:
        reports = run_pair(params, args.codec, args.rounds, args.exchange_timeout, Path(tmp) / "pair")
        print("\n".join(report(params, args.codec, reports)), flush=True)
        if args.baseline:
            base = run_pair(params, args.codec, args.rounds, args.exchange_timeout, Path(tmp) / "baseline", True)
            print("\nbaseline: past round inputs kept in float32\n\n" + "\n".join(report(params, args.codec, base)))
            beyond = [max(0, r["peak"] - r["baseline"]) for r in reports]
            before = [max(0, r["peak"] - r["baseline"]) for r in base]
            print("\npeak beyond set-up / the baseline's, per node: "
                  + ", ".join(f"{a / b:.2f}" for a, b in zip(beyond, before, strict=True)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
