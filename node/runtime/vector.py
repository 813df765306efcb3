"""Vector mode (`--model vector`): one random vector of `dim` floats gossiped on the swarm's round clock
instead of a model.

It makes the gossip itself observable: `murmur status` and the checkpoint show it converge."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

import numpy as np

from node.config import NodeConfig
from node.runtime.saving import write_checkpoint
from node.runtime.status import NodeRuntime
from node.swarm.progress import PeerProgress, leave_out_stalled, record_lag_rounds, stalled_after
from node.swarm.recipe import SwarmSettings
from node.swarm.rounds import (
    PeerTiming,
    announce_round,
    latest_announcement,
    participants,
    plausible_timings,
    start_round,
)
from node.train.checkpoint import Checkpoint
from topology import TopologyCache, peer_round

logger = logging.getLogger("murmur.node")

CHECKPOINT_EVERY_ROUNDS = 10


def initial_state(config: NodeConfig, settings: SwarmSettings, config_hash: str,
                  checkpoint: Checkpoint | None) -> tuple[dict[str, np.ndarray], int]:
    """The vector and round to start from: the checkpoint's when it is of this swarm config, else a
    fresh vector drawn from `--seed`."""
    if checkpoint is not None:
        if checkpoint.meta.get("config_hash") == config_hash and "params" in checkpoint.tensors:
            logger.info("resuming from checkpoint at round %s", checkpoint.meta.get("round"))
            return {"params": checkpoint.tensors["params"]}, int(checkpoint.meta.get("round", 0))
        logger.warning("the checkpoint belongs to another swarm config; starting fresh (it stays as checkpoint.safetensors.prev)")
    rng = np.random.default_rng(config.seed)
    return {"params": rng.standard_normal(settings.dim).astype(np.float32)}, 0


async def gossip_until(stop: asyncio.Event, runtime: NodeRuntime, settings: SwarmSettings, ckpt_path: Path) -> None:
    """Run round after round on the swarm's clock until `stop` is set."""
    peer, discovery, config = runtime.peer, runtime.discovery, runtime.config
    assert peer is not None and discovery is not None, "the node's parts are started"
    me = peer.peer_id
    clock = settings.clock
    lead_s = 4 * config.heartbeat_s + 1.0
    announced, waiting_since = 0, time.monotonic()
    start: int | None = None
    implausible: set[str] = set()  # peers whose announced start was left out
    topologies = TopologyCache(settings.topology)
    progress = PeerProgress(stalled_after(config.heartbeat_s, config.gossip.exchange_timeout_s))
    lag_rounds = record_lag_rounds(config.heartbeat_s, config.gossip.exchange_timeout_s, clock.interval_s)
    last_round = -1
    while not stop.is_set():
        next_round = clock.next_round(time.time(), last_round, settings.max_staleness)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, clock.start_of(next_round) - time.time())):
                await stop.wait()
        if stop.is_set():
            return
        last_round = next_round
        view = discovery.view()
        progress.observe(view)
        timings = [PeerTiming(p.peer_id, p.gossip_from) for p in view if p.peer_id != me]
        if not announced and len(view) >= config.gossip.min_peers:
            announced = announce_round(clock, time.time(), lead_s)
            discovery.update(gossip_from=announced)
            runtime.gossip_from = announced
            waiting_since = time.monotonic()
        if announced and start is None:
            plausible, beyond = plausible_timings(timings, latest_announcement(clock, time.time(), lead_s))
            for timing in beyond:
                if timing.peer_id not in implausible:  # once a peer: the wait below runs every round
                    implausible.add(timing.peer_id)
                    runtime.count("peer_start_implausible")
                    logger.info("ignoring %s's announced start round %d: later than any peer could announce now",
                                timing.peer_id, timing.gossip_from)
            start = start_round(plausible, announced)
            if start is None and time.monotonic() - waiting_since > 2 * lead_s:
                # a peer that never announces (it waits for a larger quorum) must not hold us back
                start = start_round([t for t in plausible if t.gossip_from], announced)
            if start is not None:
                logger.info("gossip starts at round %d (now %d)", start, next_round)
                # our tensors are our input to that round: label replies so, not as `stale`
                peer.round = max(peer.round, start - 1)
        # (peers are dialled in the background, node.net.dialer: a round never waits for a dial)
        if start is None or next_round < start:
            continue
        members = participants([*timings, PeerTiming(me, announced)], next_round)
        if me not in members.peer_ids:
            continue
        plan, stalled = leave_out_stalled(peer_round(topologies.get(members.n), members, me, next_round), view,
                                          progress, next_round, settings.max_staleness, lag_rounds)
        for _ in stalled:
            peer.stats.skipped["stalled"] += 1
        outcome = await peer.run_round(next_round, plan)
        discovery.update(round=next_round, step=peer.step)
        if outcome.skipped:
            logger.info("round %d: mixed with %d, skipped %s", next_round, len(outcome.mixed_with), outcome.skipped)
        if next_round % CHECKPOINT_EVERY_ROUNDS == 0:
            await write_checkpoint(runtime, ckpt_path)
