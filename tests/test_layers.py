"""The daemon's lower layers name nothing above them, not even for type checking: node.swarm (the one
loop) and node.train (what one node computes) never import node.net, node.algorithms or anything that
runs the node."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
ABOVE = ("node.algorithms", "node.net", "node.runtime", "node.monitor", "node.cli")


def imported(path: Path) -> set[str]:
    """Every module `path` imports, wherever the import statement stands."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", ["node/swarm", "node/train"])
def test_a_lower_layer_imports_nothing_above_it(package: str) -> None:
    found = {f"{path.relative_to(ROOT)}: {name}" for path in sorted((ROOT / package).rglob("*.py"))
             for name in imported(path) if name.startswith(ABOVE)}
    assert not found, sorted(found)

