"""One group of tensors synced by an outer step over gossip (a DiLoCo fragment, SPES's shared weights,
one SPES expert): its anchor, the error-feedback residuals of what it sends, its outer momentum and
the gossip peers its pseudo-gradients and anchors are mixed on.

A sync of round k: the pseudo-gradient Δ = anchor - now, folded into the next outer momentum buffer
(mu b + Δ; Δ itself without momentum), is compressed with error feedback and mixed with the round's
neighbours, so the buffers stay in consensus (gossip.diloco.OuterNesterov); when the anchors are mixed
too (every `anchor_every`-th round) the anchors' compressed images are mixed on a second peer with the
same plan; the new anchor is (mix of anchors, or our own) - outer_lr * Nesterov(mixed buffer).
With outer lr 1 and no momentum that is the mix of (anchor - Δ) = the mix of the current weights, so
such a sync sends that one message ("fused"): exactly the gossip of D-SGD, compressed with error
feedback."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from gossip.codecs import Codec, ErrorFeedback
from gossip.diloco import OuterNesterov
from gossip.diloco.unequal import ArrivalWindow
from gossip.exchange import ExchangeSettings, GossipPeer, RoundOutcome, Skip
from gossip.optimizers import consensus_distance
from gossip.transport import Transport
from topology import PeerRound


@dataclass(frozen=True)
class GroupSync:
    """What one sync of a group found: its rounds and the distance of our values to the neighbours'."""

    round: int
    outcome: RoundOutcome | None  # the pseudo-gradients' round (None when fused or failed)
    consensus_distance: float | None
    anchors: RoundOutcome | None = None  # the anchors' round (fused: the only one)
    anchor_distance: float | None = None


