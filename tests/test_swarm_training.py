"""Real `murmur` node processes training a model together on loopback: a node killed mid-run, a node
joining at half time (it downloads the swarm's parameters), a killed node restarted with its identity
(it resumes from its checkpoint), parity of the swarm-averaged model with single-process training, and
a corrupted checkpoint that falls back to the previous good one."""

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from node.swarm.loop import EVAL_BATCH_SIZE, EVAL_BATCHES
from node.swarm.recipe import optimizer_config
from node.train.checkpoint import load_checkpoint
from node.train.data import load_corpus
from node.train.trainer import Trainer, TrainerConfig, average_tensors, train_alone
from support.swarm_harness import Swarm, wait_for
from support.tiny_model import TINY, build

pytestmark = pytest.mark.multiprocess

SUPPORT = Path(__file__).parent / "support"
MURMUR = str(Path(sys.executable).with_name("murmur"))
STEPS = 300  # at 400 the swarm average came within 0.2% of the 3-node baseline (PARITY allows 5%)
BATCH = 16
LR = 0.5
WARMUP = 20
# the swarm's recipe (founder flags) and what every node needs to start together and step quickly
RECIPE = {"model": "tiny_model:build", "context": TINY.context, "batch_size": BATCH, "optimizer": "dsgd",
          "lr": LR, "warmup_steps": WARMUP, "steps": STEPS, "topology": "one-peer-exp"}
NODE = {"threads": 1, "eval_every": 25, "checkpoint_every": 10, "exchange_timeout": 3}
JOINER = {"model": RECIPE["model"]}
PARITY = 1.05
RESTART_STEPS = 120


