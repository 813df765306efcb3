"""A joiner's download from donors on slow links (real `murmur` processes whose answers to downloads are
throttled, support.hostile's slow-serve): its progress shows in its `/api/status` while it runs, the
download is not cut for taking longer than the deadline downloads used to have, and when a donor is
killed mid-download the join completes from the other donor."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from support.hostile import Mode, hostile_argv
from support.swarm_harness import Node, Swarm, wait_for
from support.tiny_model import TINY

pytestmark = pytest.mark.multiprocess

SUPPORT = Path(__file__).parent / "support"  # the nodes import the tiny model from there

RATE = 25_000  # bytes/s each donor serves a download at: the tiny model's ~400 KB take ~16 s
FLAGS = {"model": "tiny_model:build", "context": TINY.context, "batch_size": 8, "optimizer": "dadam", "lr": 1e-2,
         "steps": 0, "threads": 1, "eval_every": 5, "checkpoint_every": 1000, "exchange_timeout": 2,
         "stall_timeout": 10}
SLOW = hostile_argv([Mode.SLOW_SERVE], options={"rate": RATE})


def joined(node: Node) -> dict | None:
    """The joiner's catch-up outcome, once it is done."""
    training = node.status().get("training") or {}
    return training.get("joined")


@pytest.fixture
def support_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH")])))


def ahead(swarm: Swarm, donors: list[Node], steps: int = 10) -> None:
    wait_for(lambda: all(n.status()["step"] >= steps for n in donors), 180, f"the donors at step {steps}")


@pytest.mark.usefixtures("support_path")
def test_a_slow_download_shows_its_progress_and_completes_from_the_donor_left_when_one_is_killed(tmp_path) -> None:
    """One swarm for both: what a user relies on while a join downloads (progress in the status and on
    the command line, no cut for being slow) and when a donor dies mid-download (the other one serves)."""
    with Swarm(tmp_path, **FLAGS) as swarm:
        founder = swarm.spawn("n0", seed=0, join=None, hostile=SLOW)
        swarm.wait_ready([founder])
        second = swarm.spawn("n1", seed=1, join=founder, hostile=SLOW)
        swarm.wait_ready([second])
        ahead(swarm, [founder, second])
        joiner = swarm.spawn("n2", seed=2, join=founder)
        swarm.wait_ready([joiner])
        # both donors are downloaded from at once
        progress = wait_for(lambda: _both_under_way(joiner), 120, "downloads from both donors under way")
        second.signal(signal.SIGKILL)  # ... and the second dies while its download runs
        outcome = wait_for(lambda: joined(joiner), 120, "the joiner's catch-up to end")
        after = joiner.status()
        log = joiner.stderr()
    assert sorted(progress["donors"]) == sorted([founder.peer_id, second.peer_id]), progress
    # both payloads' sizes are known, neither is complete
    assert 0 < progress["bytes_done"] < progress["bytes_total"] and progress["bytes_total"] >= 2 * 4 * 100_000, progress
    assert progress["rate_bps"] > 0 and (progress["eta_s"] is None or progress["eta_s"] >= 0), progress
    # at RATE one download outlasts the whole-download deadline of 4 exchange timeouts it used to have
    assert progress["bytes_total"] / 2 / RATE > 4 * FLAGS["exchange_timeout"]
    assert outcome["sources"] == [founder.peer_id], outcome
    assert second.peer_id in outcome["refused"] and second.peer_id not in outcome["losses"], outcome
    training = after["training"]
    assert after["join"] is None and training["started_from"] == f"peer {founder.peer_id} at step {outcome['step']}"
    assert "downloading the swarm's parameters: " in log and " MB/s" in log  # the command line's progress lines


def _both_under_way(joiner: Node) -> dict | None:
    progress = joiner.status().get("join")
    return progress if progress and len(progress["donors"]) == 2 and progress["bytes_done"] > 0 else None
