"""Each algorithm's knobs are declared once, as the fields of a msgspec Struct in gossip/ (type, default,
bounds, help): the swarm document's part, the node's settings (flags, `MURMUR_*`, docs/cli.md's table),
`murmur plan`'s flags and the algorithm's config all derive from it. Checked here for gossip DiLoCo's
DilocoSettings, SPES's SpesSyncSettings, compressed gossip's ChocoKnobs and the optimizer's
OptimizerSettings, so a knob retyped in any of those places fails as soon as it drifts."""

from __future__ import annotations

import argparse
from typing import Annotated, Any, get_args, get_origin

import msgspec
import pytest

from gossip.diloco import DILOCO_DEFAULTS, MAX_ANCHOR_EVERY, MAX_QSR_ALPHA, DilocoConfig, DilocoSettings
from gossip.knobs import knobs
from node.cli.main import build_parser
from node.config import DEFAULTS, SETTINGS, SETTINGS_BY_KEY, setting_value
from node.config.kinds import Boolean, Choice, Integer, Number
from node.config.table import NODE, struct_settings
from node.swarm.recipe import DilocoDoc

pytestmark = pytest.mark.unit

FIELDS = msgspec.structs.fields(DilocoSettings)
DERIVED = dict(zip((f.name for f in FIELDS), struct_settings(DilocoSettings, "training.", NODE), strict=True))


def _declared(field: msgspec.structs.FieldInfo) -> tuple[Any, msgspec.Meta]:
    """The field's type and its Meta (in its annotation or, for a bare type, the Struct's FIELD_META)."""
    if get_origin(field.type) is Annotated:
        base, meta = get_args(field.type)
        return base, meta
    return field.type, DilocoSettings.FIELD_META[field.name]


def _plan_actions() -> dict[str, argparse.Action]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {flag: action for action in sub.choices["plan"]._actions for flag in action.option_strings}


@pytest.mark.parametrize("field", FIELDS, ids=lambda f: f.name)
def test_the_document_is_the_declaration(field: msgspec.structs.FieldInfo) -> None:
    doc = {f.name: f for f in msgspec.structs.fields(DilocoDoc)}[field.name]
    assert issubclass(DilocoDoc, DilocoSettings)
    assert doc.type is field.type and doc.default is field.default
    assert getattr(DILOCO_DEFAULTS, field.name) is field.default  # DilocoConfig's defaults are the Struct's


@pytest.mark.parametrize("field", FIELDS, ids=lambda f: f.name)
def test_the_setting_is_the_declaration(field: msgspec.structs.FieldInfo) -> None:
    base, meta = _declared(field)
    setting = DERIVED[field.name]
    assert SETTINGS_BY_KEY[setting.key] == setting and sum(s.key == setting.key for s in SETTINGS) == 1
    assert setting.help == meta.description
    assert setting_value(DEFAULTS, setting.key) == field.default
    name = setting.key.removeprefix("training.")
    assert (setting.flag, setting.env) == ("--" + name.replace("_", "-"), "MURMUR_" + name.upper())
    bounds: dict[str, Any] = {"ge": meta.ge, "gt": meta.gt, "le": meta.le, "lt": meta.lt,
                              **(meta.extra or {}).get("setting_bounds", {})}
    kind = SETTINGS_BY_KEY[setting.key].kind
    if isinstance(kind, Number):
        assert (kind.lo, kind.lo_open) == ((bounds["gt"], True) if bounds["gt"] is not None else (bounds["ge"], False))
        assert (kind.hi, kind.hi_open) == ((bounds["lt"], True) if bounds["lt"] is not None else (bounds["le"], False))
    elif isinstance(kind, Integer):
        assert (kind.lo, kind.hi) == (bounds["ge"], bounds["le"])
    elif isinstance(kind, Choice):
        assert kind.choices == get_args(base)
    else:
        assert isinstance(kind, Boolean) and field.default is False


def test_the_settings_name_exceptions() -> None:
    assert DERIVED["inner"].key == "training.inner_optimizer" and DERIVED["inner"].flag == "--inner-optimizer"
    assert [s.key for s in DERIVED.values() if not s.key.endswith(tuple(DERIVED))] == ["training.inner_optimizer"]


def test_the_document_caps_what_a_node_need_not() -> None:
    """qsr_alpha and anchor_every: a node sets any value >= 0 for itself; a founder's document is capped."""
    assert SETTINGS_BY_KEY["training.qsr_alpha"].kind.from_text(str(10 * MAX_QSR_ALPHA)) == 10 * MAX_QSR_ALPHA  # type: ignore[attr-defined]
    assert SETTINGS_BY_KEY["training.anchor_every"].kind.from_text(str(10 * MAX_ANCHOR_EVERY)) == 10 * MAX_ANCHOR_EVERY  # type: ignore[attr-defined]
    for name, cap in (("qsr_alpha", MAX_QSR_ALPHA), ("anchor_every", MAX_ANCHOR_EVERY)):
        assert msgspec.convert({name: cap}, DilocoDoc) == DilocoDoc(**{name: cap})
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({name: cap * 10}, DilocoDoc)


