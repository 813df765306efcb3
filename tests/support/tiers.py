"""The rule that every test carries a tier marker (a pytest plugin, loaded by tests/conftest.py)."""

import pytest

# The tiers `make test-fast` and CI select by; `slow` only refines `unit`, so it is no tier of its own.
TIERS = frozenset({"unit", "multiprocess", "container", "browser"})


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects anything, so an unmarked test fails every run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    untiered = [item.nodeid for item in items if not TIERS & {mark.name for mark in item.iter_markers()}]
    if untiered:
        raise pytest.UsageError(f"{len(untiered)} test(s) carry no tier marker ({', '.join(sorted(TIERS))}): "
                                + ", ".join(untiered))
