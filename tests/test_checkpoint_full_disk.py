"""A really full disk: a 256 KiB tmpfs mounted in a private mount namespace (`unshare --mount`, so
the host's mounts are untouched), in which a child process writes a node checkpoint and the
swarm-average model until the disk is full. Each failed write raises OSError (ENOSPC) and leaves the
file written before it readable and unchanged, with no temporary file left behind.

Needs root and util-linux's `unshare` (as in CI); without them the test fails, it does not skip."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

TMPFS_SIZE = "256k"

CHILD = textwrap.dedent("""
    import asyncio, errno, json, sys
    from pathlib import Path
    import numpy as np
    from node.train.checkpoint import load_checkpoint, save_checkpoint
    from node.config import NodeConfig
    from node.runtime.saving import SWARM_AVERAGE_FILE
    from node.runtime.saving import save_swarm_average as _save_swarm_average
    from node.runtime.status import NodeRuntime
    from node.swarm.swarm_eval import IncludedPeer, SwarmEvalResult

    disk = Path(sys.argv[1])
    small = {"w": np.arange(1000, dtype=np.float32)}          # 4 KB: fits
    large = {"w": np.ones(200_000, dtype=np.float32)}          # 800 KB: does not
    out = {}

    def attempt(write):
        try:
            write()
        except OSError as exc:
            return errno.errorcode.get(exc.errno, str(exc.errno))
        return None

    path = disk / "checkpoint.safetensors"
    save_checkpoint(path, small, {"step": 1})
    out["checkpoint_error"] = attempt(lambda: save_checkpoint(path, large, {"step": 2}))
    kept = load_checkpoint(path)
    out["checkpoint_kept"] = bool(np.array_equal(kept.tensors["w"], small["w"])) and kept.meta["step"] == 1

    runtime = NodeRuntime(NodeConfig(data_dir=disk, swarm="full-disk"), founding=True)
    runtime.config_hash, runtime.swarm_doc = "c0ffee", {"version": 1}
    result = SwarmEvalResult(2.5, "me", (IncludedPeer("me", 7), IncludedPeer("peer-a", 9)), {}, 0.1)
    out["average_saved"] = asyncio.run(_save_swarm_average(runtime, small, result))
    out["average_error"] = attempt(lambda: asyncio.run(_save_swarm_average(runtime, large, result)))
    average = load_checkpoint(disk / SWARM_AVERAGE_FILE)
    out["average_kept"] = bool(np.array_equal(average.tensors["w"], small["w"]))
    out["average_meta"] = {k: average.meta[k] for k in ("kind", "min_step", "max_step", "peers", "val_loss")}
    out["files"] = sorted(p.name for p in disk.iterdir())
    print(json.dumps(out))
""")


def test_a_full_disk_fails_the_write_and_keeps_the_previous_checkpoint_and_average(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    script = f'mount -t tmpfs -o size={TMPFS_SIZE} murmur-full-disk "$1" && exec "$2" -c "$3" "$1"'
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(disk),
                           sys.executable, CHILD], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[1])
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout}\n{done.stderr[-3000:]}"
    out = json.loads(done.stdout.strip().splitlines()[-1])

    assert out["checkpoint_error"] == "ENOSPC" and out["checkpoint_kept"]
    assert out["average_saved"] == str(disk / "swarm-average.safetensors")
    assert out["average_error"] == "ENOSPC" and out["average_kept"]
    assert out["average_meta"] == {"kind": "swarm-average", "min_step": 7, "max_step": 9,
                                   "peers": json.dumps(["me", "peer-a"]), "val_loss": 2.5}
    # the failed writes left no temporary file; the first writes had no earlier file to keep as .prev
    assert out["files"] == ["checkpoint.safetensors", "swarm-average.safetensors"]
    assert not any(disk.iterdir()), "the tmpfs leaked out of its mount namespace"
