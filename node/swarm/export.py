"""Export a swarm's model to a directory other tools read (docs/training.md, "Export").

- A Hugging Face model: a `save_pretrained` directory (config.json, generation_config.json,
  model.safetensors, and the swarm's tokenizer as tokenizer.json + tokenizer_config.json) that
  `transformers.AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load. The
  per-expert parameters murmur trains are stacked back into transformers' fused expert tensors.
- The embedded GPT (or a user model): model.safetensors with one tensor per `named_parameters()`
  name in its own shape (float32), config.json ({"murmur_model": name, "config": the GPT's
  ModelConfig fields, "vocab": "bytes" or "tokenizer.json"}), the swarm's tokenizer.json (its exact
  bytes) and tokenizer_config.json.

A swarm without a tokenizer file trains on bytes (id = UTF-8 byte): its export carries that byte
vocabulary as a tokenizer.json (node.train.tokenizer.byte_tokenizer_json), so `AutoTokenizer` loads
every export. Every export also writes murmur.json: what was exported (kind, swarm, config hash,
steps, peers), and README.md, its model card (node.swarm.model_card).
A directory is written beside its destination, fsynced and renamed into place
(node.train.durable.replace_directory); an existing one is kept as `<dir>.prev` (the periodic
swarm-average export), replaced only once the new one is complete (`murmur export --force`: swapped
in one atomic step, then removed), or refused (`murmur export` without --force). A kill at any
point leaves the old export or the new one complete at the destination.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from node.swarm.contributors import parse_contributors
from node.swarm.model_card import CARD_FILE, ModelFacts, model_card
from node.swarm.recipe import SwarmSettings, TrainingRecipe, embedded_options
from node.train.checkpoint import CHECKPOINT_FILE, SWARM_AVERAGE_FILE, Checkpoint, load_checkpoint
from node.train.durable import replace_directory
from node.train.tokenizer import EOS, BpeTokenizer, byte_tokenizer_json, cache_path

MODEL_FILE = "model.safetensors"
MANIFEST_FILE = "murmur.json"
PARAM_PREFIX = "param/"  # a checkpoint's parameters (Trainer.state())


class ExportFailed(ValueError):
    """Nothing to export, or it cannot be exported (one line, says why)."""


class ExportSource(StrEnum):
    """Which model of a data directory `murmur export` writes."""

    AVERAGE = "average"  # swarm-average.safetensors: the swarm's model
    CHECKPOINT = "checkpoint"  # checkpoint.safetensors: this node's own parameters


def read_source(data_dir: Path, source: ExportSource | None) -> tuple[ExportSource, Checkpoint]:
    """The parameters to export from a node's data directory: `source`, or by default the swarm
    average where one was written, else the node's checkpoint."""
    order = [source] if source is not None else [ExportSource.AVERAGE, ExportSource.CHECKPOINT]
    for kind in order:
        path = data_dir / (SWARM_AVERAGE_FILE if kind is ExportSource.AVERAGE else CHECKPOINT_FILE)
        checkpoint = load_checkpoint(path)
        if checkpoint is not None:
            return kind, checkpoint
    wanted = " or ".join(SWARM_AVERAGE_FILE if k is ExportSource.AVERAGE else CHECKPOINT_FILE for k in order)
    raise ExportFailed(f"{data_dir} has no {wanted} (is it a node's --data-dir?)")


def parameters_of(kind: ExportSource, checkpoint: Checkpoint) -> dict[str, np.ndarray]:
    if kind is ExportSource.AVERAGE:
        return dict(checkpoint.tensors)
    return {k[len(PARAM_PREFIX):]: v for k, v in checkpoint.tensors.items() if k.startswith(PARAM_PREFIX)}


def recipe_of(meta: Mapping[str, Any]) -> TrainingRecipe:
    """The training recipe a checkpoint's or swarm average's swarm config names."""
    raw = meta.get("swarm_config")
    if raw is None:
        raise ExportFailed("the file carries no swarm config (written by an older murmur?)")
    recipe = SwarmSettings.from_doc(json.loads(str(raw))).training
    if recipe is None:
        raise ExportFailed("the swarm trains no model (vector mode): nothing to export")
    return recipe


