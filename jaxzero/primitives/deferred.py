"""Arrays read only when they are needed: a subtree of a saved state that lives on disk.

The offload engine's disk units are not in RAM between steps; a checkpoint reads each when it writes
it (one unit in RAM at a time, not all of them). A restore, likewise, reads each unit when the trainer
places it. In a saved state such a subtree is a `Deferred`: its abstract shapes, and the function
that reads it. Tree utilities see a `Deferred` as one leaf;
`abstract` puts its shapes in its place (for byte counts and metadata), `resolved` its arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax


@dataclass(frozen=True)
class Deferred:
    """A subtree read when it is needed; `shapes` is its tree of ShapeDtypeStructs. `read()` returns
    a tuple of which this subtree is item `index` (a unit's masters and optimizer state are read
    together: `pair` makes one `Deferred` of two such halves)."""

    read: Callable[[], tuple[Any, ...]]
    index: int
    shapes: Any

    def load(self) -> Any:
        """The subtree's arrays (blocking)."""
        return self.read()[self.index]


def pair(first: Deferred, second: Deferred, keys: tuple[str, str]) -> Deferred | None:
    """One `Deferred` of {keys[0]: first, keys[1]: second}, read once, where both are halves of one
    read; None otherwise."""
    if first.read is not second.read:
        return None
    read = first.read
    shapes = {keys[0]: first.shapes, keys[1]: second.shapes}
    return Deferred(lambda: ({keys[0]: (r := read())[first.index], keys[1]: r[second.index]},), 0, shapes)


def is_deferred(x: Any) -> bool:
    return isinstance(x, Deferred)


def abstract(tree: Any) -> Any:
    """`tree` with each `Deferred` replaced by its shapes (the other leaves as they are)."""
    return jax.tree.map(lambda x: x.shapes if is_deferred(x) else x, tree, is_leaf=is_deferred)


def resolved(tree: Any) -> Any:
    """`tree` with each `Deferred` read (blocking): its arrays in its place. Halves of one read are
    read once."""
    reads: dict[int, tuple[Any, ...]] = {}

    def load(x: Any) -> Any:
        if not is_deferred(x):
            return x
        if id(x.read) not in reads:
            reads[id(x.read)] = x.read()
        return reads[id(x.read)][x.index]

    return jax.tree.map(load, tree, is_leaf=is_deferred)
