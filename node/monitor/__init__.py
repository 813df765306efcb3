"""The node's local monitor: a web page, its JSON API, server-sent events and Prometheus metrics,
served from the node's event loop; `NodeRuntime` (node.runtime.status) is its data source."""

from node.monitor.eventlog import EventLog, LogEntry
from node.monitor.history import Counters, HistoryRecorder, MixingStepEstimate, Sample, TrainingFigures
from node.monitor.server import MonitorServer, start_monitor
from node.monitor.source import MonitorSource
from node.monitor.topology_view import RoundGraphCache, round_graph

__all__ = [
    "Counters",
    "EventLog",
    "HistoryRecorder",
    "LogEntry",
    "MixingStepEstimate",
    "MonitorServer",
    "MonitorSource",
    "RoundGraphCache",
    "Sample",
    "TrainingFigures",
    "round_graph",
    "start_monitor",
]
