"""The swarm's shared recipe: the document the founder publishes under `<swarm>.config` (topology,
codec, round timing, mixing, admission, and what is trained with which optimizer), declared as msgspec
Structs with the bounds a node holds any founder to, and the validated settings a node reads back
from it, so every peer of a swarm gossips and trains the same way. The founder builds its document
from its own settings in node.runtime.founding (this module knows no NodeConfig).

Adding a field: give it a default, declare its bounds with `Meta`, and leave the Struct's
`omit_defaults` on, so a document that does not use the field keeps its bytes (and its config hash);
tests/test_recipe.py checks every declared bound on both sides.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal, TypeVar, cast

import msgspec

from gossip.choco import ChocoKnobs, ChocoSettings, check_topology, default_gamma
from gossip.codecs import DEFAULT_TOPK_RATIO, Codec, Fp32Codec, get_codec
from gossip.diloco import DilocoConfig, DilocoSettings
from gossip.knobs import MAX_STEPS
from gossip.mixing import MixingKind, MixingRule
from gossip.optimizers import Algorithm, OptimizerConfig, OptimizerSettings
from gossip.rules import Knobs, Rule, broken_rules
from gossip.spes import SpesConfig, SpesSettings, SpesSyncSettings
from node.swarm.rounds import RoundClock
from node.train.model_names import EMBEDDED_MODEL_NAMES, HF_PRESET_NAMES, MODEL_NAME_PATTERN, VECTOR_MODEL
from node.train.tokenizer import TokenizerSpec
from topology import TopologySpec

# The document's format; a node refuses a document of another format (the founder runs another murmur).
SWARM_CONFIG_VERSION = 2

# Bounds a swarm document is held to. They keep a hostile or mistaken founder from making a node
# allocate without limit (max_staleness_rounds keeps that many copies of the model), divide by zero
# (round_interval_s) or spin (tiny intervals), while leaving every sane recipe possible.
MAX_SEED = 2**63 - 1
MAX_BATCH_SIZE = 4096
MAX_CONTEXT = 1 << 17
MAX_VECTOR_DIM = 1 << 27  # 512 MiB of float32
MAX_STALENESS_ROUNDS = 16
MIN_ROUND_INTERVAL_S = 1e-3
MAX_ROUND_INTERVAL_S = 3600.0
MAX_EPOCH = 1e11  # unix seconds, year ~5000
MAX_RANKS = 1 << 16  # ranks a custom edge list may name
MAX_EDGES = 1 << 16
MAX_DEGREE = 256
MAX_ROWS = 1 << 16
MAX_MODEL_NAME = 256
MAX_KEY_CHECK = 128
# open swarms: the leading zero bits of an identity's proof of work (node.net.work); 20 is ~1 s of one core
MAX_IDENTITY_WORK_BITS = 32
DEFAULT_IDENTITY_WORK_BITS = 20
# `<swarm>.peers` and `<swarm>.experts` are split over `membership_shards` DHT keys (node.net.records.ShardedKey).
# A reader reads every shard each view read, so shards cost DHT lookups (node.net.dht_guard's find rate is
# sized for this many). A shard answers up to 4 MiB: ~64 peer records padded to their 64 KiB bound (thousands
# of honest ones), or ~34 SPES peers of a 24x64 MoE (each holds every expert's record, ~120 KiB).
MAX_MEMBERSHIP_SHARDS = 16
# A Hugging Face model config (node.train.models.hf bounds its size and the fields that decide memory)
MAX_MODEL_CONFIG_KEYS = 512
MAX_MODEL_CONFIG_KEY = 128

_FINITE_MAX = sys.float_info.max
Steps = Annotated[int, msgspec.Meta(ge=0, le=MAX_STEPS)]
Seed = Annotated[int, msgspec.Meta(ge=0, le=MAX_SEED)]
# --codec; topk only on differences (compressed gossip's, gossip DiLoCo's pseudo-gradients)
CodecName = Literal["fp32", "fp16", "bf16", "int8", "topk", "sparseloco"]
# whole parameter vectors (anchors, SPES's groups): top-k is sound only on differences
StateCodecName = Literal["fp32", "fp16", "bf16", "int8"]
RefreshCodecName = Literal["fp32", "fp16", "bf16", "int8"]
ModelName = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_MODEL_NAME, pattern=f"^(?:{MODEL_NAME_PATTERN})$")]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANKS)]
Sha256Hex = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
ModelConfigDoc = Annotated[dict[Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_MODEL_CONFIG_KEY)], Any],
                           msgspec.Meta(min_length=1, max_length=MAX_MODEL_CONFIG_KEYS)]
TopologyName = Literal["ring", "torus", "complete", "star", "static-exp", "one-peer-exp", "hypercube", "random-regular",
                       "custom"]
WeightScheme = Literal["metropolis-hastings", "uniform", "max-degree"]


class RecipeInvalid(ValueError):
    """The swarm's config document cannot be used by this murmur (one line, says why)."""


