"""A clean stop: SIGINT/SIGTERM set the node's stop event, and each part closes within a bound, so the
node is gone within the 5 s a user waits after SIGTERM even when a part hangs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator
from typing import Protocol

logger = logging.getLogger("murmur.node")

STOP_TIMEOUT_S = 4.0  # everything below must be gone within the 5 s a user waits after SIGTERM


class Closable(Protocol):
    async def close(self) -> None: ...


class ShutsDown(Protocol):
    """hivemind's P2P and DHTNode."""

    async def shutdown(self) -> None: ...


class HasClose(Protocol):
    """A blocking close (the trainer's)."""

    def close(self) -> None: ...


def install_stop_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


@contextlib.asynccontextmanager
async def bounded_cleanup(what: str, timeout_s: float = STOP_TIMEOUT_S) -> AsyncIterator[None]:
    """Run one part's cleanup within `timeout_s`; a failure or a timeout is logged, not raised, so the
    parts after it still stop."""
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except TimeoutError:  # asyncio.timeout's error has no message: say what it means
        logger.warning("stopping %s: not done within %g s, left behind", what, timeout_s)
    except Exception as exc:
        logger.warning("stopping %s: %s", what, str(exc) or type(exc).__name__)


async def close(part: Closable, what: str) -> None:
    async with bounded_cleanup(what):
        await part.close()


async def close_in_thread(part: HasClose, what: str) -> None:
    async with bounded_cleanup(what):
        await asyncio.to_thread(part.close)


async def shut_down(part: ShutsDown, what: str) -> None:
    async with bounded_cleanup(what):
        await part.shutdown()
