"""The swarm page's data (`GET /api/swarm`): every peer's published summary as this node's view holds it
(its own record included), its contribution points (tokens weighed by its contribution score) and their
share, and the swarm's loss and throughput over time in a bounded history."""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from gossip.scoring import PeerScore, ScoreState

DEFAULT_CAPACITY = 1800  # as the node's own history: 30 minutes at one point a second


class SwarmPeer(msgspec.Struct, frozen=True):
    """One row of the swarm table (schemas/swarm.json)."""

    peer_id: str
    self: bool
    step: int
    loss: float | None
    tokens: int  # processed by the peer itself, as its record claims (clipped to its step)
    tokens_per_s: float
    uptime_s: float
    reach: str  # how the swarm reaches it, as it says: direct, relayed, unknown
    connection: str | None  # this node's connection to it (None for this node)
    points: float  # its tokens weighed by its standing (contribution_points)
    share: float  # of the points of every peer in view, 0..1
    score: float | None  # its contribution score, where this node rates peers
    rated_rounds: int | None
    score_state: ScoreState | None


class SwarmPoint(msgspec.Struct, frozen=True):
    """The swarm as this node saw it at one sampling tick."""

    t: float
    peers: int
    loss: float | None  # mean of the peers' published losses (those that published one)
    tokens_per_s: float  # sum of the peers' throughputs
    tokens: int  # sum of the peers' tokens processed


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) else None


def _score(entry: object) -> PeerScore | None:
    """A `contribution` entry of `/api/status` in its declared schema; None where it is absent or not one."""
    try:
        return msgspec.convert(entry, PeerScore)
    except msgspec.ValidationError:
        return None


def contribution_points(tokens: int, score: float | None, state: ScoreState | None) -> float:
    """A peer's points: the tokens it trained, weighed by what its updates did where this node rates it
    (a score of about 1 is an honest peer's, about 0 a useless one's): in full when unrated, times the
    score clipped to [0, 1] when rated, none once excluded. Tokens are claimed; the score is measured."""
    if state is ScoreState.EXCLUDED:
        return 0.0
    if score is None:
        return float(tokens)
    return tokens * min(1.0, max(0.0, score))


def swarm_peers(peers: Sequence[Mapping[str, Any]], contribution: object = None) -> list[SwarmPeer]:
    """The rows from the monitor's peers (NodeRuntime.peers) and the status's `contribution` map, if any."""
    scores = contribution if isinstance(contribution, Mapping) else {}
    rated = []
    for p in peers:
        tokens = int(p.get("tokens") or 0)
        entry = _score(scores.get(p["peer_id"]))
        score = _number(entry.score) if entry is not None else None
        rounds = entry.rated_rounds if entry is not None else None
        state = entry.state if entry is not None else None
        rated.append((p, tokens, score, rounds, state, contribution_points(tokens, score, state)))
    total = sum(points for *_, points in rated)
    return [SwarmPeer(
        peer_id=p["peer_id"], self=bool(p.get("self")), step=int(p.get("step") or 0), loss=_number(p.get("loss")),
        tokens=tokens, tokens_per_s=_number(p.get("tokens_per_s")) or 0.0,
        uptime_s=_number(p.get("uptime_s")) or 0.0, reach=str(p.get("reach") or "unknown"),
        connection=None if p.get("self") else p.get("connection"), points=points,
        share=points / total if total else 0.0, score=score, rated_rounds=rounds, score_state=state)
        for p, tokens, score, rounds, state, points in rated]


def swarm_point(rows: Sequence[SwarmPeer], now: float) -> SwarmPoint:
    # each published figure is finite, but a few huge ones can overflow a sum: the page's JSON takes no inf
    losses = [r.loss for r in rows if r.loss is not None]
    mean = _number(sum(loss / len(losses) for loss in losses)) if losses else None  # divided first: no overflow
    return SwarmPoint(t=now, peers=len(rows), loss=mean,
                      tokens_per_s=_number(sum(r.tokens_per_s for r in rows)) or 0.0,
                      tokens=sum(r.tokens for r in rows))


class SwarmHistory:
    """The swarm's points, one per sampling tick, the newest `capacity` of them."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 2:
            raise ValueError(f"a swarm history holds at least 2 points, got capacity={capacity}")
        self._points: collections.deque[SwarmPoint] = collections.deque(maxlen=capacity)

    @property
    def capacity(self) -> int:
        return self._points.maxlen or 0

    def tick(self, rows: Sequence[SwarmPeer], now: float) -> SwarmPoint:
        point = swarm_point(rows, now)
        self._points.append(point)
        return point

    def points(self, limit: int | None = None) -> list[SwarmPoint]:
        """The last `limit` points (all when None), oldest first."""
        chosen = list(self._points)
        return chosen[-limit:] if limit is not None else chosen


def swarm_document(rows: Sequence[SwarmPeer], points: Sequence[SwarmPoint], *, me: str, interval_s: float,
                   capacity: int, now: float) -> dict[str, Any]:
    """`GET /api/swarm` (schemas/swarm.json): the rows, the current totals and the history."""
    current = swarm_point(rows, now)
    doc: dict[str, Any] = msgspec.to_builtins({
        "self": me, "now": now, "interval_s": interval_s, "capacity": capacity,
        "peers": list(rows), "loss": current.loss, "tokens_per_s": current.tokens_per_s, "tokens": current.tokens,
        "history": list(points)})
    return doc


__all__ = ["SwarmHistory", "SwarmPeer", "SwarmPoint", "contribution_points", "swarm_document", "swarm_peers",
           "swarm_point"]