class PayloadKind(enum.StrEnum):
    """What a swarm gossips: a trained model, or a random vector of `dim` floats (vector mode)."""

    MODEL = "model"
    VECTOR = "vector"


class AdmissionMode(enum.StrEnum):
    """Who may take part in a swarm (docs/threat-model.md): anyone, holders of the swarm key, or peers
    holding a membership certificate from the founder."""

    OPEN = "open"
    KEY = "key"
    ALLOWLIST = "allowlist"


class _Doc(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Every part of the document: declared fields only; fields at their default are left out."""


_D = TypeVar("_D", bound=_Doc)


class DilocoDoc(DilocoSettings, _Doc, frozen=True):
    """Gossip DiLoCo's outer loop (gossip.diloco.DilocoConfig); present exactly with algorithm diloco.

    Its fields, their bounds and defaults are gossip.diloco.DilocoSettings's, declared once there. A field
    left out means DiLoCo's default: changing one of those changes what published documents mean, so it
    takes a new SWARM_CONFIG_VERSION."""


class OptimizerDoc(OptimizerSettings, _Doc, frozen=True):
    """The optimizer's knobs (gossip.optimizers.OptimizerSettings's fields, bounds and defaults, declared once
    there) and gossip DiLoCo's. adam_accumulate absent: 1, plain DAdam."""

    diloco: DilocoDoc | None = None  # gossip DiLoCo's knobs; absent unless algorithm is diloco


class SpesDoc(SpesSettings, _Doc, frozen=True, omit_defaults=False):
    """SPES's swarm-wide knobs, gossip.spes.SpesSettings's fields, bounds and defaults, declared once there.
    Written with every field: documents carried `expert_codec` before defaults were left out, and their
    hash must not change (a new field here changes SPES swarms' hash)."""


class SpesSyncDoc(SpesSyncSettings, _Doc, frozen=True):
    """SPES syncs at internet bandwidth (issue 15): the shared weights' codec, deltas for frozen-copy
    refreshes, the outer step. Beside `spes` rather than in it, so that SPES documents written before
    keep their hash; its defaults (and its absence) are what those documents mean. Its fields, bounds and
    defaults are gossip.spes.SpesSyncSettings's, declared once there."""


class ModelPayload(_Doc, frozen=True, tag_field="kind", tag="model"):
    """A trained model: which one, its initial seed, the per-node batch, the step budget, the optimizer."""

    model: ModelName
    seed: Seed
    batch_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_BATCH_SIZE)]
    context: Annotated[int, msgspec.Meta(ge=2, le=MAX_CONTEXT)]
    steps: Steps  # 0: until stopped
    optimizer: OptimizerDoc
    spes: SpesDoc | None = None  # SPES's swarm-wide knobs; absent when off
    spes_sync: SpesSyncDoc | None = None  # with spes only; absent: every field at its default
    # a Hugging Face model's config itself (not a path), so joiners build it without files; checked in
    # depth (size, model type, memory-deciding fields) by node.train.models.hf.check_config_doc
    model_config: ModelConfigDoc | None = None
    weights_sha256: Sha256Hex | None = None  # the pretrained weights the swarm starts from (hf:PATH)
    tokenizer: TokenizerSpec | None = None  # the swarm's tokenizer file; absent: one token per byte
    # every node averages all live peers' final models once at the end of the budget (gossip DiLoCo's default)
    final_merge: bool = False


class VectorPayload(_Doc, frozen=True, tag_field="kind", tag="vector"):
    """Vector mode: a random vector of `dim` floats instead of a model."""

    dim: Annotated[int, msgspec.Meta(ge=1, le=MAX_VECTOR_DIM)]


