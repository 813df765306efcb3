"""Time to a target validation loss over an emulated WAN, and the accuracy of `murmur plan`'s step times.

N node processes, each in its own network namespace (a "home"), joined through a hub by links shaped to
--rate-mbit with tbf both ways, every connection passing a user-space relay that adds --delay-ms each
way (bench/wan_net.py, bench/wan_relay.py). Every configuration trains the same model on the same data
with the same per-node batch from the same initial parameters, for --steps steps. Every --snapshot-every
steps each node's parameters are kept (a hard link to its checkpoint; hivemind peers save theirs) with the
time its step was first seen; afterwards the swarm-average model of every snapshot step is evaluated on the
validation split, off the clock. A configuration's time to target is the wall time from its first training
step until every node had reached the first snapshot step whose average is at most --target.
Configurations (`--configs`):

- compute: murmur nodes that never gossip (H beyond the run): the compute time per step on these cores,
  the step time `murmur plan` is given;
- dadam-fp32: murmur's DAdam, whole fp32 parameters every step, one-peer exponential (the defaults);
  dadam-int8: the same with int8 parameters;
- choco-topk, choco-int8: DAdam with compressed gossip (top-k 5% or int8 differences) on the hypercube;
- diloco: gossip DiLoCo, when this murmur has it (`--optimizer diloco`; skipped otherwise), its outer sync
  overlapped with the next phase; diloco-awaited: the same with each sync awaited;
- hivemind: hivemind.Optimizer with use_local_updates=True (local Adam steps, parameters averaged by
  hivemind's all-reduce every --hivemind-every steps of the swarm), the closest hivemind has.

With --mock-gpu-step S every node's forward and backward pass is a sleep of S seconds (bench/mock_gpu_node.py,
a GPU that leaves the CPU free, which this machine lacks): step times, bytes and the overlap only.

Ratios are printed against DAdam fp32 measured in the same command. Plan accuracy: the measured per-step
time of each murmur configuration against `murmur plan`'s prediction from the compute-only step time and
the link. Needs root, `ip` and `tc`; takes tens of minutes. Run from the repository root:
    .venv/bin/python -m bench.bench_wan [--configs compute,dadam-fp32,choco-topk,hivemind]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
MURMUR = str(Path(sys.executable).with_name("murmur"))
SWARM = "wan"
READY_TIMEOUT_S = 240.0  # N interpreters importing torch and hivemind on two shared cores
POLL_S = 2.0
STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Config:
    name: str
    kind: str  # "murmur" or "hivemind"
    flags: dict[str, object] = field(default_factory=dict)  # the founder's recipe flags
    # what `murmur plan` is told about it (None: not predicted)
    plan: dict[str, object] | None = None
    steps: int | None = None  # a row that only checks the plan's step time: fewer steps than --steps


def configs(args: argparse.Namespace) -> dict[str, Config]:
    common = {"model": args.model, "batch_size": args.batch_size, "context": args.context, "lr": args.lr,
              "warmup_steps": args.warmup}
    return {
        "compute": Config("compute: local steps only (no gossip)", "murmur", {**common, "local_steps": 10_000}),
        "dadam-fp32": Config("murmur DAdam, fp32, one-peer-exp", "murmur", {**common, "topology": "one-peer-exp"},
                             {"optimizer": "dadam", "topology": "one-peer-exp", "codec": "fp32"}),
        "dadam-int8": Config("murmur DAdam, int8, one-peer-exp", "murmur",
                             {**common, "topology": "one-peer-exp", "codec": "int8"},
                             {"optimizer": "dadam", "topology": "one-peer-exp", "codec": "int8"}),
        "choco-topk": Config("murmur DAdam + choco top-k 5%, hypercube", "murmur",
                             {**common, "topology": "hypercube", "gossip_compression": "choco", "mixing": "weighted", "codec": "topk",
                              "topk_ratio": 0.05},
                             {"optimizer": "dadam", "topology": "hypercube", "codec": "topk", "topk_ratio": 0.05,
                              "gossip_compression": "choco"}),
        "choco-int8": Config("murmur DAdam + choco int8, hypercube", "murmur",
                             {**common, "topology": "hypercube", "gossip_compression": "choco", "mixing": "weighted", "codec": "int8"},
                             {"optimizer": "dadam", "topology": "hypercube", "codec": "int8",
                              "gossip_compression": "choco"}),
        "dadam-bf16-ring": Config("murmur DAdam, bf16, ring (step time only)", "murmur",
                                  {**common, "topology": "ring", "codec": "bf16"},
                                  {"optimizer": "dadam", "topology": "ring", "codec": "bf16"}, steps=30),
        # DiLoCo's outer step (lr 0.7, momentum 0.9) and anchors mixed at every sync: two int8 rounds per sync,
        # run while the next inner phase computes
        "diloco": Config(f"murmur gossip DiLoCo H={args.diloco_h}, int8, overlapped, one-peer-exp", "murmur",
                         {**common, "optimizer": "diloco", "local_steps": args.diloco_h, "codec": "int8",
                          "overlap": True, "topology": "one-peer-exp"},
                         {"optimizer": "diloco", "topology": "one-peer-exp", "codec": "int8",
                          "local_steps": args.diloco_h, "overlap": True}, steps=args.diloco_steps),
        # the same, with each sync awaited before the next phase: what the overlap hides
        "diloco-awaited": Config(f"murmur gossip DiLoCo H={args.diloco_h}, int8, sync awaited, one-peer-exp", "murmur",
                                 {**common, "optimizer": "diloco", "local_steps": args.diloco_h, "codec": "int8",
                                  "overlap": False, "topology": "one-peer-exp"},
                                 {"optimizer": "diloco", "topology": "one-peer-exp", "codec": "int8",
                                  "local_steps": args.diloco_h, "overlap": False}, steps=args.diloco_steps),
        "hivemind": Config(f"hivemind.Optimizer, use_local_updates, averaging every {args.hivemind_every} steps",
                           "hivemind", common),
    }


# ---- one run ----------------------------------------------------------------------------------------


@dataclass
class Trace:
    """What the bench saw of one configuration: per node, polls of (seconds since start, step, bytes moved);
    per snapshot step, the seconds since start when every node had reached it; the averages' losses."""

    name: str
    polls: list[list[tuple[float, int, int]]]
    snapshots: dict[int, float]  # step -> seconds until every node had a snapshot of it
    losses: dict[int, float] = field(default_factory=dict)  # step -> validation loss of the average
    note: str = ""
    peak_rss_gb: list[float] = field(default_factory=list)  # per murmur node process, its VmHWM at the end

    def step_time(self, warm_steps: int) -> float | None:
        """Median over nodes of the mean wall time per step after the first `warm_steps` steps."""
        per_node = []
        for polls in self.polls:
            warm = [(t, s) for t, s, _ in polls if s >= warm_steps]
            if len(warm) >= 2 and warm[-1][1] > warm[0][1]:
                per_node.append((warm[-1][0] - warm[0][0]) / (warm[-1][1] - warm[0][1]))
        return statistics.median(per_node) if per_node else None

    def bytes_per_step(self) -> float | None:
        per_node = [p[-1][2] / p[-1][1] for p in self.polls if p and p[-1][1] > 0]
        return statistics.mean(per_node) if per_node and any(p[-1][2] for p in self.polls if p) else None

    def to_target(self, target: float) -> tuple[int, float] | None:
        """The first snapshot step whose average is at most `target`, and when every node had reached it."""
        for step in sorted(self.losses):
            if self.losses[step] <= target and step in self.snapshots:
                return step, self.snapshots[step]
        return None


