"""The swarm-average model, on request or every few steps (docs/training.md, "The swarm-average model").

Every live peer's current parameters are pulled and averaged uniformly with this node's own; the average
is evaluated on this node's validation split and, when asked, written to disk."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

from gossip.errors import WireError
from gossip.exchange import GossipPeer, PeerRejected
from gossip.pace import TransferStalled
from node.swarm.peers import PeerRecordLike

if TYPE_CHECKING:
    from node.train.trainer import Trainer

logger = logging.getLogger("murmur.eval")

# How long one peer's pull may take to begin (the dial, the request and its answer's header): a frozen or
# unreachable peer costs the caller at most about this long. The transfer itself is then paced by its
# size and progress (gossip.pace), not cut at a fixed time.
FETCH_TIMEOUT_S = 30.0

Tensors = Mapping[str, np.ndarray]


View = Callable[[], Sequence[PeerRecordLike]]
Connect = Callable[[PeerRecordLike], Awaitable[None]]
# peer id -> that peer's tensors (this node's first) -> the average model; CPU-heavy, run in a thread
Average = Callable[[Mapping[str, Tensors]], dict[str, np.ndarray]]
# writes the average model with what the evaluation found; returns where; raises OSError (disk full...)
SaveAverage = Callable[[Mapping[str, np.ndarray], "SwarmEvalResult"], Awaitable[str]]


class EvalBusy(Exception):
    """An evaluation of the swarm average is already running on this node."""


class EvalUnavailable(Exception):
    """This node cannot evaluate a swarm average (it trains no model)."""


@dataclass(frozen=True)
class IncludedPeer:
    peer_id: str
    step: int  # the step the peer's parameters carried when it answered


@dataclass(frozen=True)
class SwarmEvalResult:
    """One evaluation: the loss of the uniform average over `included` (this node first)."""

    loss: float  # validation cross-entropy (nats) of the average, on this node's validation split; may be inf/nan
    self_id: str
    included: tuple[IncludedPeer, ...]
    failed: Mapping[str, str]  # peer id -> why it was left out
    elapsed_s: float
    saved: str | None = None  # where the average model was written, when asked to save it
    save_error: str | None = None  # why it could not be written (the previous file is kept)

    @property
    def min_step(self) -> int:
        return min(p.step for p in self.included)

    @property
    def max_step(self) -> int:
        return max(p.step for p in self.included)

    def as_dict(self) -> dict[str, Any]:
        """The JSON answer of `POST /api/eval/average` (schemas/swarm_eval.json, less `local`)."""
        return {"loss": finite_or_none(self.loss), "self": self.self_id,
                "peers": [{"peer_id": p.peer_id, "step": p.step, "self": p.peer_id == self.self_id}
                          for p in self.included],
                "failed": dict(self.failed), "min_step": self.min_step, "max_step": self.max_step,
                "elapsed_s": self.elapsed_s, "saved": self.saved, "save_error": self.save_error}


class SwarmEvaluator:
    """Evaluates the swarm average for one node, one evaluation at a time (a second request while one
    runs raises EvalBusy rather than pulling every peer's parameters again). `close()` cancels one
    started in the background."""

    def __init__(self, trainer: Trainer, peer: GossipPeer, view: View, *, connect: Connect | None = None,
                 fetch_timeout_s: float = FETCH_TIMEOUT_S, count: Callable[[str], None] | None = None,
                 average: Average | None = None, save: SaveAverage | None = None) -> None:
        self._trainer = trainer
        self._peer = peer
        self._view = view
        self._connect = connect  # dials a peer from its record first (p2pd may not know its address yet)
        self._fetch_timeout_s = fetch_timeout_s
        self._count = count  # bad input from a peer is counted here by kind, e.g. "swarm_eval_bad_schema"
        # how the members combine: uniformly by default; SPES averages each expert over its owners only
        self._average = average or _uniform_average
        self._save = save
        self._lock = asyncio.Lock()  # held while an evaluation runs, requested or periodic
        self._due = False  # a periodic write was asked for and has not started yet
        self._background: asyncio.Task[None] | None = None

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    async def evaluate(self, *, save: bool = False) -> SwarmEvalResult:
        """Pull every live peer's parameters concurrently, average them with ours, evaluate the average
        and, with `save`, write it. Peers that fail are left out and named in the result; a failed write
        is named in it too. Raises EvalBusy while one runs, EvalUnavailable to save without a writer."""
        if self._lock.locked():
            raise EvalBusy("an evaluation of the swarm average is already running on this node; "
                           "ask again once it is done")
        if save and self._save is None:
            raise EvalUnavailable("this node has nowhere to write the swarm average")
        async with self._lock:
            return await self._evaluate(save)

    def save_in_background(self) -> None:
        """Write the swarm average soon, without waiting for it (`--average-every`). Writes asked for
        while one runs are coalesced into one more after it, so the last one asked for (training's end)
        is never lost; one behind a requested evaluation waits for it."""
        if self._save is None:
            raise EvalUnavailable("this node has nowhere to write the swarm average")
        self._due = True
        if self._background is None or self._background.done():
            self._background = asyncio.create_task(self._save_while_due(), name="swarm average")
            self._background.add_done_callback(_log_failure)

    async def _save_while_due(self) -> None:
        while self._due:
            async with self._lock:
                self._due = False
                await self._evaluate(save=True)

    async def close(self) -> None:
        """Cancel a write started in the background and wait for it to end."""
        if self._background is not None and not self._background.done():
            self._background.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._background

    async def merged(self) -> tuple[dict[str, np.ndarray], SwarmEvalResult]:
        """The final merge (the recipe's `final_merge`): every live peer's current parameters averaged
        with ours, as the evaluation pulls and averages them (the result's loss is left unknown: the
        node evaluates the model it adopts). Waits for an evaluation that runs."""
        async with self._lock:
            return await self._gather()

    async def _gather(self) -> tuple[dict[str, np.ndarray], SwarmEvalResult]:
        """Pull every live peer's parameters and average them with ours; the result's loss is not known yet."""
        started = time.monotonic()
        me = self._peer.peer_id
        others = sorted({r.peer_id: r for r in self._view() if r.peer_id != me}.values(), key=lambda r: r.peer_id)
        fetched: dict[str, tuple[dict[str, np.ndarray], int]] = {}
        failed: dict[str, str] = {}

        async def pull(record: PeerRecordLike) -> None:
            reason = await self._pull(record, fetched)
            if reason is not None:
                failed[record.peer_id] = reason

        # Our own contribution is what the gossip peer offers (and what peers pulling from us get): a
        # snapshot the peer replaces, never modifies, labelled with its step in one read.
        own, own_step = self._peer.tensors, self._peer.step
        async with asyncio.TaskGroup() as group:
            for record in others:
                group.create_task(pull(record))
        included = (IncludedPeer(me, own_step), *(IncludedPeer(p, fetched[p][1]) for p in sorted(fetched)))
        members = {me: own, **{p: fetched[p][0] for p in sorted(fetched)}}
        average = await asyncio.to_thread(self._average, members)
        members.clear()  # the peers' copies are no longer needed while the evaluation runs
        fetched.clear()
        return average, SwarmEvalResult(math.nan, me, included, MappingProxyType(dict(sorted(failed.items()))),
                                        time.monotonic() - started)

    async def _evaluate(self, save: bool) -> SwarmEvalResult:
        average, result = await self._gather()
        loss = await self._trainer.evaluate(average)
        result = dataclasses.replace(result, loss=loss)
        logger.info("swarm-average val loss %s over %d peers (steps %d-%d) in %.1f s%s", _fmt(loss),
                    len(result.included), result.min_step, result.max_step, result.elapsed_s,
                    f"; left out {dict(result.failed)}" if result.failed else "")
        if save:
            result = await self._write(average, result)
        return result

    async def _write(self, average: Mapping[str, np.ndarray], result: SwarmEvalResult) -> SwarmEvalResult:
        assert self._save is not None
        try:
            where = await self._save(average, result)
        except OSError as exc:
            if self._count is not None:
                self._count("swarm_average_save_failed")
            logger.error("swarm average not written (%s); the previous one is kept", exc)
            return dataclasses.replace(result, save_error=str(exc))
        logger.info("swarm average written to %s", where)
        return dataclasses.replace(result, saved=where)

    async def _pull(self, record: PeerRecordLike, into: dict[str, tuple[dict[str, np.ndarray], int]]) -> str | None:
        """Fetch one peer's parameters into `into`; None, or why it failed."""
        peer = record.peer_id
        try:
            if self._connect is not None:
                async with asyncio.timeout(self._fetch_timeout_s):
                    await self._connect(record)
            # every node of a final merge pulls from every other at once: a donor serves a few at a time
            # (IncomingLimits.concurrent_uploads) and the others ask again until it has room
            tensors, _, step = await self._peer.fetch(peer, answer_timeout_s=self._fetch_timeout_s,
                                                      busy_wait_s=self._peer.busy_wait_s(len(self._view())))
        except TransferStalled as exc:
            logger.info("swarm eval: the pull from %s was cut: %s", peer, exc)
            return "stalled"
        except TimeoutError:
            return "timeout"
        except PeerRejected as exc:
            return f"rejected: {exc}"
        except WireError as exc:
            if self._count is not None:
                self._count(f"swarm_eval_{exc.kind}")
            logger.warning("swarm eval: parameters from %s refused: %s: %s", peer, exc.kind, exc)
            return exc.kind
        except (ConnectionError, ValueError) as exc:  # ValueError: a record whose addresses do not parse
            logger.info("swarm eval: %s unreachable: %s", peer, exc or type(exc).__name__)
            return "unreachable"
        into[peer] = (tensors, step)
        return None


def _uniform_average(members: Mapping[str, Tensors]) -> dict[str, np.ndarray]:
    # imported here: the monitor imports this module on nodes that train no model (and load no torch)
    from node.train.trainer import average_tensors

    return average_tensors(list(members.values()))


def _log_failure(task: asyncio.Task[None]) -> None:
    # A background evaluation has no caller to raise to; its failure would otherwise go unseen.
    if not task.cancelled() and task.exception() is not None:
        exc = task.exception()
        logger.error("swarm average in the background failed: %s: %s", type(exc).__name__, exc)


def finite_or_none(value: float | None) -> float | None:
    """JSON has no inf or nan: a diverged model's loss is answered as null."""
    return value if value is not None and math.isfinite(value) else None


def _fmt(value: float) -> str:
    return f"{value:.4f}" if math.isfinite(value) else str(value)
