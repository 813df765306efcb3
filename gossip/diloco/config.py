"""The knobs of gossip DiLoCo that every node of a swarm shares (the swarm's recipe)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal, get_args

import msgspec

from gossip.codecs.registry import STATE_CODECS
from gossip.knobs import MAX_OUTER_LR, knobs

ANCHOR_CODECS = STATE_CODECS  # anchors are whole parameters
INNER_OPTIMIZERS = ("adam", "sgd")
AnchorCodecName = Literal["fp32", "fp16", "bf16", "int8"]  # ANCHOR_CODECS, in their order
InnerOptimizerName = Literal["adam", "sgd"]  # INNER_OPTIMIZERS
assert get_args(AnchorCodecName) == ANCHOR_CODECS and get_args(InnerOptimizerName) == INNER_OPTIMIZERS

MAX_FRAGMENTS = 64
# The swarm document's extra caps (a node's own setting has none): they keep a hostile or mistaken founder
# from making every node sync after an absurd period; a node may set anything >= 0 for itself.
MAX_QSR_ALPHA = 1e3
MAX_ANCHOR_EVERY = 10**6
MAX_OUTER_WARMUP = 1000
MAX_PHASE_SECONDS = 7 * 86400.0


class DilocoSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """DiLoCo's knobs, each declared once (gossip.knobs): its type, default, bounds (`msgspec.Meta`: the
    swarm document's) and help (the description). Everything else derives from here: the swarm document's
    part (node.swarm.recipe.DilocoDoc subclasses this Struct), the node's settings table rows
    `training.<field>` with their flag `--<field>` and variable `MURMUR_<FIELD>` (node.config.table),
    docs/cli.md's table, `murmur plan`'s DiLoCo flags (node.cli.plan, from the table), and DilocoConfig's
    defaults and checks (a node's own bounds).

    `Meta.extra` carries what the settings table and DilocoConfig's errors use besides: `metavar`, `noun`,
    `setting` (the setting's name where it is not the field's), `setting_bounds` (where a node's own
    setting is bounded otherwise than the document, which a founder may not stretch) and `why`. The help
    names the node's flags: it is the settings table's text, user-visible byte for byte.
    """

    outer_lr: Annotated[float, msgspec.Meta(
        gt=0.0, le=MAX_OUTER_LR, extra={"metavar": "LR"},
        description="diloco: outer learning rate of the Nesterov step on the mixed pseudo-gradient; 1 with --codec "
        "sparseloco unless given (the swarm's)",
    )] = 0.7
    outer_momentum: Annotated[float, msgspec.Meta(
        ge=0.0, lt=1.0, extra={"metavar": "MU"},
        description="diloco: Nesterov momentum of the outer step; the nodes mix their buffers (mu b + the "
        "pseudo-gradient), so the momentum stays in consensus at no extra bytes; 0 with --codec sparseloco unless "
        "given, its error feedback standing in for it (the swarm's)",
    )] = 0.9
    fragments: Annotated[int, msgspec.Meta(
        ge=1, le=MAX_FRAGMENTS, extra={"noun": "fragments"},
        description="diloco: P, fragments of the model synced at staggered inner steps, so about 1/P of it is in "
        "flight at a time; at most --local-steps (the swarm's)",
    )] = 1
    overlap: Annotated[bool, msgspec.Meta(
        description="diloco: delayed outer step - run each outer exchange while the next phase computes and apply "
        "its outer step one phase late (not the eager update), so a slow link hides behind compute at some "
        "cost in loss (the swarm's)",
    )] = False
    # the document caps ALPHA (MAX_QSR_ALPHA); a node's own setting does not
    qsr_alpha: Annotated[float, msgspec.Meta(
        ge=0.0, le=MAX_QSR_ALPHA, extra={"metavar": "ALPHA", "setting_bounds": {"le": None}},
        description="diloco: grow the sync period as the learning rate decays, H = max(--local-steps, "
        "floor((ALPHA / lr)^2)) after the warm-up (quadratic synchronisation rule); 0: constant H (the swarm's)",
    )] = 0.0
    outer_warmup: Annotated[int, msgspec.Meta(
        ge=0, le=MAX_OUTER_WARMUP, extra={"noun": "warm-up phases"},
        description="diloco: W, outer warm-up - the first W phases sync more often, phase k < W lasting "
        "ceil(H (k + 1) / (W + 1)) steps (at least --fragments), as DiLoCo's papers sync often early; 0: "
        "every phase H (the swarm's)",
    )] = 4
    phase_seconds: Annotated[float, msgspec.Meta(
        ge=0.0, le=MAX_PHASE_SECONDS, extra={"metavar": "SECONDS"},
        description="diloco: wall-clock phases - a node whose inner steps since the last sync point took SECONDS x "
        "(the steps between the two) / --local-steps passes over the inner steps left before the next, so "
        "volunteers of unequal speed keep one cadence, and each pseudo-gradient is weighed by the inner steps "
        "it trained; about H times the fastest nodes' step time; 0: every node trains every step (the swarm's)",
    )] = 0.0
    # the document caps the period (MAX_ANCHOR_EVERY); a node's own setting does not
    anchor_every: Annotated[int, msgspec.Meta(
        ge=0, le=MAX_ANCHOR_EVERY, extra={"setting_bounds": {"le": None}},
        description="diloco: mix the anchors (the models as of the last outer step) with the neighbours at every "
        "this-many-th sync too, which keeps the nodes together; 0: never (the swarm's)",
    )] = 1
    anchor_codec: Annotated[AnchorCodecName, msgspec.Meta(
        extra={"metavar": "CODEC", "noun": "anchor codec",
               "why": "a whole-parameter codec; top-k is sound only on differences"},
        description="diloco: codec the anchors travel in, with error feedback (the swarm's)",
    )] = "int8"
    # the type stays the bare Literal (the names are checked against INNER_OPTIMIZERS as written), so its
    # Meta (help, and its setting's name: the flag says which optimizer, --inner-optimizer) is in FIELD_META
    inner: InnerOptimizerName = "adam"

    FIELD_META: ClassVar[Mapping[str, msgspec.Meta]] = {"inner": msgspec.Meta(
        extra={"metavar": "OPTIMIZER", "noun": "inner optimizer", "setting": "inner_optimizer"},
        description="diloco: the inner steps' optimizer, adam (AdamW, DiLoCo's) or sgd (local SGD; --lr as "
        "dsgd's) (the swarm's)",
    )}

_SETTINGS = DilocoSettings()  # the defaults
_KNOBS = knobs(DilocoSettings)


@dataclass(frozen=True)
class DilocoConfig:
    """The outer loop over H inner steps of local AdamW (H is `OptimizerConfig.local_steps`).

    - `outer_lr`, `outer_momentum`: the outer Nesterov step on the gossip-mixed pseudo-gradient
      (DiLoCo's defaults 0.7 and 0.9); what is mixed is the next momentum buffer (OuterNesterov).
    - `fragments`: P; the parameters are split into P fragments synced at staggered inner steps, so
      about 1/P of the model is in flight at a time (Streaming DiLoCo). 1: the whole model at once.
    - `overlap`: a delayed outer step, not the eager update: the exchange of a phase's pseudo-gradient
      runs while the next phase computes, and its outer step is applied one phase late (the raw local
      progress carries on meanwhile, at lr 1).
    - `qsr_alpha`: 0 keeps H constant; > 0 lets H grow as the learning rate decays, by the quadratic
      synchronisation rule H = max(H_base, floor((alpha / lr)^2)) (after the warm-up).
    - `outer_warmup`: W; phase k < W lasts ceil(H (k + 1) / (W + 1)) steps (at least P), so the
      swarm syncs often while the models move fast, then every H (gossip.diloco.schedule).
    - `phase_seconds`: S > 0 makes phases wall-clock: a node whose inner steps since its last sync point
      took S x (steps to the next one) / H (their own time: not what the node does between them) passes
      over the steps left before it (they advance the step
      count without training), so a slower volunteer syncs when the swarm does with what it trained,
      its pseudo-gradient weighed by its share of the phase's steps; 0: every step is trained.
    - `anchor_every`: every this many syncs of a fragment its anchors are mixed with the same
      neighbours too (a state, in `anchor_codec`, never top-k): mixing pseudo-gradients alone keeps
      the swarm's mean on DiLoCo's path but lets each node's anchor drift with its own data; 0: never.
    - `anchor_codec`: the codec anchors travel in (fp32, fp16, bf16 or int8, with error feedback).
    - `inner`: the inner optimizer, AdamW as DiLoCo (`adam`, the local direction of dadam) or plain SGD
      (`sgd`, dsgd's: with outer lr 1 and no momentum, local SGD with periodic gossip averaging).
    """

    outer_lr: float = _SETTINGS.outer_lr
    outer_momentum: float = _SETTINGS.outer_momentum
    fragments: int = _SETTINGS.fragments
    overlap: bool = _SETTINGS.overlap
    qsr_alpha: float = _SETTINGS.qsr_alpha
    outer_warmup: int = _SETTINGS.outer_warmup
    phase_seconds: float = _SETTINGS.phase_seconds
    anchor_every: int = _SETTINGS.anchor_every
    anchor_codec: str = _SETTINGS.anchor_codec
    inner: str = _SETTINGS.inner  # the inner optimizer: "adam" (AdamW, DiLoCo's) or "sgd" (local SGD)

    MAX_FRAGMENTS = MAX_FRAGMENTS

    def __post_init__(self) -> None:
        for knob in _KNOBS:  # a node's own bounds, as DilocoSettings declares them
            knob.check(getattr(self, knob.name))

    @property
    def inner_algorithm(self) -> str:
        """The local direction of the inner steps, as gossip.optimizers names it."""
        return "dadam" if self.inner == "adam" else "dsgd"

    def mixes_anchors(self, round_index: int) -> bool:
        """Whether a fragment's sync of `round_index` also mixes its anchors."""
        return self.anchor_every > 0 and (round_index + 1) % self.anchor_every == 0


# DiLoCo's defaults (declared in DilocoSettings): the node's settings, the swarm document, `murmur plan` and
# its model read them from here, so a founder, a joiner and a prediction cannot disagree on what "unset" means.
DILOCO_DEFAULTS = DilocoConfig()
