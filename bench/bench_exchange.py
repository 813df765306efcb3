"""Exchange benchmarks over the p2pd transport, each against a baseline measured in the same run:

1. goodput: a `GossipPeer` fetches a 100 MiB fp32 vector from another over two p2pd daemons on
   loopback (the full exchange path: request, wire format, validation, decoding into tensors), against
   a raw p2pd binary stream of the same bytes between the same daemons (target: at least 0.8x the raw
   stream); a round that pulls the same vector and mixes it in is timed beside it;
2. link: the same pull, and the raw stream, across a 100 Mbit/s tc-tbf link between two network
   namespaces, one process per side (target: goodput at least 0.85 of the link rate; needs root);
2b. duplex: symmetric exchange rounds across a 50 Mbit/s link shaped on both sides, alternating the duplex
   exchange (the request and the reply cross at once) with the sequential one (the reply after the whole
   request, the baseline), one process per side (needs root);
3. rounds: 8 GossipPeers x 10M float32 parameters over 8 p2pd daemons on loopback, one-peer
   exponential topology, fp32 and fp16: median round time, against encoding + decoding the same
   vector once in-process;
3b. nodes: the same rounds with one process per node (each a GossipPeer on its own p2pd), against
   the in-process rounds of part 3 measured in the same run.
4. inputs: the memory a GossipPeer holds for its past round inputs (tracemalloc, after rounds that each
   began from new values, staleness bound 2) when it keeps them in the round codec's wire bytes, against
   the same peer keeping them in float32 (the baseline: murmur before it re-kept them), and the time of
   such a round alone (the re-encoding is all it does), per lossy codec.

Run from the repository root: .venv/bin/python -m bench.bench_exchange [--only goodput,link,duplex,rounds,nodes,inputs]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from gossip.codecs import get_codec
from gossip.exchange import ExchangeSettings, GossipPeer
from gossip.mixing import MixingRule, mix
from gossip.transport import GOSSIP_PROTOCOL, Stream
from gossip.wire import decode_message, encode_message
from topology import MembershipView, PeerRound, build_topology, peer_round

REPO = Path(__file__).resolve().parents[1]
SWARM, CONFIG_HASH = "bench", "0" * 64
RAW_PROTOCOL = "/murmur/bench-raw/1"
READ_CHUNK = 1 << 20  # the raw reader's read size: the wire format's payload chunk size
EXCHANGE_TIMEOUT_S = 120.0
LINK_MBIT = 100.0
TARGETS = {"goodput": 0.80, "link": 0.85}
ROLE_TIMEOUT_S = 150.0  # one namespace side of the link benchmark, start-up included
SOURCE_READY_TIMEOUT_S = 60.0


def _run_async(main: Callable[[], Awaitable[object]]) -> object:
    """uvloop when present, as the daemon runs: stream throughput depends on the loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(main())
    return uvloop.run(main())


def _vector(numel: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(numel, dtype=np.float32)


def _numel(mib: float) -> int:
    """float32 elements in `mib` MiB."""
    return int(mib * 2**20) // 4


def _settings(codec: str) -> ExchangeSettings:
    return ExchangeSettings(swarm=SWARM, config_hash=CONFIG_HASH, codec=get_codec(codec),
                            exchange_timeout_s=EXCHANGE_TIMEOUT_S)


def _pull_plan(source: str) -> PeerRound:
    """A round in which this peer only pulls `source`'s value (a directed edge) and averages it in."""
    return PeerRound(self_weight=0.5, in_weights={source: 0.5}, out_peers=())


async def start_source(peer: GossipPeer) -> None:
    """Serve, and begin round 0 (with no neighbours): the source runs no rounds of its own, and a pull
    of a round its peer has not begun waits for it, so the pulls (all of round 0) are answered at once."""
    await peer.start()
    await peer.run_round(0, PeerRound(self_weight=1.0, in_weights={}, out_peers=()))


class FloatInputsPeer(GossipPeer):
    """The baseline of part 4: a peer that keeps its past round inputs in float32, as murmur did."""

    async def _keep_past_inputs_encoded(self, round_index: int) -> None:
        return None


async def kept_inputs(mib: float, codec: str, rounds: int, peer_type: type[GossipPeer]) -> tuple[int, list[float]]:
    """Bytes traced after `rounds` rounds of a lone peer (each from new values, as a trainer's steps give
    them), beyond what it held before the first; and each round's duration."""
    import tracemalloc

    from gossip.memory import InMemoryNetwork

    settings = replace(_settings(codec), max_staleness=2)
    tracemalloc.start()
    try:
        peer = peer_type(InMemoryNetwork().transport("p"), settings, {"w": _vector(_numel(mib), seed=0)})
        alone, times = PeerRound(1.0, {}, ()), []
        before = tracemalloc.get_traced_memory()[0]
        for r in range(rounds):
            peer.set_tensors({"w": _vector(_numel(mib), seed=r + 1)}, step=r)
            started = time.perf_counter()
            await peer.run_round(r, alone)
            times.append(time.perf_counter() - started)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return held, times


# ---- daemons and transports ------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def p2pd_daemons(count: int, workdir: Path, listen: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",)
                       ) -> AsyncIterator[list]:
    """`count` p2pd daemons (hivemind `P2P`s) with identities under `workdir`, shut down on exit."""
    from node.net.identity import claim_identity
    from node.net.transport.p2pd import P2PSettings, start_p2pd

    async with contextlib.AsyncExitStack() as stack:
        claims = [stack.enter_context(claim_identity(workdir / f"peer{i}.key")) for i in range(count)]
        started = await asyncio.gather(
            *(start_p2pd(P2PSettings(identity_path=c.identity.path, host_maddrs=tuple(listen))) for c in claims),
            return_exceptions=True,
        )
        for p2p in started:
            if not isinstance(p2p, BaseException):
                stack.push_async_callback(p2p.shutdown)
        for p2p in started:
            if isinstance(p2p, BaseException):
                raise p2p
        yield list(started)