class TopologyDoc(_Doc, frozen=True):
    name: TopologyName
    weights: WeightScheme | None
    degree: Annotated[int, msgspec.Meta(ge=1, le=MAX_DEGREE)]
    seed: Seed
    rows: Annotated[int, msgspec.Meta(ge=1, le=MAX_ROWS)] | None
    edges: Annotated[tuple[tuple[Rank, Rank], ...], msgspec.Meta(max_length=MAX_EDGES)]
    directed: bool


class MixingDoc(_Doc, frozen=True):
    kind: MixingKind
    tau: Annotated[float, msgspec.Meta(gt=0.0, le=_FINITE_MAX)] | None
    trim: Annotated[float, msgspec.Meta(ge=0.0, lt=0.5)]


class CompressionDoc(ChocoKnobs, _Doc, frozen=True, kw_only=True):
    """Compressed gossip of differences (gossip/choco.py); gamma absent: gossip.choco.default_gamma.

    Its knobs (gamma) are gossip.choco.ChocoKnobs's, declared once there; `kind` is the document's own
    (keyword-only, since it has no default and follows them: the config hash sorts the keys)."""

    kind: Literal["choco"]


class GossipDoc(_Doc, frozen=True):
    topology: TopologyDoc
    codec: CodecName
    round_interval_s: Annotated[float, msgspec.Meta(ge=MIN_ROUND_INTERVAL_S, le=MAX_ROUND_INTERVAL_S)]
    max_staleness_rounds: Annotated[int, msgspec.Meta(ge=0, le=MAX_STALENESS_ROUNDS)]
    mixing: MixingDoc
    topk_ratio: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = DEFAULT_TOPK_RATIO  # written only with codec topk or sparseloco
    topk_packed: bool = False  # written only when true (older configs keep their hash)
    topk_elias_fano: bool = False  # written only when true
    compression: CompressionDoc | None = None  # absent: whole parameters


class AdmissionDoc(_Doc, frozen=True):
    """Who may take part (absent: open). In `key` mode `key_check` is an HMAC of the swarm name under the
    swarm key (node.net.admission), so a member given the wrong key learns so at start."""

    mode: AdmissionMode
    key_check: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$", max_length=MAX_KEY_CHECK)] | None = None


class SwarmDocument(_Doc, frozen=True):
    """The `<swarm>.config` document: its canonical JSON is what the config hash covers."""

    version: int
    epoch: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_EPOCH)]
    payload: ModelPayload | VectorPayload
    gossip: GossipDoc
    admission: AdmissionDoc | None = None  # absent: open, so open swarms keep their config hash
    # an open swarm's proof of work per identity, in leading zero bits (node.net.work); absent: none, so
    # documents of swarms founded before it keep their hash
    identity_work: Annotated[int, msgspec.Meta(ge=0, le=MAX_IDENTITY_WORK_BITS)] = 0
    # how many DHT keys `<swarm>.peers` and `<swarm>.experts` are each split over; absent: one, the key
    # itself, so documents of swarms founded before shards keep their hash
    membership_shards: Annotated[int, msgspec.Meta(ge=1, le=MAX_MEMBERSHIP_SHARDS)] = 1

    @property
    def admission_mode(self) -> AdmissionMode:
        return self.admission.mode if self.admission is not None else AdmissionMode.OPEN


class _FormatOnly(msgspec.Struct):
    version: Any = None


def _check_format(version: object) -> None:
    if version != SWARM_CONFIG_VERSION or isinstance(version, bool):
        raise RecipeInvalid(f"the swarm's config has version {version!r}; this murmur reads {SWARM_CONFIG_VERSION}")


def _schema_error(exc: msgspec.ValidationError | msgspec.DecodeError) -> RecipeInvalid:
    """msgspec's `Expected ... - at `$.gossip.codec`` said as `gossip.codec: expected ...`."""
    text, _, where = str(exc).partition(" - at `$")
    where = where.rstrip("`").lstrip(".")
    text = text[:1].lower() + text[1:]
    return RecipeInvalid(f"the swarm's config is invalid: {where}: {text}" if where
                         else f"the swarm's config is invalid: {text}")


