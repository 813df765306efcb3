"""The knobs of gossip DiLoCo that every node of a swarm shares (the swarm's recipe)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gossip.codecs.registry import STATE_CODECS

ANCHOR_CODECS = STATE_CODECS  # anchors are whole parameters
INNER_OPTIMIZERS = ("adam", "sgd")


@dataclass(frozen=True)
class DilocoConfig:
    """The outer loop over H inner steps of local AdamW (H is `OptimizerConfig.local_steps`).

    - `outer_lr`, `outer_momentum`: the outer Nesterov step on the gossip-mixed pseudo-gradient
      (DiLoCo's defaults 0.7 and 0.9); each node keeps its own momentum.
    - `fragments`: P; the parameters are split into P fragments synced at staggered inner steps, so
      about 1/P of the model is in flight at a time (Streaming DiLoCo). 1: the whole model at once.
    - `overlap`: the exchange of a phase's pseudo-gradient runs while the next phase computes, and its
      outer step is applied one phase late (the local pseudo-gradient stands in meanwhile).
    - `qsr_alpha`: 0 keeps H constant; > 0 lets H grow as the learning rate decays, by the quadratic
      synchronisation rule H = max(H_base, floor((alpha / lr)^2)) (after the warm-up).
    - `anchor_every`: every this many syncs of a fragment its anchors are mixed with the same
      neighbours too (a state, in `anchor_codec`, never top-k): mixing pseudo-gradients alone keeps
      the swarm's mean on DiLoCo's path but lets each node's anchor drift with its own data; 0: never.
    - `anchor_codec`: the codec anchors travel in (fp32, fp16, bf16 or int8, with error feedback).
    - `inner`: the inner optimizer, AdamW as DiLoCo (`adam`, the local direction of dadam) or plain SGD
      (`sgd`, dsgd's: with outer lr 1 and no momentum, local SGD with periodic gossip averaging).
    """

    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    fragments: int = 1
    overlap: bool = False
    qsr_alpha: float = 0.0
    anchor_every: int = 1
    anchor_codec: str = "int8"
    inner: str = "adam"  # the inner optimizer: "adam" (AdamW, DiLoCo's) or "sgd" (local SGD)

    MAX_FRAGMENTS = 64

    def __post_init__(self) -> None:
        if not (math.isfinite(self.outer_lr) and 0.0 < self.outer_lr <= 10.0):
            raise ValueError(f"outer_lr must be in (0, 10], got {self.outer_lr!r}")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum!r}")
        if type(self.fragments) is not int or not 1 <= self.fragments <= self.MAX_FRAGMENTS:
            raise ValueError(f"fragments must be an integer in [1, {self.MAX_FRAGMENTS}], got {self.fragments!r}")
        if not (math.isfinite(self.qsr_alpha) and self.qsr_alpha >= 0.0):
            raise ValueError(f"qsr_alpha must be >= 0, got {self.qsr_alpha!r}")
        if type(self.anchor_every) is not int or self.anchor_every < 0:
            raise ValueError(f"anchor_every must be an integer >= 0, got {self.anchor_every!r}")
        if self.inner not in INNER_OPTIMIZERS:
            raise ValueError(f"inner must be one of {', '.join(INNER_OPTIMIZERS)}, got {self.inner!r}")
        if self.anchor_codec not in ANCHOR_CODECS:
            raise ValueError(f"anchor_codec must be one of {', '.join(ANCHOR_CODECS)} (a whole-parameter codec; "
                             f"top-k is sound only on differences), got {self.anchor_codec!r}")

    @property
    def inner_algorithm(self) -> str:
        """The local direction of the inner steps, as gossip.optimizers names it."""
        return "dadam" if self.inner == "adam" else "dsgd"

    def mixes_anchors(self, round_index: int) -> bool:
        """Whether a fragment's sync of `round_index` also mixes its anchors."""
        return self.anchor_every > 0 and (round_index + 1) % self.anchor_every == 0


# The one place DiLoCo's defaults are written: the node's settings, the swarm document, `murmur plan` and
# its model read them from here, so a founder, a joiner and a prediction cannot disagree on what "unset" means.
DILOCO_DEFAULTS = DilocoConfig()