@contextlib.asynccontextmanager
async def transports_on(p2ps: Sequence) -> AsyncIterator[list]:
    """Fresh `P2PDTransport`s on running daemons (closing one unregisters its handlers, not the daemon)."""
    from node.net.transport.p2pd import P2PDTransport

    async with contextlib.AsyncExitStack() as stack:
        transports = []
        for p2p in p2ps:
            transport = P2PDTransport(p2p, open_timeout_s=30.0)
            stack.push_async_callback(transport.close)
            transports.append(transport)
        yield transports


async def connect_all(transports: Sequence) -> None:
    for i, a in enumerate(transports):
        for b in transports[i + 1:]:
            await a.connect(b.peer_id, await b.maddrs())


# ---- raw stream and exchange pulls -----------------------------------------------------------------


def raw_server(payload: np.ndarray) -> Callable[[Stream], Awaitable[None]]:
    """Answers an 8-byte length with that many bytes of `payload`, written as the exchange writes."""
    view = memoryview(payload).cast("B")

    async def handle(stream: Stream) -> None:
        nbytes = int.from_bytes(await stream.read_exactly(8), "big")
        await stream.write(view[:nbytes])

    return handle


async def raw_pull(transport, source: str, nbytes: int) -> float:
    """Seconds to receive `nbytes` raw bytes from `source`, stream open to stream close."""
    start = time.perf_counter()
    async with asyncio.timeout(EXCHANGE_TIMEOUT_S):
        stream = await transport.open_stream(source, RAW_PROTOCOL)
        try:
            await stream.write(nbytes.to_bytes(8, "big"))
            chunks = [await stream.read_exactly(min(READ_CHUNK, nbytes - offset))
                      for offset in range(0, nbytes, READ_CHUNK)]
        finally:
            await stream.close()
    elapsed = time.perf_counter() - start
    if sum(map(len, chunks)) != nbytes:
        raise RuntimeError("raw pull came back short")
    return elapsed


async def exchange_pull(peer: GossipPeer, source: str) -> float | str:
    """Seconds for one round in which `peer` pulls `source`'s tensors and mixes them in, or why it failed."""
    outcome = await peer.run_round(0, _pull_plan(source))  # round 0 every time: never stale
    if outcome.mixed_with != (source,):
        return str(outcome.skipped.get(source, "not mixed"))
    return outcome.duration_s


@dataclass(frozen=True)
class PullResult:
    nbytes: int
    raw_s: list[float]
    exchange_s: list[float]
    failures: list[str]  # exchange pulls that did not complete (left out of the times), by reason
    # `GossipPeer.fetch` of the same tensors: the exchange's transfer, validation and decoding, no mix
    fetch_s: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        """Exchange goodput over raw-stream goodput, best of each."""
        return min(self.raw_s) / min(self.exchange_s)

    @property
    def fetch_ratio(self) -> float:
        return min(self.raw_s) / min(self.fetch_s)

    @property
    def paired_ratios(self) -> tuple[float, float]:
        """Median over the repeats of raw / round and raw / fetch, each from the same repeat: the pulls
        of one repeat run back to back and share the machine's load of that moment, which best-of
        times do not (the raw stream's best is a quiet moment the longer exchange rarely gets)."""
        pairs = list(zip(self.raw_s, self.exchange_s, self.fetch_s))
        return (statistics.median(raw / round_s for raw, round_s, _ in pairs),
                statistics.median(raw / fetch_s for raw, _, fetch_s in pairs))


