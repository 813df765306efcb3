"""The gossip exchange protocol (`/murmur/gossip/1`) over any `Transport`: one round's exchanges with
the neighbours a topology names, the request/reply on one stream, validation, and accounting.

Who opens a stream in round r (every peer computes this from its own view):
- j is an in-neighbour of i and i is an in-neighbour of j (a symmetric edge: ring, torus, hypercube
  pairs...): the peer with the smaller id opens one stream and sends an `exchange` request carrying
  its tensors; the other answers with a `reply` carrying its own, and both mix what they got, so a
  pair averages symmetrically over one stream. The larger id waits for that request.
- j is an in-neighbour of i only (directed graphs: static and one-peer exponential): i sends a
  `pull` request (no tensors) and j replies with its tensors.
A peer answers every valid request, whatever its own view says, with a snapshot of its tensors; a
pull gets the snapshot the asker's round mixes (see `GossipPeer._reply_for`).
An exchange request from a peer it does not expect is answered and its tensors are kept (latest per
sender) in case that peer becomes its partner within the staleness bound.

Every exchange has a deadline; a neighbour that is dead, frozen, slow, rejects us or is more than
`max_staleness` rounds away is skipped and its weight goes back to the local tensors (see
`gossip.mixing`). Anything invalid is refused with a specific `gossip.errors.WireError`, counted by
kind, answered with a `reject` message saying why, and never reaches the local tensors.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from gossip.codecs import Codec
from gossip.errors import BadSchema, ManifestMismatch, WireError
from gossip.mixing import MixingRule, mix
from gossip.transport import GOSSIP_PROTOCOL, Stream, Transport
from gossip.wire import DEFAULT_LIMITS, Expectation, Message, WireLimits, encode_message, read_message, tensor_specs
from topology import PeerRound

logger = logging.getLogger(__name__)

PULL, EXCHANGE, REPLY, REJECT = "pull", "exchange", "reply", "reject"
MAILBOX_SENDERS = 16  # unexpected exchange requests kept at once; each holds one copy of the tensors

Tensors = Mapping[str, np.ndarray]


@dataclass(frozen=True)
class ExchangeSettings:
    swarm: str
    config_hash: str
    codec: Codec
    exchange_timeout_s: float = 10.0
    max_staleness: int = 4
    rule: MixingRule = field(default_factory=MixingRule)
    limits: WireLimits = DEFAULT_LIMITS


@dataclass
class ExchangeStats:
    """Counters one peer keeps about its exchanges (read by the status API and the monitor)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    exchanges_ok: int = 0
    rounds: int = 0
    last_round_s: float = 0.0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)  # rejected input, by kind
    skipped: collections.Counter[str] = field(default_factory=collections.Counter)  # neighbours skipped, by reason


@dataclass(frozen=True)
class RoundOutcome:
    round: int
    mixed_with: tuple[str, ...]
    skipped: Mapping[str, str]  # neighbour -> why it was left out
    duration_s: float


@dataclass(frozen=True)
class _Received:
    round: int
    step: int
    tensors: dict[str, np.ndarray]


class PeerRejected(Exception):
    """The neighbour answered with a `reject` message."""


