"""A user model named by import path (`--model tiny_model:build`, with tests/ on PYTHONPATH): the
multi-process training tests use it to train in seconds, and it exercises the import-path route."""

from node.models import ModelConfig, build_model

TINY = ModelConfig(context=32, layers=2, width=64, heads=4, experts=0, expert_hidden=128)


def build():
    return build_model(TINY)
