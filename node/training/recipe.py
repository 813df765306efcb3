"""The swarm's shared recipe: the document the founder publishes under `<swarm>.config` (topology,
codec, round timing, mixing, and what is trained with which optimizer) and the validated settings a
node reads back from it, so every peer of a swarm gossips and trains the same way."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, cast

from gossip.codecs import Codec, get_codec
from gossip.diloco import DilocoConfig
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
    diloco: DilocoConfig | None = None  # gossip DiLoCo's outer loop, with --optimizer diloco
    final_merge: bool = False  # every node averages all live peers' final models at the end of the budget

    @property
    def inner_optimizer(self) -> OptimizerConfig:
        """The optimizer the trainer steps with: gossip DiLoCo's inner one under diloco, else the optimizer."""
        if self.diloco is None:
            return self.optimizer
        return replace(self.optimizer, algorithm=cast(Algorithm, self.diloco.inner_algorithm))

    def to_doc(self) -> dict[str, Any]:
        o = self.optimizer
        optimizer: dict[str, Any] = {"algorithm": o.algorithm, "lr": o.lr, "warmup_steps": o.warmup_steps,
                                     "local_steps": o.local_steps, "micro_batches": o.micro_batches}
        doc: dict[str, Any] = {"kind": PayloadKind.MODEL.value, "model": self.model, "seed": self.seed,
                               "batch_size": self.batch_size, "context": self.context, "steps": self.steps,
                               "optimizer": optimizer}
        if self.diloco is not None:  # absent unless diloco, so other swarms keep their config hash
            d = self.diloco
            optimizer["diloco"] = {"outer_lr": d.outer_lr, "outer_momentum": d.outer_momentum,
                                          "fragments": d.fragments, "overlap": d.overlap, "qsr_alpha": d.qsr_alpha,
                                          "anchor_every": d.anchor_every, "anchor_codec": d.anchor_codec,
                                          "inner": d.inner}
        if self.final_merge:
            doc["final_merge"] = True
        if self.spes is not None:  # absent when off, so a swarm without SPES keeps its config hash
            c = self.spes
            doc["spes"] = {"sync_every": c.sync_every, "merge_every": c.merge_every, "merge_until": c.merge_until,
                           "alpha0": c.alpha0, "replication": c.replication, "refresh_codec": c.refresh_codec,
                           "expert_codec": c.expert_codec, "shared_codec": c.shared_codec,
                           "delta_refresh": c.delta_refresh, "outer_lr": c.outer_lr,
                           "outer_momentum": c.outer_momentum, "anchor_every": c.anchor_every}
        return doc

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> TrainingRecipe:
        o, steps = doc["optimizer"], int(doc["steps"])
        if (o["algorithm"] == "diloco") != (o.get("diloco") is not None):
            raise ValueError("the optimizer's diloco knobs come with algorithm 'diloco' and only with it")
        return cls(model=str(doc["model"]), seed=int(doc["seed"]), batch_size=int(doc["batch_size"]),
                   context=int(doc["context"]), steps=steps,
                   optimizer=optimizer_config(str(o["algorithm"]), float(o["lr"]), int(o["warmup_steps"]), steps,
                                              int(o["local_steps"]), int(o["micro_batches"])),
                   spes=_spes_from_doc(doc["spes"]) if doc.get("spes") is not None else None,
                   diloco=_diloco_from_doc(o["diloco"]) if o.get("diloco") is not None else None,
                   final_merge=_flag(doc.get("final_merge", False)))


def _flag(value: object) -> bool:
    if type(value) is not bool:
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def _diloco_from_doc(doc: dict[str, Any]) -> DilocoConfig:
    """DilocoConfig checks the values (ValueError names the bad one)."""
    return DilocoConfig(outer_lr=float(doc["outer_lr"]), outer_momentum=float(doc["outer_momentum"]),
                        fragments=int(doc["fragments"]), overlap=_flag(doc["overlap"]),
                        qsr_alpha=float(doc["qsr_alpha"]), anchor_every=int(doc["anchor_every"]),
                        anchor_codec=str(doc["anchor_codec"]), inner=str(doc["inner"]))


