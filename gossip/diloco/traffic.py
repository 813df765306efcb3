"""Gossip DiLoCo's analytic traffic: the bytes one node writes and reads in one gossip round of a fragment,
and summed over a run.

A round's bytes come from its plan and the exact size of each wire message; a run's from walking the sync
schedule. The multi-process test checks measured bytes against it (within 10%); a runtime model
(`murmur plan`) may stand in for it through the same `Prediction` shape."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from gossip.codecs import Codec
from gossip.diloco.schedule import SyncSchedule
from gossip.wire import message_nbytes
from topology import PeerRound


@dataclass(frozen=True)
class RoundMessages:
    """What one node does in one round (see gossip.exchange): pulls it sends to in-neighbours only it
    mixes, pulls it answers for out-neighbours only, symmetric exchanges it opens (smaller id) and
    answers."""

    pulls_sent: int = 0
    pulls_served: int = 0
    exchanges_asked: int = 0
    exchanges_answered: int = 0

    @classmethod
    def of(cls, plan: PeerRound, me: str) -> RoundMessages:
        ins, outs = set(plan.in_weights), set(plan.out_peers)
        both = ins & outs
        return cls(pulls_sent=len(ins - both), pulls_served=len(outs - both),
                   exchanges_asked=sum(1 for p in both if me < p), exchanges_answered=sum(1 for p in both if me > p))


@dataclass(frozen=True)
class Traffic:
    sent: int = 0
    received: int = 0

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.sent + other.sent, self.received + other.received)

    @property
    def total(self) -> int:
        return self.sent + self.received


def round_bytes(specs: Mapping[str, tuple[tuple[int, ...], object]], codec: Codec, messages: RoundMessages,
                **header: object) -> Traffic:
    """Bytes one node writes and reads in one round moving tensors `specs` (name -> (shape, dtype)) in
    `codec`: a message with tensors costs M, a header-only one (pull request, ack) H."""
    full = message_nbytes(specs, codec, **header)  # type: ignore[arg-type]
    bare = message_nbytes({}, codec, **header)  # type: ignore[arg-type]
    m = messages
    sent = m.pulls_sent * bare + m.pulls_served * full + m.exchanges_asked * (full + bare) + m.exchanges_answered * full
    received = (m.pulls_sent * full + m.pulls_served * bare + m.exchanges_asked * full
                + m.exchanges_answered * (full + bare))
    return Traffic(sent, received)


# (fragment, round) -> this node's plan for that round
PlanOf = Callable[[int, int], PeerRound]


def run_bytes(fragments: Sequence[Mapping[str, np.ndarray]], codec: Codec, schedule: SyncSchedule, steps: int,
              plan_of: PlanOf, me: str, *, flush_at_end: bool = True, **header: object) -> Traffic:
    """What one node moves in the outer exchanges of `steps` steps: every sync the schedule holds,
    plus (`flush_at_end`) the final sync of each fragment whose last sync point came before the end.
    `fragments` gives each fragment's tensors (only their shapes and dtypes are used)."""
    specs = [{n: (t.shape, t.dtype) for n, t in frag.items()} for frag in fragments]
    total = Traffic()
    last = [-1] * len(fragments)
    for count in range(1, steps + 1):
        for p, k in schedule.syncs_at(count):
            total = total + round_bytes(specs[p], codec, RoundMessages.of(plan_of(p, k), me), **header)
            last[p] = count
    if flush_at_end:
        for p, done in enumerate(last):
            if done != steps:
                k = schedule.last_sync(p, steps) + 1
                total = total + round_bytes(specs[p], codec, RoundMessages.of(plan_of(p, k), me), **header)
    return total
