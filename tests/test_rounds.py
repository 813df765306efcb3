"""The swarm's round clock and the quorum start of a vector swarm (node/swarm/rounds.py)."""

from __future__ import annotations

import pytest

from node.swarm.rounds import (
    PeerTiming,
    RoundClock,
    announce_round,
    latest_announcement,
    plausible_timings,
    start_round,
)

pytestmark = pytest.mark.unit

CLOCK = RoundClock(epoch=1000.0, interval_s=0.5)


def test_a_start_announced_beyond_what_any_peer_could_announce_is_left_out() -> None:
    """A record announcing round 2**64 - 1 once fixed a node's start there: it never gossiped again."""
    now, lead_s = 1100.0, 5.0
    honest = [PeerTiming("a", announce_round(CLOCK, now - 1.0, lead_s)), PeerTiming("b", announce_round(CLOCK, now, lead_s))]
    # another peer's clock may run ahead by as much as the lead: still plausible
    skewed = PeerTiming("c", announce_round(CLOCK, now + lead_s, lead_s))
    hostile = PeerTiming("h", 2**64 - 1)
    kept, beyond = plausible_timings([*honest, skewed, hostile], latest_announcement(CLOCK, now, lead_s))
    assert kept == [*honest, skewed] and beyond == [hostile]
    own = announce_round(CLOCK, now, lead_s)
    assert start_round(kept, own) == skewed.gossip_from
    assert start_round([*kept, PeerTiming("d", 0)], own) is None  # a peer yet to announce is waited for