def parse_document(doc: Mapping[str, Any]) -> SwarmDocument:
    """The declared document a decoded `<swarm>.config` mapping holds; RecipeInvalid naming the field at fault."""
    if not isinstance(doc, Mapping):
        raise RecipeInvalid("the swarm's config is invalid: not a map")
    _check_format(doc.get("version"))
    try:
        document = msgspec.convert(dict(doc), SwarmDocument)
    except msgspec.ValidationError as exc:
        raise _schema_error(exc) from None
    check_document(document)
    return document


def document_from_json(raw: bytes) -> SwarmDocument:
    """The declared document of a config's canonical JSON bytes (what the DHT validators check)."""
    try:
        _check_format(msgspec.json.decode(raw, type=_FormatOnly).version)
        document = msgspec.json.decode(raw, type=SwarmDocument)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _schema_error(exc) from None
    check_document(document)
    return document


def check_document(document: SwarmDocument) -> None:
    """The rules a schema cannot declare (a custom topology needs edges, SPES's M a multiple of S...):
    building the settings checks them all."""
    SwarmSettings.from_document(document)


def document_dict(document: SwarmDocument) -> dict[str, Any]:
    """The plain mapping of a document as JSON gives it back (lists, not tuples): what is published and hashed."""
    built: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(document))
    return built


def check_model_allowed(swarm_model: str, own_model: str) -> None:
    """Raise RecipeInvalid unless this node may build the swarm's model. A model named by import path
    is code that the swarm config makes this node import and call, so a joiner runs it only if its own
    --model names the same builder; embedded models are always allowed."""
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
    # a Hugging Face model's config document (node.train.models.hf), carried so joiners need no path
    model_config: dict[str, Any] | None = None
    weights_sha256: str | None = None  # the pretrained weights the swarm starts from (hf:PATH of a checkpoint)
    tokenizer: TokenizerSpec | None = None  # None: one token per byte
    diloco: DilocoConfig | None = None  # gossip DiLoCo's outer loop, with --optimizer diloco
    final_merge: bool = False  # every node averages all live peers' final models at the end of the budget

    @property
    def inner_optimizer(self) -> OptimizerConfig:
        """The optimizer the trainer steps with: gossip DiLoCo's inner one under diloco, else the optimizer."""
        if self.diloco is None:
            return self.optimizer
        return replace(self.optimizer, algorithm=cast(Algorithm, self.diloco.inner_algorithm))

    def to_payload(self) -> ModelPayload:
        o, c, d = self.optimizer, self.spes, self.diloco
        spes = None if c is None else SpesDoc(
            sync_every=c.sync_every, merge_every=c.merge_every, merge_until=c.merge_until, alpha0=c.alpha0,
            replication=c.replication, refresh_codec=cast(RefreshCodecName, c.refresh_codec),
            expert_codec=cast(StateCodecName, c.expert_codec))
        spes_sync = None if c is None else _without_defaults(
            SpesSyncDoc, shared_codec=cast(StateCodecName, c.shared_codec), delta_refresh=c.delta_refresh, outer_lr=c.outer_lr,
            outer_momentum=c.outer_momentum, anchor_every=c.anchor_every)
        diloco = None if d is None else _without_defaults(
            DilocoDoc, outer_lr=d.outer_lr, outer_momentum=d.outer_momentum, fragments=d.fragments, overlap=d.overlap,
            qsr_alpha=d.qsr_alpha, outer_warmup=d.outer_warmup, phase_seconds=d.phase_seconds,
            anchor_every=d.anchor_every, anchor_codec=cast(StateCodecName, d.anchor_codec),
            inner=cast(Literal["adam", "sgd"], d.inner))
        return ModelPayload(
            model=self.model, seed=self.seed, batch_size=self.batch_size, context=self.context, steps=self.steps,
            optimizer=OptimizerDoc(algorithm=o.algorithm, lr=o.lr, warmup_steps=o.warmup_steps,
                                   local_steps=o.local_steps, micro_batches=o.micro_batches, diloco=diloco,
                                   adam_accumulate=o.adam_accumulate),
            spes=spes, spes_sync=None if spes_sync == SpesSyncDoc() else spes_sync, model_config=self.model_config, weights_sha256=self.weights_sha256, tokenizer=self.tokenizer,
            final_merge=self.final_merge)

    def to_doc(self) -> dict[str, Any]:
        built: dict[str, Any] = msgspec.to_builtins(self.to_payload())
        return built

    @classmethod
    def from_payload(cls, p: ModelPayload) -> TrainingRecipe:
        o = p.optimizer
        if (o.algorithm == "diloco") != (o.diloco is not None):
            raise ValueError("optimizer.diloco comes with algorithm 'diloco' and only with it")
        if p.spes_sync is not None and p.spes is None:
            raise ValueError("spes_sync comes with spes and only with it")
        return cls(model=p.model, seed=p.seed, batch_size=p.batch_size, context=p.context, steps=p.steps,
                   optimizer=optimizer_config(o.algorithm, o.lr, o.warmup_steps, p.steps, o.local_steps,
                                              o.micro_batches, adam_accumulate=o.adam_accumulate),
                   spes=_spes_from_doc(p.spes, p.spes_sync or SpesSyncDoc()) if p.spes is not None else None,
                   model_config=_checked_model_config(p.model_config), weights_sha256=p.weights_sha256,
                   tokenizer=p.tokenizer, diloco=_diloco_from_doc(o.diloco) if o.diloco is not None else None,
                   final_merge=p.final_merge)

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> TrainingRecipe:
        try:
            payload = msgspec.convert(dict(doc), ModelPayload)
        except msgspec.ValidationError as exc:
            raise _schema_error(exc) from None
        return cls.from_payload(payload)


