"""The update rules of decentralized training, without networking: the learning-rate schedule, gradient
clipping, the local SGD and Adam directions, and the consensus distance a gossip round reveals.

Arrays may be numpy arrays or torch tensors (anything with numpy-style arithmetic operators); state is
updated in place with augmented assignment, which both libraries do without copies. How the rules fit
together (D-SGD, DAdam) is in docs/training.md; the loop that runs them is node/train/trainer.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import numpy as np

from gossip.knobs import DILOCO_LOCAL_STEPS, MAX_STEPS
from gossip.mixing import effective_weights

Algorithm = Literal["dsgd", "dadam", "diloco"]
ALGORITHMS: tuple[Algorithm, ...] = ("dsgd", "dadam", "diloco")
# the algorithms whose local direction is Adam's (diloco: the inner AdamW of gossip DiLoCo)
ADAM_ALGORITHMS: tuple[Algorithm, ...] = ("dadam", "diloco")
Decay = Literal["cosine", "constant"]
DECAYS: tuple[Decay, ...] = ("cosine", "constant")

# numpy.ndarray or torch.Tensor; kept untyped so this module imports neither torch nor a protocol for both.
Array = Any


@dataclass(frozen=True)
class LRSchedule:
    """Linear warm-up from lr/warmup_steps to `lr` over the first `warmup_steps` steps, then (for
    `decay="cosine"`) a half cosine down to `lr * min_lr_ratio` at `total_steps`, flat after it."""

    lr: float
    warmup_steps: int = 0
    decay: Decay = "cosine"
    total_steps: int | None = None  # None: no decay after warm-up
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be finite and > 0, got {self.lr!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps!r}")
        if self.decay not in DECAYS:
            raise ValueError(f"unknown lr decay {self.decay!r}; expected one of {DECAYS}")
        if self.total_steps is not None and self.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {self.total_steps!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")

    def lr_at(self, step: int) -> float:
        """The learning rate of step `step` (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.decay == "constant" or self.total_steps is None:
            return self.lr
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        floor = self.lr * self.min_lr_ratio
        return floor + 0.5 * (self.lr - floor) * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class OptimizerConfig:
    """Everything that decides how a node updates its parameters.

    - ``dsgd``: `local_steps` (H) SGD steps, then one gossip round on the result (adapt, then combine).
    - ``dadam``: Adam moments stay local; a round's exchange of x_t runs while g(x_t) is computed and
      x_{t+1} = mix(x_t) - lr * AdamDirection(g(x_t)); with H > 1 only every H-th step mixes. With
      `adam_accumulate` K > 1 the direction is AccumAdam's (`accum_adam_step`): the moments advance once
      per K steps on the K steps' mean gradient, which lowers the variance of small local batches.
    - ``diloco``: H local AdamW steps (the inner optimizer), then an outer Nesterov step on the gossip-mixed
      pseudo-gradient (gossip.diloco; the outer knobs are a DilocoConfig beside this one).
    Each runs without a swarm as the single-process baseline (SGD or Adam with the same schedule).
    """

    algorithm: Algorithm = "dadam"
    lr: float = 3e-3
    warmup_steps: int = 0
    decay: Decay = "cosine"
    total_steps: int | None = None
    min_lr_ratio: float = 0.1
    clip_norm: float | None = 1.0  # max global L2 norm of the gradient; None: no clipping
    local_steps: int = 1  # H: steps between gossip rounds
    micro_batches: int = 1  # k: gradients averaged per step (gradient accumulation)
    momentum: float = 0.0  # dsgd's local SGD; 0 is plain (momentum-free) SGD
    betas: tuple[float, float] = (0.9, 0.999)  # dadam
    eps: float = 1e-8  # dadam
    weight_decay: float = 0.0  # decoupled (AdamW-style): direction += weight_decay * x
    # K: dadam's AccumAdam (Decent-DP): the moments take the mean gradient of each K steps; 1 is plain Adam
    adam_accumulate: int = 1

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown optimizer algorithm {self.algorithm!r}; expected one of {ALGORITHMS}")
        LRSchedule(self.lr, self.warmup_steps, self.decay, self.total_steps, self.min_lr_ratio)  # validates them
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0 (or None for no clipping), got {self.clip_norm!r}")
        if self.local_steps < 1:
            raise ValueError(f"local_steps must be >= 1, got {self.local_steps!r}")
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {self.micro_batches!r}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum!r}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps!r}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.adam_accumulate < 1:
            raise ValueError(f"adam_accumulate must be >= 1, got {self.adam_accumulate!r}")
        if self.adam_accumulate > 1 and self.algorithm != "dadam":
            raise ValueError(f"adam_accumulate (AccumAdam) is an option of dadam, not of {self.algorithm!r}")

    @property
    def schedule(self) -> LRSchedule:
        return LRSchedule(self.lr, self.warmup_steps, self.decay, self.total_steps, self.min_lr_ratio)

    def mixes_after(self, step: int) -> bool:
        """Whether step `step` (0-based) ends with a gossip round: every `local_steps`-th step."""
        return (step + 1) % self.local_steps == 0


