"""Child processes that die with the node, even when the node is SIGKILLed: Linux PR_SET_PDEATHSIG
for children we spawn, and for the p2pd daemon that hivemind spawns on our behalf.

PDEATHSIG fires when the *thread* that forked the child exits, so spawn long-lived children from
a thread that lives as long as the node (the event loop's thread).
"""

from __future__ import annotations

import asyncio
import asyncio.subprocess
import contextlib
import contextvars
import ctypes
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

_PR_SET_PDEATHSIG = 1

PreexecFn = Callable[[], None]

# Which preexec_fn (if any) asyncio subprocesses created in the current task should get; see
# `asyncio_children_die_with_us`. A ContextVar keeps the request local to one task.
_asyncio_child_preexec: contextvars.ContextVar[PreexecFn | None] = contextvars.ContextVar(
    "murmur_asyncio_child_preexec", default=None
)


def die_with_this_process(sig: signal.Signals = signal.SIGKILL) -> PreexecFn:
    """A `preexec_fn` that makes the child receive `sig` when the calling process dies.

    Everything the child needs is resolved here, before fork; the returned function only calls
    prctl and getppid. If the parent died between fork and prctl, the child kills itself.
    """
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    parent_pid = os.getpid()
    signum = int(sig)

    def set_parent_death_signal() -> None:
        if prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signum)

    return set_parent_death_signal


def popen(args: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
    """subprocess.Popen whose child is SIGKILLed when this process dies."""
    if "preexec_fn" in kwargs:
        raise ValueError("popen sets preexec_fn itself")
    return subprocess.Popen(args, preexec_fn=die_with_this_process(), **kwargs)


async def create_subprocess_exec(program: str, *args: str, **kwargs: Any) -> asyncio.subprocess.Process:
    """asyncio.create_subprocess_exec whose child is SIGKILLed when this process dies."""
    if "preexec_fn" in kwargs:
        raise ValueError("create_subprocess_exec sets preexec_fn itself")
    return await asyncio.create_subprocess_exec(program, *args, preexec_fn=die_with_this_process(), **kwargs)


@contextlib.contextmanager
def asyncio_children_die_with_us() -> Iterator[None]:
    """Within this block, `asyncio.subprocess.create_subprocess_exec` calls made by the current task
    (and by tasks it starts) give their child PR_SET_PDEATHSIG(SIGKILL).

    This exists for hivemind's `P2P.create`, which starts p2pd with
    `asyncio.subprocess.create_subprocess_exec(...)` and offers no hook for a preexec_fn. We wrap that
    one function once, in place; the wrapper passes every call through unchanged unless the calling
    task is inside this block, so code elsewhere in the process is unaffected.
    """
    _install_preexec_wrapper()
    token = _asyncio_child_preexec.set(die_with_this_process())
    try:
        yield
    finally:
        _asyncio_child_preexec.reset(token)


def _install_preexec_wrapper() -> None:
    original = asyncio.subprocess.create_subprocess_exec
    if getattr(original, "_murmur_preexec_wrapper", False):
        return

    async def create_subprocess_exec(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        preexec = _asyncio_child_preexec.get()
        if preexec is not None and kwargs.get("preexec_fn") is None:
            kwargs["preexec_fn"] = preexec
        return await original(*args, **kwargs)

    create_subprocess_exec.__wrapped__ = original  # type: ignore[attr-defined]
    create_subprocess_exec._murmur_preexec_wrapper = True  # type: ignore[attr-defined]
    asyncio.subprocess.create_subprocess_exec = create_subprocess_exec
