"""Models a swarm trains: the embedded GPT (dense or mixture-of-experts), user models by import path,
and the shared/expert parameter partition SPES syncs by."""

from node.training.models.evaluate import mean_cross_entropy
from node.training.models.factory import EMBEDDED_MODELS, ModelFactory, build_named_model, load_model_factory
from node.training.models.gpt import DEFAULT, DENSE_DEFAULT, GPT, ModelConfig, MoE, Routing, build_model
from node.training.models.params import expert_parameter_names, shared_parameter_names

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
    "load_model_factory",
    "mean_cross_entropy",
    "shared_parameter_names",
]
