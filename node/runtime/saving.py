"""What a running node writes to its data directory: its checkpoint (periodic and final) and the
swarm-average model, each carrying the swarm it belongs to."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from node.runtime.shutdown import STOP_TIMEOUT_S, bounded_cleanup
from node.runtime.status import NodeRuntime
from node.train.checkpoint import CHECKPOINT_FILE, SWARM_AVERAGE_FILE, save_checkpoint

SWARM_AVERAGE_HF_DIR = "swarm-average-hf"  # a Hugging Face model's swarm average as a save_pretrained directory

if TYPE_CHECKING:
    from node.swarm.swarm_eval import SwarmEvalResult

logger = logging.getLogger("murmur.node")



def checkpoint_path(runtime: NodeRuntime) -> Path:
    return runtime.config.data_dir / CHECKPOINT_FILE


def swarm_meta(runtime: NodeRuntime) -> dict[str, str | int]:
    """What a file this node writes carries of the swarm it belongs to (a checkpoint, the swarm average)."""
    swarm = runtime.swarm_config
    return {"swarm": runtime.config.swarm, "config_hash": runtime.config_hash,
            "swarm_config": json.dumps(runtime.swarm_doc), "config_version": swarm.version if swarm else 0,
            "founder": swarm.founder if swarm else ""}


def contributors_meta(runtime: NodeRuntime) -> dict[str, str]:
    """The peers' tokens this node has seen (node.swarm.contributors), for the export's model card."""
    training = runtime.training
    if training is None:
        return {}
    training.observe_contributors()
    return {"contributors": training.contributors.to_meta()}


# The slowest disk a final checkpoint is given time for (a home machine's HDD or a network volume): the
# final save on SIGTERM may take STOP_TIMEOUT_S plus its size at this rate (docs/deploy.md: the stop
# timeout a container needs).
CHECKPOINT_WRITE_FLOOR_BYTES_S = 100e6


def save_bound_s(nbytes: int) -> float:
    """The most seconds a final checkpoint of `nbytes` (or the write in flight before it) may take."""
    return STOP_TIMEOUT_S + nbytes / CHECKPOINT_WRITE_FLOOR_BYTES_S


@dataclass(frozen=True)
class CheckpointSnapshot:
    """What one checkpoint holds, taken between two steps: the arrays are not changed afterwards (the
    trainer's are fresh copies; the gossip peer and DiLoCo replace their arrays, never write into them)."""

    tensors: Mapping[str, np.ndarray]
    meta: Mapping[str, str | int | float]

    @property
    def nbytes(self) -> int:
        return sum(int(np.asarray(a).nbytes) for a in self.tensors.values())


async def snapshot(runtime: NodeRuntime) -> CheckpointSnapshot:
    """The trainer's state (or the vector), with the round and step."""
    peer, training = runtime.peer, runtime.training
    assert peer is not None, "a checkpoint is written once the gossip peer exists"
    tensors = await training.state() if training is not None else peer.tensors
    step = training.trainer.step if training is not None else peer.step
    meta: dict[str, str | int | float] = {"round": peer.round, "step": step, **swarm_meta(runtime),
                                          **(training.checkpoint_meta() if training is not None else {})}
    return CheckpointSnapshot(tensors, meta)


async def write_snapshot(runtime: NodeRuntime, path: Path, taken: CheckpointSnapshot) -> None:
    """Write `taken` on a thread; OSError is counted as `checkpoint_failed` and the previous checkpoint is kept."""
    try:
        await asyncio.to_thread(save_checkpoint, path, taken.tensors, taken.meta)
    except OSError as exc:
        runtime.count("checkpoint_failed")
        logger.error("checkpoint not written (%s); the previous one is kept", exc)


async def write_checkpoint(runtime: NodeRuntime, path: Path) -> None:
    """Take a snapshot and write it, waiting for both (vector mode; tests)."""
    await write_snapshot(runtime, path, await snapshot(runtime))


class CheckpointWriter:
    """A training node's checkpoints, off the step path: a save waits for the write before it (so one
    snapshot at most is held beside the model) and for its own snapshot; the write then runs on a thread
    while training goes on. `final` writes the last one within a bound that follows its size."""

    def __init__(self, runtime: NodeRuntime, path: Path) -> None:
        self._runtime, self.path = runtime, path
        self._writing: asyncio.Task[None] | None = None
        self._writing_bytes = 0

    async def save(self, wait: bool = False) -> None:
        """Snapshot now and write in the background; `wait`: return once it is written (the last step's,
        so that a node that shows itself done has its checkpoint on disk)."""
        await self.written()
        taken = await snapshot(self._runtime)
        self._writing_bytes = taken.nbytes
        self._writing = asyncio.create_task(write_snapshot(self._runtime, self.path, taken),
                                            name="checkpoint write")
        if wait:
            await self.written()

    async def written(self) -> None:
        """Wait for the write in flight, if any (its errors are counted where it runs)."""
        if self._writing is not None:
            await asyncio.shield(self._writing)
            self._writing = None

    async def final(self) -> None:
        """The checkpoint a stopping node writes, after the write in flight; each is bounded by its size
        at CHECKPOINT_WRITE_FLOOR_BYTES_S (a write cut there leaves the previous checkpoint whole)."""
        if self._writing is not None:
            async with bounded_cleanup("the checkpoint write in flight", save_bound_s(self._writing_bytes)):
                await self.written()
            if self._writing is not None:  # still writing the same temporary: a second writer would tear it
                logger.warning("final checkpoint not written: the one before it is still being written")
                return
        await final_checkpoint(self._runtime, self.path)


async def final_checkpoint(runtime: NodeRuntime, path: Path) -> None:
    """The checkpoint a stopping node writes, bounded by its size."""
    taken: CheckpointSnapshot | None = None
    async with bounded_cleanup("final checkpoint snapshot"):
        taken = await snapshot(runtime)
    if taken is not None:
        async with bounded_cleanup("final checkpoint", save_bound_s(taken.nbytes)):
            await write_snapshot(runtime, path, taken)


async def save_swarm_average(runtime: NodeRuntime, tensors: Mapping[str, np.ndarray], result: SwarmEvalResult) -> str:
    """Write the swarm-average model beside the checkpoint, atomically, with what it averaged; OSError
    leaves the previous file as it was."""
    path = runtime.config.data_dir / SWARM_AVERAGE_FILE
    meta: dict[str, str | int | float] = {
        "kind": "swarm-average", **swarm_meta(runtime), "written_by": result.self_id, "written_at": time.time(),
        "val_loss": result.loss, "min_step": result.min_step, "max_step": result.max_step,
        "peers": json.dumps([p.peer_id for p in result.included]),
        "peer_steps": json.dumps({p.peer_id: p.step for p in result.included}),  # each peer's step as pulled
        **contributors_meta(runtime)}
    await asyncio.to_thread(save_checkpoint, path, tensors, meta)
    await _export_hf_average(runtime, tensors, meta)
    return str(path)


async def _export_hf_average(runtime: NodeRuntime, tensors: Mapping[str, np.ndarray],
                             meta: Mapping[str, str | int | float]) -> None:
    """A Hugging Face model's swarm average is also written as a save_pretrained directory beside it
    (the previous one kept as .prev). A failure is logged and counted; the safetensors file stands."""
    from node.swarm.contributors import parse_contributors
    from node.swarm.export import recipe_of, replace_directory, swarm_doc_of, tokenizer_bytes, write_export

    try:
        recipe = recipe_of(meta)
        if recipe.model_config is None:
            return
        data_dir = runtime.config.data_dir
        tokenizer = await asyncio.to_thread(tokenizer_bytes, recipe, data_dir)
        manifest = {**{k: meta[k] for k in ("kind", "swarm", "config_hash", "min_step", "max_step", "val_loss",
                                             "written_by")},
                    "model": recipe.model, "peers": json.loads(str(meta["peers"])),
                    "peer_steps": json.loads(str(meta["peer_steps"])),
                    "contributors": parse_contributors(meta.get("contributors"))}
        swarm_doc = swarm_doc_of(meta)
        await asyncio.to_thread(replace_directory, data_dir / SWARM_AVERAGE_HF_DIR,
                                lambda d: write_export(d, recipe, tensors, tokenizer, manifest, swarm_doc), True)
    except (OSError, ValueError) as exc:
        runtime.count("swarm_average_export_failed")
        logger.error("swarm average not exported as a save_pretrained directory: %s", exc)
