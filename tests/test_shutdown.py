"""Tests for node.runtime.shutdown: a part's failed or hung cleanup is logged in one line that says what
happened, and the cleanups after it still run."""

from __future__ import annotations

import asyncio
import logging

import pytest

from node.runtime.shutdown import bounded_cleanup, close

pytestmark = pytest.mark.unit


class Hangs:
    async def close(self) -> None:
        await asyncio.sleep(60)


class FailsSilently:
    async def close(self) -> None:
        raise ConnectionResetError()  # no message, as hivemind's lost connections


def test_a_hung_or_failing_part_is_named_with_what_went_wrong_and_the_next_part_still_stops(caplog) -> None:
    stopped: list[str] = []

    async def run() -> None:
        async with bounded_cleanup("hung part", timeout_s=0.05):
            await Hangs().close()
        await close(FailsSilently(), "failing part")
        async with bounded_cleanup("last part"):
            stopped.append("last part")

    with caplog.at_level(logging.WARNING, logger="murmur.node"):
        asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["stopping hung part: not done within 0.05 s, left behind",
                     "stopping failing part: ConnectionResetError"]
    assert stopped == ["last part"]
