"""The layers a config is resolved from, defaults < TOML file < `MURMUR_*` environment < flags, and
their merge into one checked `NodeConfig` that remembers where each value came from."""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, TypeVar, cast

from gossip.diloco import DILOCO_LOCAL_STEPS
from gossip.knobs import codec_outer_step
from gossip.rules import Knobs, Rule, broken_rules
from node.config.kinds import toml_type
from node.config.settings import DEFAULTS, ConfigError, NodeConfig, setting_value
from node.config.table import SETTINGS_BY_KEY, TABLES, Setting, Transport
from node.train.model_names import HF_DENSE_PRESETS, Model

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

ENV_CONFIG_FILE = "MURMUR_CONFIG"  # names the config file when --config is not given
_Config = TypeVar("_Config", bound="DataclassInstance")


class Sourced(NamedTuple):
    """A setting's value and where it came from, for error messages."""

    value: object
    source: str


Layer = Mapping[str, Sourced]


def read_config_file(path: Path, source: str = "--config") -> dict[str, Sourced]:
    """Read a TOML config file: nested tables whose dotted keys are the settings' keys.

    Unknown keys and values of the wrong type are errors. Relative paths in the file are relative
    to the file's directory, so a config and the files it names can move together.
    """
    try:
        with open(path, "rb") as file:
            document = tomllib.load(file)
    except OSError as exc:
        raise ConfigError(f"{source} {path}: cannot read the config file: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    layer: dict[str, Sourced] = {}
    for key, raw in _flatten(path, document):
        setting = SETTINGS_BY_KEY[key]
        try:
            value = setting.kind.from_toml(raw)
        except ValueError as exc:
            raise ConfigError(f"{path}:{key}: {exc}") from None
        if isinstance(value, Path) and not value.is_absolute():
            value = path.parent / value
        layer[key] = Sourced(value, f"{path}:{key}")
    return layer


def _flatten(path: Path, table: Mapping[str, object], prefix: str = "") -> Iterator[tuple[str, object]]:
    for name, raw in table.items():
        key = prefix + name
        if key in SETTINGS_BY_KEY:
            yield key, raw
        elif key in TABLES:
            if not isinstance(raw, dict):
                raise ConfigError(f"{path}:{key}: must be a table ([{key}]), got {toml_type(raw)}")
            yield from _flatten(path, raw, key + ".")
        else:
            known = [*SETTINGS_BY_KEY, *TABLES]
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{path}: unknown key {key!r}{hint}")


def read_environment(env: Mapping[str, str], settings: Collection[Setting]) -> dict[str, Sourced]:
    """The `MURMUR_*` variables of `settings`; an empty variable counts as unset."""
    layer: dict[str, Sourced] = {}
    for setting in settings:
        text = env.get(setting.env, "")
        if not text.strip():
            continue
        try:
            layer[setting.key] = Sourced(setting.kind.from_text(text), setting.env)
        except ValueError as exc:
            raise ConfigError(f"{setting.env}: {exc}") from None
    return layer


def read_flags(given: Mapping[Setting, object]) -> dict[str, Sourced]:
    """The flags a user actually gave, as argparse left them: a string, a list of strings
    (repeatable flags) or a bool (--x/--no-x)."""
    layer: dict[str, Sourced] = {}
    for setting, raw in given.items():
        try:
            if isinstance(raw, bool):
                setting.kind.check(raw)
                value: object = raw
            else:
                value = setting.kind.from_text(" ".join(raw) if isinstance(raw, list) else str(raw))
        except ValueError as exc:
            raise ConfigError(f"{setting.flag}: {exc}") from None
        layer[setting.key] = Sourced(value, setting.flag)
    return layer


@dataclass(frozen=True)
class ResolvedConfig:
    """A config and, for each setting not left at its default, where its value came from."""

    config: NodeConfig
    sources: Mapping[str, str] = field(default_factory=dict)

    def source(self, key: str) -> str:
        return self.sources.get(key) or default_source(key)


def default_source(key: str) -> str:
    """The source of a setting left at its default, as errors name it."""
    return f"default {SETTINGS_BY_KEY[key].flag}"


def merge_layers(*layers: Layer) -> ResolvedConfig:
    """Later layers win: call as merge_layers(file, environment, flags). Paths become absolute."""
    merged: dict[str, Sourced] = {}
    for layer in layers:
        merged.update(layer)
    if _current(merged, "training.optimizer") == "diloco" and "training.local_steps" not in merged:
        # DiLoCo's H is its own (gossip.diloco.DILOCO_LOCAL_STEPS), not the per-step optimizers' 1
        merged["training.local_steps"] = Sourced(DILOCO_LOCAL_STEPS, DILOCO_H_SOURCE)
    if _current(merged, "training.optimizer") == "diloco" and (
            outer := codec_outer_step(str(_current(merged, "gossip.codec")))) is not None:
        merged.setdefault("training.outer_lr", Sourced(outer[0], CODEC_OUTER_SOURCE))
        merged.setdefault("training.outer_momentum", Sourced(outer[1], CODEC_OUTER_SOURCE))
    _check_combinations(merged)
    values = {key: item.value for key, item in merged.items()}
    for key, value in values.items():
        if isinstance(value, Path):
            values[key] = value.absolute()
    if "data_dir" not in values:
        values["data_dir"] = DEFAULTS.data_dir.absolute()
    try:
        config = _replaced(DEFAULTS, values)
    except ValueError as exc:  # TopologySpec / MixingRule checks not covered above
        raise ConfigError(str(exc)) from None
    return ResolvedConfig(config, {key: item.source for key, item in merged.items()})


DILOCO_H_SOURCE = "--optimizer diloco's default --local-steps"
CODEC_OUTER_SOURCE = "--codec's default outer step"


def _current(merged: Mapping[str, Sourced], key: str) -> object:
    return merged[key].value if key in merged else setting_value(DEFAULTS, key)


def _check_combinations(merged: Mapping[str, Sourced]) -> None:
    def current(key: str) -> object:
        return _current(merged, key)

    def source(key: str) -> str:
        return merged[key].source if key in merged else default_source(key)

    if current("gossip.mixing.kind") == "clipped" and current("gossip.mixing.tau") is None:
        raise ConfigError(f"{source('gossip.mixing.kind')}: mixing rule 'clipped' needs a clipping radius: "
                          "set --tau, MURMUR_TAU or gossip.mixing.tau")
    for key in ("network.data_listen", "network.data_announce"):
        if current(key) and current("network.transport") != Transport.LIBP2P:
            raise ConfigError(f"{source(key)}: only the libp2p data plane listens apart from p2pd; "
                              "add --transport libp2p or drop it")
    if current("training.spes") and current("training.model") in (Model.VECTOR, Model.DENSE, *HF_DENSE_PRESETS):
        raise ConfigError(f"{source('training.spes')}: SPES syncs the experts of a mixture-of-experts model; "
                          f"--model {current('training.model')} has none (use --model moe)")
    merge_every, sync_every = current("training.spes_merge_every"), current("training.spes_sync_every")
    if current("training.spes") and merge_every % sync_every:  # type: ignore[operator]
        raise ConfigError(f"{source('training.spes_merge_every')}: the merge interval "
                          f"{current('training.spes_merge_every')} must be a multiple of the sync interval "
                          f"{current('training.spes_sync_every')} (--spes-sync-every)")
    broken = broken_rules(Knobs(codec=str(current("gossip.codec")), diloco=current("training.optimizer") == "diloco",
                                choco=current("gossip.compression") == "choco", spes=bool(current("training.spes")),
                                mixing=str(current("gossip.mixing.kind")),
                                fragments=cast(int, current("training.fragments")),
                                local_steps=cast(int, current("training.local_steps"))))
    _check_codec(current, source, broken)
    _check_compression(current, source, broken)
    _check_diloco(current, source, broken)
    if current("gossip.topology.name") == "custom" and not current("gossip.topology.edges"):
        raise ConfigError(f"{source('gossip.topology.name')}: the custom topology needs an edge list: "
                          "set --edges, MURMUR_EDGES or gossip.topology.edges")


def _check_compression(current: Callable[[str], object], source: Callable[[str], str], broken: Collection[Rule]
                       ) -> None:
    """--gossip-compression choco: where it is sound (docs/training.md)."""
    from gossip.choco import check_topology
    from gossip.rules import CHOCO_RULES
    from topology import TopologySpec

    if current("gossip.compression") != "choco":
        return
    if Rule.CHOCO_WITH_DILOCO in broken:
        raise ConfigError(f"{source('gossip.compression')}: compressed gossip is for the per-step optimizers dsgd "
                          "and dadam; --optimizer diloco compresses its pseudo-gradients with --codec (error feedback)")
    try:
        check_topology(TopologySpec(str(current("gossip.topology.name")), weights=current("gossip.topology.weights"),  # type: ignore[arg-type]
                                    edges=current("gossip.topology.edges") or ((0, 1),),  # type: ignore[arg-type]
                                    directed=bool(current("gossip.topology.directed"))))
    except ValueError as exc:
        raise ConfigError(f"{source('gossip.compression')}: {exc}") from None
    if Rule.CHOCO_WITH_WHOLE_VECTOR_MIXING in broken:
        raise ConfigError(f"{source('gossip.mixing.kind')}: compressed gossip moves along per-edge differences; "
                          f"mixing rule {current('gossip.mixing.kind')} needs whole vectors: use "
                          f"{' or '.join(CHOCO_RULES)}")
    if Rule.CHOCO_WITH_SPES in broken:
        raise ConfigError(f"{source('gossip.compression')}: compressed gossip does not cover SPES's expert syncs; "
                          "drop --spes or --gossip-compression choco")


DILOCO_ONLY = ("training.outer_lr", "training.outer_momentum", "training.fragments", "training.overlap",
               "training.qsr_alpha", "training.outer_warmup", "training.phase_seconds", "training.anchor_every",
               "training.anchor_codec", "training.inner_optimizer")


def _check_codec(current: Callable[[str], object], source: Callable[[str], str], broken: Collection[Rule]) -> None:
    """--codec topk only where it is sound: on differences (DiLoCo's pseudo-gradients with error feedback,
    compressed gossip's differences against estimates), never on whole parameters."""
    if Rule.TOPK_WITH_SPES in broken:
        raise ConfigError(f"{source('gossip.codec')}: SPES mixes its shared weights as whole parameters; "
                          "top-k is not sound there: use fp32, fp16, bf16 or int8")
    if Rule.TOPK_ON_WHOLE_PARAMETERS in broken:
        raise ConfigError(f"{source('gossip.codec')}: top-k sends a few entries of each tensor and drops the rest, "
                          "so it is sound on differences only: use it with --optimizer diloco (pseudo-gradients "
                          "with error feedback) or --gossip-compression choco; --optimizer "
                          f"{current('training.optimizer')} gossips whole parameters: use fp32, fp16, bf16 or int8")


def _check_diloco(current: Callable[[str], object], source: Callable[[str], str], broken: Collection[Rule]) -> None:
    """DiLoCo's knobs only with --optimizer diloco, and fragments that fit a phase."""
    diloco = current("training.optimizer") == "diloco"
    for key in DILOCO_ONLY:
        if not diloco and current(key) != setting_value(DEFAULTS, key):
            raise ConfigError(f"{source(key)}: {SETTINGS_BY_KEY[key].flag} is a knob of --optimizer diloco; "
                              f"the optimizer here is {current('training.optimizer')}")
    if Rule.FRAGMENTS_OVER_PHASE in broken:
        raise ConfigError(f"{source('training.fragments')}: {current('training.fragments')} fragments cannot "
                          f"sync at distinct steps of a {current('training.local_steps')}-step phase: use at most "
                          "--local-steps fragments")


def _replaced(obj: _Config, values: Mapping[str, object]) -> _Config:
    """`obj` with the values at dotted keys (relative to it) replaced, nested dataclasses included."""
    direct: dict[str, object] = {}
    nested: dict[str, dict[str, object]] = {}
    for key, value in values.items():
        head, _, rest = key.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            direct[head] = value
    for head, sub in nested.items():
        direct[head] = _replaced(getattr(obj, head), sub)
    return dataclasses.replace(obj, **direct)