class GossipPeer:
    """One peer's side of the protocol: serves requests and runs rounds over a transport.

    The local tensors are replaced, never modified in place, so a reply can encode a snapshot
    without copying while a round or the trainer produces the next values.
    """

    def __init__(self, transport: Transport, settings: ExchangeSettings, tensors: Tensors, *, step: int = 0) -> None:
        self._transport = transport
        self._settings = settings
        self._tensors: dict[str, np.ndarray] = dict(tensors)
        self._specs = tensor_specs(self._tensors)
        # Requests and replies are read before their kind is known (a pull or a reject carries no
        # tensors), so the manifest is checked after reading, within limits sized to our own tensors.
        self._expect_peer = Expectation(settings.swarm, settings.config_hash)
        self._request_limits = _limits_for(self._tensors, settings.limits)
        self.round = 0
        self.step = step
        self.stats = ExchangeStats()
        # exchange requests from peers we were not waiting for: sender -> latest, for a later round
        self._mailbox: dict[str, _Received] = {}
        self._arrived = asyncio.Condition()
        # round -> our tensors as that round began, for the last max_staleness + 1 rounds (see _reply_for);
        # they are the values the rounds replaced, so this holds up to that many extra copies
        self._round_inputs: dict[int, dict[str, np.ndarray]] = {}
        self._round_began = asyncio.Condition()

    @property
    def peer_id(self) -> str:
        return self._transport.peer_id

    @property
    def tensors(self) -> dict[str, np.ndarray]:
        return self._tensors

    def set_tensors(self, tensors: Tensors, step: int | None = None) -> None:
        """Install new local values (e.g. after a training step); names, dtypes and shapes must match."""
        if tensor_specs(tensors) != self._specs:
            raise ValueError("new tensors differ in names, dtypes or shapes from the swarm's manifest")
        self._tensors = dict(tensors)
        if step is not None:
            self.step = step

    async def start(self) -> None:
        await self._transport.serve(GOSSIP_PROTOCOL, self._serve)

    # ---- one round -------------------------------------------------------------------------------

    async def run_round(self, round_index: int, plan: PeerRound) -> RoundOutcome:
        """Exchange with this round's neighbours, mix what arrived in time, install the result."""
        started = time.monotonic()
        own_snapshot = self._tensors
        oldest_kept = round_index - self._settings.max_staleness
        async with self._round_began:
            self.round = round_index
            self._round_inputs = {r: t for r, t in self._round_inputs.items() if oldest_kept <= r < round_index}
            self._round_inputs[round_index] = own_snapshot
            self._round_began.notify_all()
        received: dict[str, _Received] = {}
        skipped: dict[str, str] = {}

        async def one(peer: str) -> None:
            try:
                async with asyncio.timeout(self._settings.exchange_timeout_s):
                    if peer in plan.out_peers and self.peer_id > peer:
                        got = await self._await_partner(peer)
                    else:
                        got = await self._request(peer, EXCHANGE if peer in plan.out_peers else PULL, own_snapshot)
            except TimeoutError:
                skipped[peer] = "timeout"
            except PeerRejected as exc:
                skipped[peer] = f"rejected: {exc}"
            except WireError as exc:
                self._count_error(exc, peer)
                skipped[peer] = exc.kind
            except ConnectionError as exc:
                skipped[peer] = "unreachable"
                logger.debug("round %d: %s unreachable: %s", round_index, peer, exc)
            else:
                if abs(got.round - round_index) > self._settings.max_staleness:
                    skipped[peer] = "stale"
                else:
                    received[peer] = got

        async with asyncio.TaskGroup() as group:
            for peer in sorted(plan.in_weights):
                group.create_task(one(peer))

        mixed = await asyncio.to_thread(self._mix, own_snapshot, received, plan)
        # values installed meanwhile (a trainer's step) win over this round's mix of older ones
        if self._tensors is own_snapshot:
            self._tensors = mixed
        for reason in skipped.values():
            self.stats.skipped[reason.split(":")[0]] += 1
        duration = time.monotonic() - started
        self.stats.rounds += 1
        self.stats.last_round_s = duration
        return RoundOutcome(round_index, tuple(sorted(received)), skipped, duration)

    def _mix(self, own: dict[str, np.ndarray], received: Mapping[str, _Received], plan: PeerRound) -> dict[str, np.ndarray]:
        return {
            name: mix(x, {peer: r.tensors[name] for peer, r in received.items()}, plan.self_weight, plan.in_weights,
                      self._settings.rule)
            for name, x in own.items()
        }

    async def _await_partner(self, peer: str) -> _Received:
        """Wait for `peer`'s exchange request of a round within the staleness bound."""
        async with self._arrived:
            while True:
                got = self._mailbox.get(peer)
                if got is not None and abs(got.round - self.round) <= self._settings.max_staleness:
                    del self._mailbox[peer]
                    return got
                await self._arrived.wait()

    async def _request(self, peer: str, kind: str, own: Tensors) -> _Received:
        stream = await self._transport.open_stream(peer, GOSSIP_PROTOCOL)
        try:
            await self._send(stream, own if kind == EXCHANGE else {}, None, kind)
            reply = await self._read(stream, self._expect_peer)
            if reply.header.kind == REJECT:
                raise PeerRejected(str(reply.header.meta.get("error", "unspecified")))
            if reply.header.kind != REPLY:
                raise BadSchema(f"expected a reply, got a {reply.header.kind!r} message")
            _check_manifest(reply, self._specs)
            self.stats.exchanges_ok += 1
            return _Received(reply.header.round, reply.header.step, reply.tensors)
        finally:
            await stream.close()

    # ---- serving ---------------------------------------------------------------------------------

    async def _serve(self, stream: Stream) -> None:
        peer = stream.remote_peer
        try:
            async with asyncio.timeout(self._settings.exchange_timeout_s):
                request = await self._read(stream, self._expect_peer)
                kind = request.header.kind
                if kind not in (PULL, EXCHANGE):
                    raise BadSchema(f"expected a pull or exchange request, got a {kind!r} message")
                if kind == EXCHANGE:
                    _check_manifest(request, self._specs)
                elif request.header.manifest:
                    raise BadSchema("a pull request carries no tensors")
                await self._send(stream, *await self._reply_for(kind, request.header.round), REPLY)
                self.stats.exchanges_ok += 1
        except WireError as exc:
            self._count_error(exc, peer)
            await self._try_reject(stream, exc)
            await self._linger(stream)
            return
        except (TimeoutError, ConnectionError) as exc:
            self.stats.errors["timeout" if isinstance(exc, TimeoutError) else "disconnected"] += 1
            logger.info("gossip request from %s abandoned: %s", peer, exc or type(exc).__name__)
            return
        if kind == EXCHANGE:
            async with self._arrived:
                self._mailbox.pop(peer, None)
                if len(self._mailbox) >= MAILBOX_SENDERS:
                    oldest = min(self._mailbox, key=lambda p: self._mailbox[p].round)
                    del self._mailbox[oldest]
                self._mailbox[peer] = _Received(request.header.round, request.header.step, request.tensors)
                self._arrived.notify_all()
        await self._linger(stream)

    async def _linger(self, stream: Stream) -> None:
        """Keep our end open until the asker hangs up (it does once it has read our answer).

        p2pd resets a stream whose answering end closes first, and the reset can overtake the
        answer: the asker would then read nothing and count the exchange as truncated while we mixed.
        """
        try:
            async with asyncio.timeout(self._settings.exchange_timeout_s):
                await stream.read_exactly(1)
        except (TimeoutError, ConnectionError):
            pass  # hung up (or never will): either way we are done

    async def _reply_for(self, kind: str, round_index: int) -> tuple[Tensors, int]:
        """The tensors (and their round) that answer a `kind` request of round `round_index`.

        Mixing stays doubly stochastic only if a puller gets our input to *its* round: a pull of a
        round we began gets our tensors as that round began, even if we have moved on, and a pull of
        a round we will begin within the staleness bound waits for it (within the request's
        deadline). An exchange is answered at once with our current tensors: those are what its
        sender's tensors are mixed with here, in the round that takes them from the mailbox, and
        waiting could stall that very round.
        """
        if kind != PULL:
            return self._tensors, self.round
        if self.round < round_index <= self.round + self._settings.max_staleness:
            async with self._round_began:
                await self._round_began.wait_for(lambda: self.round >= round_index)
        began = self._round_inputs.get(round_index)
        return (began, round_index) if began is not None else (self._tensors, self.round)

    async def _try_reject(self, stream: Stream, exc: WireError) -> None:
        try:
            async with asyncio.timeout(min(1.0, self._settings.exchange_timeout_s)):
                await self._send(stream, {}, None, REJECT, meta={"error": exc.kind})
        except (TimeoutError, ConnectionError, WireError):
            pass  # the peer is gone or broken; the error is already counted

    # ---- framing ---------------------------------------------------------------------------------

    async def _send(self, stream: Stream, tensors: Tensors, round_index: int | None, kind: str,
                    meta: Mapping[str, str] | None = None) -> None:
        frames = encode_message(
            tensors, self._settings.codec, swarm=self._settings.swarm, config_hash=self._settings.config_hash,
            sender=self.peer_id, round=self.round if round_index is None else round_index, step=self.step, kind=kind,
            meta=meta, limits=self._settings.limits,
        )
        for frame in frames:
            await stream.write(frame)
            self.stats.bytes_sent += len(frame)

    async def _read(self, stream: Stream, expected: Expectation) -> Message:
        async def read_exactly(n: int) -> bytes:
            data = await stream.read_exactly(n)
            self.stats.bytes_received += len(data)
            return data

        message = await read_message(read_exactly, self._request_limits, expected)
        if message.header.sender != stream.remote_peer:
            raise BadSchema(f"header names sender {message.header.sender}, but the stream comes from {stream.remote_peer}")
        return message

    def _count_error(self, exc: WireError, peer: str) -> None:
        self.stats.errors[exc.kind] += 1
        logger.warning("rejected gossip message from %s: %s: %s", peer, exc.kind, exc)


def _check_manifest(message: Message, specs: tuple) -> None:
    got = tuple(entry.spec for entry in message.header.manifest)
    if got != specs:
        raise ManifestMismatch(f"{message.header.kind} manifest {_describe(got)} differs from the local {_describe(specs)}")


def _describe(specs: tuple) -> str:
    if len(specs) <= 3:
        return str([(s.name, s.dtype, list(s.shape)) for s in specs])
    return f"[{len(specs)} tensors, first {specs[0].name!r}]"


def _limits_for(tensors: Tensors, limits: WireLimits) -> WireLimits:
    """Limits sized to our own tensors, so a message we read before knowing its kind stays that small.

    Top-k can take up to 8 bytes per element; every other codec takes at most 8.
    """
    elements = sum(int(t.size) for t in tensors.values())
    decoded = sum(int(t.nbytes) for t in tensors.values())
    return replace(
        limits,
        max_payload_bytes=min(limits.max_payload_bytes, 8 * elements + 1024),
        max_decoded_bytes=min(limits.max_decoded_bytes, decoded + 1024),
        max_tensors=min(limits.max_tensors, max(1, len(tensors))),
    )
