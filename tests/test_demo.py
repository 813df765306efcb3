"""`murmur demo`: a local swarm of real node processes trains the embedded model and reports the
losses of each node, of the averaged model and of the untrained model; bad flags exit 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from node.train.models import build_named_model

MURMUR = Path(sys.executable).with_name("murmur")


@pytest.mark.multiprocess
def test_demo_trains_and_reports_json(tmp_path):
    steps = 30
    out = subprocess.run([str(MURMUR), "demo", "--nodes", "2", "--steps", str(steps), "--model", "dense",
                          "--batch-size", "4", "--optimizer", "dsgd", "--lr", "0.3", "--dir", str(tmp_path / "run"),
                          "--json"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "monitor of node0: http://127.0.0.1:" in out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    dense_params = sum(p.numel() for p in build_named_model("dense").parameters())
    assert len(summary["nodes"]) == 2 and len({n["peer_id"] for n in summary["nodes"]}) == 2
    for node in summary["nodes"]:
        assert node["steps"] == steps
        assert node["trainable_params"] == dense_params
        assert node["bytes_sent"] > 0 and node["bytes_received"] > 0
        assert node["optimizer_state_bytes"] == 0  # plain D-SGD (no momentum) keeps no optimizer state
        assert node["val_loss"] < summary["initial_val_loss"] - 1.0
    assert summary["averaged_val_loss"] < summary["initial_val_loss"] - 1.0
    # the nodes gossiped: their models ended close to each other and to their average
    losses = [n["val_loss"] for n in summary["nodes"]]
    assert max(losses) - min(losses) < 0.2 and abs(summary["averaged_val_loss"] - min(losses)) < 0.2
    # a round of fp32 every step moves what the default demo's analytic figure says, give or take headers
    assert 0.9 < summary["traffic"]["ratio_to_default"] < 1.1, summary["traffic"]


@pytest.mark.multiprocess
def test_a_diloco_demo_with_int8_shows_its_saving_next_to_the_default_demo(tmp_path):
    """`murmur demo --optimizer diloco --codec int8 --json`: the swarm trains, ends on one merged model,
    and its bytes per node per step are a small fraction of the default demo's."""
    steps, local_steps = 40, 10
    out = subprocess.run([str(MURMUR), "demo", "--nodes", "2", "--steps", str(steps), "--model", "dense",
                          "--batch-size", "4", "--optimizer", "diloco", "--codec", "int8", "--local-steps",
                          str(local_steps), "--dir", str(tmp_path / "run"), "--json"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert [n["steps"] for n in summary["nodes"]] == [steps, steps]
    assert summary["averaged_val_loss"] < summary["initial_val_loss"] - 1.0
    losses = [n["val_loss"] for n in summary["nodes"]]
    assert max(losses) - min(losses) < 1e-3, losses  # the final merge: one model
    # per node and phase: pseudo-gradients and anchors in int8 (about 1 byte per parameter each way), per
    # run the final merge's fp32 model each way: (4 / H + 8 / steps) / 8 of the default demo's 8 bytes
    traffic = summary["traffic"]
    expected = (4 / local_steps + 8 / steps) / 8
    assert 0.5 * expected < traffic["ratio_to_default"] < 1.5 * expected, traffic


@pytest.mark.multiprocess
def test_a_demo_of_a_hugging_face_preset_trains_and_prints_the_monitor(tmp_path):
    """`murmur demo --model hf-tiny-llama`: the nodes build the transformers model from the swarm's
    config, train it together, and the losses fall."""
    from node.train.models.hf import parameter_count, read_source

    steps = 30
    out = subprocess.run([str(MURMUR), "demo", "--nodes", "2", "--steps", str(steps), "--model", "hf-tiny-llama",
                          "--batch-size", "4", "--lr", "1e-2", "--dir", str(tmp_path / "run"), "--json"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "monitor of node0: http://127.0.0.1:" in out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["model"] == "hf-tiny-llama" and len(summary["nodes"]) == 2
    for node in summary["nodes"]:
        assert node["steps"] == steps
        assert node["trainable_params"] == parameter_count(read_source("hf-tiny-llama").config)
        assert node["bytes_sent"] > 0 and node["bytes_received"] > 0
        assert node["val_loss"] < summary["initial_val_loss"] - 1.0
    assert summary["averaged_val_loss"] < summary["initial_val_loss"] - 1.0


@pytest.mark.unit
@pytest.mark.parametrize("args, message", [
    (["--nodes", "0"], "argument --nodes: 0 is below the minimum 1"),
    (["--optimizer", "sgd"], "argument --optimizer: invalid choice"),
    (["--spes", "--model", "dense"], "--spes: SPES syncs the experts of an MoE model (moe, hf-tiny-mixtral)"),
])
def test_demo_bad_flags_exit_2_with_one_line(args, message):
    out = subprocess.run([str(MURMUR), "demo", *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr


@pytest.mark.unit
@pytest.mark.parametrize("args, flags", [
    (["--spes"], ["--spes-sync-every", "10"]),  # ten syncs in the default 100 steps, not a node's two
    (["--spes", "--spes-sync-every", "5"], ["--spes-sync-every", "5"]),
    (["--optimizer", "diloco"], ["--local-steps", "20"]),
    ([], []),
])
def test_the_demo_passes_its_own_period_defaults_to_the_founder(monkeypatch, args, flags):
    from node.cli import demo
    from node.cli.main import build_parser

    started: list[demo.DemoOptions] = []
    monkeypatch.setattr(demo, "run_demo", lambda options: started.append(options) or 0)
    parsed = build_parser().parse_args(["demo", *args])
    assert parsed.run(parsed) == 0
    assert list(started[0].recipe_flags) == flags


@pytest.mark.unit
def test_the_demos_help_says_its_own_period_defaults():
    """`murmur demo --help` says the periods the demo uses, not a node's (which it names beside them)."""
    import argparse

    from node.cli.demo import DEMO_DILOCO_LOCAL_STEPS, DEMO_SPES_SYNC_EVERY
    from node.cli.main import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(commands.choices["demo"].format_help().split())
    assert f"(default: 1; {DEMO_DILOCO_LOCAL_STEPS} with --optimizer diloco, where a node takes 100;" in text
    assert f"(default: {DEMO_SPES_SYNC_EVERY}, where a node takes 50;" in text
    assert "unset with --optimizer diloco: 100" not in text
