"""The names --model takes without an import path, and the pattern every model name matches: the
models' own vocabulary, which the config's --model setting and the swarm's recipe both check against.

Kept out of node/train/models/ because importing that package imports torch, and the config (so every
`murmur` command) reads these names."""

from __future__ import annotations

from enum import StrEnum


class Model(StrEnum):
    """The models --model names without an import path."""

    MOE = "moe"
    DENSE = "dense"
    VECTOR = "vector"  # no model: gossip a random vector of `dim` floats (tests, demos of the gossip alone)


EMBEDDED_MODEL_NAMES = (Model.MOE, Model.DENSE)
# Tiny Hugging Face configs built with transformers (node.train.models.hf.PRESETS); hf:PATH names others
HF_PRESET_NAMES = ("hf-tiny-llama", "hf-tiny-mixtral")
HF_DENSE_PRESETS = ("hf-tiny-llama",)
VECTOR_MODEL = Model.VECTOR
# An embedded model, `vector`, a preset, hf:PATH, or a user builder named by import path (imported when the
# node starts).
MODEL_NAME_PATTERN = "|".join((*EMBEDDED_MODEL_NAMES, VECTOR_MODEL, *HF_PRESET_NAMES, r"hf:.+", r"[\w.]+:[\w.]+"))