class OuterGroup:
    """See the module docstring. Arrays are float32 and replaced, never modified in place."""

    def __init__(self, transport: Transport, settings: ExchangeSettings, anchor_codec: Codec, names: tuple[str, ...],
                 *, protocol: str, anchor_protocol: str, outer: OuterNesterov, anchor_every: int,
                 arrivals: ArrivalWindow | None = None) -> None:
        self.names = names
        self._transport = transport
        self._settings = settings
        self._protocol, self._anchor_protocol = protocol, anchor_protocol
        self._anchor_settings = replace(settings, codec=anchor_codec, config_hash=f"{settings.config_hash}/anchor")
        self._outer = outer
        self._anchor_every = anchor_every
        # how long a round waits for a neighbour, learned from the recent rounds (None: the settings' fixed wait)
        self.arrivals = arrivals
        self._feedback = _feedback_for(settings.codec)
        self._anchor_feedback = _feedback_for(anchor_codec)
        # outer lr 1, no momentum and one codec: a sync that mixes anchors sends one message, anchor - Δ
        self.fused = outer.lr == 1.0 and outer.momentum == 0.0 and anchor_codec == settings.codec
        self.anchor: dict[str, np.ndarray] = {}
        self.peer: GossipPeer | None = None
        self.anchor_peer: GossipPeer | None = None

    async def start(self, anchor: Mapping[str, np.ndarray], step: int, round_index: int) -> None:
        self.anchor = {n: np.asarray(anchor[n], np.float32).reshape(-1) for n in self.names}
        zeros = {n: np.zeros_like(a) for n, a in self.anchor.items()}
        self.peer = GossipPeer(self._transport, self._settings, zeros, step=step, protocol=self._protocol)
        self.anchor_peer = GossipPeer(self._transport, self._anchor_settings, dict(zeros), step=step,
                                      protocol=self._anchor_protocol)
        await self.peer.start()
        await self.anchor_peer.start()
        self.place(step, round_index)

    def place(self, step: int, round_index: int) -> None:
        """Answer the round after `round_index` next (a fresh, resumed or downloaded node)."""
        for peer in self.peers:
            peer.round, peer.step = max(0, round_index), step

    @property
    def peers(self) -> tuple[GossipPeer, ...]:
        return tuple(p for p in (self.peer, self.anchor_peer) if p is not None)

    def mixes_anchors(self, round_index: int) -> bool:
        return self._anchor_every > 0 and (round_index + 1) % self._anchor_every == 0

    async def exchange(self, round_index: int, delta: Mapping[str, np.ndarray], step: int,
                       plan_for: Callable[[], Awaitable[PeerRound]], *, share: float = 1.0) -> GroupSync:
        """Compress and offer this round's values, run the round(s) with the plan `plan_for()` awaits;
        the peers then hold the mixes (see `land`). `share`: of a full phase's inner steps, those `delta`
        covers; the round weighs each pseudo-gradient by its own (gossip.exchange.SHARE), not the anchors."""
        assert self.peer is not None and self.anchor_peer is not None, "start() first"
        anchors = self.mixes_anchors(round_index)
        # a fused sync mixes A - Δ: with one anchor, weighing those is weighing the Δ
        self.peer.share, self.anchor_peer.share = share, share if anchors and self.fused else 1.0
        if self.arrivals is not None:
            window = self.arrivals.window()
            for peer in self.peers:
                peer.set_exchange_timeout(window)
        if anchors and self.fused:
            image = await asyncio.to_thread(
                lambda: _compressed(self._anchor_feedback, {n: self.anchor[n] - delta[n] for n in self.names}))
            self.anchor_peer.set_tensors(image, step=step)
            plan = await plan_for()
            outcome = await self.anchor_peer.run_round(round_index, plan)
            self._record_arrivals(outcome)
            distance = await asyncio.to_thread(consensus_distance, image, self.anchor_peer.tensors, plan.self_weight,
                                               plan.in_weights, outcome.mixed_with)
            return GroupSync(round_index, None, None, outcome, distance)
        # what is mixed is the next momentum buffer, mu b + delta (gossip.diloco.OuterNesterov): the same
        # bytes as delta alone, and the buffers stay in consensus
        image, anchor_image = await asyncio.to_thread(
            lambda: ({n: _compressed_one(self._feedback, n, self._outer.message(n, delta[n])) for n in self.names},
                     _compressed(self._anchor_feedback, {n: self.anchor[n] for n in self.names}) if anchors else None))
        self.peer.set_tensors(image, step=step)
        if anchor_image is not None:
            self.anchor_peer.set_tensors(anchor_image, step=step)
        plan = await plan_for()
        async with asyncio.TaskGroup() as group:
            rounds = group.create_task(self.peer.run_round(round_index, plan))
            anchor_rounds = group.create_task(self.anchor_peer.run_round(round_index, plan)) if anchor_image else None
        outcome = rounds.result()
        self._record_arrivals(outcome)
        distance = await asyncio.to_thread(consensus_distance, image, self.peer.tensors, plan.self_weight,
                                           plan.in_weights, outcome.mixed_with)
        if anchor_rounds is None or anchor_image is None:
            return GroupSync(round_index, outcome, distance)
        anchor_outcome = anchor_rounds.result()
        anchor_distance = await asyncio.to_thread(consensus_distance, anchor_image, self.anchor_peer.tensors,
                                                  plan.self_weight, plan.in_weights, anchor_outcome.mixed_with)
        return GroupSync(round_index, outcome, distance, anchor_outcome, anchor_distance)

    def _record_arrivals(self, outcome: RoundOutcome) -> None:
        """A round in which every neighbour that was waited for came tells how long the last one took; a
        round that cut one for its timeout only that it took longer (ArrivalWindow.record_cut)."""
        if self.arrivals is None:
            return
        if any(reason.split(":")[0] == Skip.TIMEOUT for reason in outcome.skipped.values()):
            self.arrivals.record_cut()
        elif outcome.mixed_with:
            self.arrivals.record(outcome.duration_s)

    def land(self, sync: GroupSync | None, delta: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Apply the outer step of a finished `sync` (None: it failed, and the local pseudo-gradient
        stands in) to the anchor; returns the new anchor. CPU-heavy for a large group: run in a thread."""
        assert self.peer is not None and self.anchor_peer is not None, "start() first"
        if sync is not None and sync.outcome is None and sync.anchors is not None:  # fused
            self.anchor = {n: np.asarray(self.anchor_peer.tensors[n], np.float32) for n in self.names}
            return dict(self.anchor)
        base = self.anchor_peer.tensors if sync is not None and sync.anchors is not None else self.anchor
        if sync is None:  # alone: the local Nesterov step
            self.anchor = {n: self._outer.step(n, base[n], delta[n]) for n in self.names}
        else:
            self.anchor = {n: self._outer.step_mixed(n, base[n], self.peer.tensors[n]) for n in self.names}
        return dict(self.anchor)

    def residuals(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """What the pseudo-gradients' and the anchors' codecs have not sent yet, by tensor."""
        return (self._feedback.state() if self._feedback is not None else {},
                self._anchor_feedback.state() if self._anchor_feedback is not None else {})

    def load_residuals(self, deltas: Mapping[str, np.ndarray], anchors: Mapping[str, np.ndarray]) -> None:
        for feedback, residuals in ((self._feedback, deltas), (self._anchor_feedback, anchors)):
            if feedback is not None:
                feedback.load_state({n: r for n, r in residuals.items() if n in self.names})

    def reset_residuals(self) -> None:
        for feedback in (self._feedback, self._anchor_feedback):
            if feedback is not None:
                feedback.reset()


def _feedback_for(codec: Codec) -> ErrorFeedback | None:
    """Error feedback for a lossy codec; fp32 drops nothing."""
    return ErrorFeedback(codec) if codec.name != "fp32" else None


def _compressed(feedback: ErrorFeedback | None, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What the receivers will decode of `tensors`, the rest kept as the residual."""
    if feedback is None:
        return dict(tensors)
    return {n: feedback.compress(n, v) for n, v in tensors.items()}


def _compressed_one(feedback: ErrorFeedback | None, name: str, value: np.ndarray) -> np.ndarray:
    """One tensor's image (tensor by tensor, so a transient such as mu b + Δ is one tensor at a time)."""
    return value if feedback is None else feedback.compress(name, value)


__all__ = ["GroupSync", "OuterGroup"]
