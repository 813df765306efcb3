"""Training inside the daemon: the one loop every algorithm runs in.

It builds the swarm's model, data and optimizer, starts from this node's checkpoint or from a live peer's
parameters, then steps the swarm's algorithm (node.swarm.algorithm), whose rounds (one after every H steps,
numbered step // H) mix with the neighbours the topology names in the current membership view, evaluating,
checkpointing and reporting as it goes."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from gossip.errors import Truncated
from gossip.exchange import GossipPeer
from node.swarm.algorithm import Algorithm, StepReport
from node.swarm.contributors import ContributorTable, tokens_per_step
from node.swarm.joining import (
    DownloadWatch,
    JoinCheck,
    JoinOutcome,
    JoinProgress,
    JoinRules,
    Refused,
    StepJudgement,
    join_check,
    join_swarm,
    judge_steps,
    plausible_steps,
    swarm_left_behind,
)
from node.swarm.peers import Membership, SwarmRecord
from node.swarm.progress import PeerProgress, leave_out_stalled
from node.swarm.recipe import TrainingRecipe, embedded_options
from node.swarm.rounds import serving_members
from node.train.checkpoint import Checkpoint
from node.train.data import load_corpus, peer_shard
from node.train.models import build_named_model, model_context, model_vocab_size
from node.train.settings import TrainingSettings
from node.train.shards import ShardStream, open_dataset
from node.train.tokenizer import SwarmTokenizer, TextTokenizer
from node.train.trainer import Trainer, TrainerConfig, resolve_device
from topology import MembershipView, PeerRound, Topology, peer_round

logger = logging.getLogger("murmur.train")

STEP_GRACE_S = 2.0  # a stop waits this long for the step in flight before it abandons it
JOIN_LOOK_S = 10.0  # how long a joiner looks for live peers to download parameters from
EVAL_BATCHES = 8
LAG_WAIT_S = 30.0  # longest a round waits for a laggard that is catching up before it goes on without
CATCH_UP_DIAL_S = 10.0  # how long a starting node waits for dials to the peers it downloads from
THROUGHPUT_MIN_STEPS = 10  # tokens_per_s averages over at least this many steps, and over a whole phase
THROUGHPUT_MAX_STEPS = 1000  # ... up to this many (a phase of 10,000 local steps would answer too slowly)
STALLED_AFTER_S = 10.0  # default: a record unchanged this long shows no progress (node.swarm.progress)
EVAL_BATCH_SIZE = 32
MERGE_WAIT_S = 120.0  # longest the final merge waits for the peers in view to finish their budget
# How often a node whose algorithm re-joins when left behind (DiLoCo) looks whether the swarm left it
# behind (SwarmLoop._rejoin_if_left_behind)
LAGGARD_CHECK_S = 5.0
# A re-join that did not move this node on (the records' claims were not backed by what its downloads found:
# claims of record-only identities, sybils) cost it the wait for its syncs in flight and the downloads' time:
# the next check waits twice as long, up to this, so unbacked claims cannot make a node re-join again and again.
LAGGARD_BACKOFF_MAX_S = 640.0
DOWNLOAD_REPORT_S = 3.0  # how often a running catch-up's download progress is shown on the command line
# A catch-up whose downloads all broke off (a donor died or stalled mid-download) tries the other peers in
# view again, after this long (records of peers that came meanwhile arrive), this many times in all
CATCH_UP_RETRY_S = 2.0
CATCH_UP_TRIES = 3
_BROKEN_OFF = frozenset({Refused.TIMEOUT, Refused.STALLED, Refused.UNREACHABLE, Truncated.kind})


class TrainingSetupError(ValueError):
    """The swarm's recipe cannot be trained here (unknown model, context too long...): one line."""


class StartedFrom(enum.StrEnum):
    """Where a node's parameters came from; a download from a peer reads "peer <id> at step N"."""

    INIT = "init"
    CHECKPOINT = "checkpoint"


class RecordSample(Protocol):
    """The monitor's history (NodeRuntime.record): one call per step and per evaluation."""

    def __call__(self, *, step: int, loss: float | None = None, val_loss: float | None = None,
                 consensus_distance: float | None = None, tokens: int = 0) -> None: ...


# dials these peers now (not in a round: a start-up download), waiting for the dials a bounded time
Connect = Callable[[Sequence[SwarmRecord]], Awaitable[None]]
# the final merge: every live peer's final model averaged with ours (node.swarm.swarm_eval), with what it
# took in; None when there was nothing to merge
Merge = Callable[[], Awaitable[tuple[dict[str, Any], "MergeReport"]]]


