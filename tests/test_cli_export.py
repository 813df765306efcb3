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
# the contributor table a node keeps in its checkpoint (node.swarm.contributors): peer id -> tokens processed
CONTRIBUTORS = {"QmPeerB": 1152, "QmPeerA": 3456}


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
                                                        "config_hash": "cafe", "swarm_config": json.dumps(doc),
                                                        "contributors": json.dumps(CONTRIBUTORS)})
    return model


class Card:
    def __init__(self, front: dict, body: str) -> None:
        self.front, self.body = front, body


def read_card(directory: Path) -> Card:
    """An export's README.md: its YAML front matter (parsed) and the Markdown after it."""
    yaml = pytest.importorskip("yaml")
    text = (directory / "README.md").read_text(encoding="utf-8")
    assert text.startswith("---\n")
    front, body = text[4:].split("\n---\n", 1)
    parsed = yaml.safe_load(front)
    assert isinstance(parsed, dict)
    return Card(parsed, body)


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
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "README.md", "config.json", "model.safetensors", "murmur.json", "tokenizer.json", "tokenizer_config.json"]
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
    # the byte vocabulary comes as a tokenizer AutoTokenizer loads, though transformers cannot load the model
    from transformers import AutoTokenizer

    text = "Grüße, 日本 🎉"
    hf_tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert hf_tokenizer(text)["input_ids"] == list(text.encode("utf-8"))
    card = read_card(tmp_path / "out")
    assert "library_name" not in card.front and "murmur" in card.front["tags"] and "`moe`" in card.body


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


def test_a_byte_vocabulary_hf_export_carries_a_tokenizer_and_a_model_card(tmp_path, corpus: Corpus) -> None:
    """`murmur node --model hf-tiny-llama` without --tokenizer trains on bytes: its export's tokenizer
    gives murmur's byte ids, round-trips non-ASCII text and decodes what the exported model generates;
    README.md says how the model was made."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = write_node_checkpoint(tmp_path / "node", "hf-tiny-llama", corpus)
    done = murmur_export(tmp_path / "node", tmp_path / "out")
    assert done.returncode == 0, done.stderr[-2000:]
    out = tmp_path / "out"
    assert {"README.md", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    hf_tokenizer = AutoTokenizer.from_pretrained(str(out))
    text = "Nora found the lantern — grüße, naïve café, 日本語 🎉\n"
    ids = hf_tokenizer(text)["input_ids"]
    assert ids == list(text.encode("utf-8")) and hf_tokenizer.decode(ids) == text
    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    prompt = hf_tokenizer("Nora found", return_tensors="pt")
    with torch.no_grad():
        np.testing.assert_allclose(loaded(input_ids=prompt.input_ids).logits.numpy(),
                                   model.eval()(prompt.input_ids)[0].numpy(), atol=1e-5, rtol=0)
        generated = loaded.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert generated.shape == (1, prompt.input_ids.shape[1] + 8)  # no EOS in the byte vocabulary: all 8 come
    assert hf_tokenizer.decode(generated[0]).startswith("Nora found")

    card = read_card(out)
    assert card.front["library_name"] == "transformers"
    assert {"murmur", "decentralized-training", "dadam", "hf-tiny-llama"} <= set(card.front["tags"])
    for wanted in ("# hf-tiny-llama, trained by the murmur swarm `exported`", "LlamaForCausalLM",
                   "## Data", "- optimizer: `dadam`", "- topology: `one-peer-exp`", "- steps: 3",
                   f"- tokens: {3 * 16 * 128:,} per node", "- config hash: `cafe`", "## Contributors",
                   "one node's own checkpoint", "bytes (256 ids",
                   # the contributors the node saw, most tokens first, with their shares
                   "2 contributor(s) processed 4,608 training tokens", "| `QmPeerA` | 3,456 | 75.0% |",
                   "| `QmPeerB` | 1,152 | 25.0% |"):
        assert wanted in card.body, wanted
    assert card.body.index("QmPeerA") < card.body.index("QmPeerB")
    assert json.loads((out / "murmur.json").read_text())["contributors"] == CONTRIBUTORS
    # deterministic: the same inputs give the same card
    again = murmur_export(tmp_path / "node", tmp_path / "again")
    assert again.returncode == 0 and (tmp_path / "again" / "README.md").read_text() == (out / "README.md").read_text()
