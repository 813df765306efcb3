"""The membership view's size cap: which live records a node keeps when more peers publish records than
it will track (a flood of records must grow neither memory nor the topology without bound, nor keep a
new honest peer out).

The rule ranks by standing, then gives newcomers a share, and keeps incumbents only after both
(docs/threat-model.md, "Sybils"):
1. this node;
2. peers that stand: their step or round rose since this node first saw their record (evidence over
   time: a record-only identity must re-sign a rising claim every heartbeat to keep it, while a claim
   to serve, `gossip_from > 0`, costs nothing to hold and so counts for nothing here); the first seen
   first, then by sha256(swarm name, peer id); at most `cap - 1 - reserve` of them here;
3. a random sample of newcomers (not in the view), `reserve` = a quarter of the cap: a flood of
   record-only identities, in the view or claiming progress, cannot keep every newcomer out;
4. the rest in the order: the other standing peers, then the view's peers that do not stand (the first
   seen first: a member that has not progressed yet keeps its place against later identities), then
   the other newcomers.
A newcomer that got in through the share and then progresses stands (its progress counts from when it
was first seen, in the view or not). A record-only identity that keeps claiming progress stands too,
after those that stood before it, which is why open swarms make each identity cost a proof of work
(node.net.work).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Collection, Mapping
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


@dataclass(frozen=True)
class FirstSeen:
    """When this node first saw a peer's live record (any monotonic clock), and its step and round then."""

    at: float
    step: int
    round: int = 0


R = TypeVar("R", bound=Progressing)


def newcomer_rank(swarm: str, peer_id: str) -> bytes:
    return hashlib.sha256(f"{swarm}\0{peer_id}".encode()).digest()


def stands(record: Progressing, seen: FirstSeen | None) -> bool:
    """Whether a peer stands: its step or round rose since this node first saw its record."""
    return seen is not None and (record.step > seen.step or record.round > seen.round)


def cap_view(records: Mapping[str, R], me: str, view: Collection[str], seen: Mapping[str, FirstSeen], cap: int,
             swarm: str, rng: random.Random) -> tuple[dict[str, R], int]:
    """At most `cap` of `records` (peer id -> record), chosen as the module docstring says, and how many
    were left out. `view`: the peers of the current view; `seen`: when this node first saw each record;
    `rng` draws the newcomers."""
    if len(records) <= cap:
        return dict(records), 0

    def seniority(p: str) -> tuple[float, bytes]:
        first = seen.get(p)
        return (first.at if first is not None else math.inf), newcomer_rank(swarm, p)

    others = [p for p in records if p != me]
    standing = sorted((p for p in others if stands(records[p], seen.get(p))), key=seniority)
    stood = set(standing)
    newcomers = [p for p in others if p not in view and p not in stood]
    rng.shuffle(newcomers)
    stalled = sorted((p for p in others if p in view and p not in stood), key=seniority)
    reserve = max(1, cap // NEWCOMER_SHARE)
    first = min(len(standing), max(0, cap - 1 - reserve))
    drawn = min(len(newcomers), reserve)
    order = [me] if me in records else []
    order += standing[:first] + newcomers[:drawn] + standing[first:] + stalled + newcomers[drawn:]
    kept = order[:cap]
    return {p: records[p] for p in kept}, len(records) - len(kept)
