"""What a running node writes to its data directory: its checkpoint (periodic and final) and the
swarm-average model, each carrying the swarm it belongs to."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from node.runtime.shutdown import bounded_cleanup
from node.runtime.status import NodeRuntime
from node.training.checkpoint import save_checkpoint

if TYPE_CHECKING:
    from node.training.swarm_eval import SwarmEvalResult

logger = logging.getLogger("murmur.node")

CHECKPOINT_FILE = "checkpoint.npz"  # in the data directory
SWARM_AVERAGE_FILE = "swarm-average.npz"  # in the data directory, beside checkpoint.npz


def checkpoint_path(runtime: NodeRuntime) -> Path:
    return runtime.config.data_dir / CHECKPOINT_FILE


def swarm_meta(runtime: NodeRuntime) -> dict[str, str]:
    """What a file this node writes carries of the swarm it belongs to (a checkpoint, the swarm average)."""
    return {"swarm": runtime.config.swarm, "config_hash": runtime.config_hash,
            "swarm_config": json.dumps(runtime.swarm_doc)}


async def write_checkpoint(runtime: NodeRuntime, path: Path) -> None:
    """The trainer's state (or the vector), with the round and step; OSError is counted as
    `checkpoint_failed` and the previous checkpoint is kept."""
    peer, training = runtime.peer, runtime.training
    assert peer is not None, "a checkpoint is written once the gossip peer exists"
    tensors = await training.state() if training is not None else peer.tensors
    step = training.trainer.step if training is not None else peer.step
    meta: dict[str, str | int | float] = {"round": peer.round, "step": step, **swarm_meta(runtime),
                                          **(training.checkpoint_meta() if training is not None else {})}
    try:
        await asyncio.to_thread(save_checkpoint, path, tensors, meta)
    except OSError as exc:
        runtime.count("checkpoint_failed")
        logger.error("checkpoint not written (%s); the previous one is kept", exc)


async def final_checkpoint(runtime: NodeRuntime, path: Path) -> None:
    async with bounded_cleanup("final checkpoint"):
        await write_checkpoint(runtime, path)


async def save_swarm_average(runtime: NodeRuntime, tensors: Mapping[str, np.ndarray], result: SwarmEvalResult) -> str:
    """Write the swarm-average model beside the checkpoint, atomically, with what it averaged; OSError
    leaves the previous file as it was."""
    path = runtime.config.data_dir / SWARM_AVERAGE_FILE
    meta: dict[str, str | int | float] = {
        "kind": "swarm-average", **swarm_meta(runtime), "written_by": result.self_id, "written_at": time.time(),
        "val_loss": result.loss, "min_step": result.min_step, "max_step": result.max_step,
        "peers": json.dumps([p.peer_id for p in result.included])}
    await asyncio.to_thread(save_checkpoint, path, tensors, meta)
    return str(path)
