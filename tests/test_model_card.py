"""An export's model card (node.swarm.model_card) and the byte vocabulary's tokenizer.json
(node.train.tokenizer.byte_tokenizer_json): the card is YAML front matter plus the recipe's facts,
deterministic in its inputs; the tokenizer gives murmur's byte ids exactly."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.unit


def recipe_and_doc(flags: list[str]) -> tuple[Any, dict[str, Any]]:
    from node.cli.main import parse_node_config
    from node.runtime.founding import swarm_document
    from node.swarm.recipe import SwarmSettings

    doc = swarm_document(parse_node_config(["node", *flags], {}), 1.0)
    recipe = SwarmSettings.from_doc(doc).training
    assert recipe is not None
    return recipe, doc


def split_card(text: str) -> tuple[dict[str, Any], str]:
    yaml = pytest.importorskip("yaml")
    assert text.startswith("---\n")
    front, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(front), body


def test_a_swarm_averages_card_names_its_peers_with_equal_shares_and_the_recipe() -> None:
    from node.swarm.model_card import ModelFacts, model_card

    recipe, doc = recipe_and_doc(["--model", "moe", "--optimizer", "diloco", "--batch-size", "8", "--context", "64",
                                  "--micro-batches", "2", "--topology", "ring", "--steps", "500"])
    manifest = {"kind": "average", "model": "moe", "swarm": "lab", "config_hash": "abc", "min_step": 90,
                "max_step": 100, "peers": ["peer-b", "peer-a", "peer-c", "peer-d"], "val_loss": 2.5,
                "written_by": "peer-b", "source": "/somewhere",
                "peer_steps": {"peer-a": 100, "peer-b": 95, "peer-c": 90, "peer-d": 99},
                "contributors": {"peer-a": 3000, "peer-b": 1000, "peer-c": 1000, "peer-d": 5000}}
    facts = ModelFacts("murmur's `moe`", 1234567, False, "bytes (256 ids, id = UTF-8 byte)")
    text = model_card(recipe, manifest, facts, doc)
    assert text == model_card(recipe, dict(manifest), facts, doc)  # deterministic
    front, body = split_card(text)
    assert "library_name" not in front  # the embedded model is not a transformers model
    assert front["tags"][:2] == ["murmur", "decentralized-training"] and "diloco" in front["tags"]
    for wanted in ("# moe, trained by the murmur swarm `lab`", "- parameters: 1,234,567", "- optimizer: `diloco`",
                   "- topology: `ring`", "- DiLoCo: inner", "- steps: 90-100 (the averaged peers' steps) of a budget of 500",
                   f"- tokens: {100 * 8 * 64 * 2:,} per node", "- config hash: `abc`", "- validation loss: 2.5000",
                   "The swarm average over 4 peer(s), taken by `peer-b`", "| `peer-a` | 100 | 25.0% |", "| `peer-c` | 90 | 25.0% |",
                   "| `peer-d` | 5,000 | 50.0% |", "| `peer-a` | 3,000 | 30.0% |", "| `peer-b` | 1,000 | 10.0% |",
                   "4 contributor(s) processed 10,000 training tokens", "held to its step times the tokens per step"):
        assert wanted in body, wanted
    assert "/somewhere" not in text  # where the export was read from is not the model's business
    # most tokens first; equal counts in peer id order, whatever order the file gave
    assert body.index("| `peer-d` | 5,000") < body.index("| `peer-a` | 3,000") < body.index("| `peer-b` | 1,000") \
        < body.index("| `peer-c` | 1,000")
    reordered = {**manifest, "contributors": dict(reversed(list(manifest["contributors"].items())))}
    assert model_card(recipe, reordered, facts, doc) == text


def test_the_periodic_swarm_average_kind_is_an_average_too() -> None:
    from node.swarm.model_card import ModelFacts, model_card

    recipe, doc = recipe_and_doc(["--model", "dense"])
    facts = ModelFacts("LlamaForCausalLM", 10, True, "bytes")
    front, body = split_card(model_card(recipe, {"kind": "swarm-average", "min_step": 5, "max_step": 5,
                                                 "peers": ["x"], "swarm": "s", "config_hash": "h"}, facts, doc))
    assert front["library_name"] == "transformers" and "| `x` | not recorded | 100.0% |" in body and "- steps: 5 (no step budget)" in body
    _, body = split_card(model_card(recipe, {"kind": "checkpoint", "step": None}, facts, None))
    assert "- tokens: unknown" in body and "one node's own checkpoint" in body
    assert "No tokens per peer were recorded" in body


def test_the_byte_tokenizer_json_gives_murmurs_byte_ids_and_decodes_back() -> None:
    from node.train.tokenizer import BpeTokenizer, ByteTokenizer, byte_tokenizer_json

    data = byte_tokenizer_json()
    assert data == byte_tokenizer_json()
    tokenizer = BpeTokenizer(data)
    assert tokenizer.vocab_size == 256 and tokenizer.eos_id is None  # as the byte tokenizer: no special token
    texts = ["plain ASCII, spaces  and\ttabs\n", "grüße, naïve café — 日本語 🎉", "\x00\x7f", "", " leading space"]
    assert tokenizer.encode_batch(texts) == ByteTokenizer().encode_batch(texts)
    assert all(tokenizer.decode(ids) == text for ids, text in zip(tokenizer.encode_batch(texts), texts, strict=True))
    assert sorted(tokenizer.tokenizer.get_vocab().values()) == list(range(256))
