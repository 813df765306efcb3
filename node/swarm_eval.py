"""The validation loss of the swarm-average model, on request: pull every live peer's current
parameters, average them uniformly with this node's own, and evaluate the average on this node's
validation split (docs/training.md, "The swarm-average loss")."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from gossip.errors import WireError
from gossip.exchange import GossipPeer, PeerRejected

if TYPE_CHECKING:
    from node.trainer import Trainer

logger = logging.getLogger("murmur.eval")

# One peer's pull (dial included). A frozen or far-away peer costs the caller at most this long.
FETCH_TIMEOUT_S = 30.0

Tensors = Mapping[str, np.ndarray]


class PeerRecordLike(Protocol):
    """What this module reads of a membership record (node.discovery.PeerRecord)."""

    @property
    def peer_id(self) -> str: ...

    @property
    def maddrs(self) -> tuple[str, ...]: ...


View = Callable[[], Sequence[PeerRecordLike]]
Connect = Callable[[PeerRecordLike], Awaitable[None]]
# peer id -> that peer's tensors (this node's first) -> the average model; CPU-heavy, run in a thread
Average = Callable[[Mapping[str, Tensors]], dict[str, np.ndarray]]


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
                "elapsed_s": self.elapsed_s}


class SwarmEvaluator:
    """Evaluates the swarm average for one node, one evaluation at a time (a second request while one
    runs raises EvalBusy rather than pulling every peer's parameters again)."""

    def __init__(self, trainer: Trainer, peer: GossipPeer, view: View, *, connect: Connect | None = None,
                 fetch_timeout_s: float = FETCH_TIMEOUT_S, count: Callable[[str], None] | None = None,
                 average: Average | None = None) -> None:
        self._trainer = trainer
        self._peer = peer
        self._view = view
        self._connect = connect  # dials a peer from its record first (p2pd may not know its address yet)
        self._fetch_timeout_s = fetch_timeout_s
        self._count = count  # bad input from a peer is counted here by kind, e.g. "swarm_eval_bad_schema"
        # how the members combine: uniformly by default; SPES averages each expert over its owners only
        self._average = average or _uniform_average
        self._running = False

    @property
    def busy(self) -> bool:
        return self._running

    async def evaluate(self) -> SwarmEvalResult:
        """Pull every live peer's parameters concurrently, average them with ours, evaluate the average.
        Peers that fail are left out and named in the result; raises EvalBusy while one runs."""
        if self._running:
            raise EvalBusy("an evaluation of the swarm average is already running on this node; "
                           "ask again once it is done")
        self._running = True
        try:
            return await self._evaluate()
        finally:
            self._running = False

    async def _evaluate(self) -> SwarmEvalResult:
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
        loss = await self._trainer.evaluate(average)
        result = SwarmEvalResult(loss, me, included, MappingProxyType(dict(sorted(failed.items()))),
                                 time.monotonic() - started)
        logger.info("swarm-average val loss %s over %d peers (steps %d-%d) in %.1f s%s", _fmt(loss), len(included),
                    result.min_step, result.max_step, result.elapsed_s,
                    f"; left out {dict(result.failed)}" if failed else "")
        return result

    async def _pull(self, record: PeerRecordLike, into: dict[str, tuple[dict[str, np.ndarray], int]]) -> str | None:
        """Fetch one peer's parameters into `into`; None, or why it failed."""
        peer = record.peer_id
        try:
            async with asyncio.timeout(self._fetch_timeout_s):
                if self._connect is not None:
                    await self._connect(record)
                tensors, _, step = await self._peer.fetch(peer)
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
    from node.trainer import average_tensors

    return average_tensors(list(members.values()))


def finite_or_none(value: float | None) -> float | None:
    """JSON has no inf or nan: a diverged model's loss is answered as null."""
    return value if value is not None and math.isfinite(value) else None


def _fmt(value: float) -> str:
    return f"{value:.4f}" if math.isfinite(value) else str(value)
