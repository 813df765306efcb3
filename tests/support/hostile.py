"""A hostile murmur node for attack tests: the real node (`murmur node` / `murmur join`, the same flags,
the same code) with one behaviour replaced, started as a process of its own:

    python tests/support/hostile.py --mode noise -- join --peers ADDR --invite S@FOUNDER ...
    python -m support.hostile --mode noise -- join ...     (with tests/ on sys.path; -m tests.support.hostile
                                                            from the repository root)

(`Swarm.spawn(..., hostile=hostile_argv([...]))` in tests/support/swarm_harness.py starts it.)

Everything before `--` configures the attack; everything after it is a `murmur` command line. Modes
(`Mode`; the definitions are in `BEHAVIOURS`):

- huge-step: its peer record and every gossip header claim step 10^9 (HUGE_STEP); it trains honestly.
- noise: every tensor it serves (gossip replies, exchange requests, pulls and downloads) is finite
  Gaussian noise with each tensor's own standard deviation (at least 0.01). Under compressed gossip
  (`--gossip-compression choco`) the tensor modes replace the differences it sends instead.
- scaled: it serves its honest tensors x 1000 (SCALE).
- sign-flip: it serves its update reversed and amplified: with x_prev the tensors it held when it last
  served a message of an earlier round and x its current ones, it serves x_prev - k (x - x_prev),
  k = 10 (SIGN_FLIP_FACTOR, `--option sign-flip-factor=K`).
- stale-replay: it serves, forever, the first tensors it ever served (its seeded initial parameters,
  or whatever it downloaded on joining).
- useless: plausible but useless updates: with x_prev and x as for sign-flip, it serves x_prev + r, r a
  random direction of the honest update's norm ||x - x_prev|| per tensor (its own training is honest); a
  peer whose values are updates themselves (gossip DiLoCo's fragment messages, pseudo-gradients) serves r
  of the honest message's norm.
- creeping: its record's step creeps: each heartbeat it claims one step more than the last, within
  `depth` (default 40) steps below the floor, the lowest step its neighbours' records show less the lag
  window (its own node's, the same as theirs); where one more would reach the floor (its neighbours were
  held meanwhile) it falls back to `depth` below it and creeps on (`creep_claim`). A laggard that seems
  to be catching up, always just beyond the window, so that every round that pairs with it is held
  (node.swarm.loop `_wait_for_laggards`) until its neighbour's wait budget for it is spent
  (node.swarm.progress). It trains and serves honestly.
- spes-capacity: its peer record claims SPES capacity 2^62, and its expert records (and expert fetch
  replies) claim version 2^62 for every expert it holds, as their owner.

The attacks that have launcher scripts of their own run here too, from inside the real node (each
starts `attack-after` seconds after the node's discovery started, default 5, and is bounded by
`duration`, default 30 s; `--option KEY=VALUE`):

- forge-config: under `<swarm>.config`, a plain value, a config it signed itself with a far
  expiration (and an ordinary one), one claiming the founder's key, an oversized one, every `every`
  seconds (hostile_dht.forge_config, through a client-mode DHT node on the node's own p2pd).
- flood-records: `count` (1000) fake peer records, `keys` (20) of them from real keys of their own
  (hostile_dht.flood_records).
- flood-streams / flood-pulls: held incoming streams (`streams`, 64 per victim) carrying an exchange
  request's whole vector, and back-to-back pulls of the current parameters, of rounds and of far-future
  rounds (`pullers`, 4 per victim), to every peer of its view (hostile_flood.hold_streams and
  flood_pulls; the vector of `dim` floats is the swarm's own for a vector model).
- unroutable: its record names only addresses that route nowhere (hostile_flood.UNROUTABLE_MADDRS).
- stalled-record: its record stays at step 0 and round 0, and every gossip stream to it hangs.
- slow-serve: it serves whole-model downloads (pulls of its current parameters) at `rate` bytes per
  second (default 50000), frame by frame: a donor on a slow but moving link (tests of download progress).
- wrong-key / stolen-certificate: in a key / allowlist swarm, it presents proofs under a random key, or
  the certificate file `certificate` (another peer's), and admits everyone itself
  (hostile_intruder.forge_admission).

The separate launchers stay for the tests that drive them (test_swarm_identity, test_limits_swarm,
bench_floods): hostile_dht and hostile_flood run as peers without a node and write a JSON report.

Several `--mode` flags combine (say huge-step with noise). With `--cycle-rounds N` the tensor modes
among them (noise, scaled, sign-flip, stale-replay) take turns, each for N rounds, by the round a
message belongs to.

The hostile reports what it did on stderr, a line `murmur hostile: <mode>: <what> <count>` at the first
occurrence and every tenth (`HostileContext.count`); `hostile_counts(stderr)` reads them back, so a
test can prove the attack happened before it asserts that it failed.

**Adding a mode** (another helper's module does this): add a member to `Mode`, write
`install(ctx: HostileContext) -> None` that patches what it needs (attributes of the node's classes:
the whole process is the hostile node) and/or registers work with `ctx.background(...)`, which runs
inside the node's event loop once its discovery has started and is cancelled before discovery
closes; then add `Mode.X: Behaviour("what it does", install)` to `BEHAVIOURS`. Keep each mode one
behaviour, so that combining modes stays meaningful.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import enum
import re
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

if TYPE_CHECKING:
    from gossip.exchange import GossipPeer
    from node.net.discovery import Discovery
    from node.runtime.status import NodeRuntime

HUGE_STEP = 10**9
HUGE_CAPACITY = 2**62
HUGE_VERSION = 2**62
SCALE = 1000.0
SIGN_FLIP_FACTOR = 10.0
NOISE_MIN_STD = 0.01
REPORT_EVERY = 10
PREFIX = "murmur hostile: "
CREEP_DEPTH = 40  # steps below its neighbours' lag floor: a 30 s laggard wait at 1 step a heartbeat of 1 s
MAX_ATTACK_S = 300.0  # every DHT or flood attack ends within this, whatever `duration` says


class Mode(enum.StrEnum):
    """What the hostile node does differently from an honest one (see the module docstring)."""

    HUGE_STEP = "huge-step"
    NOISE = "noise"
    SCALED = "scaled"
    SIGN_FLIP = "sign-flip"
    STALE_REPLAY = "stale-replay"
    USELESS = "useless"
    SPES_CAPACITY = "spes-capacity"
    CREEPING = "creeping"
    # the attacks of hostile_dht.py, hostile_flood.py and hostile_intruder.py, from inside a real node
    FORGE_CONFIG = "forge-config"
    FLOOD_RECORDS = "flood-records"
    FLOOD_STREAMS = "flood-streams"
    FLOOD_PULLS = "flood-pulls"
    UNROUTABLE = "unroutable"
    STALLED_RECORD = "stalled-record"
    WRONG_KEY = "wrong-key"
    STOLEN_CERTIFICATE = "stolen-certificate"
    SLOW_SERVE = "slow-serve"


# the modes that replace the tensors a node serves (they take turns under --cycle-rounds)
TENSOR_MODES = (Mode.NOISE, Mode.SCALED, Mode.SIGN_FLIP, Mode.STALE_REPLAY, Mode.USELESS)


@dataclass
class HostileNode:
    """What background work gets: the running node's parts (`runtime.discovery`, `runtime.transport`,
    `runtime.peer`, `runtime.config`, ...) once its discovery has started."""

    runtime: NodeRuntime | None
    discovery: Discovery


Background = Callable[[HostileNode], Awaitable[None]]


@dataclass
class HostileContext:
    """What an installer gets: the modes and options asked for, a seeded generator, a tally that
    reports on stderr, and a way to run work inside the node."""

    modes: tuple[Mode, ...]
    options: Mapping[str, str] = field(default_factory=dict)
    cycle_rounds: int = 0  # 0: the tensor modes apply together (the first one listed wins)
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(1))
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    backgrounds: list[Background] = field(default_factory=list)
    start_hooks: list[Callable[[Discovery], None]] = field(default_factory=list)  # before the first record

    def option(self, name: str, default: float) -> float:
        return float(self.options.get(name, default))

    def text(self, name: str, default: str = "") -> str:
        return str(self.options.get(name, default))

    def count(self, mode: Mode | str, what: str) -> None:
        """Tally one hostile act; report the first and every REPORT_EVERY-th on stderr."""
        key = f"{mode}: {what}"
        self.counts[key] += 1
        n = self.counts[key]
        if n == 1 or n % REPORT_EVERY == 0:
            print(f"{PREFIX}{key} {n}", file=sys.stderr, flush=True)

    def background(self, work: Background) -> None:
        self.backgrounds.append(work)

    def before_start(self, hook: Callable[[Discovery], None]) -> None:
        """Run `hook` on the node's Discovery before it publishes its first record."""
        self.start_hooks.append(hook)

    def tensor_mode(self, round_index: int) -> Mode | None:
        """The tensor mode in force for a message of `round_index`."""
        modes = [m for m in self.modes if m in TENSOR_MODES]
        if not modes:
            return None
        if self.cycle_rounds <= 0:
            return modes[0]
        return modes[(max(0, round_index) // self.cycle_rounds) % len(modes)]


def hostile_counts(stderr: str) -> dict[str, int]:
    """The latest count of each `<mode>: <what>` a hostile node reported on its stderr."""
    counts: dict[str, int] = {}
    for match in re.finditer(rf"^{re.escape(PREFIX)}(.+) (\d+)$", stderr, flags=re.MULTILINE):
        counts[match.group(1)] = max(counts.get(match.group(1), 0), int(match.group(2)))
    return counts


# ---- tensors ------------------------------------------------------------------------------------


@dataclass
class Served:
    """What one GossipPeer of the hostile has served, for the modes that remember."""

    first: dict[str, np.ndarray] | None = None
    previous: dict[str, np.ndarray] | None = None  # its honest tensors when it served an earlier round
    current: dict[str, np.ndarray] | None = None
    current_round: int = -1
    cache: dict[tuple[Mode, int], dict[str, np.ndarray]] = field(default_factory=dict)  # this round's answers
    updates: bool = False  # its values are updates (a DiLoCo fragment's messages), not parameters


def tampered(ctx: HostileContext, served: Served, mode: Mode, tensors: Mapping[str, np.ndarray],
              round_index: int) -> dict[str, np.ndarray]:
    honest = {name: np.asarray(t, np.float32) for name, t in tensors.items()}
    if served.first is None:
        served.first = honest
    if round_index != served.current_round:
        served.previous, served.current, served.current_round = served.current, honest, round_index
        served.cache.clear()
    key = (mode, round_index)
    if key in served.cache:  # every pull of one round gets the same answer
        return served.cache[key]
    if mode is Mode.NOISE:
        out = {n: (ctx.rng.standard_normal(t.shape) * max(float(t.std()), NOISE_MIN_STD)).astype(np.float32)
               for n, t in honest.items()}
    elif mode is Mode.SCALED:
        out = {n: t * np.float32(SCALE) for n, t in honest.items()}
    elif mode is Mode.SIGN_FLIP:
        k = ctx.option("sign-flip-factor", SIGN_FLIP_FACTOR)
        before = served.previous or honest
        out = {n: (before[n] - k * (t - before[n])).astype(np.float32) for n, t in honest.items()}
    elif mode is Mode.STALE_REPLAY:
        out = dict(served.first)
    elif mode is Mode.USELESS and served.updates:
        out = {n: random_of_norm(ctx.rng, t.shape, float(np.linalg.norm(t))).astype(np.float32) for n, t in honest.items()}
    elif mode is Mode.USELESS:
        before = served.previous or honest
        out = {n: (before[n] + random_of_norm(ctx.rng, t.shape, float(np.linalg.norm(t - before[n])))).astype(np.float32)
               for n, t in honest.items()}
    else:
        raise ValueError(f"{mode} does not replace tensors")
    served.cache[key] = out
    return out


def random_of_norm(rng: np.random.Generator, shape: tuple[int, ...], norm: float) -> np.ndarray:
    """A random direction (Gaussian, normalised) of length `norm`."""
    direction = rng.standard_normal(shape)
    length = float(np.linalg.norm(direction))
    return direction * (norm / length) if length > 0.0 else direction * 0.0


_DILOCO_MESSAGES = re.compile(r"/murmur/diloco/\d+/1")  # node.algorithms.diloco.trainer.fragment_protocol


def install_tensor_modes(ctx: HostileContext) -> None:
    """Replace the tensors of every message a GossipPeer sends with tensors (exchange requests, replies
    to pulls and exchanges, downloads): the one seam every served tensor passes. Under compressed gossip
    the `useless` mode instead claims its useless parameters and encodes them as CHOCO differences
    honestly (ChocoState.prepare), so its edges stay in step and only the values are useless; the other
    modes replace the differences themselves."""
    from gossip import choco, exchange

    original = exchange.GossipPeer._frames
    original_prepare = choco.ChocoState.prepare
    served: dict[int, Served] = {}
    claims: dict[int, tuple[int, int]] = {}  # ChocoState -> (id of the round input last seen, its count)

    def prepare(self: Any, peer: str, own: Any) -> Any:
        seen, count = claims.get(id(self), (None, -1))
        if seen != id(own):  # one round input per round, the same for every edge
            seen, count = id(own), count + 1
            claims[id(self)] = (seen, count)
        if ctx.tensor_mode(count) is Mode.USELESS:
            own = tampered(ctx, served.setdefault(id(self), Served()), Mode.USELESS, own, count)
            ctx.count(Mode.USELESS, "tampered choco claim")
        return original_prepare(self, peer, own)

    def frames(self: GossipPeer, tensors: Any, round_index: int | None, kind: str, meta: Any = None,
               codec: Any = None) -> Any:
        # under compressed gossip (`codec` given) the tensors are the CHOCO differences: those are replaced,
        # but for `useless`, whose claim `prepare` encodes
        if self._choco is not None and ctx.tensor_mode(self.round if round_index is None else round_index) is Mode.USELESS:
            return original(self, tensors, round_index, kind, meta, codec)
        if tensors and kind in (exchange.REPLY, exchange.EXCHANGE):
            r = self.round if round_index is None else round_index
            mode = ctx.tensor_mode(r)
            if mode is not None:
                kept = served.setdefault(id(self), Served(updates=_DILOCO_MESSAGES.fullmatch(self._protocol) is not None))
                tensors = tampered(ctx, kept, mode, tensors, r)
                ctx.count(mode, f"tampered {kind}")
        return original(self, tensors, round_index, kind, meta, codec)

    exchange.GossipPeer._frames = frames  # type: ignore[method-assign]
    choco.ChocoState.prepare = prepare  # type: ignore[method-assign]


# ---- records ------------------------------------------------------------------------------------


def install_huge_step(ctx: HostileContext) -> None:
    """Claim HUGE_STEP in the peer record and in every gossip header (the trainer's own step is honest)."""
    from gossip import exchange
    from node.net import discovery

    update = discovery.Discovery.update

    def claimed(self: Discovery, **changes: Any) -> None:
        if changes.get("step") is not None:
            changes["step"] = HUGE_STEP
            ctx.count(Mode.HUGE_STEP, "record claims")
        update(self, **changes)

    discovery.Discovery.update = claimed  # type: ignore[method-assign]
    ctx.before_start(lambda d: d.update(step=HUGE_STEP))
    original = exchange.GossipPeer._frames

    def frames(self: GossipPeer, tensors: Any, round_index: int | None, kind: str, meta: Any = None,
               codec: Any = None) -> Any:
        honest = self.step
        self.step = HUGE_STEP  # iter_message reads it when called, before this returns
        try:
            return original(self, tensors, round_index, kind, meta, codec)
        finally:
            self.step = honest

    exchange.GossipPeer._frames = frames  # type: ignore[method-assign]


def install_spes_capacity(ctx: HostileContext) -> None:
    """Claim capacity HUGE_CAPACITY in the peer record and HUGE_VERSION, as owner, for every expert
    record it publishes and every expert copy it serves."""
    from node.algorithms.spes import directory
    from node.algorithms.spes import node as spes_node
    from node.net import discovery

    update = discovery.Discovery.update

    def claimed(self: Discovery, **changes: Any) -> None:
        if changes.get("capacity") is not None:
            changes["capacity"] = HUGE_CAPACITY
            ctx.count(Mode.SPES_CAPACITY, "record claims")
        update(self, **changes)

    discovery.Discovery.update = claimed  # type: ignore[method-assign]
    ctx.before_start(lambda d: d.update(capacity=HUGE_CAPACITY))
    publish = directory.DhtExpertDirectory.publish

    async def inflated(self: Any, peer_id: str, records: Mapping[Any, Any]) -> None:
        ctx.count(Mode.SPES_CAPACITY, "expert records inflated")
        await publish(self, peer_id, {k: replace(r, version=HUGE_VERSION, owner=True) for k, r in records.items()})

    directory.DhtExpertDirectory.publish = inflated  # type: ignore[method-assign]
    served_copy = spes_node.SpesNode.served_copy

    async def served(self: Any, key: Any) -> Any:
        tensors, record = await served_copy(self, key)
        ctx.count(Mode.SPES_CAPACITY, "expert copies served")
        return tensors, replace(record, version=HUGE_VERSION, owner=True)

    spes_node.SpesNode.served_copy = served  # type: ignore[method-assign]


@dataclass
class Creep:
    """The creeping record's last claim, and the node it runs in (once discovery has started)."""

    claimed: int = -1
    node: HostileNode | None = None


def creep_claim(claimed: int, own_step: int, floor: int, depth: int) -> int:
    """The creeping record's next step: one more than `claimed` while that stays below `floor` (the lowest
    step a neighbour waits for), else (the neighbours held, the creep caught up) back to `floor - depth`;
    never less than `floor - depth` (the swarm ran ahead), never above its honest `own_step` or below 0."""
    claim = claimed + 1 if floor - depth <= claimed + 1 < floor else floor - depth
    return max(0, min(own_step, claim))


def install_creeping(ctx: HostileContext) -> None:
    """Publish, each heartbeat, a step that rises one a heartbeat and stays just beyond its neighbours' lag
    window (creep_claim)."""
    from node.net import discovery

    creep = Creep()
    depth = max(1, int(ctx.option("depth", CREEP_DEPTH)))
    publish = discovery.Discovery._publish_record

    async def remember(node: HostileNode) -> None:
        creep.node = node

    async def creeping(self: Discovery) -> None:
        others = [r.step for r in self._view if r.peer_id != self.peer_id]
        training = creep.node.runtime.training if creep.node is not None and creep.node.runtime else None
        if others and training is not None:
            # a neighbour waits while this record is below its floor, its own step less the lag window
            creep.claimed = creep_claim(creep.claimed, training.trainer.step, min(others) - training._lag_window,
                                        depth)
            self._local = msgspec.structs.replace(self._local, step=creep.claimed)
            ctx.count(Mode.CREEPING, "record creeps behind the window" if creep.claimed < min(others)
                      - training._lag_window else "record at its honest step")
        await publish(self)

    ctx.background(remember)
    discovery.Discovery._publish_record = creeping  # type: ignore[method-assign]


# ---- attacks with launcher scripts of their own, from inside the node --------------------------------


def _support() -> None:
    """Make `support.*` importable when this file runs as a script (sys.path[0] is tests/support)."""
    tests = str(Path(__file__).resolve().parents[1])
    if tests not in sys.path:
        sys.path.insert(0, tests)


def _deadline(ctx: HostileContext) -> float:
    return time.monotonic() + min(ctx.option("duration", 30.0), MAX_ATTACK_S)


def install_dht_attacks(ctx: HostileContext) -> None:
    """forge-config and flood-records: hostile_dht's writes, signed with the node's own key by a
    client-mode DHT node on the node's p2pd (client mode serves nothing, so it shares the daemon)."""
    _support()
    from hivemind.dht.node import DHTNode

    from support import hostile_dht

    async def attack(node: HostileNode) -> None:
        await asyncio.sleep(ctx.option("attack-after", 5.0))
        discovery = node.discovery
        own = discovery._identity.signing_key
        swarm = discovery._settings.swarm
        validator = hostile_dht.SignsWithWhateverKey({hostile_dht._marker(own): own})
        async with asyncio.timeout(20):
            dht = await DHTNode.create(p2p=discovery._p2p, initial_peers=list(discovery._initial_peers) or None,
                                       record_validator=validator, client_mode=True, wait_timeout=5.0)
        try:
            if Mode.FORGE_CONFIG in ctx.modes:
                config = node.runtime.swarm_config if node.runtime else None
                founder_key = config.founder_key if config is not None and config.founder_key else None
                deadline = _deadline(ctx)
                while True:
                    for what, ok in (await hostile_dht.forge_config(dht, own, swarm, founder_key)).items():
                        ctx.count(Mode.FORGE_CONFIG, f"{what} {'stored' if ok else 'refused'}")
                    if time.monotonic() + ctx.option("every", 2.0) > deadline:
                        break
                    await asyncio.sleep(ctx.option("every", 2.0))
            if Mode.FLOOD_RECORDS in ctx.modes:
                count = max(1, min(int(ctx.option("count", 1000)), 5000))
                keys = max(0, min(int(ctx.option("keys", 20)), 100))
                # records of the swarm's config: a node leaves those of another config out of its view
                config_hash = node.runtime.config_hash if node.runtime else ""
                flood, _ = await hostile_dht.flood_records(dht, validator, own, swarm, count, keys, config_hash)
                for what, n in flood.items():
                    for _ in range(n):
                        ctx.count(Mode.FLOOD_RECORDS, what)
        finally:
            await dht.shutdown()

    ctx.background(attack)


def install_floods(ctx: HostileContext) -> None:
    """flood-pulls, then flood-streams (each half of `duration` when both run), against every peer of
    the node's view: hostile_flood's loops on the node's own data plane."""
    _support()
    from support import hostile_flood

    async def attack(node: HostileNode) -> None:
        await asyncio.sleep(ctx.option("attack-after", 5.0))
        runtime = node.runtime
        if runtime is None or runtime.transport is None:
            raise RuntimeError("the flood modes need the node's data plane")
        transport, me = runtime.transport, node.discovery.peer_id
        victims = tuple(hostile_flood.Victim(r.peer_id, tuple(r.maddrs)) for r in node.discovery.view()
                        if r.peer_id != me)
        floods = [m for m in (Mode.FLOOD_PULLS, Mode.FLOOD_STREAMS) if m in ctx.modes]
        target = hostile_flood.Target(
            swarm=node.discovery._settings.swarm, config_hash=runtime.config_hash,
            dim=int(ctx.option("dim", getattr(runtime.config, "dim", 64))), victims=victims, workdir=Path("."),
            modes=(), streams_per_id=int(ctx.option("streams", 64)), pullers=int(ctx.option("pullers", 4)),
            extra_ids=0)
        report = hostile_flood.Report()

        def round_of(peer: str) -> Callable[[], int]:
            return lambda: next((r.round for r in node.discovery.view() if r.peer_id == peer), 0)

        started = time.monotonic()
        total = min(ctx.option("duration", 30.0), MAX_ATTACK_S)
        for mode in floods:
            deadline = time.monotonic() + total / len(floods)
            if mode is Mode.FLOOD_STREAMS:
                await asyncio.gather(*(hostile_flood.hold_streams(transport, target, v, target.streams_per_id,
                                                                  round_of(v.peer_id), deadline, report)
                                       for v in victims))
            else:
                await asyncio.gather(*(hostile_flood.flood_pulls(transport, target, v, round_of(v.peer_id),
                                                                 deadline, report) for v in victims))
        for what, n in (("streams opened", report.streams_opened),
                        ("streams closed by the victim", report.streams_closed_by_victim),
                        *((f"pulls answered {k}", n) for k, n in report.pulls.items()),
                        *((f"far-ahead exchanges answered {k}", n) for k, n in report.exchanges_far_ahead.items())):
            ctx.counts[f"{Mode.FLOOD_STREAMS if 'stream' in what else Mode.FLOOD_PULLS}: {what}"] += n
        for key in sorted(k for k in ctx.counts if k.startswith(("flood-streams:", "flood-pulls:"))):
            print(f"{PREFIX}{key} {ctx.counts[key]}", file=sys.stderr, flush=True)
        print(f"{PREFIX}floods: done in {time.monotonic() - started:.0f} s 1", file=sys.stderr, flush=True)

    ctx.background(attack)


def install_unroutable(ctx: HostileContext) -> None:
    """Its record names only addresses that route nowhere (its p2pd still answers where it listens)."""
    _support()
    from support.hostile_flood import UNROUTABLE_MADDRS

    def unroutable(discovery: Discovery) -> None:
        discovery._data_maddrs = tuple(f"{a}/p2p/{discovery.peer_id}" for a in UNROUTABLE_MADDRS)
        ctx.count(Mode.UNROUTABLE, "record names unroutable addresses")

    ctx.before_start(unroutable)


def install_stalled_record(ctx: HostileContext) -> None:
    """Its record stays at step 0 and round 0; every gossip stream to it hangs (a frozen peer)."""
    from gossip import exchange
    from node.net import discovery

    update = discovery.Discovery.update

    def stalled(self: Discovery, **changes: Any) -> None:
        dropped = [changes.pop(what, None) for what in ("step", "round")]
        if any(value is not None for value in dropped):
            ctx.count(Mode.STALLED_RECORD, "record kept at step 0")
        update(self, **changes)

    discovery.Discovery.update = stalled  # type: ignore[method-assign]

    async def frozen(self: GossipPeer, stream: Any) -> None:
        ctx.count(Mode.STALLED_RECORD, "gossip streams held")
        async with asyncio.timeout(MAX_ATTACK_S):
            await asyncio.Event().wait()

    exchange.GossipPeer._serve = frozen  # type: ignore[method-assign]


def install_slow_serve(ctx: HostileContext) -> None:
    """Downloads served at `rate` bytes/s: the paced sends (MessageStream.send with a stall timeout) are
    the answers to pulls of the current parameters, and only those."""
    from gossip import stream

    rate = ctx.option("rate", 50_000.0)
    send = stream.MessageStream.send

    async def slow(self: stream.MessageStream, frames: stream.Frames, stall_s: float | None = None) -> None:
        if stall_s is None:
            await send(self, frames)
            return
        ctx.count(Mode.SLOW_SERVE, "downloads served slowly")
        for frame in frames:
            view = memoryview(frame)
            for at in range(0, len(view), 16 << 10):  # in small writes, so the bytes arrive steadily
                piece = view[at:at + (16 << 10)]
                await send(self, [piece], stall_s)
                await asyncio.sleep(len(piece) / rate)

    stream.MessageStream.send = slow  # type: ignore[method-assign]


def install_intruder(ctx: HostileContext) -> None:
    """wrong-key / stolen-certificate: hostile_intruder's forged admission."""
    _support()
    from node.net.admission import read_certificate
    from support import hostile_intruder

    if Mode.WRONG_KEY in ctx.modes:
        hostile_intruder.forge_admission(hostile_intruder.wrong_key(), None)
    else:
        path = ctx.text("certificate")
        if not path:
            raise SystemExit("stolen-certificate needs --option certificate=FILE")
        hostile_intruder.forge_admission(None, read_certificate(Path(path)).token)


# ---- hooks into the node's life ---------------------------------------------------------------------


def install_lifecycle(ctx: HostileContext) -> None:
    """Run the start hooks before discovery publishes its first record, and the background work once
    it has started (cancelled before it closes)."""
    from node.net import discovery
    from node.runtime import status

    runtimes: list[NodeRuntime] = []
    init = status.NodeRuntime.__init__

    def remember(self: NodeRuntime, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        runtimes.append(self)

    status.NodeRuntime.__init__ = remember  # type: ignore[method-assign]
    start, close = discovery.Discovery.start, discovery.Discovery.close
    tasks: list[asyncio.Task[None]] = []

    async def started(self: Discovery, *args: Any, **kwargs: Any) -> None:
        for hook in ctx.start_hooks:
            hook(self)
        await start(self, *args, **kwargs)
        handle = HostileNode(runtimes[-1] if runtimes else None, self)
        for work in ctx.backgrounds:
            tasks.append(asyncio.create_task(work(handle), name=f"hostile-{getattr(work, '__name__', 'work')}"))

    async def closed(self: Discovery, *args: Any, **kwargs: Any) -> None:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await close(self, *args, **kwargs)

    discovery.Discovery.start = started  # type: ignore[method-assign]
    discovery.Discovery.close = closed  # type: ignore[method-assign]


@dataclass(frozen=True)
class Behaviour:
    help: str
    install: Callable[[HostileContext], None]


BEHAVIOURS: dict[Mode, Behaviour] = {
    Mode.HUGE_STEP: Behaviour("claims step 10^9 in its record and headers", install_huge_step),
    Mode.NOISE: Behaviour("serves finite noise instead of its tensors", install_tensor_modes),
    Mode.SCALED: Behaviour("serves its tensors x 1000", install_tensor_modes),
    Mode.SIGN_FLIP: Behaviour("serves its update reversed, x_prev - k (x - x_prev)", install_tensor_modes),
    Mode.STALE_REPLAY: Behaviour("serves the first tensors it ever served, forever", install_tensor_modes),
    Mode.USELESS: Behaviour("serves x_prev plus a random update of the honest update's norm", install_tensor_modes),
    Mode.SPES_CAPACITY: Behaviour("claims SPES capacity 2^62 and expert versions 2^62", install_spes_capacity),
    Mode.CREEPING: Behaviour("its record's step creeps up a step a heartbeat just beyond the lag window "
                             "(option depth)", install_creeping),
    Mode.FORGE_CONFIG: Behaviour("forges <swarm>.config: plain, self-signed with a far expiration, claiming "
                                 "the founder's key, oversized", install_dht_attacks),
    Mode.FLOOD_RECORDS: Behaviour("floods 1000 fake peer records (option count, keys)", install_dht_attacks),
    Mode.FLOOD_STREAMS: Behaviour("holds many incoming gossip streams open at every peer", install_floods),
    Mode.FLOOD_PULLS: Behaviour("pulls parameters and far-future rounds back to back", install_floods),
    Mode.UNROUTABLE: Behaviour("its record names only unroutable addresses", install_unroutable),
    Mode.STALLED_RECORD: Behaviour("its record stays at step 0, its gossip streams hang", install_stalled_record),
    Mode.SLOW_SERVE: Behaviour("serves downloads at `rate` bytes/s (default 50000)", install_slow_serve),
    Mode.WRONG_KEY: Behaviour("proves membership of a key swarm with a wrong key", install_intruder),
    Mode.STOLEN_CERTIFICATE: Behaviour("presents another peer's certificate (option certificate=FILE)",
                                       install_intruder),
}


def install(ctx: HostileContext) -> None:
    """Install every behaviour `ctx.modes` asks for (each installer once) and the lifecycle hooks."""
    installed: set[Callable[[HostileContext], None]] = set()
    for mode in ctx.modes:
        behaviour = BEHAVIOURS[mode]
        if behaviour.install not in installed:
            installed.add(behaviour.install)
            behaviour.install(ctx)
    install_lifecycle(ctx)


def hostile_argv(modes: Sequence[Mode | str], *, cycle_rounds: int = 0,
                 options: Mapping[str, object] | None = None) -> list[str]:
    """The attack's part of the command line (before `--`)."""
    argv: list[str] = []
    for mode in modes:
        argv += ["--mode", str(Mode(mode))]
    if cycle_rounds:
        argv += ["--cycle-rounds", str(cycle_rounds)]
    for key, value in (options or {}).items():
        argv += ["--option", f"{key}={value}"]
    return argv


def parse(argv: Sequence[str]) -> tuple[HostileContext, list[str]]:
    if "--" not in argv:
        raise SystemExit("usage: hostile.py --mode MODE [--mode MODE]... [--cycle-rounds N] "
                         "[--option KEY=VALUE]... [--seed N] -- node|join [murmur flags]")
    split = list(argv).index("--")
    parser = argparse.ArgumentParser(prog="hostile.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", action="append", required=True, choices=[str(m) for m in Mode],
                        help="; ".join(f"{m}: {b.help}" for m, b in BEHAVIOURS.items()))
    parser.add_argument("--cycle-rounds", type=int, default=0, help="tensor modes take turns every N rounds")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="a mode's knob")
    parser.add_argument("--seed", type=int, default=1, help="seed of the noise")
    args = parser.parse_args(argv[:split])
    options = dict(item.split("=", 1) for item in args.option)
    ctx = HostileContext(tuple(Mode(m) for m in args.mode), options, args.cycle_rounds, np.random.default_rng(args.seed))
    return ctx, list(argv[split + 1:])


def main(argv: Sequence[str] | None = None) -> int:
    ctx, node_argv = parse(sys.argv[1:] if argv is None else argv)
    install(ctx)
    print(f"{PREFIX}modes {','.join(ctx.modes)} installed 1", file=sys.stderr, flush=True)
    from node.cli.main import main as murmur

    return murmur(node_argv)


if __name__ == "__main__":
    sys.exit(main())
