"""Each algorithm default is written once, in gossip/, and every layer above reads it: the node's settings
table, the swarm document (what a field left out means), `murmur plan`'s model and flags. Checked by
importing them, so a default retyped anywhere fails here as soon as it drifts."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from gossip.choco import DENSE_GAMMA, ChocoSettings, default_gamma
from gossip.codecs import DEFAULT_TOPK_RATIO, Fp32Codec, TopKCodec
from gossip.diloco import DILOCO_DEFAULTS, DilocoConfig
from gossip.optimizers import OptimizerConfig
from gossip.plan import PlanConfig
from gossip.spes import SpesConfig
from node.config import DEFAULTS, SETTINGS_BY_KEY, setting_value
from node.swarm.recipe import DilocoDoc, GossipDoc, OptimizerDoc

pytestmark = pytest.mark.unit

# setting key -> DilocoConfig field
DILOCO_KNOBS = {
    "training.outer_lr": "outer_lr",
    "training.outer_momentum": "outer_momentum",
    "training.fragments": "fragments",
    "training.overlap": "overlap",
    "training.qsr_alpha": "qsr_alpha",
    "training.outer_warmup": "outer_warmup",
    "training.anchor_every": "anchor_every",
    "training.anchor_codec": "anchor_codec",
    "training.inner_optimizer": "inner",
}
# DiLoCo knobs `murmur plan` models (PlanConfig field -> DilocoConfig field)
PLAN_DILOCO_KNOBS = {"outer_lr": "outer_lr", "outer_momentum": "outer_momentum", "fragments": "fragments",
                     "overlap": "overlap", "anchor_every": "anchor_every"}
SPES_KNOBS = {
    "training.spes_sync_every": "sync_every", "training.spes_merge_every": "merge_every",
    "training.spes_merge_until": "merge_until", "training.spes_alpha0": "alpha0",
    "training.spes_replication": "replication", "training.spes_refresh_codec": "refresh_codec",
    "training.spes_expert_codec": "expert_codec", "training.spes_shared_codec": "shared_codec",
    "training.spes_delta_refresh": "delta_refresh", "training.spes_outer_lr": "outer_lr",
    "training.spes_outer_momentum": "outer_momentum", "training.spes_anchor_every": "anchor_every",
}
OPTIMIZER_KNOBS = {"training.lr": "lr", "training.local_steps": "local_steps",
                   "training.micro_batches": "micro_batches", "training.adam_accumulate": "adam_accumulate"}


def _struct_default(cls: type[msgspec.Struct], name: str) -> Any:
    return next(f.default for f in msgspec.structs.fields(cls) if f.name == name)


def _plan_default(name: str) -> Any:
    return PlanConfig.__dataclass_fields__[name].default


@pytest.mark.parametrize(("key", "name"), sorted(DILOCO_KNOBS.items()))
def test_diloco_defaults_are_the_gossip_configs(key: str, name: str) -> None:
    gossip = getattr(DILOCO_DEFAULTS, name)
    assert getattr(DilocoConfig(), name) == gossip
    assert setting_value(DEFAULTS, key) is gossip  # the settings table's default
    assert _struct_default(DilocoDoc, name) is gossip  # what a document that leaves the field out means
    assert key in SETTINGS_BY_KEY


@pytest.mark.parametrize(("plan", "name"), sorted(PLAN_DILOCO_KNOBS.items()))
def test_plan_models_diloco_with_its_defaults(plan: str, name: str) -> None:
    assert _plan_default(plan) is getattr(DILOCO_DEFAULTS, name)


def test_plan_anchor_codec_and_local_steps_are_the_nodes() -> None:
    assert PlanConfig.__dataclass_fields__["anchor_codec"].default_factory().name == DILOCO_DEFAULTS.anchor_codec  # type: ignore[misc]
    assert _plan_default("local_steps") is OptimizerConfig.local_steps is DEFAULTS.training.local_steps


@pytest.mark.parametrize(("key", "name"), sorted(SPES_KNOBS.items()))
def test_spes_defaults_are_the_gossip_configs(key: str, name: str) -> None:
    assert setting_value(DEFAULTS, key) is getattr(SpesConfig(), name)


@pytest.mark.parametrize(("key", "name"), sorted(OPTIMIZER_KNOBS.items()))
def test_optimizer_defaults_are_the_gossip_configs(key: str, name: str) -> None:
    assert setting_value(DEFAULTS, key) is getattr(OptimizerConfig(), name)


def test_adam_accumulate_left_out_means_the_gossip_default() -> None:
    assert _struct_default(OptimizerDoc, "adam_accumulate") is OptimizerConfig().adam_accumulate


def test_topk_ratio_is_the_codecs() -> None:
    assert DEFAULTS.gossip.topk_ratio is DEFAULT_TOPK_RATIO
    assert _struct_default(GossipDoc, "topk_ratio") is DEFAULT_TOPK_RATIO
    TopKCodec(DEFAULT_TOPK_RATIO)  # a ratio the codec takes


def test_choco_gamma_default_is_choco_s() -> None:
    assert DEFAULTS.gossip.choco_gamma is None  # None: default_gamma of the codec, in the node and the recipe
    assert ChocoSettings(Fp32Codec()).gamma is DENSE_GAMMA is default_gamma(Fp32Codec())
    text = SETTINGS_BY_KEY["gossip.choco_gamma"].default_text
    assert text is not None and f"at most {default_gamma(TopKCodec(1.0)):g}" in text
    assert f"{default_gamma(TopKCodec(0.01)) / 0.01:g} x --topk-ratio" in text


# `murmur plan` flag -> the setting whose default it takes
PLAN_FLAGS = {
    "model": "training.model", "topology": "gossip.topology.name", "optimizer": "training.optimizer",
    "overlap": "training.overlap",
    "anchor_every": "training.anchor_every", "anchor_codec": "training.anchor_codec", "codec": "gossip.codec",
    "topk_ratio": "gossip.topk_ratio", "topk_packed": "gossip.topk_packed", "topk_elias_fano": "gossip.topk_elias_fano",
    "gossip_compression": "gossip.compression", "batch_size": "training.batch_size", "context": "training.context",
    "micro_batches": "training.micro_batches",
}


@pytest.mark.parametrize(("dest", "key"), sorted(PLAN_FLAGS.items()))
def test_plan_flags_default_to_the_nodes(dest: str, key: str) -> None:
    from node.cli.main import build_parser

    args = build_parser().parse_args(["plan"])
    assert getattr(args, dest) is setting_value(DEFAULTS, key)


def test_plan_fragments_and_local_steps_defaults() -> None:
    from node.cli.main import build_parser

    args = build_parser().parse_args(["plan"])
    assert args.fragments is DILOCO_DEFAULTS.fragments
    assert args.local_steps is None  # 1 (the node's) or, for diloco, the plan's own PLAN_DILOCO_LOCAL_STEPS
    # the node's DiLoCo outer step, or the one --codec calls for (gossip.knobs.codec_outer_step), as a node takes it
    assert args.outer_lr is None and args.outer_momentum is None


def test_choices_are_the_gossip_layers() -> None:
    """The names a flag offers and the swarm document admits are the algorithms' own (the document's are
    Literal types, written out for msgspec and mypy: checked equal here)."""
    from typing import get_args

    from gossip.codecs import STATE_CODECS
    from gossip.diloco import ANCHOR_CODECS, INNER_OPTIMIZERS
    from gossip.optimizers import ALGORITHMS
    from node.config import NODE_CODECS, OPTIMIZERS
    from node.swarm.recipe import CodecName, OptimizerDoc, StateCodecName

    assert SETTINGS_BY_KEY["training.anchor_codec"].kind.choices == ANCHOR_CODECS == STATE_CODECS  # type: ignore[attr-defined]
    assert SETTINGS_BY_KEY["training.inner_optimizer"].kind.choices == INNER_OPTIMIZERS  # type: ignore[attr-defined]
    assert get_args(StateCodecName) == STATE_CODECS and get_args(CodecName) == NODE_CODECS
    assert get_args(_struct_type(DilocoDoc, "inner")) == INNER_OPTIMIZERS
    assert OPTIMIZERS == ALGORITHMS == get_args(_struct_type(OptimizerDoc, "algorithm"))


def _struct_type(cls: type[msgspec.Struct], name: str) -> Any:
    return next(f.type for f in msgspec.structs.fields(cls) if f.name == name)
