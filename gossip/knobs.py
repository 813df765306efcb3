"""An algorithm's knobs, declared once as the fields of a msgspec Struct (as gossip.diloco.DilocoSettings):
each field's type, default, bounds (`msgspec.Meta`: the swarm document's) and help (its description).

`Meta.extra` carries what the node's settings table needs besides: `metavar`, `noun` (the word its
errors use), `setting` (the setting's name where it is not the field's), `setting_bounds` (a node's
own bounds where they differ from the document's, which a founder may not stretch), `why` (said
when a choice is refused), `setting_choices` (a node's own choices where they are fewer than the
document's), `env` (the variable's name where it is older than the derived one) and
`default_text` (the default in words, for a knob that may be left out:
`Annotated[...] | None = None`, its value then computed). A field whose type must stay bare (a Literal read as it is) has its Meta in
the Struct's `FIELD_META`.

`knobs()` reads them for the layers above (node.config.table makes the settings from them) and
`Knob.check` holds an algorithm's config to a node's own bounds.
"""

from __future__ import annotations

import math
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import msgspec

_BOUNDS = ("ge", "gt", "le", "lt")
MAX_OUTER_LR = 10.0  # an outer step's learning rate (DiLoCo's, SPES's syncs')
# H when --optimizer diloco is chosen without --local-steps: an outer sync (two rounds and a Nesterov step)
# every inner step would pay DiLoCo's cost with none of its saving; DiLoCo's papers sync every 100-500.
# The node's settings (node.config.layers) and `murmur plan` take it from here (gossip.diloco re-exports it).
DILOCO_LOCAL_STEPS = 100
# DiLoCo's outer step when its pseudo-gradients travel as SparseLoCo payloads and the founder names none:
# plain averaging, the error feedback standing in for momentum as in SparseLoCo; with Nesterov 0.9 the
# held-back entries come out in bursts the momentum amplifies (docs/benchmarks.md, SparseLoCo with
# DiLoCo's own outer step: 1.69x the baseline's loss against 1.37x at outer lr 1).
SPARSELOCO_OUTER_LR, SPARSELOCO_OUTER_MOMENTUM = 1.0, 0.0
MAX_STEPS = 10**9  # any step count a swarm document names (the optimizer's, SPES's)


def codec_outer_step(codec: str) -> tuple[float, float] | None:
    """DiLoCo's outer lr and momentum where the founder names neither, when `codec` (of the pseudo-gradients)
    calls for other than DiLoCo's own: the node's settings (node.config.layers) and `murmur plan` ask here."""
    return (SPARSELOCO_OUTER_LR, SPARSELOCO_OUTER_MOMENTUM) if codec == "sparseloco" else None


@dataclass(frozen=True)
class Knob:
    """One field of an algorithm's settings Struct."""

    name: str  # the field's
    type: Any  # the field's type without its Meta: float, int, bool or a Literal
    default: Any
    meta: msgspec.Meta
    optional: bool = False  # None is a value too (the knob left out: its value computed)

    @property
    def extra(self) -> Mapping[str, Any]:
        return self.meta.extra or {}

    @property
    def help(self) -> str:
        return self.meta.description or ""

    @property
    def setting_name(self) -> str:
        """The name of the node's setting (`training.<name>`, `--<name>`, `MURMUR_<NAME>`)."""
        name: str = self.extra.get("setting", self.name)
        return name

    @property
    def bounds(self) -> dict[str, Any]:
        """A node's own bounds on its setting: the document's, but where `setting_bounds` says otherwise."""
        own = {b: getattr(self.meta, b) for b in _BOUNDS}
        return {**own, **self.extra.get("setting_bounds", {})}

    @property
    def choices(self) -> tuple[str, ...]:
        """A node's own choices: the Literal's, but where `setting_choices` says fewer."""
        if get_origin(self.type) is not Literal:
            return ()
        return tuple(self.extra.get("setting_choices", get_args(self.type)))

    def check(self, value: object) -> None:
        """ValueError naming the knob unless `value` is within a node's own bounds (or one of the choices)."""
        if value is None and self.optional:
            return
        b = self.bounds
        lo, hi = (b["gt"] if b["gt"] is not None else b["ge"]), (b["lt"] if b["lt"] is not None else b["le"])
        if self.type is float:
            ok = math.isfinite(value) and _within(value, b)  # type: ignore[arg-type]
            if not ok:
                raise ValueError(f"{self.name} must be {_range(b, lo, hi)}, got {value!r}")
        elif self.type is int:
            if type(value) is not int or not _within(value, b):
                raise ValueError(f"{self.name} must be an integer {_range(b, lo, hi)}, got {value!r}")
        elif self.choices and value not in self.choices:
            why = f" ({self.extra['why']})" if "why" in self.extra else ""
            raise ValueError(f"{self.name} must be one of {', '.join(self.choices)}{why}, got {value!r}")


def knobs(struct: type[msgspec.Struct]) -> tuple[Knob, ...]:
    """The knobs of an algorithm's settings Struct, in field order."""
    field_meta: Mapping[str, msgspec.Meta] = getattr(struct, "FIELD_META", {})
    found = []
    for field in msgspec.structs.fields(struct):
        base, meta, optional = field.type, field_meta.get(field.name), False
        if get_origin(base) in (Union, types.UnionType) and type(None) in get_args(base):
            base, optional = next(a for a in get_args(base) if a is not type(None)), True
        if get_origin(base) is Annotated:
            base, *metas = get_args(base)
            meta = next(m for m in metas if isinstance(m, msgspec.Meta))
        if meta is None:
            raise TypeError(f"{field.name}: an algorithm's knob carries its msgspec.Meta (help, bounds)")
        found.append(Knob(field.name, base, field.default, meta, optional))
    return tuple(found)


def _within(value: Any, b: Mapping[str, Any]) -> bool:
    return ((b["ge"] is None or value >= b["ge"]) and (b["gt"] is None or value > b["gt"])
            and (b["le"] is None or value <= b["le"]) and (b["lt"] is None or value < b["lt"]))


def _range(b: Mapping[str, Any], lo: Any, hi: Any) -> str:
    if lo is None:
        return f"{'<' if b['lt'] is not None else '<='} {hi:g}"
    if hi is None:
        return f"{'>' if b['gt'] is not None else '>='} {lo:g}"
    return f"in {'(' if b['gt'] is not None else '['}{lo:g}, {hi:g}{')' if b['lt'] is not None else ']'}"
