"""Orbax's handler of a checkpoint's `state` item: each part (`jaxzero.storage.checkpoint_layout`) an Orbax
PyTree checkpoint in a directory of its own, written and read one after another with a bounded number
of bytes in flight to or from disk, so that a save or a restore holds about one unit beyond the state
in host RAM. `jaxzero.storage.checkpoint` registers it with the CheckpointManager.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from jaxzero.primitives.deferred import Deferred, resolved
from jaxzero.storage.checkpoint_layout import PYTREE_METADATA, Part, join_parts, largest_array_bytes

# Orbax refuses an array that fills its in-flight limit exactly: a MiB over the largest admits it.
ARRAY_MARGIN = 2**20


@dataclass
class PartsSave(ocp.args.CheckpointArgs):
    """The `state` item's save: `parts` in order, read at their turn (`start(position)` first: a part
    may be replaced by a copy until then), `written(position)` once a unit's part is on disk."""

    parts: list[Part]
    start: Callable[[int], None]
    written: Callable[[int], None]


@dataclass
class PartsRestore(ocp.args.CheckpointArgs):
    """The `state` item's restore onto `parts` (abstract trees carrying their shardings)."""

    parts: Sequence[Part]


class PartsHandler(ocp.CheckpointHandler):
    """Orbax handler of the `state` item: each part an Orbax PyTree checkpoint in a directory of its
    own, written and read one after another, `in_flight` bytes at most in flight to disk (see the
    module docstring). Checkpoints of the earlier layout (one PyTree) are read whole."""

    def __init__(
        self,
        in_flight: int,
        restore_batch: int | None,
        multiprocessing: Any,
        finalized: Callable[[Path], None] = lambda step_dir: None,
    ):
        """`finalized(step_dir)`: called with the step's temporary directory once every item of a save
        is written, before Orbax commits it (on the primary process)."""
        self._finalized = finalized
        self._in_flight_gb = in_flight / 10**9  # Orbax's unit
        self._restore_gb = None if restore_batch is None else restore_batch / 10**9
        self._multiprocessing = multiprocessing

    def _pytree(self, save_gb: float | None = None) -> ocp.PyTreeCheckpointHandler:
        return ocp.PyTreeCheckpointHandler(
            save_concurrent_gb=self._in_flight_gb if save_gb is None else save_gb,
            restore_concurrent_gb=self._restore_gb,
            multiprocessing_options=self._multiprocessing,
            # Uncompressed: training weights barely compress, and compressing more than doubles a
            # save's CPU time, which the host update needs, and slows the save (BENCHMARKS.md,
            # "Checkpoints in bounded host RAM").
            use_compression=False,
            # Copies to plain host RAM: XLA's pinned pool is sized for the training state alone, and a
            # save's copies there fail once it is full (BENCHMARKS.md, "checkpoints through host RAM a
            # batch at a time").
            enable_pinned_host_transfer=False,
        )

    def save(self, directory: epath.Path, args: PartsSave) -> None:
        # Orbax writes an array whole and refuses one over its in-flight limit (gpt-oss-20b's float32
        # embedding is 2.3 GB): the limit admits the state's largest array, within the one unit of host
        # RAM a save may take beyond the buffer (module docstring).
        largest = largest_array_bytes([part.tree for part in args.parts]) + ARRAY_MARGIN
        pytree = self._pytree(max(self._in_flight_gb, largest / 10**9))
        for i in range(len(args.parts)):
            if args.parts[i].position is not None:
                args.start(args.parts[i].position)
            part = args.parts[i]  # after `start`: the unit as it is now, or the copy made of it
            path = epath.Path(directory) / part.name
            path.mkdir(parents=True, exist_ok=True)  # every process: the file system may be shared
            tree = resolved(part.tree)  # a disk unit is read now, and dropped once written
            pytree.save(path, args=ocp.args.PyTreeSave(tree))
            del tree
            if part.position is not None:
                args.parts[i] = part._replace(tree=None)  # a copy's bytes go with it
                args.written(part.position)

    def finalize(self, directory: epath.Path) -> None:
        pytree = self._pytree()  # merges each part's per-process files (the primary process, at commit)
        for path in sorted(p for p in epath.Path(directory).iterdir() if p.is_dir()):
            pytree.finalize(path)
        self._finalized(Path(directory).parent)

    def restore(self, directory: epath.Path, args: PartsRestore) -> dict[str, Any]:
        pytree, directory = self._pytree(), epath.Path(directory)
        if (directory / PYTREE_METADATA).exists():  # the earlier layout: the whole state as one PyTree
            target = join_parts([p.tree for p in args.parts])
            targets = ocp.checkpoint_utils.construct_restore_args(target)
            return dict(pytree.restore(directory, args=ocp.args.PyTreeRestore(target, restore_args=targets)))

        def read(part: Part) -> Any:
            targets = ocp.checkpoint_utils.construct_restore_args(part.tree)
            return pytree.restore(
                directory / part.name, args=ocp.args.PyTreeRestore(part.tree, restore_args=targets)
            )

        def deferred(part: Part) -> dict[str, Deferred]:  # read when the trainer places the unit
            def both() -> tuple[Any, Any]:
                tree = read(part)
                return tree["params"], tree["opt_state"]

            return {k: Deferred(both, i, part.tree[k]) for i, k in enumerate(("params", "opt_state"))}

        scalars, *units = args.parts
        return join_parts([read(scalars), *map(deferred, units)])

    def metadata(self, directory: epath.Path) -> None:
        return None

    def close(self) -> None:
        pass


ocp.args.register_with_handler(PartsHandler, for_save=True)(PartsSave)
ocp.args.register_with_handler(PartsHandler, for_restore=True)(PartsRestore)
