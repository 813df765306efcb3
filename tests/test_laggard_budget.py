"""The creeping laggard (docs/threat-model.md): a round waits for a laggard catching up, but each
neighbour's waiting comes from a budget of its own (node/swarm/progress.py, PeerProgress.wait_left), so a
record that rises a step a heartbeat while staying beyond the lag window holds its neighbours' rounds for
the budget, then a tenth of the time at most; an honest peer catching up is waited for as before.

The loop's wait runs here on a fake clock: time.monotonic and asyncio.sleep of node.swarm.loop are
replaced, so 50 rounds of 30 s waits take no time."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

import node.swarm.loop as loop
from node.swarm.progress import WAIT_BUDGET_S, WAIT_BUDGET_WINDOW_S, PeerProgress
from topology import PeerRound

pytestmark = pytest.mark.unit

LAG_WINDOW = 10
TRAIN_S = 5.0  # fake seconds a round's steps take between two waits
HEARTBEAT_S = 2.0


@dataclass(frozen=True)
class Record:
    peer_id: str
    step: int = 0
    round: int = 0
    gossip_from: int = 0


class FakeTime:
    """`tick`: seconds each reading of the clock moves it on, as a real clock does between two readings."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tick: float = 0.0) -> None:
        self.now = 1000.0
        self.tick = tick
        real_sleep = asyncio.sleep

        async def sleep(seconds: float) -> None:
            self.now += seconds
            await real_sleep(0)

        monkeypatch.setattr(loop, "time", SimpleNamespace(monotonic=self.read))
        monkeypatch.setattr(loop, "asyncio", SimpleNamespace(sleep=sleep))

    def read(self) -> float:
        self.now += self.tick
        return self.now


def training_for(clock: FakeTime, step_of: Callable[[float], int]) -> SimpleNamespace:
    """A SwarmLoop's parts the wait reads: its step, a view with one neighbour whose record shows
    `step_of(now)` (published each heartbeat), its progress and its counters."""
    progress = PeerProgress(10.0, clock=clock.read)

    def view() -> tuple[Record, ...]:
        published = clock.now - clock.now % HEARTBEAT_S
        return (Record("me", step=training.trainer.step), Record("other", step=step_of(published)))

    training = SimpleNamespace(discovery=SimpleNamespace(view=view), progress=progress,
                               trainer=SimpleNamespace(step=0), _lag_window=LAG_WINDOW, _done=lambda step: False,
                               peer=SimpleNamespace(stats=SimpleNamespace(skipped=collections.Counter())))
    progress.observe(view())  # seen once: a rise shows from the next look on
    return training


async def one_round(training: SimpleNamespace, clock: FakeTime) -> float:
    """Train a round (TRAIN_S), then wait for laggards as plan_for does; how long the wait held it."""
    clock.now += TRAIN_S
    training.progress.observe(training.discovery.view())
    started = clock.now
    await loop.SwarmLoop._wait_for_laggards(training, PeerRound(0.5, {"other": 0.5}, ()))
    return clock.now - started