def _stop_all(processes: Sequence[subprocess.Popen]) -> None:
    """SIGTERM every process group we started at once, wait for them, then SIGKILL what is left."""
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(max(0.1, deadline - time.monotonic()))
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(10)


def _flag_args(flags: dict[str, object]) -> list[str]:
    """Command-line flags of `flags`: booleans as --key / --no-key, the rest as --key VALUE."""
    args: list[str] = []
    for key, value in flags.items():
        flag = key.replace("_", "-")
        if isinstance(value, bool):
            args.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            args += [f"--{flag}", str(value)]
    return args


def _start(net, i: int, argv: list[str], workdir: Path, name: str) -> subprocess.Popen:
    from node.net.proc import popen

    env = {k: v for k, v in os.environ.items() if not k.startswith("MURMUR_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    with open(workdir / f"{name}.out", "wb") as out, open(workdir / f"{name}.err", "wb") as err:
        return popen(net.command(i, argv), stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=workdir, env=env,
                     start_new_session=True)


def _ready_line(path: Path, process: subprocess.Popen, deadline: float):
    from node.runtime.ready_line import find_ready_line

    while time.monotonic() < deadline:
        found = find_ready_line(path.read_text(errors="replace")) if path.exists() else None
        if found is not None:
            return found
        if process.poll() is not None:
            raise RuntimeError(f"{path.stem} exited with {process.returncode} before it was ready:\n"
                               f"{path.with_suffix('.err').read_text(errors='replace')[-3000:]}")
        time.sleep(0.3)
    raise TimeoutError(f"{path.stem} not ready within {READY_TIMEOUT_S:g} s")


def run_murmur(net, config: Config, args: argparse.Namespace, workdir: Path) -> Trace:
    from node.cli.status import fetch_status

    workdir.mkdir(parents=True)
    # with --mock-gpu-step the forward and backward pass sleep instead (bench/mock_gpu_node.py)
    murmur = [sys.executable, "-m", "bench.mock_gpu_node", str(args.mock_gpu_step)] if args.mock_gpu_step else [MURMUR]
    own = {"threads": 1, "eval_every": 1_000_000, "checkpoint_every": args.snapshot_every, "min_peers": args.nodes,
           "exchange_timeout": args.exchange_timeout, "heartbeat": 2, "monitor_port": 7690, "swarm": SWARM}
    processes: list[subprocess.Popen] = []
    try:
        founder_argv = [*murmur, "node", "--data-dir", str(workdir / "n0"), "--listen", net.listen_maddr(0),
                        "--announce", net.announce_maddr(0), *_flag_args({**config.flags, **own})]
        processes.append(_start(net, 0, founder_argv, workdir, "n0"))
        ready = [_ready_line(workdir / "n0.out", processes[0], time.monotonic() + READY_TIMEOUT_S)]
        entry = f"{net.announce_maddr(0)}/p2p/{ready[0].peer_id}"
        for i in range(1, args.nodes):
            # the invite names the swarm and the founder whose signed config the joiner trusts
            joiner = {k: v for k, v in own.items() if k != "swarm"}
            argv = [*murmur, "join", "--peers", entry, "--invite", ready[0].invite, "--data-dir", str(workdir / f"n{i}"),
                    "--listen", net.listen_maddr(i), "--announce", net.announce_maddr(i), *_flag_args(joiner)]
            processes.append(_start(net, i, argv, workdir, f"n{i}"))
        deadline = time.monotonic() + READY_TIMEOUT_S
        ready += [_ready_line(workdir / f"n{i}.out", processes[i], deadline) for i in range(1, args.nodes)]
        urls = [r.monitor_url for r in ready]

        def poll(i: int) -> tuple[int, int] | None:
            try:
                status = net.call_inside(i, fetch_status, urls[i])
            except (OSError, ValueError):
                return None
            return int((status.get("training") or {}).get("step", 0)), int(status["bytes_sent"]) + int(status["bytes_received"])

        def snapshot(i: int, seen: set[int]) -> list[tuple[int, float]]:
            """Hard-link node i's newest checkpoint under its step, if that step is new: (step, written at).
            The checkpoint is replaced by a rename, so the link keeps the file of that step."""
            import safetensors

            from node.train.checkpoint import CHECKPOINT_FILE, META_KEY

            path = workdir / f"n{i}" / CHECKPOINT_FILE
            with contextlib.suppress(OSError, ValueError, KeyError, safetensors.SafetensorError):
                kept = workdir / f"snap-n{i}-new.safetensors"
                kept.unlink(missing_ok=True)
                os.link(path, kept)
                with safetensors.safe_open(str(kept), "np") as f:
                    step = int(json.loads(f.metadata()[META_KEY])["step"])
                if step not in seen:
                    return [(step, kept.rename(workdir / f"snap-n{i}-{step}.safetensors").stat().st_mtime)]
            return []

        trace = _follow(config.name, args, poll, snapshot, processes, config.steps or args.steps)
        trace.peak_rss_gb = [_peak_rss_gb(p.pid) for p in processes]
        return trace
    finally:
        _stop_all(processes)


def _peak_rss_gb(pid: int) -> float:
    """A node process's resident-memory high-water mark (VmHWM; `ip netns exec` execs the node), 0 if gone."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / (1 << 20)
    return 0.0


def _follow(name: str, args: argparse.Namespace, poll: Callable[[int], tuple[int, int] | None],
            snapshot: Callable[[int, set[int]], list[tuple[int, float]]],
            processes: Sequence[subprocess.Popen], steps: int) -> Trace:
    """Poll every node until all have a snapshot of step --steps or the time is up; time (wall clock, which
    the snapshots' modification times share) counts from the first poll that saw a node past step 0."""
    polls: list[list[tuple[float, int, int]]] = [[] for _ in range(args.nodes)]
    seen: list[dict[int, float]] = [{} for _ in range(args.nodes)]
    start: float | None = None
    cap = time.monotonic() + 60 * args.max_minutes
    note = ""
    while True:
        if time.monotonic() > cap:
            note = f"stopped after {args.max_minutes:g} min"
            break
        dead = [i for i, p in enumerate(processes) if p.poll() is not None]
        if dead:
            note = f"node(s) {dead} exited"
            break
        now = time.time()
        for i in range(args.nodes):
            got = poll(i)
            if got is not None and got[0] > 0 and start is None:
                start = now
            if start is None:
                continue
            if got is not None:
                polls[i].append((now - start, *got))
            for step, written in snapshot(i, set(seen[i])):
                seen[i][step] = max(0.0, written - start)
        last = steps - steps % args.snapshot_every
        if start is not None and all(last in s for s in seen):
            break
        time.sleep(POLL_S)
    common = set.intersection(*(set(s) for s in seen)) if all(seen) else set()
    return Trace(name, polls, {step: max(s[step] for s in seen) for step in sorted(common)}, note=note)


# ---- hivemind.Optimizer -----------------------------------------------------------------------------


def run_hivemind(net, config: Config, args: argparse.Namespace, workdir: Path) -> Trace:
    workdir.mkdir(parents=True)
    processes: list[subprocess.Popen] = []
    spec = {"workdir": str(workdir), "nodes": args.nodes, "model": args.model, "batch_size": args.batch_size,
            "lr": args.lr, "warmup": args.warmup, "snapshot_every": args.snapshot_every, "every": args.hivemind_every,
            "max_minutes": args.max_minutes + 5}
    try:
        for i in range(args.nodes):
            role = {**spec, "index": i, "listen": net.listen_maddr(i), "announce": net.announce_maddr(i)}
            argv = [sys.executable, "-m", "bench.bench_wan", "--role", "hivemind", "--spec", json.dumps(role)]
            processes.append(_start(net, i, argv, workdir, f"h{i}"))

        def poll(i: int) -> tuple[int, int] | None:
            path = workdir / f"progress{i}.json"
            with contextlib.suppress(OSError, ValueError):
                return int(json.loads(path.read_text())["step"]), 0
            return None

        def snapshot(i: int, seen: set[int]) -> list[tuple[int, float]]:
            found = ((int(path.stem.rsplit("-", 1)[1]), path) for path in workdir.glob(f"snap-n{i}-*.npz"))
            return [(step, path.stat().st_mtime) for step, path in found if step not in seen]

        return _follow(config.name, args, poll, snapshot, processes, args.steps)
    finally:
        (workdir / "stop").touch()
        _stop_all(processes)


def hivemind_role(spec: dict) -> None:
    """One hivemind.Optimizer peer (run inside its home): the same model, data shard rule, batch, Adam,
    warm-up and gradient clipping as a murmur node; it writes its step and, every snapshot_every steps,
    its parameters, as a node's checkpoint holds them."""
    import hivemind
    import torch

    from node.train.data import embedded_corpus, peer_shard, training_batch
    from node.train.models import build_named_model

    torch.set_num_threads(1)
    workdir, index = Path(spec["workdir"]), spec["index"]
    p2p_opts = {"host_maddrs": [spec["listen"]], "announce_maddrs": [spec["announce"]], "nat_port_map": False,
                "use_relay": False, "auto_nat": False}
    if index == 0:
        dht = hivemind.DHT(start=True, **p2p_opts)
        _write_json(workdir / "dht.json", {"maddrs": [f"{spec['announce']}/p2p/{dht.peer_id}"]})
    else:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not (workdir / "dht.json").exists():
            if time.monotonic() > deadline:
                raise TimeoutError("the first hivemind peer never wrote its address")
            time.sleep(0.3)
        dht = hivemind.DHT(start=True, initial_peers=json.loads((workdir / "dht.json").read_text())["maddrs"],
                           **p2p_opts)
    peer_id = str(dht.peer_id)
    corpus = embedded_corpus(workdir, 0)
    shard = peer_shard(corpus, peer_id)
    model = build_named_model(spec["model"], seed=0)
    batch, context = spec["batch_size"], 128
    opt = hivemind.Optimizer(
        dht=dht, run_id="wan", params=model.parameters(), optimizer=lambda params: torch.optim.Adam(params, lr=spec["lr"]),
        batch_size_per_step=batch, target_batch_size=spec["nodes"] * batch * spec["every"], use_local_updates=True,
        matchmaking_time=3.0, averaging_timeout=120.0, verbose=False)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # hivemind's averager set it to ignored
    deadline = time.monotonic() + 60 * spec["max_minutes"]
    step = 0
    # like a murmur node, a peer trains until it is stopped: peers past --steps keep the swarm's epochs going
    # for one that lags (a hivemind peer alone cannot find an averaging group and stalls)
    while not (workdir / "stop").exists() and time.monotonic() < deadline:
        lr = spec["lr"] * min(1.0, (step + 1) / spec["warmup"]) if spec["warmup"] else spec["lr"]
        for group in opt.opt.param_groups:  # the inner torch optimizer's groups (opt.param_groups are copies)
            group["lr"] = lr
        x, y = training_batch(shard, peer_id, step, batch, context)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        step += 1
        if step % spec["snapshot_every"] == 0:
            tmp = workdir / f".snap-n{index}-{step}.npz"
            np.savez(tmp, **{f"t/param/{name}": p.detach().numpy().reshape(-1).copy()
                             for name, p in model.named_parameters()})
            tmp.rename(workdir / f"snap-n{index}-{step}.npz")
        _write_json(workdir / f"progress{index}.json", {"t": time.time(), "step": step, "epoch": opt.local_epoch})
    opt.shutdown()
    dht.shutdown()


def _write_json(path: Path, value: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    tmp.rename(path)


# ---- evaluation, off the clock -----------------------------------------------------------------------


def evaluate(trace: Trace, workdir: Path, args: argparse.Namespace) -> None:
    """The validation loss of the swarm-average model at every snapshot step all nodes reached."""
    import torch

    from node.swarm.loop import EVAL_BATCH_SIZE
    from node.train.data import embedded_corpus, validation_batches
    from node.train.models import build_named_model, mean_cross_entropy

    corpus = embedded_corpus(workdir, 0)
    model = build_named_model(args.model, seed=0)
    params = dict(model.named_parameters())
    for step in trace.snapshots:
        total: dict[str, np.ndarray] = {}
        for i in range(args.nodes):
            saved = _snapshot_params(workdir, i, step)
            for name in params:
                value = saved[name].astype(np.float64)
                total[name] = total[name] + value if name in total else value
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(torch.from_numpy((total[name] / args.nodes).astype(np.float32)).view_as(p))
        trace.losses[step] = mean_cross_entropy(model, validation_batches(corpus.val, EVAL_BATCH_SIZE, 128,
                                                                          args.eval_batches))


def _snapshot_params(workdir: Path, i: int, step: int) -> dict[str, np.ndarray]:
    """Node i's parameters at `step`: a murmur checkpoint's, or a hivemind peer's own snapshot."""
    from node.train.checkpoint import read_checkpoint_file

    npz = workdir / f"snap-n{i}-{step}.npz"
    if npz.exists():
        with np.load(npz) as saved:
            return {k[len("t/param/"):]: saved[k] for k in saved.files}
    tensors = read_checkpoint_file(workdir / f"snap-n{i}-{step}.safetensors").tensors
    return {k[len("param/"):]: v for k, v in tensors.items() if k.startswith("param/")}


# ---- plan accuracy ----------------------------------------------------------------------------------


def predicted_step(config: Config, args: argparse.Namespace, step_time: float) -> tuple[float, float]:
    """`murmur plan`'s step time for this configuration given the compute-only step time measured in the
    run, and the round's local CPU work it counted. That work is measured by `murmur plan` itself next to
    a step of the model, and scaled by the run's step over that step: both ran on the same (shared) cores."""
    assert config.plan is not None
    common = [MURMUR, "plan", "--model", args.model, "--peers", str(args.nodes), "--bandwidth-mbit", str(args.rate_mbit),
              "--latency-ms", str(args.delay_ms), "--batch-size", str(args.batch_size), "--context", str(args.context),
              "--json",
              *_flag_args(config.plan)]

    def plan(*extra: str) -> dict:
        out = subprocess.run([*common, *extra], capture_output=True, text=True, timeout=600, cwd=REPO)
        if out.returncode != 0:
            raise RuntimeError(f"murmur plan failed: {out.stderr}")
        return json.loads(out.stdout)

    here = plan("--round-cpu", "measure")["inputs"]
    round_cpu = here["round_cpu_s"] * step_time / here["step_time_s"]
    return plan("--step-time", f"{step_time:.6f}", "--round-cpu", f"{round_cpu:.6f}")["gossip"]["step_s"], round_cpu


# ---- report -----------------------------------------------------------------------------------------


def report(traces: dict[str, Trace], cfgs: dict[str, Config], args: argparse.Namespace) -> list[str]:
    # step times leave out the start (quorum, first dials, lag waits): the first fifth of the steps
    def warm_of(key: str) -> int:
        return max(3, (cfgs[key].steps or args.steps) // 5)

    warm = warm_of("compute")
    base = traces.get("dadam-fp32")
    base_hit = base.to_target(args.target) if base else None
    lines = [f"### Time to validation loss {args.target:g}: {args.nodes} nodes, {args.rate_mbit:g} Mbit/s each way, "
             f"{args.delay_ms:g} ms one-way, model {args.model}, batch {args.batch_size} x {args.context} per node"
             + (f"; forward and backward mocked as a {args.mock_gpu_step:g} s sleep (a GPU leaving the CPU free), "
                "so no losses" if getattr(args, "mock_gpu_step", None) else ""), "",
             "| configuration | time to target s | at step | s / step | MB / step / node (sent + received) | "
             "time to target vs DAdam fp32 |", "|---|---:|---:|---:|---:|---:|"]
    for key, trace in traces.items():
        hit = trace.to_target(args.target)
        step, moved = trace.step_time(warm_of(key)), trace.bytes_per_step()
        ratio = f"{base_hit[1] / hit[1]:.2f}x faster" if base_hit and hit and key != "dadam-fp32" else "-"
        lines.append(f"| {cfgs[key].name} | {f'{hit[1]:.0f}' if hit else 'not reached'} | {hit[0] if hit else '-'} | "
                     f"{f'{step:.2f}' if step else '-'} | {f'{moved / 1e6:.3f}' if moved else '-'} | {ratio} |")
    lines += ["", "Validation loss of the swarm-average model at each snapshot step (seconds since the first step):", ""]
    for key, trace in traces.items():
        curve = ", ".join(f"{step}: {loss:.3f} ({trace.snapshots[step]:.0f} s)" for step, loss in sorted(trace.losses.items()))
        peak = f"; peak RSS per node {', '.join(f'{gb:.1f}' for gb in trace.peak_rss_gb)} GB" if trace.peak_rss_gb else ""
        lines.append(f"- {key}: {curve or '-'}{f' ({trace.note})' if trace.note else ''}{peak}")
    compute = traces.get("compute")
    compute_step = compute.step_time(warm) if compute else None
    diloco = traces.get("diloco")
    diloco_step = diloco.step_time(warm_of("diloco")) if diloco else None
    if compute_step and diloco_step:
        # the overlap target: the overlapped outer sync's step within 10% of inner steps alone
        lines += ["", f"Overlap: DiLoCo's step with its outer sync overlapped {diloco_step:.3f} s against the "
                  f"compute-only step {compute_step:.3f} s: {diloco_step / compute_step:.2f}x "
                  f"({'within' if diloco_step <= 1.10 * compute_step else 'NOT within'} 10%)"]
    planned = [key for key in traces if cfgs[key].plan is not None]
    if compute_step and planned:
        lines += ["", f"### Plan accuracy: predicted against measured step time (compute-only step {compute_step:.3f} s, "
                  "measured in the same command)", "",
                  "| configuration | measured s / step | predicted s / step | of which a round's CPU work | "
                  "predicted / measured | within 25% |", "|---|---:|---:|---:|---:|---|"]
        for key in planned:
            measured = traces[key].step_time(warm_of(key))
            if measured is None:
                continue
            predicted, round_cpu = predicted_step(cfgs[key], args, compute_step)
            ratio = predicted / measured
            lines.append(f"| {cfgs[key].name} | {measured:.3f} | {predicted:.3f} | {round_cpu:.3f} | {ratio:.2f} | "
                         f"{'yes' if abs(ratio - 1) <= 0.25 else 'NO'} |")
    return lines


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # run the clean-up (nodes, relay, namespaces) on SIGTERM too


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.bench_wan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="compute,dadam-fp32,choco-topk,diloco,hivemind")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--rate-mbit", type=float, default=20.0)
    parser.add_argument("--delay-ms", type=float, default=25.0, help="one-way delay the relay adds (default 25)")
    parser.add_argument("--model", default="moe")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--context", type=int, default=128, help="tokens per training sequence (default 128; "
                        "validation always uses 128)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=100, help="steps every configuration takes (default 100)")
    parser.add_argument("--snapshot-every", type=int, default=10)
    parser.add_argument("--eval-batches", type=int, default=8, help="validation batches of 32 x 128 (default 8, "
                        "as a node evaluates)")
    parser.add_argument("--target", type=float, default=2.6, help="validation loss to reach (default 2.6)")
    parser.add_argument("--max-minutes", type=float, default=20.0, help="per configuration (default 20)")
    parser.add_argument("--exchange-timeout", type=float, default=30.0)
    parser.add_argument("--diloco-h", type=int, default=25)
    parser.add_argument("--diloco-steps", type=int, help="steps of the diloco row (default --steps)")
    parser.add_argument("--hivemind-every", type=int, default=10, help="steps of the swarm between averagings")
    parser.add_argument("--mock-gpu-step", type=float, metavar="SECONDS",
                        help="replace each step's forward and backward pass by a sleep of SECONDS, as on a GPU that "
                        "leaves the CPU free (bench/mock_gpu_node.py): step times and the overlap only, no losses; "
                        "murmur configurations only")
    parser.add_argument("--json-out", type=Path, help="also write the traces here")
    parser.add_argument("--keep", type=Path, help="work in this directory (node logs, snapshots) and keep it")
    parser.add_argument("--report", type=Path, help="print the report of traces written by --json-out (same other "
                        "flags), without running anything")
    parser.add_argument("--role", choices=("hivemind",), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.model.startswith("hf:"):  # the nodes run in their own work directories
        args.model = "hf:" + str(Path(args.model[3:]).resolve())
    if args.role == "hivemind":
        hivemind_role(json.loads(args.spec))
        return 0
    from bench.wan_net import wan
    from node.net.proc import popen

    if args.report is not None:
        saved = json.loads(args.report.read_text())
        traces = {key: Trace(**{**value, "snapshots": {int(k): v for k, v in value["snapshots"].items()},
                                "losses": {int(k): v for k, v in value["losses"].items()}})
                  for key, value in saved.items()}
        print("\n".join(report(traces, configs(args), args)))
        return 0
    signal.signal(signal.SIGTERM, _interrupted)
    signal.signal(signal.SIGINT, _interrupted)  # a background job's SIGINT is ignored otherwise
    cfgs = configs(args)
    wanted = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(wanted) - cfgs.keys()
    if unknown:
        parser.error(f"--configs: unknown {', '.join(sorted(unknown))}")
    if args.mock_gpu_step and any(cfgs[key].kind != "murmur" for key in wanted):
        parser.error("--mock-gpu-step: murmur configurations only")
    if not _has_diloco():
        for key in {"diloco", "diloco-awaited"} & set(wanted):
            print(f"note: this murmur has no --optimizer diloco yet; the {key} row is skipped", flush=True)
            wanted.remove(key)
    print(f"command: .venv/bin/python -m bench.bench_wan {' '.join(argv)}".rstrip())
    print(f"python {platform.python_version()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start",
          flush=True)
    traces: dict[str, Trace] = {}
    with (contextlib.nullcontext(str(args.keep)) if args.keep else tempfile.TemporaryDirectory(prefix="murmur-wan-")) as tmp:
        with wan("wan", args.nodes, rate_mbit=args.rate_mbit, delay_ms=args.delay_ms) as net:
            routes = [arg for lh, lp, th, tp in net.routes() for arg in ("--route", f"{lh}:{lp}={th}:{tp}")]
            relay = popen(net.hub_command([sys.executable, "-m", "bench.wan_relay", "--delay-ms", str(args.delay_ms),
                                           *routes]), cwd=REPO, stdout=subprocess.PIPE, text=True,
                          start_new_session=True)
            try:
                print(relay.stdout.readline().strip(), flush=True)
                for key in wanted:
                    started = time.monotonic()
                    run = run_hivemind if cfgs[key].kind == "hivemind" else run_murmur
                    traces[key] = run(net, cfgs[key], args, Path(tmp) / key)
                    t = traces[key]
                    print(f"{key}: step time {t.step_time(3)}, {len(t.snapshots)} snapshots {t.note} "
                          f"({time.monotonic() - started:.0f} s, load average {os.getloadavg()[0]:.1f})", flush=True)
            finally:
                _stop_all([relay])
        for key, trace in traces.items():
            if not args.mock_gpu_step:  # mocked steps train nothing: no loss to evaluate
                evaluate(trace, Path(tmp) / key, args)
            if args.json_out:
                args.json_out.write_text(json.dumps({k: asdict(v) for k, v in traces.items()}))
    print("\n".join(report(traces, cfgs, args)))
    return 0


def _has_diloco() -> bool:
    from node.config import OPTIMIZERS

    return "diloco" in OPTIMIZERS


if __name__ == "__main__":
    raise SystemExit(main())
