"""The observability profile's files, in-process: the Grafana dashboard parses and every query reads a
metric the node exports (checked against a live exposition too); the compose profile is optional and
its Prometheus scrapes every node service; promtool accepts the shipped config and the dashboard's
PromQL where it is installed; the node's resident memory figure."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from node.config import NodeConfig
from node.monitor.metrics import METRIC_NAMES, exposition, metrics_registry, resident_memory_bytes
from node.runtime.status import NodeRuntime
from support.prometheus import (
    COMPOSE_FILE,
    DASHBOARD,
    DOCKER,
    GRAFANA_PROVISIONING,
    MONITOR_PORT,
    PROFILE,
    PROMETHEUS_CONFIG,
    PROMTOOL_BIN,
    compose_document,
    concrete,
    dashboard,
    dashboard_queries,
    metric_names,
    node_services,
    profile_services,
    promtool_check_config,
)

pytestmark = pytest.mark.unit

# What the dashboard must show (issue 27): each a metric some panel reads.
SHOWN = {"murmur_step", "murmur_loss", "murmur_tokens_per_second", "murmur_bytes_sent_total",
         "murmur_bytes_received_total", "murmur_peers_alive", "murmur_errors_total", "murmur_skipped_total",
         "murmur_resident_memory_bytes"}


def live_names() -> set[str]:
    """The sample names of an in-process node's /metrics, with a training step recorded."""
    runtime = NodeRuntime(NodeConfig(), founding=True)
    runtime.record(step=1, loss=2.5, tokens=64)
    text = exposition(metrics_registry(runtime, lambda: 0)).decode()
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


# ---- the dashboard ------------------------------------------------------------------------------

def test_every_dashboard_query_reads_metrics_the_node_exports():
    board = dashboard()
    queries = dashboard_queries(board)
    assert len(board["panels"]) >= 9 and len(queries) >= len(board["panels"])
    read: set[str] = set()
    for title, expr in queries:
        names = metric_names(expr)
        assert names, f"{title}: {expr!r} reads no murmur metric"
        unknown = names - set(METRIC_NAMES)
        assert not unknown, f"{title}: {expr!r} reads {sorted(unknown)}, which node/monitor/metrics.py does not export"
        read |= names
    assert read >= SHOWN, f"no panel shows {sorted(SHOWN - read)}"
    # and the names a node really serves (the declared list could drift from the collector)
    live = live_names()
    always = {"murmur_step", "murmur_bytes_sent_total", "murmur_bytes_received_total", "murmur_peers_alive",
              "murmur_loss", "murmur_resident_memory_bytes"}
    assert always <= live, sorted(always - live)


def test_the_name_check_catches_a_misspelt_metric():
    assert metric_names('rate(murmur_bytes_sent{instance=~"$instance"}[$__rate_interval])') == {"murmur_bytes_sent"}
    assert "murmur_bytes_sent" not in METRIC_NAMES  # a counter is exported with its _total suffix
    assert metric_names("sum by (instance) (up)") == set()


def test_every_panel_uses_the_dashboards_data_source_and_names_each_node():
    board = dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["includeAll"] and variables["instance"]["multi"]
    ids = [panel["id"] for panel in board["panels"]]
    assert len(set(ids)) == len(ids)
    for panel in board["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            # one line per node: the series are told apart by the scrape target
            assert "{{instance}}" in target["legendFormat"], (panel["title"], target)
            assert 'instance=~"$instance"' in target["expr"], (panel["title"], target)


@pytest.mark.skipif(PROMTOOL_BIN is None, reason="promtool is not installed (Debian's prometheus package has it)")
def test_promtool_parses_every_dashboard_query(tmp_path):
    exprs = [concrete(expr) for panel in dashboard()["panels"] for expr in (t["expr"] for t in panel["targets"])]
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:query{i}", "expr": expr}
                                                        for i, expr in enumerate(exprs)]}]}
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    checked = subprocess.run([PROMTOOL_BIN, "check", "rules", str(path)], capture_output=True, text=True,
                             timeout=60, stdin=subprocess.DEVNULL)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # and it does refuse a broken query, so the check above can fail
    path.write_text(yaml.safe_dump({"groups": [{"name": "bad", "rules": [{"record": "bad:q", "expr": "rate(x[)"}]}]}))
    broken = subprocess.run([PROMTOOL_BIN, "check", "rules", str(path)], capture_output=True, text=True, timeout=60,
                            stdin=subprocess.DEVNULL)
    assert broken.returncode != 0


