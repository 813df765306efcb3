"""The preflight: before the trainer is built, does the swarm's model fit this machine with the swarm's
algorithm? The memory model is gossip.footprint's; this module counts the model's parameters cheaply
(a Hugging Face config on the meta device, an embedded model on the meta device), reads this machine's
available RAM (/proc/meminfo) and free GPU memory, and refuses with one line that names the numbers and
what would fit (exit status 2, as every start-up error). It also settles this node's own choices the swarm
leaves to it: a SPES node given no --experts on a CPU trains every expert if they fit, else the most that
fit (`choose_capacity`); the batch size is the swarm's, the same on every node.

Test hook: MURMUR_MOCK_MACHINE_MEMORY="ram=2GiB,vram=0" stands in for this machine's memory (a GPU or a
small machine cannot exist in the tests); vram > 0 makes the node count as a CUDA node. Nothing else
reads it."""

from __future__ import annotations

import enum
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from gossip.footprint import Footprint, MemoryInputs, Where, footprint
from node.runtime.errors import StartupError
from node.swarm.recipe import SwarmSettings, TrainingRecipe
from node.train.machine import available_ram
from topology import TopologySpec, build_topology

logger = logging.getLogger("murmur.node")

MOCK_ENV = "MURMUR_MOCK_MACHINE_MEMORY"
GIB = 2**30
_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6,
          "gb": 10**9, "tb": 10**12}


@dataclass(frozen=True)
class Machine:
    ram: int  # bytes of RAM available
    vram: int | None  # bytes of free GPU memory; None: a CPU node


def parse_mock(text: str) -> Machine:
    """`ram=2GiB,vram=0` -> Machine (vram 0 or absent: a CPU node). ValueError on anything else."""
    values: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", value)
        if key.strip() not in ("ram", "vram") or match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(f"{MOCK_ENV}: expected ram=SIZE[,vram=SIZE] (e.g. ram=2GiB,vram=0), got {text!r}")
        values[key.strip()] = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if "ram" not in values:
        raise ValueError(f"{MOCK_ENV}: ram=SIZE is required, got {text!r}")
    return Machine(values["ram"], values.get("vram") or None)


def this_machine(device: str) -> Machine:
    """This machine's memory for a node on `device` (the mock's where the test hook sets it)."""
    mock = os.environ.get(MOCK_ENV)
    if mock:
        machine = parse_mock(mock)
        return replace(machine, vram=None) if device == "cpu" else machine
    import torch

    from node.train.trainer import resolve_device

    resolved = resolve_device(device)
    vram = int(torch.cuda.mem_get_info(resolved)[0]) if resolved.type == "cuda" else None
    return Machine(available_ram(), vram)


@dataclass(frozen=True)
class ModelSize:
    parameters: int
    expert_parameters: int = 0  # of them, in routed experts (`.experts.<i>.` in their names)
    experts_per_layer: int = 0


def parameter_split(recipe: TrainingRecipe) -> ModelSize | None:
    """The recipe's model's size, counted on the meta device (nothing allocated); None when the model
    cannot be built there (a user model: it is checked as it is built). Routed experts are found by
    name: `experts.<i>.` (one module per expert) or `experts.<proj>` of shape [experts, ...] (the
    fused layout transformers 5 builds, which murmur splits per expert when it builds the model)."""
    import torch

    from node.swarm.recipe import embedded_options
    from node.train.models.factory import build_named_model

    try:
        with torch.device("meta"):
            if recipe.model_config is not None:
                from node.train.models.hf import hf_config, transformers_module

                model = transformers_module().AutoModelForCausalLM.from_config(hf_config(recipe.model_config),
                                                                               trust_remote_code=False)
            else:
                model = build_named_model(recipe.model, seed=recipe.seed, options=embedded_options(recipe))
    except Exception as exc:  # a model the meta device cannot build is checked as it is built
        logger.debug("preflight: the model's size is not known before it is built: %s", exc)
        return None
    total = experts = per_layer = 0
    for name, p in model.named_parameters():
        total += p.numel()
        found = re.search(r"(?:^|\.)experts\.(\d+)\.", name)
        if found:  # one module per expert (the embedded MoE, murmur's split of a transformers MoE)
            experts += p.numel()
            per_layer = max(per_layer, int(found.group(1)) + 1)
        elif re.search(r"(?:^|\.)experts\.[A-Za-z_]+$", name) and p.dim() >= 3:  # transformers' fused experts
            experts += p.numel()
            per_layer = max(per_layer, int(p.shape[0]))
    return ModelSize(total, experts, per_layer)


