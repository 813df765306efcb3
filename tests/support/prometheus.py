"""A real Prometheus for tests (Debian's `prometheus` package, which `make test` installs) and the
observability files of docker/: the dashboard's queries, the compose profile. Not a test module.

`Prometheus` runs the binary on a free loopback port with a throwaway storage directory and a
generated config whose only targets are the ones a test names (no remote write, no other scrape); it is
stopped by its PID when the test leaves it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
COMPOSE_FILE = DOCKER / "compose.yaml"
PROMETHEUS_CONFIG = DOCKER / "prometheus" / "prometheus.yml"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "murmur.json"
GRAFANA_PROVISIONING = DOCKER / "grafana" / "provisioning"
PROFILE = "observability"
MONITOR_PORT = 7690

# Where Debian puts the binaries; PATH first, for a Prometheus installed another way.
PROMETHEUS_BIN = shutil.which("prometheus") or ("/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK)
                                                else None)
PROMTOOL_BIN = shutil.which("promtool") or ("/usr/bin/promtool" if os.access("/usr/bin/promtool", os.X_OK) else None)
MISSING = "prometheus is not installed: apt-get install prometheus (`make test` does)"

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0
REQUEST_TIMEOUT_S = 10.0
# What the dashboard's Grafana variables stand for when a test runs its queries against Prometheus.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$instance": ".*"}


# ---- the repository's files ---------------------------------------------------------------------

def compose_document() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def node_services(document: dict) -> dict[str, dict]:
    """The services a plain `docker compose up` starts: the nodes (no profile)."""
    return {name: spec for name, spec in document["services"].items() if not spec.get("profiles")}


def profile_services(document: dict, profile: str = PROFILE) -> dict[str, dict]:
    return {name: spec for name, spec in document["services"].items() if profile in spec.get("profiles", ())}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_queries(board: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel's targets, and of the query variables."""
    queries = [(panel["title"], target["expr"]) for panel in board["panels"] for target in panel.get("targets", [])]
    for variable in board.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable["query"]
            queries.append((f"${variable['name']}", query["query"] if isinstance(query, dict) else query))
    return queries


def concrete(expr: str) -> str:
    """The PromQL Grafana would send: its variables replaced by what a test stands them for."""
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def metric_names(expr: str) -> set[str]:
    """The murmur metric names a PromQL expression reads (label_values(m, l) included)."""
    return set(re.findall(r"\bmurmur_[a-zA-Z0-9_]*", expr))


# ---- a running Prometheus -----------------------------------------------------------------------

def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def scrape_config(targets: Sequence[str], interval_s: int = 2) -> dict:
    """A Prometheus config scraping `targets` (host:port) and nothing else, every `interval_s`."""
    return {
        "global": {"scrape_interval": f"{interval_s}s", "scrape_timeout": f"{interval_s}s",
                   "evaluation_interval": f"{interval_s}s"},
        "scrape_configs": [{"job_name": "murmur", "metrics_path": "/metrics",
                            "static_configs": [{"targets": list(targets)}]}],
    }


def promtool_check_config(path: Path) -> subprocess.CompletedProcess:
    assert PROMTOOL_BIN is not None
    # --syntax-only: a file the config names need not exist on this machine (none is named here)
    return subprocess.run([PROMTOOL_BIN, "check", "config", "--syntax-only", str(path)], capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)


class Prometheus:
    """One prometheus process on 127.0.0.1 with its own storage under `root`; a context manager that
    stops it (SIGTERM, then SIGKILL) by PID."""

    def __init__(self, root: Path, config: dict) -> None:
        self.root = root
        self.config_path = root / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log_path = root / "prometheus.log"
        self.process: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> Prometheus:
        assert PROMETHEUS_BIN is not None, MISSING
        # a port found free can be taken before prometheus binds it: one more try with another
        for attempt in range(2):
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen(
                    [PROMETHEUS_BIN, f"--config.file={self.config_path}",
                     f"--storage.tsdb.path={self.root / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                     "--storage.tsdb.retention.time=1h", "--log.level=info"],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=self.root,
                    start_new_session=True)
            try:
                self._wait_ready()
                return self
            except AssertionError:
                self.stop()
                if attempt == 1:
                    raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"prometheus exited with {self.process.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(OSError), \
                    urllib.request.urlopen(f"{self.url}/-/ready", timeout=REQUEST_TIMEOUT_S) as response:
                if response.status == 200:
                    return
            time.sleep(0.5)
        raise AssertionError(f"prometheus not ready within {READY_TIMEOUT_S:g} s:\n{self.log_tail()}")

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        # start_new_session made it a group leader, not reaped yet: its PID is still ours to signal
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
            process.wait(STOP_TIMEOUT_S)

    def log_tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def api(self, path: str, **params: str) -> dict:
        """GET /api/v1/<path>; its `data` (AssertionError with Prometheus's error otherwise)."""
        url = f"{self.url}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        try:
            with urllib.request.urlopen(url, timeout=REQUEST_TIMEOUT_S) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:
            body = json.load(exc)
        assert body.get("status") == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, promql: str) -> list[dict]:
        """An instant query's vector: [{"metric": {labels}, "value": [t, "v"]}, ...]."""
        data = self.api("query", query=promql)
        assert data["resultType"] == "vector", data
        return data["result"]

    def targets(self) -> list[dict]:
        return self.api("targets", state="active")["activeTargets"]


def by_instance(result: list[dict]) -> dict[str, float]:
    """{instance: value} of a query's vector (one series per instance expected)."""
    values: dict[str, float] = {}
    for series in result:
        instance = series["metric"]["instance"]
        assert instance not in values, f"two series for {instance}: {result}"
        values[instance] = float(series["value"][1])
    return values
