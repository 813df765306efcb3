"""The model card of an export (README.md, the Hugging Face convention): YAML front matter, then how the
model was made — model, data, algorithm, training, contributors — from the export's inputs only (the
swarm's config document and what the exported file records), so the same inputs give the same card
(docs/training.md, "Export").

Contributors: the tokens each peer processed, as the exporting node saw them in the peers' records
(clipped to what their steps allow, node.swarm.contributors) and kept in the checkpoint's or swarm
average's `contributors`; a swarm average also names the peers it averaged (each weighs 1/N in the
uniform average) and, when written by this murmur, each one's step as pulled.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from node.swarm.contributors import MAX_CONTRIBUTORS, parse_contributors, ranked
from node.swarm.recipe import TrainingRecipe

CARD_FILE = "README.md"
AVERAGE_KINDS = ("average", "swarm-average")  # murmur export's manifest, the node's periodic write


@dataclass(frozen=True)
class ModelFacts:
    """What the writer of the weights knows of the model it wrote."""

    architecture: str  # e.g. "LlamaForCausalLM (llama)" or "murmur GPT (moe)"
    parameters: int
    transformers: bool  # a save_pretrained directory transformers loads
    vocabulary: str  # "bytes" or "BPE (N tokens, sha256 ...)"


def _yaml_str(value: str) -> str:
    return json.dumps(value)  # a JSON string is a YAML double-quoted scalar


def _int(value: Any) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _steps(manifest: Mapping[str, Any]) -> tuple[int | None, str]:
    """The exported model's step (the highest of an average's peers) and how to say it."""
    if manifest.get("kind") in AVERAGE_KINDS:
        low, high = _int(manifest.get("min_step")), _int(manifest.get("max_step"))
        if high is None:
            return None, "unknown"
        return high, f"{low}-{high} (the averaged peers' steps)" if low is not None and low != high else str(high)
    step = _int(manifest.get("step"))
    return step, str(step) if step is not None else "unknown"


def _algorithm_lines(recipe: TrainingRecipe, gossip: Mapping[str, Any]) -> list[str]:
    o = recipe.optimizer
    lines = [f"- optimizer: `{o.algorithm}`, learning rate {o.lr:g}, warm-up {o.warmup_steps} steps, "
             f"{o.decay} decay, {o.local_steps} local step(s) per gossip round, {o.micro_batches} micro-batch(es) per step"]
    if o.adam_accumulate > 1:
        lines.append(f"- AccumAdam: Adam moments advance once per {o.adam_accumulate} steps on their mean gradient")
    topology = gossip.get("topology") or {}
    if topology:
        extra = f", weights `{topology['weights']}`" if topology.get("weights") else ""
        lines.append(f"- topology: `{topology.get('name')}`{extra}")
    if gossip.get("codec"):
        lines.append(f"- gossip codec: `{gossip['codec']}`" + (
            f" (compression `{gossip['compression'].get('kind')}`)" if isinstance(gossip.get("compression"), Mapping) else ""))
    mixing = gossip.get("mixing") or {}
    if mixing:
        lines.append(f"- mixing: `{mixing.get('kind')}`")
    if gossip.get("round_interval_s") is not None:
        lines.append(f"- round interval: {gossip['round_interval_s']:g} s")
    if recipe.diloco is not None:
        d = recipe.diloco
        lines.append(f"- DiLoCo: inner `{d.inner}`, outer lr {d.outer_lr:g}, outer momentum {d.outer_momentum:g}, "
                     f"{d.fragments} fragment(s), overlap {'on' if d.overlap else 'off'}")
    if recipe.spes is not None:
        s = recipe.spes
        lines.append(f"- SPES: sync every {s.sync_every} steps, merge every {s.merge_every} until step {s.merge_until}, "
                     f"alpha0 {s.alpha0:g}, replication {s.replication}, expert codec `{s.expert_codec}`")
    lines.append(f"- final merge: {'yes' if recipe.final_merge else 'no'}")
    return lines


def _token_shares(manifest: Mapping[str, Any]) -> list[str]:
    """The contributors by tokens processed, most first, with their share of the swarm's tokens."""
    people = ranked(parse_contributors(manifest.get("contributors")))
    if not people:
        return ["No tokens per peer were recorded (a file written by an older murmur, or by a node that "
                "trained no step)."]
    total = sum(c.tokens for c in people)
    lines = [f"{len(people)} contributor(s) processed {total:,} training tokens, as the exporting node saw them in "
             "their peer records:", "",
             "| peer | tokens processed | share of the tokens |", "| --- | --- | --- |"]
    lines += [f"| `{c.peer_id}` | {c.tokens:,} | {100 * c.share:.1f}% |" for c in people]
    return lines


