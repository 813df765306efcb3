"""Models by name: the embedded ones ("moe", "dense") or a user builder named by import path
("package.module:build"), all built from a seed."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from node.train.model_names import HF_PRESET_NAMES
from node.train.models.gpt import DEFAULT, DENSE_DEFAULT, ModelConfig, build_model


def is_hf_model(name: str) -> bool:
    """A Hugging Face preset or hf:PATH (node.train.models.hf, imported only to build one)."""
    return name in HF_PRESET_NAMES or name.startswith("hf:")


def model_context(model: nn.Module) -> int | None:
    """The longest sequence a model takes, where it says (the embedded GPT's config, a Hugging Face model)."""
    context = getattr(model, "context", None) or getattr(getattr(model, "config", None), "context", None)
    return int(context) if isinstance(context, int) else None


def model_vocab_size(model: nn.Module) -> int | None:
    vocab = getattr(model, "vocab_size", None) or getattr(getattr(model, "config", None), "vocab_size", None)
    return int(vocab) if isinstance(vocab, int) else None

EMBEDDED_MODELS: Mapping[str, ModelConfig] = MappingProxyType({"moe": DEFAULT, "dense": DENSE_DEFAULT})

ModelFactory = Callable[[Mapping[str, Any] | None], nn.Module]


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _takes_options(path: str, builder: Callable[..., Any]) -> bool:
    """Whether the builder takes one argument (a dict of options) rather than none."""
    try:
        parameters = inspect.signature(builder).parameters.values()
    except (TypeError, ValueError):
        return False  # no introspectable signature (some builtins): call it without arguments
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    required = [p for p in positional if p.default is p.empty and p.kind is not p.VAR_POSITIONAL]
    if len(required) > 1:
        raise ValueError(f"model {path!r} must take no arguments or one dict of options")
    return bool(positional)


def load_model_factory(path: str) -> ModelFactory:
    """Import the builder named by `path` ("package.module:callable", the callable may be dotted).
    Every problem with the path is a ValueError with a one-line message."""
    module_name, colon, attribute = path.partition(":")
    if not colon or not module_name or not attribute:
        raise ValueError(f"model {path!r} is not of the form package.module:callable")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # anything the user's module raises while importing
        raise ValueError(f"model {path!r}: cannot import {module_name!r}: {_first_line(exc)}") from exc
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ValueError(f"model {path!r}: {module_name!r} has no attribute {attribute!r}") from None
    if not callable(target):
        raise ValueError(f"model {path!r}: {attribute!r} is not callable")
    builder: Callable[..., Any] = target
    takes_options = _takes_options(path, builder)

    def build(options: Mapping[str, Any] | None = None) -> nn.Module:
        if takes_options:
            model = builder(dict(options or {}))
        elif options:
            raise ValueError(f"model {path!r} takes no options, got {', '.join(sorted(options))}")
        else:
            model = builder()
        if not isinstance(model, nn.Module):
            raise ValueError(f"model {path!r} returned {type(model).__name__}, not a torch.nn.Module")
        return model

    return build


def build_named_model(name: str, seed: int = 0, options: Mapping[str, Any] | None = None) -> nn.Module:
    """An embedded model ("moe", "dense"; `options` override config fields), a Hugging Face model (a
    preset or hf:PATH; `options` is its config document, node.train.models.hf) or a user model by
    import path. Embedded and Hugging Face models are bit-identical for a seed on every machine; a user
    model is built under torch.manual_seed(seed), identical wherever torch's RNG is (same torch version
    and CPU kind)."""
    if is_hf_model(name):
        from node.train.models.hf import build_hf_model, read_source

        return build_hf_model(options if options is not None else read_source(name).config, seed)
    if name in EMBEDDED_MODELS:
        config = ModelConfig.from_dict({**EMBEDDED_MODELS[name].to_dict(), **(options or {})})
        return build_model(config, seed=seed)
    if ":" not in name:
        raise ValueError(f"unknown model {name!r}: use one of {', '.join(EMBEDDED_MODELS)} or package.module:callable")
    factory = load_model_factory(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory(options)
