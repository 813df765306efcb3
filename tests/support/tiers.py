"""The rule that every test carries a tier marker, and the order the tiers run in (a pytest plugin, loaded by
tests/conftest.py)."""

import pytest

# The tiers `make test-fast` and CI select by; `slow` only refines `unit`, so it is no tier of its own.
TIERS = frozenset({"unit", "multiprocess", "container", "browser"})
# Heaviest first: under `make test`'s two workers (a file each) the long container and node-process files
# start early and the quick in-process files fill the gaps, rather than one long file ending the run alone.
# A file ranks as its heaviest test; the order within a file stays as written. xdist keeps this order
# only with --no-loadscope-reorder (the Makefile's): by default it sorts files by their number of tests.
_RANK = {"container": 0, "multiprocess": 1, "browser": 1, "slow": 2}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects anything, so an unmarked test fails every run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    untiered = [item.nodeid for item in items if not TIERS & {mark.name for mark in item.iter_markers()}]
    if untiered:
        raise pytest.UsageError(f"{len(untiered)} test(s) carry no tier marker ({', '.join(sorted(TIERS))}): "
                                + ", ".join(untiered))
    rank: dict[str, tuple[int, int]] = {}
    for index, item in enumerate(items):
        heaviest = min((_RANK[m.name] for m in item.iter_markers() if m.name in _RANK), default=len(_RANK))
        if item.get_closest_marker("run_last") is not None:  # its load would skew the other node files' timing
            heaviest = len(_RANK) + 1
        was = rank.setdefault(item.path.as_posix(), (heaviest, index))
        rank[item.path.as_posix()] = (min(was[0], heaviest), was[1])
    items.sort(key=lambda item: rank[item.path.as_posix()])

