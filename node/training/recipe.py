"""The swarm's shared recipe: the document the founder publishes under `<swarm>.config` (topology,
codec, round timing, mixing, and what is trained with which optimizer) and the validated settings a
node reads back from it, so every peer of a swarm gossips and trains the same way."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

from gossip.codecs import Codec, get_codec
from gossip.mixing import MixingRule
from gossip.optimizers import Algorithm, OptimizerConfig
from gossip.spes import SpesConfig
from node.config import EMBEDDED_MODEL_NAMES, HF_PRESET_NAMES, VECTOR_MODEL, NodeConfig
from node.training.rounds import RoundClock
from node.training.tokenizer import TokenizerSpec
from topology import TopologySpec

SWARM_CONFIG_VERSION = 2


class RecipeInvalid(ValueError):
    """The swarm's config document cannot be used by this murmur (one line, says why)."""


class PayloadKind(enum.StrEnum):
    """What a swarm gossips: a trained model, or a random vector of `dim` floats (vector mode)."""

    MODEL = "model"
    VECTOR = "vector"


def check_model_allowed(swarm_model: str, own_model: str) -> None:
    """Raise RecipeInvalid unless this node may build the swarm's model. A model named by import path
    is code that the swarm config (which any DHT peer can write) makes this node import and call, so a
    joiner runs it only if its own --model names the same builder; embedded models are always allowed."""
    if swarm_model in (*EMBEDDED_MODEL_NAMES, VECTOR_MODEL, *HF_PRESET_NAMES) or swarm_model == own_model:
        return
    if swarm_model.startswith("hf:"):  # a transformers config, carried by the swarm config: no code to run
        return
    raise RecipeInvalid(f"the swarm trains the model built by {swarm_model!r}, code this node would import and "
                        f"run; start it with --model {swarm_model} to allow that")


@dataclass(frozen=True)
class TrainingRecipe:
    """What every peer of a training swarm shares: the model and its initial seed, the optimizer,
    the per-node batch and the step budget."""

    model: str
    seed: int
    optimizer: OptimizerConfig
    batch_size: int
    context: int
    steps: int  # 0: until stopped
    spes: SpesConfig | None = None  # SPES's swarm-wide knobs when the MoE model is trained with it
    # a Hugging Face model's config document (node.training.models.hf), carried so joiners need no path
    model_config: dict[str, Any] | None = None
    weights_sha256: str | None = None  # the pretrained weights the swarm starts from (hf:PATH of a checkpoint)
    tokenizer: TokenizerSpec | None = None  # None: one token per byte

    def to_doc(self) -> dict[str, Any]:
        o = self.optimizer
        doc = {"kind": PayloadKind.MODEL.value, "model": self.model, "seed": self.seed, "batch_size": self.batch_size,
               "context": self.context, "steps": self.steps,
               "optimizer": {"algorithm": o.algorithm, "lr": o.lr, "warmup_steps": o.warmup_steps,
                             "local_steps": o.local_steps, "micro_batches": o.micro_batches}}
        # each absent when unset, so a swarm without them keeps its config hash
        if self.model_config is not None:
            doc["model_config"] = self.model_config
        if self.weights_sha256 is not None:
            doc["weights_sha256"] = self.weights_sha256
        if self.tokenizer is not None:
            doc["tokenizer"] = self.tokenizer.to_doc()
        if self.spes is not None:
            c = self.spes
            doc["spes"] = {"sync_every": c.sync_every, "merge_every": c.merge_every, "merge_until": c.merge_until,
                           "alpha0": c.alpha0, "replication": c.replication, "refresh_codec": c.refresh_codec,
                           "expert_codec": c.expert_codec}
        return doc

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> TrainingRecipe:
        o, steps = doc["optimizer"], int(doc["steps"])
        return cls(model=str(doc["model"]), seed=int(doc["seed"]), batch_size=int(doc["batch_size"]),
                   context=int(doc["context"]), steps=steps,
                   optimizer=optimizer_config(str(o["algorithm"]), float(o["lr"]), int(o["warmup_steps"]), steps,
                                              int(o["local_steps"]), int(o["micro_batches"])),
                   spes=_spes_from_doc(doc["spes"]) if doc.get("spes") is not None else None,
                   model_config=_model_config_from_doc(doc.get("model_config")),
                   weights_sha256=_sha256_from_doc(doc.get("weights_sha256")),
                   tokenizer=TokenizerSpec.from_doc(doc["tokenizer"]) if doc.get("tokenizer") is not None else None)


