"""Who a training round pairs with (node/swarm/rounds.py `serving_members`): a peer whose record entered the
view while it was still loading or downloading is not paired until its record says it serves its round
protocols, and a fresh swarm's quorum counts only peers that serve, so no node starts training alone
against neighbours whose rounds would fail at once."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import pytest

import node.swarm.loop as loop
from node.swarm.rounds import serving_members

pytestmark = pytest.mark.unit

BUDGET = 100


@dataclass(frozen=True)
class Record:
    peer_id: str
    step: int = 0
    gossip_from: int = 0


def members(view: list[Record], me: str = "me") -> tuple[str, ...]:
    return serving_members(((r.peer_id, r.gossip_from, r.step) for r in view), me, lambda s: s >= BUDGET).peer_ids


def test_a_round_pairs_only_with_peers_that_serve_and_have_steps_left():
    view = [Record("me"), Record("loading"), Record("serving", step=5, gossip_from=1),
            Record("finished", step=BUDGET, gossip_from=3), Record("joined-late", step=40, gossip_from=9)]
    # this peer counts whatever its own record says: it is the one asking
    assert members(view) == ("joined-late", "me", "serving")


def test_a_peer_enters_the_rounds_once_its_record_says_it_serves():
    view = [Record("me", gossip_from=1), Record("joiner")]
    assert members(view) == ("me",)
    view[1] = replace(view[1], gossip_from=1)
    assert members(view) == ("joiner", "me")


@dataclass
class Discovery:
    records: dict[str, Record]
    published: list[dict] = field(default_factory=list)

    def view(self) -> list[Record]:
        return sorted(self.records.values(), key=lambda r: r.peer_id)

    def update(self, **changes: int) -> None:
        self.published.append(changes)
        self.records["me"] = replace(self.records["me"], **{k: v for k, v in changes.items() if k != "round"})


def swarm_loop(discovery: Discovery, min_peers: int) -> tuple[loop.SwarmLoop, list[str]]:
    started: list[str] = []

    async def start() -> None:
        started.append("start")

    training = object.__new__(loop.SwarmLoop)
    training.discovery = discovery  # type: ignore[assignment]
    training.peer = SimpleNamespace(peer_id="me", round=0)  # type: ignore[assignment]
    training.trainer = SimpleNamespace(step=0)  # type: ignore[assignment]
    training.recipe = SimpleNamespace(steps=BUDGET)  # type: ignore[assignment]
    training.settings = SimpleNamespace(min_peers=min_peers)  # type: ignore[assignment]
    training.algorithm = SimpleNamespace(start=start)  # type: ignore[assignment]
    training._serving = False
    return training, started


def test_serving_starts_the_algorithm_once_and_announces_it_in_the_record():
    discovery = Discovery({"me": Record("me")})
    training, started = swarm_loop(discovery, min_peers=1)

    async def main() -> None:
        await training.serve_rounds()
        await training.serve_rounds()

    asyncio.run(main())
    assert started == ["start"]
    assert [c.get("gossip_from") for c in discovery.published] == [1]


def test_the_quorum_waits_for_peers_that_serve_not_for_records():
    discovery = Discovery({"me": Record("me"), "a": Record("a"), "b": Record("b")})
    training, _ = swarm_loop(discovery, min_peers=3)
    stop = asyncio.Event()

    async def main() -> list[bool]:
        await training.serve_rounds()
        waiting = asyncio.create_task(training.wait_for_quorum(stop))
        seen = []
        for ready in ("a", "b"):
            await asyncio.sleep(0.7)  # the wait polls every 0.5 s
            seen.append(waiting.done())
            discovery.records[ready] = replace(discovery.records[ready], gossip_from=1)
        async with asyncio.timeout(5):
            await waiting
        return seen

    # three records were in view from the start; the quorum held until the third peer served
    assert asyncio.run(main()) == [False, False]
