"""Streaming DiLoCo's fragments: the model's tensors split into P groups of near-equal size, each
synced at its own inner step, so every parameter is in exactly one fragment."""

from __future__ import annotations

from collections.abc import Mapping


def fragment_partition(sizes: Mapping[str, int], fragments: int) -> tuple[tuple[str, ...], ...]:
    """Whole tensors into `fragments` groups: the largest tensor first into the lightest group (ties:
    the lower group index; equal sizes keep the model's order), each group in the model's order.

    Every node with the same model computes the same groups. ValueError when there are fewer tensors
    than fragments (a fragment would be empty)."""
    if fragments < 1:
        raise ValueError(f"fragments must be >= 1, got {fragments}")
    names = list(sizes)
    if len(names) < fragments:
        raise ValueError(f"{fragments} fragments need at least as many tensors; the model has {len(names)}")
    order = {name: i for i, name in enumerate(names)}
    loads = [0] * fragments
    groups: list[list[str]] = [[] for _ in range(fragments)]
    for name in sorted(names, key=lambda n: (-int(sizes[n]), order[n])):
        lightest = min(range(fragments), key=lambda g: (loads[g], g))
        groups[lightest].append(name)
        loads[lightest] += int(sizes[name])
    return tuple(tuple(sorted(group, key=order.__getitem__)) for group in groups)
