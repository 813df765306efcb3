"""The monitor page in a real browser (Debian's chromium driven by playwright) on real node processes:
- a 3-node gossip swarm (vector mode): the peers table and the topology graph fill in, the charts get
  points, a fourth node shows up within 5 s, a SIGKILLed node vanishes within the DHT record's expiry,
  and the page says plainly when its own node stops answering (the charts of a training swarm are
  tests/test_swarm_page_browser.py's, on its 4-node swarm).
Screenshots are test artifacts, written to a temporary folder or $MURMUR_TEST_ARTIFACTS, never over
the tracked docs/img/monitor.png (copy the training one there by hand to refresh the docs)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from support.swarm_harness import Node, Swarm

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
# what ENVIRONMENT.md says chromium needs here; no proxy for the page's own loopback address
CHROMIUM_ARGS = ["--no-sandbox", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--no-proxy-server"]

HEARTBEAT_S = 2.0  # a 1 s heartbeat lets records lapse now and then on a loaded 2-core machine
RECORD_TTL_S = 3 * HEARTBEAT_S  # node.net.discovery.DiscoverySettings.ttl_heartbeats
VIEW_REFRESH_S = HEARTBEAT_S / 2
SAMPLE_INTERVAL_S = 1.0  # node.monitor.server.SAMPLE_INTERVAL_S: how often the page is pushed an update
NEW_PEER_WITHIN_S = 5.0  # the bound
GONE_WITHIN_S = RECORD_TTL_S + VIEW_REFRESH_S + SAMPLE_INTERVAL_S + 1.5  # + polling slack on a busy machine
SETUP_TIMEOUT_MS = 90_000
VECTOR = {"model": "vector", "heartbeat": HEARTBEAT_S}


@pytest.fixture
def artifacts(tmp_path) -> Path:
    """Where screenshots go: $MURMUR_TEST_ARTIFACTS (CI uploads it) or the test's tmp dir."""
    path = Path(os.environ.get("MURMUR_TEST_ARTIFACTS", tmp_path / "artifacts"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extra: make venv")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} missing: apt-get install chromium (make test does)")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def rows(page) -> list[str]:
    return page.eval_on_selector_all("#peers tr", "rows => rows.map(r => r.dataset.peerId)")


def wait_rows(page, expected: list[Node], timeout_s: float) -> float:
    """Until the peers table lists exactly `expected`; returns the seconds it took."""
    started = time.monotonic()
    want = sorted(n.peer_id for n in expected)
    try:
        page.wait_for_function(
            "want => JSON.stringify([...document.querySelectorAll('#peers tr')].map(r => r.dataset.peerId).sort())"
            " === JSON.stringify(want)", arg=want, timeout=timeout_s * 1000)
    except Exception as exc:
        raise AssertionError(f"the peers table shows {sorted(rows(page))}, not {want}, after {timeout_s:g} s; "
                             f"the page says {page.inner_text('#connection')!r}") from exc
    return time.monotonic() - started


def wait_chart_points(page, selector: str, points: int) -> None:
    """Until the chart `selector` names says it draws at least `points` points (its data-points)."""
    page.wait_for_function("([selector, points]) => Number(document.querySelector(selector)?.dataset.points) >= points",
                           arg=[selector, points], timeout=SETUP_TIMEOUT_MS)


def kill_group(node: Node) -> None:
    os.killpg(node.pid, signal.SIGKILL)  # the node and its p2pd: no clean withdrawal from the DHT
    node.process.wait(10)


def open_page(browser, node: Node, errors: list[str]):
    # predicates are passed as functions: the page's Content-Security-Policy forbids evaluating strings
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(node.monitor_url)
    return page


def test_the_page_follows_a_live_swarm(tmp_path, browser, artifacts):
    with Swarm(tmp_path, **VECTOR) as swarm:
        nodes = swarm.start(3)
        first = nodes[0]
        errors: list[str] = []
        page = open_page(browser, first, errors)

        # the header, the table, the graph and the charts fill in without a reload
        wait_rows(page, nodes, SETUP_TIMEOUT_MS / 1000)
        assert page.inner_text("#node-id") == first.peer_id
        assert page.inner_text("#swarm") == "murmur"
        assert page.inner_text("#peers-alive") == "3"
        assert page.eval_on_selector_all("#peers tr.self", "r => r.map(x => x.dataset.peerId)") == [first.peer_id]
        page.wait_for_function("() => document.querySelectorAll('#topology g.node').length === 3", timeout=SETUP_TIMEOUT_MS)
        assert page.eval_on_selector_all("#topology g.node.self", "g => g.map(x => x.dataset.peerId)") == [first.peer_id]
        page.wait_for_function("() => document.querySelectorAll('#topology line.edge.current').length > 0",
                               timeout=SETUP_TIMEOUT_MS)
        wait_chart_points(page, "#chart-traffic", 2)
        wait_chart_points(page, "#chart-consensus", 2)
        # each neighbour's link (node.net.reachability): on loopback both are direct connections
        page.wait_for_function("() => [...document.querySelectorAll('#peers tr:not(.self) td.link')]"
                               ".map(td => td.textContent).join() === 'direct,direct'", timeout=SETUP_TIMEOUT_MS)
        # vector mode trains nothing, and the loss chart says so instead of staying blank
        assert page.get_attribute("#chart-loss", "data-points") == "0"
        assert "trains no model" in page.text_content("#chart-loss")
        assert page.get_attribute("#connection", "data-state") == "live"

        # a fourth node: in the table within 5 s of being ready (its record is published by then)
        fourth = swarm.spawn("n3", seed=3, join=first)
        swarm.wait_ready([fourth])
        took = wait_rows(page, [*nodes, fourth], NEW_PEER_WITHIN_S)
        print(f"the fourth node appeared on the page {took:.1f} s after it was ready")
        page.wait_for_function("() => document.querySelectorAll('#topology g.node').length === 4", timeout=10_000)
        page.screenshot(path=str(artifacts / "monitor-vector.png"), full_page=True)

        # a killed node leaves no tombstone: it goes when its record expires
        victim = nodes[2]
        kill_group(victim)
        took = wait_rows(page, [first, nodes[1], fourth], GONE_WITHIN_S)
        print(f"the killed node left the page {took:.1f} s after SIGKILL (record TTL {RECORD_TTL_S:g} s)")
        assert page.inner_text("#peers-alive") == "3"
        page.wait_for_function("() => [...document.querySelectorAll('#log li')].some(li => li.dataset.kind === 'peer_left')",
                               timeout=5_000)

        # the page's own node goes away: the page says so, plainly
        assert page.is_hidden("#offline")
        kill_group(first)
        page.wait_for_selector("#offline", state="visible", timeout=10_000)
        assert page.inner_text("#connection") == "NOT ANSWERING"
        assert "not answering" in page.inner_text("#offline")
        page.screenshot(path=str(artifacts / "monitor-offline.png"), full_page=True)
        assert errors == [], errors
