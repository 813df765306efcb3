"""Gossip DiLoCo on a node: H inner steps of local AdamW on the trainer, then, per fragment, the
pseudo-gradient (phase start minus now) compressed with error feedback and mixed with the topology's
neighbours by one gossip round, and an outer Nesterov step on the anchor (the model as of the last
outer step). With `overlap`, a fragment's exchange runs while the next phase computes and its outer
step lands one phase late. The rules are gossip.diloco; docs/training.md ("Gossip DiLoCo") explains
the scheme and what it costs in consensus."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from gossip.codecs import get_codec
from gossip.diloco import ArrivalWindow, DilocoConfig, OuterNesterov, SyncSchedule, fragment_partition
from gossip.errors import WireError
from gossip.exchange import ExchangeSettings, GossipPeer, PeerRejected, RoundOutcome
from gossip.optimizers import global_norm
from gossip.transport import Transport
from node.algorithms.diloco.scoring import FragmentJudge, models_from_anchor, models_from_messages
from node.algorithms.outer_group import GroupSync, OuterGroup
from node.swarm.contribution import ContributionScorer
from node.train.trainer import StepStats, Tensors, Trainer
from topology import PeerRound

logger = logging.getLogger("murmur.diloco")

MOMENTUM_PROTOCOL = "/murmur/diloco/momentum/1"
# checkpoint entries beside Trainer.state()'s
_ANCHOR, _MOMENTUM, _RESIDUAL = "diloco/anchor/", "diloco/momentum/", "diloco/residual/"
_ANCHOR_RESIDUAL = "diloco/anchor_residual/"
# A downloaded outer momentum is refused when its norm exceeds this many times the anchor's: a buffer
# sums pseudo-gradients geometrically, and a phase that moved the model by more than its own norm is
# not training but a hostile or broken peer.
MOMENTUM_NORM_BOUND = 10.0
# A joiner asks for the outer momentum in int8 (one float32 scale per 256 values: about 0.4% of a block's
# largest value): it is a starting point the next outer steps decay (by the momentum factor each), and the
# joiner fetches it whole from up to 3 peers, so fp32 made a DiLoCo catch-up 3 copies of the model dearer.
MOMENTUM_CODEC = "int8"

# (fragment, round) -> this node's neighbours and weights for that round, when it may start
FragmentPlanFor = Callable[[int, int], Awaitable[PeerRound]]


def fragment_protocol(fragment: int) -> str:
    """The protocol on which fragment `fragment`'s pseudo-gradients are mixed (one GossipPeer each)."""
    return f"/murmur/diloco/{fragment}/1"


def anchor_protocol(fragment: int) -> str:
    """The protocol on which fragment `fragment`'s anchors are mixed."""
    return f"/murmur/diloco/{fragment}/anchor/1"


@dataclass(frozen=True)
class OuterSync:
    """One fragment's outer exchange: its gossip round and what the mixes showed."""

    fragment: int
    round: int
    outcome: RoundOutcome | None  # the pseudo-gradients' round; None when fused (see OuterGroup) or failed
    consensus_distance: float | None  # ||own mixed value (mu b + Δ) - mean of the neighbours' that arrived||_2
    anchors: RoundOutcome | None = None  # the anchors' round, when this sync mixed them
    anchor_distance: float | None = None  # ||own anchor - mean of the neighbours' anchors that arrived||_2
    failed: bool = False  # the exchange failed; the local pseudo-gradient stood in


@dataclass(frozen=True)
class DilocoStepReport:
    stats: StepStats
    step_s: float
    launched: tuple[tuple[int, int], ...] = ()  # (fragment, round) exchanges started in this step
    synced: tuple[OuterSync, ...] = ()  # exchanges whose outer step was applied in this step
    passed: bool = False  # the wall-clock phase was spent: the step count moved on without training