def owned_share(size: ModelSize, device: str, wanted: int | None) -> float:
    """The share of the routed experts a SPES node trains: --experts of the layer's; without it every
    expert on a CPU node, and on CUDA at least one (the node sizes its capacity to the free GPU memory
    at start, node.algorithms.spes.swarm.capacity_for: the preflight checks that the least fits)."""
    if size.experts_per_layer == 0:
        return 1.0
    owned = wanted if wanted is not None else (size.experts_per_layer if device == "cpu" else 1)
    return min(owned, size.experts_per_layer) / size.experts_per_layer


# the swarm size the topology's neighbour counts are read at (the swarm's own size is not known at start)
TYPICAL_SWARM = 16


def neighbours(spec: TopologySpec) -> tuple[int, int]:
    """(the most values one round receives, the distinct neighbours over a period) of rank 0 of the
    swarm's topology at TYPICAL_SWARM peers; (2, 2), a ring's, where it cannot be built."""
    try:
        topology = build_topology(spec, TYPICAL_SWARM)
    except ValueError:
        return 2, 2
    rounds = [graph.in_degree(0) for graph in topology.period_graphs]
    distinct = {j for graph in topology.period_graphs for j in graph.out_neighbours(0)}
    return max(rounds, default=0), len(distinct)


def memory_inputs(parameters: int, experts: int, recipe: TrainingRecipe, settings: SwarmSettings,
                  device: str, capacity_share: float = 1.0, scoring: bool = False) -> MemoryInputs:
    """The footprint's inputs for the swarm's recipe on a `device` ("cpu" or "cuda") node; `scoring`: this
    node's contribution scoring is on (--score-every > 0)."""
    inner = recipe.inner_optimizer
    per_round, distinct = neighbours(settings.topology)
    common: dict[str, Any] = {
        "parameters": parameters, "device": device, "codec": settings.codec.name,
        "inner": "adam" if inner.algorithm in ("dadam", "adam") else "sgd", "momentum": inner.momentum,
        "max_staleness": settings.max_staleness, "in_neighbours": per_round, "scoring": scoring,
    }
    if settings.choco is not None:
        common.update(choco=True, choco_edges=min(settings.choco.max_edges, distinct))
    d = recipe.diloco
    if d is not None:
        return MemoryInputs(algorithm="diloco", fragments=d.fragments, overlap=d.overlap,
                            outer_momentum=d.outer_momentum, anchor_codec=d.anchor_codec,
                            anchor_every=d.anchor_every, **common)
    if recipe.spes is not None:
        return MemoryInputs(algorithm=recipe.optimizer.algorithm, spes=True, expert_parameters=experts,
                            owned_share=capacity_share, outer_momentum=0.0, anchor_codec=settings.codec.name,
                            frozen_bf16=recipe.spes.frozen_bf16, **common)
    return MemoryInputs(algorithm=recipe.optimizer.algorithm, **common)


