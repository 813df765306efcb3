"""Three real node processes train `hf-tiny-llama` on a jsonl dataset the test writes, with a BPE
tokenizer trained by `murmur tokenizer train`; the joiners are not given the tokenizer and fetch it
from the founder. The validation loss falls by a third, a malformed line and a record without the text
field are skipped and counted while training goes on, and `murmur export --url` writes a directory from
which transformers loads a model and a tokenizer that generate text, with the swarm average's logits."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from node.swarm.loop import EVAL_BATCH_SIZE, EVAL_BATCHES
from node.swarm.recipe import SwarmSettings
from node.train.checkpoint import SWARM_AVERAGE_FILE, load_checkpoint
from node.train.data import synthetic_text
from node.train.models import mean_cross_entropy
from support.swarm_harness import Swarm, wait_for

pytestmark = pytest.mark.multiprocess

MURMUR = str(Path(sys.executable).with_name("murmur"))
STEPS = 60
CONTEXT = 64
RECIPE = {"model": "hf-tiny-llama", "context": CONTEXT, "batch_size": 8, "optimizer": "dadam", "lr": 3e-3,
          "warmup_steps": 5, "steps": STEPS, "topology": "ring"}
NODE = {"threads": 1, "eval_every": 20, "checkpoint_every": 30, "exchange_timeout": 3, "min_peers": 3,
        "text_field": "body"}


BAD_EVERY = 8  # stories between bad records: every unit (16 KiB, ~28 stories) holds a few of each kind


def write_dataset(directory: Path) -> int:
    """Stories as jsonl records in two shards, with a malformed line and a record without the text field
    after every BAD_EVERY-th story, so whichever units a node reads first hold both; returns the number
    of bad records."""
    directory.mkdir()
    stories = [s for s in synthetic_text(0, 250_000).decode().split("\n\n") if s]
    half, bad = len(stories) // 2, 0
    for name, part in (("a.jsonl", stories[:half]), ("b.jsonl", stories[half:])):
        with open(directory / name, "w") as f:
            for i, story in enumerate(part):
                f.write(json.dumps({"id": f"{name}:{i}", "body": story}) + "\n")
                if i % BAD_EVERY == 3:
                    f.write('{"id": "broken", "body": "no closing quote}\n')
                if i % BAD_EVERY == 7:
                    f.write(json.dumps({"id": "no-body", "title": "a record without the text field"}) + "\n")
                bad += i % BAD_EVERY in (3, 7)
    return bad


def murmur(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([MURMUR, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(600)
def test_three_nodes_train_hf_tiny_llama_with_a_trained_tokenizer_and_export_what_transformers_loads(tmp_path):
    data = tmp_path / "data"
    bad = write_dataset(data)
    tokenizer = tmp_path / "tokenizer.json"
    trained = murmur("tokenizer", "train", "--data", str(data), "--text-field", "body", "--vocab", "512",
                     "--out", str(tokenizer))
    assert trained.returncode == 0, trained.stderr[-2000:]
    # it trains on the training units only (a twentieth of the data is validation), skipping their bad records
    counted = re.search(r"trained a byte-level BPE of 512 tokens on \d+ records \((\d+) skipped\)", trained.stdout)
    assert counted and 0.8 * bad <= int(counted.group(1)) <= bad, (bad, trained.stdout)

    with Swarm(tmp_path / "swarm", heartbeat=1) as swarm:
        founder = swarm.found(**RECIPE, **NODE, data=data, tokenizer=tokenizer)
        # the joiners have the data but not the tokenizer: they fetch it from the founder by its hash
        joiners = [swarm.spawn(f"n{i}", seed=i, join=founder, **NODE, data=data) for i in (1, 2)]
        swarm.wait_ready(joiners)
        nodes = [founder, *joiners]
        wait_for(lambda: all(n.status()["training"]["done"] for n in nodes), 400, "every node to finish")
        for joiner in joiners:
            assert "fetched the swarm's tokenizer" in joiner.stderr(), joiner.log_tail()
        # every unit holds bad records of both kinds: each node logged and counted them, and trained on
        statuses = swarm.statuses(nodes)
        for node, status in zip(nodes, statuses, strict=True):
            for kind in ("data_bad_record", "data_missing_field"):
                assert status["errors"].get(kind, 0) >= 1, (node.name, status["errors"])
                assert f"data: skipped {kind}" in node.stderr(), node.log_tail()
        assert all(s["training"]["step"] == STEPS for s in statuses)

        exported = tmp_path / "export"
        token = (founder.data_dir / "monitor.token").read_text().strip()
        done = murmur("export", "--url", founder.monitor_url, "--token", token, "--to", str(exported))
        assert done.returncode == 0, done.stderr[-2000:]
        assert f"to {exported}" in done.stdout
        assert (founder.data_dir / "swarm-average-hf" / "config.json").is_file()  # written with the average
        assert swarm.stop_all(nodes) == [0, 0, 0]

    average = load_checkpoint(founder.data_dir / SWARM_AVERAGE_FILE)
    assert average is not None and sorted(json.loads(average.meta["peers"])) == sorted(n.peer_id for n in nodes)
    card = (exported / "README.md").read_text()  # the model card lists every averaged peer with its step
    assert all(f"| `{n.peer_id}` | {STEPS} | 33.3% |" in card for n in nodes), card
    recipe = SwarmSettings.from_doc(json.loads(average.meta["swarm_config"])).training
    assert recipe is not None and recipe.tokenizer is not None and recipe.model_config["vocab_size"] == 512

    from node.train.models.hf import build_hf_model
    from node.train.shards import ShardStream, open_dataset
    from node.train.tokenizer import BpeTokenizer

    # the validation loss of the untrained model and of the swarm average, as the nodes evaluate it
    stream = ShardStream(open_dataset(data), BpeTokenizer(tokenizer.read_bytes()), "test", "body")
    val = stream.val_tokens()
    stream.close()
    from node.train.data import validation_batches

    def loss_of(model: torch.nn.Module) -> float:
        return mean_cross_entropy(model, validation_batches(val, EVAL_BATCH_SIZE, CONTEXT, EVAL_BATCHES))

    model = build_hf_model(recipe.model_config, recipe.seed)
    initial = loss_of(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(average.tensors[name]).view_as(p))
    final = loss_of(model)
    assert final <= initial * 2 / 3, f"validation loss {initial:.3f} -> {final:.3f}: not a third lower"

    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_model = AutoModelForCausalLM.from_pretrained(str(exported))
    hf_tokenizer = AutoTokenizer.from_pretrained(str(exported))
    prompt = hf_tokenizer("Mira walked to the garden and", return_tensors="pt")
    with torch.no_grad():
        exported_logits = hf_model(input_ids=prompt.input_ids).logits
        average_logits, _ = model(prompt.input_ids)
    np.testing.assert_allclose(exported_logits.numpy(), average_logits.numpy(), atol=1e-5, rtol=0)
    generated = hf_model.generate(prompt.input_ids, max_new_tokens=12, do_sample=False)
    text = hf_tokenizer.decode(generated[0][prompt.input_ids.shape[1]:], skip_special_tokens=True)
    assert generated.shape[1] > prompt.input_ids.shape[1] and text.strip(), text
    manifest = json.loads((exported / "murmur.json").read_text())
    assert manifest["kind"] == "average" and manifest["model"] == "hf-tiny-llama"
    # the steps the peers offered their parameters at, as the swarm average recorded them
    assert manifest["max_step"] == average.meta["max_step"] >= STEPS - 1
