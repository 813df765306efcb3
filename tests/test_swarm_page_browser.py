"""The monitor page in Chromium on a real 4-node training swarm (issue 27, items 3 and 5): its loss,
throughput and topology charts draw the training, the swarm page lists every node of the swarm with its
step and its contribution (tokens processed and share), and the export of that node's checkpoint names
the four contributors in its model card. (The page's live membership is tests/test_monitor_browser.py's.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_monitor_browser import (  # noqa: F401
    CHROMIUM_ARGS,
    SETUP_TIMEOUT_MS,
    artifacts,
    browser,
    open_page,
    wait_chart_points,
)

from support.swarm_harness import Swarm, wait_for

pytestmark = pytest.mark.browser

MURMUR = str(Path(sys.executable).with_name("murmur"))
NODES = 4
BATCH, CONTEXT = 1, 8
TOKENS_PER_STEP = BATCH * CONTEXT  # one micro-batch
# min_peers 4: the four start training together from step 0, so none downloads (and each one's tokens
# are its own steps')
TRAINING = {"model": "dense", "batch_size": BATCH, "context": CONTEXT, "threads": 1, "eval_every": 20,
            "min_peers": NODES, "heartbeat": 2.0}
ROWS = "[...document.querySelectorAll('#swarm-peers tr')]"


def swarm_rows(page) -> list[dict]:
    return page.eval_on_selector_all(
        "#swarm-peers tr", "rows => rows.map(r => ({peer: r.dataset.peerId, step: Number(r.dataset.step), "
        "tokens: Number(r.dataset.tokens), points: Number(r.dataset.points), self: r.classList.contains('self'), "
        "share: r.querySelector('td.share').textContent, score: r.querySelector('td.score').textContent, "
        "reach: r.querySelector('td.reach').textContent}))")


def test_the_swarm_page_lists_every_node_with_its_step_and_contribution_and_the_export_names_them(
        tmp_path, browser, artifacts) -> None:  # noqa: F811
    with Swarm(tmp_path, **TRAINING) as swarm:
        nodes = swarm.start(NODES)
        first = nodes[0]
        errors: list[str] = []
        page = open_page(browser, first, errors)
        want = sorted(n.peer_id for n in nodes)
        # every node in the table, each having trained and said so in its record
        try:
            page.wait_for_function(
                f"want => JSON.stringify({ROWS}.map(r => r.dataset.peerId).sort()) === JSON.stringify(want)"
                f" && {ROWS}.every(r => Number(r.dataset.step) > 0 && Number(r.dataset.tokens) > 0)",
                arg=want, timeout=SETUP_TIMEOUT_MS * 2)
        except Exception as exc:
            raise AssertionError(f"the swarm table shows {swarm_rows(page)}, not all of {want} trained\n"
                                 f"{swarm.logs()}") from exc

        def rows_and_statuses() -> tuple[list[dict], dict] | None:
            """The table, then every node's status, once the table's scores are the first node's: it
            samples a second apart from the status, and a peer may be rated for the first time between."""
            rows = swarm_rows(page)
            statuses = {n.peer_id: n.status() for n in nodes}
            scores = statuses[first.peer_id].get("contribution") or {}
            same = all((r["score"] == "–") == (r["peer"] not in scores) for r in rows)
            return (rows, statuses) if same else None

        rows, statuses = wait_for(rows_and_statuses, 30, "the table's scores to be the first node's")
        assert [r["peer"] for r in rows if r["self"]] == [first.peer_id]
        for row in rows:
            # a row is one record: its tokens are the steps that peer trained itself, and the page is
            # never ahead of the node it shows
            assert 0 < row["tokens"] <= row["step"] * TOKENS_PER_STEP, row
            assert row["step"] <= statuses[row["peer"]]["step"], (row, statuses[row["peer"]]["step"])
            assert row["reach"] in ("direct", "relayed", "unknown")
        # scores come from /api/status's `contribution` where a node rates peers; "–" where it does not
        # (rows_and_statuses waited for that)
        for row in rows:  # unrated peers' points are their tokens; rated ones' at most that
            assert row["points"] == row["tokens"] if row["score"] == "–" else 0 <= row["points"] <= row["tokens"], row
        total = sum(r["points"] for r in rows)
        for row in rows:  # each share is its points over the table's, as shown to a tenth of a percent (the
            # page rounds an exact tie such as 40/128 = 31.25% up, Python's format to even: compare the numbers)
            assert row["share"].endswith("%"), row
            assert abs(float(row["share"][:-1]) - 100 * row["points"] / total) <= 0.05 + 1e-9, (row, total)
        wait_chart_points(page, "#chart-swarm-throughput", 2)
        assert int(page.inner_text("#swarm-peers-count")) == NODES
        page.screenshot(path=str(artifacts / "monitor-swarm.png"), full_page=True)
        check_the_loss_chart(page, first, artifacts)
        assert errors == [], errors

        # a clean stop writes the final checkpoint, with the contributors this node saw
        assert swarm.stop_all(nodes, timeout_s=60) == [0] * NODES, swarm.logs()
    out = tmp_path / "export"
    done = subprocess.run([MURMUR, "export", "--data-dir", str(first.data_dir), "--from", "checkpoint", "--to", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    contributors = json.loads((out / "murmur.json").read_text())["contributors"]
    assert sorted(contributors) == want and all(n > 0 for n in contributors.values())
    card = (out / "README.md").read_text(encoding="utf-8")
    assert f"{NODES} contributor(s) processed" in card
    for peer in want:
        assert f"| `{peer}` | {contributors[peer]:,} |" in card, peer


def check_the_loss_chart(page, node, shots: Path) -> None:
    """The node's own charts draw its training: losses, an evaluation, throughput, the current round's edges."""
    for series, points in (("loss", 5), ("validation", 1)):
        wait_chart_points(page, f"#chart-loss polyline[data-series={series}]", points)
    wait_chart_points(page, "#chart-throughput", 5)
    page.wait_for_function("() => document.querySelectorAll('#topology line.edge.current').length > 0",
                           timeout=SETUP_TIMEOUT_MS)
    # the untrained model's first losses can be above 10 (a fresh-clone run read 10.6): wait for the page
    # to show one the swarm has trained down, rather than reading the first figure it drew
    page.wait_for_function("() => Number(document.getElementById('loss').textContent) > 0"
                           " && Number(document.getElementById('loss').textContent) < 10", timeout=SETUP_TIMEOUT_MS)
    step = int(page.inner_text("#step"))
    loss = float(page.inner_text("#loss"))
    status = node.status()
    assert step > 0 and 0 < loss < 10 and status["loss"] is not None and status["step"] >= step, (step, loss)
    page.screenshot(path=str(shots / "monitor.png"), full_page=True)
