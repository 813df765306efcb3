"""Hugging Face causal language models, wrapped so the trainer sees forward(idx, targets) -> (logits, loss)
like the embedded GPT.

They are built with transformers from a model config (a seeded random init, the same on every node) or
from a local pretrained checkpoint.

transformers is imported only here and only when such a model is built, so the fast commands stay
fast. A swarm config carries the model config itself; it comes from the network, so its size and the
fields that decide memory are bounded before anything is built, the model's parameter count is
measured on the meta device (no memory) against this machine's memory, and remote code is never run.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from node.train.machine import available_ram
from node.train.models.experts import split_fused_experts
from node.train.models.seeded_init import seeded_uniform

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel

HF_PREFIX = "hf:"
# The presets: tiny configs that train on a CPU in seconds, for tests, demos and trying murmur out.
# Their vocab_size is the byte vocabulary unless a tokenizer sets it (node.train.tokenizer).
PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "hf-tiny-llama": MappingProxyType({
        "model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 192,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "initializer_range": 0.02, "bos_token_id": None,
        "eos_token_id": None}),
    "hf-tiny-mixtral": MappingProxyType({
        "model_type": "mixtral", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
        "num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.01, "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6, "initializer_range": 0.02, "bos_token_id": None, "eos_token_id": None}),
})
PRESET_NAMES = tuple(PRESETS)

# A model config from the network is untrusted: these bound it before transformers sees it.
MAX_CONFIG_BYTES = 32 << 10  # the whole swarm config is one DHT record of at most 64 KiB
CONFIG_BOUNDS: Mapping[str, int] = MappingProxyType({
    "num_hidden_layers": 512, "hidden_size": 65536, "intermediate_size": 262144, "moe_intermediate_size": 262144,
    "vocab_size": 1 << 21, "num_attention_heads": 1024, "num_key_value_heads": 1024, "head_dim": 4096,
    "max_position_embeddings": 1 << 21, "num_local_experts": 1024, "num_experts": 1024, "num_experts_per_tok": 64,
    "n_routed_experts": 1024, "n_shared_experts": 64,
})
# Keys that would make transformers import code, or read files, named by the config.
FORBIDDEN_KEYS = ("auto_map", "trust_remote_code", "_name_or_path", "quantization_config")
# value + gradient + two Adam moments, in float32: what a trained parameter costs
TRAINED_BYTES_PER_PARAMETER = 16


class HfModelInvalid(ValueError):
    """A Hugging Face model config or checkpoint that cannot be used (one line, says why)."""


def transformers_module() -> Any:
    """`transformers`, imported on first use (it takes seconds), typed loosely: its API is not annotated."""
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - a dependency; this names it if an install lacks it
        raise HfModelInvalid(f"Hugging Face models need the transformers package: {exc}") from None
    return transformers


# ---- the config: read, bounded, published ----------------------------------------------------------


def check_config_doc(doc: Mapping[str, Any]) -> None:
    """Refuse a config document that is too large, names code or files, or whose sizes are out of bounds."""
    if not isinstance(doc, Mapping):
        raise HfModelInvalid(f"the model config must be a JSON object, got {type(doc).__name__}")
    size = len(json.dumps(doc, default=str))
    if size > MAX_CONFIG_BYTES:
        raise HfModelInvalid(f"the model config has {size} bytes, more than {MAX_CONFIG_BYTES}")
    model_type = doc.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise HfModelInvalid("the model config has no model_type")
    for key in FORBIDDEN_KEYS:
        if doc.get(key):
            raise HfModelInvalid(f"the model config sets {key!r}, which murmur never follows (no remote code)")
    for key, limit in CONFIG_BOUNDS.items():
        value = doc.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
            raise HfModelInvalid(f"the model config's {key} is {value!r}; murmur accepts integers 1..{limit}")


def hf_config(doc: Mapping[str, Any]) -> PreTrainedConfig:
    """A transformers config from a checked document; only model types transformers itself knows."""
    check_config_doc(doc)
    transformers = transformers_module()
    values = {k: v for k, v in doc.items() if k != "model_type"}
    try:
        config = transformers.AutoConfig.for_model(doc["model_type"], **values)
    except (ValueError, TypeError, KeyError) as exc:
        raise HfModelInvalid(f"transformers cannot build a {doc['model_type']!r} config: {_first_line(exc)}") from None
    mapping = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if config.model_type not in mapping:
        raise HfModelInvalid(f"model type {config.model_type!r} is not a causal language model transformers knows")
    built: PreTrainedConfig = config
    return built


def config_doc(config: PreTrainedConfig) -> dict[str, Any]:
    """What the swarm config carries of a model config: its non-default values and model_type."""
    doc = config.to_diff_dict()
    doc.pop("transformers_version", None)
    for key in ("architectures", "dtype", "torch_dtype", *FORBIDDEN_KEYS):
        doc.pop(key, None)
    doc["model_type"] = config.model_type
    plain: dict[str, Any] = json.loads(json.dumps(doc))  # plain JSON types, as every peer will read them back
    return plain


@dataclass(frozen=True)
class HfSource:
    """What `--model` names, on the founder: the config document, and where pretrained weights and a
    tokenizer lie when it names a checkpoint directory."""

    config: dict[str, Any]
    weights: Path | None = None  # a directory with *.safetensors (from_pretrained), or None: random init
    tokenizer: Path | None = None  # the checkpoint's own tokenizer.json, if it has one


def read_source(name: str, vocab_size: int | None = None) -> HfSource:
    """The model `name` (a preset, or hf:PATH of a config directory, a config.json or a pretrained
    checkpoint), with `vocab_size` from the swarm's tokenizer (a preset takes it; a config must hold it)."""
    if name in PRESETS:
        doc = dict(PRESETS[name])
        if vocab_size is not None:
            doc["vocab_size"] = vocab_size
        return HfSource(config_doc(hf_config(doc)))
    if not name.startswith(HF_PREFIX):
        raise HfModelInvalid(f"{name!r} is not a Hugging Face model (a preset or hf:PATH)")
    path = Path(name[len(HF_PREFIX):]).expanduser()
    config_file = path if path.is_file() else path / "config.json"
    if not config_file.is_file():
        raise HfModelInvalid(f"--model {name}: {config_file} does not exist (give a directory with config.json)")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise HfModelInvalid(f"--model {name}: cannot read {config_file}: {exc}") from None
    config = hf_config({k: v for k, v in raw.items() if k not in ("architectures", "transformers_version")})
    directory = config_file.parent
    weights = directory if any(directory.glob("*.safetensors")) else None
    if vocab_size is not None and config.vocab_size < vocab_size:
        raise HfModelInvalid(f"--model {name}: its vocab_size {config.vocab_size} is smaller than the tokenizer's "
                             f"{vocab_size}")
    tokenizer = directory / "tokenizer.json"
    return HfSource(config_doc(config), weights, tokenizer if tokenizer.is_file() else None)


