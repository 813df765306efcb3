"""The membership view's size cap: which live records a node keeps when more peers publish records than
it will track (a flood of records must grow neither memory nor the topology without bound, nor keep a
new honest peer out).

The rule ranks by standing and recency, not by incumbency (docs/threat-model.md, "Sybils"):
1. this node;
2. peers of the last view that show progress: they serve rounds (`gossip_from > 0`) or their step rose
   since the last view, ordered by sha256(swarm name, peer id), at most `cap - 1 - reserve` of them;
3. a random sample of newcomers (not in the last view), `reserve` = a quarter of the cap: a flood of
   record-only identities, incumbent or claiming progress, cannot keep every newcomer out;
4. the rest in the order: the other standing peers, then peers of the last view without progress, the
   most recently admitted first (one that never progresses ages out), then the other newcomers.
A record-only identity that claims progress gets the standing of tier 2 for free, which is why open
swarms make each identity cost a proof of work (node.net.work) and the newcomers' share is reserved.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from typing import Protocol, TypeVar

MAX_VIEW = 256  # peers a node tracks, itself included
NEWCOMER_SHARE = 4  # a 1/NEWCOMER_SHARE of the cap is kept for newcomers drawn at random


class Progressing(Protocol):
    """What the cap reads of a record (node.net.records.PeerRecord)."""

    @property
    def step(self) -> int: ...

    @property
    def gossip_from(self) -> int: ...


R = TypeVar("R", bound=Progressing)


def newcomer_rank(swarm: str, peer_id: str) -> bytes:
    return hashlib.sha256(f"{swarm}\0{peer_id}".encode()).digest()


def shows_progress(record: Progressing, before: Progressing | None) -> bool:
    """Whether a peer of the last view (`before`: its record then) stands: it serves rounds or its step rose."""
    return before is not None and (record.gossip_from > 0 or record.step > before.step)


def cap_view(records: Mapping[str, R], me: str, previous: Mapping[str, Progressing],
             admitted_at: Mapping[str, float], cap: int, swarm: str,
             rng: random.Random) -> tuple[dict[str, R], int]:
    """At most `cap` of `records` (peer id -> record), chosen as the module docstring says, and how many
    were left out. `previous`: the last view's records; `admitted_at`: when each of them entered the view
    (any clock; larger is later); `rng` draws the newcomers."""
    if len(records) <= cap:
        return dict(records), 0
    others = [p for p in records if p != me]
    standing = sorted((p for p in others if shows_progress(records[p], previous.get(p))),
                      key=lambda p: newcomer_rank(swarm, p))
    newcomers = [p for p in others if p not in previous]
    rng.shuffle(newcomers)
    stands = set(standing)
    stalled = sorted((p for p in others if p in previous and p not in stands),
                     key=lambda p: (-admitted_at.get(p, 0.0), newcomer_rank(swarm, p)))
    reserve = max(1, cap // NEWCOMER_SHARE)
    first = min(len(standing), max(0, cap - 1 - reserve))
    drawn = min(len(newcomers), reserve)
    order = [me] if me in records else []
    order += standing[:first] + newcomers[:drawn] + standing[first:] + stalled + newcomers[drawn:]
    kept = order[:cap]
    return {p: records[p] for p in kept}, len(records) - len(kept)
