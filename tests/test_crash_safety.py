"""A save killed at every step: a child process writes a checkpoint (or replaces an export directory,
as `murmur export --force` does) and dies with os._exit right before its first, or right after its
N-th, filesystem operation (os.replace, rename, unlink, rmdir, fsync, the atomic directory swap), for every
N until the write completes. The parent then finds the old state or the new one, complete, never
neither; and a retry succeeds and leaves no temporary behind.

Also: a checkpoint whose newest file is torn keeps its good `.prev` through a save (the window the
old switch had: it renamed the torn file over `.prev` before the new file was in place), and a
failing export leaves the old directory as it was."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from node.train.checkpoint import CHECKPOINT_FILE, is_complete, load_checkpoint, previous_path, save_checkpoint
from node.train.durable import aside_path, exchange, recover_directory, replace_directory

pytestmark = pytest.mark.unit

ROOT = Path(__file__).parents[1]
KILLED = 77

DYING = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    import numpy as np
    import node.train.durable as durable
    from node.train.checkpoint import save_checkpoint

    die_at, events = int(sys.argv[2]), [0]

    def event():
        events[0] += 1
        if events[0] == die_at:
            os._exit(77)

    def dying(fn):
        def call(*args, **kwargs):
            if events[0] == 0:
                event()  # killed before the first operation (the temporary written, not yet synced)
            result = fn(*args, **kwargs)
            event()  # killed after each operation (the same as before the next one)
            return result
        return call

    for name in ("replace", "rename", "unlink", "rmdir", "fsync"):
        setattr(os, name, dying(getattr(os, name)))
    durable.exchange = dying(durable.exchange)
    if sys.argv[3] == "no-exchange":
        durable.exchange = dying(lambda a, b: False)
""")

SAVE = DYING + textwrap.dedent("""
    save_checkpoint(Path(sys.argv[1]), {"w": np.full(256, 2.0, np.float32)}, {"step": 2})
""")

EXPORT = DYING + textwrap.dedent("""
    def fill(directory):
        (directory / "model.safetensors").write_text("new" * 100)
        (directory / "sub").mkdir()
        (directory / "sub" / "config.json").write_text("new")

    durable.replace_directory(Path(sys.argv[1]), fill, keep_previous=sys.argv[4] == "prev", force=True)
""")


def tensors(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full(256, value, np.float32)}