class MergeReport(Protocol):
    """What the final merge reports (node.swarm.swarm_eval.SwarmEvalResult)."""

    def as_dict(self) -> dict[str, Any]: ...


@dataclass
class TrainingStatus:
    """What the local API reports about training; updated after every step on the event loop."""

    model: str
    optimizer: str
    steps_target: int
    trainable_params: int
    step: int = 0
    loss: float | None = None
    val_loss: float | None = None
    val_step: int | None = None
    lr: float = 0.0
    tokens_per_s: float = 0.0
    consensus_distance: float | None = None
    optimizer_state_bytes: int = 0
    done: bool = False
    started_from: str = StartedFrom.INIT  # a StartedFrom, or "peer(s) <ids> at step N"
    bytes_per_token: float | None = None  # bytes sent + received per training token, this node's own
    diloco: dict[str, Any] | None = None  # the outer loop's figures (node.algorithms.diloco.swarm)
    final_merge: dict[str, Any] | None = None  # what the final merge averaged, once done
    joined: dict[str, Any] | None = None  # what the catch-up did (node.swarm.joining.JoinOutcome.as_dict)

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer, "steps_target": self.steps_target,
                "trainable_params": self.trainable_params, "step": self.step, "loss": self.loss,
                "val_loss": self.val_loss, "val_step": self.val_step, "lr": self.lr,
                "tokens_per_s": self.tokens_per_s, "consensus_distance": self.consensus_distance,
                "optimizer_state_bytes": self.optimizer_state_bytes, "done": self.done,
                "started_from": self.started_from, "bytes_per_token": self.bytes_per_token,
                "diloco": self.diloco, "final_merge": self.final_merge, "joined": self.joined}


def build_trainer(settings: TrainingSettings, recipe: TrainingRecipe, peer_id: str,
                  tokenizer: SwarmTokenizer | None = None, count: Callable[[str], None] | None = None) -> Trainer:
    """The model (seeded from the recipe, so every fresh peer starts from the same point, or the
    pretrained weights the swarm starts from where this node has them), this peer's data (a shard of
    the embedded corpus, or its part of --data streamed) and its optimizer. `tokenizer` is the swarm's
    (None: bytes); `count` counts skipped records. Blocking (builds a model, reads data): call in a thread."""
    if settings.threads:
        torch.set_num_threads(settings.threads)
    tokenizer = tokenizer or SwarmTokenizer(None)
    stream: ShardStream | None = None
    try:
        model = build_swarm_model(settings, recipe)
        text_tokenizer = tokenizer.load()
        vocab = model_vocab_size(model)
        if vocab is not None and vocab < text_tokenizer.vocab_size:
            raise TrainingSetupError(f"the swarm's model has a vocabulary of {vocab}, smaller than its tokenizer's "
                                     f"{text_tokenizer.vocab_size}")
        if settings.data is not None:
            stream = ShardStream(open_dataset(settings.data), text_tokenizer, peer_id, settings.text_field, count)
            train_tokens, val_tokens = None, stream.val_tokens()
        else:
            corpus = load_corpus(None, settings.data_dir)
            train_tokens, val_tokens = peer_shard(corpus, peer_id), corpus.val
            if tokenizer.data is not None:  # the embedded corpus in the swarm's tokens
                train_tokens, val_tokens = (_encode(text_tokenizer, t) for t in (train_tokens, val_tokens))
    except (ValueError, OSError) as exc:
        if stream is not None:
            stream.close()
        raise TrainingSetupError(str(exc)) from None
    model_max = model_context(model)
    if model_max is not None and recipe.context > model_max:
        raise TrainingSetupError(f"the swarm trains with context {recipe.context}, longer than the model's {model_max}")
    try:
        trainer_config = TrainerConfig(optimizer=recipe.inner_optimizer, batch_size=recipe.batch_size, context=recipe.context,
                                       device=settings.device, precision=settings.precision,
                                       eval_batch_size=EVAL_BATCH_SIZE, eval_batches=EVAL_BATCHES)
        return Trainer(model, trainer_config, peer_id=peer_id, train_tokens=train_tokens, val_tokens=val_tokens,
                       stream=stream)
    except ValueError as exc:
        raise TrainingSetupError(str(exc)) from None


def _encode(tokenizer: TextTokenizer, tokens: torch.Tensor) -> torch.Tensor:
    text = bytes(tokens.numpy()).decode("utf-8", errors="replace")
    return torch.tensor(tokenizer.encode_batch([text])[0], dtype=torch.int64)