def bytes_text(n: float) -> str:
    """Bytes as people read them in a line: GiB from 1 GiB up, else MiB."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def count_text(n: float) -> str:
    """A parameter count as people read it: 2.4M, 1.10B."""
    if n >= 1e8:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n / 1e3:.1f}K"


def _shortfalls(f: Footprint, inputs: MemoryInputs, machine: Machine) -> list[tuple[str, int, int, Where]]:
    """(what, needed, available, where) for each memory `f` exceeds on `machine`; empty when it fits."""
    short: list[tuple[str, int, int, Where]] = []
    if f.host_bytes > machine.ram:
        short.append(("RAM", f.host_bytes, machine.ram, Where.HOST))
    if inputs.device == "cuda" and machine.vram is not None and f.device_bytes > machine.vram:
        short.append(("GPU memory", f.device_bytes, machine.vram, Where.DEVICE))
    return short


def judge(inputs: MemoryInputs, machine: Machine, hints: Sequence[str] = ()) -> tuple[Footprint, str | None]:
    """The footprint, and why it does not fit `machine` (one line), or None when it fits. `hints` (what
    would fit, worked out by the caller) lead the line's suggestions."""
    f = footprint(inputs)
    short = _shortfalls(f, inputs, machine)
    if not short:
        return f, None
    name = "gossip DiLoCo" if inputs.algorithm == "diloco" else ("SPES" if inputs.spes else inputs.algorithm)
    if inputs.choco:
        name += " with CHOCO"
    what, needed, have, where = short[0]
    per = f.host_per_parameter if where is Where.HOST else f.device_per_parameter
    fits = min(machine.ram / max(f.host_per_parameter, 1e-9),
               machine.vram / max(f.device_per_parameter, 1e-9) if inputs.device == "cuda" and machine.vram else 1e30)
    line = (f"the swarm's model ({count_text(inputs.parameters)} parameters) with {name} needs ~{bytes_text(needed)} of {what} "
            f"here ({per:.0f} bytes per parameter: {', '.join(f.largest(where))}, ...), this machine has "
            f"{bytes_text(have)} available: a node here fits up to ~{count_text(fits)} parameters with this algorithm")
    others: list[tuple[bool, int, str]] = []  # (fits, RAM needed, what)
    for algorithm in ("dsgd", "dadam", "diloco"):
        other = replace(inputs, algorithm=algorithm, choco=False, spes=False, inner="sgd" if algorithm == "dsgd" else "adam")
        if algorithm == inputs.algorithm and not inputs.choco and not inputs.spes:
            continue
        g = footprint(other)
        ok = g.host_bytes <= machine.ram and (inputs.device != "cuda" or machine.vram is None
                                              or g.device_bytes <= machine.vram)
        needs = f"~{bytes_text(g.host_bytes)} of RAM" + (f" and ~{bytes_text(g.device_bytes)} of GPU memory"
                                                   if inputs.device == "cuda" else "")
        others.append((ok, g.host_bytes, f"{algorithm} would need {needs}"))
    fitting = [what.replace("would need", "fits with") for ok, _, what in others if ok]
    suggestions = [*hints, *((fitting or [min(others)[2]]) if others else [])]
    if inputs.scoring:
        unscored = replace(inputs, scoring=False)
        if not _shortfalls(footprint(unscored), unscored, machine):
            suggestions.insert(0, "--score-every 0 (no contribution scoring) fits")
    if not hints and inputs.spes and inputs.expert_parameters and inputs.owned_share >= 0.5:
        suggestions.append("SPES with fewer owned experts (--experts) needs less")
    others_text = "; ".join(suggestions)
    return f, line + ("; " + others_text if others_text else "")


class CapacityChoice(enum.StrEnum):
    """How a SPES node's capacity (experts per MoE layer it trains) was settled."""

    GIVEN = "given"  # --experts
    ALL = "all"  # no --experts on a CPU node: every expert, and they fit
    LARGEST_FITTING = "largest_fitting"  # no --experts, every expert does not fit: the most that do
    MEASURED = "measured"  # no --experts on CUDA: sized to the free GPU memory at start (the least fits)


@dataclass(frozen=True)
class Capacity:
    experts: int | None  # experts per MoE layer to train; None: sized to the free GPU memory at start
    choice: CapacityChoice


def choose_capacity(experts_per_layer: int, wanted: int | None, device: str, largest: int) -> Capacity:
    """A SPES node's capacity, given --experts (`wanted`), its device kind and the most experts per layer
    that fit this machine (`largest`, 0: not even one). The user's word stands (the preflight refuses it
    if it does not fit); a CUDA node is sized at start by measuring (node.algorithms.spes.swarm.capacity_for);
    a CPU node trains every expert, or the most that fit when every one does not (capacity is each
    node's own choice in a SPES swarm: the assignment follows the capacities peers publish)."""
    if wanted is not None:
        return Capacity(min(wanted, experts_per_layer), CapacityChoice.GIVEN)
    if device == "cuda":
        return Capacity(None, CapacityChoice.MEASURED)
    if 1 <= largest < experts_per_layer:
        return Capacity(largest, CapacityChoice.LARGEST_FITTING)
    return Capacity(experts_per_layer, CapacityChoice.ALL)


@dataclass(frozen=True)
class Fit:
    """What the preflight settled: the footprint on this machine, and this node's choices."""

    machine: Machine
    inputs: MemoryInputs
    footprint: Footprint
    batch_size: int  # the swarm's, the same on every node
    context: int
    experts_per_layer: int = 0  # 0: no SPES
    capacity: Capacity | None = None  # SPES's
    largest_fitting: int = 0  # SPES: the most experts per layer that fit here by the estimate

    def as_json(self) -> dict[str, Any]:
        """The status's `memory` object."""
        capacity = self.capacity
        return {**self.footprint.as_json(), "algorithm": self.inputs.algorithm, "device": self.inputs.device,
                "ram_available": self.machine.ram, "vram_available": self.machine.vram,
                "batch_size": self.batch_size, "context": self.context,
                "spes_capacity": None if capacity is None else {
                    "experts": capacity.experts, "of": self.experts_per_layer, "choice": capacity.choice.value,
                    "largest_fitting": self.largest_fitting}}


