"""AccumAdam (Decent-DP's accumulated Adam) as DAdam's `adam_accumulate` option: the rule against an
independent numpy computation, K = 1 as plain Adam, the trainer's state and its bytes, the recipe field."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch

from gossip.optimizers import LocalOptimizer, OptimizerConfig, accum_adam_step
from node.swarm.recipe import ModelPayload, TrainingRecipe
from node.train.data import Corpus, peer_shard
from node.train.models import ModelConfig, build_model
from node.train.trainer import Trainer, TrainerConfig, train_alone

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

BETAS = (0.9, 0.999)
EPS = 1e-8
TINY = ModelConfig(context=32, layers=2, width=64, heads=4, experts=0, expert_hidden=128)


def reference_directions(grads: list[np.ndarray], k: int) -> list[np.ndarray]:
    """AccumAdam's direction at each step, from the gradients alone (no running state): the moments are
    EMAs, from zero, of the means of the completed blocks of k steps; the step's own gradient enters
    last; the bias corrections count blocks (ceil(t / k))."""
    beta1, beta2 = BETAS
    out = []
    for t in range(1, len(grads) + 1):
        done = (t - 1) // k  # complete blocks before step t
        means = [np.mean(grads[b * k:(b + 1) * k], axis=0) for b in range(done)]
        m = sum(((1 - beta1) * beta1 ** (done - 1 - b) * means[b] for b in range(done)), np.zeros_like(grads[0]))
        v = sum(((1 - beta2) * beta2 ** (done - 1 - b) * means[b] ** 2 for b in range(done)), np.zeros_like(grads[0]))
        g = grads[t - 1]
        m_hat = beta1 * m + (1 - beta1) * g
        v_hat = beta2 * v + (1 - beta2) * g * g
        blocks = math.ceil(t / k)
        out.append((m_hat / (1 - beta1**blocks)) / (np.sqrt(v_hat / (1 - beta2**blocks)) + EPS))
    return out


def plain_adam_directions(grads: list[np.ndarray]) -> list[np.ndarray]:
    beta1, beta2 = BETAS
    m, v, out = np.zeros_like(grads[0]), np.zeros_like(grads[0]), []
    for t, g in enumerate(grads, 1):
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        out.append((m / (1 - beta1**t)) / (np.sqrt(v / (1 - beta2**t)) + EPS))
    return out


def gradients(steps: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(0.3, 1.0, size=17) for _ in range(steps)]


@pytest.mark.parametrize("k", [2, 3, 4])
def test_accum_adam_matches_an_independent_computation_over_several_blocks(k: int) -> None:
    grads = gradients(4 * k + 1)
    optimizer = LocalOptimizer(OptimizerConfig(algorithm="dadam", adam_accumulate=k, betas=BETAS, eps=EPS))
    param = np.zeros(17)
    for got, want in zip((optimizer.direction("w", g, param) for g in grads), reference_directions(grads, k),
                         strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_the_reference_with_k_1_is_plain_adam() -> None:
    grads = gradients(9)
    for got, want in zip(reference_directions(grads, 1), plain_adam_directions(grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12)


def test_k_1_is_dadam_exactly_and_keeps_no_extra_buffer() -> None:
    grads = gradients(9, seed=1)
    plain = LocalOptimizer(OptimizerConfig(algorithm="dadam"))
    accum1 = LocalOptimizer(OptimizerConfig(algorithm="dadam", adam_accumulate=1))
    param = np.zeros(17)
    for g in grads:
        np.testing.assert_array_equal(plain.direction("w", g, param), accum1.direction("w", g, param))
    assert set(accum1.state()) == {"w/adam_m", "w/adam_v"}
    # and the rule itself at K = 1, stepped by hand, is that same Adam
    m, v, acc = np.zeros(17), np.zeros(17), np.zeros(17)
    for t, (g, want) in enumerate(zip(grads, plain_adam_directions(grads), strict=True), 1):
        d, end = accum_adam_step(m, v, acc, g, t, 1, BETAS, EPS)
        acc[:] = 0
        assert end
        np.testing.assert_allclose(d, want, rtol=1e-12)


def test_the_rule_runs_on_torch_tensors_like_on_numpy() -> None:
    grads = gradients(7, seed=2)
    config = OptimizerConfig(algorithm="dadam", adam_accumulate=3)
    on_numpy, on_torch = LocalOptimizer(config), LocalOptimizer(config)
    for g in grads:
        want = on_numpy.direction("w", g, np.zeros(17))
        got = on_torch.direction("w", torch.from_numpy(g), torch.zeros(17, dtype=torch.float64))
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-12)
    np.testing.assert_allclose(on_torch.state()["w/adam_accum"].numpy(), on_numpy.state()["w/adam_accum"])


def test_state_round_trips_mid_block() -> None:
    grads = gradients(10, seed=3)
    config = OptimizerConfig(algorithm="dadam", adam_accumulate=4)
    first, second = LocalOptimizer(config), LocalOptimizer(config)
    param = np.zeros(17)
    for g in grads[:6]:  # two steps into the second block
        first.direction("w", g, param)
    second.load_state({key: value.copy() for key, value in first.state().items()}, first.state_counts())
    for g in grads[6:]:
        np.testing.assert_array_equal(first.direction("w", g, param), second.direction("w", g, param))
    assert first.state_bytes() == 3 * 17 * 8


@pytest.mark.parametrize("bad", [{"adam_accumulate": 0}, {"algorithm": "dsgd", "adam_accumulate": 2},
                                 {"algorithm": "diloco", "adam_accumulate": 2}])
def test_bad_accumulation_settings_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError, match="adam_accumulate"):
        OptimizerConfig(**bad)


# ---- the trainer -----------------------------------------------------------------------------------


def make_trainer(corpus: Corpus, optimizer: OptimizerConfig, *, seed: int = 0) -> Trainer:
    config = TrainerConfig(optimizer=optimizer, batch_size=2, context=TINY.context, device="cpu", precision="fp32",
                           eval_batch_size=16, eval_batches=2)
    return Trainer(build_model(TINY, seed=seed), config, peer_id="peer-a", train_tokens=peer_shard(corpus, "peer-a"),
                   val_tokens=corpus.val)


def test_a_trainer_steps_with_accum_adam_and_counts_its_buffer(corpus: Corpus) -> None:
    accum = OptimizerConfig(algorithm="dadam", lr=3e-3, adam_accumulate=4)
    plain = OptimizerConfig(algorithm="dadam", lr=3e-3)

    async def main() -> None:
        async with make_trainer(corpus, accum) as trainer, make_trainer(corpus, plain) as baseline, \
                make_trainer(corpus, accum, seed=7) as restored:
            parameters = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
            before = await trainer.tensors()
            reports = await train_alone(trainer, 6)
            await train_alone(baseline, 6)
            assert all(math.isfinite(r.loss) for r in reports)
            assert trainer.optimizer_state_bytes == 3 * 4 * parameters  # m, v and the accumulator, fp32
            assert baseline.optimizer_state_bytes == 2 * 4 * parameters
            after = await trainer.tensors()
            assert any(not np.array_equal(before[name], after[name]) for name in before)
            # a checkpoint taken mid-block continues exactly
            await restored.restore(await trainer.state())
            await train_alone(trainer, 3)
            await train_alone(restored, 3)
            ours, theirs = await trainer.tensors(), await restored.tensors()
        for name in ours:
            np.testing.assert_array_equal(ours[name], theirs[name])

    asyncio.run(main())


# ---- the recipe ------------------------------------------------------------------------------------


def recipe(**optimizer: object) -> TrainingRecipe:
    return TrainingRecipe(model="dense", seed=1, batch_size=4, context=32, steps=100,
                          optimizer=OptimizerConfig(**{"algorithm": "dadam", "lr": 1e-3, "total_steps": 100,
                                                       **optimizer}))  # type: ignore[arg-type]


def test_the_recipe_carries_the_accumulation_and_leaves_the_default_out() -> None:
    doc = recipe(adam_accumulate=4).to_doc()
    assert doc["optimizer"]["adam_accumulate"] == 4
    assert TrainingRecipe.from_doc(doc).optimizer.adam_accumulate == 4
    plain = recipe().to_doc()
    assert "adam_accumulate" not in plain["optimizer"]
    assert TrainingRecipe.from_doc(plain).optimizer.adam_accumulate == 1


def test_a_recipe_with_accumulation_outside_dadam_is_refused() -> None:
    doc = recipe(adam_accumulate=4).to_doc()
    doc["optimizer"] = {**doc["optimizer"], "algorithm": "dsgd"}
    with pytest.raises(ValueError, match="adam_accumulate"):
        TrainingRecipe.from_doc(doc)


def test_a_founders_flag_reaches_the_document_and_a_joiners_recipe() -> None:
    from node.config import NodeConfig, TrainingConfig
    from node.runtime import founding
    from node.swarm.recipe import RecipeInvalid, parse_document

    config = NodeConfig(seed=3, training=TrainingConfig(model="dense", optimizer="dadam", adam_accumulate=4))
    doc = founding.swarm_document(config, 0.0)
    assert doc["payload"]["optimizer"]["adam_accumulate"] == 4
    payload = parse_document(doc).payload
    assert isinstance(payload, ModelPayload)
    assert TrainingRecipe.from_payload(payload).optimizer.adam_accumulate == 4
    plain = founding.swarm_document(NodeConfig(seed=3, training=TrainingConfig(model="dense")), 0.0)
    assert "adam_accumulate" not in plain["payload"]["optimizer"]
    with pytest.raises(RecipeInvalid, match="adam_accumulate"):
        founding.swarm_document(NodeConfig(training=TrainingConfig(model="dense", optimizer="dsgd",
                                                                   adam_accumulate=4)), 0.0)