# The swarm document's caps (a node's own settings have none): they keep a hostile or mistaken founder from
# making every node step absurdly far, sync after an absurd period or hold absurdly many gradients.
MAX_LR = 10.0
MAX_LOCAL_STEPS = 10_000
MAX_MICRO_BATCHES = 1024
MAX_ADAM_ACCUMULATE = 1024
_NO_CAP = {"le": None}  # a node's own setting: `setting_bounds` without the document's cap


class OptimizerSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """The optimizer's knobs every node of a swarm shares (D-SGD, DAdam; DiLoCo's inner loop), each declared
    once (gossip.knobs, as gossip.diloco.DilocoSettings): the swarm document's part
    (node.swarm.recipe.OptimizerDoc subclasses this Struct and adds `diloco`) and the node's settings table
    rows `training.<setting>` with their flags and variables (node.config.table, which places each row
    where it stands in `--help`), hence docs/cli.md's table and `murmur plan`'s flags (add_knob_flag).

    Only adam_accumulate has a document default: the others are written in every document (a default
    would leave them out and change the config hash), and a node's defaults are OptimizerConfig's and
    node.config's. The document caps each count and the lr; a node's own setting is not capped
    (`setting_bounds`). OptimizerConfig keeps its own checks and messages."""

    # the type stays the bare Literal (ALGORITHMS, checked as written), so its Meta is in FIELD_META
    algorithm: Algorithm
    lr: Annotated[float, msgspec.Meta(
        gt=0.0, le=MAX_LR, extra={"metavar": "LR", "setting_bounds": _NO_CAP},
        description="peak learning rate (the swarm's)",
    )]
    # the variable's name is older than the derived MURMUR_WARMUP_STEPS
    warmup_steps: Annotated[int, msgspec.Meta(
        ge=0, le=MAX_STEPS, extra={"env": "MURMUR_WARMUP", "setting_bounds": _NO_CAP},
        description="linear learning-rate warm-up steps (the swarm's)",
    )]
    local_steps: Annotated[int, msgspec.Meta(
        ge=1, le=MAX_LOCAL_STEPS, extra={"noun": "local steps", "setting_bounds": _NO_CAP},
        description="H: optimizer steps between gossip rounds; unset with --optimizer diloco: "
        f"{DILOCO_LOCAL_STEPS} (the swarm's)",
    )]
    micro_batches: Annotated[int, msgspec.Meta(
        ge=1, le=MAX_MICRO_BATCHES, extra={"noun": "micro-batches", "setting_bounds": _NO_CAP},
        description="k: micro-batches accumulated per step (the swarm's)",
    )]
    # dadam's AccumAdam block length K (accum_adam_step); absent from a document: 1, plain DAdam
    adam_accumulate: Annotated[int, msgspec.Meta(
        ge=1, le=MAX_ADAM_ACCUMULATE, extra={"noun": "AccumAdam steps", "metavar": "K", "setting_bounds": _NO_CAP},
        description="dadam: AccumAdam (Decent-DP) - the Adam moments advance once per K steps on the K steps' "
        "mean gradient, for small local batches; one more parameter-sized buffer of optimizer state; 1: plain "
        "DAdam (the swarm's)",
    )] = OptimizerConfig.adam_accumulate

    FIELD_META: ClassVar[Mapping[str, msgspec.Meta]] = {"algorithm": msgspec.Meta(
        extra={"metavar": "OPTIMIZER", "noun": "optimizer", "setting": "optimizer"},
        description="dsgd (adapt-then-combine), dadam (decentralized Adam, exchange overlapped with compute) or "
        "diloco (gossip DiLoCo: --local-steps of local AdamW, then an outer Nesterov step on the "
        "pseudo-gradients mixed with the neighbours); a joiner takes the swarm's",
    )}


# ---- gradient clipping ---------------------------------------------------------------------------