def embedded_options(recipe: TrainingRecipe) -> dict[str, Any] | None:
    """The embedded GPT's config overrides a recipe implies: a tokenizer's vocabulary instead of bytes."""
    if recipe.model in EMBEDDED_MODEL_NAMES and recipe.tokenizer is not None:
        return {"vocab_size": recipe.tokenizer.vocab_size}
    return None


def _checked_model_config(doc: dict[str, Any] | None) -> dict[str, Any] | None:
    """A Hugging Face config from the network, bounded in depth before anything builds it (ValueError)."""
    if doc is None:
        return None
    from node.train.models.hf import check_config_doc

    check_config_doc(doc)
    return dict(doc)


def _without_defaults(cls: type[_D], **values: Any) -> _D:
    """`cls(**values)` with the values equal to their field's default left out, so that the encoding
    omits them (msgspec's omit_defaults compares floats by identity, and a parsed 1.0 is not the default's)."""
    defaults = {f.name: f.default for f in msgspec.structs.fields(cls)}
    return cls(**{name: v for name, v in values.items() if name not in defaults or v != defaults[name]})


def _spes_from_doc(doc: SpesDoc, sync: SpesSyncDoc) -> SpesConfig:
    """SpesConfig checks what the schema cannot (M a multiple of S; ValueError names the bad value)."""
    return SpesConfig(sync_every=doc.sync_every, merge_every=doc.merge_every, merge_until=doc.merge_until,
                      alpha0=doc.alpha0, replication=doc.replication, refresh_codec=doc.refresh_codec,
                      expert_codec=doc.expert_codec, shared_codec=sync.shared_codec, delta_refresh=sync.delta_refresh,
                      outer_lr=sync.outer_lr, outer_momentum=sync.outer_momentum, anchor_every=sync.anchor_every)


def _diloco_from_doc(doc: DilocoDoc) -> DilocoConfig:
    return DilocoConfig(outer_lr=doc.outer_lr, outer_momentum=doc.outer_momentum, fragments=doc.fragments,
                        overlap=doc.overlap, qsr_alpha=doc.qsr_alpha, outer_warmup=doc.outer_warmup,
                        phase_seconds=doc.phase_seconds, anchor_every=doc.anchor_every,
                        anchor_codec=doc.anchor_codec, inner=doc.inner)


def optimizer_config(algorithm: str, lr: float, warmup_steps: int, steps: int, local_steps: int,
                     micro_batches: int, *, adam_accumulate: int = OptimizerConfig.adam_accumulate) -> OptimizerConfig:
    """The optimizer of a recipe: warm-up, then a cosine to 0.1 lr at `steps` (flat when steps is 0)."""
    # OptimizerConfig refuses an unknown algorithm, and adam_accumulate > 1 outside dadam (ValueError)
    return OptimizerConfig(algorithm=cast(Algorithm, algorithm), lr=lr, warmup_steps=warmup_steps,
                           decay="cosine" if steps else "constant", total_steps=steps or None,
                           local_steps=local_steps, micro_batches=micro_batches, adam_accumulate=adam_accumulate)


