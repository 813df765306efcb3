"""Long-lived background tasks that never die silently.

`supervise` runs a task's body; an unexpected exception is logged in one line with its type, counted
(`background_task_failed`, and `background_task_failed_<name>`), and the body starts again after a
backoff that doubles from `backoff_s` up to `max_backoff_s` (and starts over once a run has lasted
`healthy_s`). Cancellation ends it, as it ends the body. A body that returns is done.

Where a restart makes no sense (a control channel read mid-frame, say), the task reports its death
through the owner's own path instead (node.net.transport.libp2p's watcher stops the node).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)

FAILED = "background_task_failed"
BACKOFF_S = 1.0  # the first restart's delay, unless a caller says otherwise
MAX_BACKOFF_S = 30.0


async def supervise(name: str, body: Callable[[], Awaitable[None]], count: Callable[[str], None], *,
                    backoff_s: float | None = None, max_backoff_s: float | None = None,
                    healthy_s: float = 60.0) -> None:
    """Run `body()` until it returns or this is cancelled, restarting it after each unexpected exception
    (module docstring). `count(kind)` increments the node's error count of `kind`."""
    loop = asyncio.get_running_loop()
    backoff_s = BACKOFF_S if backoff_s is None else backoff_s
    max_backoff_s = MAX_BACKOFF_S if max_backoff_s is None else max_backoff_s
    delay = backoff_s
    slug = name.replace(" ", "_")
    while True:
        started = loop.time()
        try:
            await body()
            return
        except Exception as exc:  # CancelledError is no Exception: cancelling still ends the task
            if loop.time() - started >= healthy_s:
                delay = backoff_s
            count(FAILED)
            count(f"{FAILED}_{slug}")
            logger.error("background task %r failed (%s: %s); restarting it in %.3g s", name, type(exc).__name__,
                         exc, delay)
        await asyncio.sleep(delay)
        delay = min(max_backoff_s, delay * 2)


def counter_of(counts: dict[str, int]) -> Callable[[str], None]:
    """A `count` for `supervise` that increments `counts[kind]`."""

    def count(kind: str) -> None:
        counts[kind] = counts.get(kind, 0) + 1

    return count
