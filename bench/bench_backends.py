"""Data-plane backends side by side (p2pd and the py-libp2p child), against raw TCP in the same run:

1. goodput: a 100 MiB fp32 vector between two peers on loopback, for each backend both as a raw stream
   of the vector's bytes and as a `GossipPeer` pull (wire format, validation, mixing); baseline: the
   same bytes over a plain asyncio TCP connection on loopback, interleaved with the others;
2. rounds: 8 `GossipPeer`s on each backend, one-peer exponential topology, median round time.

Run from the repository root: .venv/bin/python -m bench.bench_backends [--only goodput,rounds]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np

from bench.bench_exchange import (
    RAW_PROTOCOL,
    READ_CHUNK,
    _numel,
    _run_async,
    _settings,
    _show_exchange_logs,
    _vector,
    connect_all,
    exchange_pull,
    p2pd_daemons,
    raw_pull,
    raw_server,
    transports_on,
)
from gossip.exchange import GossipPeer
from topology import MembershipView, build_topology, peer_round

BACKENDS = ("p2pd", "libp2p")


@contextlib.asynccontextmanager
async def libp2p_transports(count: int, workdir: Path) -> AsyncIterator[list]:
    """`count` py-libp2p children with identities under `workdir`, started together, closed on exit."""
    from node.net.identity import claim_identity
    from node.net.transport.libp2p import LibP2PSettings, LibP2PTransport

    async with contextlib.AsyncExitStack() as stack:
        claims = [stack.enter_context(claim_identity(workdir / f"lp{i}.key")) for i in range(count)]
        started = await asyncio.gather(
            *(LibP2PTransport.start(LibP2PSettings(c.identity.path, c.identity.peer_id, open_timeout_s=30.0,
                                                   startup_timeout_s=120.0)) for c in claims),
            return_exceptions=True)
        for transport in started:
            if not isinstance(transport, BaseException):
                stack.push_async_callback(transport.close)
        for transport in started:
            if isinstance(transport, BaseException):
                raise transport
        yield list(started)


@contextlib.asynccontextmanager
async def backend_transports(backend: str, count: int, workdir: Path) -> AsyncIterator[list]:
    workdir.mkdir(parents=True, exist_ok=True)
    if backend == "libp2p":
        async with libp2p_transports(count, workdir) as transports:
            yield transports
    else:
        async with p2pd_daemons(count, workdir) as p2ps, transports_on(p2ps) as transports:
            yield transports


# ---- raw TCP baseline ------------------------------------------------------------------------------


@contextlib.contextmanager
def tcp_source(payload: np.ndarray) -> Iterator[int]:
    """A loopback TCP server (a thread, blocking sockets: the OS's ceiling, no event loop in the way)
    answering an 8-byte length with that many bytes of `payload`; yields its port."""
    view = memoryview(payload).cast("B")
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # the listener was closed: the benchmark is over
            with conn:
                conn.settimeout(120)
                nbytes = int.from_bytes(_recv_exactly(conn, 8), "big")
                conn.sendall(view[:nbytes])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()
        thread.join(5)


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("raw TCP peer hung up")
        data += chunk
    return bytes(data)


def _tcp_pull_blocking(port: int, nbytes: int) -> float:
    buffer = bytearray(nbytes)
    view = memoryview(buffer)
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=120) as conn:
        conn.sendall(nbytes.to_bytes(8, "big"))
        got = 0
        while got < nbytes:
            n = conn.recv_into(view[got:], min(READ_CHUNK, nbytes - got))
            if not n:
                raise ConnectionError("raw TCP source hung up")
            got += n
    return time.perf_counter() - start


async def tcp_pull(port: int, nbytes: int) -> float:
    return await asyncio.to_thread(_tcp_pull_blocking, port, nbytes)


# ---- 1. goodput ------------------------------------------------------------------------------------


async def goodput(mib: float, repeats: int, workdir: Path) -> dict[str, list[float]]:
    """Seconds per path, all paths interleaved so that background load hits them alike."""
    x = _vector(_numel(mib), seed=1)
    times: dict[str, list[float]] = {"raw TCP (baseline)": []}
    async with contextlib.AsyncExitStack() as stack:
        port = stack.enter_context(tcp_source(x))
        pulls = {}
        for backend in BACKENDS:
            puller_t, source_t = await stack.enter_async_context(backend_transports(backend, 2, workdir / backend))
            await connect_all([puller_t, source_t])
            source = GossipPeer(source_t, _settings("fp32"), {"params": x})
            # past round 0 without running it: the pulls of round 0 are answered at once, not
            # held until the source begins that round (gossip.exchange waits for a round to come)
            source.round = 1
            puller = GossipPeer(puller_t, _settings("fp32"), {"params": _vector(_numel(mib), seed=2)})
            await source.start()
            await puller.start()
            await source_t.serve(RAW_PROTOCOL, raw_server(x))
            pulls[backend] = (puller_t, puller, source_t.peer_id)
            times[f"{backend}: raw stream"] = []
            times[f"{backend}: GossipPeer pull"] = []
        await tcp_pull(port, x.nbytes)  # warm-ups: connections, buffers, page faults
        for puller_t, puller, source in pulls.values():
            await raw_pull(puller_t, source, x.nbytes)
            await exchange_pull(puller, source)
        for _ in range(repeats):
            times["raw TCP (baseline)"].append(await tcp_pull(port, x.nbytes))
            for backend, (puller_t, puller, source) in pulls.items():
                times[f"{backend}: raw stream"].append(await raw_pull(puller_t, source, x.nbytes))
                got = await exchange_pull(puller, source)
                if isinstance(got, str):
                    print(f"{backend}: an exchange pull failed ({got}); left out", file=sys.stderr)
                else:
                    times[f"{backend}: GossipPeer pull"].append(got)
    return times


def report_goodput(mib: float, repeats: int, times: dict[str, list[float]]) -> list[str]:
    mb = _numel(mib) * 4 / 1e6
    base = min(times["raw TCP (baseline)"])
    lines = [f"### Goodput on loopback: {mib:g} MiB fp32 between two peers, best of {repeats}", "",
             "| path | best s | median s | MB/s (best) | vs raw TCP |", "|---|---:|---:|---:|---:|"]
    for name, values in times.items():
        if not values:
            lines.append(f"| {name} | failed | | | |")
            continue
        lines.append(f"| {name} | {min(values):.3f} | {statistics.median(values):.3f} | {mb / min(values):,.1f} | "
                     f"{base / min(values):.3f}x |")
    return lines + [""]


# ---- 2. round latency ------------------------------------------------------------------------------


async def round_latency(backend: str, peers: int, dim: int, rounds: int, workdir: Path
                        ) -> tuple[list[float], list[str]]:
    topology = build_topology("one-peer-exp", peers)
    async with backend_transports(backend, peers, workdir / f"rounds-{backend}") as transports:
        await connect_all(transports)
        gossip = {t.peer_id: GossipPeer(t, _settings("fp32"), {"params": _vector(dim, seed=i)})
                  for i, t in enumerate(transports)}
        for peer in gossip.values():
            await peer.start()
        view = MembershipView.of(gossip)
        times: list[float] = []
        skipped: list[str] = []
        for r in range(rounds + 1):  # round 0 warms up and is not counted
            start = time.perf_counter()
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(p.run_round(r, peer_round(topology, view, pid, r)))
                         for pid, p in gossip.items()]
            if r:
                times.append(time.perf_counter() - start)
                skipped.extend(reason for t in tasks for reason in t.result().skipped.values())
    return times, skipped


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.bench_backends", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="goodput,rounds", help="comma-separated parts to run (default: all)")
    parser.add_argument("--mib", type=float, default=100, help="vector size of the goodput part in MiB (default 100)")
    parser.add_argument("--repeats", type=int, default=3, help="timed pulls per path, after a warm-up (default 3)")
    parser.add_argument("--peers", type=int, default=8, help="peers of the round part (default 8)")
    parser.add_argument("--dim", type=int, default=1_000_000, help="parameters per peer in the round part")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per backend, after a warm-up")
    args = parser.parse_args(argv)
    parts = {p.strip() for p in args.only.split(",") if p.strip()}
    if parts - {"goodput", "rounds"}:
        parser.error(f"--only: unknown part(s) {', '.join(sorted(parts - {'goodput', 'rounds'}))}")
    _show_exchange_logs()
    print(f"command: .venv/bin/python -m bench.bench_backends {' '.join(argv)}".rstrip())
    print(f"python {platform.python_version()}, numpy {np.__version__}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f} at start\n", flush=True)
    with tempfile.TemporaryDirectory(prefix="murmur-bench-") as tmp:
        workdir = Path(tmp)
        if "goodput" in parts:
            times = _run_async(lambda: goodput(args.mib, args.repeats, workdir / "goodput"))
            print("\n".join(report_goodput(args.mib, args.repeats, times)), flush=True)
        if "rounds" in parts:
            lines = [f"### Round latency: {args.peers} GossipPeers x {args.dim:,} fp32 parameters, one-peer "
                     f"exponential, median of {args.rounds} rounds", "",
                     "| backend | round s (median) | rounds s | vs p2pd |", "|---|---:|---|---:|"]
            medians = {}
            for backend in BACKENDS:
                times, skipped = _run_async(lambda: round_latency(backend, args.peers, args.dim, args.rounds, workdir))
                medians[backend] = statistics.median(times)
                lines.append(f"| {backend} | {medians[backend]:.2f} | {', '.join(f'{t:.2f}' for t in times)} | "
                             f"{medians[backend] / medians['p2pd']:.2f}x |")
                if skipped:
                    lines.append(f"{backend}: neighbours skipped in timed rounds: {', '.join(skipped)}")
            print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