@dataclass(frozen=True)
class SwarmSettings:
    """The shared settings read back from a swarm document (validated by `from_doc`)."""

    topology: TopologySpec
    codec: Codec  # of whole tensors in rounds (fp32 under compressed gossip); downloads are fp32 whatever it is
    clock: RoundClock
    max_staleness: int
    mixing: MixingRule
    dim: int  # floats of the vector payload; 0 when a model is trained
    training: TrainingRecipe | None
    admission: AdmissionMode = AdmissionMode.OPEN
    choco: ChocoSettings | None = None  # compressed gossip; its codec is the differences'

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> SwarmSettings:
        return cls.from_document(parse_document(doc))

    @classmethod
    def from_document(cls, document: SwarmDocument) -> SwarmSettings:
        g, t, payload = document.gossip, document.gossip.topology, document.payload
        try:
            topology = TopologySpec(t.name, weights=t.weights, degree=t.degree, seed=t.seed, rows=t.rows,
                                    edges=t.edges, directed=t.directed)
            codec = (get_codec(g.codec, ratio=g.topk_ratio, packed=g.topk_packed,
                                   elias_fano=g.topk_elias_fano) if g.codec == "topk"
                     else get_codec(g.codec, ratio=g.topk_ratio) if g.codec == "sparseloco"
                     else get_codec(g.codec))
            mixing = MixingRule(kind=g.mixing.kind, tau=g.mixing.tau, trim=g.mixing.trim)
            choco = None
            model = payload if isinstance(payload, ModelPayload) else None
            broken = broken_rules(Knobs(codec=codec.name, diloco=model is not None and model.optimizer.diloco is not None,
                                        choco=g.compression is not None, spes=model is not None and model.spes is not None))
            if g.compression is not None:
                check_topology(topology)
                if Rule.CHOCO_WITH_SPES in broken:
                    raise ValueError("compressed gossip does not cover SPES's expert syncs")
                if Rule.CHOCO_WITH_DILOCO in broken:
                    raise ValueError("compressed gossip is for dsgd and dadam; diloco compresses its pseudo-gradients "
                                     "with the codec")
                gamma = default_gamma(codec) if g.compression.gamma is None else g.compression.gamma
                choco = ChocoSettings(codec=codec, gamma=gamma, rule=mixing)
            elif Rule.TOPK_ON_WHOLE_PARAMETERS in broken:
                raise ValueError(f"codec {g.codec} is sound on differences only (compressed gossip's, gossip DiLoCo's "
                                 "pseudo-gradients), and the swarm gossips whole parameters")
            return cls(
                topology=topology,
                codec=Fp32Codec() if choco is not None else codec,
                clock=RoundClock(document.epoch, g.round_interval_s),
                max_staleness=g.max_staleness_rounds,
                mixing=mixing,
                dim=payload.dim if isinstance(payload, VectorPayload) else 0,
                training=TrainingRecipe.from_payload(payload) if isinstance(payload, ModelPayload) else None,
                admission=document.admission_mode,
                choco=choco,
            )
        except ValueError as exc:
            raise RecipeInvalid(f"the swarm's config is invalid: {exc}") from None

    def __post_init__(self) -> None:
        # built from a document by `from_document`, or directly: the rules hold either way (under compressed
        # gossip `codec` is the fp32 of whole tensors, the differences' is the choco's)
        t = self.training
        broken = broken_rules(Knobs(codec=self.codec.name, diloco=t is not None and t.diloco is not None,
                                    spes=t is not None and t.spes is not None))
        if Rule.TOPK_ON_WHOLE_PARAMETERS in broken:
            raise RecipeInvalid(f"the swarm's config is invalid: gossip.codec: {self.codec.name} drops most of each tensor and is "
                                "sound only on gossip DiLoCo's pseudo-gradients, not on whole parameters")
        if Rule.SPES_WITH_DILOCO in broken:
            raise RecipeInvalid("the swarm's config is invalid: SPES takes its outer step knobs from its own fields, "
                                "not from optimizer.diloco")


def field_at_fault(error: RecipeInvalid) -> tuple[str, str] | None:
    """(document field, what is wrong) of a schema refusal; None for a refusal that names no field."""
    text = str(error).removeprefix("the swarm's config is invalid: ")
    where, sep, problem = text.partition(": ")
    if not sep or " " in where:
        return None
    return where.split("[")[0], problem
