"""A real Prometheus (Debian's package) scrapes a 3-node loopback swarm training the tiny model: every
target comes up, PromQL returns each node's step and gossip bytes (one series per node, above zero),
the step joins the node's peer id, and every query of the Grafana dashboard runs."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from support.prometheus import (
    MISSING,
    PROMETHEUS_BIN,
    PROMTOOL_BIN,
    Prometheus,
    by_instance,
    concrete,
    dashboard,
    promtool_check_config,
    scrape_config,
)
from support.swarm_harness import Swarm, wait_for
from support.tiny_model import TINY

pytestmark = pytest.mark.multiprocess

SUPPORT = Path(__file__).parent / "support"
# the tiny model trains in seconds; steps enough that it is still training when the test ends
RECIPE = {"model": "tiny_model:build", "context": TINY.context, "batch_size": 8, "optimizer": "dsgd", "lr": 0.5,
          "warmup_steps": 5, "steps": 100_000, "topology": "one-peer-exp"}
NODE = {"threads": 1, "eval_every": 1000, "checkpoint_every": 1000, "exchange_timeout": 3, "min_peers": 3}
SCRAPED_TIMEOUT_S = 240.0  # three torch processes and a Prometheus on a loaded 2-core machine
# The panels whose queries must return a series for every node of a training swarm (failures and
# skips may rightly be empty, validation loss may not have run yet).
EVERY_NODE = {"Step", "Steps per second", "Tokens per second", "Gossip bytes sent per second",
              "Gossip bytes received per second", "Gossip bytes in all", "Peers in view", "Memory"}


@pytest.fixture
def prometheus_binary() -> str:
    if PROMETHEUS_BIN is None:
        if os.environ.get("CI"):
            pytest.fail(MISSING)
        pytest.skip(MISSING)
    return PROMETHEUS_BIN


def target(monitor_url: str) -> str:
    parts = urlsplit(monitor_url)
    return f"{parts.hostname}:{parts.port}"


@pytest.mark.timeout(600)
def test_prometheus_scrapes_every_nodes_step_and_bytes(prometheus_binary, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH")])))
    with Swarm(tmp_path / "swarm", heartbeat=1) as swarm:
        founder = swarm.found(**RECIPE, **NODE)
        nodes = [founder, *(swarm.spawn(f"n{i}", seed=i, join=founder, model=RECIPE["model"], **NODE)
                            for i in (1, 2))]
        swarm.wait_ready(nodes[1:])
        instances = {target(node.monitor_url): node for node in nodes}
        assert all(host == "127.0.0.1" for host, _ in (t.split(":") for t in instances))

        root = tmp_path / "prometheus"
        root.mkdir()
        with Prometheus(root, scrape_config(sorted(instances))) as prom:
            if PROMTOOL_BIN is not None:
                checked = promtool_check_config(prom.config_path)
                assert checked.returncode == 0, checked.stdout + checked.stderr

            def scraped() -> bool:
                targets = prom.targets()
                return sorted(t["labels"]["instance"] for t in targets if t["health"] == "up") == sorted(instances)

            wait_for(scraped, SCRAPED_TIMEOUT_S, f"every node's /metrics scraped up\n{prom.log_tail()}", 1.0)
            # the only targets are the three nodes: nothing else is scraped
            assert sorted(t["scrapeUrl"] for t in prom.targets()) == sorted(
                f"http://{instance}/metrics" for instance in instances)

            def every_node(promql: str) -> dict[str, float] | None:
                values = by_instance(prom.query(promql))
                return values if sorted(values) == sorted(instances) else None

            report = f"\n{swarm.logs()}\n{prom.log_tail()}"
            steps = wait_for(lambda: every_node('murmur_step{job="murmur"} > 0'), SCRAPED_TIMEOUT_S,
                             f"a step above 0 from every node through PromQL{report}", 1.0)
            sent = wait_for(lambda: every_node("murmur_bytes_sent_total > 0"), SCRAPED_TIMEOUT_S,
                            f"gossip bytes sent by every node through PromQL{report}", 1.0)
            received = wait_for(lambda: every_node("murmur_bytes_received_total > 0"), SCRAPED_TIMEOUT_S,
                                f"gossip bytes received by every node through PromQL{report}", 1.0)
            # each series is its own node's: what Prometheus holds never runs ahead of the node itself
            for instance, node in instances.items():
                status = node.status()
                assert 0 < steps[instance] <= status["step"], (instance, steps[instance], status["step"])
                assert 0 < sent[instance] <= status["bytes_sent"], instance
                assert 0 < received[instance] <= status["bytes_received"], instance
            # the target names the node; murmur_node_info says which peer it is
            joined = prom.query("murmur_step * on (instance) group_left (peer_id) murmur_node_info")
            assert {s["metric"]["instance"]: s["metric"]["peer_id"] for s in joined} == {
                instance: node.peer_id for instance, node in instances.items()}

            # every panel of the Grafana dashboard runs, and the ones a training swarm always fills
            # have a series for each node (rates need two scrapes: waited for)
            for panel in dashboard()["panels"]:
                for query in panel["targets"]:
                    promql = concrete(query["expr"])
                    if panel["title"] in EVERY_NODE:
                        wait_for(lambda q=promql: {s["metric"]["instance"] for s in prom.query(q)} == set(instances),
                                 60.0, f"{panel['title']}: {promql} for every node{report}", 1.0)
                    else:
                        prom.query(promql)  # AssertionError if Prometheus refuses it
        assert prom.process is None  # stopped by its PID on leaving