def global_norm(grads: Iterable[Array]) -> float:
    """The L2 norm of all arrays together, summed in float64."""
    return math.sqrt(math.fsum(_squared_sum(g) for g in grads))


def _squared_sum(x: Array) -> float:
    if hasattr(x, "double"):  # torch.Tensor
        return float(x.double().square().sum())
    return float(np.square(x, dtype=np.float64).sum())


def clip_factor(norm: float, max_norm: float | None) -> float:
    """What to multiply the gradients by so their global norm is at most `max_norm` (1.0 when it
    already is, or when clipping is off); 0.0 for a non-finite norm, so a blown-up step changes nothing."""
    if not math.isfinite(norm):
        return 0.0
    if max_norm is None or norm <= max_norm:
        return 1.0
    return max_norm / (norm + 1e-6)


# ---- local update directions ---------------------------------------------------------------------


def _zeros_like(x: Array) -> Array:
    return x.new_zeros(x.shape) if hasattr(x, "new_zeros") else np.zeros_like(x)


def _sqrt(x: Array) -> Array:
    return x.sqrt() if hasattr(x, "sqrt") else np.sqrt(x)


def accum_adam_step(m: Array, v: Array, accum: Array, grad: Array, count: int, accumulate: int,
                    betas: tuple[float, float], eps: float) -> tuple[Array, bool]:
    """One step of AccumAdam, the accumulated Adam of Decent-DP (Wang et al., ICLR 2025), in place.

    With K = `accumulate`, t = `count` (this step, 1-based) and b = ceil(t / K) (the block it is in):

        A     += g_t / K                                  (the block's mean gradient, once complete)
        m_hat  = beta1 * m + (1 - beta1) * g_t            (m, v: EMAs of the completed blocks' A)
        v_hat  = beta2 * v + (1 - beta2) * g_t**2
        d_t    = (m_hat / (1 - beta1**b)) / (sqrt(v_hat / (1 - beta2**b)) + eps)
        at the end of a block (t % K == 0):  m = beta1 * m + (1 - beta1) * A,  v = beta2 * v + (1 - beta2) * A**2

    Returns (d_t, whether t ends a block); the caller zeroes `accum` at a block's end. The moments'
    history is made of K-step means (K times less gradient noise, no extra compute); each step's own
    gradient still enters its direction. K = 1 is Adam exactly (torch.optim.Adam's direction).
    """
    beta1, beta2 = betas
    accum += grad * (1.0 / accumulate)
    blocks = -(-count // accumulate)
    m_hat = beta1 * m + (1.0 - beta1) * grad
    v_hat = beta2 * v + (1.0 - beta2) * grad * grad
    direction = (m_hat / (1.0 - beta1**blocks)) / (_sqrt(v_hat) / math.sqrt(1.0 - beta2**blocks) + eps)
    end_of_block = count % accumulate == 0
    if end_of_block:
        m *= beta1
        m += (1.0 - beta1) * accum
        v *= beta2
        v += (1.0 - beta2) * accum * accum
    return direction, end_of_block


def _zero(x: Array) -> None:
    if hasattr(x, "zero_"):
        x.zero_()
    else:
        x.fill(0)


@dataclass
class _AdamMoments:
    m: Array
    v: Array
    count: int = 0
    accum: Array | None = None  # AccumAdam's running sum of g / K over the current block of K steps


@dataclass
class LocalOptimizer:
    """Per-parameter local state (SGD momentum buffers or Adam moments) and the direction d such that
    the update is x <- base - lr * d (base is x itself for a local step, the gossip mix for DAdam).

    Adam with these directions is exactly torch.optim.Adam (and AdamW for weight decay); with
    `adam_accumulate` K > 1 it is AccumAdam (`accum_adam_step`, one more buffer per parameter); SGD with
    momentum is torch.optim.SGD's heavy ball. State is created on first use, keyed by parameter name.
    """

    config: OptimizerConfig
    _momentum: dict[str, Array] = field(default_factory=dict)
    _adam: dict[str, _AdamMoments] = field(default_factory=dict)

    def direction(self, name: str, grad: Array, param: Array) -> Array:
        """The direction for one parameter; advances that parameter's state by one step."""
        c = self.config
        if c.algorithm in ADAM_ALGORITHMS:
            d = self._adam_direction(name, grad)
        elif c.momentum:
            buffer = self._momentum.get(name)
            if buffer is None:
                buffer = self._momentum[name] = grad * 1  # a copy: torch.optim.SGD's first buffer is g
            else:
                buffer *= c.momentum
                buffer += grad
            d = buffer
        else:
            d = grad
        if c.weight_decay:
            d = d + c.weight_decay * param
        return d

    def _adam_direction(self, name: str, grad: Array) -> Array:
        accumulate = self.config.adam_accumulate
        state = self._adam.get(name)
        if state is None:
            state = self._adam[name] = _AdamMoments(_zeros_like(grad), _zeros_like(grad))
        if accumulate > 1:
            return self._accum_adam_direction(state, grad, accumulate)
        beta1, beta2 = self.config.betas
        state.count += 1
        state.m *= beta1
        state.m += (1.0 - beta1) * grad
        state.v *= beta2
        state.v += (1.0 - beta2) * grad * grad
        bias1 = 1.0 - beta1**state.count
        bias2 = 1.0 - beta2**state.count
        return (state.m / bias1) / (_sqrt(state.v) / math.sqrt(bias2) + self.config.eps)

    def _accum_adam_direction(self, state: _AdamMoments, grad: Array, accumulate: int) -> Array:
        """AccumAdam (accum_adam_step): the stored moments advance once per block of K steps."""
        if state.accum is None:
            state.accum = _zeros_like(grad)
        state.count += 1
        direction, end_of_block = accum_adam_step(state.m, state.v, state.accum, grad, state.count, accumulate,
                                                  self.config.betas, self.config.eps)
        if end_of_block:
            _zero(state.accum)
        return direction

    def state(self) -> dict[str, Array]:
        """The state as named arrays (for checkpoints): `<param>/momentum`, `<param>/adam_m`, `<param>/adam_v`,
        and AccumAdam's `<param>/adam_accum` (adam_accumulate > 1 only)."""
        out: dict[str, Array] = {f"{name}/momentum": buffer for name, buffer in self._momentum.items()}
        for name, moments in self._adam.items():
            out[f"{name}/adam_m"] = moments.m
            out[f"{name}/adam_v"] = moments.v
            if moments.accum is not None:
                out[f"{name}/adam_accum"] = moments.accum
        return out

    def state_counts(self) -> dict[str, int]:
        """Adam's per-parameter step counts (bias correction), for checkpoints."""
        return {name: moments.count for name, moments in self._adam.items()}

    def load_state(self, state: Mapping[str, Array], counts: Mapping[str, int]) -> None:
        """Replace the state with what `state()` and `state_counts()` returned (arrays are used as given)."""
        momentum: dict[str, Array] = {}
        first: dict[str, Array] = {}
        second: dict[str, Array] = {}
        accum: dict[str, Array] = {}
        for key, value in state.items():
            name, _, kind = key.rpartition("/")
            target = {"momentum": momentum, "adam_m": first, "adam_v": second, "adam_accum": accum}.get(kind)
            if target is None:
                raise ValueError(f"unknown optimizer state entry {key!r}")
            target[name] = value
        if first.keys() != second.keys() or not first.keys() <= counts.keys():
            raise ValueError("optimizer state: Adam moments and step counts do not name the same parameters")
        if not accum.keys() <= first.keys():
            raise ValueError("optimizer state: AccumAdam buffers of parameters without Adam moments")
        self._momentum = momentum
        self._adam = {name: _AdamMoments(first[name], second[name], int(counts[name]), accum.get(name))
                      for name in first}

    def state_bytes(self) -> int:
        """Memory the local state takes (what the swarm status reports as optimizer_state_bytes)."""
        return sum(int(x.nbytes) for x in self.state().values())


# ---- what a round tells about consensus ----------------------------------------------------------


def consensus_distance(
    own: Mapping[str, Array],
    mixed: Mapping[str, Array],
    self_weight: float,
    neighbour_weights: Mapping[str, float],
    arrived: Iterable[str],
) -> float | None:
    """||x_i - xbar||_2 over all tensors, xbar the weighted mean of the neighbour values that arrived
    in a round; None when none arrived.

    Derived from the round's input `own` and output `mixed` alone: a weighted mix is
    w_s * x_i + (1 - w_s) * xbar, with w_s the self weight after missing neighbours' weight moved
    to it, so x_i - xbar = (x_i - mix) / (1 - w_s). (Under a robust mixing rule this measures how
    far the robust mix moved, scaled the same way.)
    """
    arrived = tuple(arrived)
    if not arrived:
        return None
    self_w, _ = effective_weights(self_weight, neighbour_weights, arrived)
    if self_w >= 1.0:
        return None
    moved = global_norm(own[name] - mixed[name] for name in own)
    return moved / (1.0 - self_w)
