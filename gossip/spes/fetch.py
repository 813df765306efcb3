"""SPES's fetch protocol (`/murmur/spes/fetch/1`): one expert copy, asked for by label and checked by the asker
against the version and hash it comes with; over any `Transport`.

The copy is answered in the refresh codec. With delta refreshes the asker names the hash of the copy it has,
and an owner whose previous published copy has that hash answers with the compressed delta from it (kind
`delta`, in the refresh codec) instead of the whole copy (kind `expert`, then in fp32); the asker adds it and
checks the sum's hash.

docs/spes.md ("The fetch protocol") describes the messages; `node.algorithms.spes.node.SpesNode` asks and serves.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Protocol

import numpy as np

from gossip.codecs import Codec, get_codec
from gossip.errors import BadSchema, Truncated, WireError
from gossip.exchange import ExchangeSettings
from gossip.limits import LruTable, ThrottledLog
from gossip.pace import measured_goodput
from gossip.spes.rules import (
    ExpertHashMismatch,
    ExpertKey,
    ExpertRecord,
    content_hash,
    expert_label,
    parse_expert_label,
)
from gossip.stream import Accounting, Frames, MessageStream
from gossip.transport import Stream, Transport
from gossip.wire import (
    DEFAULT_LIMITS,
    Expectation,
    HeaderFields,
    MetaValue,
    TensorSpec,
    WireLimits,
    check_expectation,
    encode_message,
    message_nbytes,
)

logger = logging.getLogger(__name__)

FETCH_PROTOCOL = "/murmur/spes/fetch/1"
FETCH, EXPERT, DELTA, REJECT = "fetch", "expert", "delta", "reject"
# A fetch request is a header without tensors: small limits, so a hostile asker cannot make us read much.
REQUEST_LIMITS = replace(DEFAULT_LIMITS, max_header_bytes=16 << 10, max_tensors=1, max_payload_bytes=1,
                         max_decoded_bytes=1)


class FetchSkip(StrEnum):
    """Why a frozen copy was not fetched (FetchStats.skipped), besides the `WireError.kind` of a refused answer."""

    TIMEOUT = "timeout"
    UNREACHABLE = "unreachable"
    REJECTED = "rejected"  # the holder answered with a `reject`
    STALE = "stale"  # the copy sent is older than the directory showed
    VERSION_OUT_OF_BOUNDS = "version_out_of_bounds"  # the copy claims a version beyond the sync index's bound
    NO_RECORD = "no_record"  # no owner published a record of the expert
    FAILED = "failed"  # an error of no declared kind (the backstop): this copy's loss, not the sync's


RATE_LIMITED = "rate_limited"  # the reject's error when an asker fetched one copy too often


@dataclass
class FetchStats:
    """Counters of the frozen-copy refresh protocol (both directions)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    served: int = 0
    fetched: int = 0
    deltas: int = 0  # fetched as a delta from the copy held
    errors: collections.Counter[str] = field(default_factory=collections.Counter)  # refused input, by kind
    skipped: collections.Counter[str] = field(default_factory=collections.Counter)  # refreshes not done, by reason
    # fetch requests answered with a reject for their rate (RATE_LIMITED), not for being invalid
    refused: collections.Counter[str] = field(default_factory=collections.Counter)