async def interleaved_pulls(puller_transport, puller: GossipPeer, source: str, nbytes: int, repeats: int
                            ) -> PullResult:
    """Raw and exchange pulls, alternating so that background load hits both alike. A failed exchange
    is recorded and retried (at most `repeats` times in all), so one bad moment does not void the run."""
    raw: list[float] = []
    exchange: list[float] = []
    fetches: list[float] = []
    failures: list[str] = []
    await raw_pull(puller_transport, source, nbytes)  # warm-up: connection, daemon buffers, page faults
    await exchange_pull(puller, source)
    while len(exchange) < repeats and len(failures) < repeats:
        raw_s = await raw_pull(puller_transport, source, nbytes)
        got = await exchange_pull(puller, source)
        if not isinstance(got, float):
            failures.append(got)
            continue
        start = time.perf_counter()
        await puller.fetch(source)
        raw.append(raw_s)
        exchange.append(got)
        fetches.append(time.perf_counter() - start)
    if not exchange:
        raise RuntimeError(f"every exchange pull failed: {failures}")
    return PullResult(nbytes, raw, exchange, failures, fetches)


def in_process_costs(x: np.ndarray, codec: str, repeats: int = 3) -> dict[str, float]:
    """Best-of-`repeats` seconds of what the exchange does besides moving bytes: encode, decode, mix."""
    settings = _settings(codec)
    header = {"swarm": SWARM, "config_hash": CONFIG_HASH, "sender": "bench", "round": 0, "step": 0}
    best = {"encode": float("inf"), "decode": float("inf"), "mix": float("inf")}
    y = x[::-1].copy()
    for _ in range(repeats):
        t0 = time.perf_counter()
        frames = encode_message({"params": x}, settings.codec, kind="reply", **header)
        t1 = time.perf_counter()
        buf = b"".join(frames)
        t2 = time.perf_counter()
        decode_message(buf)
        t3 = time.perf_counter()
        mix(x, {"b": y}, 0.5, {"b": 0.5}, MixingRule())
        t4 = time.perf_counter()
        for key, seconds in (("encode", t1 - t0), ("decode", t3 - t2), ("mix", t4 - t3)):
            best[key] = min(best[key], seconds)
        del frames, buf
    return best


# ---- 1. goodput on loopback ------------------------------------------------------------------------


async def loopback_goodput(mib: float, repeats: int, workdir: Path) -> PullResult:
    x = _vector(_numel(mib), seed=1)
    async with p2pd_daemons(2, workdir) as p2ps, transports_on(p2ps) as (puller_t, source_t):
        await connect_all([puller_t, source_t])
        source = GossipPeer(source_t, _settings("fp32"), {"params": x})
        puller = GossipPeer(puller_t, _settings("fp32"), {"params": _vector(_numel(mib), seed=2)})
        await start_source(source)
        await puller.start()
        await source_t.serve(RAW_PROTOCOL, raw_server(x))
        return await interleaved_pulls(puller_t, puller, source_t.peer_id, x.nbytes, repeats)


# ---- 2. across a rate-limited link between two namespaces ------------------------------------------


async def serve_role(spec: dict) -> None:
    """The link benchmark's source side (inside its namespace): serve the vector until SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    workdir = Path(spec["workdir"])
    x = _vector(_numel(spec["mib"]), seed=1)
    async with p2pd_daemons(1, workdir / "source", [spec["listen"]]) as p2ps, transports_on(p2ps) as (transport,):
        await start_source(GossipPeer(transport, _settings("fp32"), {"params": x}))
        await transport.serve(RAW_PROTOCOL, raw_server(x))
        _write_json(workdir / "source.json", {"peer_id": transport.peer_id, "maddrs": list(await transport.maddrs())})
        await stop.wait()


async def pull_role(spec: dict) -> dict:
    """The link benchmark's pulling side: once the source is up, interleaved raw and exchange pulls."""
    workdir = Path(spec["workdir"])
    async with p2pd_daemons(1, workdir / "puller", [spec["listen"]]) as p2ps, transports_on(p2ps) as (transport,):
        puller = GossipPeer(transport, _settings("fp32"), {"params": _vector(_numel(spec["mib"]), seed=2)})
        await puller.start()
        source = await asyncio.to_thread(_wait_for_file, workdir / "source.json", SOURCE_READY_TIMEOUT_S)
        await transport.connect(source["peer_id"], source["maddrs"])
        nbytes = puller.tensors["params"].nbytes
        result = await interleaved_pulls(transport, puller, source["peer_id"], nbytes, spec["repeats"])
    return asdict(result)


