"""`murmur export --data-dir DIR --from checkpoint --to OUT` run as a command: a node's data directory
holding a checkpoint (a trainer's state, as the node writes it) becomes a directory other tools load —
the embedded model's safetensors with one tensor per parameter in its shape, and for a Hugging Face
preset a save_pretrained directory that transformers loads with the checkpoint's logits and the
swarm's tokenizer."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from node.train.data import Corpus

pytestmark = [pytest.mark.unit, pytest.mark.slow]  # builds models and runs the command (seconds)

MURMUR = str(Path(sys.executable).with_name("murmur"))


def write_node_checkpoint(data_dir: Path, model_name: str, corpus: Corpus, tokenizer: Path | None = None) -> torch.nn.Module:
    """A node's data directory after a few training steps: checkpoint.safetensors with the trainer's
    state and the meta a node writes (its swarm config inside), the tokenizer in the node's cache.
    Returns the trained model."""
    from node.cli.main import parse_node_config
    from node.runtime.founding import swarm_document
    from node.swarm.loop import build_swarm_model
    from node.swarm.recipe import SwarmSettings
    from node.train.checkpoint import CHECKPOINT_FILE, save_checkpoint
    from node.train.tokenizer import store_in_cache
    from node.train.trainer import Trainer, TrainerConfig

    config = parse_node_config(["node", "--model", model_name, "--lr", "3e-2", "--warmup-steps", "1"]
                               + (["--tokenizer", str(tokenizer)] if tokenizer else []), {})
    doc = swarm_document(config, 1.0)
    recipe = SwarmSettings.from_doc(doc).training
    assert recipe is not None
    if tokenizer is not None:
        store_in_cache(data_dir, tokenizer.read_bytes())
    model = build_swarm_model(config.training, recipe)
    trainer_config = TrainerConfig(optimizer=recipe.optimizer, batch_size=4, context=32, device="cpu", precision="fp32")

    async def train() -> dict[str, np.ndarray]:
        async with Trainer(model, trainer_config, peer_id="p", train_tokens=corpus.train, val_tokens=corpus.val) as t:
            for _ in range(3):
                await t.train_step()
            return await t.state()

    state = asyncio.run(train())
    assert int(state["trainer/step"]) == 3 and any(k.startswith("optimizer/") for k in state)
    # trained away from the seeded init, so an export of anything else than the checkpoint shows
    fresh = build_swarm_model(config.training, recipe)
    assert all(not np.array_equal(state[f"param/{n}"], p.detach().numpy().reshape(-1))
               for n, p in fresh.named_parameters() if p.dim() > 1 and "experts" not in n)
    save_checkpoint(data_dir / CHECKPOINT_FILE, state, {"round": 2, "step": 3, "swarm": "exported",
                                                        "config_hash": "cafe", "swarm_config": json.dumps(doc)})
    return model


def murmur_export(data_dir: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([MURMUR, "export", "--data-dir", str(data_dir), "--from", "checkpoint", "--to", str(out)],
                          capture_output=True, text=True, timeout=300)


def test_murmur_export_writes_an_embedded_models_checkpoint_as_safetensors(tmp_path, corpus: Corpus) -> None:
    from safetensors.numpy import load_file

    from node.train.models.gpt import GPT, ModelConfig

    model = write_node_checkpoint(tmp_path / "node", "moe", corpus)
    done = murmur_export(tmp_path / "node", tmp_path / "out")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == (f"murmur export: wrote this node's checkpoint of swarm 'exported' (moe, step 3) "
                                   f"to {tmp_path / 'out'}")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors", "murmur.json"]
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    trained = {n: p.detach().numpy() for n, p in model.named_parameters()}
    assert weights.keys() == trained.keys()
    assert all(weights[n].shape == trained[n].shape and np.array_equal(weights[n], trained[n]) for n in trained)
    # the documented way back: GPT(ModelConfig(**config["config"])) and load_state_dict of the tensors
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["murmur_model"] == "moe" and config["vocab"] == "bytes"
    rebuilt = GPT(ModelConfig(**config["config"]))
    rebuilt.load_state_dict({n: torch.from_numpy(w) for n, w in weights.items()}, strict=True)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(rebuilt.eval()(ids)[0], model.eval()(ids)[0], atol=0, rtol=0)
    manifest = json.loads((tmp_path / "out" / "murmur.json").read_text())
    assert manifest["kind"] == "checkpoint" and manifest["step"] == 3 and manifest["config_hash"] == "cafe"


def test_murmur_export_writes_an_hf_presets_checkpoint_that_transformers_loads(tmp_path, corpus: Corpus) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from node.train.data import synthetic_text
    from node.train.tokenizer import train_bpe

    tokenizer = tmp_path / "tokenizer.json"
    train_bpe(synthetic_text(0, 100_000).decode().split("\n\n"), 300, tokenizer)
    model = write_node_checkpoint(tmp_path / "node", "hf-tiny-llama", corpus, tokenizer)
    done = murmur_export(tmp_path / "node", tmp_path / "out")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "wrote this node's checkpoint of swarm 'exported' (hf-tiny-llama, step 3)" in done.stdout
    out = tmp_path / "out"
    assert {"config.json", "model.safetensors", "tokenizer.json", "murmur.json"} <= {p.name for p in out.iterdir()}
    loaded = AutoModelForCausalLM.from_pretrained(str(out))
    hf_tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert loaded.config.model_type == "llama" and loaded.config.vocab_size == 300
    ids = hf_tokenizer("Nora found the little lantern", return_tensors="pt").input_ids
    with torch.no_grad():
        np.testing.assert_allclose(loaded.eval()(input_ids=ids).logits.numpy(), model.eval()(ids)[0].numpy(),
                                   atol=1e-5, rtol=0)
