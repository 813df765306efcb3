"""A hostile peer process for the resource-limit attacks: it floods a swarm of real `murmur` nodes with
streams and pulls, or lies in its record, for a bounded time.

Run as `python tests/support/hostile_flood.py WORKDIR EXTRA_IDS` (it starts its hosts, then waits for
WORKDIR/target.json, a `Target`), it joins the swarm through its DHT and attacks with the modes the target
file names, then writes a report (JSON, one line on stdout) and stays, its record live, until it is
signalled.

Modes (`Mode`):
- `flood-streams`: many concurrent incoming gossip and SPES-fetch streams, from its own peer id (a
  member: it publishes a record; exchange requests with a whole vector behind their header) and from
  `extra_ids` more peer ids without records (half a header), each held open;
- `flood-pulls`: pulls of the current parameters and of rounds, back to back from several streams at
  once, and exchange requests for far-future rounds (bookkeeping per round); with both floods, the
  pulls take the first half of `duration_s` and the streams the second;
- `unroutable`: its record names only addresses that route nowhere or into a blackhole;
- `stalled-record`: its record stays at step 0 and round 0 while announcing the swarm's first round,
  and every gossip stream to it hangs as to a frozen peer (the test SIGSTOPs the process too).
Not a test module: tests/test_limits_swarm.py and bench/bench_floods.py start it (`HostileProcess`:
started early, told its target once the swarm runs). Every loop is
bounded by `duration_s`; it sends only to the loopback addresses in the target file.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# Addresses that route nowhere (documentation, unspecified, multicast): no node may dial them. (A
# blackhole in a private range would not do on loopback: the hostile's DHT connection already reaches
# every victim, and p2pd's connect returns at once on a live connection; node.net.reach's rule and the
# dialer's backoff against a hanging dial are unit-tested.)
UNROUTABLE_MADDRS = ("/ip4/192.0.2.1/tcp/4001", "/ip4/0.0.0.0/tcp/4001", "/ip4/224.0.0.1/tcp/4001")
HALF_HEADER = (100).to_bytes(8, "big") + b"\x8b"  # a header frame's length, then one byte of it
PAUSE_S = 0.25  # a flood stream the victim closed is opened again after this: bounded, not a busy loop


class Mode(enum.StrEnum):
    FLOOD_STREAMS = "flood-streams"
    FLOOD_PULLS = "flood-pulls"
    UNROUTABLE = "unroutable"
    STALLED_RECORD = "stalled-record"


@dataclass(frozen=True)
class Victim:
    peer_id: str
    maddrs: tuple[str, ...]  # DHT maddrs (p2pd: the data plane too)


@dataclass(frozen=True)
class Target:
    """What the hostile process is told (the JSON file it is started with)."""

    swarm: str
    config_hash: str
    dim: int  # the swarm's vector (its manifest: one float32 tensor "params")
    victims: tuple[Victim, ...]
    workdir: Path
    modes: tuple[Mode, ...]
    gossip_from: int = 0  # the swarm's first round, announced in the record
    heartbeat_s: float = 1.0
    duration_s: float = 10.0
    streams_per_id: int = 64  # concurrent held streams per victim from the hostile's own (member) id
    pullers: int = 4  # concurrent pull loops per victim
    extra_ids: int = 2  # peer ids without records that flood streams too
    extra_streams: int = 16  # concurrent streams per victim from each of them
    spes: bool = False  # the victims serve SPES's fetch protocol: flood it too

    @classmethod
    def load(cls, path: Path) -> Target:
        raw = json.loads(path.read_text())
        raw["victims"] = tuple(Victim(v["peer_id"], tuple(v["maddrs"])) for v in raw["victims"])
        raw["workdir"] = Path(raw["workdir"])
        raw["modes"] = tuple(Mode(m) for m in raw["modes"])
        return cls(**raw)

    def dump(self, path: Path) -> None:
        raw = {**self.__dict__, "workdir": str(self.workdir), "modes": [str(m) for m in self.modes],
               "victims": [{"peer_id": v.peer_id, "maddrs": list(v.maddrs)} for v in self.victims]}
        path.write_text(json.dumps(raw))


@dataclass
class Report:
    streams_opened: int = 0
    streams_open_failed: int = 0
    streams_closed_by_victim: int = 0  # closed by the victim before the attack ended
    pulls: collections.Counter[str] = field(default_factory=collections.Counter)  # "tensors" or the reject's error
    exchanges_far_ahead: collections.Counter[str] = field(default_factory=collections.Counter)

    def as_json(self) -> dict[str, Any]:
        return {"streams_opened": self.streams_opened, "streams_open_failed": self.streams_open_failed,
                "streams_closed_by_victim": self.streams_closed_by_victim, "pulls": dict(self.pulls),
                "exchanges_far_ahead": dict(self.exchanges_far_ahead)}


async def join_open_swarm(p2p: Any, identity: Any, swarm: str, bootstrap: tuple[str, ...], heartbeat_s: float, *,
                          data_maddrs: tuple[str, ...] = (), gossip_from: int = 0, timeout_s: float = 30.0) -> Any:
    """A `Discovery` that has entered the open swarm `swarm` (its founder's signed config read from the
    DHT, as a joiner does): this peer's record is live, with `gossip_from` and `data_maddrs` if given,
    so the swarm's nodes count it a member. The caller closes it."""
    from node.net.admission import Admission
    from node.net.discovery import Discovery, DiscoverySettings

    discovery = Discovery(p2p, identity, DiscoverySettings(swarm, heartbeat_s=heartbeat_s), initial_peers=bootstrap,
                          data_maddrs=data_maddrs)
    if gossip_from:
        discovery.update(gossip_from=gossip_from)  # in its first record
    await discovery.start(publish=False)
    deadline = time.monotonic() + timeout_s
    while (read := await discovery.read_config(None)).config is None:
        if time.monotonic() > deadline:
            await discovery.close()
            raise RuntimeError(f"no config of swarm {swarm!r} found: {read.failed or read.refused}")
        await asyncio.sleep(0.5)
    await discovery.enter(read.config, Admission.open(swarm))
    return discovery


