"""`murmur demo`: a local swarm of N node processes on loopback training the embedded model together,
with live progress, and a summary of each node's validation loss and of the swarm-averaged model next
to the loss of the same model before training."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np

from gossip.knobs import DILOCO_LOCAL_STEPS
from node.cli.args import UsageError, add_setting_flag, number
from node.cli.status import fetch_status
from node.config import (
    DEFAULTS,
    EMBEDDED_MODEL_NAMES,
    HF_PRESET_NAMES,
    OPTIMIZERS,
    SETTINGS_BY_KEY,
    Command,
    Model,
    merge_layers,
    read_flags,
)
from node.net.proc import popen
from node.runtime.ready_line import ReadyLine, find_ready_line
from node.train.checkpoint import CHECKPOINT_FILE, load_checkpoint
from topology import TOPOLOGY_NAMES

if TYPE_CHECKING:
    import torch

READY_TIMEOUT_S = 180.0  # a loaded 2-core machine imports torch and hivemind in N processes at once
STOP_TIMEOUT_S = 15.0
POLL_S = 1.0
STALL_TIMEOUT_S = 300.0  # no node made a step for this long: the demo gives up and says why
DEMO_DILOCO_LOCAL_STEPS = 20  # --optimizer diloco without --local-steps: 7 outer steps in the default 100 (4 warm-up)
DEMO_SPES_SYNC_EVERY = 10  # --spes without --spes-sync-every: 10 syncs in the default 100 steps, not a node's 2
DEMO_IDENTITY_WORK = 8  # bits of proof of work per identity in the demo's loopback swarm (a node's default: 20)


class DemoFailed(Exception):
    """The demo could not finish (a node died or stalled): one line, exit 1."""


@dataclass(frozen=True)
class DemoOptions:
    nodes: int = 4
    steps: int = 100
    topology: str = "one-peer-exp"
    optimizer: str = "dadam"
    model: str = "moe"
    lr: float | None = None  # None: the node's default
    batch_size: int = 16
    as_json: bool = False
    workdir: Path | None = None  # None: a temporary directory, removed at the end
    spes: bool = False
    recipe_flags: tuple[str, ...] = ()  # more of the founder's recipe flags (--codec, diloco's knobs)


@dataclass
class DemoNode:
    name: str
    data_dir: Path
    process: subprocess.Popen[bytes]
    log: Path
    peer_id: str = ""
    monitor_url: str = ""
    maddrs: tuple[str, ...] = ()
    invite: str = ""
    status: dict[str, Any] = field(default_factory=dict)

    def ready_line(self) -> ReadyLine | None:
        return find_ready_line(self.log.read_text(errors="replace")) if self.log.exists() else None

    def log_tail(self, lines: int = 5) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def node_args(options: DemoOptions, index: int, data_dir: Path, swarm: str, founder: DemoNode | None) -> list[str]:
    murmur = str(Path(sys.executable).with_name("murmur"))
    # every node waits for all of them, so the swarm starts training together
    common = ["--data-dir", str(data_dir), "--monitor-port", "0", "--heartbeat", "1", "--threads", "1",
              "--log-level", "INFO", "--swarm", swarm, "--min-peers", str(options.nodes)]
    if founder is None:
        # a loopback swarm under a name of its own: no stranger can join it, so its identities need not
        # cost the default's second of CPU each (8 bits still mints and checks a proof)
        recipe = ["--model", options.model, "--steps", str(options.steps), "--topology", options.topology,
                  "--optimizer", options.optimizer,
                  "--batch-size", str(options.batch_size), "--identity-work", str(DEMO_IDENTITY_WORK)]
        if options.lr is not None:
            recipe += ["--lr", str(options.lr)]
        if options.spes:
            recipe += ["--spes"]
        recipe += list(options.recipe_flags)
        return [murmur, "node", *common, *recipe, "--seed", "0"]
    # a joiner takes the swarm's recipe, but runs a model given by import path only if it names it too
    return [murmur, "join", *common, "--peers", founder.maddrs[0], "--invite", founder.invite, "--model", options.model]


class Demo:
    """The processes of one demo run; `close()` stops every one of them, whatever happened."""

    def __init__(self, options: DemoOptions, root: Path, out: TextIO) -> None:
        self.options = options
        self.root = root
        self.out = out
        self.nodes: list[DemoNode] = []
        self.swarm = f"demo-{os.getpid()}"

    def spawn(self, index: int, founder: DemoNode | None) -> DemoNode:
        data_dir = self.root / f"node{index}"
        log = self.root / f"node{index}.log"
        argv = node_args(self.options, index, data_dir, self.swarm, founder)
        with open(log, "wb") as sink:
            env = {k: v for k, v in os.environ.items() if not k.startswith("MURMUR_")}
            process = popen(argv, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=self.root)
        node = DemoNode(f"node{index}", data_dir, process, log)
        self.nodes.append(node)
        return node

    def wait_ready(self, nodes: Sequence[DemoNode]) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for node in nodes:
            while (match := node.ready_line()) is None:
                if node.process.poll() is not None:
                    raise DemoFailed(f"{node.name} exited with status {node.process.returncode}:\n{node.log_tail()}")
                if time.monotonic() > deadline:
                    raise DemoFailed(f"{node.name} was not ready within {READY_TIMEOUT_S:g} s:\n{node.log_tail()}")
                time.sleep(0.2)
            node.peer_id, node.monitor_url, node.maddrs = match.peer_id, match.monitor_url, match.maddrs
            node.invite = match.invite

    def start(self) -> None:
        founder = self.spawn(0, None)
        self.wait_ready([founder])
        print(f"murmur demo: monitor of node0: {founder.monitor_url}", file=self.out, flush=True)
        joiners = [self.spawn(i, founder) for i in range(1, self.options.nodes)]
        self.wait_ready(joiners)

    def poll(self) -> None:
        for node in self.nodes:
            if node.process.poll() is not None:
                raise DemoFailed(f"{node.name} exited with status {node.process.returncode}:\n{node.log_tail()}")
            with contextlib.suppress(OSError, ValueError):
                node.status = fetch_status(node.monitor_url)

    def train(self) -> None:
        """Poll until every node has spent its step budget, showing progress."""
        last_progress, last_steps, last_line = time.monotonic(), -1, 0.0
        live = self.out.isatty() and not self.options.as_json
        while True:
            self.poll()
            steps = [_training(n).get("step", 0) for n in self.nodes]
            if sum(steps) != last_steps:
                last_progress, last_steps = time.monotonic(), sum(steps)
            if all(_training(n).get("done") for n in self.nodes):
                break
            if time.monotonic() - last_progress > STALL_TIMEOUT_S:
                raise DemoFailed(f"no node made a step for {STALL_TIMEOUT_S:g} s; logs are in {self.root}")
            if live:
                self.out.write("\x1b[2J\x1b[H" + progress_table(self.nodes, self.options.steps) + "\n")
                self.out.flush()
            elif time.monotonic() - last_line > 10.0:
                print(progress_line(self.nodes, self.options.steps), file=self.out, flush=True)
                last_line = time.monotonic()
            time.sleep(POLL_S)
        self.poll()

    def stop(self) -> None:
        """SIGTERM every node (each writes its final checkpoint) and wait for them."""
        for node in self.nodes:
            if node.process.poll() is None:
                node.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for node in self.nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            if node.process.poll() is None:
                node.process.kill()
                node.process.wait()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()


def _training(node: DemoNode) -> dict[str, Any]:
    return node.status.get("training") or {}


def progress_table(nodes: Sequence[DemoNode], steps: int) -> str:
    rows = [f"{'node':<6} {'step':>9} {'loss':>7} {'val':>7} {'peers':>5} {'sent MB':>8} {'recv MB':>8} {'tok/s':>7}"]
    for node in nodes:
        t, s = _training(node), node.status
        rows.append(f"{node.name:<6} {t.get('step', 0):>4}/{steps:<4} {_num(t.get('loss')):>7} {_num(t.get('val_loss')):>7} "
                    f"{len(s.get('peers', [])):>5} {s.get('bytes_sent', 0) / 1e6:>8.1f} "
                    f"{s.get('bytes_received', 0) / 1e6:>8.1f} {t.get('tokens_per_s', 0):>7.0f}")
    return "\n".join(rows)


def progress_line(nodes: Sequence[DemoNode], steps: int) -> str:
    parts = [f"{n.name} {_training(n).get('step', 0)}/{steps} loss {_num(_training(n).get('loss'))}" for n in nodes]
    return "murmur demo: " + "; ".join(parts)


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}"


# ---- the summary ---------------------------------------------------------------------------------


def node_parameters(data_dir: Path) -> dict[str, np.ndarray]:
    """A node's final parameters, from the checkpoint it wrote when it stopped."""
    checkpoint = load_checkpoint(data_dir / CHECKPOINT_FILE)
    if checkpoint is None:
        raise DemoFailed(f"{data_dir} has no checkpoint")
    return {k[len("param/"):]: v for k, v in checkpoint.tensors.items() if k.startswith("param/")}


