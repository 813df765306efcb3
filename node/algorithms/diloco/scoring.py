"""Contribution scoring of gossip DiLoCo's outer rounds (node.swarm.contribution): a neighbour's message is
scored as the model it leads to from this node's anchor, and a peer rated low is down-weighted or left out
of every round of the fragments, anchors included."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

from node.swarm.contribution import ContributionScorer, Measured, Tensors


def models_from_messages(anchor: Tensors, own: Tensors, base: Tensors | None,
                         received: Mapping[str, Tensors]) -> Measured | None:
    """A fragment round's messages m (the pseudo-gradient, start minus end of a phase, or with outer momentum
    the next buffer mu b + Δ: what the outer step applies) as models, A - m, measured from the anchor A.
    Moving A toward A - m_j by j's weight is A - w_j m_j: j's share of the outer step at outer lr 1."""
    if not anchor:
        return None
    return (anchor, {n: anchor[n] - own[n] for n in own},
            {peer: {n: anchor[n] - m[n] for n in m} for peer, m in received.items()})


def models_from_anchor(anchor: Tensors, own: Tensors, base: Tensors | None,
                       received: Mapping[str, Tensors]) -> Measured | None:
    """A fused sync's values are models already (each peer's A_j - Δ_j), measured from this node's anchor."""
    return (anchor, own, dict(received)) if anchor else None


class FragmentJudge:
    """gossip.exchange.Judge for a fragment's peer: scores its scored rounds with `values` from the anchor as
    it is when the round's values arrive (a snapshot: DilocoTrainer replaces the anchor's arrays, never
    modifies them), or with no `values` only answers the ratings (rounds that mix plain anchors, whose
    values say nothing of a peer's updates)."""

    def __init__(self, scorer: ContributionScorer, anchor: Callable[[], Tensors],
                 values: Callable[[Tensors, Tensors, Tensors | None, Mapping[str, Tensors]], Measured | None] | None
                 ) -> None:
        self._scorer, self._anchor, self._values = scorer, anchor, values

    def weigh(self, round_index: int, own: Tensors, base: Tensors | None, received: Mapping[str, Tensors],
              weights: Mapping[str, float]) -> dict[str, float]:
        if self._values is None:
            return self._scorer.factors(received)
        values = functools.partial(self._values, self._anchor())
        return self._scorer.weigh_with(values, round_index, own, base, received, weights)


__all__ = ["FragmentJudge", "models_from_anchor", "models_from_messages"]