def build_swarm_model(settings: TrainingSettings, recipe: TrainingRecipe) -> torch.nn.Module:
    """The recipe's model on this node: a Hugging Face model from the config the swarm carries, checked
    to fit in this machine's memory first, from pretrained weights where this node's own --model holds
    the ones the swarm starts from; otherwise seeded."""
    if recipe.model_config is None:
        return build_named_model(recipe.model, seed=recipe.seed, options=embedded_options(recipe))
    from node.train.models.hf import build_hf_model, check_fits

    check_fits(recipe.model_config, resolve_device(settings.device))
    return build_hf_model(recipe.model_config, recipe.seed, weights=local_weights(settings.model, recipe))


def local_weights(own_model: str, recipe: TrainingRecipe) -> Path | None:
    """This node's copy of the pretrained weights the swarm starts from (its own --model hf:PATH with the
    same digest), or None: it starts from the seeded init and downloads the swarm's parameters."""
    if recipe.weights_sha256 is None or not own_model.startswith("hf:"):
        return None
    from node.train.models.hf import read_source, weights_digest

    source = read_source(own_model)
    if source.weights is None or weights_digest(source.weights) != recipe.weights_sha256:
        return None
    return source.weights


def checkpoint_matches(checkpoint: Checkpoint | None, config_hash: str) -> bool:
    return (checkpoint is not None and checkpoint.meta.get("config_hash") == config_hash
            and "trainer/step" in checkpoint.tensors)


