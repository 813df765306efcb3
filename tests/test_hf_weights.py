"""`--model hf:PATH` (node.train.models.hf, node.swarm.loop): a directory holding only a
config.json builds the same seeded random init on every build; a pretrained checkpoint directory
builds the checkpoint's model (its logits) and the founder's recipe names its weights by sha256; and a
joiner uses those weights only if its own --model holds the same ones, otherwise it must download the
swarm's parameters (even at step 0) or stop with exit 2."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.unit, pytest.mark.slow]  # they import transformers (seconds)

TINY_LLAMA = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
              "tie_word_embeddings": False, "rms_norm_eps": 1e-6}


def llama_config(**changes: object):
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_LLAMA, **changes})


def pretrained(directory: Path, seed: int):
    """A tiny Llama with weights of its own (not murmur's seeded init), saved with save_pretrained."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config()).eval()
    with torch.no_grad():  # away from any init rule: the test must see these values come back
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(directory), safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("hf")
    config_only, checkpoint, other = root / "config-only", root / "checkpoint", root / "other"
    llama_config().save_pretrained(str(config_only))
    original = pretrained(checkpoint, seed=1)
    pretrained(other, seed=2)  # the same config, other weights
    return SimpleNamespace(config_only=config_only, checkpoint=checkpoint, other=other, original=original)


def recipe_for(model: str):
    from node.cli.main import parse_node_config
    from node.runtime.founding import swarm_document
    from node.swarm.recipe import SwarmSettings

    recipe = SwarmSettings.from_doc(swarm_document(parse_node_config(["node", "--model", model], {}), 1.0)).training
    assert recipe is not None
    return recipe


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_config_only_directory_builds_the_same_seeded_random_init_every_time(dirs) -> None:
    from node.train.models.hf import build_hf_model, read_source

    assert sorted(p.name for p in dirs.config_only.iterdir()) == ["config.json"]
    source = read_source(f"hf:{dirs.config_only}")
    assert source.weights is None and source.tokenizer is None
    assert source.config["model_type"] == "llama" and source.config["hidden_size"] == 32
    assert read_source(f"hf:{dirs.config_only / 'config.json'}") == source  # the file itself names it too
    a, b, c = (params(build_hf_model(source.config, seed)) for seed in (7, 7, 8))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), "one seed must give one model"
    assert any(not torch.equal(a[n], c[n]) for n in a if a[n].dim() > 1), "another seed, another model"
    # the founder's recipe carries the config itself and no weights: every joiner builds the same init
    recipe = recipe_for(f"hf:{dirs.config_only}")
    assert recipe.model_config == source.config and recipe.weights_sha256 is None
    assert not any(str(dirs.config_only) in str(v) for v in recipe.model_config.values())


def test_a_pretrained_checkpoint_builds_its_own_model_and_the_recipe_names_its_weights(dirs) -> None:
    from node.train.models.hf import build_hf_model, read_source, weights_digest

    source = read_source(f"hf:{dirs.checkpoint}")
    assert source.weights == dirs.checkpoint
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = dirs.original(input_ids=ids).logits
        for seed in (0, 5):  # the weights, not the seed, decide the model
            got, _ = build_hf_model(source.config, seed, weights=source.weights).eval()(ids)
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    # sha256 over the safetensors files' names and bytes, in name order
    files = sorted(dirs.checkpoint.glob("*.safetensors"))
    assert [f.name for f in files] == ["model.safetensors"]
    digest = hashlib.sha256(b"".join(f.name.encode() + b"\x00" + f.read_bytes() for f in files)).hexdigest()
    recipe = recipe_for(f"hf:{dirs.checkpoint}")
    assert recipe.weights_sha256 == weights_digest(dirs.checkpoint) == digest
    assert recipe.weights_sha256 != weights_digest(dirs.other)
    assert recipe.model_config == source.config == read_source(f"hf:{dirs.config_only}").config


def test_a_joiner_loads_the_swarms_weights_only_from_the_same_checkpoint_and_else_must_download(dirs) -> None:
    from node.cli.main import parse_node_config
    from node.net.records import PeerRecord
    from node.swarm.joining import judge_steps
    from node.swarm.loop import build_swarm_model, local_weights

    recipe = recipe_for(f"hf:{dirs.checkpoint}")
    assert local_weights(f"hf:{dirs.checkpoint}", recipe) == dirs.checkpoint
    # the default model, a preset, a config without weights and other weights of the same config: the
    # joiner lacks the swarm's weights (start_training sets must_download when it is not resuming)
    for own in ("moe", "hf-tiny-llama", f"hf:{dirs.config_only}", f"hf:{dirs.other}"):
        assert local_weights(own, recipe) is None, own
    # a swarm that starts from a random init needs no weights, whatever the joiner's --model
    assert local_weights(f"hf:{dirs.checkpoint}", recipe_for(f"hf:{dirs.config_only}")) is None

    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = dirs.original(input_ids=ids).logits
        for own, from_weights in ((f"hf:{dirs.checkpoint}", True), ("moe", False), (f"hf:{dirs.other}", False)):
            settings = parse_node_config(["node", "--model", own], {}).training  # the joiner's own --model
            logits, _ = build_swarm_model(settings, recipe).eval()(ids)
            assert torch.allclose(logits, expected, atol=1e-6, rtol=0) is from_weights, own

    # must_download: catch_up looks for any live peer ahead of step -1, so a founder still at step 0 is
    # downloaded from; without it a joiner at step 0 would not download from a peer at step 0
    def record(peer: str, step: int) -> PeerRecord:
        return PeerRecord(peer_id=peer, maddrs=(f"/ip4/127.0.0.1/tcp/1/p2p/{peer}",), step=step, round=0, experts=(),
                          capacity=0, version="0", heartbeat=0.0)

    view = [record("me", 0), record("founder", 0)]
    assert judge_steps(view, "me", step=0, margin=0, budget=100) is None
    judged = judge_steps(view, "me", step=0, margin=-1, budget=100)
    assert judged is not None and [r.peer_id for r in judged.candidates] == ["founder"]


def test_a_joiner_that_got_no_parameters_for_pretrained_weights_exits_2_with_one_line(dirs, capsys) -> None:
    from node.runtime.serve import _run
    from node.runtime.training import train_until

    recipe = recipe_for(f"hf:{dirs.checkpoint}")
    caught_up: list[int] = []

    class NoPeerServed:
        """A SwarmLoop whose catch-up found no peer to download from: must_download stays set."""

        must_download = True
        trainer = SimpleNamespace(step=0)

        def __init__(self) -> None:
            self.recipe = recipe

        async def catch_up(self, stop, margin: int, look: bool, epoch=None) -> None:
            caught_up.append(margin)

        async def wait_for_quorum(self, stop) -> None:  # pragma: no cover - reached only if the check is gone
            raise AssertionError("trained from a random init instead of the swarm's pretrained weights")

    async def main() -> int:
        runtime = SimpleNamespace(swarm_eval=object(), founding=False)
        settings = SimpleNamespace(max_staleness=2, clock=SimpleNamespace(epoch=None))
        await train_until(asyncio.Event(), runtime, NoPeerServed(), settings, Path("unused"))
        return 0

    assert _run(main) == 2
    assert caught_up, "the joiner tried to catch up first"
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"murmur: error: the swarm starts from pretrained weights (sha256 {recipe.weights_sha256}) that "
                     "this node does not have, and no peer served the swarm's parameters; start it with "
                     "--model hf:PATH of that checkpoint"]
