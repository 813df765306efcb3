"""A harness for multi-process tests: real `murmur node`/`murmur join` processes on loopback, killed even
when a test fails. Not a test module.

It starts them, reads their status and checkpoints, signals them, and kills every process they started;
the swarm test files build their fixtures on `Swarm`."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np
import psutil

from node.cli.status import fetch_status
from node.runtime.ready_line import find_ready_line
from node.train.checkpoint import CHECKPOINT_FILE, load_checkpoint

MURMUR = Path(sys.executable).with_name("murmur")
HOSTILE = Path(__file__).resolve().with_name("hostile.py")  # a hostile node: the real one with a behaviour replaced
# Importing torch and hivemind costs seconds of CPU per process; a loaded 2-core machine starts 8 at once.
READY_TIMEOUT_S = 120.0

# What every test node gets unless a test says otherwise: small, fast, loopback, chatty enough to debug.
# The proof of work of the harness's swarms, unless a test sets its own: the default 20 bits cost each node
# a second or more of a core at start, a few minutes of the suite's two cores over its hundreds of nodes,
# and only the sybil tests need it to cost anything (test_sybils_swarm sets its difficulty, and test_sybils
# checks the minting and the default).
TEST_IDENTITY_WORK = 4
DEFAULT_FLAGS: Mapping[str, object] = {
    "model": "vector",
    "dim": 64,
    "round_interval": 0.4,
    "heartbeat": 1,
    "exchange_timeout": 2,
    "log_level": "info",
}

T = TypeVar("T")


def initial_vector(seed: int, dim: int) -> np.ndarray:
    """The vector a fresh node with `--seed seed --dim dim` starts from (see node.runtime.vector.initial_state)."""
    return np.random.default_rng(seed).standard_normal(dim).astype(np.float32)


def consensus_distance(vectors: Iterable[np.ndarray]) -> float:
    """max_i ||x_i - mean||_2, in float64: how far the farthest node is from the swarm's average."""
    stacked = np.stack(list(vectors)).astype(np.float64)
    return float(np.linalg.norm(stacked - stacked.mean(axis=0), axis=1).max())


def mean_vector(vectors: Iterable[np.ndarray]) -> np.ndarray:
    return np.stack(list(vectors)).astype(np.float64).mean(axis=0)


def check_consensus(nodes: list[Node], report: str, logs: str) -> None:
    """The nodes' final checkpoints agree to 1e-6 of their initial spread, and their average is their
    initial vectors' average to 1e-6 relative (mixing was doubly stochastic: only float32 rounding)."""
    initial = [initial_vector(node.seed, node.dim) for node in nodes]
    final = [node.checkpoint()[0] for node in nodes]
    start, end = consensus_distance(initial), consensus_distance(final)
    assert end < 1e-6 * start, f"consensus distance {end:.3g} from {start:.3g}\n{report}\n{logs}"
    drift = np.linalg.norm(mean_vector(final) - mean_vector(initial))
    assert drift < 1e-6 * np.linalg.norm(mean_vector(initial)), f"the average moved by {drift:.3g}\n{report}"


def wait_for(check: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.2) -> T:
    """Poll `check` until it returns something truthy; AssertionError naming `what` after `timeout_s`.

    Exceptions from `check` (a node that does not answer yet) count as "not yet"; the last one is
    shown if time runs out.
    """
    deadline = time.monotonic() + timeout_s
    last: object = None
    while True:
        try:
            value = check()
            if value:
                return value
            last = value
        except Exception as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what} (last: {last!r})")
        time.sleep(interval_s)


def _flag_args(flags: Mapping[str, object]) -> list[str]:
    args: list[str] = []
    for key, value in flags.items():
        if value is None:
            continue
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args


def clean_env() -> dict[str, str]:
    """This environment without MURMUR_* variables, so only the flags a test passes configure a node."""
    return {k: v for k, v in os.environ.items() if not k.startswith("MURMUR_")}