def summarize(options: DemoOptions, nodes: Sequence[DemoNode], workdir: Path) -> dict[str, Any]:
    """Validation losses of the untrained model, of each node and of the nodes' average, evaluated here
    on the same validation batches the nodes use."""
    import torch

    from node.swarm.loop import EVAL_BATCH_SIZE, EVAL_BATCHES
    from node.train.data import load_corpus, validation_batches
    from node.train.models import build_named_model, mean_cross_entropy
    from node.train.trainer import average_tensors

    corpus = load_corpus(None, workdir)
    model = build_named_model(options.model, seed=0)
    context = DEFAULTS.training.context

    def loss_of(params: dict[str, np.ndarray] | None) -> float:
        if params is not None:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(torch.from_numpy(params[name]).view_as(p))
        return mean_cross_entropy(model, validation_batches(corpus.val, EVAL_BATCH_SIZE, context, EVAL_BATCHES))

    initial = loss_of(None)
    finals = [node_parameters(n.data_dir) for n in nodes]
    per_node = []
    for node, params in zip(nodes, finals, strict=True):
        t, spes = _training(node), node.status.get("spes") or {}
        per_node.append({"peer_id": node.peer_id, "val_loss": loss_of(params), "steps": t.get("step", 0),
                         "bytes_sent": node.status.get("bytes_sent", 0),
                         "bytes_received": node.status.get("bytes_received", 0),
                         "trainable_params": t.get("trainable_params", 0),
                         "optimizer_state_bytes": t.get("optimizer_state_bytes", 0),
                         **({"experts": spes.get("owned_experts", [])} if options.spes else {})})
    averaged = loss_of(_spes_average(model, nodes, finals) if options.spes else average_tensors(finals))
    return {"initial_val_loss": initial, "averaged_val_loss": averaged, "nodes": per_node,
            "model": options.model, "optimizer": options.optimizer, "topology": options.topology,
            "steps": options.steps, "spes": options.spes, "recipe_flags": list(options.recipe_flags),
            "traffic": traffic_summary(options, model, per_node)}


