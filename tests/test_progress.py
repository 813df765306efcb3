"""Which neighbours' records show progress (node/swarm/progress.py): a round waits only for a laggard
seen catching up, and leaves out a record that stopped changing beyond the staleness bound, so a record at
step 0 that never trains, or a frozen peer, holds no round beyond its deadline."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

import node.swarm.loop as loop
from node.swarm.progress import PeerProgress, leave_out_stalled, record_lag_rounds, stalled_after
from topology import PeerRound

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class Record:
    peer_id: str
    step: int = 0
    round: int = 0
    gossip_from: int = 0


def test_a_round_leaves_out_its_weight_onto_this_peer():
    plan = PeerRound(0.5, {"a": 0.25, "b": 0.25}, ("a", "c"))
    assert plan.without(["a"]) == PeerRound(0.75, {"b": 0.25}, ("c",))
    assert plan.without(["zz"]) is plan


def test_a_record_stalled_beyond_the_staleness_bound_is_left_out_and_one_moving_again_comes_back():
    now = [0.0]
    progress = PeerProgress(5.0, clock=lambda: now[0])
    plan = PeerRound(0.5, {"stuck": 0.25, "live": 0.25}, ("stuck",))
    gone: tuple[str, ...] = ()
    for second in range(12):
        now[0] = float(second)
        view = [Record("stuck", round=3), Record("live", round=97 + second)]
        progress.observe(view)
        round_plan, gone = leave_out_stalled(plan, view, progress, 100 + second, max_staleness=2)
        if second < 5:
            assert gone == () and round_plan is plan, second  # not yet: its record may only lag
    assert gone == ("stuck",) and round_plan == PeerRound(0.75, {"live": 0.25}, ())
    # it moves again: in at once
    now[0] = 12.0
    view = [Record("stuck", round=111), Record("live", round=109)]
    progress.observe(view)
    assert leave_out_stalled(plan, view, progress, 112, max_staleness=2)[1] == ()


def test_a_peer_that_just_started_gossiping_is_not_taken_for_stalled():
    now = [100.0]
    progress = PeerProgress(5.0, clock=lambda: now[0])
    view = [Record("new", round=0, gossip_from=50)]  # announced round 50; its record shows no round yet
    progress.observe(view)
    now[0] = 200.0  # unchanged for long, but it only starts at round 50
    plan = PeerRound(0.5, {"new": 0.5}, ())
    assert leave_out_stalled(plan, view, progress, 51, max_staleness=2)[1] == ()
    assert leave_out_stalled(plan, view, progress, 53, max_staleness=2)[1] == ()  # behind: noted, not yet


def test_on_a_round_clock_a_record_further_behind_than_any_live_one_is_left_out_at_once():
    progress = PeerProgress(5.0, clock=lambda: 0.0)
    lag = record_lag_rounds(heartbeat_s=1.0, exchange_timeout_s=2.0, round_interval_s=0.5)
    assert lag == 9
    view = [Record("hostile", round=0, gossip_from=50), Record("slow", round=200 - 2 - lag)]
    progress.observe(view)
    plan = PeerRound(0.4, {"hostile": 0.3, "slow": 0.3}, ())
    assert leave_out_stalled(plan, view, progress, 200, 2, lag)[1] == ("hostile",)
    assert stalled_after(heartbeat_s=2.0, exchange_timeout_s=10.0) == 10.0


def test_a_round_waits_for_a_laggard_catching_up_but_not_for_a_record_that_never_moves(monkeypatch):
    monkeypatch.setattr(loop, "LAG_WAIT_S", 1.0)

    async def main() -> None:
        records = {"me": Record("me", step=100), "zero": Record("zero", step=0), "slow": Record("slow", step=50)}
        progress = PeerProgress(5.0)
        training = SimpleNamespace(discovery=SimpleNamespace(view=lambda: tuple(records.values())),
                                   progress=progress, trainer=SimpleNamespace(step=100), _lag_window=10,
                                   _done=lambda step: False)
        wait = loop.SwarmLoop._wait_for_laggards
        progress.observe(tuple(records.values()))
        started = time.monotonic()
        await wait(training, PeerRound(0.5, {"zero": 0.5}, ()))  # type: ignore[arg-type]
        assert time.monotonic() - started < 0.1  # step 0 forever: never waited for
        records["slow"] = Record("slow", step=60)  # seen rising: it is catching up
        progress.observe(tuple(records.values()))
        started = time.monotonic()
        await wait(training, PeerRound(0.5, {"slow": 0.5}, ()))  # type: ignore[arg-type]
        assert 0.9 < time.monotonic() - started < 2.0  # waited for it, within LAG_WAIT_S

    asyncio.run(main())