async def _start_host(workdir: Path, name: str, initial: tuple[str, ...]) -> tuple[Any, Any, Any]:
    """p2pd with a new identity (loopback, no UPnP), and the data-plane transport over it."""
    from node.net.identity import create_identity
    from node.net.transport.p2pd import P2PDTransport, P2PSettings, start_p2pd

    path = workdir / f"{name}.key"
    identity = create_identity(path)
    p2p = await start_p2pd(P2PSettings(identity_path=path, initial_peers=initial, nat_port_map=False))
    return identity, p2p, P2PDTransport(p2p, open_timeout_s=5.0)


def _header(target: Target, sender: str, kind: str, round_index: int, *, tensors: bool = False,
            meta: dict[str, Any] | None = None) -> bytes:
    from gossip.codecs import get_codec
    from gossip.wire import iter_message

    payload = {"params": np.zeros(target.dim, np.float32)} if tensors else {}
    frames = iter_message(payload, get_codec("fp32"), swarm=target.swarm, config_hash=target.config_hash,
                          sender=sender, round=round_index, step=0, kind=kind, meta=meta)
    return bytes(next(iter(frames)))


async def read_answer(stream: Any) -> tuple[str, int]:
    """The answer's kind (or the reject's error) and its payload size, read through the wire decoder."""
    from gossip.wire import MessageReader, WireLimits

    reader = MessageReader(stream.read_exactly, WireLimits(max_payload_bytes=1 << 31))
    header = await reader.header()
    message = await reader.rest()
    if header.kind == "reject":
        return str(header.meta.get("error")), 0
    return header.kind, sum(t.nbytes for t in message.tensors.values())


