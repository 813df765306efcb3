"""Crash-safe replacement of files and directories: write beside the target, fsync, rename into place,
fsync the directory (docs/training.md, "Checkpoints" and "Export").

A process killed at any instant, a full disk or an exception leaves either the old content or the new
one complete at the target's name, never neither. Temporaries carry the writer's pid
(`.<name>.<pid>...tmp`), so a later writer removes those whose writer is gone and a retry works.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

_in_flight: set[str] = set()  # temporaries this process is writing now (never removed as stale)


def fsync_directory(directory: Path) -> None:
    """Make the renames and unlinks done in `directory` durable."""
    fd = os.open(directory, os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (a freshly written export), deepest first."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_directory(Path(folder))


@contextlib.contextmanager
def writing(tmp: Path) -> Iterator[None]:
    """While the block runs, `tmp` is this process's temporary in flight, not a stale one."""
    key = str(tmp.absolute())
    _in_flight.add(key)
    try:
        yield
    finally:
        _in_flight.discard(key)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def temporary_name(target: Path, tail: str = ".tmp") -> str:
    """The name of a temporary that will become `target`: hidden, beside it, with this process's pid."""
    return f".{target.name}.{os.getpid()}{tail}"


def stale_temporaries(target: Path) -> list[Path]:
    """Temporaries of `target` left by a writer that was killed: its pid is gone, or it is this
    process's pid (a restarted container reuses pids) and this process is not writing it now."""
    stale = []
    prefix = f".{target.name}."
    for candidate in target.parent.glob(f"{glob_escape(prefix)}*.tmp"):
        pid_text = candidate.name[len(prefix):].split(".", 1)[0]
        if not pid_text.isdigit() or str(candidate.absolute()) in _in_flight:
            continue
        pid = int(pid_text)
        if pid == os.getpid() or not _alive(pid):
            stale.append(candidate)
    return stale


def glob_escape(text: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)


def remove(path: Path) -> None:
    """Remove a file or a directory tree (nothing if it is not there)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def remove_stale_temporaries(target: Path) -> None:
    for stale in stale_temporaries(target):
        logger.info("removing %s, left by an interrupted write", stale)
        with contextlib.suppress(OSError):
            remove(stale)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


@functools.cache
def _renameat2() -> Callable[..., int] | None:
    if sys.platform != "linux":
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def exchange(a: Path, b: Path) -> bool:
    """Swap `a` and `b` in one atomic step (Linux renameat2 RENAME_EXCHANGE); False, with nothing
    done, where the system or the filesystem cannot."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def aside_path(destination: Path) -> Path:
    """Where the old directory waits while a new one is renamed into place (without an atomic swap)."""
    return destination.with_name(f".{destination.name}.old")


def previous_directory(destination: Path) -> Path:
    return destination.with_name(destination.name + ".prev")


def recover_directory(destination: Path) -> None:
    """Undo what an interrupted `replace_directory` left: an old directory moved aside while no new one
    took its name comes back; one whose successor is in place, and dead temporaries, are removed."""
    destination = destination.absolute()
    aside = aside_path(destination)
    if os.path.lexists(aside):
        if os.path.lexists(destination):
            logger.info("removing %s, left by an interrupted export", aside)
            remove(aside)
        else:
            logger.warning("an export was interrupted while replacing %s: the previous one is back", destination)
            os.replace(aside, destination)
            fsync_directory(destination.parent)
    if destination.parent.is_dir():
        remove_stale_temporaries(destination)


def replace_directory(destination: Path, fill: Callable[[Path], None], keep_previous: bool,
                      force: bool = False) -> None:
    """Write a directory with `fill` beside `destination`, fsync it, then move it into place. An existing
    one becomes `<destination>.prev` (`keep_previous`), is removed once the new one is in place
    (`force`), or is refused (FileExistsError). A failure or a kill at any point leaves the old
    directory or the new one, complete, at `destination`: the two are swapped in one atomic step
    where Linux can (renameat2), else the old one is renamed aside first and a later call puts it back
    (`recover_directory`)."""
    destination = destination.absolute()
    recover_directory(destination)
    if os.path.lexists(destination) and not (keep_previous or force):
        raise FileExistsError(f"{destination} exists")
    parent = destination.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=temporary_name(destination, "."), suffix=".tmp"))
    with writing(tmp):
        _replace_with(destination, tmp, fill, keep_previous)


def _replace_with(destination: Path, tmp: Path, fill: Callable[[Path], None], keep_previous: bool) -> None:
    parent = destination.parent
    try:
        fill(tmp)
        _fsync_tree(tmp)
        old: Path | None = None
        if not os.path.lexists(destination):
            os.rename(tmp, destination)
        elif exchange(tmp, destination):
            old = tmp  # now holds the old directory
        else:
            old = aside_path(destination)
            remove(old)
            os.rename(destination, old)
            fsync_directory(parent)
            os.rename(tmp, destination)
        fsync_directory(parent)
        if old is not None:
            if keep_previous:
                previous = previous_directory(destination)
                remove(previous)
                os.rename(old, previous)
                fsync_directory(parent)
            else:
                remove(old)
    finally:
        with contextlib.suppress(OSError):
            remove(tmp)
