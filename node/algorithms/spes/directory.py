"""SPES's expert directory over the DHT: each peer's expert records under `<swarm>.experts` (split over the
swarm's shards as `<swarm>.peers` is), one signed, expiring subkey per peer, batched to the heartbeat.

`SpesNode` publishes after every sync and reads before every refresh; the DHT is written at most
every half heartbeat (and at least every heartbeat, so the record outlives no peer by more than
its time to live) and read at most every half heartbeat: a record lags by up to a heartbeat, which
SpesNode tolerates (a copy still old is refreshed at the next sync).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Mapping

from gossip.spes import ExpertKey, ExpertRecord, RecordsByPeer
from node.net.discovery import Discovery
from node.net.records import decode_expert_records, encode_expert_records, experts_key

logger = logging.getLogger(__name__)

class DhtExpertDirectory:
    """`node.algorithms.spes.node.ExpertDirectory` over a running `Discovery`. `run()` (inside the training's task
    group) keeps this peer's records stored; `publish`/`read` never wait on the DHT for long."""

    def __init__(self, discovery: Discovery, swarm: str, heartbeat_s: float, ttl_s: float) -> None:
        self._discovery = discovery
        self._base = experts_key(swarm)
        self._heartbeat_s = heartbeat_s
        self._ttl_s = ttl_s
        self._mine: dict[ExpertKey, ExpertRecord] = {}
        self._others: dict[str, dict[ExpertKey, ExpertRecord]] = {}
        self._read_at = float("-inf")
        self._dirty = asyncio.Event()
        self._read_lock = asyncio.Lock()
        self._warned: set[str] = set()
        self.errors: collections.Counter[str] = collections.Counter()

    @property
    def peer_id(self) -> str:
        return self._discovery.peer_id

    async def publish(self, peer_id: str, records: Mapping[ExpertKey, ExpertRecord]) -> None:
        if peer_id != self.peer_id:
            raise ValueError(f"this directory publishes for {self.peer_id} only, not {peer_id}")
        self._mine = dict(records)
        self._dirty.set()

    async def read(self) -> RecordsByPeer:
        """Every live peer's records as last read (at most half a heartbeat ago), this peer's current ones."""
        loop = asyncio.get_running_loop()
        async with self._read_lock:
            if loop.time() - self._read_at >= self._heartbeat_s / 2:
                await self._read_now()
                self._read_at = loop.time()
        return {**self._others, self.peer_id: dict(self._mine)}

    async def run(self) -> None:
        """Store this peer's records whenever they changed (at most every half heartbeat) and at
        every heartbeat; until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._heartbeat_s):
                    await self._dirty.wait()
            self._dirty.clear()
            started = loop.time()
            if self._mine:
                key = self._discovery.sharded(self._base).key_of(self.peer_id)
                await self._discovery.store_own(key, encode_expert_records(self._mine), self._ttl_s,
                                                what="expert records")
            await asyncio.sleep(max(0.0, self._heartbeat_s / 2 - (loop.time() - started)))

    async def _read_now(self) -> None:
        key = self._discovery.sharded(self._base)
        found = await self._discovery.read_owned(key, what="expert records")
        if found is None:
            return  # the DHT did not answer: keep the last read rather than forget every peer
        # a shard whose read failed keeps its peers' last records
        others = {peer: held for peer, held in self._others.items() if key.shard_of(peer) in found.failed}
        for peer, raw in found.values.items():
            if peer == self.peer_id:
                continue
            try:
                others[peer] = decode_expert_records(raw)
            except ValueError as exc:
                self.errors["expert_records_invalid"] += 1
                if peer not in self._warned:  # logged once per peer; every one is counted
                    self._warned.add(peer)
                    logger.warning("ignoring malformed expert records from %s: %s", peer, exc)
        self._others = others


__all__ = ["DhtExpertDirectory"]