def last_round_at(step: int, recipe: TrainingRecipe) -> int:
    """The round a peer whose trainer is at `step` last ran: where a fresh, resumed or downloaded
    peer's round count starts (a round follows every H-th step)."""
    return max(0, step // recipe.optimizer.local_steps - 1)


def throughput_window(recipe: TrainingRecipe) -> int:
    """Steps `tokens_per_s` averages over: a whole phase of H local steps, within bounds."""
    return min(THROUGHPUT_MAX_STEPS, max(THROUGHPUT_MIN_STEPS, recipe.optimizer.local_steps))


def tokens_per_second(tokens_per_step: int, step_times: Sequence[float]) -> float:
    """Throughput over steps that took `step_times` seconds each; 0 before any time has passed."""
    elapsed = sum(max(0.0, t) for t in step_times)
    return tokens_per_step * len(step_times) / elapsed if elapsed > 0 else 0.0


class SwarmLoop:
    """One node's training run inside the daemon (see the module docstring); `algorithm` steps it."""

    def __init__(self, trainer: Trainer, peer: GossipPeer, discovery: Membership, recipe: TrainingRecipe,
                 settings: TrainingSettings, topology_for: Callable[[int], Topology], connect: Connect,
                 lag_window: int, algorithm: Algorithm, record: RecordSample | None = None) -> None:
        self.trainer = trainer
        self.peer = peer
        self.discovery = discovery
        self.recipe = recipe
        self.settings = settings
        self._topology_for = topology_for
        self._connect = connect
        self._lag_window = lag_window
        # the monitor's history: record(step=, loss=, val_loss=, consensus_distance=, tokens=)
        self._record_sample = record
        self.algorithm = algorithm
        self.progress = PeerProgress(STALLED_AFTER_S)  # the runtime sets the bound from heartbeat and deadline
        # the swarm starts from pretrained weights this node lacks: it must download the parameters
        self.must_download = False
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        self._tokens = 0  # trained since this process started, for bytes_per_token
        # the last steps' wall times: throughput over a whole phase (its sync included), not the one step
        # that ends it, which with gossip DiLoCo also waits for the outer exchange
        self._step_times: deque[float] = deque(maxlen=throughput_window(recipe))
        # trained by this node itself since it first started (the start_training restores it from the
        # checkpoint): what its record claims, and the export's card credits
        self.tokens_processed = 0
        self.contributors = ContributorTable()  # every peer's tokens seen in the view (node.swarm.contributors)
        self._observed_view: object = None
        self.status = TrainingStatus(model=recipe.model, optimizer=recipe.optimizer.algorithm, steps_target=recipe.steps,
                                     trainable_params=trainable, step=trainer.step)
        self._catch_up_with: tuple[int, float | None] | None = None  # margin and epoch of the first catch-up
        self._stop: asyncio.Event | None = None
        self._checked_at = 0.0
        self._laggard_wait_s = LAGGARD_CHECK_S  # until the next laggard check: doubled by each unbacked re-join
        self._serving = False
        self.downloads: DownloadWatch | None = None  # a catch-up's downloads while they run
        algorithm.show(self.status)

    @property
    def finished(self) -> bool:
        return self._done(self.trainer.step)

    def _done(self, step: int) -> bool:
        return self.recipe.steps > 0 and step >= self.recipe.steps

    async def plan_for(self, round_index: int) -> PeerRound:
        """This peer's neighbours and weights in round `round_index`, from the current view. Dials
        happen in the background (node.net.dialer): a round never waits for one."""
        view = self.discovery.view()
        self.progress.observe(view)
        # peers whose step budget is spent no longer run rounds: leave them out rather than wait for them
        members = self.round_members(view)
        self._share_data(members.peer_ids)
        plan = peer_round(self._topology_for(members.n), members, self.peer.peer_id, round_index)
        await self._wait_for_laggards(plan)
        plan, stalled = leave_out_stalled(plan, self.discovery.view(), self.progress, round_index,
                                          self.peer.settings.max_staleness)
        for _ in stalled:
            self.peer.stats.skipped["stalled"] += 1
        return plan

    def round_members(self, view: Sequence[SwarmRecord]) -> MembershipView:
        return serving_members(((p.peer_id, p.gossip_from, p.step) for p in view), self.peer.peer_id, self._done)

    def _share_data(self, members: Sequence[str]) -> None:
        """--data: the training peers the next epoch's shard plan divides the units among."""
        if isinstance(self.trainer.stream, ShardStream):
            self.trainer.stream.set_members(members)

    async def _wait_for_laggards(self, plan: PeerRound) -> None:
        """Hold this round while a neighbour that is catching up is more than the lag window behind
        (by its DHT record).

        A neighbour beyond the staleness bound answers with parameters too old to mix, so a node that
        ran ahead (it started first, or its neighbours are slower) would train alone; waiting keeps the
        swarm together. Only a laggard whose record shows its step rising is waited for: a record that
        never moves (a peer at step 0 that never trains, a frozen peer) holds no round, and is left out
        of it once it is stale (see plan_for). A neighbour that died leaves the view within a few heartbeats.

        Each neighbour's waiting is paid from a budget of its own (PeerProgress.wait_left: 90 s, refilled
        over 15 min), so a record that creeps up a step a heartbeat, just beyond the lag window, cannot
        hold every round: once its budget is spent, rounds go on without waiting for it (it is still mixed
        with when it answers in time), counted in skipped["laggard_wait_spent"] once a round and logged
        once a budget window.
        """
        progress = self.progress
        deadline = time.monotonic() + LAG_WAIT_S
        waiting: list[str] = []  # held for since the last look: each is charged the time
        spent: set[str] = set()
        last = progress.now
        while time.monotonic() < deadline:
            view = self.discovery.view()
            progress.observe(view)
            now = progress.now
            progress.charge_wait(waiting, now - last)
            last = now
            records = {p.peer_id: p for p in view}
            floor = self.trainer.step - self._lag_window
            behind = [p for p in plan.in_weights if p in records and records[p].step < floor
                      and not self._done(records[p].step) and progress.progressing(p)]
            waiting = [p for p in behind if progress.may_wait_for(p)]
            for p in behind:
                if p not in waiting and p not in spent:
                    spent.add(p)
                    self.peer.stats.skipped["laggard_wait_spent"] += 1
                    if progress.tell_wait_spent(p):
                        logger.info("neighbour %s held rounds %g s within %g s while far behind: rounds go on "
                                    "without waiting for it until its budget refills", p,
                                    progress.wait_budget_s, progress.wait_budget_window_s)
            if not waiting:
                return
            await asyncio.sleep(min(0.2, max(0.01, min(progress.wait_left(p) for p in waiting))))
        progress.charge_wait(waiting, progress.now - last)
        logger.info("round goes on without neighbours still far behind after %g s", LAG_WAIT_S)

    async def catch_up(self, stop: asyncio.Event, margin: int, look: bool, epoch: float | None = None) -> None:
        """Catch up with the swarm when it is more than `margin` steps ahead (a joiner; a node back from
        a restart keeps its restored optimizer state): parameters from several peers, checked and
        combined, at a robust step (node.swarm.joining); `epoch` (the swarm's founding time) bounds
        the steps a peer can claim. With `look`, wait up to JOIN_LOOK_S for the view to show another
        peer: records arrive a moment after start."""
        await self.algorithm.start()
        if self._catch_up_with is None:
            self._catch_up_with = (margin, epoch)
        await self._catch_up(stop, margin, look, epoch)

    async def _catch_up(self, stop: asyncio.Event, margin: int, look: bool, epoch: float | None) -> None:
        if self.must_download:
            margin, look = -1, True  # any live peer's parameters beat a random init of a pretrained model
        deadline = time.monotonic() + (JOIN_LOOK_S if look else 0.0)
        while True:
            view = self.discovery.view()
            if len(view) > 1 or time.monotonic() >= deadline or stop.is_set():
                break
            await asyncio.sleep(0.5)
        plausible = plausible_steps(epoch, time.time()) if epoch is not None else None
        broken: dict[str, str] = {}  # peers whose download broke off (died, stalled): not asked again
        for attempt in range(CATCH_UP_TRIES):
            if attempt:
                logger.warning("the downloads from %s broke off; trying the other peers in view (try %d of %d)",
                               ", ".join(sorted(broken)), attempt + 1, CATCH_UP_TRIES)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(CATCH_UP_RETRY_S):
                        await stop.wait()
                if stop.is_set():
                    return
                view = self.discovery.view()
            tried = await self._download(view, margin, plausible, broken)
            if tried is None:
                return
            judgement, refused, outcome = tried
            if outcome.tensors is not None or (not judgement.candidates and not attempt):
                break
            newly = {p: why for p, why in outcome.refused.items() if why in _BROKEN_OFF and p not in broken}
            if not newly:
                break
            broken.update(newly)
        if outcome.tensors is None:
            # the catch-up's outcome, not an attempt's: a reader of `joined` sees the end, not a retry's start
            self.status.joined = outcome.as_dict()
            if not judgement.candidates and not broken:
                return  # nobody to download from (the status's `joined` says why)
            logger.warning("no download was good enough to join the swarm at step %d (%s); continuing from step %d",
                           judgement.reference, _reasons(outcome.refused), self.trainer.step)
            return
        step = self._step_now(outcome.step, epoch, refused, "the downloads were checked")
        await self.trainer.load_tensors(outcome.tensors)
        await self.trainer.start_from_download(step)
        self.peer.set_tensors(outcome.tensors, step=step, moved=False)
        self.must_download = False
        await self.algorithm.adopt_download([r for r in judgement.candidates if r.peer_id in outcome.vouchers()])
        # what the algorithm fetched there (DiLoCo's momentum) took a while too: the swarm's step again
        later = self._step_now(step, epoch, refused, "the outer state was fetched")
        if later > step:
            await self.trainer.start_from_download(later)
            self.peer.step = later
            await self.algorithm.moved_to(later)
        self.peer.round = last_round_at(self.trainer.step, self.recipe)
        self.status.started_from = outcome.describe()
        self.status.step = self.trainer.step
        self.status.joined = outcome.as_dict()  # last: a reader who sees it sees the node on the swarm's parameters
        logger.info("downloaded parameters from %s (combined from %d) at step %d%s", ", ".join(outcome.sources),
                    len(outcome.sources), outcome.step,
                    f"; refused {_reasons(outcome.refused)}" if outcome.refused else "")
        # the check evaluated these very parameters: evaluating them again would cost a pass over the
        # validation batches (minutes for a large model on a CPU) while the swarm trains on
        if outcome.loss is None:
            await self.evaluate()
        else:
            self._record_loss(outcome.loss)
        logger.info("validation loss after the download: %.4f", self.status.val_loss)

    async def _download(self, view: Sequence[SwarmRecord], margin: int, plausible: int | None,
                        broken: Mapping[str, str]) -> tuple[StepJudgement, dict[str, str], JoinOutcome] | None:
        """Judge the view's claims (without the peers in `broken`) and download from the believable
        peers (node.swarm.joining.join_swarm): the judgement, the peers refused before downloading, and
        the outcome; None when nobody is ahead. The downloads' progress is `self.downloads` meanwhile."""
        me = self.peer.peer_id
        judgement = judge_steps(view, me, self.trainer.step, margin, self.recipe.steps, plausible, refused=broken)
        if judgement is None:
            return None
        # records that claim what no honest peer does: judged again without them (their step claims too)
        refused = {**await self.algorithm.record_refusals(view, judgement.reference + judgement.tolerance), **broken}
        if refused.keys() - broken.keys():
            logger.warning("not downloading from peers whose records claim what no honest peer does: %s",
                           _reasons({p: why for p, why in refused.items() if p not in broken}))
            judgement = judge_steps(view, me, self.trainer.step, margin, self.recipe.steps, plausible, refused=refused)
            if judgement is None:
                return None
        if judgement.ignored:
            logger.warning("ignoring the step claims of %s: %s", ", ".join(judgement.ignored),
                           f"far above the swarm's step {judgement.reference}" if judgement.candidates
                           else "beyond what the swarm can have trained")
        if not judgement.candidates:
            return judgement, refused, JoinOutcome(judgement.reference, refused=judgement.refusals())
        await self._connect(judgement.candidates)
        watch = self.downloads = DownloadWatch()
        reporter = asyncio.create_task(_report_downloads(watch))
        try:
            numel = sum(int(t.size) for t in self.peer.tensors.values())
            rules = JoinRules(check=join_check(JoinCheck(self.settings.join_check), numel))
            outcome = await join_swarm(judgement, self.peer.fetch, self.trainer.evaluate, self.peer.tensors,
                                       rules, watch=watch)
        finally:
            self.downloads = None
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporter
        return judgement, refused, outcome

    def _step_now(self, downloaded: int, epoch: float | None, refused: Mapping[str, str] | None,
                  meanwhile: str) -> int:
        """The step to continue from after a download made at step `downloaded`: the swarm trained on
        while the downloads were checked (several evaluations) and while the algorithm fetched its outer
        state (DiLoCo's momentum), and a joiner left that far behind would find its neighbours' rounds
        stale and catch up again, for ever if a catch-up takes longer than the swarm needs to move that
        far. The view's claims now, judged as before, move it forward."""
        plausible = plausible_steps(epoch, time.time()) if epoch is not None else None
        now = judge_steps(self.discovery.view(), self.peer.peer_id, downloaded, 0, self.recipe.steps, plausible,
                          refused=refused)
        if now is None or not now.candidates or now.reference <= downloaded:
            return downloaded
        logger.info("the swarm moved on from step %d to %d while %s", downloaded, now.reference, meanwhile)
        return now.reference

    async def _rejoin_if_left_behind(self) -> None:
        """The laggard rule, for an algorithm that opts in (`rejoins_when_left_behind`: DiLoCo). A node more
        than the staleness bound of outer rounds behind its neighbours (slower compute, a long pause)
        finds every round stale: its neighbours answer nothing, and it never mixes again. Every
        LAGGARD_CHECK_S it judges the view's steps as a joiner does; once the swarm is more than that
        margin ahead, the algorithm lands what is in flight and the node catches up like a joiner (the
        swarm's parameters from several peers, checked and combined, the view's step), giving up the
        local progress it could not sync anyway. A re-join the downloads did not back (the node did not move
        on) doubles the wait before the next check, up to LAGGARD_BACKOFF_MAX_S."""
        now = time.monotonic()
        if (not self.algorithm.rejoins_when_left_behind or self._catch_up_with is None or self._stop is None
                or now - self._checked_at < self._laggard_wait_s):
            return
        self._checked_at = now
        margin, epoch = self._catch_up_with
        stop = self._stop
        plausible = plausible_steps(epoch, time.time()) if epoch is not None else None
        judged = swarm_left_behind(self.discovery.view(), self.peer.peer_id, self.trainer.step, margin,
                                   self.recipe.steps, plausible)
        if judged is None:
            return
        if await self.algorithm.rejoin(judged, margin, lambda: self._catch_up(stop, margin, False, epoch)):
            self._laggard_wait_s = LAGGARD_CHECK_S
        else:
            self._laggard_wait_s = min(LAGGARD_BACKOFF_MAX_S, 2 * self._laggard_wait_s)
            logger.warning("the view claimed step %d, but catching up did not move this node on (step %d): the "
                           "next laggard check in %g s", judged, self.trainer.step, self._laggard_wait_s)
        self._checked_at = time.monotonic()  # the catch-up's own time does not count toward the wait

    async def serve_rounds(self) -> None:
        """Serve the algorithm's round protocols, then say so in this peer's record (its `gossip_from`):
        neighbours pair with a peer only from then on (node.swarm.rounds.serving_members)."""
        if self._serving:
            return
        await self.algorithm.start()
        self._serving = True
        self.discovery.update(step=self.trainer.step, round=self.peer.round, gossip_from=max(1, self.peer.round + 1))

    async def wait_for_quorum(self, stop: asyncio.Event) -> None:
        """A fresh swarm starts together: wait until `min_peers` peers serve their rounds (this one included)."""
        wanted = self.settings.min_peers

        def serving() -> int:
            return self.round_members(self.discovery.view()).n

        logged = False
        while not stop.is_set() and serving() < wanted:
            if not logged:
                logger.info("waiting for %d peers before training (have %d)", wanted, serving())
                logged = True
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5):
                    await stop.wait()

    async def run(self, stop: asyncio.Event, save: Callable[[], Awaitable[None]],
                  average: Callable[[], None] | None = None, merge: Merge | None = None) -> None:
        """Train until the recipe's step budget is spent or `stop` is set; `save` writes a checkpoint;
        `average` starts writing the swarm average every `average_every` steps and at the end (0: never);
        `merge` averages every live peer's final model with ours (the recipe's final merge)."""
        await self.serve_rounds()
        self._stop = stop
        async with self.algorithm.running():
            await self._train(stop, save, average, merge)

    async def _train(self, stop: asyncio.Event, save: Callable[[], Awaitable[None]],
                     average: Callable[[], None] | None, merge: Merge | None) -> None:
        every_eval, every_ckpt = self.settings.eval_every, self.settings.checkpoint_every
        every_average = self.settings.average_every
        self._share_data(self.round_members(self.discovery.view()).peer_ids)
        # where we start (restored or downloaded) must show in our record before the first round, or
        # neighbours would hold their rounds for us as if we were far behind
        self.discovery.update(step=self.trainer.step, round=self.peer.round)
        while not stop.is_set() and not self.finished:
            report = await self._one_step(stop)
            if report is None and not self.finished:
                return  # stopped
            if self.finished:
                # what peers pull from now on (downloads, evaluations, their final merge) is the final model
                await self.algorithm.publish_final()
            if report is not None:  # None: a laggard's catch-up took it to the budget's end, no step to take
                self._record(report)
            step = self.trainer.step
            if step % every_eval == 0 or self.finished:
                await self.evaluate()
            if step % every_ckpt == 0 or self.finished:
                await save()
            if average is not None and every_average and (step % every_average == 0 or self.finished):
                average()
        if self.finished and self.recipe.final_merge and merge is not None and not stop.is_set():
            await self._final_merge(merge, stop, save)
        if self.finished:
            self.peer.park()
            self.discovery.update(tokens_per_s=0.0)  # it trains no more: the swarm's throughput leaves it out
            self.status.done = True
            logger.info("training done at step %d (val loss %s); serving parameters until stopped",
                        self.trainer.step, _fmt(self.status.val_loss))

    async def evaluate(self) -> None:
        self._record_loss(await self.trainer.evaluate())

    def _record_loss(self, loss: float) -> None:
        """The validation loss of the parameters the trainer holds now."""
        self.status.val_loss = loss
        self.status.val_step = self.trainer.step
        if self._record_sample is not None:
            self._record_sample(step=self.trainer.step, val_loss=self.status.val_loss)

    async def _one_step(self, stop: asyncio.Event) -> StepReport | None:
        stepping = asyncio.create_task(self._step())
        stopping = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({stepping, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if not stepping.done():
            # a stop: give the step in flight a moment (its round may be waiting on a frozen peer)
            done, _ = await asyncio.wait({stepping}, timeout=STEP_GRACE_S)
            if not done:
                stepping.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await stepping
                return None
        return stepping.result()

    async def _step(self) -> StepReport | None:
        """One step, after the laggard check; None when that check's catch-up took the node to the end of
        its budget (the swarm's final step), which leaves no step to take."""
        await self._rejoin_if_left_behind()
        if self.finished:
            return None
        return await self.algorithm.step(self.plan_for)

    async def _final_merge(self, merge: Merge, stop: asyncio.Event, save: Callable[[], Awaitable[None]]) -> None:
        """Wait (up to MERGE_WAIT_S) until every peer in view has spent its budget, then average their
        final models with ours once (uniformly; SPES: each expert over its owners), train no more on it,
        evaluate and checkpoint it. Peers keep being served the pre-merge final models, so every node
        averages the same inputs."""
        deadline = time.monotonic() + MERGE_WAIT_S
        while not stop.is_set() and time.monotonic() < deadline:
            if all(self._done(p.step) for p in self.discovery.view() if p.peer_id != self.peer.peer_id):
                break
            await asyncio.sleep(0.2)
        else:
            if not stop.is_set():
                logger.info("final merge goes on without the peers still training after %g s", MERGE_WAIT_S)
        if stop.is_set():
            return
        merged, report = await merge()
        await self.algorithm.adopt_merged(merged)
        self.status.final_merge = report.as_dict()
        await self.evaluate()
        await save()
        logger.info("final merge over %d peers: val loss %s", len(report.as_dict().get("peers", [])),
                    _fmt(self.status.val_loss))

    async def state(self) -> dict[str, Any]:
        """What the checkpoint holds: the trainer's state and the algorithm's (DiLoCo's outer state)."""
        return await self.algorithm.state()

    def join_progress(self) -> JoinProgress | None:
        """The running catch-up's downloads (the status document's `join`); None when none runs."""
        return self.downloads.snapshot() if self.downloads is not None else None

    def status_dict(self) -> dict[str, Any]:
        """The `training` section of the node's status, as of now."""
        # read at status time, not at the last _record: a SPES table change or a step that has not
        # been recorded yet changes the state, and the spes section reads the optimizer live too;
        # DiLoCo's exchanges in flight change between steps
        self.algorithm.show(self.status)
        self.status.optimizer_state_bytes = self.trainer.optimizer_state_bytes
        return self.status.as_dict()

    def extra_traffic(self) -> tuple[int, int]:
        """Bytes sent and received on protocols besides the main gossip peer's (SPES, DiLoCo)."""
        return self.algorithm.traffic()

    def extra_errors(self) -> dict[str, int]:
        """Refused input counted on protocols besides the main gossip peer's (DiLoCo's fragments)."""
        return self.algorithm.errors()

    def extra_skipped(self) -> dict[str, int]:
        """Neighbours left out of rounds besides the main gossip peer's (DiLoCo's fragments), by reason."""
        return self.algorithm.skipped()

    def checkpoint_meta(self) -> dict[str, str]:
        """What the checkpoint carries beyond its tensors (SPES: the expert records; the tokens this node
        processed and the contributors it saw)."""
        self.observe_contributors()
        return {**self.algorithm.checkpoint_meta(), "tokens": str(self.tokens_processed),
                "contributors": self.contributors.to_meta()}

    def observe_contributors(self) -> None:
        """Take the view's tokens (clipped by discovery) into the contributor table, once per view read."""
        view = self.discovery.view()
        if view is not self._observed_view:  # discovery replaces the tuple on every read
            self._observed_view = view
            self.contributors.observe_view(view)
        self.contributors.observe(self.peer.peer_id, self.tokens_processed)

    def spes_status(self) -> dict[str, Any] | None:
        """The `spes` section of the node's status; None without SPES."""
        return self.algorithm.sections().get("spes")

    def _record(self, report: StepReport) -> None:
        s = self.status
        s.step = self.trainer.step
        if report.round is not None:
            s.consensus_distance = report.round.consensus_distance
        if report.passed:  # no compute, no tokens, no loss: only the step count moved on (and a sync, maybe)
            self.discovery.update(step=self.trainer.step, round=self.peer.round)
            self.algorithm.show(s)
            return
        s.loss, s.lr = report.stats.loss, report.stats.lr
        tokens = tokens_per_step(self.recipe)
        self._step_times.append(report.step_s)
        s.tokens_per_s = tokens_per_second(tokens, self._step_times)
        self._tokens += tokens
        self.tokens_processed += tokens
        sent, received = self.extra_traffic()
        moved = sent + received + self.peer.stats.bytes_sent + self.peer.stats.bytes_received
        s.bytes_per_token = moved / self._tokens
        self.discovery.update(step=self.trainer.step, round=self.peer.round, loss=s.loss,
                              tokens=self.tokens_processed, tokens_per_s=s.tokens_per_s)
        self.observe_contributors()
        if self._record_sample is not None:
            self._record_sample(step=s.step, loss=s.loss, tokens=tokens,
                                consensus_distance=report.round.consensus_distance if report.round else None)
        if s.step % 10 == 0:
            logger.info("step %d loss %.4f lr %.2e %.0f tok/s", s.step, s.loss, s.lr, s.tokens_per_s)
        self.algorithm.show(s)


def _reasons(refused: Mapping[str, str]) -> str:
    return ", ".join(f"{peer}: {why}" for peer, why in sorted(refused.items())) or "no peer answered"


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


async def _report_downloads(watch: DownloadWatch, every_s: float = DOWNLOAD_REPORT_S) -> None:
    """Show a catch-up's download progress on the command line every `every_s` until cancelled: a line
    rewritten in place when stdout is a terminal, else a log line."""
    tty = sys.stdout.isatty()
    shown = False
    try:
        while True:
            await asyncio.sleep(every_s)
            progress = watch.snapshot()
            if progress is None:
                continue
            if tty:
                sys.stdout.write(f"\r{progress.line()}\x1b[K")
                sys.stdout.flush()
                shown = True
            else:
                logger.info("%s", progress.line())
    finally:
        if shown:
            sys.stdout.write("\n")
            sys.stdout.flush()