@dataclass
class Node:
    """One started `murmur` process and what its ready line said."""

    name: str
    data_dir: Path
    seed: int
    dim: int
    argv: list[str]
    process: subprocess.Popen
    log_dir: Path
    peer_id: str = ""
    monitor_url: str = ""
    maddrs: tuple[str, ...] = ()
    invite: str = ""  # NAME@FOUNDER_PEER_ID, from the ready line
    # the node's child processes (p2pd), recorded once it is ready, so they can be checked and killed
    children: list[psutil.Process] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def stdout_path(self) -> Path:
        return self.log_dir / f"{self.name}.out"

    @property
    def stderr_path(self) -> Path:
        return self.log_dir / f"{self.name}.err"

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.process.poll() is None

    def status(self) -> dict:
        return fetch_status(self.monitor_url)

    def reread_ready_line(self) -> bool:
        """Take the node's latest ready line (a node that follows a new config prints another); whether
        it changed."""
        ready = find_ready_line(self.stdout(), latest=True)
        if ready is None or ready.monitor_url == self.monitor_url:
            return False
        self.peer_id, self.monitor_url, self.maddrs, self.invite = ready.peer_id, ready.monitor_url, ready.maddrs, \
            ready.invite
        return True

    def checkpoint(self) -> tuple[np.ndarray, int]:
        """(vector, round) from the node's checkpoint."""
        ckpt = load_checkpoint(self.data_dir / CHECKPOINT_FILE)
        assert ckpt is not None, f"no checkpoint in {self.data_dir}"
        return ckpt.tensors["params"].copy(), int(ckpt.meta["round"])

    def signal(self, sig: signal.Signals) -> None:
        self.process.send_signal(sig)

    def stop(self, timeout_s: float = 10.0) -> tuple[int, float]:
        """SIGTERM; wait for the exit. Returns (exit status, seconds it took)."""
        started = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        rc = self.process.wait(timeout_s)
        return rc, time.monotonic() - started

    def log_tail(self, lines: int = 30) -> str:
        text = self.stderr().splitlines()[-lines:]
        return f"--- {self.name} (pid {self.pid}) stderr ---\n" + "\n".join(text)


