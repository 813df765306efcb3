"""The swarm's tokenizer on this node: found locally or fetched from a peer, then cached and served to peers
that lack it.

Locally means its own --tokenizer, or the cache under its data directory, by the hash the swarm config
carries; peers serve it over `/murmur/blob/1`. A node that finds it nowhere stops with exit 2."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gossip.blob import BlobFailed, fetch_blob, serve_blobs
from gossip.transport import Transport
from node.runtime.errors import StartupError
from node.train.tokenizer import SwarmTokenizer, TokenizerSpec, find_local, store_in_cache

if TYPE_CHECKING:
    from node.net.records import PeerRecord

logger = logging.getLogger("murmur.node")

FIND_PEERS_S = 15.0  # how long a joiner looks for peers that may hold the tokenizer
PEER_TIMEOUT_S = 30.0  # one peer's answer


async def obtain_tokenizer(spec: TokenizerSpec | None, data_dir: Path, own: Path | None, transport: Transport,
                           view: Callable[[], Sequence[PeerRecord]],
                           connect: Callable[[PeerRecord], object]) -> SwarmTokenizer:
    """The swarm's tokenizer (None in `spec`: bytes), cached under `data_dir` and served from now on."""
    if spec is None:
        return SwarmTokenizer(None)
    data = await asyncio.to_thread(find_local, spec, data_dir, own)
    if data is None:
        if own is not None:
            logger.warning("--tokenizer %s is not the swarm's (sha256 %s...); fetching the swarm's from a peer",
                           own, spec.sha256[:12])
        data = await _fetch_from_peers(spec, transport, view, connect)
    try:
        await asyncio.to_thread(store_in_cache, data_dir, data)
    except OSError as exc:  # a full or read-only disk: train anyway, just do not cache or serve from disk
        logger.warning("the swarm's tokenizer is not cached in %s: %s", data_dir, exc)

    async def source(sha256: str) -> bytes | None:
        return data if sha256 == spec.sha256 else None

    await serve_blobs(transport, source)
    return SwarmTokenizer(data)


async def _fetch_from_peers(spec: TokenizerSpec, transport: Transport, view: Callable[[], Sequence[PeerRecord]],
                            connect: Callable[[PeerRecord], object]) -> bytes:
    me, tried, failures = transport.peer_id, set(), []
    deadline = time.monotonic() + FIND_PEERS_S
    while True:
        for record in [r for r in view() if r.peer_id != me and r.peer_id not in tried]:
            tried.add(record.peer_id)
            try:
                result = connect(record)
                if asyncio.iscoroutine(result):
                    async with asyncio.timeout(PEER_TIMEOUT_S):
                        await result
                data = await fetch_blob(transport, record.peer_id, spec.sha256, spec.bytes, PEER_TIMEOUT_S)
            except (BlobFailed, TimeoutError, ConnectionError, ValueError) as exc:
                failures.append(f"{record.peer_id[:16]}: {exc}")
                logger.warning("tokenizer from %s: %s", record.peer_id, exc)
                continue
            logger.info("fetched the swarm's tokenizer (sha256 %s..., %d bytes) from %s", spec.sha256[:12],
                        len(data), record.peer_id)
            return data
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.5)
    tail = f" ({'; '.join(failures[:3])})" if failures else " (no peer in view)"
    raise StartupError(f"this node does not have the swarm's tokenizer (sha256 {spec.sha256[:16]}..., "
                       f"{spec.bytes} bytes) and no peer served it{tail}; pass --tokenizer FILE with that file")


__all__ = ["obtain_tokenizer"]
