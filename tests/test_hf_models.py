"""Hugging Face models (node.train.models.hf, .experts, node.swarm.export): presets built the same
on every node from a seed; a model config from the network bounded before it is built; fused
Mixtral-style experts split per expert with the same outputs, unsupported layouts named; SPES on
hf-tiny-mixtral with 4 nodes (each optimizer holds exactly the shared weights and its owned experts;
loss within 5% of dense training); exports that transformers loads with the same logits; and the
command line that never imports the HF stack unless asked."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gossip.codecs import get_codec
from gossip.exchange import ExchangeSettings, GossipPeer
from gossip.lockstep import Lockstep
from gossip.memory import InMemoryNetwork
from gossip.optimizers import OptimizerConfig
from gossip.spes import SpesConfig, assign_experts
from node.algorithms.dsgd import GossipTrainer
from node.algorithms.lockstep import drive
from node.train.data import Corpus, peer_shard
from node.train.trainer import Trainer, TrainerConfig, average_tensors

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.unit
def test_the_command_line_and_the_node_config_never_import_the_hf_stack() -> None:
    code = "import node.cli.main, node.train.checkpoint, node.train.shards, node.train.tokenizer, gossip.blob"
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines() if "|" in line}
    assert not imported & {"transformers", "tokenizers", "safetensors", "pyarrow", "datasets"}, imported


def mixtral_doc(**changes: object) -> dict:
    from node.train.models.hf import read_source

    return {**read_source("hf-tiny-mixtral").config, **changes}


@pytest.mark.unit
@pytest.mark.slow
def test_presets_are_the_same_on_every_node_for_a_seed_and_split_per_expert() -> None:
    from node.train.models import expert_parameter_names, shared_parameter_names
    from node.train.models.hf import build_hf_model, parameter_count, read_source

    for name in ("hf-tiny-llama", "hf-tiny-mixtral"):
        doc = read_source(name, vocab_size=300).config
        assert doc["vocab_size"] == 300
        a, b, c = build_hf_model(doc, seed=5), build_hf_model(doc, seed=5), build_hf_model(doc, seed=6)
        pa, pb, pc = dict(a.named_parameters()), dict(b.named_parameters()), dict(c.named_parameters())
        assert all(torch.equal(pa[n], pb[n]) for n in pa), "one seed must give the same model"
        assert any(not torch.equal(pa[n], pc[n]) for n in pa if pa[n].dim() > 1)
        assert sum(p.numel() for p in pa.values()) == parameter_count(doc)
    experts = expert_parameter_names(a)
    assert len(experts) == 2 * 4 and experts[(1, 3)] == ["lm.model.layers.1.mlp.experts.3.gate_up_proj",
                                                         "lm.model.layers.1.mlp.experts.3.down_proj"]
    shared = shared_parameter_names(a)
    assert "lm.model.layers.0.mlp.gate.weight" in shared and not any(".experts." in n for n in shared)


@pytest.mark.unit
@pytest.mark.slow
def test_split_experts_compute_what_transformers_fused_experts_compute() -> None:
    from transformers import AutoModelForCausalLM

    from node.train.models.experts import SplitExperts, fuse_state_dict, split_fused_experts
    from node.train.models.hf import hf_config

    config = hf_config(mixtral_doc())
    torch.manual_seed(0)
    fused = AutoModelForCausalLM.from_config(config)
    reference = {k: v.clone() for k, v in fused.state_dict().items()}
    x = torch.randint(0, 256, (3, 20))
    with torch.no_grad():
        before = fused(input_ids=x).logits
        assert split_fused_experts(fused) == 2
        assert isinstance(fused.model.layers[0].mlp.experts, SplitExperts)
        after = fused(input_ids=x).logits
    torch.testing.assert_close(after, before, atol=1e-6, rtol=0)
    back = fuse_state_dict(fused.state_dict(), fused)
    assert back.keys() == reference.keys() and all(torch.equal(back[k], reference[k]) for k in back)


@pytest.mark.unit
@pytest.mark.slow
@pytest.mark.parametrize(("doc", "named"), [
    # GPT-OSS: fused 3-D experts with biases, transposed
    ({"model_type": "gpt_oss", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 32, "head_dim": 8,
      "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
      "num_experts_per_tok": 2, "max_position_embeddings": 64, "layer_types": ["full_attention"]},
     r"GptOssExperts of model type 'gpt_oss' at model\.layers\.0\.mlp\.experts \(gate_up_proj \(4, 32, 64\)"),
    # DBRX: DbrxExperts keeps every expert in a child DbrxExpertGLU, w1, v1 and w2 flattened to 2-D (E * F, H)
    ({"model_type": "dbrx", "vocab_size": 256, "d_model": 32, "n_heads": 4, "n_layers": 1, "max_seq_len": 64,
      "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0},
      "ffn_config": {"ffn_hidden_size": 16, "moe_num_experts": 4, "moe_top_k": 2}},
     r"DbrxExperts of model type 'dbrx' at transformer\.blocks\.0\.ffn\.experts \(mlp\.w1 \(64, 32\), "
     r"mlp\.v1 \(64, 32\), mlp\.w2 \(64, 32\)\)"),
], ids=["gpt_oss", "dbrx"])
def test_an_unsupported_expert_layout_is_refused_by_name(doc, named) -> None:
    from node.algorithms.spes.partition import ModelPartition
    from node.train.models.hf import build_hf_model

    model = build_hf_model(doc, seed=0)
    with pytest.raises(ValueError, match=r"^SPES cannot split the experts of this model per expert: unsupported layout "
                                         + named):
        ModelPartition.of(model)


@pytest.mark.unit
@pytest.mark.slow  # imports transformers (seconds)
@pytest.mark.parametrize(("doc", "message"), [
    ({"model_type": "llama", "num_hidden_layers": 100_000}, "num_hidden_layers is 100000"),
    ({"model_type": "llama", "hidden_size": -1}, "hidden_size is -1"),
    ({"model_type": "llama", "vocab_size": True}, "vocab_size is True"),
    ({"model_type": "llama", "auto_map": {"AutoModelForCausalLM": "evil.Model"}}, "never follows"),
    ({"model_type": "llama", "padding": "x" * 40_000}, "bytes, more than"),
    ({"vocab_size": 10}, "no model_type"),
    ({"model_type": "no-such-family"}, "cannot build"),
    ({"model_type": "vit"}, "not a causal language model"),
])
def test_a_model_config_from_the_network_is_bounded_before_it_is_built(doc, message) -> None:
    from node.train.models.hf import HfModelInvalid, hf_config

    with pytest.raises(HfModelInvalid, match=message):
        hf_config(doc)


@pytest.mark.unit
@pytest.mark.slow
def test_a_model_too_large_for_this_machine_is_refused_without_allocating_it() -> None:
    from node.train.models.hf import HfModelInvalid, check_fits

    # every field within its bound, but ~70 billion parameters: counted on the meta device
    huge = {"model_type": "llama", "vocab_size": 128_000, "hidden_size": 8192, "intermediate_size": 28_672,
            "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8}
    with pytest.raises(HfModelInvalid, match="parameters, ~.* GiB to train, more than the .* GiB available on cpu"):
        check_fits(huge, torch.device("cpu"))
    assert check_fits(mixtral_doc(), torch.device("cpu")) > 0


# ---- SPES on hf-tiny-mixtral -----------------------------------------------------------------------------

IDS = [f"peer{i}" for i in range(4)]
STEPS = 30
CONTEXT = 32
SETTINGS = ExchangeSettings(swarm="hf-spes", config_hash="c0ffee", codec=get_codec("fp32"), exchange_timeout_s=30.0)
OPTIMIZER = OptimizerConfig(algorithm="dadam", lr=1e-2, warmup_steps=5, total_steps=STEPS)


def mixtral_trainer(corpus: Corpus, peer_id: str) -> Trainer:
    from node.train.models.hf import build_hf_model

    config = TrainerConfig(optimizer=OPTIMIZER, batch_size=8, context=CONTEXT, device="cpu", precision="fp32",
                           eval_batch_size=64, eval_batches=6)
    return Trainer(build_hf_model(mixtral_doc(), seed=0), config, peer_id=peer_id,
                   train_tokens=peer_shard(corpus, peer_id), val_tokens=corpus.val)


@pytest.mark.unit
@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_spes_on_hf_tiny_mixtral_trains_shared_and_owned_experts_within_5_percent_of_dense(corpus: Corpus) -> None:
    from node.algorithms.spes.node import InMemoryExpertDirectory, SpesNode
    from node.algorithms.spes.partition import ModelPartition, spes_average

    async def dense() -> tuple[float, float]:
        net, nodes = InMemoryNetwork(), []
        for pid in IDS:
            trainer = mixtral_trainer(corpus, pid)
            peer = GossipPeer(net.transport(pid), SETTINGS, await trainer.tensors())
            await peer.start()
            nodes.append(GossipTrainer(trainer, peer))
        initial = await nodes[0].trainer.evaluate()
        lockstep = Lockstep(IDS, "ring")
        async with asyncio.timeout(600):
            await drive(nodes, STEPS, lockstep)
        loss = await nodes[0].trainer.evaluate(average_tensors([await n.trainer.tensors() for n in nodes]))
        for node in nodes:
            node.trainer.close()
        return initial, loss

    async def spes() -> tuple[float, list[SpesNode]]:
        config = SpesConfig(sync_every=1, merge_every=5, merge_until=12, alpha0=0.1, replication=2)
        ownership = assign_experts(IDS, dict.fromkeys(IDS, 2), 4, 2, config.replication)
        net, directory = InMemoryNetwork(), InMemoryExpertDirectory()
        nodes = [SpesNode(mixtral_trainer(corpus, pid), net.transport(pid), SETTINGS, config, ownership, directory)
                 for pid in IDS]
        for node in nodes:
            await node.start()
        lockstep = Lockstep(IDS, "ring")
        async with asyncio.timeout(600):
            await drive(nodes, STEPS, lockstep)
        members = {n.peer_id: await n.trainer.tensors() for n in nodes}
        loss = await nodes[0].trainer.evaluate(spes_average(members, nodes[0].ownership, nodes[0].partition))
        for node in nodes:
            node.trainer.close()
        return loss, nodes

    initial, dense_loss = asyncio.run(dense())
    spes_loss, nodes = asyncio.run(spes())
    assert dense_loss < initial - 1.0, "dense training did not learn"
    assert spes_loss <= 1.05 * dense_loss, f"SPES {spes_loss:.3f} vs dense {dense_loss:.3f} at {STEPS} steps"
    partition = ModelPartition.of(nodes[0].trainer.model)
    assert (partition.layers, partition.experts_per_layer) == (2, 4)
    for node in nodes:
        assert len(node.owned) == 2 * 2
        expected = set(partition.shared) | set(partition.names_of(node.owned))
        assert node.trainer.optimizer_parameter_names == expected
        assert set(node.trainer.trainable_parameter_names) == expected


# ---- export ------------------------------------------------------------------------------------------------


def write_average(data_dir: Path, model: str, tensors: dict[str, np.ndarray], tokenizer: Path | None = None) -> dict:
    from node.cli.main import parse_node_config
    from node.runtime.founding import swarm_document
    from node.train.checkpoint import SWARM_AVERAGE_FILE, save_checkpoint
    from node.train.tokenizer import store_in_cache

    flags = ["node", "--model", model] + (["--tokenizer", str(tokenizer)] if tokenizer else [])
    doc = swarm_document(parse_node_config(flags, {}), 1.0)
    if tokenizer is not None:
        store_in_cache(data_dir, tokenizer.read_bytes())
    save_checkpoint(data_dir / SWARM_AVERAGE_FILE, tensors, {
        "kind": "swarm-average", "swarm": "s", "config_hash": "h", "swarm_config": json.dumps(doc), "min_step": 9,
        "max_step": 10, "peers": json.dumps(["a", "b"]), "val_loss": 3.0})
    return doc


def perturbed(model: torch.nn.Module) -> dict[str, np.ndarray]:
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return {n: p.detach().numpy().reshape(-1).copy() for n, p in model.named_parameters()}


@pytest.mark.unit
@pytest.mark.slow
def test_an_hf_moe_export_loads_in_transformers_with_the_averages_logits(tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from node.swarm.export import ExportSource, export_data_dir
    from node.swarm.recipe import SwarmSettings
    from node.train.data import synthetic_text
    from node.train.models.hf import build_hf_model
    from node.train.tokenizer import train_bpe

    tokenizer = tmp_path / "tokenizer.json"
    train_bpe(synthetic_text(0, 100_000).decode().split("\n\n"), 300, tokenizer)
    doc = write_average(tmp_path, "hf-tiny-mixtral", {}, tokenizer)
    recipe = SwarmSettings.from_doc(doc).training
    model = build_hf_model(recipe.model_config, recipe.seed)
    tensors = perturbed(model)
    write_average(tmp_path, "hf-tiny-mixtral", tensors, tokenizer)
    kind, manifest = export_data_dir(tmp_path, tmp_path / "out")
    assert kind is ExportSource.AVERAGE and manifest["peers"] == ["a", "b"] and manifest["max_step"] == 10
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    hf_tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    ids = hf_tokenizer("Nora found the little lantern", return_tensors="pt").input_ids
    with torch.no_grad():
        np.testing.assert_allclose(loaded(input_ids=ids).logits.numpy(), model(ids)[0].numpy(), atol=1e-5, rtol=0)
    card = (tmp_path / "out" / "README.md").read_text()
    assert "MixtralForCausalLM" in card and "| `a` | not recorded | 50.0% |" in card and "| `b` | not recorded | 50.0% |" in card
    with pytest.raises(FileExistsError):
        export_data_dir(tmp_path, tmp_path / "out")
    export_data_dir(tmp_path, tmp_path / "out", force=True)


@pytest.mark.unit
@pytest.mark.slow
def test_an_embedded_model_exports_one_safetensors_tensor_per_parameter_in_its_shape(tmp_path) -> None:
    from safetensors.numpy import load_file

    from node.swarm.export import export_data_dir
    from node.train.models import build_named_model

    model = build_named_model("moe", seed=0)
    tensors = perturbed(model)
    write_average(tmp_path, "moe", tensors)
    export_data_dir(tmp_path, tmp_path / "out")
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert {n: w.shape for n, w in weights.items()} == shapes
    assert all(np.array_equal(weights[n].reshape(-1), tensors[n]) for n in shapes)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["murmur_model"] == "moe" and config["config"]["experts"] == 8 and config["vocab"] == "bytes"


@pytest.mark.unit
def test_export_and_tokenizer_commands_refuse_bad_input_with_exit_2_and_one_line(tmp_path, capsys) -> None:
    from node.cli.main import main

    (tmp_path / "empty").mkdir()
    assert main(["export", "--to", str(tmp_path / "out"), "--data-dir", str(tmp_path / "empty")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"murmur export: error: {tmp_path / 'empty'} has no swarm-average.safetensors or checkpoint.safetensors "
        "(is it a node's --data-dir?)"]
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    assert main(["export", "--to", str(tmp_path / "taken"), "--data-dir", str(tmp_path / "empty")]) == 2
    assert "exists and is not empty (add --force" in capsys.readouterr().err
    assert main(["tokenizer", "train", "--data", str(tmp_path / "missing"), "--vocab", "300"]) == 2
    assert capsys.readouterr().err.strip() == (f"murmur tokenizer: error: --data {tmp_path / 'missing'}: no such file, "
                                               "directory or glob match")
    with pytest.raises(SystemExit) as exited:
        main(["tokenizer", "train", "--data", str(tmp_path), "--vocab", "100"])
    assert exited.value.code == 2 and "100 is below the minimum 257" in capsys.readouterr().err


@pytest.mark.unit
@pytest.mark.slow  # imports transformers (seconds)
def test_a_config_transformers_cannot_build_a_model_from_is_one_clear_line() -> None:
    from node.train.models.hf import HfModelInvalid, build_hf_model

    # within every bound, but DBRX's attention needs attn_config.rope_theta
    doc = {"model_type": "dbrx", "vocab_size": 256, "d_model": 32, "n_heads": 4, "n_layers": 1, "max_seq_len": 64,
           "attn_config": {"kv_n_heads": 2}, "ffn_config": {"ffn_hidden_size": 16, "moe_num_experts": 4, "moe_top_k": 2}}
    with pytest.raises(HfModelInvalid, match=r"^transformers cannot build a 'dbrx' model from this config: \w+Error: "):
        build_hf_model(doc, seed=0)
