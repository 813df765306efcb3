"""Helpers shared by the tests: swarms of node processes, network namespaces, containers, tiny models."""