def embedded_options(recipe: TrainingRecipe) -> dict[str, Any] | None:
    """The embedded GPT's config overrides a recipe implies: a tokenizer's vocabulary instead of bytes."""
    if recipe.model in EMBEDDED_MODEL_NAMES and recipe.tokenizer is not None:
        return {"vocab_size": recipe.tokenizer.vocab_size}
    return None


def _model_config_from_doc(doc: object) -> dict[str, Any] | None:
    """A Hugging Face config from the network, bounded before anything reads it (ValueError says why)."""
    if doc is None:
        return None
    from node.training.models.hf import check_config_doc

    if not isinstance(doc, Mapping):
        raise ValueError(f"model_config must be an object, got {type(doc).__name__}")
    check_config_doc(doc)
    return dict(doc)


def _sha256_from_doc(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise ValueError(f"weights_sha256 {str(value)[:80]!r} is not 64 lowercase hex digits")
    return value


def _spes_from_doc(doc: dict[str, Any]) -> SpesConfig:
    """SpesConfig checks the values (ValueError names the bad one)."""
    return SpesConfig(sync_every=int(doc["sync_every"]), merge_every=int(doc["merge_every"]),
                      merge_until=int(doc["merge_until"]), alpha0=float(doc["alpha0"]),
                      replication=int(doc["replication"]), refresh_codec=str(doc["refresh_codec"]),
                      expert_codec=str(doc.get("expert_codec", "fp32")))


def optimizer_config(algorithm: str, lr: float, warmup_steps: int, steps: int, local_steps: int,
                     micro_batches: int) -> OptimizerConfig:
    """The optimizer of a recipe: warm-up, then a cosine to 0.1 lr at `steps` (flat when steps is 0)."""
    # OptimizerConfig refuses an unknown algorithm (ValueError)
    return OptimizerConfig(algorithm=cast(Algorithm, algorithm), lr=lr, warmup_steps=warmup_steps,
                           decay="cosine" if steps else "constant", total_steps=steps or None,
                           local_steps=local_steps, micro_batches=micro_batches)


def training_recipe(config: NodeConfig) -> TrainingRecipe | None:
    """The recipe a founder publishes from its own settings; None for the vector payload. Reads the
    tokenizer and a Hugging Face model's config (and hashes pretrained weights): RecipeInvalid says
    what is wrong with them."""
    t = config.training
    if not t.trains_model:
        return None
    try:
        model_config, weights_sha256, tokenizer = _model_and_tokenizer(t.model, t.tokenizer)
    except ValueError as exc:
        raise RecipeInvalid(str(exc)) from None
    spes = SpesConfig(sync_every=t.spes_sync_every, merge_every=t.spes_merge_every, merge_until=t.spes_merge_until,
                      alpha0=t.spes_alpha0, replication=t.spes_replication,
                      refresh_codec=t.spes_refresh_codec, expert_codec=t.spes_expert_codec) if t.spes else None
    return TrainingRecipe(model=t.model, seed=config.seed, batch_size=t.batch_size, context=t.context, steps=t.steps,
                          optimizer=optimizer_config(t.optimizer, t.lr, t.warmup_steps, t.steps, t.local_steps,
                                                     t.micro_batches), spes=spes, model_config=model_config,
                          weights_sha256=weights_sha256, tokenizer=tokenizer)


def _model_and_tokenizer(model: str, tokenizer: Path | None) -> tuple[dict[str, Any] | None, str | None,
                                                                        TokenizerSpec | None]:
    """A founder's model config, weights hash and tokenizer entry. A pretrained hf:PATH checkpoint with
    a tokenizer.json of its own trains with that tokenizer unless --tokenizer names another."""
    from node.training.models import is_hf_model
    from node.training.models.hf import read_source, weights_digest
    from node.training.tokenizer import read_tokenizer_file, spec_of

    spec = spec_of(read_tokenizer_file(tokenizer)) if tokenizer is not None else None
    if not is_hf_model(model):
        return None, None, spec
    source = read_source(model, spec.vocab_size if spec is not None else None)
    if spec is None and source.weights is not None and source.tokenizer is not None:
        spec = spec_of(read_tokenizer_file(source.tokenizer))
    if spec is not None and int(source.config.get("vocab_size", 0)) < spec.vocab_size:
        raise RecipeInvalid(f"--model {model}: vocab_size {source.config.get('vocab_size')} is smaller than the "
                            f"tokenizer's {spec.vocab_size}")
    return source.config, weights_digest(source.weights) if source.weights is not None else None, spec


def swarm_document(config: NodeConfig, epoch: float) -> dict[str, Any]:
    """What the founder publishes under `<swarm>.config`; joiners take these settings from it."""
    topo = config.gossip.topology
    recipe = training_recipe(config)
    return {
        "version": SWARM_CONFIG_VERSION,
        "epoch": epoch,
        "payload": recipe.to_doc() if recipe is not None else {"kind": PayloadKind.VECTOR.value, "dim": config.dim},
        "gossip": {
            "topology": {"name": topo.name, "weights": topo.weights, "degree": topo.degree, "seed": topo.seed,
                         "rows": topo.rows, "edges": [list(e) for e in topo.edges], "directed": topo.directed},
            "codec": config.gossip.codec,
            "round_interval_s": config.gossip.round_interval_s,
            "max_staleness_rounds": config.gossip.max_staleness_rounds,
            "mixing": asdict(config.gossip.mixing),
        },
    }


@dataclass(frozen=True)
class SwarmSettings:
    """The shared settings read back from a swarm document (validated by `from_doc`)."""

    topology: TopologySpec
    codec: Codec
    clock: RoundClock
    max_staleness: int
    mixing: MixingRule
    dim: int  # floats of the vector payload; 0 when a model is trained
    training: TrainingRecipe | None

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> SwarmSettings:
        if doc.get("version") != SWARM_CONFIG_VERSION:
            raise RecipeInvalid(f"the swarm's config has version {doc.get('version')!r}; "
                                f"this murmur reads {SWARM_CONFIG_VERSION}")
        try:
            g = doc["gossip"]
            t = g["topology"]
            payload = doc["payload"]
            if payload["kind"] not in tuple(PayloadKind):
                raise ValueError(f"unknown payload kind {payload['kind']!r}")
            kind = PayloadKind(payload["kind"])
            return cls(
                topology=TopologySpec(t["name"], weights=t["weights"], degree=t["degree"], seed=t["seed"],
                                      rows=t["rows"], edges=tuple(tuple(e) for e in t["edges"]), directed=t["directed"]),
                codec=get_codec(g["codec"]),
                clock=RoundClock(float(doc["epoch"]), float(g["round_interval_s"])),
                max_staleness=int(g["max_staleness_rounds"]),
                mixing=MixingRule(**g["mixing"]),
                dim=int(payload["dim"]) if kind is PayloadKind.VECTOR else 0,
                training=TrainingRecipe.from_doc(payload) if kind is PayloadKind.MODEL else None,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RecipeInvalid(f"the swarm's config is invalid: {exc}") from None


def same_payload(doc: dict[str, Any], config: NodeConfig) -> bool:
    """Whether a founder restarting with `config` may keep the swarm document `doc` of its checkpoint."""
    return doc.get("version") == SWARM_CONFIG_VERSION and doc.get("payload") == swarm_document(config, 0.0)["payload"]