@pytest.fixture
def swarm(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH")])))
    with Swarm(tmp_path, heartbeat=1) as s:
        yield s


def training(node) -> dict:
    return node.status()["training"]


def final_parameters(data_dir: Path) -> dict[str, np.ndarray]:
    checkpoint = load_checkpoint(data_dir / "checkpoint.safetensors")
    assert checkpoint is not None, f"no checkpoint in {data_dir}"
    return {k[len("param/"):]: v for k, v in checkpoint.tensors.items() if k.startswith("param/")}


def single_process_val_loss(nodes: int, data_dir: Path, tensors: dict[str, np.ndarray] | None = None) -> float:
    """Validation loss of `tensors` (evaluated as the nodes do), or, without them, of the baseline:
    one process taking STEPS steps of batch nodes*BATCH over the whole corpus with the same schedule."""
    corpus = load_corpus(None, data_dir)
    config = TrainerConfig(optimizer=optimizer_config("dsgd", LR, WARMUP, STEPS, 1, 1), batch_size=nodes * BATCH,
                           context=TINY.context, device="cpu", eval_batch_size=EVAL_BATCH_SIZE, eval_batches=EVAL_BATCHES)

    async def run() -> float:
        async with Trainer(build(), config, peer_id="baseline", train_tokens=corpus.train, val_tokens=corpus.val) as t:
            if tensors is not None:
                return await t.evaluate(tensors)
            await train_alone(t, STEPS)
            return await t.evaluate()

    return asyncio.run(run())


@pytest.mark.timeout(900)
def test_kill_join_restart_and_parity(swarm, tmp_path):
    founder = swarm.found(**RECIPE, **NODE, min_peers=4)
    # joiners name the swarm's model too: it is user code, which a node runs only if it names it
    nodes = [founder, *(swarm.spawn(f"n{i}", seed=i, join=founder, **NODE, **JOINER, min_peers=4) for i in range(1, 4))]
    swarm.wait_ready(nodes[1:])
    survivors, victim = nodes[:3], nodes[3]
    wait_for(lambda: all(training(n)["step"] >= STEPS // 4 for n in nodes), 180, "a quarter of the steps on every node")
    victim.process.kill()
    victim.process.wait(10)
    checkpointed = int(load_checkpoint(victim.data_dir / "checkpoint.safetensors").meta["step"])

    # a fifth node joins mid-run (started now, it is ready some way into the run, depending on the
    # machine's load): it starts from the swarm's parameters, not from scratch, then trains with it. It
    # spot-checks one copy, striped over the donors (the restarted node below takes three copies)
    joiner = swarm.spawn("n4", seed=4, join=founder, join_check="spot", **NODE, **JOINER)
    swarm.wait_ready([joiner])
    untrained = single_process_val_loss(1, tmp_path, _initial())
    joined = wait_for(lambda: (t := training(joiner))["started_from"].startswith("peer") and t["val_step"] is not None and t,
                      120, "the joiner's download and first evaluation")
    joined_at = int(joined["started_from"].rsplit(" ", 1)[1])
    outcome = wait_for(lambda: training(joiner)["joined"], 60, "the joiner's catch-up report")
    # one copy, in parts from the survivors at once, each part checked against the two others
    ids = sorted(n.peer_id for n in survivors)
    assert outcome["check"] == "spot" and outcome["sources"] and set(outcome["sources"]) <= set(ids), outcome
    for donor in outcome["sources"]:
        assert sorted([donor, *outcome["checked"][donor]]) == ids, outcome
    assert STEPS // 4 <= joined_at < STEPS, f"the joiner came at step {joined_at}, not mid-run"
    source_val = min(training(n)["val_loss"] for n in survivors)
    assert abs(joined["val_loss"] - source_val) < abs(joined["val_loss"] - untrained), (
        f"joiner's first val loss {joined['val_loss']:.3f}: swarm {source_val:.3f}, untrained {untrained:.3f}")

    everyone = [*survivors, joiner]
    wait_for(lambda: all(training(n)["done"] for n in everyone), 300, "every live node to finish")
    statuses = swarm.statuses(everyone)
    for s in statuses:
        assert s["training"]["step"] == STEPS
    assert statuses[-1]["rounds_run"] > 0 and statuses[-1]["bytes_received"] > 0, "the joiner never gossiped"
    # the swarm-average loss asked of a running node: every live node is in it (their parameters no
    # longer change once done, so it is checked below against the average of their final checkpoints)
    def asked_everyone() -> dict | None:
        # asked again if a record lapsed from the founder's view for a moment (a late heartbeat under load)
        asked = subprocess.run([MURMUR, "eval", "--url", founder.monitor_url, "--data-dir", str(founder.data_dir),
                                "--save", "--json"], capture_output=True, text=True, timeout=120)
        assert asked.returncode == 0, asked.stderr[-2000:]
        result = json.loads(asked.stdout)
        return result if sorted(p["peer_id"] for p in result["peers"]) == sorted(n.peer_id for n in everyone) else None

    swarm_eval = wait_for(asked_everyone, 240, "murmur eval to average every live node", interval_s=1.0)
    assert swarm_eval["failed"] == {} and swarm_eval["self"] == founder.peer_id
    assert swarm_eval["local"]["val_step"] == STEPS
    assert swarm_eval["saved"] == str(founder.data_dir / "swarm-average.safetensors") and swarm_eval["save_error"] is None

    # the killed node comes back with its identity: it restores its checkpoint, then catches up with
    # the swarm (which is more than the staleness bound ahead) by downloading its parameters
    restarted = swarm.spawn("n3", seed=3, join=founder, data_dir=victim.data_dir, **NODE, **JOINER)
    swarm.wait_ready([restarted])
    assert restarted.peer_id == victim.peer_id
    wait_for(lambda: training(restarted)["done"], 120, "the restarted node to finish")
    log = restarted.stderr() + restarted.stdout()
    resumed = re.search(r"resuming from checkpoint at step (\d+)", log)
    assert resumed and int(resumed.group(1)) == checkpointed, log[-2000:]
    assert "downloaded parameters from" in log

    assert swarm.stop_all(everyone + [restarted]) == [0] * 5
    swarm_loss = single_process_val_loss(1, tmp_path, average_tensors([final_parameters(n.data_dir) for n in survivors]))
    everyone_loss = single_process_val_loss(1, tmp_path, average_tensors([final_parameters(n.data_dir) for n in everyone]))
    assert swarm_eval["loss"] == pytest.approx(everyone_loss, rel=1e-4), "murmur eval's average is not the swarm's"
    saved = load_checkpoint(founder.data_dir / "swarm-average.safetensors")
    assert saved.meta["kind"] == "swarm-average" and saved.meta["min_step"] == saved.meta["max_step"] == STEPS
    assert sorted(json.loads(saved.meta["peers"])) == sorted(n.peer_id for n in everyone)
    assert single_process_val_loss(1, tmp_path, saved.tensors) == pytest.approx(swarm_eval["loss"], rel=1e-5)
    baseline = single_process_val_loss(3, tmp_path)
    assert swarm_loss <= PARITY * baseline, f"swarm average {swarm_loss:.4f} vs 3-node baseline {baseline:.4f}"
    assert swarm_loss < untrained - 1.0


def _initial() -> dict[str, np.ndarray]:
    return {name: p.detach().numpy().reshape(-1).copy() for name, p in build().named_parameters()}


def test_restart_resumes_from_checkpoint_and_survives_a_corrupt_one(swarm):
    # 120 steps: room for two periodic averages (every 50) before the one at the end
    flags = {**RECIPE, **NODE, "steps": RESTART_STEPS, "checkpoint_every": 10}
    node = swarm.found(**flags)
    wait_for(lambda: training(node)["step"] >= 15, 120, "15 steps")
    assert swarm.stop_all([node]) == [0]
    final = load_checkpoint(node.data_dir / "checkpoint.safetensors")
    stopped_at = int(final.meta["step"])
    assert stopped_at >= 15 and final.tensors["trainer/step"].item() == stopped_at
    per_step = BATCH * TINY.context  # tokens one step processes (one micro-batch): what the record claims
    assert int(final.meta["tokens"]) == stopped_at * per_step

    again = swarm.spawn("n0", seed=0, join=None, data_dir=node.data_dir, **flags)
    swarm.wait_ready([again])
    assert training(again)["started_from"] == "checkpoint"
    assert training(again)["step"] >= stopped_at
    wait_for(lambda: training(again)["step"] >= stopped_at + 5, 120, "5 more steps")
    assert swarm.stop_all([again]) == [0]
    # the tokens went on from the checkpoint's count, and its contributor table names this node
    resumed = load_checkpoint(node.data_dir / "checkpoint.safetensors")
    assert int(resumed.meta["tokens"]) == int(resumed.meta["step"]) * per_step
    assert json.loads(resumed.meta["contributors"]) == {node.peer_id: int(resumed.meta["tokens"])}

    # a torn write of the newest checkpoint: the node falls back to the previous one and loses nothing else
    path = node.data_dir / "checkpoint.safetensors"
    previous = load_checkpoint(node.data_dir / "checkpoint.safetensors.prev")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    # ...and writes the swarm average (alone: its own model) every 50 steps and once more at the end
    third = swarm.spawn("n0", seed=0, join=None, data_dir=node.data_dir, **flags, average_every=50)
    swarm.wait_ready([third])
    assert training(third)["started_from"] == "checkpoint"
    assert training(third)["step"] >= int(previous.meta["step"])
    log = third.stderr() + third.stdout()
    assert "is unreadable" in log and "resuming from checkpoint at step " + str(previous.meta["step"]) in log
    # a joiner that does not name the swarm's model (user code, named by the DHT's config) will not run it
    refused = swarm.spawn("n9", seed=9, join=third, **NODE)
    assert refused.process.wait(60) == 2
    assert ("the swarm trains the model built by 'tiny_model:build', code this node would import and run; "
            "start it with --model tiny_model:build to allow that") in refused.stderr()
    wait_for(lambda: training(third)["done"], 120, "training to finish after the fallback")
    average_path = node.data_dir / "swarm-average.safetensors"
    wait_for(lambda: average_path.exists() and load_checkpoint(average_path).meta["max_step"] == RESTART_STEPS, 60,
             "the swarm average written at the end of training")
    assert swarm.stop_all([third]) == [0]
    average = load_checkpoint(average_path)
    assert average.meta["kind"] == "swarm-average" and json.loads(average.meta["peers"]) == [third.peer_id]
    final_params = final_parameters(node.data_dir)
    assert sorted(average.tensors) == sorted(final_params)
    for name, values in final_params.items():
        np.testing.assert_array_equal(average.tensors[name].reshape(-1), values.reshape(-1), err_msg=name)
    assert load_checkpoint(node.data_dir / "swarm-average.safetensors.prev").meta["max_step"] < RESTART_STEPS  # an earlier periodic one


def test_a_model_that_raises_stops_training_not_the_node(swarm):
    node = swarm.found(**{**RECIPE, **NODE, "model": "tiny_model:build_failing", "steps": 100})
    status = wait_for(lambda: (s := node.status())["errors"].get("training_failed") and s, 120, "the failure counted")
    assert status["training"]["step"] < 100 and not status["training"]["done"]
    log = node.stderr()
    assert "training stopped at step" in log and "user model bug" in log and "Traceback" not in log
    assert node.alive()
    assert swarm.stop_all([node]) == [0]
    assert load_checkpoint(node.data_dir / "checkpoint.safetensors") is not None
