"""Training wiring: the runtime's side of a swarm that trains a model. It builds the trainer and its
gossip peer from the swarm's recipe and this node's settings, restores this node's checkpoint, picks
the recipe's algorithm (node.algorithms.registry), and runs the loop until the node stops."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, cast

from gossip.choco import ChocoState
from gossip.codecs import get_codec
from gossip.exchange import ExchangeSettings, GossipPeer
from node.config import NodeConfig
from node.runtime.errors import StartupError
from node.runtime.saving import CheckpointWriter, save_swarm_average
from node.runtime.shutdown import close_in_thread
from node.runtime.status import NodeRuntime
from node.runtime.tokenizer import obtain_tokenizer
from node.swarm.contributors import ContributorTable, tokens_from_meta, tokens_per_step
from node.swarm.progress import PeerProgress, stalled_after
from node.swarm.recipe import SwarmSettings, TrainingRecipe
from node.train.checkpoint import Checkpoint
from node.train.settings import TrainingSettings
from node.train.trainer import Precision
from topology import Topology, TopologyCache

if TYPE_CHECKING:
    from node.swarm.loop import SwarmLoop
    from node.swarm.peers import PeerRecordLike, SwarmRecord

logger = logging.getLogger("murmur.node")


def training_settings(config: NodeConfig) -> TrainingSettings:
    """What training takes of the node's config (the swarm's recipe gives the rest)."""
    t = config.training
    # the config's precision is one of PRECISION_NAMES, the trainer's Precision; TrainerConfig checks it again
    return TrainingSettings(data_dir=config.data_dir, data=t.data, device=t.device, precision=cast(Precision, t.precision),
                            threads=t.threads, eval_every=t.eval_every, checkpoint_every=t.checkpoint_every,
                            average_every=t.average_every, min_peers=config.gossip.min_peers, model=t.model,
                            text_field=t.text_field, tokenizer=t.tokenizer, join_check=t.join_check)


async def start_training(runtime: NodeRuntime, recipe: TrainingRecipe, settings: SwarmSettings,
                         exchange: ExchangeSettings, checkpoint: Checkpoint | None,
                         stack: contextlib.AsyncExitStack) -> SwarmLoop:
    """Build the trainer and its gossip peer; restore this node's checkpoint when it is of this swarm."""
    from node.algorithms.registry import ALGORITHMS, AlgorithmContext, algorithm_name
    from node.swarm.loop import (
        CATCH_UP_DIAL_S,
        StartedFrom,
        SwarmLoop,
        TrainingSetupError,
        build_trainer,
        checkpoint_matches,
        last_round_at,
        local_weights,
    )

    config, transport, discovery = runtime.config, runtime.transport, runtime.discovery
    assert transport is not None and discovery is not None, "the data plane and discovery are started"
    me, local = transport.peer_id, training_settings(config)

    dialer = runtime.dialer
    assert dialer is not None, "the dialer is started"

    async def dial(record: PeerRecordLike) -> None:
        await dialer.ensure([record], CATCH_UP_DIAL_S)

    tokenizer = await obtain_tokenizer(recipe.tokenizer, config.data_dir, local.tokenizer, transport, discovery.view,
                                       dial)
    try:
        trainer = await asyncio.to_thread(build_trainer, local, recipe, me, tokenizer, runtime.count)
    except TrainingSetupError as exc:
        raise StartupError(f"cannot train the swarm's model here: {exc}") from None
    stack.push_async_callback(close_in_thread, trainer, "trainer")
    # compressed gossip's anchor: the seeded initial parameters, the same bits on every fresh peer
    choco = ChocoState(settings.choco, await trainer.tensors()) if settings.choco is not None else None
    resumed = checkpoint is not None and checkpoint_matches(checkpoint, runtime.config_hash)
    if checkpoint is not None and resumed:
        await trainer.restore(checkpoint.tensors)
        logger.info("resuming from checkpoint at step %d", trainer.step)
    elif checkpoint is not None:
        logger.warning("the checkpoint belongs to another swarm config; starting fresh (it stays as checkpoint.safetensors.prev)")
    # DiLoCo's main peer serves whole models (downloads, evaluations, the final merge): losslessly, whatever
    # codec the swarm's pseudo-gradients travel in
    state_exchange = replace(exchange, codec=get_codec("fp32")) if recipe.diloco is not None else exchange
    peer = runtime.peer = GossipPeer(transport, state_exchange, await trainer.tensors(), step=trainer.step, choco=choco)
    peer.round = last_round_at(trainer.step, recipe)
    topologies = TopologyCache(settings.topology)

    def topology_for(n: int) -> Topology:
        return topologies.get(n)

    async def connect(records: Sequence[SwarmRecord]) -> None:
        await dialer.ensure(records, CATCH_UP_DIAL_S)

    local_steps = recipe.optimizer.local_steps
    # DHT records lag by up to a heartbeat: the window leaves room for that beyond the staleness bound
    lag_window = max(10, 2 * (settings.max_staleness + 1) * local_steps)
    entry = ALGORITHMS[algorithm_name(recipe)]
    context = AlgorithmContext(trainer=trainer, peer=peer, discovery=discovery, transport=transport, recipe=recipe,
                               exchange=exchange, peer_exchange=state_exchange,
                               resumed=checkpoint if resumed else None, swarm=config.swarm,
                               heartbeat_s=config.heartbeat_s, record_ttl_s=runtime.record_ttl_s,
                               experts=config.training.experts)
    try:
        algorithm = entry.build(context)
    except ValueError as exc:  # SPES: no MoE layers; DiLoCo: fewer tensors than fragments, another model's checkpoint
        raise StartupError(f"cannot train the swarm's model with {entry.label} here: {exc}") from None
    scoring = config.gossip.scoring
    # scored where rounds mix whole values: D-SGD and DAdam's parameters (under compressed gossip, the
    # estimates of them its differences build), gossip DiLoCo's outer messages (SPES averages experts over
    # their owners: not scored)
    if scoring.enabled:
        from node.swarm.contribution import ContributionScorer

        scorer = ContributionScorer(trainer, scoring)
        if algorithm.score_with(scorer):
            runtime.contribution = scorer
            stack.push_async_callback(scorer.close)
    training = SwarmLoop(trainer, peer, discovery, recipe, local, topology_for, connect, lag_window, algorithm,
                         record=runtime.record)
    training.status.started_from = StartedFrom.CHECKPOINT if resumed else StartedFrom.INIT
    if checkpoint is not None and resumed:  # the work done before this start, and the contributors seen
        training.tokens_processed = tokens_from_meta(checkpoint.meta.get("tokens"), trainer.step, tokens_per_step(recipe))
        training.contributors = ContributorTable.from_meta(checkpoint.meta.get("contributors"))
    training.progress = PeerProgress(stalled_after(config.heartbeat_s, config.gossip.exchange_timeout_s))
    runtime.training = training
    training.must_download = (recipe.weights_sha256 is not None and not resumed
                              and await asyncio.to_thread(local_weights, local.model, recipe) is None)
    from node.swarm.swarm_eval import SwarmEvaluator

    swarm_eval = runtime.swarm_eval = SwarmEvaluator(
        trainer, peer, discovery.view, connect=dial, count=runtime.count,
        average=algorithm.average, save=functools.partial(save_swarm_average, runtime))
    stack.push_async_callback(swarm_eval.close)
    return training


