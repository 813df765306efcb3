"""What the monitor reads from a node: a small typed protocol the daemon's `NodeRuntime` implements
(and tests can implement without a swarm)."""

from __future__ import annotations

from typing import Any, Protocol

from node.monitor.eventlog import EventLog
from node.monitor.history import Counters, HistoryRecorder


class DoctorUnavailable(Exception):
    """`murmur doctor`'s checks cannot run on this node now (no host yet, or a check is running)."""


class MonitorSource(Protocol):
    """Every method is called from the event loop's thread and none may block; all but
    `evaluate_swarm_average` are cheap."""

    @property
    def history(self) -> HistoryRecorder:
        """The time series the sampler appends to (and the trainer records into)."""

    @property
    def events(self) -> EventLog:
        """Recent events and errors."""

    @property
    def record_ttl_s(self) -> float:
        """How long a peer's DHT record lives without a heartbeat."""

    def status(self) -> dict[str, Any]:
        """`/api/status` (see schemas/status.json)."""

    def peers(self) -> list[dict[str, Any]]:
        """The membership view, one object per peer (the items of schemas/peers.json)."""

    def topology(self) -> dict[str, Any]:
        """The current round's graph (schemas/topology.json), as of the last `refresh_topology`."""

    async def refresh_topology(self) -> None:
        """Bring `topology()` up to date; heavy work (a dense matrix, its eigenvalues) runs in a thread,
        and only when the graph's inputs changed."""

    def counters(self) -> Counters:
        """What one history sample takes from the node's counters."""

    async def doctor(self) -> dict[str, Any]:
        """`POST /api/doctor` (schemas/doctor.json): reachability checks that take seconds (dial-backs,
        circuit probes, neighbour probes). Raises DoctorUnavailable."""

    async def evaluate_swarm_average(self, save: bool = False) -> dict[str, Any]:
        """`POST /api/eval/average` (schemas/swarm_eval.json): the one method that does real work; it
        awaits the network and a thread, and with `save` writes the average model to disk. Raises
        node.swarm.swarm_eval.EvalBusy or EvalUnavailable."""
