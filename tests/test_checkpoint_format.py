"""Checkpoints in safetensors (node.train.checkpoint): what safetensors itself reads, a flipped bit
or a torn file found and the previous checkpoint used, old .npz checkpoints (written by murmur 0.1's
writer) still read, and a trainer restored from either continues exactly."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from node.swarm.recipe import optimizer_config
from node.train.checkpoint import (
    CHECKPOINT_FILE,
    META_KEY,
    CheckpointUnreadable,
    load_checkpoint,
    previous_path,
    save_checkpoint,
)
from node.train.data import load_corpus
from node.train.trainer import Trainer, TrainerConfig
from support.npz_checkpoint import save_npz_checkpoint
from support.tiny_model import TINY, build

pytestmark = pytest.mark.unit

TENSORS = {"param/w": np.arange(12, dtype=np.float32).reshape(3, 4), "trainer/step": np.asarray(7, np.int64),
           "optimizer/w/m": np.linspace(-1, 1, 5, dtype=np.float32), "empty": np.zeros((2, 0), np.float32)}
META = {"step": 7, "swarm": "s", "val_loss": 2.5, "swarm_config": json.dumps({"version": 2})}


def test_a_checkpoint_is_a_safetensors_file_with_its_meta_and_types_kept(tmp_path) -> None:
    path = tmp_path / CHECKPOINT_FILE
    save_checkpoint(path, TENSORS, META)
    raw = load_file(str(path))  # safetensors reads it itself
    assert sorted(raw) == sorted(TENSORS) and all(np.array_equal(raw[k], v) and raw[k].shape == v.shape
                                                  for k, v in TENSORS.items())
    loaded = load_checkpoint(path)
    assert loaded is not None and loaded.meta == META
    assert loaded.tensors["trainer/step"].shape == () and int(loaded.tensors["trainer/step"]) == 7
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        assert json.loads(f.metadata()[META_KEY]) == META


def test_a_flipped_bit_or_a_torn_write_falls_back_to_the_previous_checkpoint(tmp_path, caplog) -> None:
    path = tmp_path / CHECKPOINT_FILE
    save_checkpoint(path, TENSORS, {**META, "step": 6})
    save_checkpoint(path, TENSORS, META)
    data = bytearray(path.read_bytes())
    data[-20] ^= 0x01  # inside the tensor data: safetensors alone would not notice
    path.write_bytes(bytes(data))
    assert load_checkpoint(path).meta["step"] == 6
    assert "do not match the digest" in caplog.text
    path.write_bytes(bytes(data[: len(data) // 2]))
    assert load_checkpoint(path).meta["step"] == 6
    previous_path(path).write_bytes(b"garbage")
    with pytest.raises(CheckpointUnreadable):
        load_checkpoint(path)


def test_an_old_npz_checkpoint_is_still_read_from_its_path_or_beside_the_new_name(tmp_path) -> None:
    old = tmp_path / "checkpoint.npz"
    save_npz_checkpoint(old, TENSORS, META)
    for path in (old, tmp_path / CHECKPOINT_FILE):  # the node asks for checkpoint.safetensors
        loaded = load_checkpoint(path)
        assert loaded is not None and loaded.meta == META
        # murmur 0.1 stored a 0-d array (the step) as shape (1,): its readers take int() of it
        assert all(np.array_equal(loaded.tensors[k].reshape(-1), v.reshape(-1)) for k, v in TENSORS.items())
    # once a safetensors checkpoint exists, it wins
    save_checkpoint(tmp_path / CHECKPOINT_FILE, TENSORS, {**META, "step": 8})
    assert load_checkpoint(tmp_path / CHECKPOINT_FILE).meta["step"] == 8


@pytest.mark.slow
@pytest.mark.parametrize("writer", ["safetensors", "npz"])
def test_a_trainer_restored_from_either_format_continues_exactly(tmp_path, writer) -> None:
    corpus = load_corpus(None, tmp_path)
    config = TrainerConfig(optimizer=optimizer_config("dadam", 1e-2, 2, 20, 1, 1), batch_size=4,
                           context=TINY.context, device="cpu", precision="fp32")

    async def run() -> None:
        async with Trainer(build(), config, peer_id="p", train_tokens=corpus.train, val_tokens=corpus.val) as a:
            for _ in range(3):
                await a.train_step()
            path = tmp_path / ("c.npz" if writer == "npz" else CHECKPOINT_FILE)
            (save_npz_checkpoint if writer == "npz" else save_checkpoint)(path, await a.state(), {"step": a.step})
            async with Trainer(build(), config, peer_id="p", train_tokens=corpus.train, val_tokens=corpus.val) as b:
                await b.restore(load_checkpoint(path).tensors)
                for _ in range(2):
                    await a.train_step()
                    await b.train_step()
                ta, tb = await a.tensors(), await b.tensors()
                assert all(np.array_equal(ta[k], tb[k]) for k in ta)

    asyncio.run(run())
