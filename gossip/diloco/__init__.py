"""Gossip DiLoCo without torch or networking.

The shared knobs (`config`), the outer Nesterov step (`outer`), the split of the model into streamed
fragments (`fragments`), when each fragment syncs (`schedule`, with the outer warm-up and the quadratic
synchronisation rule), the analytic traffic (`traffic`) and volunteers of unequal speed (`unequal`: the
learned grace window; the token weights are the mix's, gossip.mixing.token_weights).

`node/algorithms/diloco/trainer.py` runs these over a trainer and one gossip peer per fragment;
docs/training.md ("Gossip DiLoCo") explains the scheme.
"""

from gossip.diloco.config import (
    ANCHOR_CODECS,
    DILOCO_DEFAULTS,
    INNER_OPTIMIZERS,
    MAX_ANCHOR_EVERY,
    MAX_QSR_ALPHA,
    DilocoConfig,
    DilocoSettings,
)
from gossip.diloco.fragments import fragment_partition
from gossip.diloco.outer import OuterNesterov
from gossip.diloco.schedule import MAX_PHASE, SyncSchedule, qsr_period, warmup_period
from gossip.diloco.traffic import RoundMessages, Traffic, round_bytes, run_bytes
from gossip.diloco.unequal import PHASE_ROOM, ArrivalWindow, grace_window, phase_seconds_for
from gossip.knobs import DILOCO_LOCAL_STEPS, MAX_OUTER_LR
from gossip.mixing import token_weights

__all__ = [
    "ANCHOR_CODECS",
    "DILOCO_DEFAULTS",
    "DILOCO_LOCAL_STEPS",
    "INNER_OPTIMIZERS",
    "MAX_ANCHOR_EVERY",
    "MAX_OUTER_LR",
    "MAX_PHASE",
    "MAX_QSR_ALPHA",
    "PHASE_ROOM",
    "ArrivalWindow",
    "DilocoConfig",
    "DilocoSettings",
    "OuterNesterov",
    "RoundMessages",
    "SyncSchedule",
    "Traffic",
    "fragment_partition",
    "grace_window",
    "phase_seconds_for",
    "qsr_period",
    "round_bytes",
    "run_bytes",
    "token_weights",
    "warmup_period",
]
