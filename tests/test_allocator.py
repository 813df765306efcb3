"""The node's C allocator setting (node/runtime/allocator.py): model-sized arrays freed between live ones
go back to the system, which glibc's default dynamic threshold does not do."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from node.runtime.allocator import bound_allocator_slack

pytestmark = pytest.mark.unit

# Frees 2 MiB arrays between live ones (a sync's transient copies between the arrays it keeps) and
# prints how many MiB of them the process still holds.
_FRAGMENT = textwrap.dedent("""
    import os, sys
    import numpy as np
    from node.runtime.allocator import bound_allocator_slack
    if sys.argv[1] == "set":
        assert bound_allocator_slack({}, "cuda")
    def rss_mib():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    big = np.ones(1 << 21, np.float32)  # 8 MiB mapped and freed: glibc raises its threshold past 2 MiB
    del big
    before = rss_mib()
    arrays = [np.ones(1 << 19, np.float32) for _ in range(128)]  # 256 MiB
    kept = arrays[::8]  # 32 MiB live between the freed ones
    del arrays
    print(rss_mib() - before - 32)
""")


def _retained_mib(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", _FRAGMENT, mode], capture_output=True, text=True, timeout=120,
                         check=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    return float(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_model_sized_arrays_go_back_to_the_system_with_the_nodes_setting() -> None:
    assert _retained_mib("default") > 150, "glibc's default keeps the holes (what the setting is for)"
    assert _retained_mib("set") < 16


def test_a_threshold_the_environment_sets_is_left_alone() -> None:
    assert not bound_allocator_slack({"MALLOC_MMAP_THRESHOLD_": "65536"}, "cuda")
    assert not bound_allocator_slack({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}, "cuda")


def test_a_cpu_node_keeps_glibcs_default_so_its_training_steps_stay_fast() -> None:
    assert not bound_allocator_slack({}, "cpu")
