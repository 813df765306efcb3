"""Checkpoints off the step path (node/runtime/saving.py, CheckpointWriter): a save returns once its snapshot
is taken, the write runs beside training, one snapshot at most waits to be written, and the final save on a
stop is bounded by its size and never writes over a write still in flight."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

import node.runtime.saving as saving
from node.runtime.status import NodeRuntime
from node.train.checkpoint import CHECKPOINT_FILE, load_checkpoint

pytestmark = pytest.mark.unit


class FakeRuntime:
    """What the writer reads of a node: a vector-mode gossip peer (no trainer), its swarm and its counters."""

    def __init__(self) -> None:
        self.peer = SimpleNamespace(tensors={"w": np.zeros(1000, np.float32)}, step=0, round=0)
        self.training = None
        self.config = SimpleNamespace(swarm="s")
        self.config_hash = "h" * 64
        self.swarm_doc: dict[str, Any] = {}
        self.swarm_config = None
        self.counted: list[str] = []

    def count(self, kind: str) -> None:
        self.counted.append(kind)

    def train(self, value: float) -> None:
        """A step: the peer's arrays are replaced, never written into (as GossipPeer and the trainer do)."""
        self.peer.tensors = {"w": np.full(1000, value, np.float32)}
        self.peer.step += 1


class GatedSave:
    """save_checkpoint, held at a gate until the test opens it; counts writers running at once."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.running = 0
        self.most_at_once = 0
        self.lock = threading.Lock()
        self.real = saving.save_checkpoint

    def __call__(self, path: Path, tensors: Any, meta: Any) -> None:
        with self.lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        try:
            if not self.gate.wait(timeout=30):
                raise OSError("the test never opened the gate")
            self.real(path, tensors, meta)
        finally:
            with self.lock:
                self.running -= 1


def _writer(tmp_path: Path, runtime: FakeRuntime) -> saving.CheckpointWriter:
    return saving.CheckpointWriter(cast(NodeRuntime, runtime), tmp_path / CHECKPOINT_FILE)


def test_a_save_returns_at_its_snapshot_and_writes_what_it_took(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gated = GatedSave()
    monkeypatch.setattr(saving, "save_checkpoint", gated)
    runtime = FakeRuntime()
    writer = _writer(tmp_path, runtime)

    async def main() -> None:
        runtime.train(1.0)
        await asyncio.wait_for(writer.save(), timeout=10)  # returns while the write is held at the gate
        assert gated.running == 1 and not (tmp_path / CHECKPOINT_FILE).exists()
        runtime.train(2.0)  # training goes on while the checkpoint is written
        gated.gate.set()
        await asyncio.wait_for(writer.written(), timeout=30)

    asyncio.run(main())
    written = load_checkpoint(tmp_path / CHECKPOINT_FILE)
    assert written is not None
    assert written.meta["step"] == 1 and np.all(written.tensors["w"] == 1.0)


def test_one_snapshot_waits_at_most_and_the_last_step_waits_for_its_write(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    gated = GatedSave()
    monkeypatch.setattr(saving, "save_checkpoint", gated)
    runtime = FakeRuntime()
    writer = _writer(tmp_path, runtime)

    async def main() -> None:
        runtime.train(1.0)
        await writer.save()
        runtime.train(2.0)
        second = asyncio.create_task(writer.save())
        await asyncio.sleep(0.2)
        assert not second.done(), "a second save must wait for the write before it"
        gated.gate.set()
        await asyncio.wait_for(second, timeout=30)
        runtime.train(3.0)
        await asyncio.wait_for(writer.save(wait=True), timeout=30)
        assert (load_checkpoint(tmp_path / CHECKPOINT_FILE) or pytest.fail("no checkpoint")).meta["step"] == 3

    asyncio.run(main())
    assert gated.most_at_once == 1


def test_the_final_save_is_bounded_and_never_writes_over_a_write_in_flight(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    gated = GatedSave()
    monkeypatch.setattr(saving, "save_checkpoint", gated)
    monkeypatch.setattr(saving, "STOP_TIMEOUT_S", 0.5)
    runtime = FakeRuntime()
    writer = _writer(tmp_path, runtime)

    async def main() -> float:
        runtime.train(1.0)
        await writer.save()  # a write that hangs (a frozen disk)
        started = time.monotonic()
        await asyncio.wait_for(writer.final(), timeout=20)
        took = time.monotonic() - started
        gated.gate.set()  # the disk comes back: the write in flight ends (asyncio.run waits for its thread)
        return took

    assert asyncio.run(main()) < 10
    assert gated.most_at_once == 1


def test_the_final_save_writes_the_last_state(tmp_path: Path) -> None:
    runtime = FakeRuntime()
    writer = _writer(tmp_path, runtime)

    async def main() -> None:
        runtime.train(1.0)
        await writer.save()
        runtime.train(5.0)
        await writer.final()

    asyncio.run(main())
    written = load_checkpoint(tmp_path / CHECKPOINT_FILE)
    assert written is not None and written.meta["step"] == 2 and np.all(written.tensors["w"] == 5.0)
    assert runtime.counted == []


def test_a_failed_write_is_counted_and_keeps_the_previous_checkpoint(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = FakeRuntime()
    writer = _writer(tmp_path, runtime)

    def full_disk(path: Path, tensors: Any, meta: Any) -> None:
        raise OSError(28, "No space left on device")

    async def main() -> None:
        runtime.train(1.0)
        await writer.save(wait=True)
        monkeypatch.setattr(saving, "save_checkpoint", full_disk)
        runtime.train(2.0)
        await writer.save(wait=True)

    asyncio.run(main())
    assert runtime.counted == ["checkpoint_failed"]
    kept = load_checkpoint(tmp_path / CHECKPOINT_FILE)
    assert kept is not None and kept.meta["step"] == 1


def test_the_final_save_bound_follows_the_size() -> None:
    small, large = saving.save_bound_s(1 << 20), saving.save_bound_s(16 << 30)
    assert small >= saving.STOP_TIMEOUT_S and small < saving.STOP_TIMEOUT_S + 1
    assert large > small + 100  # 16 GiB (1B parameters with Adam's moments) at the floor rate