def _role_command(role: str, spec: dict) -> list[str]:
    return [sys.executable, "-m", "bench.bench_exchange", "--role", role, "--spec", json.dumps(spec)]


def link_goodput(mib: float, repeats: int, workdir: Path) -> PullResult:
    from node.net.proc import popen
    from tests.support.netns import veth_link  # the tests' namespace helper; `-m` puts the repository root on sys.path

    # only the source's side is shaped: the data flows from it, the puller's side carries ACKs
    with veth_link("b", rate_mbit=LINK_MBIT, limited_sides=(0,)) as link:
        spec = {"workdir": str(workdir), "mib": mib, "repeats": repeats}
        # both sides start at once (imports take seconds); the puller waits for the source's ready file
        source = popen(link.command(0, _role_command("serve", {**spec, "listen": link.tcp_maddr(0)})), cwd=REPO,
                       stdin=subprocess.DEVNULL)
        try:
            puller = popen(link.command(1, _role_command("pull", {**spec, "listen": link.tcp_maddr(1)})), cwd=REPO,
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                out, err = puller.communicate(timeout=ROLE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                puller.kill()
                puller.communicate()
                raise
        finally:
            source.send_signal(signal.SIGTERM)
            try:
                source.wait(timeout=15)
            except subprocess.TimeoutExpired:
                source.kill()
                source.wait()
    if puller.returncode != 0:
        raise RuntimeError(f"the pulling side failed ({puller.returncode}):\n{err[-3000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    return PullResult(**result)


# ---- 2b. duplex exchanges across a link shaped both ways ---------------------------------------------

DUPLEX_LINK_MBIT = 50.0
SEQUENTIAL_PROTOCOL = "/murmur/bench-sequential/1"


async def duplex_role(spec: dict) -> None:
    """One side of the duplex benchmark (inside its namespace): two GossipPeers on the same p2pd, one asking
    for duplex exchanges and one not (each on its own protocol); rounds alternate between them, each a
    symmetric exchange with the other side. Writes its round times to `<side>.result.json`."""
    workdir, side = Path(spec["workdir"]), spec["side"]
    x = _vector(_numel(spec["mib"]), seed=side)
    async with p2pd_daemons(1, workdir / f"side{side}", [spec["listen"]]) as p2ps, transports_on(p2ps) as (transport,):
        peers = {mode: GossipPeer(transport, replace(_settings("fp32"), duplex=mode == "duplex"), {"params": x},
                                  protocol=protocol)
                 for mode, protocol in (("duplex", GOSSIP_PROTOCOL), ("sequential", SEQUENTIAL_PROTOCOL))}
        for peer in peers.values():
            await peer.start()
        _write_json(workdir / f"{side}.json", {"peer_id": transport.peer_id, "maddrs": list(await transport.maddrs())})
        other = await asyncio.to_thread(_wait_for_file, workdir / f"{1 - side}.json", SOURCE_READY_TIMEOUT_S)
        await transport.connect(other["peer_id"], other["maddrs"])
        plan = PeerRound(0.5, {other["peer_id"]: 0.5}, (other["peer_id"],))
        times: dict[str, list[float]] = {"duplex": [], "sequential": []}
        skipped: list[str] = []
        for r in range(2 * (spec["rounds"] + 1)):  # a warm-up round of each, then alternating
            mode = "duplex" if r % 2 == 0 else "sequential"
            outcome = await peers[mode].run_round(r // 2, plan)
            if outcome.skipped:
                skipped.append(f"{mode} round {r // 2}: {outcome.skipped}")
            elif r >= 2:
                times[mode].append(outcome.duration_s)
        asker = transport.peer_id < other["peer_id"]
        _write_json(workdir / f"{side}.result.json", {"times": times, "skipped": skipped, "asker": asker,
                                                       "nbytes": int(x.nbytes)})
        # the other side may still be in its last round: keep serving until it is done too
        await asyncio.to_thread(_wait_for_file, workdir / f"{1 - side}.result.json", ROLE_TIMEOUT_S)


def duplex_rounds(mib: float, rounds: int, workdir: Path) -> list[dict]:
    from node.net.proc import popen
    from tests.support.netns import veth_link

    with veth_link("d", rate_mbit=DUPLEX_LINK_MBIT, limited_sides=(0, 1)) as link:
        spec = {"workdir": str(workdir), "mib": mib, "rounds": rounds}
        with contextlib.ExitStack() as logs:
            sides = [popen(link.command(i, _role_command("duplex", {**spec, "side": i, "listen": link.tcp_maddr(i)})),
                           cwd=REPO, stdin=subprocess.DEVNULL,
                           stderr=logs.enter_context((workdir / f"{i}.log").open("w"))) for i in (0, 1)]
            try:
                results = [_wait_for_file(workdir / f"{i}.result.json", ROLE_TIMEOUT_S * 2, sides) for i in (0, 1)]
            except (TimeoutError, RuntimeError):
                for i in (0, 1):
                    print(f"side {i}'s log:\n{(workdir / f'{i}.log').read_text()[-3000:]}", file=sys.stderr)
                raise
            finally:
                stop_children(sides, 15)
    return results


def _wait_for_file(path: Path, timeout_s: float, children: Sequence[subprocess.Popen] = ()) -> dict:
    """The JSON another process writes to `path` (atomically, see `_write_json`), once it is there."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} did not appear within {timeout_s:g} s")
        dead = [child.pid for child in children if child.poll() is not None]
        if dead:
            raise RuntimeError(f"process(es) {dead} exited while waiting for {path.name}")
        time.sleep(0.05)
    return json.loads(path.read_text())


def _write_json(path: Path, value: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    tmp.rename(path)


# ---- 3. round latency, 8 peers ---------------------------------------------------------------------


@dataclass(frozen=True)
class RoundsResult:
    codec: str
    round_s: list[float]
    codec_s: list[float]  # encode + decode of one vector in-process, timed after each round
    skipped: list[str]  # neighbours left out of a timed round, by reason (none expected)

    @property
    def median_s(self) -> float:
        return statistics.median(self.round_s)

    @property
    def baseline_s(self) -> float:
        return statistics.median(self.codec_s)


async def round_latency(peers: int, dim: int, codecs: Sequence[str], rounds: int, workdir: Path
                        ) -> list[RoundsResult]:
    results = []
    topology = build_topology("one-peer-exp", peers)
    async with p2pd_daemons(peers, workdir) as p2ps:
        for codec in codecs:
            async with transports_on(p2ps) as transports:
                if not results:
                    await connect_all(transports)
                gossip = {t.peer_id: GossipPeer(t, _settings(codec), {"params": _vector(dim, seed=i)})
                          for i, t in enumerate(transports)}
                for peer in gossip.values():
                    await peer.start()
                view = MembershipView.of(gossip)
                times: list[float] = []
                baseline: list[float] = []
                skipped: list[str] = []
                x = next(iter(gossip.values())).tensors["params"]
                for r in range(rounds + 1):  # round 0 warms up and is not counted
                    start = time.perf_counter()
                    async with asyncio.TaskGroup() as group:
                        tasks = [group.create_task(p.run_round(r, peer_round(topology, view, pid, r)))
                                 for pid, p in gossip.items()]
                    elapsed = time.perf_counter() - start
                    if r:
                        times.append(elapsed)
                        skipped.extend(reason for t in tasks for reason in t.result().skipped.values())
                        # right after the round, so that both see the same background load
                        costs = in_process_costs(x, codec, repeats=1)
                        baseline.append(costs["encode"] + costs["decode"])
                del gossip, tasks, x
            results.append(RoundsResult(codec, times, baseline, skipped))
    return results


# ---- 3b. round latency, one process per node -------------------------------------------------------

NODE_START_TIMEOUT_S = 180.0  # 8 interpreters importing hivemind and starting p2pd on 2 loaded cores
ROUND_TIMEOUT_S = 300.0
ROUND_LEAD_S = 0.5  # a round's start time is announced this far ahead, so every node begins it together


async def node_role(spec: dict) -> None:
    """One node of the multi-process round benchmark: a GossipPeer on its own p2pd, in its own process.

    It runs the rounds the coordinator announces (`go<r>.json`: a wall-clock start time, the same
    clock for every local process), writes when each ended, and serves until told to stop."""
    workdir, index = Path(spec["workdir"]), spec["index"]
    async with p2pd_daemons(1, workdir / f"node{index}") as p2ps, transports_on(p2ps) as (transport,):
        peer = GossipPeer(transport, _settings(spec["codec"]), {"params": _vector(spec["dim"], seed=index)})
        await peer.start()
        _write_json(workdir / f"ready{index}.json", {"peer_id": transport.peer_id,
                                                     "maddrs": list(await transport.maddrs())})
        members = await asyncio.to_thread(_wait_for_file, workdir / "members.json", NODE_START_TIMEOUT_S)
        for other in members:
            if other["peer_id"] > transport.peer_id:
                await transport.connect(other["peer_id"], other["maddrs"])
        view = MembershipView.of(m["peer_id"] for m in members)
        topology = build_topology("one-peer-exp", len(members))
        for r in range(spec["rounds"] + 1):
            go = await asyncio.to_thread(_wait_for_file, workdir / f"go{r}.json", ROUND_TIMEOUT_S)
            await asyncio.sleep(max(0.0, go["start"] - time.time()))
            outcome = await peer.run_round(r, peer_round(topology, view, transport.peer_id, r))
            _write_json(workdir / f"done{r}-{index}.json", {"end": time.time(), "skipped": list(outcome.skipped.values())})
        await asyncio.to_thread(_wait_for_file, workdir / "stop.json", ROUND_TIMEOUT_S)


def multiprocess_rounds(peers: int, dim: int, codec: str, rounds: int, workdir: Path) -> RoundsResult:
    """Round times of `peers` node processes: from the announced start to the last node's end."""
    from node.net.proc import popen

    workdir.mkdir(parents=True)
    spec = {"workdir": str(workdir), "codec": codec, "dim": dim, "rounds": rounds}
    children: list[subprocess.Popen] = []
    try:
        for i in range(peers):
            children.append(popen(_role_command("node", {**spec, "index": i}), cwd=REPO, stdin=subprocess.DEVNULL))
        ready = [_wait_for_file(workdir / f"ready{i}.json", NODE_START_TIMEOUT_S, children) for i in range(peers)]
        _write_json(workdir / "members.json", ready)
        times: list[float] = []
        skipped: list[str] = []
        for r in range(rounds + 1):  # round 0 warms up and is not counted
            start = time.time() + ROUND_LEAD_S
            _write_json(workdir / f"go{r}.json", {"start": start})
            ends = [_wait_for_file(workdir / f"done{r}-{i}.json", ROUND_TIMEOUT_S, children) for i in range(peers)]
            if r:
                times.append(max(e["end"] for e in ends) - start)
                skipped.extend(reason for e in ends for reason in e["skipped"])
        _write_json(workdir / "stop.json", {})
        for child in children:
            child.wait(timeout=30)
    finally:
        stop_children(children, 15.0)
    return RoundsResult(codec, times, [], skipped)


def stop_children(children: Sequence[subprocess.Popen], timeout_s: float) -> None:
    """SIGTERM the role processes still running, then SIGKILL those not gone within `timeout_s` each."""
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    for child in children:
        try:
            child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


# ---- report ----------------------------------------------------------------------------------------


def _verdict(ratio: float, target: float) -> str:
    return f"target >= {target:.2f}: {'met' if ratio >= target else 'MISSED'}"


def report_pull(title: str, result: PullResult, baseline_name: str) -> list[str]:
    mb = result.nbytes / 1e6

    def row(name: str, times: list[float]) -> str:
        return (f"| {name} | {min(times):.3f} | {statistics.median(times):.3f} | {mb / min(times):,.1f} | "
                f"{mb * 8 / min(times):,.0f} |")

    lines = [title, "", "| path | best s | median s | MB/s (best) | Mbit/s (best) |", "|---|---:|---:|---:|---:|",
             row(baseline_name, result.raw_s), row("GossipPeer pull (run_round: transfer, decode, mix)", result.exchange_s)]
    if result.fetch_s:
        lines.append(row("GossipPeer fetch (transfer, validated decode; no mix)", result.fetch_s))
    lines.append("")
    if result.failures:
        lines += [f"exchange pulls that failed and were retried: {', '.join(result.failures)}", ""]
    return lines


def _show_exchange_logs() -> None:
    """murmur's own INFO lines (an abandoned request, a failed dial) on stderr: they explain a failed pull."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("gossip", "node"):
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.bench_exchange", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="goodput,link,duplex,rounds,nodes,inputs",
                        help="comma-separated parts to run (default: all)")
    parser.add_argument("--mib", type=float, default=100, help="vector size of the loopback pull in MiB (default 100)")
    parser.add_argument("--link-mib", type=float, default=24,
                        help="vector size of the pull across the 100 Mbit/s link in MiB (default 24)")
    parser.add_argument("--repeats", type=int, default=3, help="timed pulls per path, after a warm-up (default 3)")
    parser.add_argument("--peers", type=int, default=8, help="peers of the round benchmark (default 8)")
    parser.add_argument("--dim", type=int, default=10_000_000, help="parameters per peer in the round benchmark")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per codec, after a warm-up (default 3)")
    parser.add_argument("--duplex-mib", type=float, default=24,
                        help="vector size of the duplex exchange rounds across the 50 Mbit/s link in MiB (default 24)")
    parser.add_argument("--inputs-mib", type=float, default=256,
                        help="model size of the round-inputs benchmark in MiB of float32 (default 256)")
    parser.add_argument("--role", choices=("serve", "pull", "node", "duplex"), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "serve":
        _show_exchange_logs()
        _run_async(lambda: serve_role(json.loads(args.spec)))
        return 0
    if args.role == "pull":
        _show_exchange_logs()
        print(json.dumps(_run_async(lambda: pull_role(json.loads(args.spec)))))
        return 0
    if args.role == "node":
        _show_exchange_logs()
        _run_async(lambda: node_role(json.loads(args.spec)))
        return 0
    if args.role == "duplex":
        _show_exchange_logs()
        _run_async(lambda: duplex_role(json.loads(args.spec)))
        return 0
    _show_exchange_logs()
    parts = {p.strip() for p in args.only.split(",") if p.strip()}
    unknown = parts - {"goodput", "link", "duplex", "rounds", "nodes", "inputs"}
    if unknown:
        parser.error(f"--only: unknown part(s) {', '.join(sorted(unknown))}")

    print(f"command: .venv/bin/python -m bench.bench_exchange {' '.join(argv)}".rstrip())
    print(f"python {platform.python_version()}, numpy {np.__version__}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f} at start\n", flush=True)
    in_process: dict[str, RoundsResult] = {}
    with tempfile.TemporaryDirectory(prefix="murmur-bench-") as tmp:
        workdir = Path(tmp)
        if "goodput" in parts:
            result = _run_async(lambda: loopback_goodput(args.mib, args.repeats, workdir / "goodput"))
            lines = report_pull(f"### 1. Goodput on loopback: {args.mib:g} MiB fp32, two p2pd daemons, "
                                f"best of {args.repeats}", result, "raw p2pd stream (baseline)")
            costs = in_process_costs(_vector(_numel(args.mib), seed=1), "fp32")
            paired_round, paired_fetch = result.paired_ratios
            lines += [f"exchange (fetch) / raw stream, median of per-repeat ratios: {paired_fetch:.2f}x "
                      f"({_verdict(paired_fetch, TARGETS['goodput'])}); round with its mix / raw stream: "
                      f"{paired_round:.2f}x",
                      f"best of each: round {result.ratio:.2f}x, fetch {result.fetch_ratio:.2f}x",
                      f"in-process costs of the same vector: encode {costs['encode']:.3f} s, decode (chunk by "
                      f"chunk, validated) {costs['decode']:.3f} s, mix {costs['mix']:.3f} s", ""]
            print("\n".join(lines), flush=True)
        if "link" in parts:
            (workdir / "link").mkdir(parents=True)
            result = link_goodput(args.link_mib, args.repeats, workdir / "link")
            lines = report_pull(f"### 2. Across a {LINK_MBIT:g} Mbit/s tbf link between two namespaces: "
                                f"{args.link_mib:g} MiB fp32, one process per side, best of {args.repeats}",
                                result, "raw p2pd stream")
            link_ratio = result.nbytes * 8 / min(result.exchange_s) / (LINK_MBIT * 1e6)
            raw_ratio = result.nbytes * 8 / min(result.raw_s) / (LINK_MBIT * 1e6)
            lines += [f"exchange goodput / link rate: {link_ratio:.2f} ({_verdict(link_ratio, TARGETS['link'])}); "
                      f"raw stream / link rate: {raw_ratio:.2f}; exchange / raw stream: {result.ratio:.2f}x", ""]
            print("\n".join(lines), flush=True)
        if "duplex" in parts:
            (workdir / "duplex").mkdir(parents=True)
            sides = duplex_rounds(args.duplex_mib, args.rounds, workdir / "duplex")
            transfer_s = sides[0]["nbytes"] * 8 / (DUPLEX_LINK_MBIT * 1e6)
            lines = [f"### 2b. Duplex exchanges across a {DUPLEX_LINK_MBIT:g} Mbit/s link shaped both ways: "
                     f"{args.duplex_mib:g} MiB fp32 each way, one process per side, {args.rounds} rounds of each "
                     "alternating, after a warm-up of each", "",
                     "| side | exchange | round s (median) | rounds s | / one transfer at the link rate |",
                     "|---|---|---:|---|---:|"]
            for side in sides:
                role = "asker" if side["asker"] else "answerer"
                for mode in ("sequential", "duplex"):
                    times = side["times"][mode]
                    if times:
                        median = statistics.median(times)
                        lines.append(f"| {role} | {mode} | {median:.2f} | {', '.join(f'{t:.2f}' for t in times)} | "
                                     f"{median / transfer_s:.2f} |")
            asker = next(s for s in sides if s["asker"])
            if asker["times"]["duplex"] and asker["times"]["sequential"]:
                ratio = statistics.median(asker["times"]["sequential"]) / statistics.median(asker["times"]["duplex"])
                lines.append(f"\nsequential / duplex round time (the asker's medians): {ratio:.2f}x "
                             f"(one transfer at the link rate: {transfer_s:.2f} s)")
            for side in sides:
                lines += [f"skipped: {s}" for s in side["skipped"]]
            print("\n".join(lines + [""]), flush=True)
        if "rounds" in parts:
            results = _run_async(lambda: round_latency(args.peers, args.dim, ("fp32", "fp16"), args.rounds,
                                                       workdir / "rounds"))
            lines = [f"### 3. Round latency: {args.peers} GossipPeers x {args.dim:,} parameters, one-peer "
                     f"exponential, {args.peers} p2pd daemons and one Python process, median of {args.rounds} rounds",
                     "", "| codec | round s (median) | rounds s | encode+decode s (baseline, median) | "
                     f"round / baseline | round / ({args.peers} x baseline) |", "|---|---:|---|---:|---:|---:|"]
            for r in results:
                lines.append(f"| {r.codec} | {r.median_s:.2f} | {', '.join(f'{t:.2f}' for t in r.round_s)} | "
                             f"{r.baseline_s:.3f} | {r.median_s / r.baseline_s:.1f}x | "
                             f"{r.median_s / (args.peers * r.baseline_s):.1f}x |")
            for r in results:
                if r.skipped:
                    lines.append(f"{r.codec}: neighbours skipped in timed rounds: {', '.join(r.skipped)}")
            print("\n".join(lines), flush=True)
            in_process = {r.codec: r for r in results}
        if "nodes" in parts:
            lines = [f"### 3b. Round latency with one process per node: {args.peers} node processes (a GossipPeer "
                     f"on its own p2pd each) x {args.dim:,} parameters, one-peer exponential, median of "
                     f"{args.rounds} rounds; baseline: the in-process rounds of part 3 in this run", "",
                     "| codec | round s (median) | rounds s | in-process round s (baseline) | processes / in-process |",
                     "|---|---:|---|---:|---:|"]
            for codec in ("fp32", "fp16"):
                r = multiprocess_rounds(args.peers, args.dim, codec, args.rounds, workdir / f"nodes-{codec}")
                base = in_process.get(codec)
                ratio = f"{r.median_s / base.median_s:.2f}x" if base else "- (run with rounds)"
                lines.append(f"| {codec} | {r.median_s:.2f} | {', '.join(f'{t:.2f}' for t in r.round_s)} | "
                             f"{f'{base.median_s:.2f}' if base else '-'} | {ratio} |")
                if r.skipped:
                    lines.append(f"{codec}: neighbours skipped in timed rounds: {', '.join(r.skipped)}")
            print("\n".join(lines), flush=True)
        if "inputs" in parts:
            rounds, model = 6, _numel(args.inputs_mib) * 4
            lines = [f"### 4. Past round inputs: one GossipPeer, {args.inputs_mib:g} MiB of float32, {rounds} rounds "
                     "each from new values, staleness bound 2 (this round's input and 2 past ones kept); baseline: "
                     "the same peer keeping the past ones in float32. Held: traced bytes after the rounds beyond "
                     "those before (the last mix and the round inputs, less the first values)", "",
                     "| codec | held MiB (baseline) | held MiB | held / baseline | saved / the 2 past float32 "
                     "copies | round s alone (baseline, median) | round s alone (median) |",
                     "|---|---:|---:|---:|---:|---:|---:|"]
            for codec in ("int8", "bf16"):
                base_held, base_s = _run_async(lambda: kept_inputs(args.inputs_mib, codec, rounds, FloatInputsPeer))
                held, times = _run_async(lambda: kept_inputs(args.inputs_mib, codec, rounds, GossipPeer))
                lines.append(f"| {codec} | {base_held / 2**20:.0f} | {held / 2**20:.0f} | {held / base_held:.2f}x | "
                             f"{(base_held - held) / (2 * model):.2f} | "
                             f"{statistics.median(base_s[1:]):.3f} | {statistics.median(times[1:]):.3f} |")
            print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
