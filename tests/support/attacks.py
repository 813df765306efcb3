"""A five-node swarm of real `murmur` processes with one node (n3) optionally hostile (support.hostile), run
the same way for a control and an attack. Not a test module.

Founder n0 and joiners n1, n2, n3 start together, n4 joins mid-run. The attack test
(tests/test_swarm_attacks.py) and bench/bench_attacks.py build on it."""

from __future__ import annotations

import os
import re
import threading
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from support.hostile import hostile_counts
from support.swarm_harness import Node, Swarm, wait_for

SUPPORT = Path(__file__).resolve().parent
FOUNDING_HONEST = ("n0", "n1", "n2")  # compared at the fixed step; n4 joins at a step the machine's load decides
HOSTILE = "n3"


@dataclass(frozen=True)
class AttackSetup:
    """One swarm run. `recipe` is the founder's (steps 0: until stopped, so that a hostile node's
    huge step claim does not simply mark it done); every node evaluates every `steps` steps, and the
    founding honest nodes' losses at `steps` are what a control and an attack compare."""

    recipe: Mapping[str, object]
    node: Mapping[str, object]
    steps: int
    join_at: int
    hostile: Sequence[str] = ()  # support.hostile.hostile_argv for n3; empty: the control
    timeout_s: float = 600.0
    founder_args: Sequence[str] = ()  # flags of the founder's without a value (e.g. --spes)


@dataclass
class SwarmRun:
    statuses: dict[str, dict]  # n0, n1, n2: status when it evaluated at `steps`; n4: once it joined and evaluated
    nodes: dict[str, Node]
    seconds: dict[str, float]  # founding honest node -> seconds from its first step to its evaluation at `steps`
    metrics: dict[str, str] = field(default_factory=dict)  # honest node -> its /metrics text at the end
    hostile_counts: dict[str, int] = field(default_factory=dict)

    def val_loss(self, name: str) -> float:
        return float(self.statuses[name]["training"]["val_loss"])


def with_support_path(env: Mapping[str, str]) -> str:
    """PYTHONPATH with tests/support first: the nodes import the tiny models from there."""
    return os.pathsep.join(filter(None, [str(SUPPORT), env.get("PYTHONPATH")]))


def run_swarm(root: Path, identities: Path, setup: AttackSetup) -> SwarmRun:
    """Run the swarm until n0, n1 and n2 evaluated at `setup.steps` and n4 joined; then stop it.
    The same `identities` directory in a control and an attack gives the same peer ids (so the same
    data shards and topology ranks)."""
    identities.mkdir(parents=True, exist_ok=True)
    model = {"model": setup.recipe["model"]}

    def flags(name: str) -> dict[str, object]:
        return {**setup.node, "identity": identities / f"{name}.key", **(model if name != "n0" else {})}

    with Swarm(root) as swarm:
        n0 = swarm.found("n0", seed=0, extra_args=list(setup.founder_args), **setup.recipe, **flags("n0"))
        nodes = {"n0": n0}
        for i in (1, 2, 3):
            name = f"n{i}"
            hostile = setup.hostile if name == HOSTILE else ()
            nodes[name] = swarm.spawn(name, seed=i, join=n0, hostile=hostile,
                                      min_peers=setup.recipe.get("min_peers", 4), **flags(name))
        swarm.wait_ready(list(nodes.values())[1:])
        watch = _Watch(nodes, setup.steps)
        watch.start()
        try:
            wait_for(lambda: n0.status()["training"]["step"] >= setup.join_at, setup.timeout_s,
                     f"the founder at step {setup.join_at}")
            nodes["n4"] = swarm.spawn("n4", seed=4, join=n0, **flags("n4"))
            swarm.wait_ready([nodes["n4"]])
            wait_for(lambda: watch.complete() or watch.missed, setup.timeout_s,
                     f"n0-n2 evaluated at step {setup.steps} and n4 joined")
        finally:
            watch.stop()
        assert not watch.missed, "; ".join(watch.missed)
        seen, seconds = watch.seen, watch.seconds()
        honest = [name for name in nodes if not (setup.hostile and name == HOSTILE)]
        metrics = {name: fetch_metrics(nodes[name]) for name in honest}
        counts = hostile_counts(nodes[HOSTILE].stderr()) if setup.hostile else {}
        codes = swarm.stop_all(list(nodes.values()))
        assert codes == [0] * len(nodes), f"exit statuses {codes}\n{swarm.logs()}"
    return SwarmRun(seen, nodes, seconds, metrics, counts)


class _Watch(threading.Thread):
    """Polls the nodes in the background for the whole run, so that no evaluation at `steps` is missed
    while the test waits for something else (a node starting, on a loaded machine, takes a while)."""

    def __init__(self, nodes: dict[str, Node], steps: int) -> None:
        super().__init__(daemon=True, name="attack-watch")
        self._nodes, self._steps = nodes, steps
        self._stopping = threading.Event()
        self.seen: dict[str, dict] = {}
        self._first_step: dict[str, float] = {}
        self._done_at: dict[str, float] = {}
        self.missed: list[str] = []

    def run(self) -> None:
        while not self._stopping.wait(0.1):
            for name in (*FOUNDING_HONEST, "n4"):
                node = self._nodes.get(name)
                if node is None or name in self.seen or not node.monitor_url or self.missed:
                    continue
                try:
                    status = node.status()
                except Exception:  # not answering yet
                    continue
                self._observe(name, status, time.monotonic())

    def _observe(self, name: str, status: dict, now: float) -> None:
        training = status["training"]
        if name == "n4":
            # it evaluates after its download, or once it gave up on downloading (`joined` says why)
            caught_up = training.get("joined") is not None or training["started_from"] != "init"
            if caught_up and training["val_step"] is not None:
                self.seen[name] = status
            return
        if training["step"] >= 1:
            self._first_step.setdefault(name, now)
        if training["val_step"] == self._steps:
            self.seen[name], self._done_at[name] = status, now
        elif training["val_step"] is not None and training["val_step"] > self._steps:
            self.missed.append(f"{name} evaluated at step {training['val_step']} before it was seen at {self._steps}")

    def complete(self) -> bool:
        return len(self.seen) == len(FOUNDING_HONEST) + 1

    def seconds(self) -> dict[str, float]:
        return {name: self._done_at[name] - self._first_step[name] for name in FOUNDING_HONEST}

    def stop(self) -> None:
        self._stopping.set()
        self.join(10)


def fetch_metrics(node: Node) -> str:
    with urllib.request.urlopen(f"{node.monitor_url}/metrics", timeout=10) as reply:
        return str(reply.read().decode())


def metric(text: str, name: str, label: str = "") -> float:
    """A counter's value in a /metrics text (0 when absent)."""
    match = re.search(rf"^{re.escape(name)}{re.escape(label)} (\S+)$", text, flags=re.MULTILINE)
    return float(match.group(1)) if match else 0.0
