"""When a node gossips: the swarm's round clock, the quorum start, and who takes part in a round.

Rounds are numbered by wall-clock time from the swarm's epoch (in its config), so nodes agree on
the round without messages and a node that was frozen or slow simply continues at the current one.
A peer announces `gossip_from`, the first round it will take part in, in its DHT record; round r's
participants are the peers in the view with 0 < gossip_from <= r. Peers that see the same records
therefore build the same graph, which is what keeps the mixing doubly stochastic.

A training swarm's rounds follow each peer's steps rather than the clock: there `gossip_from` only says
that the peer serves its round protocols (0 until it does), so a peer whose record entered the view
while it was still loading or downloading is not paired yet (`serving_members`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from topology import MembershipView


@dataclass(frozen=True)
class RoundClock:
    epoch: float  # unix time at which round 0 starts
    interval_s: float

    def round_at(self, unix_time: float) -> int:
        return max(0, math.floor((unix_time - self.epoch) / self.interval_s))

    def start_of(self, round_index: int) -> float:
        return self.epoch + round_index * self.interval_s

    def next_round(self, now: float, last: int, max_lag: int) -> int:
        """The round to take after round `last`: the one right after it while that leaves the node
        at most `max_lag` rounds behind the clock, else the next round to start.

        A node whose round overran its slot thus catches up instead of skipping rounds: a skipped
        round breaks mixing on directed graphs (the peer that pulls from it still counts it, so the
        swarm's average moves). A node further behind (frozen, or far too slow) jumps to the present.
        """
        current = self.round_at(now)
        if last < current <= last + max_lag:
            return last + 1
        return current + 1


@dataclass(frozen=True)
class PeerTiming:
    peer_id: str
    gossip_from: int  # 0: not announced yet


def announce_round(clock: RoundClock, now: float, lead_s: float) -> int:
    """The round a node that just reached its quorum announces: far enough ahead for its record to
    reach every peer (`lead_s`: a few heartbeats) before that round starts."""
    return clock.round_at(now + lead_s) + 1


def latest_announcement(clock: RoundClock, now: float, lead_s: float) -> int:
    """The latest start an honest peer can have announced by `now`: its announce_round, with as much lead
    again for clock skew. A later one is a hostile record's (which would hold this node back for good)."""
    return announce_round(clock, now, 2 * lead_s) + 1


def plausible_timings(peers: Iterable[PeerTiming], latest: int) -> tuple[list[PeerTiming], list[PeerTiming]]:
    """The peers' announcements split into those at or before `latest` and those beyond it."""
    kept: list[PeerTiming] = []
    beyond: list[PeerTiming] = []
    for p in peers:
        (kept if p.gossip_from <= latest else beyond).append(p)
    return kept, beyond


def start_round(peers: Iterable[PeerTiming], own_announced: int) -> int | None:
    """The round this node starts gossiping in: the latest one announced by the peers it sees (the
    caller leaves out announcements beyond `latest_announcement`).

    None while a peer in view has not announced yet: starting before it would let two peers
    that see different announcements start in different rounds.
    """
    announced = [p.gossip_from for p in peers]
    if any(r == 0 for r in announced):
        return None
    return max([own_announced, *announced])


def participants(peers: Iterable[PeerTiming], round_index: int) -> MembershipView:
    """The peers that gossip in `round_index`: those that announced a start at or before it."""
    return MembershipView.of(p.peer_id for p in peers if 0 < p.gossip_from <= round_index)


def serving_members(peers: Iterable[tuple[str, int, int]], me: str, done: Callable[[int], bool]) -> MembershipView:
    """A training round's members: this peer and every peer in view (`(peer_id, gossip_from, step)`) that
    serves its round protocols and has steps left. Pairing a peer before it serves fails the round at once
    (the protocol is not there yet), and a node whose every neighbour is still loading would train alone."""
    return MembershipView.of(peer_id for peer_id, gossip_from, step in peers
                             if peer_id == me or (gossip_from > 0 and not done(step)))