def tokenizer_bytes(recipe: TrainingRecipe, data_dir: Path) -> bytes | None:
    """The swarm's tokenizer from the node's cache (every training node keeps it there)."""
    if recipe.tokenizer is None:
        return None
    path = cache_path(data_dir, recipe.tokenizer.sha256)
    if not path.is_file():
        raise ExportFailed(f"the swarm's tokenizer ({recipe.tokenizer.sha256[:16]}...) is not in {path.parent}")
    return path.read_bytes()


def _load_into(model: nn.Module, tensors: Mapping[str, np.ndarray]) -> None:
    params = dict(model.named_parameters())
    if set(params) != set(tensors):
        missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
        raise ExportFailed(f"the parameters do not match the swarm's model: missing {missing[:3]}, unknown {extra[:3]}")
    with torch.no_grad():
        for name, p in params.items():
            value = np.asarray(tensors[name], dtype=np.float32)
            if value.size != p.numel():
                raise ExportFailed(f"parameter {name} has {value.size} values, the model {p.numel()}")
            p.copy_(torch.from_numpy(value.reshape(p.shape)))


def _write_tokenizer(directory: Path, data: bytes | None, model_config: Any | None = None) -> None:
    """tokenizer.json and tokenizer_config.json that AutoTokenizer loads: the swarm's BPE file (its
    special tokens all EOS), or with None the byte vocabulary (no special token: the byte tokenizer has none)."""
    from tokenizers import Tokenizer

    from node.train.models.hf import transformers_module

    fast = transformers_module().PreTrainedTokenizerFast
    if data is None:
        tokenizer = fast(tokenizer_object=Tokenizer.from_str(byte_tokenizer_json().decode("utf-8")))
    else:
        tokenizer = fast(tokenizer_object=Tokenizer.from_str(data.decode("utf-8")), eos_token=EOS, bos_token=EOS,
                         unk_token=EOS, pad_token=EOS)
    tokenizer.model_max_length = int(getattr(model_config, "max_position_embeddings", 0) or 0) or tokenizer.model_max_length
    tokenizer.save_pretrained(str(directory))


def _vocabulary(recipe: TrainingRecipe) -> str:
    t = recipe.tokenizer
    return "bytes (256 ids, id = UTF-8 byte)" if t is None else f"BPE, {t.vocab_size} tokens (tokenizer sha256 `{t.sha256}`)"


def _write_hf(directory: Path, recipe: TrainingRecipe, tensors: Mapping[str, np.ndarray], tokenizer: bytes | None) -> ModelFacts:
    from node.train.models.experts import fuse_state_dict
    from node.train.models.hf import build_hf_model, hf_config, transformers_module

    transformers_module().utils.logging.disable_progress_bar()  # no progress bars in a node's log

    assert recipe.model_config is not None
    model = build_hf_model(recipe.model_config, recipe.seed)
    _load_into(model, tensors)
    state = fuse_state_dict(model.lm.state_dict(), model.lm)
    config = hf_config(recipe.model_config)
    if tokenizer is not None:
        config.eos_token_id = config.bos_token_id = config.pad_token_id = BpeTokenizer(tokenizer).eos_id
    fresh = transformers_module().AutoModelForCausalLM.from_config(config, trust_remote_code=False, dtype=torch.float32)
    fresh.load_state_dict(state, strict=True)
    if tokenizer is not None:
        fresh.generation_config.eos_token_id = fresh.generation_config.pad_token_id = config.eos_token_id
    fresh.save_pretrained(str(directory), safe_serialization=True)
    _write_tokenizer(directory, tokenizer, config)
    architecture = ", ".join(getattr(fresh.config, "architectures", None) or [type(fresh).__name__])
    return ModelFacts(f"{architecture} (`{config.model_type}`, {config.num_hidden_layers} layers, hidden size "
                      f"{config.hidden_size})", sum(p.numel() for p in fresh.parameters()), True, _vocabulary(recipe))


