"""Models a swarm trains, and the shared/expert parameter partition SPES syncs by.

The embedded GPT (dense or mixture-of-experts), Hugging Face causal LMs (node.train.models.hf, imported
only when one is built) and user models by import path."""

from node.train.models.evaluate import mean_cross_entropy
from node.train.models.factory import (
    EMBEDDED_MODELS,
    ModelFactory,
    build_named_model,
    is_hf_model,
    load_model_factory,
    model_context,
    model_vocab_size,
)
from node.train.models.gpt import DEFAULT, DENSE_DEFAULT, GPT, ModelConfig, MoE, Routing, build_model
from node.train.models.params import expert_parameter_names, shared_parameter_names

__all__ = [
    "DEFAULT",
    "DENSE_DEFAULT",
    "EMBEDDED_MODELS",
    "GPT",
    "MoE",
    "ModelConfig",
    "ModelFactory",
    "Routing",
    "build_model",
    "build_named_model",
    "expert_parameter_names",
    "is_hf_model",
    "load_model_factory",
    "mean_cross_entropy",
    "model_context",
    "model_vocab_size",
    "shared_parameter_names",
]