class DoesNotFit(StartupError):
    """The swarm's model (of `parameters`) does not fit this machine; the message names the numbers and
    what would fit."""

    def __init__(self, line: str, parameters: int) -> None:
        super().__init__(line)
        self.parameters = parameters


def _largest_fitting(size: ModelSize, recipe: TrainingRecipe, settings: SwarmSettings, device: str,
                     machine: Machine, scoring: bool) -> int:
    """The most experts per layer a SPES node here can train (0: not even one)."""
    for n in range(size.experts_per_layer, 0, -1):
        inputs = memory_inputs(size.parameters, size.expert_parameters, recipe, settings, device,
                               capacity_share=n / size.experts_per_layer, scoring=scoring)
        if not _shortfalls(footprint(inputs), inputs, machine):
            return n
    return 0


def check_fit(recipe: TrainingRecipe, settings: SwarmSettings, device: str,
              wanted_experts: int | None = None, scoring: bool = False) -> Fit | None:
    """Whether the swarm's model fits this machine with the swarm's algorithm, and this node's choices
    (SPES's capacity, `scoring`: its contribution scoring); DoesNotFit when it does not, None when the
    model cannot be counted cheaply."""
    try:
        machine = this_machine(device)
    except ValueError as exc:  # the mock's text, or a CUDA device torch does not see
        raise StartupError(str(exc) if str(exc).startswith(MOCK_ENV) else
                           f"cannot train the swarm's model here: {exc}") from None
    size = parameter_split(recipe)
    if size is None:
        return None
    kind = "cuda" if machine.vram is not None else "cpu"
    capacity, largest, hints = None, 0, []
    share = owned_share(size, kind, wanted_experts)
    if recipe.spes is not None and size.experts_per_layer:
        largest = _largest_fitting(size, recipe, settings, kind, machine, scoring)
        capacity = choose_capacity(size.experts_per_layer, wanted_experts, kind, largest)
        share = (capacity.experts or 1) / size.experts_per_layer
        if largest and capacity.experts is not None and capacity.experts > largest:
            hints.append(f"SPES with --experts {largest} (of {size.experts_per_layer} per layer) fits here")
    inputs = memory_inputs(size.parameters, size.expert_parameters, recipe, settings, kind, capacity_share=share,
                           scoring=scoring)
    f, refusal = judge(inputs, machine, hints)
    if refusal is not None:
        raise DoesNotFit(refusal, size.parameters)
    logger.info("preflight: %s parameters need ~%s of RAM (%.0f B/param) and ~%s of GPU memory (%.0f B/param); "
                "%s of RAM%s available", f"{size.parameters:,}", bytes_text(f.host_bytes), f.host_per_parameter,
                bytes_text(f.device_bytes), f.device_per_parameter, bytes_text(machine.ram),
                f", {bytes_text(machine.vram)} of GPU memory" if machine.vram is not None else "")
    return Fit(machine, inputs, f, recipe.batch_size, recipe.context, size.experts_per_layer if capacity else 0,
               capacity, largest)


def preflight(recipe: TrainingRecipe, settings: SwarmSettings, device: str,
              wanted_experts: int | None = None, scoring: bool = False) -> dict[str, Any] | None:
    """Refuse (DoesNotFit, a StartupError) a model that would not fit here with the swarm's algorithm; else
    log one line and return the footprint for the status (None when the model cannot be counted cheaply)."""
    fit = check_fit(recipe, settings, device, wanted_experts, scoring)
    return fit.as_json() if fit is not None else None


__all__ = [
    "MOCK_ENV",
    "Capacity",
    "CapacityChoice",
    "DoesNotFit",
    "Fit",
    "Machine",
    "ModelSize",
    "available_ram",
    "bytes_text",
    "check_fit",
    "choose_capacity",
    "count_text",
    "judge",
    "memory_inputs",
    "owned_share",
    "parameter_split",
    "parse_mock",
    "preflight",
    "this_machine",
]