async def hold_streams(transport: Any, target: Target, victim: Victim, n: int, victim_round: Any, deadline: float,
                       report: Report) -> None:
    """Keep `n` streams to `victim` open until `deadline`. Every other gossip stream carries an exchange
    request with the whole vector for the victim's next round (`victim_round() + 1`, which it waits
    for), though no round of the victim waits for this peer: a receiver that reads a request whole
    before it checks the header holds a model's worth per stream. The others, SPES fetch streams and
    every stream of a peer without a record (`victim_round` None) carry half a header. A stream the
    victim closes is opened again after PAUSE_S."""
    from gossip.codecs import get_codec
    from gossip.spes.fetch import FETCH_PROTOCOL
    from gossip.transport import GOSSIP_PROTOCOL
    from gossip.wire import iter_message

    vector = {"params": np.ones(target.dim, np.float32)}

    def exchange(i: int) -> list[Any]:
        if victim_round is None or i % 2:
            return [HALF_HEADER]
        return list(iter_message(vector, get_codec("fp32"), swarm=target.swarm, config_hash=target.config_hash,
                                 sender=transport.peer_id, round=victim_round() + 1, step=0, kind="exchange"))

    async def one(i: int) -> None:
        protocol = FETCH_PROTOCOL if target.spes and i % 2 else GOSSIP_PROTOCOL
        while time.monotonic() < deadline:
            try:
                stream = await transport.open_stream(victim.peer_id, protocol)
            except (ConnectionError, TimeoutError, RuntimeError):
                report.streams_open_failed += 1
                await asyncio.sleep(PAUSE_S)
                continue
            report.streams_opened += 1
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    for frame in (exchange(i // 2 if target.spes else i) if protocol == GOSSIP_PROTOCOL
                                  else [HALF_HEADER]):
                        await stream.write(frame)
                    await stream.read_exactly(1 << 20)  # returns only when the victim closes
            except TimeoutError:
                pass  # held to the end
            except ConnectionError:
                report.streams_closed_by_victim += 1
                await asyncio.sleep(PAUSE_S)
            finally:
                stream.abort()

    await asyncio.gather(*(one(i) for i in range(n)))


async def flood_pulls(transport: Any, target: Target, victim: Victim, victim_round: Any, deadline: float,
                      report: Report) -> None:
    """Pull the current parameters and the victim's current rounds (`victim_round()`, from its record)
    back to back, from `target.pullers` streams at once, and send exchange requests for rounds far
    ahead, until `deadline`."""
    from gossip.transport import GOSSIP_PROTOCOL

    me = transport.peer_id
    current = _header(target, me, "pull", 0, meta={"current": True})
    far = _header(target, me, "exchange", 10**15, tensors=True)

    async def loop(i: int) -> None:
        n = 0
        while time.monotonic() < deadline:
            n += 1
            kind = ("current", "round", "far")[(i + n) % 3]
            request = (current if kind == "current" else far if kind == "far"
                       else _header(target, me, "pull", victim_round() + 2))  # its record trails it
            try:
                async with asyncio.timeout(5.0):
                    stream = await transport.open_stream(victim.peer_id, GOSSIP_PROTOCOL)
                    try:
                        await stream.write(request)
                        answer, nbytes = await read_answer(stream)
                    finally:
                        stream.abort()
            except (ConnectionError, TimeoutError, RuntimeError) as exc:
                answer, nbytes = f"failed: {type(exc).__name__}", 0
            except Exception as exc:  # a refused answer of ours, counted as such
                answer, nbytes = f"error: {type(exc).__name__}", 0
            counter = report.exchanges_far_ahead if kind == "far" else report.pulls
            counter["tensors" if nbytes else answer] += 1

    await asyncio.gather(*(loop(i) for i in range(target.pullers)))


async def frozen_handler(stream: Any) -> None:
    """A gossip stream to a frozen peer: nothing is read or written until the asker gives up."""
    await asyncio.Event().wait()


async def main(workdir: Path, extra_ids: int) -> None:
    """Start the hosts (imports, keys and daemons take seconds), then wait for `workdir/target.json`:
    the swarm can start meanwhile."""
    # An attacker's CPU is its own, elsewhere: on one shared machine it yields to the nodes under test
    # (its p2pd daemons inherit this), so what is measured is what its traffic costs them.
    os.nice(19)

    identity, p2p, transport = await _start_host(workdir, "hostile", ())
    extra = [await _start_host(workdir, f"extra{i}", ()) for i in range(extra_ids)]
    stack = contextlib.AsyncExitStack()
    async with stack:
        for _, other_p2p, other in [(identity, p2p, transport), *extra]:
            stack.push_async_callback(other_p2p.shutdown)
            stack.push_async_callback(other.close)
        print(json.dumps({"started": identity.peer_id}), flush=True)
        target_file = workdir / "target.json"
        while not target_file.exists():
            await asyncio.sleep(0.1)
        target = Target.load(target_file)
        extra = extra[:target.extra_ids]
        bootstrap = tuple(a for v in target.victims for a in v.maddrs)[:2]
        for victim in target.victims:  # where they are, before the DHT asks for them
            with contextlib.suppress(ConnectionError, TimeoutError):
                await transport.connect(victim.peer_id, victim.maddrs)
        me = identity.peer_id
        data_maddrs = tuple(f"{a}/p2p/{me}" for a in UNROUTABLE_MADDRS) if Mode.UNROUTABLE in target.modes else ()
        stalled = Mode.STALLED_RECORD in target.modes
        if stalled:
            from gossip.transport import GOSSIP_PROTOCOL

            await transport.serve(GOSSIP_PROTOCOL, frozen_handler)
        # a participant that never runs a round: it announces the swarm's first round from its first record
        discovery = await join_open_swarm(p2p, identity, target.swarm, bootstrap, target.heartbeat_s,
                                          data_maddrs=data_maddrs, gossip_from=target.gossip_from if stalled else 0)
        stack.push_async_callback(discovery.close)
        for victim in target.victims:
            for _, _, t in [(identity, p2p, transport), *extra]:
                with contextlib.suppress(ConnectionError, TimeoutError):
                    await t.connect(victim.peer_id, victim.maddrs)
        print(json.dumps({"ready": me, "extra": [t.peer_id for _, _, t in extra]}), flush=True)

        # pulls first, then streams: held streams fill this peer's stream slots, which pulls need too
        report = Report()
        floods = [m for m in (Mode.FLOOD_PULLS, Mode.FLOOD_STREAMS) if m in target.modes]
        for mode in floods:
            deadline = time.monotonic() + target.duration_s / len(floods)
            attacks = []
            for victim in target.victims:
                def victim_round(peer: str = victim.peer_id) -> int:
                    return next((r.round for r in discovery.view() if r.peer_id == peer), 0)

                if mode is Mode.FLOOD_STREAMS:
                    attacks.append(hold_streams(transport, target, victim, target.streams_per_id, victim_round,
                                                deadline, report))
                    attacks += [hold_streams(t, target, victim, target.extra_streams, None, deadline, report)
                                for _, _, t in extra]
                else:
                    attacks.append(flood_pulls(transport, target, victim, victim_round, deadline, report))
            await asyncio.gather(*attacks)
        print(json.dumps({"report": report.as_json()}), flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()


def watch_rounds(nodes: list[Any], seconds: float) -> tuple[list[float], float]:
    """Rounds run per second by each node (support.swarm_harness.Node) over `seconds`, and the longest
    round any of them reported meanwhile."""
    before = [n.status()["rounds_run"] for n in nodes]
    started, longest = time.monotonic(), 0.0
    while time.monotonic() - started < seconds:
        longest = max([longest, *(n.status()["last_round_s"] for n in nodes)])
        time.sleep(0.3)
    elapsed = time.monotonic() - started
    return [(n.status()["rounds_run"] - b) / elapsed for n, b in zip(nodes, before)], longest


class HostileProcess:
    """The hostile peer as a process of its own (its p2pd daemons die with it). Started early (its
    imports, keys and daemons take seconds) and told its target by `attack`; read by `ready` and
    `report`, frozen by `freeze` (SIGSTOP, as a frozen peer), killed by `kill`."""

    def __init__(self, workdir: Path, extra_ids: int) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.out = workdir / "hostile.out"
        self.err = workdir / "hostile.err"
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            # its own session and process group: kill() takes its p2pd daemons with it
            self.process = subprocess.Popen([sys.executable, __file__, str(workdir), str(extra_ids)], stdout=out,
                                            stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)

    def __enter__(self) -> HostileProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.kill()

    def attack(self, target: Target) -> None:
        """Give the process its target (written whole: it waits for the file)."""
        temp = self.workdir / ".target.json"
        target.dump(temp)
        temp.rename(self.workdir / "target.json")

    def _line(self, key: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.out.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    parsed = json.loads(line)
                    if key in parsed:
                        return dict(parsed)
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"the hostile process gave no {key!r} line (exit {self.process.poll()}):\n"
                             + self.err.read_text()[-3000:])

    def ready(self, timeout_s: float = 60.0) -> dict[str, Any]:
        return self._line("ready", timeout_s)

    def report(self, timeout_s: float) -> dict[str, Any]:
        return dict(self._line("report", timeout_s)["report"])

    def freeze(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def kill(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), int(sys.argv[2])))