def traffic_summary(options: DemoOptions, model: torch.nn.Module, per_node: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Bytes per node per step (sent + received, mean over nodes) next to what the default demo (DAdam,
    fp32, a round every step) moves for the same model, nodes and topology, analytically
    (gossip.diloco.round_bytes over one period of the topology's rounds)."""
    from gossip.codecs import get_codec
    from gossip.diloco import RoundMessages, round_bytes
    from topology import MembershipView, build_topology, peer_round

    measured = sum(n["bytes_sent"] + n["bytes_received"] for n in per_node) / max(1, len(per_node)) / options.steps
    specs = {name: ((p.numel(),), np.float32) for name, p in model.named_parameters()}
    view = MembershipView.of(f"peer{i:03d}" for i in range(options.nodes))
    topology = build_topology(options.topology, view.n)
    rounds = [round_bytes(specs, get_codec("fp32"), RoundMessages.of(peer_round(topology, view, me, r), me)).total
              for r in range(topology.period) for me in view.peer_ids]
    baseline = sum(rounds) / len(rounds)
    return {"bytes_per_node_per_step": measured, "default_demo_bytes_per_node_per_step": baseline,
            "ratio_to_default": measured / baseline if baseline else None}


def _spes_average(
    model: torch.nn.Module, nodes: Sequence[DemoNode], finals: list[dict[str, np.ndarray]]
) -> dict[str, np.ndarray]:
    """The SPES swarm average: shared weights over every node, each expert over the nodes that own it
    (by their last status; frozen copies are only caches)."""
    from gossip.spes import Ownership
    from node.algorithms.spes.partition import ModelPartition, spes_average

    partition = ModelPartition.of(model)
    members = {n.peer_id: params for n, params in zip(nodes, finals, strict=True)}
    owned = {n.peer_id: set((n.status.get("spes") or {}).get("owned_experts", [])) for n in nodes}
    owners = {key: tuple(p for p in sorted(members) if key[1] in owned[p]) for key in partition.experts}
    ownership = Ownership(tuple(sorted(members)), partition.experts_per_layer, partition.layers, owners)
    return spes_average(members, ownership, partition)


def summary_text(summary: dict[str, Any]) -> str:
    lines = [f"murmur demo: {len(summary['nodes'])} nodes, {summary['model']} model"
             f"{' with SPES' if summary.get('spes') else ''}, {summary['optimizer']}, "
             f"{summary['topology']}, {summary['steps']} steps",
             f"{'node':<48} {'val loss':>9} {'steps':>6} {'sent MB':>8} {'recv MB':>8}"]
    for n in summary["nodes"]:
        lines.append(f"{n['peer_id']:<48} {n['val_loss']:>9.4f} {n['steps']:>6} {n['bytes_sent'] / 1e6:>8.1f} "
                     f"{n['bytes_received'] / 1e6:>8.1f}")
    lines.append(f"validation loss before training: {summary['initial_val_loss']:.4f}")
    lines.append(f"validation loss of the averaged model: {summary['averaged_val_loss']:.4f}")
    traffic = summary.get("traffic") or {}
    if traffic.get("ratio_to_default") is not None:
        lines.append(f"bytes per node per step: {traffic['bytes_per_node_per_step'] / 1e6:.3f} MB, "
                     f"{traffic['ratio_to_default']:.3f}x the default demo's (DAdam, fp32: "
                     f"{traffic['default_demo_bytes_per_node_per_step'] / 1e6:.3f} MB)")
    return "\n".join(lines)


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM of the demo stops the nodes the same way as Ctrl-C does."""
    raise KeyboardInterrupt


@contextlib.contextmanager
def _workdir(options: DemoOptions) -> Iterator[Path]:
    if options.workdir is not None:
        options.workdir.mkdir(parents=True, exist_ok=True)
        yield options.workdir
        return
    with tempfile.TemporaryDirectory(prefix="murmur-demo-") as tmp:
        yield Path(tmp)


def run_demo(options: DemoOptions) -> int:
    out = sys.stderr if options.as_json else sys.stdout
    with _workdir(options) as root:
        demo = Demo(options, root, out)
        signal.signal(signal.SIGTERM, _interrupt)
        try:
            demo.start()
            demo.train()
            demo.stop()
            summary = summarize(options, demo.nodes, root)
        except DemoFailed as exc:
            print(f"murmur demo: error: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("murmur demo: interrupted; stopping the nodes", file=sys.stderr)
            return 130
        finally:
            demo.close()
    if options.as_json:
        print(json.dumps(summary))
    else:
        print(summary_text(summary), file=out)
    return 0


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = commands.add_parser(
        Command.DEMO, help="train the embedded model with a local swarm of node processes",
        description="Start N node processes on loopback in one swarm training the embedded model (MoE by "
        "default), print the first node's monitor URL and the progress, stop them when every node has "
        "taken --steps steps, and print the validation loss of each node and of the averaged model next "
        "to that of the untrained model. Node logs and checkpoints live in a temporary directory (--dir "
        "keeps them).")
    demo.add_argument("--nodes", type=number(int, lo=1, hi=32), default=4, help="node processes (default 4)")
    demo.add_argument("--steps", type=number(int, lo=1), default=100, help="training steps per node (default 100)")
    demo.add_argument("--topology", choices=TOPOLOGY_NAMES, default="one-peer-exp",
                      help="gossip topology (default one-peer-exp)")
    demo.add_argument("--optimizer", choices=OPTIMIZERS, default="dadam", help="optimizer (default dadam)")
    demo.add_argument("--model", choices=(*EMBEDDED_MODEL_NAMES, *HF_PRESET_NAMES), default=Model.MOE,
                      help="embedded model, or a tiny Hugging Face preset built with transformers (default moe)")
    demo.add_argument("--lr", type=number(float, lo=1e-12), help="peak learning rate (default: the node's, 3e-3)")
    demo.add_argument("--batch-size", type=number(int, lo=1), default=16,
                      help="sequences per step on each node (default 16)")
    demo.add_argument("--spes", action="store_true",
                      help="sparse expert sync of the experts (SPES): --model moe or hf-tiny-mixtral")
    recipe = demo.add_argument_group("the swarm's recipe, as `murmur node` takes it (--optimizer diloco's knobs, "
                                     "SPES's period and the codec); default: the node's, --local-steps 20 with "
                                     "diloco, --spes-sync-every 10 with --spes")
    for key in DEMO_RECIPE_KEYS:
        help_text, default_text = DEMO_FLAG_TEXT.get(key, (None, None))
        add_setting_flag(recipe, SETTINGS_BY_KEY[key], help=help_text, default_text=default_text)
    demo.add_argument("--dir", type=Path, help="keep node logs and checkpoints in this directory")
    demo.add_argument("--json", action="store_true",
                      help="end with one JSON object: initial_val_loss, averaged_val_loss, nodes (peer_id, "
                      "val_loss, steps, bytes_sent, bytes_received, trainable_params, optimizer_state_bytes) and "
                      "traffic (bytes_per_node_per_step, default_demo_bytes_per_node_per_step, ratio_to_default)")
    demo.set_defaults(run=_run_demo)


# help and default in words where the demo's own default differs from a node's (the settings table's)
DEMO_FLAG_TEXT = {
    "training.local_steps": ("H: optimizer steps between gossip rounds (the swarm's)",
                             f"1; {DEMO_DILOCO_LOCAL_STEPS} with --optimizer diloco, where a node takes "
                             f"{DILOCO_LOCAL_STEPS}"),
    "training.spes_sync_every": (None, f"{DEMO_SPES_SYNC_EVERY}, where a node takes {DEFAULTS.training.spes_sync_every}"),
}
# recipe settings `murmur demo` passes through to its founder
DEMO_RECIPE_KEYS = ("gossip.codec", "gossip.topk_ratio", "gossip.topk_packed", "gossip.topk_elias_fano",
                    "training.local_steps", "training.fragments", "training.overlap", "training.outer_lr", "training.outer_momentum",
                    "training.qsr_alpha", "training.phase_seconds", "training.anchor_every",
                    "training.anchor_codec", "training.inner_optimizer", "training.final_merge", "training.spes_sync_every")


def _run_demo(args: argparse.Namespace) -> int:
    if args.spes and args.model not in (Model.MOE, "hf-tiny-mixtral"):
        raise UsageError(f"--spes: SPES syncs the experts of an MoE model (moe, hf-tiny-mixtral); --model {args.model} has none")
    given = {SETTINGS_BY_KEY[key]: vars(args)[SETTINGS_BY_KEY[key].dest] for key in DEMO_RECIPE_KEYS
             if SETTINGS_BY_KEY[key].dest in vars(args)}
    local_steps = SETTINGS_BY_KEY["training.local_steps"]
    if args.optimizer == "diloco" and local_steps not in given:
        given[local_steps] = str(DEMO_DILOCO_LOCAL_STEPS)
    sync_every = SETTINGS_BY_KEY["training.spes_sync_every"]
    if args.spes and sync_every not in given:
        given[sync_every] = str(DEMO_SPES_SYNC_EVERY)
    # the founder's own checks, so a bad combination exits 2 here rather than in a node
    merge_layers(read_flags({**given, SETTINGS_BY_KEY["training.optimizer"]: args.optimizer,
                             SETTINGS_BY_KEY["training.spes"]: args.spes,
                             SETTINGS_BY_KEY["training.model"]: str(args.model)}))
    flags: list[str] = []
    for setting, value in given.items():
        if isinstance(value, bool):
            flags.append(setting.flag if value else f"--no-{setting.flag[2:]}")
        else:
            flags += [setting.flag, str(value)]
    return run_demo(DemoOptions(nodes=args.nodes, steps=args.steps, topology=args.topology, optimizer=args.optimizer,
                                model=args.model, lr=args.lr, batch_size=args.batch_size, as_json=args.json,
                                workdir=args.dir.absolute() if args.dir else None, spes=args.spes,
                                recipe_flags=tuple(flags)))