@pytest.mark.parametrize("before", ["none", "one", "two", "torn"])
def test_a_checkpoint_save_killed_at_any_step_leaves_the_old_or_the_new_checkpoint(tmp_path, before) -> None:
    old_step = {"none": None, "one": 1, "two": 1, "torn": 0}[before]

    def prepare(directory: Path) -> Path:
        directory.mkdir()
        path = directory / CHECKPOINT_FILE
        if before in ("two", "torn"):
            save_checkpoint(path, tensors(0.0), {"step": 0})
        if before != "none":
            save_checkpoint(path, tensors(1.0), {"step": 1})
        if before == "torn":  # a newest file cut short (a disk error, an older writer)
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2])
        return path

    path = tmp_path / "unused"

    def check(die_at: int, completed: bool) -> None:
        checkpoint = load_checkpoint(path)
        allowed = {2} if completed else {old_step, 2}
        step = None if checkpoint is None else checkpoint.meta["step"]
        assert step in allowed, f"killed at event {die_at}: found step {step}, expected one of {allowed}"
        if checkpoint is not None:
            np.testing.assert_array_equal(checkpoint.tensors["w"], tensors(float(step))["w"])
        # a retry works and cleans up after the killed save
        save_checkpoint(path, tensors(3.0), {"step": 3})
        assert load_checkpoint(path).meta["step"] == 3
        assert sorted(p.name for p in path.parent.iterdir()) == sorted(
            [CHECKPOINT_FILE] + ([previous_path(path).name] if checkpoint is not None else []))

    # each run starts from the same files
    for die_at in range(1, 200):
        path = prepare(tmp_path / f"run{die_at}")
        done = subprocess.run([sys.executable, "-c", SAVE, str(path), str(die_at), "exchange"], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode in (0, KILLED), done.stderr[-2000:]
        check(die_at, done.returncode == 0)
        if done.returncode == 0:
            break
    else:
        raise AssertionError("the save never completed")
    assert die_at > 3, "the child was not killed at the switch's steps"


def test_a_save_over_a_torn_checkpoint_keeps_the_good_previous_one(tmp_path) -> None:
    path = tmp_path / CHECKPOINT_FILE
    save_checkpoint(path, tensors(0.0), {"step": 0})
    save_checkpoint(path, tensors(1.0), {"step": 1})
    path.write_bytes(path.read_bytes()[:100])
    assert not is_complete(path) and is_complete(previous_path(path))
    save_checkpoint(path, tensors(2.0), {"step": 2})
    assert load_checkpoint(path).meta["step"] == 2
    assert load_checkpoint(previous_path(path)).meta["step"] == 0  # the good one, not the torn one


def write_tree(directory: Path, word: str) -> None:
    directory.mkdir()
    (directory / "model.safetensors").write_text(word * 100)
    (directory / "sub").mkdir()
    (directory / "sub" / "config.json").write_text(word)


def tree_state(directory: Path) -> str | None:
    """'old' or 'new' when `directory` holds that export complete, None when there is nothing."""
    if not directory.exists():
        return None
    files = sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))
    assert files == ["model.safetensors", "sub", "sub/config.json"], files
    word = (directory / "sub" / "config.json").read_text()
    assert (directory / "model.safetensors").read_text() == word * 100
    return word


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exchange", "no-exchange"])
@pytest.mark.parametrize("keep", ["force", "prev"])
def test_an_export_replaced_and_killed_at_any_step_leaves_the_old_or_the_new_export(tmp_path, mode, keep) -> None:
    if mode == "exchange":
        a, b = tmp_path / "a", tmp_path / "b"
        a.mkdir(), b.mkdir()
        if not exchange(a, b):
            pytest.skip("this filesystem has no atomic directory swap")
    completed_runs = []
    for die_at in range(1, 300):
        parent = tmp_path / f"run{die_at}"
        parent.mkdir()
        destination = parent / "out"
        write_tree(destination, "old")
        done = subprocess.run([sys.executable, "-c", EXPORT, str(destination), str(die_at), mode, keep], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode in (0, KILLED), done.stderr[-2000:]
        completed = done.returncode == 0
        if mode == "exchange":  # the destination itself is never without a complete export
            assert tree_state(destination) in ({"new"} if completed else {"old", "new"}), die_at
        else:  # the old export may wait aside, and the next export (or `murmur export`) puts it back
            assert tree_state(destination) in ({"new"} if completed else {"old", "new", None}), die_at
        recover_directory(destination)
        state = tree_state(destination)
        assert state in ({"new"} if completed else {"old", "new"}), f"killed at event {die_at}: {state}"
        # a retry works and leaves nothing behind but the export (and its .prev when kept)
        replace_directory(destination, lambda d: _fill(d, "newer"),
                          keep_previous=keep == "prev", force=True)
        assert tree_state(destination) == "newer"
        names = sorted(p.name for p in parent.iterdir())
        assert names in (["out"], ["out", "out.prev"]) and (keep == "prev" or names == ["out"]), names
        if completed:
            completed_runs.append(die_at)
            break
    assert completed_runs and completed_runs[0] > 4, "the child was not killed at the swap's steps"


def _fill(directory: Path, word: str) -> None:
    (directory / "model.safetensors").write_text(word * 100)
    (directory / "sub").mkdir()
    (directory / "sub" / "config.json").write_text(word)


def test_a_failing_export_leaves_the_old_one_and_no_leftovers(tmp_path) -> None:
    destination = tmp_path / "out"
    write_tree(destination, "old")

    def fail(directory: Path) -> None:
        (directory / "model.safetensors").write_text("partial")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        replace_directory(destination, fail, keep_previous=False, force=True)
    assert tree_state(destination) == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    with pytest.raises(FileExistsError):  # without force an existing export is refused
        replace_directory(destination, lambda d: _fill(d, "new"), keep_previous=False)
    assert tree_state(destination) == "old"


def test_an_export_interrupted_between_its_renames_is_put_back(tmp_path) -> None:
    destination = tmp_path / "out"
    write_tree(aside_path(destination), "old")  # the old export renamed aside, the new one not yet in place
    recover_directory(destination)
    assert tree_state(destination) == "old" and not aside_path(destination).exists()