class RefreshFailed(Exception):
    """A frozen copy could not be fetched; `reason` is the skip counter label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = str(reason)


@dataclass(frozen=True)
class ServedCopy:
    """What a holder answers: its copy (or, with `base`, the delta from the copy hashed `base`) and record."""

    tensors: Mapping[str, np.ndarray]
    record: ExpertRecord
    base: str | None = None  # the hash the delta applies to; None: `tensors` is the whole copy


class ExpertHolder(Protocol):
    """What the serving side asks of the node: which experts it has, and the copy it serves of one
    to an asker that has the copy hashed `have` (None: it names none)."""

    def holds(self, key: ExpertKey) -> bool: ...

    async def served_copy(self, key: ExpertKey, have: str | None) -> ServedCopy: ...


class ExpertFetch:
    """Both ends of the fetch protocol for one node; `stats` counts both directions."""

    def __init__(self, transport: Transport, settings: ExchangeSettings, refresh_codec: str,
                 step: Callable[[], int], *, deltas: bool = False) -> None:
        self._transport = transport
        self._settings = settings
        self._deltas = deltas
        # with deltas, whole copies travel exactly (they are sums of deltas, not codec images) and deltas
        # in the refresh codec
        self._copy_codec_name = "fp32" if deltas else refresh_codec
        self._copy_codec = get_codec(self._copy_codec_name)
        self._refresh_codec_name = refresh_codec
        self._refresh_codec = get_codec(refresh_codec)
        self._step = step  # the node's current step, for the headers it sends
        self.stats = FetchStats()
        self._accounting = Accounting(self.stats, logger, "refused expert message")
        # (asker, expert) -> (the version it was last served, how often): a refresh fetches a changed
        # copy once, so an asker gets each version at most `fetches_per_version` times
        incoming = settings.incoming
        self._served: LruTable[tuple[str, ExpertKey], tuple[int, int]] = LruTable(incoming.tracked_peers * 4)
        self._refusals = ThrottledLog(logger, "expert fetch")

    async def serve(self, holder: ExpertHolder) -> None:
        async def handler(stream: Stream) -> None:
            await self._serve(MessageStream(stream, self._accounting), holder)

        await self._transport.serve(FETCH_PROTOCOL, handler)

    async def fetch(self, source: str, key: ExpertKey, like: Mapping[str, np.ndarray], min_version: int,
                    have: tuple[str, Mapping[str, np.ndarray]] | None = None, max_version: int | None = None,
                    ) -> tuple[dict[str, np.ndarray], ExpertRecord]:
        """Expert `key` from `source`, shaped as `like` (its float32 tensors, in hash order), checked
        against the hash it declares, at least `min_version` (the version the directory showed) and at
        most `max_version` (`gossip.spes.version_bound`). `have` (with deltas): the hash and tensors of
        the copy this node holds, which a delta applies to. RefreshFailed says why not."""
        expected = Expectation(self._settings.swarm, self._settings.config_hash,
                               tuple(TensorSpec(n, "float32", a.shape) for n, a in like.items()),
                               frozenset({self._copy_codec_name, self._refresh_codec_name}),
                               admit=self._settings.admission.admit)
        meta: dict[str, MetaValue] = {"expert": expert_label(key)}
        if self._deltas and have is not None:
            meta["have"] = have[0]
        loop, pace = asyncio.get_running_loop(), self._settings.pace
        try:
            # the dial, the request and the answer's header within the exchange deadline; the payload, whose
            # size the header fixes, piece by piece within the stall timeout and all of it within its size
            # at the measured goodput (gossip.pace): a large expert over a slow link is not cut as if dead
            async with asyncio.timeout(self._settings.exchange_timeout_s) as deadline:
                stream = MessageStream(await self._transport.open_stream(source, FETCH_PROTOCOL), self._accounting)
                try:
                    await stream.send(self._frames({}, FETCH, meta, get_codec("fp32")))
                    try:
                        incoming = await stream.read_header(_limits_for(like), None, stall_s=pace.stall_timeout_s)
                        deadline.reschedule(max(deadline.when() or loop.time(), loop.time() + pace.whole_s(
                            incoming.header.payload_nbytes, measured_goodput(self._transport, source))))
                        reply = await incoming.rest()
                    except Truncated:
                        if stream.received == 0:  # closed unanswered (e.g. by its stream limits): no message cut
                            raise ConnectionError(f"{source} hung up without answering") from None
                        raise
                finally:
                    await stream.close()
        except TimeoutError:
            raise RefreshFailed(FetchSkip.TIMEOUT) from None
        except ConnectionError as exc:
            raise RefreshFailed(FetchSkip.UNREACHABLE, str(exc)) from None
        except WireError as exc:
            self._accounting.count_refused(exc, source)
            raise RefreshFailed(exc.kind, str(exc)) from None
        except Exception as exc:  # the backstop: whatever a holder's bytes trip, one copy is lost, not the sync
            raise RefreshFailed(FetchSkip.FAILED, f"{type(exc).__name__}: {exc}") from None
        try:
            if reply.header.kind == REJECT:
                raise RefreshFailed(FetchSkip.REJECTED, str(reply.header.meta.get("error", "unspecified")))
            check_expectation(reply.header, expected)
            kind = reply.header.kind
            if kind not in (EXPERT, DELTA) or reply.header.meta.get("expert") != expert_label(key):
                raise BadSchema(f"expected expert {expert_label(key)}, got a {kind!r} message "
                                f"for {reply.header.meta.get('expert')!r}")
            wanted = self._refresh_codec_name if kind == DELTA else self._copy_codec_name
            if reply.header.codec != wanted:
                raise BadSchema(f"an {kind} reply must travel in {wanted}, got {reply.header.codec}")
            version, declared = reply.header.meta.get("version"), reply.header.meta.get("hash")
            if not isinstance(version, int) or not isinstance(declared, str):
                raise BadSchema("an expert reply must carry an integer version and a string hash in meta")
            tensors = reply.tensors
            if kind == DELTA:
                if have is None or reply.header.meta.get("base") != have[0]:
                    raise BadSchema(f"a delta for a copy hashed {str(reply.header.meta.get('base'))[:12]}, "
                                    "not the one asked from")
                # float32 sums in the same order as the owner's: the same bits, so the hash can match
                tensors = {n: (np.asarray(have[1][n], np.float32).reshape(t.shape) + t).astype(np.float32)
                           for n, t in reply.tensors.items()}
            got = content_hash([tensors[n] for n in like])
            if got != declared:
                raise ExpertHashMismatch(f"expert {expert_label(key)} hashes to {got[:12]}, declared {declared[:12]}")
            record = ExpertRecord(version, declared, False)
        except WireError as exc:
            self._accounting.count_refused(exc, source)
            raise RefreshFailed(exc.kind, str(exc)) from None
        except ValueError as exc:  # a malformed record (version < 0, hash not hex)
            self._accounting.count_refused(BadSchema(str(exc)), source)
            raise RefreshFailed(BadSchema.kind, str(exc)) from None
        if max_version is not None and record.version > max_version:
            raise RefreshFailed(FetchSkip.VERSION_OUT_OF_BOUNDS,
                                f"{source} sent version {record.version}, beyond the bound {max_version}")
        if record.version < min_version:
            raise RefreshFailed(FetchSkip.STALE,
                                f"{source} sent version {record.version}, the directory shows {min_version}")
        self.stats.fetched += 1
        if kind == DELTA:
            self.stats.deltas += 1
        return tensors, record

    async def _serve(self, stream: MessageStream, holder: ExpertHolder) -> None:
        peer = stream.remote_peer
        incoming, pace = self._settings.incoming, self._settings.pace
        try:
            async with asyncio.timeout(min(incoming.header_timeout_s, self._settings.exchange_timeout_s)):
                request = await stream.read(REQUEST_LIMITS, Expectation(self._settings.swarm, self._settings.config_hash,
                                                                          admit=self._settings.admission.admit))
            answer: tuple[Frames, int] | None = None
            async with asyncio.timeout(self._settings.exchange_timeout_s):
                if request.header.kind != FETCH or request.header.manifest:
                    raise BadSchema(f"expected a fetch request without tensors, got a {request.header.kind!r} message")
                label = request.header.meta.get("expert")
                try:
                    key = parse_expert_label(label) if isinstance(label, str) else None
                except ValueError:
                    key = None
                if key is None or not holder.holds(key):
                    raise BadSchema(f"fetch request for unknown expert {label!r}")
                have = request.header.meta.get("have")
                copy = await holder.served_copy(key, have if isinstance(have, str) and self._deltas else None)
                if self._may_serve(peer, key, copy.record.version):
                    meta: dict[str, MetaValue] = {"expert": label, "version": copy.record.version,
                                                  "hash": copy.record.hash}
                    if copy.base is not None:
                        meta["base"] = copy.base
                    codec = self._refresh_codec if copy.base is not None else self._copy_codec
                    answer = (self._frames(copy.tensors, DELTA if copy.base is not None else EXPERT, meta, codec),
                              message_nbytes(copy.tensors, codec))
                else:
                    self.stats.refused[RATE_LIMITED] += 1
                    self._refusals.refused(RATE_LIMITED, peer)
                    await stream.try_reject(lambda: self._frames({}, REJECT, {"error": RATE_LIMITED}, get_codec("fp32")),
                                            min(1.0, self._settings.exchange_timeout_s))
            if answer is not None:
                # as the asker reads it: piece by piece within the stall timeout, all of it within its size at
                # the goodput floor (what we send is not measured), never less than the exchange deadline
                frames, nbytes = answer
                async with asyncio.timeout(max(self._settings.exchange_timeout_s, pace.whole_s(nbytes))):
                    await stream.send(frames, stall_s=pace.stall_timeout_s)
                self.stats.served += 1
        except WireError as exc:
            stream.count_refused(exc)
            reason = exc.kind
            await stream.try_reject(lambda: self._frames({}, REJECT, {"error": reason}, get_codec("fp32")),
                                    min(1.0, self._settings.exchange_timeout_s))
        except (TimeoutError, ConnectionError) as exc:
            self.stats.errors["timeout" if isinstance(exc, TimeoutError) else "disconnected"] += 1
            logger.info("expert fetch from %s abandoned: %s", peer, exc or type(exc).__name__)
            return
        # the asker hangs up once it has read the answer (see MessageStream.linger)
        await stream.linger(self._settings.exchange_timeout_s)

    def _may_serve(self, peer: str, key: ExpertKey, version: int) -> bool:
        last = self._served.get((peer, key))
        times = last[1] if last is not None and last[0] == version else 0
        if times >= self._settings.incoming.fetches_per_version:
            return False
        self._served.put((peer, key), (version, times + 1))
        return True

    def _frames(self, tensors: Mapping[str, np.ndarray], kind: str, meta: Mapping[str, MetaValue],
                codec: Codec) -> Frames:
        # encoded whole before a byte is written: an expert copy that fails its check is refused as such
        fields: HeaderFields = {"swarm": self._settings.swarm, "config_hash": self._settings.config_hash,
                                "sender": self._transport.peer_id, "round": 0, "step": self._step(), "kind": kind}
        proof = self._settings.admission.credentials(fields)
        return encode_message(tensors, codec, meta={**meta, **proof}, limits=self._settings.limits, **fields)


def _limits_for(like: Mapping[str, np.ndarray]) -> WireLimits:
    elements = sum(a.size for a in like.values())
    return replace(DEFAULT_LIMITS, max_tensors=max(1, len(like)), max_payload_bytes=8 * elements + 1024,
                   max_decoded_bytes=4 * elements + 1024)
