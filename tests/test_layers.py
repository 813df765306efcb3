"""The packages' layers import one way (docs/architecture.md, "Layers"): a module imports only its
own layer or those below it, and gossip/ and topology/ stay usable without node or a network."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]

# Top to bottom: a layer may import those after it, never those before it.
LAYERS = ("node.cli", "node.runtime", "node.monitor", "node.config", "node.algorithms", "node.net", "node.swarm",
          "node.train", "gossip", "topology")
RANK = {layer: rank for rank, layer in enumerate(LAYERS)}

# Upward imports being cut on other branches, as (importing file, imported module). The lead empties this
# set when those branches are merged; an entry that no longer occurs fails the test, so none outlives its cut.
KNOWN_UNTIL_MERGED: set[tuple[str, str]] = set()

# DESIGN.md: gossip/ and topology/ never import node, hivemind, libp2p or asyncio networking. Plain asyncio
# (tasks, queues, events: the in-memory transport, the exchange) is theirs to use.
NOT_BELOW_NODE = ("node", "hivemind", "libp2p", "p2pclient", "multiaddr", "trio", "socket", "ssl", "http",
                  "urllib", "aiohttp", "websockets", "zmq", "grpc", "asyncio.streams", "asyncio.open_connection",
                  "asyncio.start_server", "asyncio.open_unix_connection", "asyncio.start_unix_server")
# Event-loop methods that open sockets, whatever the loop object is called.
SOCKET_METHODS = {"create_connection", "create_server", "create_unix_connection", "create_unix_server",
                  "create_datagram_endpoint", "sock_connect", "sock_accept", "open_connection", "start_server"}


def layer_of(module: str) -> str | None:
    """The layer of a dotted module name; None outside the layers (stdlib, third party, node/__init__)."""
    for layer in LAYERS:
        if module == layer or module.startswith(layer + "."):
            return layer
    return None


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, module: str) -> Iterator[tuple[int, str]]:
    """(line, imported module) for every import in the file `module` is: top level, in functions, under
    `if TYPE_CHECKING:`, relative; `from a import b` yields a.b after a, since b may be a module."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                imported = ".".join([*base, node.module] if node.module else base)
            else:
                imported = node.module or ""
            yield node.lineno, imported
            for alias in node.names:
                if alias.name != "*":
                    yield node.lineno, f"{imported}.{alias.name}"


def sources(*packages: str) -> list[tuple[Path, str]]:
    return [(path, module_name(path)) for package in packages for path in sorted((ROOT / package).rglob("*.py"))]


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def upward_imports(files: Iterable[tuple[Path, str]]) -> Iterator[tuple[str, int, str, str]]:
    """(file, line, imported module, what is wrong) for each import that goes up the layers."""
    for path, module in files:
        own = layer_of(module)
        if own is None:
            continue
        seen = set()
        for line, imported in imports(path, module):
            target = layer_of(imported)
            # `from node.cli import x` names node.cli and node.cli.x: one arrow, reported once
            if target is None or RANK[target] >= RANK[own] or (line, target) in seen:
                continue
            seen.add((line, target))
            yield shown(path), line, imported, f"{own} imports {imported} ({target} is above it)"


def test_no_layer_imports_a_layer_above_it() -> None:
    found = list(upward_imports(sources("node", "gossip", "topology")))
    offending = [f"{file}:{line}: {why}" for file, line, imported, why in found
                 if (file, imported) not in KNOWN_UNTIL_MERGED]
    assert not offending, "imports against the layer order " + " > ".join(LAYERS) + ":\n" + "\n".join(offending)
    gone = KNOWN_UNTIL_MERGED - {(file, imported) for file, _, imported, _ in found}
    assert not gone, f"these upward imports are gone: take them out of KNOWN_UNTIL_MERGED: {sorted(gone)}"


def network_uses(path: Path, module: str) -> Iterator[tuple[int, str]]:
    """(line, what) for each import of node or a network stack, and each use of a socket-opening call."""
    for line, imported in imports(path, module):
        if any(imported == name or imported.startswith(name + ".") for name in NOT_BELOW_NODE):
            yield line, f"imports {imported}"
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Attribute) and node.attr in SOCKET_METHODS:
            yield node.lineno, f"calls .{node.attr}"


def test_gossip_and_topology_need_neither_node_nor_a_network() -> None:
    offending = [f"{shown(path)}:{line}: {what}"
                 for path, module in sources("gossip", "topology") for line, what in network_uses(path, module)]
    assert not offending, "gossip/ and topology/ must not import node or networking:\n" + "\n".join(offending)


def test_the_checks_see_every_kind_of_import(tmp_path: Path) -> None:
    """Function-level, TYPE_CHECKING and relative imports count as much as top-level ones."""
    probe = tmp_path / "probe.py"
    probe.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from node.config import X\n"
                     "def f():\n    import node.cli.main\nfrom ..runtime import serve\nfrom . import records\n"
                     "from node.train import data\n")
    found = {(line, imported) for _, line, imported, _ in upward_imports([(probe, "node.net.probe")])}
    assert found == {(3, "node.config"), (5, "node.cli.main"), (6, "node.runtime")}, found
    probe.write_text("import asyncio\nasync def f(loop):\n    await asyncio.sleep(0)\n"
                     "    await loop.create_connection(None)\n    from asyncio import open_connection\n")
    assert [line for line, _ in network_uses(probe, "gossip.probe")] == [5, 4]
