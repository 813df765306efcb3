"""Training on a node: a `Trainer` that owns a torch model, its local optimizer state and its data shard
and runs every step on its own worker thread (node.algorithms.dsgd combines it with a GossipPeer).

The model is only ever touched on the trainer's worker thread, so the event loop (gossip, heartbeats,
the monitor) never waits behind a forward pass, and a round's exchange can run while a gradient is
computed.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeVar

import numpy as np
import torch
from torch import nn

from gossip.optimizers import LocalOptimizer, OptimizerConfig, clip_factor, global_norm
from node.train.data import sample_batch, training_batch, validation_batches
from node.train.models import mean_cross_entropy, model_vocab_size
from node.train.staging import HostStaging

logger = logging.getLogger(__name__)

Precision = Literal["auto", "fp32", "bf16", "fp16"]
PRECISIONS: tuple[Precision, ...] = ("auto", "fp32", "bf16", "fp16")
Tensors = Mapping[str, np.ndarray]
T = TypeVar("T")

# fp16 dynamic loss scaling (as torch.amp.GradScaler): halve on overflow, double after a run of good steps.
INITIAL_LOSS_SCALE = 2.0**16
LOSS_SCALE_GROWTH_INTERVAL = 1000

# Checkpoint entry prefixes of Trainer.state().
_PARAM, _OPT, _COUNT = "param/", "optimizer/", "optimizer_count/"
_STEP, _SCALE, _WARM_FROM = "trainer/step", "trainer/loss_scale", "trainer/warm_from"
HELD_OUT_SEED = 20_251_206  # contribution scoring's held-out batches (Trainer._held_out)


class TrainBatches(Protocol):
    """A stream of training batches taken in order (node.train.shards.ShardStream), instead of
    random windows of an in-memory token tensor."""

    def train_batch(self, batch_size: int, context: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class TrainerConfig:
    """How a node trains. `optimizer`, `batch_size` and `context` are the swarm's recipe;
    `device` and `precision` are the node's own choice."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    batch_size: int = 16  # sequences per micro-batch; a step sees micro_batches * batch_size
    context: int = 128  # tokens per sequence (at most the model's context)
    device: str = "auto"  # "auto" (cuda when available), "cpu", "cuda", "cuda:1", ...
    precision: Precision = "auto"  # auto: bf16 (else fp16) autocast on CUDA, fp32 on CPU
    eval_batch_size: int = 32
    eval_batches: int | None = 8  # validation batches per evaluation; None: the whole validation split

    def __post_init__(self) -> None:
        for name in ("batch_size", "context", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer config: {name} must be >= 1, got {getattr(self, name)!r}")
        if self.eval_batches is not None and self.eval_batches < 1:
            raise ValueError(f"trainer config: eval_batches must be >= 1 or None, got {self.eval_batches!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"trainer config: precision must be one of {PRECISIONS}, got {self.precision!r}")


@dataclass(frozen=True)
class StepStats:
    """What computing one step's update found (before it is applied)."""

    step: int
    lr: float
    loss: float  # mean training loss over the step's micro-batches
    grad_norm: float  # global L2 norm before clipping
    skipped: bool  # non-finite gradient: the step changes nothing but the step counter
    compute_s: float


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA device")
    return resolved


def autocast_dtype(precision: Precision, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for `precision` on `device`; None: plain fp32."""
    if precision == "auto":
        if device.type != "cuda":
            return None
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


class Trainer:
    """One node's model, local optimizer state and data, stepped on a dedicated worker thread.

    A step is `compute_update()` (gradient of the current parameters over k micro-batches, clipped,
    turned into the local direction d; it advances the optimizer state) followed by
    `apply_update(base)`: x <- base - lr * d, where base is the current x (a local step) or the
    gossip mix of x (DAdam). `train_step()` does both: a plain local step.

    Parameters travel as float32 numpy vectors, one per named parameter (flattened), whatever the
    model's own dtype; buffers are not exchanged. Call `close()` (or use `async with`) to stop the thread.
    """

    def __init__(self, model: nn.Module, config: TrainerConfig, *, peer_id: str, train_tokens: torch.Tensor | None = None,
                 val_tokens: torch.Tensor, step: int = 0, stream: TrainBatches | None = None) -> None:
        if (train_tokens is None) == (stream is None):
            raise ValueError("a trainer takes its training data from train_tokens or from a stream, one of them")
        self.config = config
        self.peer_id = peer_id
        self.step = step
        self.device = resolve_device(config.device)
        self.model = model.to(self.device)
        self.model.train()
        self._params = dict(self.model.named_parameters())
        self._param_dtypes = {name: p.dtype for name, p in self._params.items()}  # restored when unfrozen
        self._train_tokens = train_tokens
        self._stream = stream
        self._val_tokens = val_tokens
        self._amp_dtype = autocast_dtype(config.precision, self.device)
        self._loss_scale = INITIAL_LOSS_SCALE if self._amp_dtype == torch.float16 else None
        self._good_steps = 0
        self._optimizer = LocalOptimizer(config.optimizer)
        self._schedule = config.optimizer.schedule
        self._warm_from = 0  # the step its optimizer state started from where that was not 0 (start_from_download)
        self._pending: StepStats | None = None  # computed by compute_update, not yet applied
        self._state_bytes = 0
        self._eval_model: nn.Module | None = None
        self._held_out_batches: list[tuple[torch.Tensor, torch.Tensor]] = []  # contribution scoring's (_held_out)
        # a CUDA model's gossip tensors go through pinned host buffers (node.train.staging)
        self._staging = HostStaging(pin=True) if self.device.type == "cuda" else None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"trainer-{peer_id}")

    async def __aenter__(self) -> Trainer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Stop the worker thread, after the operation it is running, if any (this call waits for it),
        and the data stream's reader."""
        if self._stream is not None:
            self._stream.close()  # first: a step waiting for data ends (DataInvalid) instead of waiting on
        self._worker.shutdown(wait=True)

    async def _on_worker(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._worker, functools.partial(fn, *args))

    @property
    def stream(self) -> TrainBatches | None:
        """Where training batches come from when they are streamed (--data), else None."""
        return self._stream

    # ---- parameters ------------------------------------------------------------------------------

    @property
    def parameter_names(self) -> tuple[str, ...]:
        return tuple(self._params)

    @property
    def optimizer_state_bytes(self) -> int:
        """Memory of the local optimizer state as of the last step (what the status reports)."""
        return self._state_bytes

    @property
    def trainable_parameter_names(self) -> tuple[str, ...]:
        """The parameters steps update (requires_grad); the others are frozen: no gradient, no optimizer state."""
        return tuple(name for name, p in self._params.items() if p.requires_grad)

    @property
    def optimizer_parameter_names(self) -> frozenset[str]:
        """The parameters the local optimizer holds state for."""
        return frozenset(key.rpartition("/")[0] for key in self._optimizer.state())

    async def set_trainable(self, trainable: Callable[[str], bool], frozen_dtype: torch.dtype | None = None) -> None:
        """Train only the parameters `trainable` names (all are trainable until this is called).

        Frozen parameters get requires_grad=False and lose their optimizer state; with `frozen_dtype`
        they are stored in that dtype (the model must cope with it; SPES's experts cast in hooks), and
        a parameter made trainable again returns to its original dtype.
        """
        await self._on_worker(self._set_trainable_now, trainable, frozen_dtype)

    def _set_trainable_now(self, trainable: Callable[[str], bool], frozen_dtype: torch.dtype | None) -> None:
        if self._pending is not None:
            raise RuntimeError("cannot change the trainable parameters between compute_update and apply_update")
        with torch.no_grad():
            for name, p in self._params.items():
                train = bool(trainable(name))
                target = self._param_dtypes[name] if train or frozen_dtype is None else frozen_dtype
                if p.dtype != target:
                    p.data = p.data.to(target)
                p.requires_grad_(train)
        keep = {name for name, p in self._params.items() if p.requires_grad}
        state = {key: value for key, value in self._optimizer.state().items() if key.rpartition("/")[0] in keep}
        counts = {name: count for name, count in self._optimizer.state_counts().items() if name in keep}
        self._optimizer.load_state(state, counts)
        self._state_bytes = self._optimizer.state_bytes()

    async def tensors(self, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """A copy of the parameters (or of those `names` lists) as flat float32 numpy vectors (the gossip tensors)."""
        return await self._on_worker(self._tensors_now, names)

    async def load_tensors(self, tensors: Tensors, *, partial: bool = False) -> None:
        """Set the parameters from flat vectors with the names and sizes `tensors()` gives; with
        `partial`, only those named (a subset), the others stay as they are."""
        await self._on_worker(self._load_now, tensors, partial)

    def _tensors_now(self, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        chosen = self._params if names is None else {name: self._params[name] for name in names}
        if self._staging is not None:
            return self._staging.to_host(chosen.items())
        with torch.no_grad():
            return {name: p.detach().to("cpu", torch.float32, copy=True).reshape(-1).numpy()
                    for name, p in chosen.items()}

    def _load_now(self, tensors: Tensors, partial: bool = False) -> None:
        if partial and not tensors.keys() <= self._params.keys():
            raise ValueError(f"parameters do not match the model: unknown {sorted(tensors.keys() - self._params.keys())[:3]}")
        if not partial and tensors.keys() != self._params.keys():
            missing, extra = sorted(self._params.keys() - tensors.keys()), sorted(tensors.keys() - self._params.keys())
            raise ValueError(f"parameters do not match the model: missing {missing[:3]}, unknown {extra[:3]}")
        if self._staging is not None:
            self._staging.to_device(self._params, {name: tensors[name] for name in self._params if name in tensors})
            return
        with torch.no_grad():
            for name, p in self._params.items():
                if name in tensors:
                    p.copy_(_as_torch(tensors[name], name, p))

    async def start_from_download(self, step: int) -> None:
        """Continue from `step` on the parameters a download gave (load_tensors). A trainer without
        optimizer state (a node that never trained) runs the schedule's warm-up again from `step`: the
        first steps with fresh Adam moments are sign-like steps of the full rate, which would throw
        the downloaded model off (and its neighbours with it). One restored from a checkpoint keeps its
        state, and the rate."""
        await self._on_worker(self._start_from_download_now, step)

    def _start_from_download_now(self, step: int) -> None:
        if not self._optimizer.state():  # Adam's moments and SGD's momentum alike
            self._warm_from = step
        self.step = step

    def lr_at(self, step: int) -> float:
        """The learning rate of step `step`: the schedule's, warmed up again from the step a fresh
        optimizer state started at mid-run (start_from_download)."""
        lr = self._schedule.lr_at(step)
        warmup = self._schedule.warmup_steps
        if self._warm_from and warmup and step >= self._warm_from:
            lr *= min(1.0, (step - self._warm_from + 1) / warmup)
        return lr

    # ---- steps -----------------------------------------------------------------------------------

    async def train_step(self) -> StepStats:
        """One local step: x <- x - lr * d(g(x))."""
        stats = await self.compute_update()
        await self.apply_update()
        return stats

    async def pass_step(self) -> StepStats:
        """Advance the step count without training (a step gossip DiLoCo's wall-clock phase passes over:
        node.algorithms.diloco.trainer); its stats say so (`skipped`, no loss: NaN)."""
        return await self._on_worker(self._pass_step_now)

    def _pass_step_now(self) -> StepStats:
        if self._pending is not None:
            raise RuntimeError("pass_step called between compute_update and apply_update")
        stats = StepStats(self.step, self.lr_at(self.step), math.nan, 0.0, True, 0.0)
        self.step += 1
        return stats

    async def compute_update(self) -> StepStats:
        """Compute g(x) for the current parameters and the local direction from it (kept for
        `apply_update`); the parameters do not change yet."""
        return await self._on_worker(self._compute_update_now)

    async def apply_update(self, base: Tensors | None = None) -> None:
        """x <- base - lr * d with the direction of the last `compute_update`; base None: x itself."""
        await self._on_worker(self._apply_update_now, base)

    def _compute_update_now(self) -> StepStats:
        if self._pending is not None:
            raise RuntimeError("compute_update called twice without apply_update in between")
        started = time.perf_counter()
        optimizer = self.config.optimizer
        loss = self._accumulate_gradients(optimizer.micro_batches)
        grads = {name: p.grad for name, p in self._params.items() if p.grad is not None}
        norm = global_norm(grads.values())
        skipped = not math.isfinite(norm)
        self._update_loss_scale(skipped)
        if not skipped:
            factor = clip_factor(norm, optimizer.clip_norm)
            with torch.no_grad():
                for name, grad in grads.items():
                    if factor != 1.0:
                        grad.mul_(factor)
                    # the direction replaces the gradient in its buffer: no second model-sized copy
                    direction = self._optimizer.direction(name, grad, self._params[name])
                    if direction is not grad:
                        grad.copy_(direction)
        self._state_bytes = self._optimizer.state_bytes()
        stats = StepStats(self.step, self.lr_at(self.step), loss, norm, skipped, time.perf_counter() - started)
        self._pending = stats
        return stats

    def _accumulate_gradients(self, micro_batches: int) -> float:
        self.model.zero_grad(set_to_none=True)
        total = 0.0
        for micro in range(micro_batches):
            if self._stream is not None:
                x, y = self._stream.train_batch(self.config.batch_size, self.config.context)
            else:
                assert self._train_tokens is not None
                x, y = training_batch(self._train_tokens, self.peer_id, self.step * micro_batches + micro,
                                      self.config.batch_size, self.config.context)
            with self._autocast():
                _, loss = self.model(x.to(self.device), y.to(self.device))
            scale = self._loss_scale or 1.0
            (loss * (scale / micro_batches)).backward()
            total += float(loss.detach())
        if self._loss_scale is not None:
            with torch.no_grad():
                for p in self._params.values():
                    if p.grad is not None:
                        p.grad.div_(self._loss_scale)
        return total / micro_batches

    def _update_loss_scale(self, overflowed: bool) -> None:
        if self._loss_scale is None:
            if overflowed:
                logger.warning("step %d: non-finite gradient; step skipped", self.step)
            return
        if overflowed:
            self._loss_scale /= 2.0
            self._good_steps = 0
            return
        self._good_steps += 1
        if self._good_steps >= LOSS_SCALE_GROWTH_INTERVAL:
            self._loss_scale *= 2.0
            self._good_steps = 0

    def _apply_update_now(self, base: Tensors | None) -> None:
        if self._pending is None:
            raise RuntimeError("apply_update called without a compute_update before it")
        stats, self._pending = self._pending, None
        if base is not None:
            self._load_now(base)
        if not stats.skipped:
            with torch.no_grad():
                for p in self._params.values():
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-stats.lr)
        self.model.zero_grad(set_to_none=True)
        self.step += 1

    @contextlib.contextmanager
    def _autocast(self) -> Iterator[None]:
        if self._amp_dtype is None:
            yield
        else:
            with torch.autocast(device_type=self.device.type, dtype=self._amp_dtype):
                yield

    async def measure_activation_bytes(self) -> int:
        """CUDA: the GPU memory one micro-batch's forward and backward take beyond the parameters and
        their gradients (peak allocated), measured on random tokens so no training data is used."""
        return await self._on_worker(self._measure_activation_bytes_now)

    def _measure_activation_bytes_now(self) -> int:
        if self.device.type != "cuda":
            raise ValueError("activation memory is measured on a CUDA device only")
        vocab = model_vocab_size(self.model) or 256
        generator = torch.Generator().manual_seed(0)
        x = torch.randint(vocab, (self.config.batch_size, self.config.context), generator=generator).to(self.device)
        self.model.zero_grad(set_to_none=True)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        with self._autocast():
            _, loss = self.model(x, x)
        loss.backward()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        grads = sum(p.grad.numel() * p.grad.element_size() for p in self._params.values() if p.grad is not None)
        self.model.zero_grad(set_to_none=True)
        return max(0, peak - before - grads)

    # ---- evaluation ------------------------------------------------------------------------------

    async def evaluate(self, tensors: Tensors | None = None) -> float:
        """Validation cross-entropy (nats) of the current parameters, or of `tensors` (e.g. the swarm
        average) without touching the trained model."""
        return await self._on_worker(self._evaluate_now, tensors)

    def _evaluate_now(self, tensors: Tensors | None,
                      batches: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None) -> float:
        model = self.model
        if tensors is not None:
            if self._eval_model is None:
                self._eval_model = copy.deepcopy(self.model)
            model = self._eval_model
            params = dict(model.named_parameters())
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(_as_torch(tensors[name], name, p))
        held_out = batches if batches is not None else validation_batches(
            self._val_tokens, self.config.eval_batch_size, self.config.context, self.config.eval_batches)
        with self._autocast():
            return mean_cross_entropy(model, held_out)

    def _held_out(self, sequences: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`sequences` windows drawn across the whole validation split with a fixed seed, in batches of at
        most the evaluation's batch size: the same on every call and every node, and wider than the split's
        first windows (one stretch of text)."""
        if sum(len(x) for x, _ in self._held_out_batches) != sequences:
            generator = torch.Generator().manual_seed(HELD_OUT_SEED)
            size = self.config.eval_batch_size
            self._held_out_batches = [sample_batch(self._val_tokens, min(size, sequences - start), self.config.context,
                                                   generator) for start in range(0, sequences, size)]
        return self._held_out_batches

    async def moved_losses(self, own: Tensors, toward: Sequence[tuple[Tensors, float]], sequences: int,
                           budget_s: float) -> tuple[float, list[float]]:
        """Held-out loss (on `sequences` fixed windows drawn across the validation split) of `own` and, for
        each (tensors, w) of `toward` in order, of own + w (tensors - own), a parameter that `tensors` lacks
        staying at own's (a DiLoCo fragment): contribution scoring's measurements (node.swarm.contribution).
        Those not reached within `budget_s` of work are left off."""
        return await self._on_worker(self._moved_losses_now, own, toward, sequences, budget_s)

    def _moved_losses_now(self, own: Tensors, toward: Sequence[tuple[Tensors, float]], sequences: int,
                          budget_s: float) -> tuple[float, list[float]]:
        deadline = time.monotonic() + budget_s
        held_out = self._held_out(sequences)
        base = self._evaluate_now(own, held_out)
        losses = []
        for theirs, weight in toward:
            if time.monotonic() > deadline:
                break
            w = np.float32(weight)
            losses.append(self._evaluate_now({name: x + w * (np.asarray(theirs[name], np.float32) - x)
                                              if name in theirs else x for name, x in own.items()}, held_out))
        return base, losses

    # ---- checkpoints -----------------------------------------------------------------------------

    async def state(self) -> dict[str, np.ndarray]:
        """Parameters, optimizer state and step as numpy arrays, for node.train.checkpoint."""
        return await self._on_worker(self._state_now)

    async def restore(self, state: Tensors) -> None:
        """Continue from what `state()` returned: the next step is the one that would have followed."""
        await self._on_worker(self._restore_now, state)

    def _state_now(self) -> dict[str, np.ndarray]:
        # Between compute_update and apply_update (a step abandoned at shutdown) the parameters are
        # still those of step t: they are saved as step t, and the moments, which already hold g_t,
        # take it in once more on resume - a negligible bias, where refusing would lose the checkpoint.
        out = {_PARAM + name: t for name, t in self._tensors_now().items()}
        out.update({_OPT + key: value.detach().to("cpu", copy=True).numpy() for key, value in self._optimizer.state().items()})
        out.update({_COUNT + name: np.asarray(count, np.int64) for name, count in self._optimizer.state_counts().items()})
        out[_STEP] = np.asarray(self.step, np.int64)
        if self._warm_from:
            out[_WARM_FROM] = np.asarray(self._warm_from, np.int64)
        if self._loss_scale is not None:
            out[_SCALE] = np.asarray(self._loss_scale, np.float64)
        return out

    def _restore_now(self, state: Tensors) -> None:
        self._load_now({key[len(_PARAM):]: value for key, value in state.items() if key.startswith(_PARAM)})
        moments = {}
        for key, value in state.items():
            if key.startswith(_OPT):
                name = key[len(_OPT):].rpartition("/")[0]
                moments[key[len(_OPT):]] = _as_torch(value, name, self._params[name]).clone()
        counts = {key[len(_COUNT):]: int(_scalar(value)) for key, value in state.items() if key.startswith(_COUNT)}
        self._optimizer.load_state(moments, counts)
        self._state_bytes = self._optimizer.state_bytes()
        self.step = int(_scalar(state[_STEP]))
        self._warm_from = int(_scalar(state[_WARM_FROM])) if _WARM_FROM in state else 0
        if self._loss_scale is not None and _SCALE in state:
            self._loss_scale = float(_scalar(state[_SCALE]))
        self._pending = None


def _scalar(value: np.ndarray) -> np.generic:
    """A checkpoint's scalar: 0-d, or of shape (1,) in the .npz checkpoints of murmur 0.1."""
    return np.asarray(value).reshape(-1)[0]  # type: ignore[no-any-return]


def _as_torch(vector: np.ndarray, name: str, like: torch.Tensor) -> torch.Tensor:
    """A flat vector as a tensor shaped, typed and placed like `like` (no copy where none is needed)."""
    if vector.size != like.numel():
        raise ValueError(f"parameter {name!r} has {like.numel()} values, got {vector.size}")
    # torch warns about read-only numpy arrays (decoded frames are) and views need contiguous
    # memory: only such arrays are copied
    source = torch.from_numpy(np.require(vector, requirements=("W", "C")))
    return source.view(like.shape).to(device=like.device, dtype=like.dtype)


async def train_alone(trainer: Trainer, steps: int) -> list[StepStats]:
    """The single-process baseline: `steps` local steps with the same optimizer and schedule."""
    return [await trainer.train_step() for _ in range(steps)]


def average_tensors(members: Sequence[Tensors]) -> dict[str, np.ndarray]:
    """The parameter-wise mean of several nodes' tensors: the swarm-average model, as float32.

    Summed in float64 one member at a time, so it holds one float64 copy of one tensor beyond its
    inputs rather than a stacked copy of every member (the swarm evaluation averages many peers).
    CPU-heavy for a large model: call it in a thread from an event loop."""
    if not members:
        raise ValueError("nothing to average")
    average = {}
    for name, first in members[0].items():
        total = first.astype(np.float64)
        for member in members[1:]:
            total += member[name]
        average[name] = (total / len(members)).astype(np.float32)
    return average
