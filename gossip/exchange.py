"""The gossip exchange protocol (`/murmur/gossip/1`) over any `Transport`: one round's exchanges with
the neighbours a topology names, the request/reply on one stream, validation, and accounting.

Who opens a stream in round r (every peer computes this from its own view):
- j is an in-neighbour of i and i is an in-neighbour of j (a symmetric edge: ring, torus, hypercube
  pairs...): the peer with the smaller id opens one stream and sends an `exchange` request carrying
  its input to round r; the other answers with a `reply` carrying its own input to round r, the
  asker confirms with an `ack`, and both mix what they got, so a pair averages symmetrically over
  one stream. The larger id waits for that request (`GossipPeer._await_partner`); a request that
  arrives before the larger id has begun round r waits for it (see `GossipPeer._claim_partner_slot`).
- j is an in-neighbour of i only (directed graphs: static and one-peer exponential): i sends a
  `pull` request (no tensors) and j replies with its input to round r.
A peer answers every valid pull within its limits (`gossip.limits.IncomingLimits`: a round pull at most
twice per asker and round, within the staleness bound; a pull of the current tensors at a bounded rate),
whatever its own view says (which peers may open streams at all is the transport's `IncomingGate`). An
exchange is answered with a reply only when the answering peer is waiting for that asker in that round;
otherwise (the round is over, the asker is not its partner, the round is too far ahead) it answers
`reject`, and neither side mixes. Every request's header is read and checked before any of its payload.

Every exchange has deadlines: `exchange_timeout_s` for a neighbour to start answering (its reply's
header; an exchange's asker first gets as long as sending its request took), then the payload, whose
size the header fixes, is paced like a whole-model transfer (gossip.pace: every 64 KiB piece within the
stall timeout, all of it within its size over the goodput floor or the peer's measured goodput), on
both ends. A neighbour that is dead, frozen, stalls, rejects us or is more than `max_staleness` rounds
away is skipped and its weight goes back to the local tensors (see `gossip.mixing`). Anything invalid
is refused with a specific `gossip.errors.WireError`, counted by kind, answered with a `reject` message
saying why, and never reaches the local tensors.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import random
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum, StrEnum
from typing import Any, Protocol, TypeVar

import numpy as np

from gossip.admission import OPEN, StreamAdmission
from gossip.choco import ChocoState, Desync, Outgoing
from gossip.codecs import STATE_CODECS, Codec, Fp32Codec, get_codec
from gossip.errors import BadSchema, ManifestMismatch, Truncated, WireError
from gossip.limits import DEFAULT_INCOMING, CountPerKey, IncomingLimits, PeerBuckets
from gossip.mixing import IncrementalMix, MixingKind, MixingRule, effective_weights, token_weights
from gossip.pace import DEFAULT_PACE, TransferPace, TransferProgress, TransferStalled, measured_goodput
from gossip.robust import ClipSettings, Mixer, ValueBound
from gossip.stream import Accounting, Frames, IncomingMessage, MessageStream, TensorsUnsendable
from gossip.transport import GOSSIP_PROTOCOL, Stream, Transport
from gossip.wire import (
    DEFAULT_LIMITS,
    EncodedTensors,
    Expectation,
    Header,
    HeaderFields,
    Message,
    MetaValue,
    TensorSpec,
    ValuesSink,
    WireLimits,
    encode_tensors,
    iter_message,
    message_nbytes,
    tensor_specs,
)
from gossip.wire.header import make_header, pack_header
from topology import PeerRound

logger = logging.getLogger(__name__)

PULL, EXCHANGE, REPLY, REJECT, ACK = "pull", "exchange", "reply", "reject", "ack"
# meta flag of a pull outside any round (`fetch`): answered at once with the current tensors
CURRENT = "current"
# meta of a pull of the current tensors: the manifest index of the first tensor wanted (a download resumed
# where another donor's broke off, `fetch`'s `start`); the answer's manifest is ours from there on
FROM = "from"
# with FROM (or from the first tensor), the manifest index the answer stops before: a few tensors only (a
# joiner's spot check of a download against other donors)
UNTIL = "until"
# meta of a pull of the current tensors: the codec the asker wants them in, one that carries every element
# (STATE_CODECS; without it, WHOLE_MODEL_CODEC): a joiner takes outer state that is only a starting point
# (DiLoCo's momentum) in int8, a quarter of the bytes (an older peer answers fp32, which the asker reads too)
CODEC = "codec"
# meta flag of an exchange request whose asker reads the reply while it writes the request: the answering
# peer replies as it reads the request, so a symmetric exchange takes one transfer's time, not two (an
# asker without the flag writes its whole request before it reads, and is answered after it)
DUPLEX = "duplex"
# meta of a round's values (an exchange request, its reply, a round pull's answer): the share of a full
# contribution they cover, in (0, 1] (gossip DiLoCo: the inner steps a node trained in its phase over the
# phase's steps, when it passed over the rest to keep the swarm's wall-clock cadence). The round then
# weighs each value by it (gossip.mixing.token_weights); without it, 1 (a full phase, or an older peer).
SHARE = "share"
# The codec of that answer, whatever codec the rounds use: a joiner, a node catching up, the swarm
# average and the final merge take an exact copy of the parameters, not the round codec's lossy image
# (as DiLoCo's and compressed gossip's main peers, whose settings codec is fp32, always did). Every
# asker reads any known codec the header names, so an older peer's answer in the round codec still
# decodes; fp32 is at most 4 bytes per element, within the asker's limits (`_limits_for`).
WHOLE_MODEL_CODEC: Codec = Fp32Codec()
# exchange requests held at once until their round begins
MAX_WAITING_REQUESTS = 16  # each holds the request's header: its tensors are read once its round claims it
# A pull refused as `uploading` is asked again after a pause that doubles from this, up to the max
BUSY_RETRY_S = 1.0
MAX_BUSY_RETRY_S = 16.0
# How long a round waits for a symmetric partner to ask again after its stream was cut: the asker does
# so at once (on another connection, or another relay's circuit); a dead one must not hold the round.
RETRY_GRACE_S = 0.5


class Refusal(StrEnum):
    """Why an exchange request was refused for its timing (the `error` of the `reject`; ExchangeStats.refused)."""

    LATE = "late"  # the round is over here, our wait for this asker ended, or the asker sent a later round since
    NOT_PARTNER = "not_partner"  # our plan for that round does not wait for this asker's exchange
    STALE = "stale"  # more than max_staleness rounds away from ours (the asker skips us as `stale`)
    BUSY = "busy"  # MAX_WAITING_REQUESTS requests already wait for their rounds
    # compressed gossip: the asker's edge estimates differ from ours (both reset the edge; docs/training.md)
    DESYNC = "desync"
    UNSUPPORTED = "unsupported"  # a round pull to a peer that gossips compressed differences (symmetric edges only)
    RATE_LIMITED = "rate_limited"  # the asker pulled this round, or the current tensors, too often (IncomingLimits)
    UPLOADING = "uploading"  # IncomingLimits.concurrent_uploads answers of the current tensors are being sent


class Skip(StrEnum):
    """Why a neighbour was left out of a round (RoundOutcome.skipped, ExchangeStats.skipped), besides
    the `WireError.kind` of a refused answer."""

    TIMEOUT = "timeout"
    STALE = "stale"  # more than max_staleness rounds away, or it refused us as such
    REJECTED = "rejected"  # it answered with a `reject`; the outcome says why: "rejected: <error>"
    UNSENDABLE = "unsendable"  # our own tensors failed the wire's checks
    UNREACHABLE = "unreachable"
    MOVED_ON = "moved_on"  # a symmetric partner asked for a later round instead
    DESYNC = "desync"  # compressed gossip: the partner's edge estimates differ from ours; both reset the edge
    DIRECTED = "directed"  # compressed gossip: a directed edge (a pull), which it does not use
    FAILED = "failed"  # an error of no declared kind (a transport's bug, say): this neighbour's loss, not the round's
    EXCLUDED = "excluded"  # its contribution rating is too low (GossipPeer.judge; gossip.scoring)

Tensors = Mapping[str, np.ndarray]


class Judge(Protocol):
    """What a node's contribution scoring (gossip.scoring; node.swarm.contribution) says of a round's
    neighbours: called on the event loop once their values arrived and passed the screen, it may start
    scoring them in the background, and returns the factor each one's mixing weight is scaled by (0:
    not mixed, as a skipped neighbour; a peer left out keeps its weight). `base` is what the node's
    tensors were after the last round's mix (`own - base`: its own update since; None: unknown). Under
    compressed gossip a neighbour's value is the node's estimate of its parameters (ChocoState.estimates)."""

    def weigh(self, round_index: int, own: Tensors, base: Tensors | None, received: Mapping[str, Tensors],
              weights: Mapping[str, float]) -> Mapping[str, float]: ...


@dataclass(frozen=True)
class ExchangeSettings:
    swarm: str
    config_hash: str
    codec: Codec  # of rounds; a pull of the current tensors (`fetch`) is answered in WHOLE_MODEL_CODEC
    exchange_timeout_s: float = 10.0
    max_staleness: int = 4
    rule: MixingRule = field(default_factory=MixingRule)
    limits: WireLimits = DEFAULT_LIMITS
    clip: ClipSettings = field(default_factory=ClipSettings)  # the adaptive_clip rule's radius
    value_bound: ValueBound = field(default_factory=ValueBound)  # received values beyond it are refused
    incoming: IncomingLimits = DEFAULT_INCOMING
    # who may send to us, and the proof our own messages carry (key and allowlist swarms)
    admission: StreamAdmission = OPEN
    # payloads once their size is known (a round's requests and replies, fetch and its answer): deadlines
    # on progress and size
    pace: TransferPace = DEFAULT_PACE
    # dense exchanges ask for a duplex answer (DUPLEX); False: write the whole request, then read (the
    # exchange as it was before, kept for benchmarks to compare)
    duplex: bool = True


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
    # valid exchange requests answered with a `reject` because of their round (LATE, NOT_PARTNER, ...)
    refused: collections.Counter[str] = field(default_factory=collections.Counter)
    clipped: int = 0  # neighbour values mixed after clipping (a clipping rule's radius cut their pull)
    # requests sent again after their stream was cut (a relay or connection lost mid-exchange)
    retried: int = 0


@dataclass(frozen=True)
class RoundOutcome:
    round: int
    mixed_with: tuple[str, ...]
    skipped: Mapping[str, str]  # neighbour -> why it was left out
    duration_s: float
    clipped: tuple[str, ...] = ()  # neighbours of mixed_with whose difference was clipped


@dataclass(frozen=True)
class _Received:
    round: int
    step: int
    tensors: dict[str, np.ndarray]
    sent: Outgoing | None = None  # compressed gossip: what we sent on this exchange
    share: float = 1.0  # of a full contribution, as its header's SHARE claimed (checked: in (0, 1])


@dataclass
class Delivered:
    """What a pull of the current tensors delivered (`GossipPeer.fetch`), also when it broke off: the step
    and round its reply claimed, and the tensors that arrived whole, in manifest order."""

    step: int | None = None
    round: int | None = None
    tensors: dict[str, np.ndarray] = field(default_factory=dict)


class PeerRejected(Exception):
    """The neighbour answered with a `reject` message; `reason` is the error it gave."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class PartnerMissed(Exception):
    """A symmetric partner's exchange of this round did not complete; `reason` is the skip reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _SlotState(Enum):
    OPEN = "open"
    CLAIMED = "claimed"  # a handler is replying
    DONE = "done"
    FAILED = "failed"
    CLOSED = "closed"  # the round stopped waiting first


class _PartnerSlot:
    """Where a round waits for one symmetric partner's exchange request, and where the handler that
    answers the request leaves the outcome.

    OPEN -> CLAIMED -> DONE | FAILED, or OPEN -> CLOSED (a request arriving later is refused as
    LATE); CLAIMED -> OPEN when the claiming request's stream is cut before its ack, so that the
    asker's second try finds the slot. Every change sets `changed`.
    """

    __slots__ = ("changed", "failure", "received", "state")

    def __init__(self) -> None:
        self.state = _SlotState.OPEN
        self.received: _Received | None = None
        self.failure = ""  # the skip reason when FAILED
        self.changed = asyncio.Event()

    def settle(self, received: _Received | None, failure: str = "") -> None:
        self.state = _SlotState.DONE if received is not None else _SlotState.FAILED
        self.received, self.failure = received, failure
        self.changed.set()

    def reopen(self, failure: str) -> None:
        """A claim that fell through before the asker's ack (a cut stream): the asker may claim it again;
        `failure` is the skip reason if it does not."""
        self.state = _SlotState.OPEN
        self.failure = failure
        self.changed.set()


class GossipPeer:
    """One peer's side of the protocol: serves requests and runs rounds over a transport.

    The local tensors are replaced, never modified in place, so a reply can encode a snapshot
    without copying while a round or the trainer produces the next values.
    """

    def __init__(self, transport: Transport, settings: ExchangeSettings, tensors: Tensors, *, step: int = 0,
                 protocol: str = GOSSIP_PROTOCOL, choco: ChocoState | None = None) -> None:
        self._transport = transport
        # compressed gossip (gossip/choco.py): exchanges carry differences against per-edge estimates
        self._choco = choco
        # one protocol per tensor group: SPES runs a peer for the shared weights and one per owned expert
        self._protocol = protocol
        self._settings = settings
        self._tensors: dict[str, np.ndarray] = dict(tensors)
        self._specs = tensor_specs(self._tensors)
        # A request's header is read and checked first (its kind says whether tensors follow, and
        # their manifest must be ours; the sender's admission) within limits sized to our own tensors
        # and header.
        self._expect_peer = Expectation(settings.swarm, settings.config_hash, admit=settings.admission.admit)
        self._request_limits = _limits_for(self._tensors, settings)
        self.round = 0  # the round in progress or last run; set by the daemon to place a fresh or resumed peer
        self.step = step
        self.stats = ExchangeStats()
        self._accounting = Accounting(self.stats, logger, "rejected gossip message")
        self._mixer = Mixer(settings.rule, settings.clip, settings.value_bound)
        # The tensors the last round mixed (or the first ones), kept from the moment they are replaced
        # until the next round: the node's own move in between is what the adaptive radius learns from.
        self._tensors_are_base = True
        self._base: dict[str, np.ndarray] | None = None
        self._parked = False  # see park()
        self.judge: Judge | None = None  # contribution scoring: set by the daemon (dense gossip, DiLoCo fragments)
        self._begun = -1  # the latest round whose run_round has begun
        # round -> our tensors as that round began, for the last max_staleness + 1 rounds (see _pull_answer);
        # they are the values the rounds replaced, so this holds up to that many extra copies: the
        # current round's as arrays (the round mixes them), earlier ones in the codec's wire bytes where
        # those are smaller (_keep_past_inputs_encoded); compressed gossip answers no past round, keeps none
        self._round_inputs: dict[int, Tensors | EncodedTensors] = {}
        # round -> the share of a full contribution our input to it covers (SHARE), where it is not 1
        self._round_shares: dict[int, float] = {}
        self._share = 1.0
        # (partner, round) -> where the round in progress waits for that partner's exchange request
        self._partner_slots: dict[tuple[str, int], _PartnerSlot] = {}
        # sender -> the latest round of its exchange requests: a peer asks for round r only after it
        # is done with earlier rounds, so our waits for its earlier requests can end at once
        # (bounded: rounds are clamped to a little past ours and pruned as rounds pass; senders are
        # the peers the transport's gate admits, and at most `incoming.tracked_peers` of them)
        self._latest_request: dict[str, int] = {}
        self._waiting_requests = 0
        incoming = settings.incoming
        # (asker, round) -> pulls of that round answered; pruned as rounds pass
        self._round_pulls: CountPerKey[tuple[str, int]] = CountPerKey(incoming.round_pulls, incoming.tracked_peers * 4)
        self._current_pulls = PeerBuckets(incoming.current_pulls_per_s, incoming.current_pulls_burst,
                                          incoming.tracked_peers)
        self._uploads = 0  # answers of the current tensors being sent now
        # notified when a round begins or a sender's latest request round grows
        self._round_began = asyncio.Condition()

    @property
    def peer_id(self) -> str:
        return self._transport.peer_id

    @property
    def settings(self) -> ExchangeSettings:
        return self._settings

    def set_exchange_timeout(self, seconds: float) -> None:
        """Wait this long for a neighbour from the next round on (gossip DiLoCo's learned grace window)."""
        self._settings = replace(self._settings, exchange_timeout_s=seconds)

    @property
    def tensors(self) -> dict[str, np.ndarray]:
        return self._tensors

    def set_tensors(self, tensors: Tensors, step: int | None = None, *, moved: bool = True) -> None:
        """Install new local values (e.g. after a training step); names, dtypes and shapes must match.
        `moved=False` says they are not this node's own move from the last mix (a download): the
        adaptive radius then learns nothing from the jump."""
        if tensor_specs(tensors) != self._specs:
            raise ValueError("new tensors differ in names, dtypes or shapes from the swarm's manifest")
        if not moved:
            self._base, self._tensors_are_base = None, True
        elif self._tensors_are_base:
            self._base, self._tensors_are_base = self._tensors, False
        self._tensors = dict(tensors)
        if step is not None:
            self.step = step

    @property
    def share(self) -> float:
        """The share of a full contribution that our input to the next round covers (SHARE)."""
        return self._share

    @share.setter
    def share(self, value: float) -> None:
        if not 0.0 < value <= 1.0:
            raise ValueError(f"a round's share of a full contribution is in (0, 1], got {value!r}")
        self._share = float(value)

    async def start(self) -> None:
        await self._transport.serve(self._protocol, self._serve)

    # ---- one round -------------------------------------------------------------------------------

    async def run_round(self, round_index: int, plan: PeerRound) -> RoundOutcome:
        """Exchange with this round's neighbours, mix what arrived in time, install the result."""
        started = time.monotonic()
        own_snapshot = self._tensors
        base, self._base = self._base, None
        oldest_kept = round_index - (0 if self._choco is not None else self._settings.max_staleness)
        awaited = {peer for peer in plan.in_weights if peer in plan.out_peers and self.peer_id > peer}
        async with self._round_began:
            self.round = round_index
            self._begun = round_index
            self._round_inputs = {r: t for r, t in self._round_inputs.items() if oldest_kept <= r < round_index}
            self._round_inputs[round_index] = own_snapshot
            self._round_shares = {r: s for r, s in self._round_shares.items() if oldest_kept <= r < round_index}
            if self._share != 1.0:
                self._round_shares[round_index] = self._share
            self._partner_slots = {(peer, round_index): _PartnerSlot() for peer in awaited}
            self._latest_request = {p: r for p, r in self._latest_request.items() if r > round_index}
            bound = max(1, self._settings.max_staleness)
            self._round_pulls.prune(lambda key: key[1] >= round_index - bound)
            self._round_began.notify_all()
        received: dict[str, _Received] = {}
        skipped: dict[str, str] = {}  # neighbour -> why, as the outcome shows it
        counted: dict[str, str] = {}  # neighbour -> the ExchangeStats.skipped label

        def skip(peer: str, label: str, detail: str = "") -> None:
            # plain strings: they are logged and serialised, and an enum member's repr is not its value
            skipped[peer] = f"{label}: {detail}" if detail else str(label)
            counted[peer] = str(label)
        running = self._incremental_mix(own_snapshot, plan, awaited)

        async def one(peer: str) -> None:
            deadline = asyncio.get_running_loop().time() + self._settings.exchange_timeout_s
            try:
                if peer in awaited:
                    got = await self._await_partner(peer, round_index, deadline)
                else:
                    kind = EXCHANGE if peer in plan.out_peers else PULL
                    if self._choco is not None and kind == PULL:
                        skip(peer, Skip.DIRECTED)
                        return
                    # a retried exchange is safe under compressed gossip: estimates move only on an ack
                    got = await self._request_again_if_cut(peer, kind, own_snapshot, round_index, deadline,
                                                           running.add if running is not None else None)
            except Desync as exc:
                self._desync(peer, round_index, exc.reason)
                skip(peer, Skip.DESYNC)
            except TimeoutError:
                skip(peer, Skip.TIMEOUT)
            except PartnerMissed as exc:
                skip(peer, exc.reason)
            except PeerRejected as exc:
                if exc.reason == Refusal.STALE:
                    skip(peer, Skip.STALE)
                elif exc.reason == Refusal.DESYNC and self._choco is not None:
                    self._desync(peer, round_index, "the partner found our edge estimates out of step")
                    skip(peer, Skip.DESYNC)
                else:
                    skip(peer, Skip.REJECTED, exc.reason)
            except WireError as exc:
                self._accounting.count_refused(exc, peer)
                skip(peer, exc.kind)
            except TensorsUnsendable:
                skip(peer, Skip.UNSENDABLE)
            except ConnectionError as exc:
                skip(peer, Skip.UNREACHABLE)
                logger.debug("round %d: %s unreachable: %s", round_index, peer, exc)
            except Exception as exc:  # the backstop: one neighbour's failure never ends the round (nor the loop)
                skip(peer, Skip.FAILED, type(exc).__name__)
                logger.warning("round %d: the exchange with %s failed: %s: %s", round_index, peer,
                               type(exc).__name__, exc)
            else:
                if abs(got.round - round_index) > self._settings.max_staleness:
                    skip(peer, Skip.STALE)
                else:
                    received[peer] = got

        async with asyncio.TaskGroup() as group:
            for peer in sorted(plan.in_weights):
                group.create_task(one(peer))
            group.create_task(self._keep_past_inputs_encoded(round_index))  # while the exchanges wait on the network

        # compressed gossip receives differences against estimates, not parameters: _choco_mix screens those
        if received and self._choco is None:
            refused = await asyncio.to_thread(self._mixer.screen, own_snapshot,
                                              {peer: r.tensors for peer, r in received.items()})
            for peer, exc in refused.items():
                self._accounting.count_refused(exc, peer)
                skip(peer, exc.kind)
                del received[peer]
        if received and self.judge is not None and self._choco is None:
            factors = self.judge.weigh(round_index, own_snapshot, base, {p: r.tensors for p, r in received.items()},
                                       plan.in_weights)
            plan, running = _weighed(plan, factors, running)
            for peer in [p for p in received if p not in plan.in_weights]:
                skip(peer, Skip.EXCLUDED)
                del received[peer]
        own_share = self._round_shares.get(round_index, 1.0)
        if self._choco is None and (own_share != 1.0 or any(r.share != 1.0 for r in received.values())):
            plan, running = _share_weighted(plan, own_share, {p: r.share for p, r in received.items()}), None
        mixed = running.result() if running is not None and received.keys() == set(plan.in_weights) else None
        clipped: tuple[str, ...] = ()
        if self._choco is not None:
            weights = await asyncio.to_thread(self._choco_commit, received, plan)
            if weights and self.judge is not None:
                # a neighbour's value here is our estimate of its parameters, as this round's difference left it
                factors = self.judge.weigh(round_index, own_snapshot, base, self._choco.estimates(weights), weights)
                weights = {p: w * _factor(factors, p) for p, w in weights.items()}
                for peer in [p for p, w in weights.items() if w == 0.0]:  # committed all the same: edges stay in step
                    skip(peer, Skip.EXCLUDED)
                    del received[peer], weights[peer]
            choco = self._choco
            step = await asyncio.to_thread(lambda: choco.step(own_snapshot, weights, self._mixer, base))
            mixed, clipped = step.tensors, step.clipped
        elif mixed is None:
            outcome = await asyncio.to_thread(self._mixer.mix, own_snapshot,
                                              {peer: r.tensors for peer, r in received.items()},
                                              plan.self_weight, plan.in_weights, base)
            mixed, clipped = outcome.tensors, outcome.clipped
        # values installed meanwhile (a trainer's step) win over this round's mix of older ones
        if self._tensors is own_snapshot:
            self._tensors = mixed
            self._tensors_are_base = True
        for label in counted.values():
            self.stats.skipped[label] += 1
        self.stats.clipped += len(clipped)
        duration = time.monotonic() - started
        self.stats.rounds += 1
        self.stats.last_round_s = duration
        return RoundOutcome(round_index, tuple(sorted(received)), skipped, duration, clipped)

    async def _keep_past_inputs_encoded(self, round_index: int) -> None:
        """Keep the inputs of the rounds before `round_index`, which only pulls still ask for, as the codec
        puts them on the wire where that is smaller: int8 keeps a quarter of float32, and a pull of such a
        round sends those same bytes. One encoding of the model a round (the last one's), off the loop."""
        codec = self._settings.codec
        for r, kept in list(self._round_inputs.items()):
            if r >= round_index or isinstance(kept, EncodedTensors) or \
                    sum(codec.encoded_nbytes(t.size) for t in kept.values()) >= sum(t.nbytes for t in kept.values()):
                continue
            try:
                encoded = await asyncio.to_thread(encode_tensors, kept, codec)
            except (WireError, TypeError) as exc:  # unsendable values: a pull of that round fails as before
                logger.debug("round %d's input stays as it is: %s", r, exc)
                continue
            except Exception as exc:  # never the round's end: the input is kept as it was
                logger.warning("round %d's input could not be re-kept in %s: %s: %s", r, codec.name,
                               type(exc).__name__, exc)
                continue
            if self._round_inputs.get(r) is kept:
                self._round_inputs[r] = encoded

    def _incremental_mix(self, own: dict[str, np.ndarray], plan: PeerRound, awaited: set[str]) -> IncrementalMix | None:
        """A mix that runs as the values arrive, when this round requests from exactly one neighbour
        (every pairwise schedule, and pulls) with the weighted rule; else None and the Mixer runs after."""
        if (self._settings.rule.kind is not MixingKind.WEIGHTED or len(plan.in_weights) != 1 or awaited
                or self._choco is not None):
            return None
        self_weight, weights = effective_weights(plan.self_weight, plan.in_weights, plan.in_weights.keys())
        return IncrementalMix(own, self_weight, *weights.values())

    def _choco_commit(self, received: Mapping[str, _Received], plan: PeerRound) -> dict[str, float]:
        """Compressed gossip: both ends of every completed exchange add what crossed to their estimates
        (what crossed was screened before the ack, `_choco_screen`); returns the weights of the edges
        committed, which this node then moves along under its own mixing rule (ChocoState.step)."""
        assert self._choco is not None
        weights = {}
        for peer, got in received.items():
            assert got.sent is not None, "a compressed-gossip exchange keeps what it sent"
            try:
                self._choco.commit(got.sent, got.tensors)
            except RuntimeError as exc:  # the edge was dropped meanwhile (more neighbours than max_edges)
                self._desync(peer, self.round, str(exc))
                continue
            weights[peer] = plan.in_weights[peer]
        return weights

    async def _choco_screen(self, peer: str, received: Tensors, own: Tensors) -> None:
        """Raise OutOfRange unless `peer`'s differences, and the estimate of `peer` they would make, are
        finite and within the node's value bound (relative to `own`, as dense gossip's screen). Called
        before the ack, so a refused difference is committed by neither end: the estimates stay in step."""
        assert self._choco is not None
        choco = self._choco
        await asyncio.to_thread(lambda: choco.screen(peer, received, self._mixer.bound.limits(own)))

    def _desync(self, peer: str, round_index: int, why: str) -> None:
        assert self._choco is not None
        self._choco.reset(peer)
        logger.info("round %d: compressed-gossip estimates of the edge to %s reset: %s", round_index, peer, why)

    async def _await_partner(self, peer: str, round_index: int, deadline: float) -> _Received:
        """Wait for `peer`'s exchange request of this round and the outcome of answering it.

        Until `deadline` the request may claim the slot; a claimed slot is settled by its handler
        within that handler's reply deadline, so both peers of the pair mix, or neither does. The
        wait ends early once `peer` has asked for a later round: it is done with this one.
        """
        slot = self._partner_slots[(peer, round_index)]
        wait_until = deadline
        while slot.state in (_SlotState.OPEN, _SlotState.CLAIMED):
            while slot.state is _SlotState.OPEN:
                if self._latest_request.get(peer, -1) > round_index:
                    slot.state = _SlotState.CLOSED
                    raise PartnerMissed(str(Skip.MOVED_ON))
                slot.changed.clear()
                try:
                    async with asyncio.timeout_at(wait_until):
                        await slot.changed.wait()
                except TimeoutError:
                    if slot.state is _SlotState.OPEN:  # else a request claimed it just as time ran out
                        slot.state = _SlotState.CLOSED
                        if slot.failure:  # the asker's stream was cut and it did not ask again in time
                            raise PartnerMissed(slot.failure) from None
                        raise
            # Claimed: the handler settles the slot within its own paced deadlines (or reopens it for
            # the asker's second try). This bound only guards against a handler that never does (a
            # bug), so it is generous.
            async with asyncio.timeout(self._answer_bound_s()):
                while slot.state is _SlotState.CLAIMED:
                    slot.changed.clear()
                    await slot.changed.wait()
            if slot.state is _SlotState.OPEN:  # reopened: the asker gets a short grace to ask again
                wait_until = min(deadline, asyncio.get_running_loop().time() + RETRY_GRACE_S)
        if slot.received is None:
            raise PartnerMissed(slot.failure)
        return slot.received

    def _answer_bound_s(self) -> float:
        """The longest an exchange's answer may take once claimed (`_answer_exchange`): the request and our
        reply, each at most the largest payload we accept (a reply is no larger) at the goodput floor, and
        the ack; every deadline there is shorter."""
        pace, wait_s = self._settings.pace, self._settings.exchange_timeout_s
        return 3 * wait_s + 1.0 + 2 * pace.whole_s(self._request_limits.max_payload_bytes)

    async def fetch(self, peer: str, progress: TransferProgress | None = None, *, answer_timeout_s: float | None = None,
                    busy_wait_s: float = 0.0, start: int = 0, stop: int | None = None,
                    delivered: Delivered | None = None, codec: str | None = None) -> tuple[dict[str, np.ndarray], int, int]:
        """`_fetch_once`, asked again while `peer` refuses it as busy uploading to others (`uploading`, its
        IncomingLimits.concurrent_uploads) for up to `busy_wait_s`, at growing random intervals, so peers
        that all pull from one donor at once (a final merge) are served in turns rather than left out; a
        joiner asks none (busy_wait_s 0) and takes the next donor instead."""
        loop = asyncio.get_running_loop()
        until, pause = loop.time() + busy_wait_s, BUSY_RETRY_S
        while True:
            try:
                return await self._fetch_once(peer, progress, answer_timeout_s=answer_timeout_s, start=start,
                                              stop=stop, delivered=delivered, codec=codec)
            except PeerRejected as exc:
                left = until - loop.time()
                if str(exc) != Refusal.UPLOADING or left <= 0:
                    raise
                await asyncio.sleep(min(left, random.uniform(pause / 2, pause)))
                pause = min(2 * pause, MAX_BUSY_RETRY_S)

    def busy_wait_s(self, askers: int) -> float:
        """How long one of `askers` peers pulling the current tensors from one donor at once may wait for its
        turn: the donor's uploads of a model the size of ours, concurrent_uploads at a time, each within its
        bound at the goodput floor (what `fetch`'s `busy_wait_s` should be for a final merge)."""
        turns = math.ceil(max(0, askers - 1) / self._settings.incoming.concurrent_uploads)
        return turns * self._settings.pace.whole_s(message_nbytes(self._tensors, WHOLE_MODEL_CODEC))

    async def _fetch_once(self, peer: str, progress: TransferProgress | None = None, *,
                          answer_timeout_s: float | None = None, start: int = 0, stop: int | None = None,
                          delivered: Delivered | None = None, codec: str | None = None,
                          ) -> tuple[dict[str, np.ndarray], int, int]:
        """`peer`'s current tensors, round and step: a pull outside any round (a joiner's download, the
        swarm-average evaluation, the final merge), answered in WHOLE_MODEL_CODEC (fp32) whatever codec the
        rounds use (an older peer answers in the round codec). Validated like every reply; raises WireError,
        PeerRejected, ConnectionError or TimeoutError (TransferStalled when a piece stalls).

        The dial, the request and the answer's header get `answer_timeout_s` (default: 4 exchange
        deadlines); then the payload, whose
        size the header fixes, is read frame by frame, each within the stall timeout, and all of it
        within its size over the goodput measured for `peer` (`TransferPace.whole_s`): a slow but
        moving link finishes, a stalled or trickling one is cut. `progress`, if given, follows the payload.

        With `start` > 0 only the tensors from that manifest index on are asked for (and returned: a
        download resumed from another donor; a peer of an older murmur answers all of them), and with
        `stop` only those before that index (a spot check: a peer that answers others is refused as a
        manifest mismatch). `delivered`, if given, gets the reply's step and round once its header is
        read, and the tensors that arrived whole, also when the payload breaks off partway. `codec` (one
        of STATE_CODECS) asks for the answer in that codec instead of fp32: a lossy image of the tensors."""
        count = len(self._specs)
        stop = count if stop is None else stop
        if not 0 <= start < max(1, stop) <= max(1, count):
            raise ValueError(f"tensors {start} to {stop} are not a range of our {count}")
        if codec is not None and codec not in STATE_CODECS:
            raise ValueError(f"a pull's answer codec must carry every element ({', '.join(STATE_CODECS)}), got {codec!r}")
        loop = asyncio.get_running_loop()
        pace = self._settings.pace
        answer_s = 4 * self._settings.exchange_timeout_s if answer_timeout_s is None else answer_timeout_s
        meta: dict[str, MetaValue] = {CURRENT: True, **({FROM: start} if start else {}),
                                      **({UNTIL: stop} if stop < count else {}),
                                      **({CODEC: codec} if codec not in (None, WHOLE_MODEL_CODEC.name) else {})}
        incoming: IncomingMessage | None = None
        async with asyncio.timeout(answer_s) as deadline:
            stream = MessageStream(await self._transport.open_stream(peer, self._protocol), self._accounting)
            try:
                await stream.send(self._frames({}, 0, PULL, meta))
                incoming = await self._read_reply_header(stream, pace.stall_timeout_s,
                                                         progress.add if progress is not None else None)
                header = incoming.header
                if header.kind == REPLY:
                    if stop < count or (start and tuple(entry.spec for entry in header.manifest) != self._specs):
                        _check_manifest(header, self._specs[start:stop])
                    else:
                        _check_manifest(header, self._specs)
                    if delivered is not None:
                        delivered.step, delivered.round = header.step, header.round
                    deadline.reschedule(loop.time() + pace.whole_s(header.payload_nbytes, self._goodput(peer)))
                    if progress is not None:
                        progress.begin(peer, header.payload_nbytes)
                reply = await incoming.rest()
            finally:
                if delivered is not None and incoming is not None and incoming.header.kind == REPLY:
                    delivered.tensors = incoming.completed()
                await stream.close()
        if header.kind == REJECT:
            raise PeerRejected(str(header.meta.get("error", "unspecified")))
        if header.kind != REPLY:
            raise BadSchema(f"expected a reply, got a {header.kind!r} message")
        self.stats.exchanges_ok += 1
        return reply.tensors, header.round, header.step

    def _goodput(self, peer: str) -> float | None:
        """The goodput (Mbit/s) the transport measured from `peer` lately; None if it measures none."""
        return measured_goodput(self._transport, peer)

    def park(self) -> None:
        """This peer runs no more rounds (its training is done): answer pulls at once with the
        current tensors instead of waiting for rounds that will never begin."""
        self._parked = True

    async def _request_again_if_cut(self, peer: str, kind: str, own: Tensors, round_index: int, deadline: float,
                                    on_values: ValuesSink | None) -> _Received:
        """`_request`, sent once more on a new stream if the first one is cut before the answer is
        complete (a relay that died, a connection reset) and a quarter of the exchange deadline is left.

        Nothing of a cut attempt is used: the answering peer mixes only after our ack, which a cut
        attempt never sent, and reopens its wait for us; an incremental mix fed part of the first
        answer is spoiled by the second one starting over, so the round mixes afterwards instead.
        """
        try:
            return await self._request(peer, kind, own, round_index, deadline, on_values)
        except (ConnectionError, Truncated) as exc:
            left = deadline - asyncio.get_running_loop().time()
            if left < self._settings.exchange_timeout_s / 4:
                raise
            self.stats.retried += 1
            logger.info("round %d: the %s stream to %s was cut (%s); asking again", round_index, kind, peer,
                        exc or type(exc).__name__)
        return await self._request(peer, kind, own, round_index, deadline, on_values)

    async def _request(self, peer: str, kind: str, own: Tensors, round_index: int, deadline: float,
                       on_values: ValuesSink | None = None, meta: Mapping[str, MetaValue] | None = None) -> _Received:
        """One request to `peer` and its answer. The dial and the answer's header are due by `deadline`
        (pushed back by as long as sending an exchange's tensors took, where the answer starts after them);
        then the answer's payload is paced by its size (gossip.pace), so a slow but moving link finishes
        and a stalled one is cut at the stall timeout. A dense exchange is duplex: it asks the answering
        peer to reply while it still reads our tensors, and reads the reply as it writes them."""
        loop = asyncio.get_running_loop()
        pace, wait_s = self._settings.pace, self._settings.exchange_timeout_s
        async with asyncio.timeout_at(deadline):
            stream = MessageStream(await self._transport.open_stream(peer, self._protocol), self._accounting)
        try:
            outgoing = None
            sent: Tensors = own if kind == EXCHANGE else {}
            codec = self._settings.codec
            duplex = kind == EXCHANGE and self._choco is None and self._settings.duplex
            if kind == EXCHANGE and self._choco is not None:
                outgoing = self._choco.prepare(peer, own)
                sent, codec = outgoing.wire, self._choco.settings.codec
                frames = self._frames(sent, round_index, kind, self._choco.meta(outgoing.count), codec=codec)
            else:
                shared = {**(meta or {}), **self._share_meta(round_index)} if kind == EXCHANGE else meta
                frames = self._frames(sent, round_index, kind, {**(shared or {}), DUPLEX: True} if duplex else shared)

            async def read_reply(bound: asyncio.Timeout, at_least: float) -> Message:
                incoming = await self._read_reply_header(stream, pace.stall_timeout_s, None, on_values)
                header = incoming.header
                if header.kind == REJECT:
                    raise PeerRejected(str(header.meta.get("error", "unspecified")))
                if header.kind != REPLY:
                    raise BadSchema(f"expected a reply, got a {header.kind!r} message")
                _check_manifest(header, self._specs)
                _share_of(header)
                # the size is known: the payload gets as long as it needs at the pace, never less than before
                paced = loop.time() + pace.whole_s(header.payload_nbytes, self._goodput(peer))
                bound.reschedule(max(deadline, paced, at_least))
                return await incoming.rest()

            async with asyncio.timeout_at(deadline) as bound:
                if sent:
                    # Our tensors at the goodput floor (what we send is not measured); the answering peer
                    # may leave them unread for up to its exchange deadline while its round has not begun.
                    began = loop.time()
                    sent_by = began + wait_s + pace.whole_s(message_nbytes(sent, codec))
                    stall_s = max(pace.stall_timeout_s, wait_s)
                    if duplex:
                        # the answer's header is due by the deadline (it does not wait for our tensors); our
                        # tensors by their own bound, which the answer's payload then never cuts
                        async def send_own() -> None:
                            async with asyncio.timeout_at(sent_by):
                                await stream.send(frames, stall_s=stall_s)

                        _, reply = await _both(send_own(), read_reply(bound, sent_by))
                    else:  # the answer starts once our tensors are read
                        bound.reschedule(max(deadline, sent_by))
                        await stream.send(frames, stall_s=stall_s)
                        bound.reschedule(deadline + (loop.time() - began))
                        reply = await read_reply(bound, deadline)
                else:
                    await stream.send(frames)
                    reply = await read_reply(bound, deadline)
                if outgoing is not None:
                    assert self._choco is not None
                    self._choco.check(peer, reply.header.meta)  # Desync: no ack, so neither end mixes
                    await self._choco_screen(peer, reply.tensors, own)  # OutOfRange: no ack either
            if kind == EXCHANGE:
                # The ack commits both sides to mixing: the answering peer mixes our tensors only if
                # it reads the ack, so it is sent only once the reply is known to be good and in time.
                async with asyncio.timeout(self._settings.exchange_timeout_s):
                    await stream.send(self._frames({}, round_index, ACK))
                # Closing first could make p2pd reset the stream before the ack has left.
                await stream.linger(self._settings.exchange_timeout_s)
            self.stats.exchanges_ok += 1
            return _Received(reply.header.round, reply.header.step, reply.tensors, outgoing, _share_of(reply.header))
        finally:
            await stream.close()

    async def _read_reply_header(self, stream: MessageStream, stall_s: float, on_bytes: Callable[[int], None] | None,
                                 on_values: ValuesSink | None = None) -> IncomingMessage:
        """The answer to our request, its header read; every piece of it within `stall_s`. A peer that
        hangs up before sending a byte of it is not a truncated message (nothing was cut) but a peer
        that did not answer: ConnectionError."""
        before = stream.received
        try:
            return await stream.read_header(self._request_limits, self._expect_peer, on_values, stall_s=stall_s,
                                            on_bytes=on_bytes)
        except Truncated:
            if stream.received == before:
                raise ConnectionError(f"{stream.remote_peer} hung up without answering") from None
            raise

    # ---- serving ---------------------------------------------------------------------------------

    async def _serve(self, raw: Stream) -> None:
        stream = MessageStream(raw, self._accounting)
        peer = stream.remote_peer
        deadline = asyncio.get_running_loop().time() + self._settings.exchange_timeout_s
        linger_s = self._settings.exchange_timeout_s
        try:
            # The header first, and nothing more: its kind, sender, round and manifest decide whether
            # any payload is read at all (a pull has none; an exchange's is read once it is claimed,
            # every piece within the stall timeout).
            async with asyncio.timeout(min(self._settings.incoming.header_timeout_s, self._settings.exchange_timeout_s)):
                request = await stream.read_header(self._request_limits, self._expect_peer,
                                                   stall_s=self._settings.pace.stall_timeout_s)
            header = request.header
            kind = header.kind
            if kind == EXCHANGE:
                _check_manifest(header, self._specs)
                _share_of(header)
                refused = await self._answer_exchange(stream, request, deadline)
                if refused is None:
                    return  # the asker hangs up only after we do (see _request)
            elif kind == PULL:
                if header.manifest:
                    raise BadSchema("a pull request carries no tensors")
                linger_s = await self._answer_pull(stream, header, deadline)
            else:
                raise BadSchema(f"expected a pull or exchange request, got a {kind!r} message")
        except WireError as exc:
            stream.count_refused(exc)
            await self._try_reject(stream, exc.kind)
            await stream.linger(self._settings.exchange_timeout_s)
            return
        except TensorsUnsendable:
            return  # counted and logged by MessageStream.send; closing the stream ends the message
        except (TimeoutError, ConnectionError) as exc:
            self.stats.errors["timeout" if isinstance(exc, TimeoutError) else "disconnected"] += 1
            logger.info("gossip request from %s abandoned: %s", peer, exc or type(exc).__name__)
            return
        await stream.linger(linger_s)

    def _pull_refusal(self, peer: str, header: Header) -> Refusal | None:
        """Whether a pull is over its limits: a round pull outside the staleness bound (answered now
        with a reject instead of tensors the asker would drop as stale) or asked more than
        `round_pulls` times, or any round pull under compressed gossip; a pull of the current tensors
        beyond the asker's token bucket."""
        if (FROM in header.meta or UNTIL in header.meta) and _tensor_range(header.meta, len(self._specs)) is None:
            raise BadSchema(f"a pull's {FROM!r} and {UNTIL!r} must be a range of our {len(self._specs)} tensors, in a "
                            f"pull of the current ones; got {header.meta.get(FROM)!r} to {header.meta.get(UNTIL)!r}")
        if CODEC in header.meta and (header.meta.get(CURRENT) is not True or header.meta[CODEC] not in STATE_CODECS):
            raise BadSchema(f"a pull's {CODEC!r} must name one of {', '.join(STATE_CODECS)}, in a pull of the current "
                            f"tensors; got {header.meta[CODEC]!r}")
        if header.meta.get(CURRENT) is True:
            if self._uploads >= self._settings.incoming.concurrent_uploads:
                return Refusal.UPLOADING  # before the bucket: a refused pull costs the asker no token
            return None if self._current_pulls.take(peer) else Refusal.RATE_LIMITED
        if self._choco is not None:  # compressed gossip has symmetric edges only: no round pulls
            return Refusal.UNSUPPORTED
        bound = max(1, self._settings.max_staleness)
        if abs(header.round - self.round) > bound:
            return Refusal.STALE
        return None if self._round_pulls.take((peer, header.round)) else Refusal.RATE_LIMITED

    async def _answer_pull(self, stream: MessageStream, header: Header, deadline: float) -> float:
        """Answer a pull (or refuse it); returns how long to linger for the asker to hang up."""
        wait_s = self._settings.exchange_timeout_s
        refusal = self._pull_refusal(stream.remote_peer, header)
        if refusal is not None:
            self.stats.refused[str(refusal)] += 1
            logger.debug("pull of round %d from %s refused: %s", header.round, stream.remote_peer, refusal)
            await self._try_reject(stream, str(refusal))
            return wait_s
        answer: tuple[Tensors | EncodedTensors, int]
        codec = self._settings.codec
        if header.meta.get(CURRENT) is True:
            # a whole model outside any round, at once; or its tail, for a download resumed here
            wanted = _tensor_range(header.meta, len(self._specs))  # checked by _pull_refusal
            assert wanted is not None
            answer = dict(itertools.islice(self._tensors.items(), *wanted)), self.round
            wanted_codec = header.meta.get(CODEC)  # checked by _pull_refusal: a state codec's name
            codec = get_codec(wanted_codec) if isinstance(wanted_codec, str) else WHOLE_MODEL_CODEC
        else:
            try:
                async with asyncio.timeout_at(deadline):
                    answer = await self._pull_answer(header.round)
            except TimeoutError:
                raise self._round_wait_timed_out(header.round) from None
        # The reply gets its own deadline: one shared with the wait above could cut the reply
        # halfway, and the asker, still within its deadline, would read a truncated message.
        nbytes = message_nbytes(answer[0], codec)
        uploading = header.meta.get(CURRENT) is True
        self._uploads += uploading
        try:
            meta = {} if uploading else self._share_meta(answer[1])
            replied = await self._send_paced(stream, self._frames(*answer, REPLY, meta, codec=codec), nbytes)
        finally:
            self._uploads -= uploading
        self.stats.exchanges_ok += 1
        return max(wait_s, replied - asyncio.get_running_loop().time())

    async def _send_paced(self, stream: MessageStream, frames: Frames, nbytes: int) -> float:
        """Send an answer of about `nbytes` as the asker reads it (gossip.pace): every piece within the
        stall timeout, all of it within its size at the goodput floor (what we send is not measured), and
        never less than the exchange deadline. Returns when (loop time) that bound ends: the answer's tail
        may still be in the transport's buffers when the last write returns, and the asker reads it until then."""
        pace = self._settings.pace
        bound_s = max(self._settings.exchange_timeout_s, pace.whole_s(nbytes))
        async with asyncio.timeout(bound_s) as bound:
            await stream.send(frames, stall_s=pace.stall_timeout_s)
        when = bound.when()
        assert when is not None
        return when

    async def _answer_exchange(self, stream: MessageStream, request: IncomingMessage, deadline: float) -> Refusal | None:
        """Answer an exchange request whose header is read: claim our round's wait for this asker,
        read its tensors, reply with our input to its round and, once the asker's ack arrives, hand
        its tensors to that round; or a `reject` saying why not (returned), its payload left unread."""
        peer, round_index = stream.remote_peer, request.header.round
        claimed = await self._claim_partner_slot(peer, round_index, deadline)
        if isinstance(claimed, Refusal):
            self.stats.refused[str(claimed)] += 1
            logger.debug("exchange request of round %d from %s refused: %s", round_index, peer, claimed)
            await self._try_reject(stream, str(claimed))
            return claimed
        slot, inputs = claimed
        received = None
        failure = str(Skip.TIMEOUT)
        outgoing = None
        try:
            if self._choco is not None:
                try:
                    self._choco.check(peer, request.header.meta)
                except Desync as exc:
                    failure = str(Skip.DESYNC)
                    self._desync(peer, round_index, exc.reason)
                    self.stats.refused[str(Refusal.DESYNC)] += 1
                    await self._try_reject(stream, str(Refusal.DESYNC))
                    return Refusal.DESYNC
                outgoing = self._choco.prepare(peer, inputs)
                frames = self._frames(outgoing.wire, round_index, REPLY, self._choco.meta(outgoing.count),
                                      codec=self._choco.settings.codec)
                reply_nbytes = message_nbytes(outgoing.wire, self._choco.settings.codec)
            else:
                frames = self._frames(inputs, round_index, REPLY, self._share_meta(round_index))
                reply_nbytes = message_nbytes(inputs, self._settings.codec)
            # Each phase is paced by its size (gossip.pace), never shorter than the exchange deadline:
            # the request's payload at the goodput measured from the asker, our reply at the floor.
            # The reply starts once the whole request is read and checked, not alongside it: compressed
            # gossip screens the request before replying (a reply to a refused difference would let the
            # asker commit alone), and the asker writes its whole request before it reads. Overlapping
            # them (dense gossip; the asker reading while it writes) would halve a symmetric round on a
            # link as fast each way; gossip.plan counts the two transfers in a row (RoleCounts.transfers).
            wait_s, pace = self._settings.exchange_timeout_s, self._settings.pace
            read_s = max(wait_s, pace.whole_s(request.header.payload_nbytes, self._goodput(peer)))

            async def read_request() -> Message:
                async with asyncio.timeout(read_s):
                    message = await request.rest()
                    if outgoing is not None:  # OutOfRange: rejected, so neither end commits the exchange
                        await self._choco_screen(peer, message.tensors, inputs)
                return message

            try:
                if outgoing is None and request.header.meta.get(DUPLEX) is True:
                    # the asker reads as it writes: reply as its request is read (a request found bad then
                    # cuts our reply, which the asker reads as truncated and does not ack)
                    phase = "reading the request's payload and sending the reply"
                    message, replied = await _both(read_request(), self._send_paced(stream, frames, reply_nbytes))
                else:
                    phase = "reading the request's payload"
                    message = await read_request()
                    phase = "sending the reply"
                    replied = await self._send_paced(stream, frames, reply_nbytes)
                phase = "waiting for the ack"
                # the asker acks once it has read all of our reply (whose tail may still be in buffers)
                async with asyncio.timeout_at(max(replied, asyncio.get_running_loop().time()) + wait_s):
                    ack = await stream.read(self._request_limits, self._expect_peer)
            except TransferStalled:
                raise
            except TimeoutError:
                raise TimeoutError(f"timed out {phase}") from None
            if ack.header.kind != ACK or ack.header.round != round_index or ack.header.manifest:
                raise BadSchema(f"expected the ack of round {round_index}, got a {ack.header.kind!r} message "
                                f"of round {ack.header.round}")
            received = _Received(round_index, message.header.step, message.tensors, outgoing, _share_of(message.header))
            self.stats.exchanges_ok += 1
        except (ConnectionError, Truncated) as exc:
            # The asker hung up without an ack: it does not mix ours either, and may ask again on a new
            # stream (its stream was cut), so the round waits a little longer for it (_await_partner);
            # if it does not, the round skips it for what cut this one (a truncated payload or a hang-up).
            slot.reopen(exc.kind if isinstance(exc, Truncated) else str(Skip.UNREACHABLE))
            raise
        except WireError as exc:
            failure = exc.kind
            raise
        except TensorsUnsendable:
            failure = str(Skip.UNSENDABLE)
            raise
        finally:
            if slot.state is _SlotState.CLAIMED:
                slot.settle(received, failure)
        return None

    def _round_wait_timed_out(self, round_index: int) -> TimeoutError:
        # a round of ours that waits a whole deadline (for a partner, a dial) holds up the peers
        # ahead of it too: the served request says which wait ran out
        return TimeoutError(f"timed out waiting for our round {round_index} to begin (still in round {self.round})")

    async def _claim_partner_slot(self, peer: str, round_index: int,
                                  deadline: float) -> tuple[_PartnerSlot, Tensors] | Refusal:
        """The slot where our round `round_index` waits for `peer`, and our input to that round; or
        why the request is refused.

        A request for a round we will begin within the staleness bound waits (until `deadline`) for
        that round to begin. This cannot deadlock: beginning a round waits for no request, and the
        round's own wait for this request (_await_partner) is what the claim ends.
        """
        async with self._round_began:
            bound = max(1, self._settings.max_staleness)
            stale = not self.round - bound <= round_index <= self.round + bound
            # A request from a peer ahead, even too far ahead to answer, says it is done with every
            # earlier round: our waits for its requests of those rounds end now, not at their deadline
            # (else two halves of a swarm further apart than the bound wait a deadline every round).
            latest = self._latest_request.get(peer)
            if round_index >= self.round - bound and round_index > (latest if latest is not None else -1) and (
                    latest is not None or len(self._latest_request) < self._settings.incoming.tracked_peers):
                # clamped just past the furthest round we would answer: as telling for our waits, and
                # pruned once our rounds pass it (a far-future round would otherwise stay for good)
                self._latest_request[peer] = min(round_index, self.round + bound + 1)
                self._round_began.notify_all()
                for (partner, r), waiting in self._partner_slots.items():
                    if partner == peer and r < round_index:
                        waiting.changed.set()
            if stale:
                return Refusal.STALE
            if self._begun < round_index:
                if not self._will_begin(round_index):
                    return Refusal.LATE  # a round this peer skipped
                if self._waiting_requests >= MAX_WAITING_REQUESTS:
                    return Refusal.BUSY
                self._waiting_requests += 1
                try:
                    async with asyncio.timeout_at(deadline):
                        await self._round_began.wait_for(
                            lambda: self._begun >= round_index or self._latest_request.get(peer, -1) > round_index)
                except TimeoutError:
                    raise self._round_wait_timed_out(round_index) from None
                finally:
                    self._waiting_requests -= 1
            slot = self._partner_slots.get((peer, round_index))
            if self._latest_request.get(peer, -1) > round_index or (slot is not None and slot.state is not _SlotState.OPEN):
                return Refusal.LATE
            if slot is None:
                return Refusal.LATE if self._begun > round_index else Refusal.NOT_PARTNER
            slot.state = _SlotState.CLAIMED
            slot.changed.set()
            began = self._round_inputs[round_index]
            assert not isinstance(began, EncodedTensors), "a partner slot is the current round's: its input is kept whole"
            return slot, began

    def _will_begin(self, round_index: int) -> bool:
        """Whether `round_index` is a round this peer has not begun but will, within the staleness
        bound (at least the next round, so a bound of 0 still lets a pair meet)."""
        if self._parked:
            return False
        last = max(self._begun, self.round - 1)
        return last < round_index <= self.round + max(1, self._settings.max_staleness)

    async def _pull_answer(self, round_index: int) -> tuple[Tensors | EncodedTensors, int]:
        """The tensors (and their round) that answer a pull of round `round_index`.

        Mixing stays doubly stochastic only if a puller gets our input to *its* round: a pull of a
        round we began gets our tensors as that round began, even if we have moved on, and a pull of
        a round we will begin within the staleness bound waits for it (within the request's deadline).
        """
        if self._begun < round_index and self._will_begin(round_index):
            async with self._round_began:
                await self._round_began.wait_for(lambda: self._begun >= round_index)
        began = self._round_inputs.get(round_index)
        return (began, round_index) if began is not None else (self._tensors, self.round)

    def _share_meta(self, round_index: int) -> dict[str, MetaValue]:
        """SHARE for our input to `round_index`, where it is not a full contribution."""
        share = self._round_shares.get(round_index)
        return {SHARE: share} if share is not None else {}

    async def _try_reject(self, stream: MessageStream, reason: str) -> None:
        await stream.try_reject(lambda: self._frames({}, None, REJECT, meta={"error": reason}),
                                min(1.0, self._settings.exchange_timeout_s))

    def _frames(self, tensors: Tensors | EncodedTensors, round_index: int | None, kind: str,
                meta: Mapping[str, MetaValue] | None = None, codec: Codec | None = None) -> Frames:
        """A message from this peer, encoded as it is written (header problems raise here, before a
        byte is written; see MessageStream.send for the tensors' own)."""
        fields: HeaderFields = {"swarm": self._settings.swarm, "config_hash": self._settings.config_hash,
                                "sender": self.peer_id, "round": self.round if round_index is None else round_index,
                                "step": self.step, "kind": kind}
        proof = self._settings.admission.credentials(fields)
        return iter_message(tensors, codec or self._settings.codec, meta={**(meta or {}), **proof},
                            limits=self._settings.limits, **fields)


_A = TypeVar("_A")
_B = TypeVar("_B")


async def _both(first: Coroutine[Any, Any, _A], second: Coroutine[Any, Any, _B]) -> tuple[_A, _B]:
    """Both at once (a duplex exchange's writing and reading); the first to fail cancels the other and is
    raised as itself: the callers sort a round's failures by their type. A cancel of the caller (a stop, a
    timeout) cancels both and propagates as itself.

    Not a TaskGroup: on Python 3.11 one whose task fails while it waits cancels the caller's task and
    never uncancels it (the count stays up for the caller's later timeouts), and it gives a task's failure
    priority over the caller's own cancel (a stop would read as a skipped neighbour)."""
    a, b = asyncio.ensure_future(first), asyncio.ensure_future(second)
    try:
        await asyncio.wait((a, b), return_when=asyncio.FIRST_EXCEPTION)
    finally:  # done, failed, or cancelled ourselves: neither half outlives the call
        for half in (a, b):
            half.cancel()
        await asyncio.wait((a, b))
    for half in (a, b):
        if not half.cancelled() and half.exception() is not None:
            raise half.exception()  # type: ignore[misc]  # checked just above
    return a.result(), b.result()


def _factor(factors: Mapping[str, float], peer: str) -> float:
    """A Judge's weight factor for `peer`, clamped to [0, 1]; 1 for a peer it left out."""
    return min(1.0, max(0.0, float(factors.get(peer, 1.0))))


def _weighed(plan: PeerRound, factors: Mapping[str, float],
             running: IncrementalMix | None) -> tuple[PeerRound, IncrementalMix | None]:
    """The round's plan with each neighbour's weight scaled by its factor in [0, 1] (the rest moved onto
    this node's own value; a factor of 0 leaves the neighbour out), and whether the mix that ran as the
    values arrived still holds (only if nothing changed)."""
    scaled = {p: _factor(factors, p) for p in plan.in_weights}
    if all(f == 1.0 for f in scaled.values()):
        return plan, running
    plan = plan.without(p for p, f in scaled.items() if f == 0.0)
    moved = sum(w * (1.0 - scaled[p]) for p, w in plan.in_weights.items())
    weights = {p: w * scaled[p] for p, w in plan.in_weights.items()}
    return PeerRound(plan.self_weight + moved, weights, plan.out_peers), None


def _share_weighted(plan: PeerRound, own_share: float, shares: Mapping[str, float]) -> PeerRound:
    """The round's plan over the neighbours whose values arrived (`shares`; the weights of the rest
    moved onto our own value), each value weighed by the share of a full contribution it covers
    (gossip.mixing.token_weights)."""
    self_weight, weights = effective_weights(plan.self_weight, plan.in_weights, shares.keys())
    self_weight, weights = token_weights(self_weight, weights, shares, own_share)
    return PeerRound(self_weight, weights, plan.out_peers)


def _share_of(header: Header) -> float:
    """The SHARE a round's message claims (1 without one); BadSchema unless a number in (0, 1]."""
    share = header.meta.get(SHARE, 1.0)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 < share <= 1.0:  # NaN fails it too
        raise BadSchema(f"a message's {SHARE!r} must be a number in (0, 1], got {share!r}")
    return float(share)


def _check_manifest(header: Header, specs: tuple[TensorSpec, ...]) -> None:
    got = tuple(entry.spec for entry in header.manifest)
    if got != specs:
        raise ManifestMismatch(f"{header.kind} manifest {_describe(got)} differs from the local {_describe(specs)}")


def _tensor_range(meta: Mapping[str, MetaValue], count: int) -> tuple[int, int] | None:
    """The tensors a pull of the current ones asks for, [FROM, UNTIL) (default: all `count`); None unless
    that is a non-empty range of them, in a pull of the current tensors."""
    start, stop = meta.get(FROM, 0), meta.get(UNTIL, count)
    if meta.get(CURRENT) is not True or type(start) is not int or type(stop) is not int:
        return None
    return (start, stop) if 0 <= start < stop <= count else None


def _describe(specs: tuple[TensorSpec, ...]) -> str:
    if len(specs) <= 3:
        return str([(s.name, s.dtype, list(s.shape)) for s in specs])
    return f"[{len(specs)} tensors, first {specs[0].name!r}]"


def _limits_for(tensors: Tensors, settings: ExchangeSettings) -> WireLimits:
    """Limits sized to our own tensors, so a message we read before knowing its kind stays that small.

    Top-k can take up to 8 bytes per element; every other codec takes at most 8. A header may be at
    most twice our own (with the most and longest meta entries allowed: admission proofs ride there)
    plus 4 KiB: names and ids differ in length.
    """
    limits = settings.limits
    elements = sum(int(t.size) for t in tensors.values())
    decoded = sum(int(t.nbytes) for t in tensors.values())
    longest = "x" * limits.max_name_len
    own = make_header(tensor_specs(tensors), settings.codec,
                      meta={f"{i:0{limits.max_name_len}d}": "x" * limits.max_meta_value_len
                            for i in range(limits.max_meta_entries)},
                      swarm=settings.swarm, config_hash=settings.config_hash, sender=longest, round=0, step=0,
                      kind=longest)
    return replace(
        limits,
        max_header_bytes=min(limits.max_header_bytes, 2 * len(pack_header(own)) + 4096),
        max_payload_bytes=min(limits.max_payload_bytes, 8 * elements + 1024),
        max_decoded_bytes=min(limits.max_decoded_bytes, decoded + 1024),
        max_tensors=min(limits.max_tensors, max(1, len(tensors))),
    )