class Swarm:
    """The node processes of one test, all under `root`. Use as a context manager: leaving it kills
    every process it started (SIGKILL to each node's process group and recorded children)."""

    def __init__(self, root: Path, **flags: object) -> None:
        self.root = root
        self.flags = {**DEFAULT_FLAGS, **flags}
        self.nodes: list[Node] = []
        self.log_dir = root / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> Swarm:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- starting ------------------------------------------------------------------------------

    def spawn(self, name: str, *, seed: int, join: Node | None, data_dir: Path | None = None,
              extra_args: Iterable[str] = (), launcher: Iterable[str] = (str(MURMUR),), hostile: Sequence[str] = (),
              **flags: object) -> Node:
        """Start one process (no waiting): `murmur node` if `join` is None, else `murmur join` through it
        (with the founder's invite). `launcher` runs the command line instead of `murmur` (a hostile node);
        `hostile` is the attack's part of a support.hostile command line (`hostile_argv`), a shorthand
        for the launcher `python tests/support/hostile.py <hostile> --`."""
        merged = {**self.flags, **flags}
        # the vector payload's tests check the weighted rule's exact averages: the robust default
        # (adaptive_clip) bends them on purpose, so vector nodes ask for the weighted rule unless told
        if merged.get("model") == "vector":
            merged.setdefault("mixing", "weighted")
        if join is None:  # a founder: its identity work is the swarm's (a `murmur node` flag only)
            merged.setdefault("identity_work", TEST_IDENTITY_WORK)
        data_dir = data_dir or self.root / name
        argv = ["node" if join is None else "join", "--data-dir", str(data_dir), "--monitor-port", "0",
                "--seed", str(seed), *_flag_args(merged), *extra_args]
        if join is not None:
            argv += ["--peers", join.maddrs[0], "--invite", join.invite]
        if hostile:
            launcher = (sys.executable, str(HOSTILE), *hostile, "--")
        return self.launch(name, [*launcher, *argv], data_dir=data_dir, seed=seed, dim=int(merged["dim"]))

    def launch(self, name: str, argv: list[str], *, data_dir: Path | None = None, seed: int = 0,
               dim: int = 0) -> Node:
        """Start any process of the test (a bootstrap node, a hostile helper) under the same cleanup."""
        suffix = sum(1 for n in self.nodes if n.name == name or n.name.startswith(f"{name}~"))
        log_name = name if suffix == 0 else f"{name}~{suffix}"  # a restarted node keeps its old logs
        with open(self.log_dir / f"{log_name}.out", "wb") as out, open(self.log_dir / f"{log_name}.err", "wb") as err:
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=clean_env(),
                                       cwd=self.root, start_new_session=True)
        node = Node(log_name, data_dir or self.root / name, seed, dim, argv, process, self.log_dir)
        self.nodes.append(node)
        return node

    def wait_ready(self, nodes: Iterable[Node], timeout_s: float = READY_TIMEOUT_S) -> None:
        pending = list(nodes)
        deadline = time.monotonic() + timeout_s
        while pending:
            for node in list(pending):
                ready = find_ready_line(node.stdout())
                if ready:
                    node.peer_id, node.monitor_url, node.maddrs = ready.peer_id, ready.monitor_url, ready.maddrs
                    node.invite = ready.invite
                    with contextlib.suppress(psutil.NoSuchProcess):
                        node.children = psutil.Process(node.pid).children(recursive=True)
                    pending.remove(node)
                elif not node.alive():
                    raise AssertionError(f"{node.name} exited with {node.process.returncode} before it was ready\n"
                                         f"{node.log_tail()}")
            if pending and time.monotonic() > deadline:
                raise AssertionError(f"not ready within {timeout_s:g} s: {[n.name for n in pending]}\n"
                                     + "\n".join(n.log_tail() for n in pending))
            time.sleep(0.1)

    def found(self, name: str = "n0", seed: int = 0, **flags: object) -> Node:
        node = self.spawn(name, seed=seed, join=None, **flags)
        self.wait_ready([node])
        return node

    def start(self, n: int, **flags: object) -> list[Node]:
        """A founder n0 (seed 0), then n-1 joiners n1.. (seeds 1..n-1) started together; all ready."""
        founder = self.found(**flags)
        joiners = [self.spawn(f"n{seed}", seed=seed, join=founder, **flags) for seed in range(1, n)]
        self.wait_ready(joiners)
        return [founder, *joiners]

    # ---- observing -----------------------------------------------------------------------------

    def statuses(self, nodes: Iterable[Node]) -> list[dict]:
        return [node.status() for node in nodes]

    def wait_views(self, nodes: list[Node], expected: Iterable[Node], timeout_s: float = 60.0) -> None:
        """Until every node in `nodes` sees exactly `expected` (by peer id) in its view."""
        want = sorted(n.peer_id for n in expected)

        def views_agree() -> bool:
            return all(sorted(p["peer_id"] for p in s["peers"]) == want for s in self.statuses(nodes))

        wait_for(views_agree, timeout_s, f"views of {[n.name for n in nodes]} to be {want}")

    def wait_rounds(self, nodes: list[Node], rounds: int, timeout_s: float = 90.0) -> list[dict]:
        """Until every node has run at least `rounds` gossip rounds; returns their statuses then."""
        def all_ran() -> list[dict] | None:
            statuses = self.statuses(nodes)
            return statuses if all(s["rounds_run"] >= rounds for s in statuses) else None

        return wait_for(all_ran, timeout_s, f"{rounds} rounds on {[n.name for n in nodes]}")

    def signal_all(self, nodes: list[Node], sig: signal.Signals = signal.SIGTERM) -> None:
        for node in nodes:
            node.signal(sig)

    def stop_all(self, nodes: list[Node], timeout_s: float = 15.0) -> list[int]:
        """SIGTERM all at once (so none gossips alone for long), then wait; returns exit statuses."""
        self.signal_all(nodes)
        return [node.process.wait(timeout_s) for node in nodes]

    # ---- cleaning up ---------------------------------------------------------------------------

    def close(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(psutil.Error):
                if node.alive():
                    node.children = _union(node.children, psutil.Process(node.pid).children(recursive=True))
            if node.process.poll() is None:
                # start_new_session made the node a group leader; it is not reaped, so its id is still ours
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(node.pid, signal.SIGKILL)
            for child in node.children:
                with contextlib.suppress(psutil.Error):
                    child.kill()  # psutil refuses if the pid now belongs to another process
        for node in self.nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.process.wait(10)

    def logs(self) -> str:
        return "\n".join(node.log_tail() for node in self.nodes)


def summary(nodes: Iterable[Node], statuses: Iterable[dict]) -> str:
    """One line per node of what a failed test wants to know: rounds run, skips and errors."""
    return "\n".join(
        f"{node.name}: round {s['round']} rounds_run {s['rounds_run']} skipped {s['skipped']} errors {s['errors']}"
        for node, s in zip(nodes, statuses)
    )


def _union(a: list[psutil.Process], b: list[psutil.Process]) -> list[psutil.Process]:
    seen = {p.pid for p in a}
    return a + [p for p in b if p.pid not in seen]
