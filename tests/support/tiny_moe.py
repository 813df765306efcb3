"""A tiny mixture-of-experts model named by import path (`--model tiny_moe:build`, with tests/ on
PYTHONPATH): the SPES multi-process tests train it through the daemon in seconds."""

from node.train.models import ModelConfig, build_model

TINY_MOE = ModelConfig(context=32, layers=2, width=32, heads=4, experts=4, top_k=2, expert_hidden=64)


def build():
    return build_model(TINY_MOE)
