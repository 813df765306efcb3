"""The membership view's size cap: which live records a node keeps when more peers publish records than
it will track (a flood of records must grow neither memory nor the topology without bound).

The rule is deterministic so honest peers agree as far as they can: this node first, then the peers
already in its view (incumbents keep their place, so records that arrive in a flood cannot push
honest members out), then newcomers in the order of sha256(swarm name, peer id), which a flooder
cannot choose cheaply for a swarm it does not know in advance. Two honest nodes that saw the swarm
grow keep the same peers; a node that starts during a flood may keep different newcomers than its
neighbours, which the exchange tolerates as it tolerates churn. docs/threat-model.md gives the figure.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping
from typing import TypeVar

MAX_VIEW = 256  # peers a node tracks, itself included

R = TypeVar("R")


def newcomer_rank(swarm: str, peer_id: str) -> bytes:
    return hashlib.sha256(f"{swarm}\0{peer_id}".encode()).digest()


def cap_view(records: Mapping[str, R], me: str, incumbents: Collection[str], cap: int,
             swarm: str) -> tuple[dict[str, R], int]:
    """At most `cap` of `records` (peer id -> record), chosen as the module docstring says, and how
    many were left out."""
    if len(records) <= cap:
        return dict(records), 0
    order = sorted(records, key=lambda p: (p != me, p not in incumbents, newcomer_rank(swarm, p)))
    kept = order[:cap]
    return {p: records[p] for p in kept}, len(records) - len(kept)