def _write_plain(directory: Path, recipe: TrainingRecipe, tensors: Mapping[str, np.ndarray], tokenizer: bytes | None) -> ModelFacts:
    from node.train.checkpoint import write_safetensors
    from node.train.models import build_named_model

    model = build_named_model(recipe.model, seed=recipe.seed, options=embedded_options(recipe))
    _load_into(model, tensors)
    shaped = {name: p.detach().numpy() for name, p in model.named_parameters()}
    with open(directory / MODEL_FILE, "wb") as f:
        write_safetensors(f, shaped, {"format": "pt", "murmur_model": recipe.model})
    model_config: Any = getattr(model, "config", None)
    fields: dict[str, Any] | None = model_config.to_dict() if hasattr(model_config, "to_dict") else None
    config = {"murmur_model": recipe.model, "config": fields,
              "vocab": "tokenizer.json" if tokenizer is not None else "bytes"}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _write_tokenizer(directory, tokenizer, None)
    if tokenizer is not None:
        (directory / "tokenizer.json").write_bytes(tokenizer)  # the swarm's own bytes: its sha256 is the config's
    described = ", ".join(f"{k} {v}" for k, v in (fields or {}).items() if k in ("layers", "width", "heads", "experts"))
    return ModelFacts(f"murmur's `{recipe.model}` (node.train.models)" + (f": {described}" if described else ""),
                      sum(p.numel() for p in model.parameters()), False, _vocabulary(recipe))


def write_export(directory: Path, recipe: TrainingRecipe, tensors: Mapping[str, np.ndarray], tokenizer: bytes | None,
                 manifest: Mapping[str, Any], swarm_doc: Mapping[str, Any] | None = None) -> None:
    """Fill `directory` (existing, empty) with the export of `tensors` (flat float32 per parameter name);
    `swarm_doc`, the swarm's config document, gives the model card its gossip settings."""
    if recipe.model_config is not None:
        facts = _write_hf(directory, recipe, tensors, tokenizer)
    else:
        facts = _write_plain(directory, recipe, tensors, tokenizer)
    (directory / MANIFEST_FILE).write_text(json.dumps(dict(manifest), indent=2, default=str) + "\n")
    (directory / CARD_FILE).write_text(model_card(recipe, manifest, facts, swarm_doc), encoding="utf-8")


def swarm_doc_of(meta: Mapping[str, Any]) -> dict[str, Any] | None:
    """The swarm config document a checkpoint's or swarm average's meta carries, if any."""
    raw = meta.get("swarm_config")
    doc = json.loads(str(raw)) if raw is not None else None
    return doc if isinstance(doc, dict) else None


def export_data_dir(data_dir: Path, destination: Path, source: ExportSource | None = None,
                    force: bool = False) -> tuple[ExportSource, dict[str, Any]]:
    """`murmur export --data-dir`: the chosen model of a node's data directory to `destination`."""
    kind, checkpoint = read_source(data_dir, source)
    recipe = recipe_of(checkpoint.meta)
    tokenizer = tokenizer_bytes(recipe, data_dir)
    meta = checkpoint.meta
    manifest = {"kind": kind.value, "model": recipe.model, "swarm": meta.get("swarm"),
                "config_hash": meta.get("config_hash"), "step": meta.get("step", meta.get("max_step")),
                "min_step": meta.get("min_step"), "max_step": meta.get("max_step"),
                "peers": json.loads(str(meta["peers"])) if "peers" in meta else None,
                "peer_steps": json.loads(str(meta["peer_steps"])) if "peer_steps" in meta else None,
                "contributors": parse_contributors(meta.get("contributors")),
                "val_loss": meta.get("val_loss"), "written_by": meta.get("written_by"),
                "source": str(data_dir.absolute())}
    tensors = parameters_of(kind, checkpoint)
    swarm_doc = swarm_doc_of(meta)
    replace_directory(destination, lambda d: write_export(d, recipe, tensors, tokenizer, manifest, swarm_doc),
                      keep_previous=False, force=force)
    return kind, manifest


__all__ = [
    "CARD_FILE",
    "MANIFEST_FILE",
    "MODEL_FILE",
    "ExportFailed",
    "ExportSource",
    "export_data_dir",
    "read_source",
    "recipe_of",
    "replace_directory",
    "swarm_doc_of",
    "tokenizer_bytes",
    "write_export",
]