def test_a_creeping_record_holds_rounds_for_its_budget_then_a_tenth_of_the_time(monkeypatch, caplog):
    clock = FakeTime(monkeypatch)

    def creeping(now: float) -> int:
        return int(now // HEARTBEAT_S)  # one step a heartbeat, for ever

    training = training_for(clock, creeping)
    caplog.set_level(logging.INFO, logger="murmur.train")

    async def main() -> list[float]:
        waits = []
        for _ in range(50):
            # the swarm runs well ahead: the creeper stays beyond the lag window however long a round waits
            training.trainer.step = creeping(clock.now) + LAG_WINDOW + 30
            waits.append(await one_round(training, clock))
        return waits

    waits = asyncio.run(main())
    # the first rounds wait as they do for any laggard, the whole LAG_WAIT_S, until the budget is spent
    assert waits[:2] == [pytest.approx(loop.LAG_WAIT_S, abs=0.3)] * 2
    assert sum(waits[:3]) == pytest.approx(WAIT_BUDGET_S, abs=2.0)
    # then each round waits only for what the bucket refilled while it trained: a tenth of TRAIN_S
    refill = TRAIN_S * WAIT_BUDGET_S / WAIT_BUDGET_WINDOW_S
    assert all(w <= refill + 0.25 for w in waits[4:]), waits
    elapsed = 50 * TRAIN_S + sum(waits)
    assert sum(waits) <= WAIT_BUDGET_S + elapsed * WAIT_BUDGET_S / WAIT_BUDGET_WINDOW_S + 1.0
    # counted each round its spent budget cut the wait short, logged once in the window
    assert training.peer.stats.skipped["laggard_wait_spent"] >= 45
    assert sum("held rounds" in r.getMessage() for r in caplog.records) == 1


def test_an_honest_peer_catching_up_is_waited_for_as_before(monkeypatch):
    clock = FakeTime(monkeypatch)
    joined_at = clock.now + 20.0

    def joiner(now: float) -> int:
        # a restarted peer at step 0 until its download lands (20 s), then at the swarm's step less the
        # rounds it missed, training a step a second
        return 0 if now < joined_at else 480 + int(now - joined_at)

    training = training_for(clock, joiner)

    async def main() -> list[float]:
        training.trainer.step = 500
        training.progress.observe(training.discovery.view())
        first = await one_round(training, clock)  # step 0, not rising: not waited for
        clock.now = joined_at
        training.progress.observe(training.discovery.view())  # seen rising: 0 -> 480+
        second = await one_round(training, clock)
        return [first, second]

    first, second = asyncio.run(main())
    assert first == 0.0
    # held until it is back within the lag window (step 490 at the node's 500), not the whole 30 s
    assert 3.0 < second < loop.LAG_WAIT_S
    assert training.progress.wait_left("other") > WAIT_BUDGET_S - loop.LAG_WAIT_S
    assert training.peer.stats.skipped["laggard_wait_spent"] == 0


def test_a_slow_honest_peer_gets_three_full_waits_and_the_budget_comes_back_after_the_window(monkeypatch):
    clock = FakeTime(monkeypatch)
    training = training_for(clock, lambda now: int(now // HEARTBEAT_S))

    async def main() -> tuple[list[float], float]:
        waits = []
        for _ in range(3):
            training.trainer.step = int(clock.now // HEARTBEAT_S) + LAG_WINDOW + 30
            waits.append(await one_round(training, clock))
        clock.now += WAIT_BUDGET_WINDOW_S  # a window without waiting for it
        assert training.progress.wait_left("other") == WAIT_BUDGET_S
        training.trainer.step = int(clock.now // HEARTBEAT_S) + LAG_WINDOW + 30
        return waits, await one_round(training, clock)

    waits, after = asyncio.run(main())
    assert waits == [pytest.approx(loop.LAG_WAIT_S, abs=0.3)] * 3
    assert after == pytest.approx(loop.LAG_WAIT_S, abs=0.3)


def test_the_budget_is_a_token_bucket_per_peer_and_leaving_the_view_does_not_refill_it():
    now = [0.0]
    progress = PeerProgress(5.0, clock=lambda: now[0], wait_budget_s=10.0, wait_budget_window_s=100.0)
    progress.charge_wait(["a", "b"], 4.0)  # both held the same 4 s: each pays it
    progress.charge_wait(["a"], 8.0)
    assert progress.wait_left("a") == 0.0 and not progress.may_wait_for("a")
    assert progress.wait_left("b") == 6.0 and progress.wait_left("c") == 10.0
    progress.observe([Record("c")])  # a and b left the view: what they spent is kept
    now[0] = 50.0
    assert progress.wait_left("a") == pytest.approx(5.0) and progress.may_wait_for("a")
    now[0] = 200.0
    assert progress.wait_left("a") == 10.0 and progress.wait_left("b") == 10.0
    # told once per window
    assert progress.tell_wait_spent("a") and not progress.tell_wait_spent("a")
    now[0] = 301.0
    assert progress.tell_wait_spent("a")


class Rejoins:
    """A DiLoCo-like algorithm whose catch-ups find what the records claimed (`backed`) or not."""

    rejoins_when_left_behind = True

    def __init__(self, training: SimpleNamespace, backed: bool) -> None:
        self.training, self.backed, self.calls = training, backed, 0

    async def rejoin(self, swarm_step: int, margin: int, catch_up: Callable[[], object]) -> bool:
        self.calls += 1
        if self.backed:
            self.training.trainer.step = swarm_step
        return self.backed


def left_behind(clock: FakeTime, backed: bool) -> tuple[SimpleNamespace, Rejoins]:
    """A node at step 100 whose view's four other peers all claim step 10,000 (sybils, or a real swarm)."""
    training = SimpleNamespace(trainer=SimpleNamespace(step=100), peer=SimpleNamespace(peer_id="me"),
                               recipe=SimpleNamespace(steps=0), _catch_up_with=(20, None), _stop=asyncio.Event(),
                               _checked_at=0.0, _laggard_wait_s=loop.LAGGARD_CHECK_S)
    training.discovery = SimpleNamespace(view=lambda: [Record("me", step=training.trainer.step)]
                                         + [Record(f"s{i}", step=10_000) for i in range(4)])
    training._catch_up = lambda *args: None
    algorithm = Rejoins(training, backed)
    training.algorithm = algorithm
    return training, algorithm


def test_claims_the_downloads_do_not_back_cannot_make_a_node_rejoin_again_and_again(monkeypatch):
    clock = FakeTime(monkeypatch)
    unbacked, lied_to = left_behind(clock, backed=False)

    async def checks(training: SimpleNamespace, seconds: float) -> None:
        for _ in range(int(seconds)):  # a step a second for `seconds`
            clock.now += 1.0
            await loop.SwarmLoop._rejoin_if_left_behind(training)

    asyncio.run(checks(unbacked, 3600))
    # every LAGGARD_CHECK_S it would be 720 re-joins in an hour; doubling waits make it about log2 of that
    # and then one per LAGGARD_BACKOFF_MAX_S
    assert lied_to.calls <= 8 + 3600 / loop.LAGGARD_BACKOFF_MAX_S, lied_to.calls
    assert lied_to.calls >= 3600 / loop.LAGGARD_BACKOFF_MAX_S  # it still looks, now and then

    clock = FakeTime(monkeypatch)
    backed, swarm = left_behind(clock, backed=True)
    asyncio.run(checks(backed, 60))
    assert swarm.calls == 1 and backed.trainer.step == 10_000  # a real swarm ahead is caught up with at once
    assert backed._laggard_wait_s == loop.LAGGARD_CHECK_S


def test_the_hostile_creeping_record_holds_rounds_until_its_budget_is_spent(monkeypatch):
    """support.hostile's `creeping` mode, the record the attack benchmark's hostile node publishes
    (bench/bench_attacks.py): its claims against the loop's wait. It does hold rounds (an attack that
    held none would prove nothing), for the budget, then a tenth of the time. The clock moves on a
    microsecond at each reading, as a real one does: the bucket refills between being charged and looked
    at, and a spent budget must still stop the wait (it did not, until MIN_WAIT_S)."""
    from support.hostile import CREEP_DEPTH, creep_claim

    clock = FakeTime(monkeypatch, tick=1e-6)
    published: dict[float, int] = {}  # heartbeat -> the step its record claimed
    node: list[SimpleNamespace] = []

    def creeper(at: float) -> int:
        at = at - at % HEARTBEAT_S  # the ticking clock: the heartbeat it falls in
        beat = max(published) + HEARTBEAT_S if published else at
        while beat <= at:  # each heartbeat since the last, from the claim before and the node's floor now
            last = published[max(published)] if published else -1
            published[beat] = creep_claim(last, 10**6, node[0].trainer.step - LAG_WINDOW, CREEP_DEPTH)
            beat += HEARTBEAT_S
        return published[at]

    node.append(SimpleNamespace(trainer=SimpleNamespace(step=0)))  # the floor of the first look
    training = training_for(clock, creeper)
    node[0] = training

    async def main() -> list[float]:
        waits = []
        for _ in range(40):
            waits.append(await one_round(training, clock))
            training.trainer.step += int(TRAIN_S)  # a step a second while not held
        return waits

    waits = asyncio.run(main())
    claims = [published[at] for at in sorted(published)]
    # it never stands still, so it always looks like a laggard catching up: up a step a heartbeat, or up to
    # `depth` below the floor when the node ran ahead, or back there when it reached the floor
    assert all(b != a for a, b in zip(claims, claims[1:], strict=False) if b > 0), claims
    held = [w for w in waits if w > 0.01]  # (a round not held still reads the ticking clock)
    assert held[:3] == [pytest.approx(loop.LAG_WAIT_S, abs=0.3)] * 3  # each whole wait while it had budget
    elapsed = 40 * TRAIN_S + sum(waits)
    assert sum(waits) <= WAIT_BUDGET_S + elapsed * WAIT_BUDGET_S / WAIT_BUDGET_WINDOW_S + 1.0
    assert training.peer.stats.skipped["laggard_wait_spent"] >= 30


class CaughtUp:
    """A SwarmLoop's parts `_step` reads: a laggard check whose catch-up lands the node on `lands_at`."""

    def __init__(self, budget: int, at: int, lands_at: int) -> None:
        self.recipe = SimpleNamespace(steps=budget)
        self.trainer = SimpleNamespace(step=at)
        self.lands_at = lands_at
        self.steps_taken = 0

        async def step(plan_for: object) -> str:
            self.steps_taken += 1
            self.trainer.step += 1
            return "report"

        self.algorithm = SimpleNamespace(step=step)
        self.plan_for = None

    @property
    def finished(self) -> bool:
        return loop.SwarmLoop._done(self, self.trainer.step)  # type: ignore[arg-type]

    async def _rejoin_if_left_behind(self) -> None:
        self.trainer.step = self.lands_at


@pytest.mark.parametrize(("lands_at", "stepped"), [(320, False), (312, True)])
def test_a_catch_up_to_the_budgets_end_takes_no_step_past_it(lands_at: int, stepped: bool) -> None:
    """A DiLoCo laggard at step 300 of 320 caught up with a swarm whose donors had finished: it adopted
    step 320 and then took one more step, ending at 321 (a suite run's DiLoCo test saw it)."""
    node = CaughtUp(budget=320, at=300, lands_at=lands_at)
    report = asyncio.run(loop.SwarmLoop._step(node))  # type: ignore[arg-type]
    assert (report is not None, node.steps_taken) == (stepped, int(stepped))
    assert node.trainer.step == (lands_at + 1 if stepped else 320) and node.trainer.step <= 320