# ---- the compose profile ------------------------------------------------------------------------

def test_the_observability_services_start_only_with_their_profile():
    document = compose_document()
    nodes, extra = node_services(document), profile_services(document)
    assert set(extra) == {"prometheus", "grafana"}
    assert set(nodes) == {"murmur-a", "murmur-b", "murmur-c"}  # a plain `compose up` starts these, as before
    assert set(nodes) | set(extra) == set(document["services"])
    for name, spec in extra.items():
        assert spec["profiles"] == [PROFILE], name
        assert all(port.startswith("127.0.0.1:") for port in spec["ports"]), f"{name}: publish on this host only"
        for volume in spec["volumes"]:
            source = volume.split(":")[0]
            assert (COMPOSE_FILE.parent / source).exists(), f"{name} mounts {source}, which is not in docker/"
    assert extra["prometheus"]["ports"] == ["127.0.0.1:9090:9090"]
    assert extra["grafana"]["ports"] == ["127.0.0.1:3000:3000"]


def test_the_profiles_prometheus_scrapes_every_node_service():
    document = compose_document()
    prometheus = profile_services(document)["prometheus"]
    mounted = {volume.split(":")[1]: DOCKER / volume.split(":")[0] for volume in prometheus["volumes"]}
    config_path = mounted["/etc/prometheus/prometheus.yml"]
    assert config_path.resolve() == PROMETHEUS_CONFIG.resolve()
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    config = yaml.safe_load(config_path.read_text())
    jobs = config["scrape_configs"]
    assert [job["job_name"] for job in jobs] == ["murmur"]
    job = jobs[0]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert "remote_write" not in config
    # by address (dns_sd), since a node's monitor refuses a Host header naming a service; the
    # service's name comes back as the instance label
    discovered = [(tuple(sd["names"]), sd["port"], sd["type"]) for sd in job["dns_sd_configs"]]
    assert discovered == [(tuple(node_services(document)), MONITOR_PORT, "A")]
    assert {"source_labels": ["__meta_dns_name"], "target_label": "instance"} in job["relabel_configs"]
    assert "static_configs" not in job


def test_grafana_is_provisioned_with_the_prometheus_service_and_the_dashboard():
    grafana = profile_services(compose_document())["grafana"]
    mounts = {volume.split(":")[1]: (DOCKER / volume.split(":")[0]).resolve() for volume in grafana["volumes"]}
    for kind in ("datasources", "dashboards"):
        assert mounts[f"/etc/grafana/provisioning/{kind}"] == (GRAFANA_PROVISIONING / kind).resolve()
    assert mounts["/etc/grafana/dashboards"] == DASHBOARD.parent.resolve()
    source = yaml.safe_load((GRAFANA_PROVISIONING / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert [(s["type"], s["url"], s["isDefault"]) for s in source] == [("prometheus", "http://prometheus:9090", True)]
    providers = yaml.safe_load((GRAFANA_PROVISIONING / "dashboards" / "murmur.yaml").read_text())["providers"]
    assert [p["options"]["path"] for p in providers] == ["/etc/grafana/dashboards"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert Path(home).parent.as_posix() == "/etc/grafana/dashboards" and (DASHBOARD.parent / Path(home).name).exists()


@pytest.mark.skipif(PROMTOOL_BIN is None, reason="promtool is not installed (Debian's prometheus package has it)")
def test_promtool_accepts_the_shipped_config():
    checked = promtool_check_config(PROMETHEUS_CONFIG)
    assert checked.returncode == 0, checked.stdout + checked.stderr


# ---- the memory figure --------------------------------------------------------------------------

def test_resident_memory_is_this_processes_and_absent_without_proc(tmp_path):
    rss = resident_memory_bytes()
    assert rss is not None and 10 * 2**20 < rss < 64 * 2**30  # a Python process with torch loaded
    big = bytearray(64 * 2**20)
    big[::4096] = b"x" * len(big[::4096])  # touched, so resident
    assert resident_memory_bytes() >= rss + 48 * 2**20
    del big
    assert resident_memory_bytes(tmp_path / "missing") is None
    (tmp_path / "statm").write_text("garbage")
    assert resident_memory_bytes(tmp_path / "statm") is None