async def train_until(stop: asyncio.Event, runtime: NodeRuntime, training: SwarmLoop, settings: SwarmSettings,
                      checkpoints: CheckpointWriter) -> None:
    """Catch up with the swarm if it is ahead (a joiner, or a node that was down), wait for the quorum of
    a fresh swarm, train, and keep serving parameters once the step budget is spent."""
    swarm_eval = runtime.swarm_eval
    assert swarm_eval is not None, "start_training made the evaluator"
    await training.catch_up(stop, margin=settings.max_staleness * training.recipe.optimizer.local_steps,
                            look=not (runtime.founding and training.trainer.step == 0), epoch=settings.clock.epoch)
    if training.must_download and not stop.is_set():
        raise StartupError(f"the swarm starts from pretrained weights (sha256 {training.recipe.weights_sha256}) that "
                           "this node does not have, and no peer served the swarm's parameters; start it with "
                           "--model hf:PATH of that checkpoint")
    await training.serve_rounds()  # before the quorum: the quorum counts the peers that serve theirs
    if training.trainer.step == 0:
        await training.wait_for_quorum(stop)
    try:
        # --average-every: the evaluator writes the swarm average in the background, training goes on
        # a checkpoint's write runs beside the next steps; the last step's is on disk before the node shows done
        await training.run(stop, lambda: checkpoints.save(wait=training.finished), average=swarm_eval.save_in_background,
                           merge=swarm_eval.merged)
    except Exception as exc:
        runtime.count("training_failed")
        logger.error("training stopped at step %d: %s: %s; the node keeps serving its last parameters",
                     training.trainer.step, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        training.peer.park()
    await stop.wait()