# `murmur plan`'s DiLoCo flags that take the node's setting (--fragments models more than a node takes)
PLAN_FLAGS = ("outer_lr", "outer_momentum", "overlap", "anchor_every", "anchor_codec")


@pytest.mark.parametrize(("field", "bad"), [("outer_lr", 0.0), ("outer_lr", 10.5), ("outer_momentum", 1.0),
                                            ("fragments", 65), ("qsr_alpha", -1.0), ("anchor_every", -1),
                                            ("anchor_codec", "topk"), ("inner", "lion")])
def test_the_config_holds_a_node_to_the_settings_bounds(field: str, bad: object) -> None:
    """DilocoConfig refuses what the node's setting refuses, with the same knob named."""
    setting = DERIVED[field]
    with pytest.raises(ValueError, match=f"^{field} must be"):
        DilocoConfig(**{field: bad})
    with pytest.raises(ValueError):
        setting.kind.check(bad)
    for knob in knobs(DilocoSettings):
        knob.check(knob.default)


@pytest.mark.parametrize("name", PLAN_FLAGS)
def test_the_plan_flags_are_the_declaration(name: str) -> None:
    setting = DERIVED[name]
    action = _plan_actions()[setting.flag]
    # the outer step's default depends on --codec, as a node's does (gossip.knobs.codec_outer_step): None there
    codec_dependent = name in ("outer_lr", "outer_momentum")
    assert action.default == (None if codec_dependent else {f.name: f.default for f in FIELDS}[name])
    if isinstance(setting.kind, Choice):
        assert tuple(action.choices or ()) == setting.kind.choices
    elif isinstance(setting.kind, (Number, Integer)):
        assert action.type is not None
        parse = action.type
        top = setting.kind.hi
        if top is not None:
            with pytest.raises(argparse.ArgumentTypeError):
                parse(str(top * 2))  # type: ignore[operator]
        with pytest.raises(argparse.ArgumentTypeError):
            parse(str(setting.kind.lo - 1))  # type: ignore[operator]


def test_spes_sync_settings_are_declared_once() -> None:
    """SPES's sync knobs: the document's part is the Struct, the table's rows derive from it (prefix spes_)."""
    from gossip.spes import SpesConfig, SpesSyncSettings
    from node.swarm.recipe import SpesSyncDoc

    assert issubclass(SpesSyncDoc, SpesSyncSettings)
    assert msgspec.structs.fields(SpesSyncDoc) == msgspec.structs.fields(SpesSyncSettings)
    for knob, setting in zip(knobs(SpesSyncSettings), struct_settings(SpesSyncSettings, "training.spes_", NODE),
                             strict=True):
        assert SETTINGS_BY_KEY[setting.key] == setting and setting.help == knob.help
        assert setting.flag == "--spes-" + knob.name.replace("_", "-")
        assert setting.env == "MURMUR_SPES_" + knob.name.upper()
    # the outer step's defaults are the node's too; the codec and delta_refresh defaults are what documents
    # written before those fields meant, and a node's own differ (SpesConfig's)
    for name in ("outer_lr", "outer_momentum", "anchor_every"):
        assert getattr(SpesConfig(), name) is getattr(SpesSyncSettings(), name)
    assert SETTINGS_BY_KEY["training.spes_anchor_every"].kind.hi is None  # type: ignore[attr-defined]
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"anchor_every": 10**7}, SpesSyncDoc)


def test_choco_settings_are_declared_once() -> None:
    """Compressed gossip's gamma: the document's part is gossip.choco.ChocoKnobs (CompressionDoc adds only its
    kind), the table's row derives from it (gossip.choco_gamma, optional, its default in words computed)."""
    from gossip.choco import DENSE_GAMMA, MAX_TOPK_GAMMA, TOPK_GAMMA_PER_RATIO, ChocoKnobs
    from node.swarm.recipe import CompressionDoc

    assert issubclass(CompressionDoc, ChocoKnobs)
    assert [f for f in msgspec.structs.fields(CompressionDoc) if f.name != "kind"] == list(
        msgspec.structs.fields(ChocoKnobs))
    (knob,) = knobs(ChocoKnobs)
    (setting,) = struct_settings(ChocoKnobs, "gossip.", NODE)
    assert SETTINGS_BY_KEY["gossip.choco_gamma"] == setting and setting.help == knob.help
    assert (setting.flag, setting.env, setting.optional) == ("--choco-gamma", "MURMUR_CHOCO_GAMMA", True)
    assert setting_value(DEFAULTS, setting.key) is None is ChocoKnobs().gamma
    assert setting.default_text == (f"{DENSE_GAMMA:g} for fp32/fp16/bf16/int8; for topk {TOPK_GAMMA_PER_RATIO:g} x "
                                    f"--topk-ratio, at most {MAX_TOPK_GAMMA:g}")
    assert isinstance(setting.kind, Number)
    assert (setting.kind.lo, setting.kind.lo_open, setting.kind.hi, setting.kind.hi_open) == (0.0, True, 1.0, False)
    for bad in (0.0, 1.5):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({"kind": "choco", "gamma": bad}, CompressionDoc)
        with pytest.raises(ValueError):
            knob.check(bad)
    knob.check(None)
    assert setting.flag not in _plan_actions()  # murmur plan resolves gamma from the codec (default_gamma)


