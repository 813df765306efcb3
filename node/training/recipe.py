"""The swarm's shared recipe: the document the founder publishes under `<swarm>.config` (topology,
codec, round timing, mixing, and what is trained with which optimizer) and the validated settings a
node reads back from it, so every peer of a swarm gossips and trains the same way."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, cast

from gossip.choco import ChocoSettings, check_topology, default_gamma
from gossip.codecs import Codec, Fp32Codec, get_codec
from gossip.mixing import MixingRule
from gossip.optimizers import Algorithm, OptimizerConfig
from gossip.spes import SpesConfig
from node.config import EMBEDDED_MODEL_NAMES, VECTOR_MODEL, NodeConfig
from node.training.rounds import RoundClock
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
    if swarm_model in (*EMBEDDED_MODEL_NAMES, VECTOR_MODEL) or swarm_model == own_model:
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

    def to_doc(self) -> dict[str, Any]:
        o = self.optimizer
        doc = {"kind": PayloadKind.MODEL.value, "model": self.model, "seed": self.seed, "batch_size": self.batch_size,
               "context": self.context, "steps": self.steps,
               "optimizer": {"algorithm": o.algorithm, "lr": o.lr, "warmup_steps": o.warmup_steps,
                             "local_steps": o.local_steps, "micro_batches": o.micro_batches}}
        if self.spes is not None:  # absent when off, so a swarm without SPES keeps its config hash
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
                   spes=_spes_from_doc(doc["spes"]) if doc.get("spes") is not None else None)


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
    """The recipe a founder publishes from its own settings; None for the vector payload."""
    t = config.training
    if not t.trains_model:
        return None
    spes = SpesConfig(sync_every=t.spes_sync_every, merge_every=t.spes_merge_every, merge_until=t.spes_merge_until,
                      alpha0=t.spes_alpha0, replication=t.spes_replication,
                      refresh_codec=t.spes_refresh_codec, expert_codec=t.spes_expert_codec) if t.spes else None
    return TrainingRecipe(model=t.model, seed=config.seed, batch_size=t.batch_size, context=t.context, steps=t.steps,
                          optimizer=optimizer_config(t.optimizer, t.lr, t.warmup_steps, t.steps, t.local_steps,
                                                     t.micro_batches), spes=spes)


def swarm_document(config: NodeConfig, epoch: float) -> dict[str, Any]:
    """What the founder publishes under `<swarm>.config`; joiners take these settings from it."""
    topo = config.gossip.topology
    recipe = training_recipe(config)
    doc: dict[str, Any] = {
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
    # absent when unused, so a swarm without them keeps its config hash
    if config.gossip.codec == "topk":
        doc["gossip"]["codec_options"] = {"ratio": config.gossip.topk_ratio}
    if config.gossip.compression == "choco":
        doc["gossip"]["compression"] = {"kind": "choco", "gamma": config.gossip.choco_gamma}
    return doc


def _compression(g: Mapping[str, Any], codec: Codec, mixing: MixingRule) -> ChocoSettings | None:
    """The swarm's compressed-gossip settings, if any (ValueError names what is wrong)."""
    doc = g.get("compression")
    if doc is None:
        return None
    if doc.get("kind") != "choco":
        raise ValueError(f"unknown gossip compression {doc.get('kind')!r}")
    gamma = doc.get("gamma")
    return ChocoSettings(codec=codec, gamma=default_gamma(codec) if gamma is None else float(gamma), rule=mixing)


@dataclass(frozen=True)
class SwarmSettings:
    """The shared settings read back from a swarm document (validated by `from_doc`)."""

    topology: TopologySpec
    codec: Codec  # of whole tensors: rounds, downloads (fp32 under compressed gossip)
    clock: RoundClock
    max_staleness: int
    mixing: MixingRule
    dim: int  # floats of the vector payload; 0 when a model is trained
    training: TrainingRecipe | None
    choco: ChocoSettings | None = None  # compressed gossip: its codec is the one of the differences

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
            codec = get_codec(g["codec"], **g.get("codec_options", {}))
            mixing = MixingRule(**g["mixing"])
            topology = TopologySpec(t["name"], weights=t["weights"], degree=t["degree"], seed=t["seed"],
                                    rows=t["rows"], edges=tuple(tuple(e) for e in t["edges"]), directed=t["directed"])
            choco = _compression(g, codec, mixing)
            if choco is not None:
                check_topology(topology)
            elif codec.name == "topk":
                raise ValueError("codec topk is sound on differences only, and the swarm gossips whole parameters")
            return cls(
                topology=topology,
                codec=Fp32Codec() if choco is not None else codec,
                clock=RoundClock(float(doc["epoch"]), float(g["round_interval_s"])),
                max_staleness=int(g["max_staleness_rounds"]),
                mixing=mixing,
                dim=int(payload["dim"]) if kind is PayloadKind.VECTOR else 0,
                training=TrainingRecipe.from_doc(payload) if kind is PayloadKind.MODEL else None,
                choco=choco,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RecipeInvalid(f"the swarm's config is invalid: {exc}") from None


def same_payload(doc: dict[str, Any], config: NodeConfig) -> bool:
    """Whether a founder restarting with `config` may keep the swarm document `doc` of its checkpoint."""
    return doc.get("version") == SWARM_CONFIG_VERSION and doc.get("payload") == swarm_document(config, 0.0)["payload"]
