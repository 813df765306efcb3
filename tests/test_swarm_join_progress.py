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

RATE = 40_000  # bytes/s each donor serves a download at: the tiny model's ~400 KB take ~10 s
FLAGS = {"model": "tiny_model:build", "context": TINY.context, "batch_size": 8, "optimizer": "dadam", "lr": 1e-2,
         "steps": 0, "threads": 1, "eval_every": 5, "checkpoint_every": 1000, "exchange_timeout": 2,
         "stall_timeout": 10, "goodput_floor": 0.05}  # a floor below RATE: at 2 Mbit/s it would cut these downloads
SLOW = hostile_argv([Mode.SLOW_SERVE], options={"rate": RATE})
BROKEN_OFF = ("truncated", "unreachable", "stalled", "timeout")  # how a download from a killed donor ends


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
    the command line, no cut for being slow) and when a donor dies mid-download (the other one serves,
    whether the joiner was downloading from both or, seeing one in its first view, tries the other next)."""
    with Swarm(tmp_path, **FLAGS) as swarm:
        founder = swarm.spawn("n0", seed=0, join=None, hostile=SLOW)
        swarm.wait_ready([founder])
        second = swarm.spawn("n1", seed=1, join=founder, hostile=SLOW)
        swarm.wait_ready([second])
        ahead(swarm, [founder, second])
        joiner = swarm.spawn("n2", seed=2, join=founder)
        swarm.wait_ready([joiner])
        progress = wait_for(lambda: _under_way(joiner), 120, "the joiner's download under way")
        donors = {founder.peer_id: founder, second.peer_id: second}
        victim = donors[second.peer_id if second.peer_id in progress["donors"] else progress["donors"][0]]
        survivor = next(node for node in donors.values() if node is not victim)
        victim.signal(signal.SIGKILL)  # while its download runs
        outcome = wait_for(lambda: joined(joiner), 180, "the joiner's catch-up to end")
        after = joiner.status()
        log = joiner.stderr()
        tail = joiner.log_tail(40)
    assert set(progress["donors"]) <= set(donors) and victim.peer_id in progress["donors"], progress
    # the payload's size is known and not all of it arrived
    assert 0 < progress["bytes_done"] < progress["bytes_total"], progress
    assert progress["bytes_total"] >= len(progress["donors"]) * 4 * 100_000, progress
    assert progress["rate_bps"] > 0 and (progress["eta_s"] is None or progress["eta_s"] >= 0), progress
    # at RATE one download outlasts the whole-download deadline of 4 exchange timeouts it used to have
    assert progress["bytes_total"] / len(progress["donors"]) / RATE > 4 * FLAGS["exchange_timeout"]
    assert outcome["sources"] == [survivor.peer_id], f"{outcome}\n{tail}"
    assert outcome["refused"].get(victim.peer_id) in BROKEN_OFF and victim.peer_id not in outcome["losses"], outcome
    training = after["training"]
    assert after["join"] is None and training["started_from"] == f"peer {survivor.peer_id} at step {outcome['step']}"
    assert "downloading the swarm's parameters: " in log and " MB/s" in log  # the command line's progress lines


def _under_way(joiner: Node) -> dict | None:
    """The joiner's download progress once bytes arrive, from both donors if it downloads from both."""
    progress = joiner.status().get("join")
    return progress if progress and progress["bytes_done"] > 0 else None
