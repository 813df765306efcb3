"""Swarm membership over hivemind's DHT: this peer's record, the swarm's founder-signed config, and the view of
the peers it admits.

The service keeps this peer's signed, expiring record alive, keeps the config (and watches for newer versions
of it), and holds the membership view (admitted peers of this config, sorted by id), telling its subscribers
when the set of peers changes. The records are node.net.records, the config envelope node.net.founder, the
rules every DHT value is held to node.net.validation.

Runs hivemind's asyncio `DHTNode` in the node's own event loop on the node's `P2P` (one daemon, one
identity). `hivemind.DHT` would instead fork a process that replicates the daemon connection and
answers every call through a pipe; `DHTNode` needs neither and every call is a plain awaitable that
`asyncio.timeout` can bound.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import importlib.metadata
import logging
import math
import random
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P
from hivemind.utils.timed_storage import get_dht_time

from node.net.admission import Admission
from node.net.dht_guard import StoreGuard
from node.net.founder import ConfigRefused, NotAdmitted, SwarmConfig, verify_config
from node.net.hivemind_adapter import FindWatch, guard_dht_node
from node.net.identity import Identity
from node.net.records import (
    MAX_MADDRS,
    MAX_TOKEN_RATE,
    MAX_UPTIME_S,
    BadAddress,
    DiscoveryError,
    PeerRecord,
    ShardedKey,
    SwarmConfigInvalid,
    config_key,
    decode_peer_entry,
    encode_peer_record,
    encode_withdrawal,
    experts_key,
    membership_shards,
    owner_peer_id,
    peers_key,
    validate_swarm_name,
)
from node.net.supervise import counter_of, supervise
from node.net.validation import (
    CONFIG_TTL_S,
    MAX_HEARTBEAT_S,
    MAX_RECORD_TTL_S,
    RECORD_TTL_HEARTBEATS,
    RefusalCounts,
    SwarmMembership,
    make_record_validator,
)
from node.net.view import MAX_VIEW, FirstSeen, cap_view
from node.net.work import cached_work, check_work, identity_work_bits
from node.swarm.contributors import MAX_TOKENS, plausible_tokens, tokens_per_step
from node.swarm.joining import plausible_steps
from node.swarm.recipe import RecipeInvalid, SwarmSettings, parse_document

logger = logging.getLogger(__name__)

# hivemind answers a find over p2pd, whose messages stop at 4 MiB: a key whose value outgrows it is found by
# no one. A shard past half of it is warned of, before it grows unreadable.
DHT_RESPONSE_BYTES = 4 << 20
SHARD_WARN_BYTES = DHT_RESPONSE_BYTES // 2
# Every node reads the whole membership (every shard), and hivemind stores what a read found back once: at
# 1000 peers a read is ~1.4 MB, 11 Mbit/s each way every half of a 2 s heartbeat. Background reads are
# spaced so they cost at most about this much each way (the next read waits the last one's size over it:
# the read comes in, its store-back goes out): a swarm of up to ~90 peers reads every half heartbeat as
# before, one of 1000 every ~11 s. A bigger view is a staler one (joiners appear, the departed go, a little
# later); reads asked for (an unknown peer's stream, node.net.membership) are not spaced by it.
MEMBERSHIP_BUDGET_MBIT_S = 1.0

__all__ = [
    "BootstrapFailed",
    "ConfigRead",
    "Discovery",
    "DiscoveryError",
    "DiscoverySettings",
    "OwnedValues",
    "SwarmConfig",
    "SwarmConfigInvalid",
    "experts_key",
    "validate_swarm_name",
]


class BootstrapFailed(DiscoveryError):
    """None of the initial peers answered."""


@dataclass(frozen=True)
class ConfigRead:
    """What one read of `<swarm>.config` found: the latest config of the founder (or None), whether the
    read itself failed (a DHT timeout or error: not the same as a swarm without a config), the
    founders whose valid configs were there, and the values refused, by reason."""

    config: SwarmConfig | None
    failed: str | None = None  # why the DHT read failed; None when it answered (even with nothing)
    founders: frozenset[str] = frozenset()
    refused: Mapping[str, int] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class OwnedValues:
    """What one read of a per-peer key found (Discovery.read_owned): each member's value, and the shards
    whose read failed (their peers' values are unknown, not gone)."""

    values: Mapping[str, bytes]
    failed: frozenset[int] = frozenset()


def read_interval_s(read_bytes: int, refresh_s: float, budget_mbit_s: float) -> float:
    """How long background reads of a view of `read_bytes` wait between two: `refresh_s`, or longer where
    reading it every `refresh_s` would cost more than `budget_mbit_s` each way (a read comes in, and
    hivemind stores it back out once: its size each way)."""
    return max(refresh_s, read_bytes * 8 / (budget_mbit_s * 1e6))


def _entries_bytes(entries: Mapping[Any, Any]) -> int:
    """What a read of one DHT key moved, about: its entries' values and subkeys (owner keys)."""
    return sum(len(item.value) + (len(subkey) if isinstance(subkey, bytes) else 0)
               for subkey, item in entries.items() if isinstance(item.value, bytes))


def _software_version() -> str:
    try:
        return importlib.metadata.version("murmur")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


@dataclass(frozen=True)
class DiscoverySettings:
    swarm: str
    heartbeat_s: float = 2.0
    ttl_heartbeats: int = RECORD_TTL_HEARTBEATS  # a record outlives its heartbeat by this many periods
    view_refresh_s: float | None = None  # how often the view is re-read; default half a heartbeat
    # what the background reads of the view may cost each way (MEMBERSHIP_BUDGET_MBIT_S): a big swarm's
    # view is read less often than every refresh_s
    membership_budget_mbit_s: float = MEMBERSHIP_BUDGET_MBIT_S
    rpc_timeout_s: float = 2.0  # one DHT RPC to one peer
    request_timeout_s: float = 5.0  # one whole DHT store/get (several RPCs)
    bootstrap_timeout_s: float = 10.0
    config_ttl_s: float = CONFIG_TTL_S
    config_check_s: float | None = None  # how often a joiner looks for a newer config; default 5 heartbeats
    version: str = dataclasses.field(default_factory=_software_version)
    max_view: int = MAX_VIEW  # peers in the view at most, this one included (node.net.view)

    def __post_init__(self) -> None:
        validate_swarm_name(self.swarm)
        if not 0 < self.heartbeat_s <= MAX_HEARTBEAT_S or self.ttl_heartbeats < 1:
            raise ValueError(f"heartbeat_s must be in (0, {MAX_HEARTBEAT_S:g}] and ttl_heartbeats at least 1")
        if self.ttl_s > MAX_RECORD_TTL_S:
            raise ValueError(f"a record's time to live ({self.ttl_s:g} s) must be at most {MAX_RECORD_TTL_S:g} s, "
                             "what the swarm's validators accept")
        if self.max_view < 2:
            raise ValueError("max_view must be at least 2")

    @property
    def ttl_s(self) -> float:
        return self.heartbeat_s * self.ttl_heartbeats

    @property
    def refresh_s(self) -> float:
        return self.view_refresh_s if self.view_refresh_s is not None else self.heartbeat_s / 2

    @property
    def check_config_s(self) -> float:
        return self.config_check_s if self.config_check_s is not None else max(2.0, 5 * self.heartbeat_s)


class Discovery:
    """This peer's presence in the swarm and its view of the others.

    Usage: `await d.start()` (or `async with d:`), then `d.view()` / `async for view in d.changes()`,
    `d.update(step=..., round=...)` as training advances, and `await d.close()` to withdraw. A node of
    a real swarm starts with `start(publish=False)`, reads or publishes the signed config, and then
    `enter()`s the swarm with it: only then does it publish its record (with its membership proof).
    The caller owns `p2p` and shuts it down after `close()`. `initial_peers` must also have been given
    to the daemon (P2PSettings.initial_peers) so it knows where they are.
    """

    def __init__(
        self,
        p2p: P2P,
        identity: Identity,
        settings: DiscoverySettings,
        *,
        initial_peers: Sequence[str] = (),
        capacity: int = 0,
        experts: Sequence[int] = (),
        data_maddrs: Sequence[str] = (),
    ) -> None:
        # `data_maddrs`: where peers open gossip streams to this node, if not through this p2pd. The
        # py-libp2p backend runs its host under the node's identity, and p2pd, which then carries only
        # the DHT, under a key of its own: two hosts with one peer id would each get the other's
        # dials (see docs/architecture.md, "Data-plane backends").
        suffix = f"/p2p/{identity.peer_id}"
        if any(not addr.endswith(suffix) for addr in data_maddrs) or len(data_maddrs) > MAX_MADDRS:
            raise ValueError(f"data-plane maddrs must be at most {MAX_MADDRS} multiaddrs ending in {suffix}")
        if not data_maddrs and p2p.peer_id.to_base58() != identity.peer_id:
            raise ValueError("the P2P daemon was not started with this identity")
        self._data_maddrs = tuple(data_maddrs)
        self._dht_maddrs: tuple[str, ...] = ()
        self._p2p = p2p
        self._identity = identity
        self._settings = settings
        self._initial_peers = tuple(initial_peers)
        signer = RSASignatureValidator(identity.signing_key)
        self._membership = SwarmMembership()
        self.refused = RefusalCounts()  # DHT values the validators refused, by reason
        self._validator = make_record_validator(signer, settings.swarm, self._membership, self.refused)
        # This peer's subkey in `<swarm>.peers`: its public key, so only its signature is accepted there.
        self._owner_subkey = signer.local_public_key
        self._local = PeerRecord(
            peer_id=identity.peer_id,
            maddrs=(),
            step=0,
            round=0,
            experts=tuple(experts),
            capacity=capacity,
            version=settings.version,
            heartbeat=0.0,
        )
        self._dht: DHTNode | None = None
        self._guard: StoreGuard | None = None  # answers the DHT's store and find RPCs (node.net.dht_guard)
        self._finds: FindWatch | None = None  # tells an unanswered DHT read from an empty one (made at the first)
        self._runner: asyncio.Task[None] | None = None
        self._last_expiration = -math.inf
        self._view: tuple[PeerRecord, ...] = ()
        self._changed = asyncio.Event()
        self._closed = False
        self._config: SwarmConfig | None = None
        self._config_refreshed_at = -math.inf
        self._admission = Admission.open(settings.swarm)
        self._watch_config = False
        self._newer_config = asyncio.Event()
        self.latest_config: SwarmConfig | None = None  # the newest of the founder's configs seen
        self._errors: collections.Counter[str] = collections.Counter()
        self.view_overflow = 0  # live records left out of the view by its cap at the last refresh
        self._refreshing: asyncio.Task[None] | None = None  # a read of the view started by read_after
        self._refreshed_at = -math.inf  # loop time the latest read of the view began
        self._last_read_began = -math.inf  # ... of the latest read that has ended
        self._read_done = asyncio.Condition()  # notified as each read ends
        self._started = time.monotonic()  # the record's uptime_s counts from here
        self._tokens_per_step = 0  # the recipe's, once entered: the most tokens a step may claim
        self._epoch: float | None = None  # the swarm's founding time, once entered: bounds the steps claimed
        self._step_budget = 0  # the recipe's steps (0: no budget), once entered: bounds them too
        self._work_bits = 0  # the proof of work (leading zero bits) a record must carry, once entered
        self._shard_full_warned: set[str] = set()  # keys whose size was warned of (once each)
        self._last_read_bytes = 0  # what the last read of the view found, every shard (spaces the reads)
        self._seen: dict[str, FirstSeen] = {}  # each live record's first sighting (node.net.view)
        self._view_rng = random.Random()  # draws the newcomers the view's cap admits, unlike any other node's

    @property
    def peer_id(self) -> str:
        return self._identity.peer_id

    @property
    def shards(self) -> int:
        """How many DHT keys this swarm's per-peer keys are each split over (one until entered)."""
        return self._membership.shards or 1

    @property
    def _peers_key(self) -> ShardedKey:
        """`<swarm>.peers`, split over the recipe's shards once entered."""
        return self.sharded(peers_key(self._settings.swarm))

    def sharded(self, base: str) -> ShardedKey:
        """A per-peer key of this swarm split as its config says (one shard until entered)."""
        return ShardedKey(base, self.shards)

    @property
    def local_record(self) -> PeerRecord:
        return self._local

    @property
    def dht_maddrs(self) -> tuple[str, ...]:
        """Where others reach this node's DHT (what `murmur join --peers` takes); set by `start()`."""
        return self._dht_maddrs

    @property
    def errors(self) -> dict[str, int]:
        """Counts of failed DHT operations and rejected records, by kind (`dht_refused_<reason>`: values
        the validators refused)."""
        errors = dict(self._errors)
        for reason, n in self.refused.counts.items():
            errors[f"dht_refused_{reason}"] = n
        return errors

    @property
    def config(self) -> SwarmConfig | None:
        return self._config

    async def start(self, *, publish: bool = True) -> None:
        """Join the DHT; with `publish`, also publish this peer and read the swarm once, then heartbeat in
        the background (else `enter()` does that once the swarm's config is known).

        Raises BootstrapFailed if the DHT cannot be joined. On failure the caller should shut the
        daemon down: a cancelled DHT start may leave its handlers registered there.
        """
        if self._dht is not None or self._closed:
            raise RuntimeError("Discovery can be started once")
        try:
            async with asyncio.timeout(self._settings.bootstrap_timeout_s):
                self._dht = await DHTNode.create(
                    p2p=self._p2p,
                    initial_peers=list(self._initial_peers) or None,
                    record_validator=self._validator,
                    wait_timeout=self._settings.rpc_timeout_s,
                    bootstrap_timeout=self._settings.rpc_timeout_s,
                )
                self._guard = await guard_dht_node(self._dht, self.refused)
                maddrs = tuple(str(addr) for addr in await self._p2p.get_visible_maddrs())
        except TimeoutError:
            await self._shutdown_dht()
            raise BootstrapFailed(
                f"the DHT did not start within {self._settings.bootstrap_timeout_s:g} s "
                f"(initial peers: {', '.join(self._initial_peers) or 'none'})"
            ) from None
        except RuntimeError as exc:  # DHTNode's "bootstrap failed: none of the initial_peers responded"
            await self._shutdown_dht()
            raise BootstrapFailed(f"{exc} (initial peers: {', '.join(self._initial_peers)})") from None
        self._dht_maddrs = maddrs
        self._local = msgspec.structs.replace(self._local, maddrs=self._data_maddrs or maddrs)
        if publish:
            await self._begin()

    async def _begin(self) -> None:
        # Publish and read once before returning, so the caller starts with itself and its peers in view.
        await self._publish_record()
        await self._refresh_view()
        self._runner = asyncio.create_task(self._run(), name=f"discovery-{self._settings.swarm}")

    def pin_founder(self, founder: str) -> None:
        """Accept `<swarm>.config` values of this founder only (the validators refuse the others)."""
        self._membership.founder = founder

    async def enter(self, config: SwarmConfig, admission: Admission, *, watch_config: bool = False) -> None:
        """Take part in the swarm under `config`: publish this peer's record (carrying the config hash and
        its membership proof), keep the config stored, admit to the view only peers of this config that
        `admission` admits, and with `watch_config`, watch for a newer version of the founder's config
        (`newer_config()`)."""
        if self._dht is None or self._closed or self._runner is not None:
            raise RuntimeError("Discovery.enter() follows start(publish=False), once")
        self._config, self.latest_config, self._admission = config, config, admission
        self._membership.founder = config.founder or self._membership.founder
        self._membership.admission = admission
        self._watch_config = watch_config
        self._local = msgspec.structs.replace(self._local, config_hash=config.config_hash)
        try:
            settings = SwarmSettings.from_doc(config.config)
            self._tokens_per_step = tokens_per_step(settings.training)
            self._epoch = settings.clock.epoch
            self._step_budget = settings.training.steps if settings.training is not None else 0
        except (RecipeInvalid, ValueError):  # a config this node runs has parsed before; never 0 tokens for it
            self._tokens_per_step = 0
        self._work_bits = identity_work_bits(config.config) if admission.is_open else 0
        self._membership.shards = membership_shards(config.config)
        if self._work_bits:
            # minted once per identity and kept beside it (node.net.work); CPU-bound, so in a thread
            nonce = await asyncio.to_thread(cached_work, self._identity.path, self._settings.swarm, self.peer_id,
                                            self._work_bits)
            self._local = msgspec.structs.replace(self._local, work=nonce)
        if config.signed and self._config_refreshed_at == -math.inf:  # a founder has just stored it
            await self._store_config(config)
        await self._begin()

    async def newer_config(self) -> SwarmConfig:
        """Wait until a version of the founder's config newer than the one entered with, and than any
        this returned before, is seen (each version wakes a waiter once)."""
        await self._newer_config.wait()
        self._newer_config.clear()
        assert self.latest_config is not None
        return self.latest_config

    def saw_config(self, found: SwarmConfig) -> None:
        """A config of the founder read from the DHT: wake `newer_config` if it is newer than any seen."""
        if self.latest_config is not None and found.version > self.latest_config.version:  # entered with one
            self.latest_config = found
            self._newer_config.set()

    async def close(self) -> None:
        """Stop heartbeats, withdraw this peer's record, and stop the DHT node (not the daemon)."""
        if self._closed:
            return
        self._closed = True
        if self._refreshing is not None:
            self._refreshing.cancel()
        if self._runner is not None:
            self._runner.cancel()
            try:
                await self._runner
            except asyncio.CancelledError:
                pass
            except Exception:  # the loops count their own failures; anything here is a bug
                logger.exception("discovery's background task failed")
        if self._dht is not None:
            await self._withdraw()
            await self._shutdown_dht()
        self._changed.set()  # wake subscribers so they see the end

    async def _shutdown_dht(self) -> None:
        if self._guard is not None:
            self._guard.close()
        if self._dht is None:
            return
        try:
            async with asyncio.timeout(self._settings.request_timeout_s):
                await self._dht.shutdown()
        except TimeoutError:
            logger.warning("DHT node did not shut down within %g s", self._settings.request_timeout_s)

    async def __aenter__(self) -> Discovery:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ---- this peer ------------------------------------------------------------------------

    def update(
        self,
        *,
        step: int | None = None,
        round: int | None = None,
        experts: Sequence[int] | None = None,
        capacity: int | None = None,
        gossip_from: int | None = None,
        loss: float | None = None,
        tokens: int | None = None,
        tokens_per_s: float | None = None,
        reach: str | None = None,
    ) -> None:
        """Change what the next heartbeat publishes about this peer. Call from the event loop's thread."""
        changes: dict[str, Any] = {}
        if tokens is not None:
            changes["tokens"] = max(0, min(int(tokens), MAX_TOKENS))
        if tokens_per_s is not None and math.isfinite(tokens_per_s):
            changes["tokens_per_s"] = max(0.0, min(float(tokens_per_s), MAX_TOKEN_RATE))
        if reach is not None:
            changes["reach"] = reach
        if loss is not None and math.isfinite(loss):
            changes["loss"] = float(loss)
        if gossip_from is not None:
            changes["gossip_from"] = gossip_from
        if step is not None:
            changes["step"] = step
        if round is not None:
            changes["round"] = round
        if experts is not None:
            changes["experts"] = tuple(experts)
        if capacity is not None:
            changes["capacity"] = capacity
        self._local = msgspec.structs.replace(self._local, **changes)

    def set_maddrs(self, maddrs: Sequence[str]) -> None:
        """Change the addresses the next heartbeat publishes (node.net.relays: a relay's circuit came or
        went). Each must end in this peer's /p2p/ id; at most MAX_MADDRS are kept, in order."""
        suffix = f"/p2p/{self.peer_id}"
        kept = tuple(addr for addr in maddrs if addr.endswith(suffix))[:MAX_MADDRS]
        if kept:
            self._local = msgspec.structs.replace(self._local, maddrs=kept)

    # ---- membership ---------------------------------------------------------------------------

    def view(self) -> tuple[PeerRecord, ...]:
        """Live peers (this one included), sorted by peer id."""
        return self._view

    async def changes(self) -> AsyncIterator[tuple[PeerRecord, ...]]:
        """Yield the current view, then each view whose set of peers differs from the previous one.

        Ends when discovery closes. A slow consumer skips intermediate views, never the latest.
        """
        while not self._closed:
            changed = self._changed  # taken before yielding, so a change during the yield is not missed
            yield self._view
            await changed.wait()

    # ---- swarm config ----------------------------------------------------------------------

    async def publish_config(self, config: SwarmConfig) -> SwarmConfig:
        """Store the founder's signed config (in this peer's subkey); every member stores it again in its
        own, so the swarm outlives its founder. Raises DiscoveryError if no DHT peer stored it."""
        if not await self._store_config(config):
            raise DiscoveryError("the swarm config could not be stored in the DHT")
        return config

    async def read_config(self, founder: str | None) -> ConfigRead:
        """The latest config of `founder` (of any founder, when None and only one is there) under
        `<swarm>.config`, checked (signature, swarm, recipe bounds); values that fail are counted
        (`config_refused_<reason>`) and skipped. `failed` says why, when the DHT read itself failed."""
        entries, failure = await self._read_entries(config_key(self._settings.swarm), "reading the swarm config")
        if entries is None:
            self._errors["config_read_failed"] += 1
            return ConfigRead(None, failed=failure or "the DHT did not answer")
        refused: collections.Counter[str] = collections.Counter()
        valid: list[SwarmConfig] = []
        now = get_dht_time()
        for item in entries.values():
            if item.expiration_time <= now:
                continue
            try:
                config = verify_config(item.value, self._settings.swarm, founder)
                parse_document(config.config)
            except ConfigRefused as exc:
                refused[str(exc.reason)] += 1
                continue
            except RecipeInvalid:
                refused["bad_recipe"] += 1
                continue
            valid.append(config)
        for reason, n in refused.items():
            self._errors[f"config_refused_{reason}"] += n
        founders = frozenset(c.founder for c in valid)
        if not valid or (founder is None and len(founders) > 1):
            return ConfigRead(None, founders=founders, refused=dict(refused))
        latest = max(valid, key=lambda c: (c.version, c.config_hash))
        return ConfigRead(latest, founders=founders, refused=dict(refused))

    # ---- other per-peer keys (SPES's `<swarm>.experts`) ---------------------------------------

    async def store_own(self, key: str, value: bytes, ttl_s: float, *, what: str) -> None:
        """Store `value` under `key` in this peer's signed subkey (its public key: only this peer's
        signature is accepted there), expiring after `ttl_s`. A failure is counted and logged."""
        await self._store_entry(self._require_started(), key, value, get_dht_time() + ttl_s, what=what)

    async def read_owned(self, key: ShardedKey, *, what: str) -> OwnedValues | None:
        """The live values under every shard of `key`, by the peer whose signed subkey holds each, of the
        peers in the membership view only (a value of any other owner, or under a subkey naming no single
        owner, is counted and skipped), and the shards whose read failed; None when every read failed.

        Any DHT node may store a value it signed under any key, so a value says nothing of its owner's
        membership: in an open swarm as in a key or allowlist one, only an owner whose peer record the
        view holds (valid, admitted, with the swarm's proof of work) speaks for the swarm here (SPES's
        `<swarm>.experts`: no record-less identity owns an expert)."""
        shards = await self._read_shards(key, f"reading the swarm's {what}")
        failed = frozenset(shard for shard, entries in shards.items() if entries is None)
        if len(failed) == len(shards):
            return None
        now, out = get_dht_time(), {}
        members = {record.peer_id for record in self._view}
        for subkey, item in ((k, v) for entries in shards.values() if entries is not None for k, v in entries.items()):
            if item.expiration_time <= now:
                continue
            owner = owner_peer_id(subkey) if isinstance(subkey, bytes) else None
            if owner is None or not isinstance(item.value, bytes):
                self._errors[f"{what.replace(' ', '_')}_invalid"] += 1
                continue
            if owner not in members:
                self._errors[f"{what.replace(' ', '_')}_not_member"] += 1
                continue
            out[owner] = item.value
        return OwnedValues(out, failed)

    # ---- internals -------------------------------------------------------------------------

    def _require_started(self) -> DHTNode:
        if self._dht is None or self._closed:
            raise RuntimeError("Discovery is not running")
        return self._dht

    async def _run(self) -> None:
        # Each loop is supervised (node.net.supervise): a bug or a stray error in one is logged, counted
        # as background_task_failed and restarted after a backoff, and never ends the others.
        count = counter_of(self._errors)
        async with asyncio.TaskGroup() as group:
            group.create_task(supervise("discovery heartbeat", self._heartbeat_loop, count))
            group.create_task(supervise("discovery view reads", self._watch_loop, count))
            if self._watch_config:
                group.create_task(supervise("config watch", self._config_watch_loop, count))

    async def _heartbeat_loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_beat = loop.time()
        while True:
            next_beat += self._settings.heartbeat_s
            await asyncio.sleep(max(0.0, next_beat - loop.time()))
            await self._publish_record()
            if self._config is not None and loop.time() - self._config_refreshed_at > self._settings.config_ttl_s / 4:
                await self._store_config(self._config)

    async def _watch_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.read_interval_s())
            await self._refresh_view()

    def read_interval_s(self) -> float:
        """How long the background reads of the view wait between two, by the last read's size
        (`read_interval_s`)."""
        return read_interval_s(self._last_read_bytes, self._settings.refresh_s, self._settings.membership_budget_mbit_s)

    async def _config_watch_loop(self) -> None:
        current = self._config
        assert current is not None
        while True:
            await asyncio.sleep(self._settings.check_config_s)
            found = (await self.read_config(current.founder or None)).config
            if found is not None:
                self.saw_config(found)

    async def _publish_record(self) -> None:
        dht = self._require_started()
        now = get_dht_time()
        self._local = msgspec.structs.replace(self._local, heartbeat=now,
                                              credential=self._admission.record_credential(self.peer_id, now),
                                              uptime_s=min(time.monotonic() - self._started, MAX_UPTIME_S))
        expiration = now + self._settings.ttl_s
        # Remember before storing: a store that times out may still have reached some replicas,
        # and the withdrawal must outrank every record that might be out there.
        self._last_expiration = max(self._last_expiration, expiration)
        await self._store_entry(dht, self._peers_key.key_of(self.peer_id), encode_peer_record(self._local), expiration,
                                what="peer record")

    async def _withdraw(self) -> None:
        assert self._dht is not None
        now = get_dht_time()
        # A newer expiration than our last record's makes the tombstone win everywhere; it is only
        # needed until that record would have expired anyway.
        expiration = max(self._last_expiration + 1e-3, now + 1.0)
        await self._store_entry(self._dht, self._peers_key.key_of(self.peer_id), encode_withdrawal(self.peer_id),
                                expiration, what="withdrawal")

    async def _store_entry(self, dht: DHTNode, key: str, value: bytes, expiration: float, *, what: str) -> None:
        """Store `value` under `key` in this peer's signed subkey; a failure is counted and logged."""
        async with self._counting_failures("dht_store", f"storing this peer's {what}"):
            stored = await dht.store(key, value, expiration, subkey=self._owner_subkey)
            if not stored:
                self._errors["dht_store_rejected"] += 1
                logger.warning("no DHT peer accepted this peer's %s", what)

    async def _store_config(self, config: SwarmConfig) -> bool:
        """Store the signed config in this peer's subkey (the founder's signature is inside the value)."""
        dht = self._require_started()
        self._config_refreshed_at = asyncio.get_running_loop().time()
        stored = False
        async with self._counting_failures("dht_store", "storing the swarm config"):
            expiration = get_dht_time() + self._settings.config_ttl_s
            stored = bool(await dht.store(config_key(self._settings.swarm), config.signed, expiration,
                                          subkey=self._owner_subkey))
            if not stored:
                self._errors["dht_store_rejected"] += 1
                logger.warning("no DHT peer accepted the swarm config")
        return stored

    @contextlib.asynccontextmanager
    async def _counting_failures(self, kind: str, doing: str) -> AsyncIterator[None]:
        """Bound a DHT call by the request timeout; count and log its failure instead of raising,
        so one bad round of the DHT does not stop heartbeats."""
        try:
            async with asyncio.timeout(self._settings.request_timeout_s):
                yield
        except TimeoutError:
            self._errors[f"{kind}_timeout"] += 1
            logger.warning("%s in the DHT timed out", doing)
        except Exception as exc:
            self._errors[f"{kind}_failed"] += 1
            logger.warning("%s in the DHT failed: %s", doing, exc)

    async def _read_entries(self, key: str, doing: str) -> tuple[dict[Any, Any] | None, str | None]:
        """The subkey entries under `key` (empty when there are none), or None and why the read failed (counted):
        it timed out, raised, or found nothing after asking peers of which none answered (hivemind reports
        that as nothing found; node.net.hivemind_adapter.FindWatch tells them apart)."""
        if self._closed or self._dht is None:
            return None, "discovery is closed"  # a read that began as the node stopped: nothing to count
        dht = self._dht
        if self._finds is None or self._finds.node is not dht:
            self._finds = FindWatch(dht)
        entries = None
        failure: str | None = None
        try:
            async with asyncio.timeout(self._settings.request_timeout_s):
                found, answered = await self._finds.get_latest(key)
            if answered:
                entries = found.value if found is not None and isinstance(found.value, dict) else {}
            else:
                self._errors["dht_get_unanswered"] += 1
                failure = "no DHT peer answered"
                logger.warning("%s in the DHT failed: no DHT peer answered", doing)
        except TimeoutError:
            self._errors["dht_get_timeout"] += 1
            failure = f"timed out after {self._settings.request_timeout_s:g} s"
            logger.warning("%s in the DHT timed out", doing)
        except Exception as exc:
            self._errors["dht_get_failed"] += 1
            failure = f"failed: {exc}"
            logger.warning("%s in the DHT failed: %s", doing, exc)
        return entries, failure

    async def _read_shards(self, key: ShardedKey, doing: str) -> dict[int, dict[Any, Any] | None]:
        """Every shard of `key`, read at once: its subkey entries, or None where its read failed (counted).
        A shard that nears what a DHT node can answer is warned of once: the founder should split the key
        further (`--membership-shards`) before it grows unreadable."""
        try:
            async with asyncio.TaskGroup() as group:
                reads = {shard: group.create_task(self._read_entries(key.key(shard), doing))
                         for shard in range(key.shards)}
        except BaseExceptionGroup as failed:
            # _read_entries counts its failures and raises none; should one escape as the node stops, the
            # stop wins (a TaskGroup gives its tasks' errors priority over a cancel of its own task): the
            # loop reading the view must end, not count one more failed read and retry for ever.
            if self._closed:
                raise asyncio.CancelledError from None
            raise failed.exceptions[0] from None
        shards = {shard: read.result()[0] for shard, read in reads.items()}
        for shard, entries in shards.items():
            if entries is None or key.key(shard) in self._shard_full_warned:
                continue
            size = _entries_bytes(entries)
            if size > SHARD_WARN_BYTES:
                self._shard_full_warned.add(key.key(shard))
                self._errors["dht_shard_near_limit"] += 1
                logger.warning("the DHT key %s holds %.1f MiB of the %d MiB a DHT node answers: the swarm needs more "
                               "--membership-shards (now %d) before it grows unreadable", key.key(shard),
                               size / 2**20, DHT_RESPONSE_BYTES >> 20, key.shards)
        return shards

    async def read_after(self, since: float, min_interval_s: float) -> None:
        """Return once a read of the view that began at or after loop time `since` has ended (the
        background reads count); start one if none is running and none began in the last
        `min_interval_s`. Concurrent callers share the reads (an unknown peer's stream asks this,
        node.net.membership)."""
        loop = asyncio.get_running_loop()
        while not self._closed and self._dht is not None and self._last_read_began < since:
            if self._refreshing is None or self._refreshing.done():
                wait = self._refreshed_at + min_interval_s - loop.time()
                if wait <= 0:
                    self._refreshing = asyncio.create_task(self._refresh_view(), name="discovery view read")
                else:
                    async with self._read_done:
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(wait):
                                await self._read_done.wait()
                    continue
            await asyncio.shield(self._refreshing)

    async def _refresh_view(self) -> None:
        began = self._refreshed_at = asyncio.get_running_loop().time()
        try:
            await self._read_view()
        except Exception as exc:  # keep the last view; a read asked for by a stream's gate must not raise either
            if self._closed:  # cut short by close (hivemind can swallow the cancel, then find the DHT gone)
                return
            self._errors["view_read_failed"] += 1
            logger.error("reading the swarm's view failed (%s: %s); keeping the last view", type(exc).__name__, exc)
        finally:
            self._last_read_began = max(self._last_read_began, began)
            async with self._read_done:
                self._read_done.notify_all()

    async def _read_view(self) -> None:
        shards = await self._read_shards(self._peers_key, "reading the swarm's peers")
        failed = {shard for shard, entries in shards.items() if entries is None}
        if len(failed) == len(shards):
            return  # keep the last view rather than report everyone gone after one failed read
        self._last_read_bytes = sum(_entries_bytes(entries) for entries in shards.values() if entries is not None)
        # A shard whose read failed keeps its peers of the last view, as an unsharded key keeps them all.
        records = {r.peer_id: r for r in self._view if self._peers_key.shard_of(r.peer_id) in failed}
        records[self.peer_id] = self._local
        now = get_dht_time()
        for subkey, item in ((k, v) for entries in shards.values() if entries is not None for k, v in entries.items()):
            record = self._live_record(subkey, item.value, item.expiration_time, now)
            if record is not None and record.peer_id != self.peer_id:
                records[record.peer_id] = record
        at = asyncio.get_running_loop().time()
        # every live record's first sighting (bounded by what the read returned), in the view or not
        self._seen = {p: self._seen.get(p) or FirstSeen(at, r.step, r.round) for p, r in records.items()}
        records, left_out = cap_view(records, self.peer_id, {r.peer_id for r in self._view}, self._seen,
                                     self._settings.max_view, self._settings.swarm, self._view_rng)
        if left_out and not self.view_overflow:
            logger.warning("%d live peer records left out of the view: it holds at most %d peers", left_out,
                           self._settings.max_view)
        self.view_overflow = left_out
        self._set_view(tuple(records[peer_id] for peer_id in sorted(records)))

    def _live_record(self, subkey: object, value: object, expiration: float, now: float) -> PeerRecord | None:
        if expiration <= now:
            return None
        if not isinstance(subkey, bytes) or not isinstance(value, bytes):
            self._errors["peer_record_invalid"] += 1
            return None
        try:
            entry = decode_peer_entry(value)
        except BadAddress as exc:
            self._errors["peer_record_bad_address"] += 1
            logger.debug("ignoring a peer record with a bad address: %s", exc)
            return None
        except ValueError as exc:
            self._errors["peer_record_invalid"] += 1
            logger.debug("ignoring a malformed peer record: %s", exc)
            return None
        # The validator checked this when the record arrived; checked again as it is cheap.
        if entry.peer_id != owner_peer_id(subkey):
            self._errors["peer_record_invalid"] += 1
            return None
        if not isinstance(entry, PeerRecord):
            return None
        # tokens are held to the steps claimed, and those to what the swarm can have run since its founding
        steps = min(entry.step, plausible_steps(self._epoch, now)) if self._epoch is not None else entry.step
        steps = min(steps, self._step_budget) if self._step_budget > 0 else steps
        tokens = plausible_tokens(entry.tokens, steps, self._tokens_per_step)
        if tokens != entry.tokens:
            # more than its steps could have processed (or any, in a swarm without a model): clipped
            self._errors["peer_record_tokens_clipped"] += 1
            entry = msgspec.structs.replace(entry, tokens=tokens)
        own_hash = self._local.config_hash
        if own_hash and entry.config_hash != own_hash:
            self._errors["peer_record_other_config"] += 1  # a peer of another config (or founder) of this name
            return None
        if self._work_bits and not check_work(self._settings.swarm, entry.peer_id, entry.work, self._work_bits):
            self._errors["peer_record_no_work"] += 1  # an identity that did not pay the swarm's proof of work
            return None
        if not self._admission.is_open:
            try:
                self._admission.check_record(entry.peer_id, entry.heartbeat, entry.credential)
            except NotAdmitted:
                self._errors["peer_record_not_member"] += 1
                return None
        return entry

    def _set_view(self, view: tuple[PeerRecord, ...]) -> None:
        membership_changed = [r.peer_id for r in view] != [r.peer_id for r in self._view]
        self._view = view
        if membership_changed:
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()