def _contributors(manifest: Mapping[str, Any]) -> list[str]:
    peers = manifest.get("peers")
    if manifest.get("kind") in AVERAGE_KINDS and isinstance(peers, Sequence) and not isinstance(peers, str) and peers:
        ids = [str(p) for p in peers]
        share = 100.0 / len(ids)
        writer = manifest.get("written_by")
        raw_steps = manifest.get("peer_steps")
        steps = {str(k): v for k, v in raw_steps.items()} if isinstance(raw_steps, Mapping) else {}
        lines = [f"The swarm average over {len(ids)} peer(s), taken by "
                 + (f"`{writer}`" if writer else "the exporting node") + ":", "",
                 "| peer | step when averaged | weight in the average |", "| --- | --- | --- |"]
        lines += [f"| `{p}` | {_int(steps.get(p)) if _int(steps.get(p)) is not None else 'not recorded'} | {share:.1f}% |"
                  for p in ids]
        lines += ["", "Each peer's parameters weigh 1/N in the uniform average (with SPES, the shared weights; "
                  "each expert is averaged over its owners)."]
        return lines
    return ["The export is one node's own checkpoint. Its parameters also carry what it mixed in from its "
            "neighbours by gossip, in proportions no file records."]


def model_card(recipe: TrainingRecipe, manifest: Mapping[str, Any], facts: ModelFacts,
               swarm_doc: Mapping[str, Any] | None = None) -> str:
    """README.md of an export: deterministic in its arguments."""
    gossip: Mapping[str, Any] = (swarm_doc or {}).get("gossip") or {}
    step, steps_text = _steps(manifest)
    o = recipe.optimizer
    per_step = recipe.batch_size * recipe.context * o.micro_batches
    swarm = manifest.get("swarm")
    tags = ["murmur", "decentralized-training", "gossip", o.algorithm, recipe.model]
    if recipe.spes is not None:
        tags.append("spes")
    front = ["---"]
    if facts.transformers:
        front += ["library_name: transformers", "pipeline_tag: text-generation"]
    front += ["tags:", *(f"- {_yaml_str(t)}" for t in dict.fromkeys(tags)), "---", ""]
    title = f"# {recipe.model}" + (f", trained by the murmur swarm `{swarm}`" if swarm else "")
    what = ("the swarm average (`swarm-average.safetensors`)" if manifest.get("kind") in AVERAGE_KINDS
            else "one node's checkpoint (`checkpoint.safetensors`)")
    body = [
        title, "",
        f"Exported by `murmur export` from {what}. murmur trains one model across volunteers' nodes, "
        "each on its own data, keeping their copies close by gossip.", "",
        "## Model", "",
        f"- architecture: {facts.architecture}",
        f"- parameters: {facts.parameters:,}",
        f"- vocabulary: {facts.vocabulary}",
        f"- initial seed: {recipe.seed}" + (f"; started from pretrained weights (sha256 `{recipe.weights_sha256}`)"
                                             if recipe.weights_sha256 else ""),
        "- loading: " + ("`AutoModelForCausalLM.from_pretrained(dir)` and `AutoTokenizer.from_pretrained(dir)`"
                         if facts.transformers else "`config.json` and `model.safetensors` (one tensor per parameter; "
                         "see murmur's docs/training.md, \"Export\"); `AutoTokenizer.from_pretrained(dir)` loads the tokenizer"),
        "",
        "## Data", "",
        "The swarm's recipe does not fix the data: each node trains on its own (`--data` files, or murmur's "
        "embedded synthetic corpus when it gives none), and no file the export reads says which, so no "
        "dataset is named.", "",
        "## Algorithm", "",
        *_algorithm_lines(recipe, gossip), "",
        "## Training", "",
        f"- steps: {steps_text}" + (f" of a budget of {recipe.steps}" if recipe.steps else " (no step budget)"),
        f"- batch: {recipe.batch_size} sequences x {recipe.context} tokens x {o.micro_batches} micro-batch(es) "
        f"= {per_step:,} tokens per step and node",
        f"- tokens: {step * per_step:,} per node (steps x batch x context x micro-batches)" if step is not None
        else "- tokens: unknown (no step recorded)",
        f"- swarm: `{swarm}`" if swarm else "- swarm: unknown",
        f"- config hash: `{manifest.get('config_hash')}`",
    ]
    if manifest.get("val_loss") is not None:
        body.append(f"- validation loss: {float(manifest['val_loss']):.4f} (nats per token, on the exporting node's "
                    "validation split)")
    body += ["", "## Contributors", "", *_token_shares(manifest), "", *_contributors(manifest), "",
             "Limitation: a peer's tokens are what its own records claimed, held to its step times the tokens "
             "per step (a node that joins adopts the swarm's step but counts only the tokens it trained itself); "
             "peers the exporting node never saw are missing, and it keeps at most "
             f"{MAX_CONTRIBUTORS} (the largest). A peer's step is its place in the shared schedule, not the work it "
             "did, so a weight in the average is not a share of the tokens.", ""]
    return "\n".join(front + body)


__all__ = ["CARD_FILE", "ModelFacts", "model_card"]