@dataclass
class DilocoStats:
    """What the monitor shows of the outer loop (docs/monitor.md)."""

    outer_steps: int = 0  # outer updates applied to fragment 0 (phases completed)
    outer_updates: int = 0  # outer updates applied, all fragments
    exchanges_failed: int = 0
    last_sync_s: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)
    steps_passed: int = 0  # inner steps passed over, not trained (wall-clock phases)
    last_share: float = 1.0  # of its phase's inner steps, those the last sync's pseudo-gradient covered


class DilocoTrainer:
    """A Trainer driven as gossip DiLoCo over one OuterGroup per fragment (see the module docstring).

    `state_peer` (the node's main gossip peer) serves the anchors: what joiners download and what
    the swarm evaluation averages; a second peer serves the outer momentum to joiners. Arrays held
    here are replaced, never modified in place, so either peer can send a snapshot at any time."""

    def __init__(self, trainer: Trainer, transport: Transport, settings: ExchangeSettings, config: DilocoConfig,
                 schedule: SyncSchedule, *, state_peer: GossipPeer | None = None,
                 state_settings: ExchangeSettings | None = None, grace: tuple[float, float] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.trainer = trainer
        self.config = config
        self.schedule = schedule
        self._transport = transport
        self._settings = settings
        self._state_settings = state_settings or replace(settings, codec=get_codec("fp32"))
        self._state_peer = state_peer
        sizes = {name: p.numel() for name, p in trainer.model.named_parameters()}
        self.fragments = fragment_partition(sizes, config.fragments)
        self._fragment_of = {name: p for p, names in enumerate(self.fragments) for name in names}
        self._outer = OuterNesterov(config.outer_lr, config.outer_momentum)
        anchor_codec = get_codec(config.anchor_codec)
        self._groups = [
            OuterGroup(transport, replace(settings, config_hash=f"{settings.config_hash}/diloco/{p}"), anchor_codec,
                       names, protocol=fragment_protocol(p), anchor_protocol=anchor_protocol(p), outer=self._outer,
                       anchor_every=config.anchor_every,
                       arrivals=ArrivalWindow(lo=grace[0], hi=grace[1]) if grace is not None else None)
            for p, names in enumerate(self.fragments)]
        self._anchor: dict[str, np.ndarray] = {}
        self._start: dict[str, np.ndarray] | None = {} if config.overlap else None  # overlap: the phase start
        self._momentum_peer: GossipPeer | None = None
        self._pending: dict[int, asyncio.Task[OuterSync]] = {}
        self._pending_delta: dict[int, dict[str, np.ndarray]] = {}
        self._applied = [0] * len(self.fragments)
        self._in_sync = 0  # exchanges being awaited in the foreground (overlap off)
        self._residuals: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None = None  # from restore()
        self._scorer: ContributionScorer | None = None  # rates the neighbours' messages (score_with)
        self.stats = DilocoStats()
        # wall-clock phases (config.phase_seconds): inner steps trained so far; per fragment, the step count
        # and that number where its phase began (its last sync, or where the node was placed); and, for the
        # stretch up to the next sync point, the step count and that number where it began and the seconds
        # its steps took so far (None: it begins at the next step)
        self._clock = clock
        self._trained = 0
        self._phase_from: list[tuple[int, int]] = [(0, 0)] * len(self.fragments)
        self._stretch: tuple[int, int, float] | None = None

    # ---- set-up ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """The anchor is the trainer's current parameters (restore() or adopt() may replace it);
        serve the fragments' protocols and the momentum protocol."""
        if not self._anchor:
            self._anchor = await self.trainer.tensors()
            self._reset_start()
        count = self.trainer.step
        for p, group in enumerate(self._groups):
            await group.start(self._anchor, count, self.schedule.last_sync(p, count))
            self._phase_from[p] = (count, self._trained)
            if self._residuals is not None:
                group.load_residuals(*self._residuals)
            if self._scorer is not None:
                assert group.peer is not None and group.anchor_peer is not None
                anchor = lambda: self.anchor  # noqa: E731  # the anchor as it is when a round's values arrive
                group.peer.judge = FragmentJudge(self._scorer, anchor, models_from_messages)
                # a fused sync mixes models (A_j - Δ_j): scored from the anchor; plain anchors only weighed
                group.anchor_peer.judge = FragmentJudge(self._scorer, anchor, models_from_anchor if group.fused else None)
        momentum_settings = replace(self._state_settings, config_hash=f"{self._settings.config_hash}/diloco/momentum")
        self._momentum_peer = GossipPeer(self._transport, momentum_settings, self._momentum_tensors(),
                                         step=self.trainer.step, protocol=MOMENTUM_PROTOCOL)
        await self._momentum_peer.start()
        self._publish()

    def score_with(self, scorer: ContributionScorer) -> None:
        """Rate the neighbours by what their messages do to this node's held-out loss from its anchor, and
        weigh them so in every fragment round (node.algorithms.diloco.scoring); before start()."""
        self._scorer = scorer

    def _reset_start(self) -> None:
        if self._start is not None:
            self._start = dict(self._anchor)

    def _momentum_tensors(self) -> dict[str, np.ndarray]:
        return {n: (b if (b := self._outer.buffer(n)) is not None else np.zeros_like(a)) for n, a in self._anchor.items()}

    def _publish(self) -> None:
        """Serve the current anchors and momentum (joiners, the swarm evaluation). Both peers run no
        rounds, so nothing reads the base a move would keep (the adaptive radius's reference): as a move
        they would each hold their first values, a whole-model copy, for the node's life."""
        step = self.trainer.step
        if self._state_peer is not None:
            self._state_peer.set_tensors(dict(self._anchor), step=step, moved=False)
        if self._momentum_peer is not None:
            self._momentum_peer.set_tensors(self._momentum_tensors(), step=step, moved=False)

    @property
    def anchor(self) -> dict[str, np.ndarray]:
        return dict(self._anchor)

    @property
    def codec_name(self) -> str:
        return self._settings.codec.name

    def set_anchor(self, tensors: Tensors) -> None:
        """Make `tensors` the anchor (the final merge's model), without serving it: peers that merge
        after this node must still get its pre-merge final model."""
        self._anchor = {n: np.asarray(tensors[n], np.float32).reshape(-1) for n in self._anchor}
        for group in self._groups:
            group.anchor = {n: self._anchor[n] for n in group.names}
        self._reset_start()

    @property
    def momentum(self) -> dict[str, np.ndarray]:
        return self._outer.state()

    @property
    def peers(self) -> tuple[GossipPeer, ...]:
        """The fragments' pseudo-gradient peers."""
        return tuple(group.peer for group in self._groups if group.peer is not None)

    @property
    def grace_window_s(self) -> float | None:
        """How long the next outer round waits for a neighbour (fragment 0's window); None: the fixed wait."""
        arrivals = self._groups[0].arrivals
        return arrivals.window() if arrivals is not None else None

    @property
    def in_flight(self) -> int:
        """Fragment exchanges running now."""
        return sum(1 for task in self._pending.values() if not task.done()) + self._in_sync

    @property
    def bytes_sent(self) -> int:
        return sum(p.stats.bytes_sent for p in self._all_peers())

    @property
    def bytes_received(self) -> int:
        return sum(p.stats.bytes_received for p in self._all_peers())

    @property
    def outer_bytes(self) -> tuple[int, int]:
        """Bytes sent and received by the fragment exchanges alone (pseudo-gradients and anchors)."""
        peers = [p for group in self._groups for p in group.peers]
        return sum(p.stats.bytes_sent for p in peers), sum(p.stats.bytes_received for p in peers)

    @property
    def fragment_rounds(self) -> list[int]:
        """Outer exchanges each fragment has completed (a fused sync runs one round, another two)."""
        return [max(p.stats.rounds for p in group.peers) if group.peers else 0 for group in self._groups]

    @property
    def rounds_run(self) -> int:
        """Gossip rounds the fragments ran (pseudo-gradients and anchors; a fused sync runs one)."""
        return sum(p.stats.rounds for group in self._groups for p in group.peers)

    def skipped(self) -> dict[str, int]:
        """Neighbours left out of the fragments' rounds, by reason."""
        total: dict[str, int] = {}
        for peer in (p for group in self._groups for p in group.peers):
            for reason, n in peer.stats.skipped.items():
                total[reason] = total.get(reason, 0) + n
        return total

    def errors(self) -> dict[str, int]:
        total: dict[str, int] = dict(self.stats.errors)
        for peer in self._all_peers():
            for kind, n in peer.stats.errors.items():
                total[kind] = total.get(kind, 0) + n
        return total

    def _all_peers(self) -> list[GossipPeer]:
        peers = [p for group in self._groups for p in group.peers]
        return [*peers, *([self._momentum_peer] if self._momentum_peer is not None else [])]

    # ---- steps -------------------------------------------------------------------------------------

    async def step(self, plan_for: FragmentPlanFor, *, final: bool = False) -> DilocoStepReport:
        """One inner step, then the outer syncs the schedule puts after it. `final` (the last step of
        the budget): every pending exchange is awaited and every fragment syncs once more, in the
        foreground, so the trainer ends on the anchor."""
        started, clock_started = time.perf_counter(), self._clock()
        passed = self._phase_spent(self.trainer.step)
        if passed:
            stats = await self.trainer.pass_step()
            self.stats.steps_passed += 1
        else:
            stats = await self.trainer.train_step()
            self._trained += 1
        count = self.trainer.step
        if final:
            due = [(p, self.schedule.last_sync(p, count - 1) + 1) for p in range(len(self.fragments))]
        else:
            due = list(self.schedule.syncs_at(count))
        synced: list[OuterSync] = []
        for p, k in due:
            share = self._share(p, count)
            if p == 0:
                self.stats.last_share = share
            synced.extend(await self._sync(p, k, plan_for, overlap=self.config.overlap and not final, share=share))
            self._phase_from[p] = (count, self._trained)
        if due:
            self._stretch = None
        elif self._stretch is not None:
            begun, trained, busy_s = self._stretch
            self._stretch = (begun, trained, busy_s + self._clock() - clock_started)
        return DilocoStepReport(stats, time.perf_counter() - started, tuple(due), tuple(synced), passed)

    def _phase_spent(self, count: int) -> bool:
        """Wall-clock phases (config.phase_seconds = S): whether this step is passed over because the steps
        of the stretch since the last sync point (or since the node was placed) have taken its budget, S x
        (its steps) / H, with at least one of them trained. Only the steps' own time counts: what the node
        does between them (an evaluation, a checkpoint, at its own settings) does not make a fast node pass
        its steps. The budget is the founder's: no peer's claim moves it. The first step after a sync point
        begins the next stretch."""
        seconds = self.config.phase_seconds
        if seconds <= 0.0:
            return False
        if self._stretch is None:
            self._stretch = (count, self._trained, 0.0)
            return False
        begun, trained, busy_s = self._stretch
        if self._trained == trained:
            return False
        return busy_s >= seconds * (self._next_sync_point(count) - begun) / self.schedule.base

    def _next_sync_point(self, count: int) -> int:
        """The first step count after `count` at which a fragment syncs."""
        k, _, _ = self.schedule.phase_of(count + 1)
        return min(point for p in range(len(self.fragments)) if (point := self.schedule.sync_point(p, k)) > count)

    def _share(self, p: int, count: int) -> float:
        """Of the steps since fragment p's phase began, the share trained (at least one step's)."""
        begun, trained = self._phase_from[p]
        steps = count - begun
        return 1.0 if steps <= 0 else min(1.0, max(1, self._trained - trained) / steps)

    async def _sync(self, p: int, k: int, plan_for: FragmentPlanFor, *, overlap: bool,
                    share: float) -> list[OuterSync]:
        names = self.fragments[p]
        synced = []
        if p in self._pending:
            synced.append(await self._land(p))
        x = await self.trainer.tensors(names)
        start = self._start if self._start is not None else self._anchor
        delta = {n: start[n] - x[n] for n in names}
        self._pending_delta[p] = delta
        self._pending[p] = asyncio.create_task(self._exchange(p, k, delta, plan_for, share),
                                               name=f"diloco fragment {p} round {k}")
        if overlap:
            assert self._start is not None
            # the fast weights: the anchor plus this phase's local progress, until its mix lands
            new_start = {n: self._anchor[n] - delta[n] for n in names}
            self._start.update(new_start)
            await self.trainer.load_tensors(new_start, partial=True)
            return synced
        self._in_sync += 1
        try:
            synced.append(await self._land(p))
        finally:
            self._in_sync -= 1
        restart = {n: self._anchor[n] for n in names}
        if self._start is not None:
            self._start.update(restart)
        await self.trainer.load_tensors(restart, partial=True)
        return synced

    async def _exchange(self, p: int, k: int, delta: dict[str, np.ndarray], plan_for: FragmentPlanFor,
                        share: float) -> OuterSync:
        sync = await self._groups[p].exchange(k, delta, self.trainer.step, lambda: plan_for(p, k), share=share)
        return OuterSync(p, k, sync.outcome, sync.consensus_distance, sync.anchors, sync.anchor_distance)

    async def _land(self, p: int) -> OuterSync:
        """Await fragment p's exchange and apply its outer step to the anchor."""
        task = self._pending.pop(p)
        delta = self._pending_delta.pop(p)
        started = time.perf_counter()
        try:
            sync = await task
        except (Exception, asyncio.CancelledError) as exc:
            current = asyncio.current_task()
            if isinstance(exc, asyncio.CancelledError) and current is not None and current.cancelling():
                raise
            # the exchange itself never fails for a neighbour (it is skipped); this is a bug or a
            # shutdown: the local pseudo-gradient stands in, so the phase's progress is kept
            self.stats.exchanges_failed += 1
            logger.warning("fragment %d: outer exchange failed (%s: %s); applying the local pseudo-gradient", p,
                           type(exc).__name__, exc)
            sync = OuterSync(p, -1, None, None, failed=True)
        group = self._groups[p]
        landed = GroupSync(sync.round, sync.outcome, sync.consensus_distance, sync.anchors, sync.anchor_distance)
        self._anchor.update(await asyncio.to_thread(group.land, None if sync.failed else landed, delta))
        self._applied[p] += 1
        self.stats.outer_updates += 1
        self.stats.outer_steps = self._applied[0]
        self.stats.last_sync_s = time.perf_counter() - started
        self._publish()
        return sync

    async def flush(self) -> list[OuterSync]:
        """Apply every pending exchange (awaiting it)."""
        return [await self._land(p) for p in sorted(self._pending)]

    async def close(self) -> None:
        """Cancel the exchanges still running (a stop); their outer steps are not applied."""
        for task in self._pending.values():
            task.cancel()
        for task in self._pending.values():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._pending.clear()
        self._pending_delta.clear()

    # ---- joiners and checkpoints --------------------------------------------------------------------

    async def adopt(self, anchor: Tensors, momentum: Tensors | None) -> None:
        """Continue from a downloaded anchor (the trainer already holds it and its step) and, if it
        passed its checks, the same peer's outer momentum; the error-feedback residuals start empty
        (this node owes nothing yet)."""
        self.set_anchor(anchor)
        self._outer.load_state(momentum or {})
        for group in self._groups:
            group.reset_residuals()
        self.place_rounds()

    def place_rounds(self) -> None:
        """Each fragment's round is its latest sync at the trainer's step, so it answers its neighbours'
        next round (a fresh, resumed or downloaded node alike, and one whose step a catch-up moved on); the
        anchors and momentum are served at that step."""
        count = self.trainer.step
        for p, group in enumerate(self._groups):
            group.place(count, self.schedule.last_sync(p, count))
            self._phase_from[p] = (count, self._trained)
        self._stretch = None
        self._publish()

    def state(self) -> dict[str, np.ndarray]:
        """The outer state for the checkpoint, beside Trainer.state(): anchor, momentum, residuals.

        An exchange still in flight is not saved: on restore the phase start is the anchor, so the
        next pseudo-gradient carries that exchange's progress again and nothing is lost."""
        out = {_ANCHOR + n: a for n, a in self._anchor.items()}
        out.update({_MOMENTUM + n: b for n, b in self._outer.state().items()})
        for group in self._groups:
            deltas, anchors = group.residuals()
            out.update({_RESIDUAL + n: r for n, r in deltas.items()})
            out.update({_ANCHOR_RESIDUAL + n: r for n, r in anchors.items()})
        return out

    def restore(self, state: Mapping[str, np.ndarray]) -> bool:
        """Take the outer state from a checkpoint (before start()); False if it holds none."""
        anchor = {k[len(_ANCHOR):]: np.asarray(v, np.float32).reshape(-1) for k, v in state.items() if k.startswith(_ANCHOR)}
        if not anchor:
            return False
        if anchor.keys() != set(self._fragment_of):
            raise ValueError("the checkpoint's DiLoCo anchor does not match the model's parameters")
        self._anchor = anchor
        self._reset_start()
        self._outer.load_state({k[len(_MOMENTUM):]: v for k, v in state.items() if k.startswith(_MOMENTUM)})
        self._residuals = ({k[len(_RESIDUAL):]: v for k, v in state.items() if k.startswith(_RESIDUAL)},
                           {k[len(_ANCHOR_RESIDUAL):]: v for k, v in state.items() if k.startswith(_ANCHOR_RESIDUAL)})
        return True

    async def fetch_momentum(self, peer_id: str) -> dict[str, np.ndarray] | None:
        """`peer_id`'s outer momentum (a joiner's download), checked: None when it fails or its norm is
        out of bounds against our anchor (then this node starts with none)."""
        assert self._momentum_peer is not None, "start() first"
        try:
            tensors, _, _ = await self._momentum_peer.fetch(peer_id, codec=MOMENTUM_CODEC)
        except (TimeoutError, ConnectionError, WireError, PeerRejected) as exc:
            logger.warning("outer momentum download from %s failed: %s; starting without", peer_id,
                           exc or type(exc).__name__)
            return None
        except Exception as exc:  # the backstop: a peer's bytes must not end the join that asked for them
            self.stats.errors["diloco_momentum_failed"] = self.stats.errors.get("diloco_momentum_failed", 0) + 1
            logger.warning("outer momentum download from %s failed: %s: %s; starting without", peer_id,
                           type(exc).__name__, exc)
            return None
        norm, bound = global_norm(tensors.values()), MOMENTUM_NORM_BOUND * global_norm(self._anchor.values())
        if not math.isfinite(norm) or norm > bound:
            self.stats.errors["diloco_momentum_refused"] = self.stats.errors.get("diloco_momentum_refused", 0) + 1
            logger.warning("outer momentum from %s refused: norm %.3g beyond %.3g; starting without", peer_id, norm, bound)
            return None
        return tensors


__all__ = [
    "MOMENTUM_CODEC",
    "MOMENTUM_PROTOCOL",
    "DilocoStats",
    "DilocoStepReport",
    "DilocoTrainer",
    "FragmentPlanFor",
    "OuterSync",
    "anchor_protocol",
    "fragment_protocol",
]
