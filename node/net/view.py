"""The membership view's size cap: which live records a node keeps when more peers publish records than
it will track (a flood of records must grow neither memory nor the topology without bound, nor keep a
new honest peer out).

The rule ranks by standing and recency, not by incumbency (docs/threat-model.md, "Sybils"):
1. this node;
2. peers of the view that stand: they serve rounds (`gossip_from > 0`) and their step or round rose
   since they entered the view (a record-only identity must at least re-sign a rising claim every heartbeat to
   keep it); the longest in the view first, then by sha256(swarm name, peer id); at most
   `cap - 1 - reserve` of them here;
3. a random sample of newcomers (not in the view), `reserve` = a quarter of the cap: a flood of
   record-only identities, in the view or claiming progress, cannot keep every newcomer out;
4. the rest in the order: the other standing peers, then peers of the view that do not stand, the
   most recently admitted first (one that never progresses ages out), then the other newcomers.
A record-only identity that keeps claiming progress stands (after the peers that stood before it),
which is why open swarms make each identity cost a proof of work (node.net.work) and newcomers keep
their share.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

MAX_VIEW = 256  # peers a node tracks, itself included
NEWCOMER_SHARE = 4  # a 1/NEWCOMER_SHARE of the cap is kept for newcomers drawn at random


class Progressing(Protocol):
    """What the cap reads of a record (node.net.records.PeerRecord)."""

    @property
    def step(self) -> int: ...

    @property
    def round(self) -> int: ...

    @property
    def gossip_from(self) -> int: ...


@dataclass(frozen=True)
class Admitted:
    """When a peer entered this node's view (any monotonic clock) and the step and round its record claimed then."""

    at: float
    step: int
    round: int = 0


R = TypeVar("R", bound=Progressing)


def newcomer_rank(swarm: str, peer_id: str) -> bytes:
    return hashlib.sha256(f"{swarm}\0{peer_id}".encode()).digest()


def stands(record: Progressing, admitted: Admitted | None) -> bool:
    """Whether a peer of the view stands: it serves rounds, and its step or round rose since it entered the view."""
    return admitted is not None and record.gossip_from > 0 and (record.step > admitted.step
                                                                  or record.round > admitted.round)


def cap_view(records: Mapping[str, R], me: str, admitted: Mapping[str, Admitted], cap: int, swarm: str,
             rng: random.Random) -> tuple[dict[str, R], int]:
    """At most `cap` of `records` (peer id -> record), chosen as the module docstring says, and how many
    were left out. `admitted`: the peers of the current view, when they entered it; `rng` draws newcomers."""
    if len(records) <= cap:
        return dict(records), 0
    others = [p for p in records if p != me]
    standing = sorted((p for p in others if stands(records[p], admitted.get(p))),
                      key=lambda p: (admitted[p].at, newcomer_rank(swarm, p)))
    newcomers = [p for p in others if p not in admitted]
    rng.shuffle(newcomers)
    stood = set(standing)
    stalled = sorted((p for p in others if p in admitted and p not in stood),
                     key=lambda p: (-admitted[p].at, newcomer_rank(swarm, p)))
    reserve = max(1, cap // NEWCOMER_SHARE)
    first = min(len(standing), max(0, cap - 1 - reserve))
    drawn = min(len(newcomers), reserve)
    order = [me] if me in records else []
    order += standing[:first] + newcomers[:drawn] + standing[first:] + stalled + newcomers[drawn:]
    kept = order[:cap]
    return {p: records[p] for p in kept}, len(records) - len(kept)
