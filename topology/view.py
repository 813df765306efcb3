"""From a membership view (a set of peer ids) to ranks: peers with equal views compute equal graphs."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from topology.catalog import Topology


@dataclass(frozen=True)
class MembershipView:
    """The live peers as one node sees them, sorted by id; a peer's rank is its index here."""

    peer_ids: tuple[str, ...]

    @classmethod
    def of(cls, peer_ids: Iterable[str]) -> MembershipView:
        return cls(tuple(sorted(set(peer_ids))))

    def __post_init__(self) -> None:
        if list(self.peer_ids) != sorted(set(self.peer_ids)):
            raise ValueError("a membership view holds distinct peer ids in sorted order; build it with MembershipView.of")

    @property
    def n(self) -> int:
        return len(self.peer_ids)

    def rank_of(self, peer_id: str) -> int:
        try:
            return self.peer_ids.index(peer_id)
        except ValueError:
            raise KeyError(f"peer {peer_id} is not in the membership view") from None


@dataclass(frozen=True)
class PeerRound:
    """Whom one peer mixes with in one round, by peer id, and with what weights."""

    self_weight: float
    in_weights: dict[str, float]  # peers whose values this peer mixes in -> weight
    out_peers: tuple[str, ...]  # peers that mix in this peer's value

    def without(self, peers: Iterable[str]) -> PeerRound:
        """This round with `peers` left out, their weights moved onto this peer's own value: what a
        skipped neighbour amounts to, decided before the round instead of at its deadline."""
        gone = set(peers)
        if not gone & (set(self.in_weights) | set(self.out_peers)):
            return self
        kept = {p: w for p, w in self.in_weights.items() if p not in gone}
        moved = sum(w for p, w in self.in_weights.items() if p in gone)
        return PeerRound(self.self_weight + moved, kept, tuple(p for p in self.out_peers if p not in gone))


def peer_round(topology: Topology, view: MembershipView, peer_id: str, round_index: int) -> PeerRound:
    if topology.n != view.n:
        raise ValueError(f"topology over {topology.n} ranks used with a view of {view.n} peers")
    rank = view.rank_of(peer_id)
    row = topology.row(rank, round_index)
    outs = topology.graph(round_index).out_neighbours(rank)
    return PeerRound(
        row.self_weight,
        {view.peer_ids[j]: w for j, w in row.neighbours},
        tuple(view.peer_ids[j] for j in outs),
    )

