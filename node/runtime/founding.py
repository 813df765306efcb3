"""The founder's side of the swarm's recipe: the document a founder publishes under `<swarm>.config`,
built from its own settings (a `NodeConfig`), and whether a restarting founder may keep the one it
published. The document's schema and what a node reads back from it are in node.swarm.recipe; this
module is the only one that reads both a NodeConfig and the schema, as the layers allow (runtime
above config above swarm)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from gossip.diloco import DilocoConfig
from gossip.spes import SpesConfig
from node.config import NodeConfig
from node.swarm.recipe import (
    SWARM_CONFIG_VERSION,
    AdmissionDoc,
    AdmissionMode,
    PayloadKind,
    RecipeInvalid,
    SwarmDocument,
    TrainingRecipe,
    document_dict,
    optimizer_config,
    parse_document,
)
from node.train.model_names import HF_PRESET_NAMES
from node.train.tokenizer import TokenizerSpec


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
                      refresh_codec=t.spes_refresh_codec, expert_codec=t.spes_expert_codec,
                      shared_codec=t.spes_shared_codec, delta_refresh=t.spes_delta_refresh, outer_lr=t.spes_outer_lr,
                      outer_momentum=t.spes_outer_momentum, anchor_every=t.spes_anchor_every) if t.spes else None
    diloco = DilocoConfig(outer_lr=t.outer_lr, outer_momentum=t.outer_momentum, fragments=t.fragments,
                          overlap=t.overlap, qsr_alpha=t.qsr_alpha, outer_warmup=t.outer_warmup, phase_seconds=t.phase_seconds,
                          anchor_every=t.anchor_every,
                          anchor_codec=t.anchor_codec, inner=t.inner_optimizer) if t.optimizer == "diloco" else None
    final_merge = t.final_merge == "on" or (t.final_merge == "auto" and diloco is not None)
    try:  # refuses --adam-accumulate above 1 outside dadam, for one
        optimizer = optimizer_config(t.optimizer, t.lr, t.warmup_steps, t.steps, t.local_steps, t.micro_batches,
                                     adam_accumulate=t.adam_accumulate)
    except ValueError as exc:
        raise RecipeInvalid(str(exc)) from None
    return TrainingRecipe(model=t.model, seed=config.seed, batch_size=t.batch_size, context=t.context, steps=t.steps,
                          optimizer=optimizer, spes=spes, model_config=model_config,
                          weights_sha256=weights_sha256, tokenizer=tokenizer, diloco=diloco, final_merge=final_merge)


def _model_and_tokenizer(model: str, tokenizer: Path | None) -> tuple[dict[str, Any] | None, str | None,
                                                                        TokenizerSpec | None]:
    """A founder's model config, weights hash and tokenizer entry. A pretrained hf:PATH checkpoint with
    a tokenizer.json of its own trains with that tokenizer unless --tokenizer names another."""
    from node.train.tokenizer import read_tokenizer_file, spec_of

    spec = spec_of(read_tokenizer_file(tokenizer)) if tokenizer is not None else None
    if model not in HF_PRESET_NAMES and not model.startswith("hf:"):
        return None, None, spec
    from node.train.models.hf import read_source, weights_digest

    source = read_source(model, spec.vocab_size if spec is not None else None)
    if spec is None and source.weights is not None and source.tokenizer is not None:
        spec = spec_of(read_tokenizer_file(source.tokenizer))
    if spec is not None and int(source.config.get("vocab_size", 0)) < spec.vocab_size:
        raise RecipeInvalid(f"--model {model}: vocab_size {source.config.get('vocab_size')} is smaller than the "
                            f"tokenizer's {spec.vocab_size}")
    return source.config, weights_digest(source.weights) if source.weights is not None else None, spec


def build_document(config: NodeConfig, epoch: float, admission: AdmissionDoc | None = None) -> SwarmDocument:
    """The document a founder with `config` publishes; RecipeInvalid if its settings are out of bounds."""
    topo, gossip = config.gossip.topology, config.gossip
    recipe = training_recipe(config)
    gossip_doc: dict[str, Any] = {
        "topology": {"name": topo.name, "weights": topo.weights, "degree": topo.degree, "seed": topo.seed,
                     "rows": topo.rows, "edges": [list(e) for e in topo.edges], "directed": topo.directed},
        "codec": gossip.codec,
        "round_interval_s": gossip.round_interval_s,
        "max_staleness_rounds": gossip.max_staleness_rounds,
        "mixing": {"kind": gossip.mixing.kind.value, "tau": gossip.mixing.tau, "trim": gossip.mixing.trim},
    }
    if gossip.codec == "sparseloco":
        gossip_doc["topk_ratio"] = gossip.topk_ratio
    if gossip.codec == "topk":
        gossip_doc["topk_ratio"] = gossip.topk_ratio
        if gossip.topk_packed or gossip.topk_elias_fano:  # Elias-Fano indices come in the packed layout
            gossip_doc["topk_packed"] = True
        if gossip.topk_elias_fano:
            gossip_doc["topk_elias_fano"] = True
    if gossip.compression == "choco":
        gossip_doc["compression"] = {"kind": "choco", "gamma": gossip.choco_gamma}
    raw = {
        "version": SWARM_CONFIG_VERSION,
        "epoch": epoch,
        "payload": msgspec.to_builtins(recipe.to_payload()) if recipe is not None
        else {"kind": PayloadKind.VECTOR.value, "dim": config.dim},
        "gossip": gossip_doc,
    }
    if admission is not None and admission.mode is not AdmissionMode.OPEN:
        raw["admission"] = msgspec.to_builtins(admission)
    elif config.identity_work:  # key and allowlist swarms' identities cost the founder's consent instead
        raw["identity_work"] = config.identity_work
    if config.membership_shards > 1:  # one shard is the unsharded key: written only when more
        raw["membership_shards"] = config.membership_shards
    return parse_document(raw)


def swarm_document(config: NodeConfig, epoch: float, admission: AdmissionDoc | None = None) -> dict[str, Any]:
    """What the founder publishes under `<swarm>.config`; joiners take these settings from it."""
    return document_dict(build_document(config, epoch, admission))


# The setting (node.config.table) each field of the document comes from, so a founder's bad flag is named.
SETTING_OF_FIELD = {
    "epoch": None, "payload.dim": "dim", "payload.model": "training.model", "payload.seed": "seed",
    "payload.batch_size": "training.batch_size", "payload.context": "training.context", "payload.steps": "training.steps",
    "payload.optimizer.algorithm": "training.optimizer", "payload.optimizer.lr": "training.lr",
    "payload.optimizer.warmup_steps": "training.warmup_steps", "payload.optimizer.local_steps": "training.local_steps",
    "payload.optimizer.micro_batches": "training.micro_batches",
    "payload.optimizer.adam_accumulate": "training.adam_accumulate", "payload.spes": "training.spes",
    "payload.spes.sync_every": "training.spes_sync_every", "payload.spes.merge_every": "training.spes_merge_every",
    "payload.spes.merge_until": "training.spes_merge_until", "payload.spes.alpha0": "training.spes_alpha0",
    "payload.spes.replication": "training.spes_replication", "payload.spes.refresh_codec": "training.spes_refresh_codec",
    "payload.spes.expert_codec": "training.spes_expert_codec",
    "payload.spes_sync.shared_codec": "training.spes_shared_codec",
    "payload.spes_sync.delta_refresh": "training.spes_delta_refresh", "payload.spes_sync.outer_lr": "training.spes_outer_lr",
    "payload.spes_sync.outer_momentum": "training.spes_outer_momentum",
    "payload.spes_sync.anchor_every": "training.spes_anchor_every",
    "payload.optimizer.diloco": "training.optimizer", "payload.optimizer.diloco.outer_lr": "training.outer_lr",
    "payload.optimizer.diloco.outer_momentum": "training.outer_momentum",
    "payload.optimizer.diloco.fragments": "training.fragments", "payload.optimizer.diloco.overlap": "training.overlap",
    "payload.optimizer.diloco.qsr_alpha": "training.qsr_alpha",
    "payload.optimizer.diloco.outer_warmup": "training.outer_warmup",
    "payload.optimizer.diloco.phase_seconds": "training.phase_seconds",
    "payload.optimizer.diloco.anchor_every": "training.anchor_every",
    "payload.optimizer.diloco.anchor_codec": "training.anchor_codec",
    "payload.optimizer.diloco.inner": "training.inner_optimizer", "payload.final_merge": "training.final_merge",
    "payload.model_config": "training.model",
    "payload.weights_sha256": "training.model", "payload.tokenizer": "training.tokenizer",
    "payload.tokenizer.sha256": "training.tokenizer", "payload.tokenizer.vocab_size": "training.tokenizer",
    "payload.tokenizer.bytes": "training.tokenizer", "gossip.topology.name": "gossip.topology.name",
    "gossip.topology.weights": "gossip.topology.weights", "gossip.topology.degree": "gossip.topology.degree",
    "gossip.topology.seed": "gossip.topology.seed", "gossip.topology.rows": "gossip.topology.rows",
    "gossip.topology.edges": "gossip.topology.edges", "gossip.topology.directed": "gossip.topology.directed",
    "gossip.codec": "gossip.codec", "gossip.round_interval_s": "gossip.round_interval_s",
    "gossip.max_staleness_rounds": "gossip.max_staleness_rounds", "gossip.mixing.kind": "gossip.mixing.kind",
    "gossip.mixing.tau": "gossip.mixing.tau", "gossip.mixing.trim": "gossip.mixing.trim",
    "gossip.topk_ratio": "gossip.topk_ratio", "gossip.topk_packed": "gossip.topk_packed",
    "gossip.topk_elias_fano": "gossip.topk_elias_fano",
    "gossip.compression": "gossip.compression",
    "gossip.compression.kind": "gossip.compression", "gossip.compression.gamma": "gossip.choco_gamma",
    "identity_work": "identity_work", "membership_shards": "membership_shards",
}


def same_recipe(doc: Mapping[str, Any], config: NodeConfig, admission: AdmissionDoc | None = None) -> bool:
    """Whether a founder restarting with `config` may keep the swarm document `doc` (of a checkpoint):
    everything but the epoch is what it would publish now, so the swarm keeps its epoch and hash."""
    if doc.get("version") != SWARM_CONFIG_VERSION:
        return False
    try:
        now = swarm_document(config, 0.0, admission)
    except RecipeInvalid:
        return False
    return {**doc, "epoch": 0.0} == now
