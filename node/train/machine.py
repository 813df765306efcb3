"""This machine's memory as a node may plan with it: what the kernel says is available now."""

from __future__ import annotations

import os


def available_ram() -> int:
    """Bytes of RAM available to a new allocation (MemAvailable; free pages where /proc is missing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
