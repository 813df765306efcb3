"""The swarm documents and config hashes of the demo's and the docs' command lines, pinned: moving or
simplifying the configuration code must leave every published recipe byte for byte as it was.
Regenerate `tests/data/recipe_golden.json` only for a deliberate format change:
`python -m tests.test_recipe_golden` (and say why in the commit)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

GOLDEN = Path(__file__).parent / "data" / "recipe_golden.json"
EPOCH = 1234.5

# The founder's command lines: what `murmur demo` starts (its recipe flags; node.cli.demo.node_args),
# and the `murmur node` examples of README.md and docs/training.md.
COMMAND_LINES = (
    "--model moe --steps 100 --topology one-peer-exp --optimizer dadam --batch-size 16 --seed 0",
    "--model moe --steps 100 --topology one-peer-exp --optimizer dsgd --batch-size 16 --seed 0",
    "--model moe --steps 100 --topology one-peer-exp --optimizer diloco --batch-size 16 --local-steps 20 --seed 0",
    "--model moe --steps 100 --topology one-peer-exp --optimizer dadam --batch-size 16 --spes --spes-sync-every 10 "
    "--seed 0",
    # the demo's SPES line before S and M defaulted to 50: the same document as then
    "--model moe --steps 100 --topology one-peer-exp --optimizer dadam --batch-size 16 --spes --spes-sync-every 1 "
    "--spes-merge-every 10 --seed 0",
    "--model hf-tiny-llama --steps 30 --topology one-peer-exp --optimizer dadam --batch-size 16 --seed 0",
    "--model dense --steps 100 --topology ring --optimizer dadam --batch-size 16 --codec int8 --seed 0",
    "",
    "--admission open",
    "--topology ring --gossip-compression choco --codec int8 --mixing weighted",
    "--topology ring --gossip-compression choco --codec topk --topk-ratio 0.0125 --topk-elias-fano --mixing weighted",
    "--optimizer diloco --local-steps 100 --codec int8 --overlap",
    "--optimizer diloco --local-steps 10 --fragments 2 --outer-lr 0.7 --outer-momentum 0.9 --anchor-every 2 "
    "--codec topk --topk-ratio 0.01",
    "--optimizer diloco --local-steps 20 --inner-optimizer sgd --final-merge on",
    "--model vector --dim 64 --topology ring",
)


def documents() -> dict[str, dict[str, Any]]:
    """Each command line's swarm document at a fixed epoch, with its config hash."""
    from node.cli.main import build_parser, node_config_from_args
    from node.net.records import config_hash
    from node.runtime.founding import swarm_document

    parser = build_parser()
    out = {}
    for line in COMMAND_LINES:
        args = parser.parse_args(["node", *shlex.split(line)])
        document = swarm_document(node_config_from_args(args, {}), EPOCH)
        out[line] = {"document": document, "config_hash": config_hash(document)}
    return out


@pytest.mark.unit
def test_the_recipes_of_the_demo_and_the_docs_keep_their_bytes_and_hashes() -> None:
    golden = json.loads(GOLDEN.read_text())
    now = json.loads(json.dumps(documents()))
    assert sorted(now) == sorted(golden), "the command lines changed: regenerate the golden file deliberately"
    for line, pinned in golden.items():
        assert now[line]["document"] == pinned["document"], line
        assert now[line]["config_hash"] == pinned["config_hash"], line


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps(documents(), indent=1, sort_keys=True) + "\n")
    sys.exit(0)