def weights_digest(directory: Path) -> str:
    """sha256 over a checkpoint's safetensors files (names and bytes, in name order): which pretrained
    weights a swarm starts from."""
    digest = hashlib.sha256()
    for path in sorted(directory.glob("*.safetensors")):
        digest.update(path.name.encode() + b"\x00")
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


# ---- memory ------------------------------------------------------------------------------------------


def parameter_count(doc: Mapping[str, Any]) -> int:
    """Parameters of the model a config builds, counted on the meta device (nothing is allocated)."""
    config = hf_config(doc)
    with torch.device("meta"):
        model = transformers_module().AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    return sum(p.numel() for p in model.parameters())


def available_memory(device: torch.device) -> int:
    """Bytes this node may give a model: free GPU memory on CUDA, else the system's MemAvailable."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return available_ram()


def check_fits(doc: Mapping[str, Any], device: torch.device) -> int:
    """Refuse a model whose training state would not fit here (a forged or huge config must not OOM a
    joiner); returns its parameter count."""
    count = parameter_count(doc)
    needed, have = count * TRAINED_BYTES_PER_PARAMETER, available_memory(device)
    if needed > have:
        raise HfModelInvalid(f"the swarm's model has {count:,} parameters, ~{needed / 2**30:.1f} GiB to train, more "
                             f"than the {have / 2**30:.1f} GiB available on {device}")
    return count


# ---- the model -----------------------------------------------------------------------------------------


class HfCausalLM(nn.Module):
    """A transformers causal LM as murmur trains it: forward(idx, targets) -> (logits, loss), where the
    loss is the next-token cross-entropy of `targets` (already shifted, as murmur's batches are) plus,
    for an MoE, router_aux_loss_coef times transformers' load-balancing loss. Its experts are split
    per expert (node.train.models.experts); `config_doc` is what the swarm config carries."""

    def __init__(self, lm: PreTrainedModel, doc: Mapping[str, Any]) -> None:
        super().__init__()
        self.lm = lm
        self.config_doc = dict(doc)
        lm.config.use_cache = False
        self.context = int(getattr(lm.config, "max_position_embeddings", 0) or 0) or None
        self.vocab_size = int(lm.config.vocab_size)
        self._router_loss = hasattr(lm.config, "output_router_logits")
        self._aux_coef = float(getattr(lm.config, "router_aux_loss_coef", 0.0) or 0.0)
        self.last_aux_loss = torch.zeros(())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        kwargs = {"output_router_logits": True} if self._router_loss and targets is not None else {}
        out = self.lm(input_ids=idx, use_cache=False, **kwargs)
        logits: torch.Tensor = out.logits
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        aux = getattr(out, "aux_loss", None)
        if aux is not None:
            self.last_aux_loss = aux.detach()
            loss = loss + self._aux_coef * aux
        return logits, loss


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


@torch.no_grad()
def seeded_init(model: nn.Module, seed: int, std: float) -> None:
    """Every parameter transformers initialised randomly gets values drawn from (seed, its name) with
    standard deviation `std` (uniform, bit-identical on every machine, as the embedded GPT's); constant
    ones (norm weights of one, zero biases) keep their value, which is the same everywhere already."""
    for name, p in model.named_parameters():
        if p.numel() == 0 or bool((p == p.reshape(-1)[0]).all()):
            continue
        p.copy_(seeded_uniform(tuple(p.shape), std, seed, name).to(p.dtype))


def build_hf_model(doc: Mapping[str, Any], seed: int, weights: Path | None = None) -> HfCausalLM:
    """The model of a config document: from `weights` (a local checkpoint directory) when given, else
    randomly initialised from `seed`, identically on every machine. float32, on the CPU."""
    config = hf_config(doc)
    transformers = transformers_module()
    if weights is not None:
        try:
            lm = transformers.AutoModelForCausalLM.from_pretrained(
                str(weights), config=config, local_files_only=True, trust_remote_code=False, dtype=torch.float32)
        except (OSError, ValueError) as exc:
            raise HfModelInvalid(f"cannot load the weights in {weights}: {_first_line(exc)}") from None
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # transformers' own init, overwritten below where it is random
            try:
                lm = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=False,
                                                                   dtype=torch.float32)
            # a config that passed the bounds may still be one a model class cannot be built from (a
            # field it needs left out): one line, not a traceback from inside transformers
            except (AttributeError, KeyError, IndexError, TypeError, ValueError, RuntimeError) as exc:
                raise HfModelInvalid(f"transformers cannot build a {config.model_type!r} model from this config: "
                                     f"{type(exc).__name__}: {_first_line(exc)}") from None
    lm.float()
    split_fused_experts(lm)
    model = HfCausalLM(lm, doc)
    if weights is None:
        std = float(getattr(config, "initializer_range", 0.02) or 0.02)
        if not math.isfinite(std) or not 0.0 < std < 1.0:
            raise HfModelInvalid(f"the model config's initializer_range {std!r} is not in (0, 1)")
        seeded_init(model, seed, std)
    return model


__all__ = [
    "CONFIG_BOUNDS",
    "HF_PREFIX",
    "PRESETS",
    "PRESET_NAMES",
    "HfCausalLM",
    "HfModelInvalid",
    "HfSource",
    "available_memory",
    "build_hf_model",
    "check_config_doc",
    "check_fits",
    "config_doc",
    "hf_config",
    "parameter_count",
    "read_source",
    "transformers_module",
    "weights_digest",
]