def _spes_from_doc(doc: dict[str, Any]) -> SpesConfig:
    """SpesConfig checks the values (ValueError names the bad one)."""
    return SpesConfig(sync_every=int(doc["sync_every"]), merge_every=int(doc["merge_every"]),
                      merge_until=int(doc["merge_until"]), alpha0=float(doc["alpha0"]),
                      replication=int(doc["replication"]), refresh_codec=str(doc["refresh_codec"]),
                      expert_codec=str(doc["expert_codec"]), shared_codec=str(doc["shared_codec"]),
                      delta_refresh=_flag(doc["delta_refresh"]), outer_lr=float(doc["outer_lr"]),
                      outer_momentum=float(doc["outer_momentum"]), anchor_every=int(doc["anchor_every"]))


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
                      refresh_codec=t.spes_refresh_codec, expert_codec=t.spes_expert_codec,
                      shared_codec=t.spes_shared_codec, delta_refresh=t.spes_delta_refresh, outer_lr=t.spes_outer_lr,
                      outer_momentum=t.spes_outer_momentum, anchor_every=t.spes_anchor_every) if t.spes else None
    diloco = DilocoConfig(outer_lr=t.outer_lr, outer_momentum=t.outer_momentum, fragments=t.fragments,
                          overlap=t.overlap, qsr_alpha=t.qsr_alpha, anchor_every=t.anchor_every,
                          anchor_codec=t.anchor_codec, inner=t.inner_optimizer) if t.optimizer == "diloco" else None
    final_merge = t.final_merge == "on" or (t.final_merge == "auto" and diloco is not None)
    return TrainingRecipe(model=t.model, seed=config.seed, batch_size=t.batch_size, context=t.context, steps=t.steps,
                          optimizer=optimizer_config(t.optimizer, t.lr, t.warmup_steps, t.steps, t.local_steps,
                                                     t.micro_batches), spes=spes, diloco=diloco, final_merge=final_merge)


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
            **({"codec_options": codec_options(config)} if codec_options(config) else {}),
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
                codec=get_codec(g["codec"], **_codec_options(g.get("codec_options", {}))),
                clock=RoundClock(float(doc["epoch"]), float(g["round_interval_s"])),
                max_staleness=int(g["max_staleness_rounds"]),
                mixing=MixingRule(**g["mixing"]),
                dim=int(payload["dim"]) if kind is PayloadKind.VECTOR else 0,
                training=TrainingRecipe.from_doc(payload) if kind is PayloadKind.MODEL else None,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RecipeInvalid(f"the swarm's config is invalid: {exc}") from None

    def __post_init__(self) -> None:
        if self.codec.name == "topk" and (self.training is None or self.training.diloco is None):
            raise RecipeInvalid("the swarm's config is invalid: codec topk drops most of each tensor and is sound "
                                "only on gossip DiLoCo's pseudo-gradients, not on whole parameters")


def codec_options(config: NodeConfig) -> dict[str, float]:
    """The options of the swarm's codec that go into its document (top-k's ratio)."""
    return {"ratio": config.gossip.topk_ratio} if config.gossip.codec == "topk" else {}


def _codec_options(options: object) -> dict[str, float]:
    if not isinstance(options, dict) or not all(isinstance(k, str) and type(v) in (int, float)
                                                for k, v in options.items()):
        raise ValueError(f"codec options must map names to numbers, got {options!r}")
    return options


def same_payload(doc: dict[str, Any], config: NodeConfig) -> bool:
    """Whether a founder restarting with `config` may keep the swarm document `doc` of its checkpoint."""
    return doc.get("version") == SWARM_CONFIG_VERSION and doc.get("payload") == swarm_document(config, 0.0)["payload"]