def test_optimizer_settings_are_declared_once() -> None:
    """The optimizer's knobs: the document's part is gossip.optimizers.OptimizerSettings (OptimizerDoc adds only
    diloco), the table's rows derive from it where the table places them, and so do murmur plan's flags."""
    from gossip.optimizers import OptimizerConfig, OptimizerSettings
    from node.swarm.recipe import OptimizerDoc

    assert issubclass(OptimizerDoc, OptimizerSettings)
    assert [f for f in msgspec.structs.fields(OptimizerDoc) if f.name != "diloco"] == list(
        msgspec.structs.fields(OptimizerSettings))
    declared = knobs(OptimizerSettings)
    rows = struct_settings(OptimizerSettings, "training.", NODE)
    plan = _plan_actions()
    for knob, setting in zip(declared, rows, strict=True):
        assert SETTINGS_BY_KEY[setting.key] == setting and sum(s.key == setting.key for s in SETTINGS) == 1
        assert setting.help == knob.help and setting.key == "training." + knob.setting_name
        assert setting.flag == "--" + knob.setting_name.replace("_", "-")
        if isinstance(setting.kind, Integer | Number):
            assert setting.kind.hi is None and knob.meta.le is not None  # the document caps, a node does not
            assert setting.kind.lo == (knob.meta.ge if knob.meta.ge is not None else knob.meta.gt)
        else:
            assert isinstance(setting.kind, Choice) and setting.kind.choices == knob.choices
        if setting.flag in plan and setting.key != "training.local_steps":  # plan's H default depends on diloco
            assert plan[setting.flag].default == setting_value(DEFAULTS, setting.key)
    by_name = {s.key.removeprefix("training."): s for s in rows}
    assert by_name["warmup_steps"].env == "MURMUR_WARMUP"  # older than the derived name
    assert [s.env for n, s in by_name.items() if n != "warmup_steps"] == [
        "MURMUR_" + n.upper() for n in by_name if n != "warmup_steps"]
    assert {"--optimizer", "--local-steps", "--micro-batches"} <= set(plan)
    assert tuple(plan["--optimizer"].choices or ()) == by_name["optimizer"].kind.choices  # type: ignore[attr-defined]
    assert OptimizerSettings.__struct_defaults__ == (OptimizerConfig.adam_accumulate,)  # the others always written
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"algorithm": "dadam", "lr": 11.0, "warmup_steps": 0, "local_steps": 1, "micro_batches": 1},
                        OptimizerDoc)
    assert by_name["lr"].kind.from_text("11") == 11.0  # type: ignore[attr-defined]


def test_spes_settings_are_declared_once() -> None:
    """SPES's swarm-wide knobs: the document's part (SpesDoc, written with every field) is gossip.spes.SpesSettings,
    the table's training.spes_* rows derive from it; a node is not capped and offers fewer refresh codecs."""
    from gossip.spes import NODE_REFRESH_CODECS, REFRESH_CODECS, SpesSettings
    from node.swarm.recipe import SpesDoc

    assert issubclass(SpesDoc, SpesSettings)
    assert msgspec.structs.fields(SpesDoc) == msgspec.structs.fields(SpesSettings)
    assert SpesDoc.__struct_config__.omit_defaults is False  # every field written: the SPES documents' hashes
    assert SpesSettings.__struct_defaults__ == ("fp32",)  # expert_codec: what documents before it meant
    for knob, setting in zip(knobs(SpesSettings), struct_settings(SpesSettings, "training.spes_", NODE), strict=True):
        assert SETTINGS_BY_KEY[setting.key] == setting and sum(s.key == setting.key for s in SETTINGS) == 1
        assert setting.help == knob.help and setting.key == "training.spes_" + knob.name
        assert (setting.flag, setting.env) == ("--spes-" + knob.name.replace("_", "-"), "MURMUR_SPES_" + knob.name.upper())
        if isinstance(setting.kind, Integer):
            assert setting.kind.hi is None and knob.meta.le is not None  # the document caps, a node does not
            assert setting.kind.lo == knob.meta.ge
        elif isinstance(setting.kind, Number):
            assert (setting.kind.lo, setting.kind.hi) == (knob.meta.ge, knob.meta.le)
        else:
            assert isinstance(setting.kind, Choice) and setting.kind.choices == knob.choices
    (refresh,) = (k for k in knobs(SpesSettings) if k.name == "refresh_codec")
    assert get_args(refresh.type) == REFRESH_CODECS and refresh.choices == NODE_REFRESH_CODECS
    assert SETTINGS_BY_KEY["training.spes_refresh_codec"].kind.choices == NODE_REFRESH_CODECS  # type: ignore[attr-defined]
