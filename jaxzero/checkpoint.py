"""Orbax checkpoints of the whole training state, written from where it lives and restored to where it
belongs, in bounded host RAM.

A checkpoint is one step directory under `<run_dir>/checkpoints/` holding two items:

    state  one ordinary Orbax PyTree checkpoint per part, in the order they are written:
             state/scalars      {"step"} (int32), and float16's {"loss_scale"}
             state/embed        {"params": float32 masters, "opt_state": the unit's optax state}
             state/block_0000   the same for each block, ...
             state/head         the same for the head
           (`ocp.PyTreeCheckpointer().restore(<step>/state/block_0003)` reads one back as NumPy)
    meta   JSON: the data iterator's position, the resolved config, the trainer's layout, the step

The compute-dtype weights of the offload engine are not saved: they are a cast of the masters and
are rebuilt on restore.

Host RAM. A save writes one part at a time with Orbax's PyTree handler, at most half of
`checkpoint.buffer_gib` (1 GiB at most) in flight to disk at once (`save_concurrent_gb`);
accelerator arrays are copied to host RAM one part at a time. A restore reads one part at a time,
at most the buffer at once, and places each array where the target says. So a save or a restore
takes at most the buffer plus one unit of host RAM beyond the state, whatever the model's size;
nothing is copied whole first.

Saves run on a writer thread. With `checkpoint.async_save` (the default) `save` returns at once and
training goes on: the arrays are written from where they live, so before each unit's next in-place
update the trainer passes its `WriteFence`: a unit the writer has not reached is copied into the
rest of the buffer, or, with no room, the update waits until it is written (units are written in the
order the next step updates them). Otherwise `save` returns once the checkpoint is
committed. Saves are atomic either way (Orbax writes into a temporary directory and renames it
when complete; a save killed half-way leaves no step directory behind).

Restores always target the abstract state *with its placement* (`Trainer.abstract_saved_state`):
Orbax does not record memory kinds, and a restore without a target would put host-resident state
into accelerator memory. Checkpoints of the earlier layout (the whole state as one PyTree under
`state/`) are restored too.

Integrity: as a save commits, the CRC-32 of every file of its items (in 64 MiB pieces) goes to
`<step>/checksums.json`; a restore checks them first (`checkpoint.verify`). A checkpoint whose files
changed, whose metadata cannot be read, or whose data-loader state is invalid is set aside to
`checkpoints-unreadable/` and the previous one is used; one whose shapes do not match the run is an
error. A save that fails (disk full, permission denied) raises `CheckpointWriteError` as soon as it is
known, and what it left half-written is removed.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import logging
import os
import re
import shutil
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import flags
from etils import epath
from jax.experimental import multihost_utils

from jaxzero import export_dir
from jaxzero.config import CheckpointConfig, CheckpointError, TrainConfig, buffer_bytes
from jaxzero.deferred import Deferred, abstract, is_deferred, pair, resolved
from jaxzero.models import ModelParams, build_model
from jaxzero.overrides import config_from_dict
from jaxzero.write_fence import WriteFence

log = logging.getLogger(__name__)  # the library speaks through logging (`jaxzero.console`)

CHECKPOINT_DIR = "checkpoints"
UNREADABLE_DIR = f"{CHECKPOINT_DIR}-unreadable"  # checkpoints that failed to restore, set aside
CHECKSUMS_FILE = "checksums.json"
CHECKSUM_PIECE = 64 << 20  # bytes per CRC-32: pieces of one file are summed in parallel
TMP_MARKER = ".orbax-checkpoint-tmp"  # in the names of Orbax's half-written step directories
TMP_SUFFIX = re.escape(TMP_MARKER) + r"[^/]*"  # of a temporary directory's name, to its end
ORBAX_STAGE = ".orbax-export"  # where an Orbax export is written, inside its directory, before moving up
PYTREE_METADATA = "_METADATA"  # in every directory Orbax's PyTree handler writes
IN_FLIGHT_MAX = 2**30  # bytes a save keeps in flight to disk at most (`in_flight_bytes`)
SCALARS = "scalars"  # the part of the state that is not per unit: the step count, float16's loss scale
# Orbax's barriers are named with this prefix (set on the manager), so that the name of the barrier
# that ends Orbax's `Checkpointer.restore` is known: a process whose restore raised before it joins it.
ORBAX_BARRIER_PREFIX = "jaxzero"
ORBAX_RESTORE_BARRIER = ocp.multihost.unique_barrier_key("Checkpointer:restore", prefix=ORBAX_BARRIER_PREFIX)
BARRIER_MISMATCH = "sync_global_devices name mismatch"  # JAX's error when processes meet at other barriers
# Orbax's switch from barriers that are device collectives to the coordination service's: a save
# runs on a writer thread beside training, whose collectives it must not interleave with.
ORBAX_SERVICE_BARRIERS = "experimental_orbax_use_distributed_barrier"


class Part(NamedTuple):
    """One part of a checkpoint's state, written (and read) as one Orbax PyTree checkpoint.

    name:     its directory under `state/` (`SCALARS`, "embed", "block_0000", ..., "head").
    position: the unit's position in the forward order (embedding 0, block i at 1 + i, head last),
              the key of `WriteFence`; None for the scalars.
    tree:     its arrays ({"params", "opt_state"} of a unit), or ShapeDtypeStructs to restore onto.
    """

    name: str
    position: int | None
    tree: Any


def part_names(num_blocks: int) -> list[str]:
    """The units' part names in forward order: "embed", "block_0000", ..., "head"."""
    return ["embed", *(f"block_{i:04d}" for i in range(num_blocks)), "head"]


def state_parts(state: dict[str, Any]) -> list[Part]:
    """A saved state ({"step", "params", "opt_state"} and float16's "loss_scale"; params and
    opt_state in `ModelParams` layout) as its parts, in the order a save writes them: the scalars,
    then each unit in forward order."""
    params, opt_state = state["params"], state["opt_state"]
    scalars = {k: v for k, v in state.items() if k not in ("params", "opt_state")}
    units = [
        (params.embed, opt_state.embed),
        *zip(params.blocks, opt_state.blocks),
        (params.head, opt_state.head),
    ]
    names = part_names(len(params.blocks))

    def unit(p: Any, o: Any) -> Any:  # a disk unit's halves are read together, when it is written
        both = pair(p, o, ("params", "opt_state")) if is_deferred(p) and is_deferred(o) else None
        return both if both is not None else {"params": p, "opt_state": o}

    return [Part(SCALARS, None, scalars)] + [
        Part(name, i, unit(p, o)) for i, (name, (p, o)) in enumerate(zip(names, units))
    ]


def join_parts(trees: Sequence[Any]) -> dict[str, Any]:
    """The saved state of its parts' trees, in `state_parts`' order (inverse of `state_parts`)."""
    scalars, *units = trees
    unit = lambda key: [u[key] for u in units]  # noqa: E731
    to_params = lambda xs: ModelParams(xs[0], tuple(xs[1:-1]), xs[-1])  # noqa: E731
    return {**scalars, "params": to_params(unit("params")), "opt_state": to_params(unit("opt_state"))}


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

    def _pytree(self) -> ocp.PyTreeCheckpointHandler:
        return ocp.PyTreeCheckpointHandler(
            save_concurrent_gb=self._in_flight_gb,
            restore_concurrent_gb=self._restore_gb,
            multiprocessing_options=self._multiprocessing,
            # Uncompressed: training weights compress by under a tenth, and compressing took 2.3x the
            # CPU time of the write, which the host update needs (BENCHMARKS.md, issue 26).
            use_compression=False,
            # Copies to plain host RAM: XLA's pinned pool is sized for the training state alone, and a
            # save's copies there fail once it is full (measured: RESOURCE_EXHAUSTED on an H100).
            enable_pinned_host_transfer=False,
        )

    def save(self, directory: epath.Path, args: PartsSave) -> None:
        pytree = self._pytree()
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


def _service_barriers() -> None:
    """Orbax's barriers through the coordination service, not device collectives (several processes):
    a save's barriers then never interleave with the collectives training runs meanwhile."""
    if jax.process_count() == 1 or ORBAX_SERVICE_BARRIERS not in flags.FLAGS:
        return
    if not flags.FLAGS.is_parsed():  # absl flags read unparsed raise; jaxzero parses none of its own
        flags.FLAGS.mark_as_parsed()
    setattr(flags.FLAGS, ORBAX_SERVICE_BARRIERS, True)


class CheckpointMismatch(CheckpointError):
    """A readable checkpoint of another run (other shapes): an error, not a reason to fall back."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; the message names the step, the directory and the cause."""


@dataclass(frozen=True)
class Restored:
    """A restored checkpoint: the saved arrays placed per the target, and its metadata."""

    step: int
    state: dict[str, Any]  # {"step", "params", "opt_state"}
    meta: dict[str, Any]  # {"data_state", "config", "layout", "step"}


class Checkpointer:
    """Saves and restores training state under `<run_dir>/checkpoints` with an Orbax CheckpointManager.

    Keeps the newest `keep` checkpoints, plus every `keep_every`-th step if set. `save` hands the
    state to the writer thread (see the module docstring); `check` raises what a background write
    has failed with since; `close` waits for pending writes. Every write failure is a
    `CheckpointWriteError`.
    """

    def __init__(self, run_dir: str | Path, cfg: CheckpointConfig, *, largest_array: int | None = None):
        """`largest_array`: the bytes of the state's largest array (`largest_array_bytes` of the
        abstract state); given, a restore reads at most `checkpoint.buffer_gib` (or that array) at a
        time, else as much as Orbax's default allows."""
        self.directory = Path(run_dir).absolute() / CHECKPOINT_DIR
        self.cfg = cfg
        self.buffer = buffer_bytes(cfg)
        # (Orbax refuses an array that fills its limit exactly: a MiB over the largest admits it.)
        restore_batch = None if largest_array is None else max(self.buffer, largest_array + 2**20)
        self._pool = ThreadPoolExecutor(
            max(1, min(16, os.cpu_count() or 1)), thread_name_prefix="jaxzero-ckpt"
        )
        # One save at a time, in the background; `_writing` is the one in progress.
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="jaxzero-ckpt-writer")
        self._writing: Future | None = None
        _service_barriers()
        multiprocessing = ocp.options.MultiprocessingOptions(barrier_sync_key_prefix=ORBAX_BARRIER_PREFIX)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep,
            keep_period=cfg.keep_every or None,
            # Orbax's own asynchronous save would copy the state first; the writer thread is ours.
            enable_async_checkpointing=False,
            create=True,
            multiprocessing_options=multiprocessing,
            cleanup_tmp_directories=True,  # remove what a killed save left half-written
        )
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        # Checksums as the save commits: part of the same atomic rename (see `write_checksums`).
        state_handler = PartsHandler(
            in_flight_bytes(cfg), restore_batch, multiprocessing, self._write_checksums
        )
        registry.add("state", PartsSave, state_handler)
        registry.add("state", PartsRestore, state_handler)
        self.manager = ocp.CheckpointManager(self.directory, options=options, handler_registry=registry)
        self.last_saved: int | None = None  # the newest step whose save was issued

    # -- saving --------------------------------------------------------------------------------------

    def save(
        self, step: int, state: dict[str, Any], meta: dict[str, Any], fence: WriteFence | None = None
    ) -> None:
        """Save `state` ({"step", "params", "opt_state"}) and JSON `meta` as checkpoint `step`, from
        where its arrays live. With `checkpoint.async_save` and the `fence` of the trainer whose state
        it is (`Trainer.fence`, which each step passes before changing a unit), returns at once;
        otherwise once the checkpoint is committed. Raises `CheckpointWriteError` before writing
        anything if the disk lacks the room for it, and for a failure of the previous save."""
        ensure_room(self.directory, state_bytes(state), f"checkpoint {step}")
        self.wait()  # one save at a time; raises the previous one's failure
        parts = state_parts(state)
        background = self.cfg.async_save and fence is not None
        fence = fence if fence is not None else WriteFence()
        sizes = {p.position: state_bytes(p.tree) for p in parts if p.position is not None}
        fence.begin(sizes, self.buffer - in_flight_bytes(self.cfg), partial(_copy_part, parts))
        self.last_saved = step
        self._writing = self._writer.submit(self._write, step, parts, meta, fence)
        if not background:
            self.wait()

    def _write(self, step: int, parts: list[Part], meta: dict[str, Any], fence: WriteFence) -> None:
        """The writer thread's save of checkpoint `step` (its checksums written as it commits); the
        fence is open after, whatever happened."""
        try:
            with self._failure(step):
                state = PartsSave(parts, fence.start, fence.written)
                args = ocp.args.Composite(state=state, meta=ocp.args.JsonSave(meta))
                self.manager.save(step, args=args, force=True)
        finally:
            fence.finish()
            trim_host_heap()

    def check(self) -> None:
        """Raise `CheckpointWriteError` if the background save failed since the last call (cheap)."""
        if self._writing is not None and self._writing.done():
            self.wait()

    def wait(self) -> None:
        """Block until the save in progress, if any, is committed; raise its `CheckpointWriteError`."""
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.result()

    def close(self) -> None:
        """Wait for the pending save, then release the manager and threads (also after a failure, and
        the threads also if the manager's close raises: a failed save's error must not keep them)."""
        try:
            self.wait()
        finally:
            try:
                self.manager.close()
            finally:
                self._writer.shutdown()
                self._pool.shutdown()

    def _failure(self, step: int | None):
        return _WriteFailure(self, step)

    def _write_checksums(self, step_dir: Path) -> None:
        """`checksums.json` of the save being committed in `step_dir` (its temporary directory)."""
        write_checksums(step_dir, self._pool)

    def _remove_partial_saves(self) -> list[Path]:
        """Remove the half-written step directories a failed save left (ours; never a committed one);
        returns those that could not be removed (the cause of the failure may forbid it too)."""
        for p in self.directory.glob(f"*{TMP_MARKER}*"):
            shutil.rmtree(p, ignore_errors=True)
        return sorted(self.directory.glob(f"*{TMP_MARKER}*"))

    # -- restoring -----------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed checkpoint steps, oldest first (half-written saves are never listed)."""
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def read_meta(self, step: int) -> dict[str, Any]:
        """The JSON metadata of checkpoint `step` (cheap: no arrays are read)."""
        return read_meta(self.directory, step)

    def restore_latest(
        self,
        abstract_state: dict[str, Any],
        layout: str,
        run: TrainConfig,
        check_meta: Callable[[dict[str, Any]], Any] = lambda meta: None,
    ) -> Restored | None:
        """The newest checkpoint that restores cleanly onto `abstract_state`, or None if there is none.

        A checkpoint that cannot be used as saved (changed or missing files, unreadable metadata, or
        metadata `check_meta` raises on) is reported, set aside to `checkpoints-unreadable/` and
        skipped in favour of the previous one; one whose shapes do not match is an error.

        With several processes they decide together, step by step, on process 0's list of steps: a
        checkpoint that fails on any process is unreadable on all (the message names the process and
        the cause), so that every process resumes from the same step. The cheap checks (metadata,
        checksums, shapes) are agreed on before Orbax's restore, a collective, is entered; its outcome
        and `check_meta`'s are agreed on after it.
        """
        steps = self._agreed_steps()
        unreadable: list[int] = []
        for step in reversed(steps):
            _, failed = self._everywhere(partial(self._check, step, abstract_state, layout, run))
            restored = None
            if not failed:
                restored, failed = self._everywhere(partial(self._read, step, abstract_state, check_meta))
            if failed:
                for failure in failed:  # a mismatch anywhere is an error everywhere, as on one process
                    if isinstance(failure.error, CheckpointMismatch):
                        raise failure.error
                where = self.directory / str(step)
                for failure in failed:
                    if failure.mismatch:
                        raise CheckpointMismatch(
                            f"checkpoint {where} does not match this run on process {failure.process}: "
                            f"{failure.text}"
                        )
                if jax.process_count() == 1:
                    log.warning(
                        f"checkpoint {where} is unreadable ({failed[0].text}); trying the previous one."
                    )
                else:
                    causes = "; ".join(f"on process {f.process} ({f.text})" for f in failed)
                    log.warning(
                        f"checkpoint {where} is unreadable {causes}; every process tries the previous one."
                    )
                unreadable.append(step)
                continue
            self._set_aside(unreadable)
            return restored
        self._set_aside(unreadable)
        if steps:
            raise CheckpointError(
                f"no checkpoint in {self.directory} could be restored (steps {steps}, now in "
                f"{self.directory.with_name(UNREADABLE_DIR)}); see the messages above. Start a new "
                "--run_dir, or move a checkpoint you trust back."
            )
        return None

    def _agreed_steps(self) -> list[int]:
        """`steps()`; with several processes, process 0's (the one that sets checkpoints aside), so
        that every process considers the same steps in the same order (a step another process does
        not see fails its checks there)."""
        steps = self.steps()
        if jax.process_count() == 1:
            return steps
        listed = [json.loads(text) for text in _allgather_text(json.dumps(steps))]
        if any(other != listed[0] for other in listed):
            log.warning(
                "the processes list different checkpoints ("
                + "; ".join(f"process {i}: {s}" for i, s in enumerate(listed))
                + "); using process 0's."
            )
        return listed[0]

    def _everywhere(self, attempt: Callable[[], Any]) -> tuple[Any, list[_Failure]]:
        """(`attempt()`'s result or None, the failures): each process runs `attempt`; with several
        processes the outcomes are then gathered (a collective every process reaches, whether its
        attempt raised or not), so that all see the same failures, every process's, in order."""
        result, own = None, None
        try:
            result = attempt()
        except Exception as e:  # noqa: BLE001 - Orbax/tensorstore raise many types for bad files
            own = _Failure(
                jax.process_index(),
                f"{type(e).__name__}: {str(e)[:300]}",
                isinstance(e, CheckpointMismatch),
                e,
            )
        if jax.process_count() == 1:
            return result, [own] if own is not None else []
        code = 0 if own is None else 2 if own.mismatch else 1
        codes = multihost_utils.process_allgather(np.array(code, np.int32))
        if not codes.any():
            return result, []
        texts = _allgather_text(own.text if own is not None else "")
        failed = [
            own if i == jax.process_index() else _Failure(i, texts[i], c == 2)
            for i, c in enumerate(codes.tolist())
            if c
        ]
        return result, failed

    def _set_aside(self, steps: list[int]) -> None:
        """Move checkpoints to `checkpoints-unreadable/` (not deleted: the run saves those steps anew).
        With several processes (each has found the same ones unreadable), process 0 moves them and
        every process then forgets them (a barrier: all call this at the same point)."""
        if not steps:
            return
        if jax.process_index() == 0:
            for bad in steps:
                target = self.directory.with_name(UNREADABLE_DIR) / str(bad)
                if target.exists():
                    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S-%f")
                    target = target.with_name(f"{bad}-{stamp}")
                target.parent.mkdir(exist_ok=True)
                shutil.move(self.directory / str(bad), target)
                log.warning(f"moved unreadable checkpoint {bad} to {target}")
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"jaxzero: checkpoints {steps} set aside")
        self.manager.reload()

    def restore(self, step: int, abstract_state: dict[str, Any], layout: str, run: TrainConfig) -> Restored:
        """Restore checkpoint `step` onto `abstract_state` (ShapeDtypeStructs carrying shardings), after
        checking its files against their checksums (`checkpoint.verify`)."""
        self._check(step, abstract_state, layout, run)
        return self._read(step, abstract_state)

    def _check(self, step: int, abstract_state: dict[str, Any], layout: str, run: TrainConfig) -> None:
        """The checks of checkpoint `step` before its arrays are read, each process on its own (no
        collective): its metadata, its files' checksums, its shapes against `abstract_state`."""
        meta = self.read_meta(step)
        if self.cfg.verify:
            verify_checksums(self.directory / str(step), self._pool)
        if meta.get("layout") != layout:  # allowed: the saved optimizer state is per unit either way
            log.info(
                f"checkpoint {step} was saved by the {meta.get('layout')} trainer; resuming under the "
                f"{layout} trainer."
            )
        check_shapes(self.directory / str(step), meta, abstract_state, run)

    def _read(
        self,
        step: int,
        abstract_state: dict[str, Any],
        check_meta: Callable[[dict[str, Any]], Any] = lambda meta: None,
    ) -> Restored:
        """Orbax's restore of checkpoint `step` (all processes call it), then `check_meta` on its
        metadata. Orbax's restore ends in a barrier (a collective): a process whose restore raised
        before it joins it there, so that the collectives of every process stay in step."""
        try:
            # each array to the sharding (and memory kind) of its target, one part at a time
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    state=PartsRestore(state_parts(abstract_state)), meta=ocp.args.JsonRestore()
                ),
            )
        except Exception as e:
            if jax.process_count() > 1 and BARRIER_MISMATCH not in str(e):  # not raised by that barrier
                try:
                    ocp.multihost.sync_global_processes(ORBAX_RESTORE_BARRIER)
                except AssertionError:  # the others were elsewhere: their restore fails there too
                    pass
            raise
        check_meta(restored["meta"])
        return Restored(step=step, state=dict(restored["state"]), meta=dict(restored["meta"]))


@dataclass(frozen=True)
class _Failure:
    """What failed on one process: its index, the cause in a line, whether the checkpoint is another
    run's (`CheckpointMismatch`), and the exception itself on the process that raised it."""

    process: int
    text: str
    mismatch: bool
    error: BaseException | None = None


def _allgather_text(text: str) -> list[str]:
    """Every process's `text`, in process order (a collective: all processes call it)."""
    data = np.frombuffer(text.encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.array(data.size, np.int32))
    padded = np.zeros(max(int(sizes.max()), 1), np.uint8)
    padded[: data.size] = data
    gathered = multihost_utils.process_allgather(padded)
    return [bytes(row[:n]).decode(errors="replace") for row, n in zip(gathered, sizes.tolist())]


class _WriteFailure:
    """Turns any error of a save into a `CheckpointWriteError` naming the step and the cause, after
    removing what the failed save left half-written."""

    def __init__(self, ckpt: Checkpointer, step: int | None):
        self.ckpt, self.step = ckpt, step

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, tb) -> bool:
        if error is None or isinstance(error, CheckpointWriteError | KeyboardInterrupt):
            return False
        left = self.ckpt._remove_partial_saves()
        what = f"checkpoint {self.step}" if self.step is not None else "a checkpoint"
        partial = (
            "Nothing half-written is left"
            if not left
            else f"The half-written {', '.join(p.name for p in left)} could not be removed (Orbax's names "
            "for unfinished saves: never restored, and removed by the run that resumes)"
        )
        raise CheckpointWriteError(
            f"could not write {what} to {self.ckpt.directory}: {describe_write_error(error)}. {partial}; "
            "the checkpoints listed there are complete, and a run resumes from the newest of them once the "
            "cause is fixed."
        ) from error


def _leaf_bytes(tree: Any) -> list[int]:
    """Bytes of each array (or ShapeDtypeStruct, or `Deferred`'s) of `tree`, whole."""
    return [int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(abstract(tree))]


def largest_array_bytes(tree: Any) -> int:
    """Bytes of the largest array (or ShapeDtypeStruct) of a saved state, whole."""
    return max(_leaf_bytes(tree))


def state_bytes(tree: Any) -> int:
    """Bytes of the arrays (or ShapeDtypeStructs) of a saved state: about the size of its checkpoint."""
    return sum(_leaf_bytes(tree))


def ensure_room(directory: Path, nbytes: int, what: str) -> None:
    """Raise `CheckpointWriteError` if the file system holding `directory` (or its nearest existing
    parent) has less than `nbytes` free: a checkpoint that cannot fit is refused before any write."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if free < nbytes:
        raise CheckpointWriteError(
            f"not enough free space for {what} in {directory}: it needs about {_size(nbytes)}, and "
            f"{_size(free)} is free. Free space there (the run's older checkpoints are deleted only after a "
            "new one is written, so delete any you do not need yourself), or set checkpoint.enabled=false."
        )


def checkpoints_on_disk(cfg: CheckpointConfig, existing: int, saves: int) -> int:
    """How many checkpoints are on disk at once at most while a run with `existing` checkpoints makes
    `saves` more: the `checkpoint.keep` newest, and the one being written before the oldest of them is
    deleted."""
    return min(cfg.keep + 1, existing + saves) if saves else existing


def ensure_disk_room(directory: Path, size: int, cfg: CheckpointConfig, saves: int) -> None:
    """Raise `CheckpointWriteError`, before training, if the file system holding `directory` cannot
    hold the checkpoints (each `size` bytes) a run keeps at once while it makes `saves` more saves
    (`checkpoints_on_disk`), counting the room its checkpoints already there take."""
    steps = [p for p in directory.iterdir() if p.name.isdigit()] if directory.is_dir() else []
    have = sum(f.stat().st_size for p in steps for f in p.rglob("*") if f.is_file())
    count = checkpoints_on_disk(cfg, len(steps), saves)
    if count * size - have > 0:
        ensure_room(
            directory,
            count * size - have,
            f"this run's checkpoints ({count} of {_size(size)} at once at most: the newest checkpoint.keep="
            f"{cfg.keep} and the one being written before the oldest is deleted; a lower checkpoint.keep "
            "needs less)",
        )


def in_flight_bytes(cfg: CheckpointConfig) -> int:
    """Of the buffer, what a save or a restore keeps in flight to or from disk: half of it, at most
    1 GiB; a save holds copies of units the next step updates before the writer has written them in
    the rest (`WriteFence`)."""
    return min(buffer_bytes(cfg) // 2, IN_FLIGHT_MAX)


def trim_host_heap() -> None:
    """Hand the heap memory freed by a save's or a restore's reads and writes back to the kernel
    (glibc's `malloc_trim`; elsewhere nothing). Measured (BENCHMARKS.md, issue 26): 147 MB back after
    restoring a 0.7 GB state on the CPU; on an H200 a resumed 3.37B run still held 3.9 GiB more than a
    fresh one, so most of that is held elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _copy_part(parts: list[Part], position: int) -> bool:
    """Replace the unit at `position` in a save's `parts` with host copies of its arrays, so that
    training may update the arrays in place while the writer has still to write them. False where a
    copy would take a detour (accelerator arrays: the writer copies those to host RAM itself)."""
    i = next(i for i, p in enumerate(parts) if p.position == position)
    if is_deferred(parts[i].tree):  # a disk unit: read now, into arrays of its own
        parts[i] = parts[i]._replace(tree=resolved(parts[i].tree))
        return True
    tree = parts[i].tree

    def on_cpu(x: Any) -> bool:
        return isinstance(x, jax.Array) and all(d.platform == "cpu" for d in x.sharding.device_set)

    if not all(on_cpu(x) or isinstance(x, np.ndarray) for x in jax.tree.leaves(tree)):
        return False

    def copy(x: Any) -> Any:  # each process copies its own shards; the copy keeps the sharding
        if isinstance(x, np.ndarray):
            return np.array(x, copy=True)
        with jax.transfer_guard("allow"):  # a deliberate copy, in host RAM
            shards = [jax.device_put(np.array(s.data, copy=True), s.device) for s in x.addressable_shards]
        return jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)

    parts[i] = parts[i]._replace(tree=jax.tree.map(copy, tree))
    return True


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def describe_write_error(error: BaseException) -> str:
    """The cause of a failed write in a few words: the OS error if one is in the chain (the Orbax and
    TensorStore errors around it can run to pages), else the first line of the error."""
    seen, chain = set(), []
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:
        if isinstance(e, OSError) and e.errno:
            return f"{os.strerror(e.errno)} (errno {e.errno})"
    text = " ".join(str(e) for e in chain)
    code = re.search(r"os_error_code='?(\d+)", text)  # TensorStore's own errors carry the OS's number
    if code and int(code.group(1)):
        return f"{os.strerror(int(code.group(1)))} (errno {code.group(1)})"
    for errno_name, message in (
        ("ENOSPC", "No space left on device"),
        ("EPERM", "Operation not permitted"),
        ("EACCES", "Permission denied"),
        ("EROFS", "Read-only file system"),
        ("EDQUOT", "Disk quota exceeded"),
    ):
        if message.lower() in text.lower():
            return f"{message} ({errno_name})"
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return f"{type(error).__name__}: {first[:300]}"


# -- checksums ---------------------------------------------------------------------------------------


def _files(step_dir: Path) -> list[Path]:
    """The files of a step's items (`state/`, `meta/`): Orbax rewrites its own bookkeeping files at
    the step's top level as it commits, so those are not summed."""
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.parent != step_dir)


def _piece_crc(path: Path, offset: int) -> int:
    with open(path, "rb") as f:
        f.seek(offset)
        return zlib.crc32(f.read(CHECKSUM_PIECE))


def file_checksums(step_dir: Path, pool: ThreadPoolExecutor) -> dict[str, list[int]]:
    """{file path relative to `step_dir`: [size, CRC-32 of each 64 MiB piece...]}, pieces in parallel.
    Paths are named as committed: summed before Orbax renames its temporary item directories, a
    path drops their temporary suffix."""
    files = _files(step_dir)
    jobs = {
        (p, off): pool.submit(_piece_crc, p, off)
        for p in files
        for off in range(0, max(p.stat().st_size, 1), CHECKSUM_PIECE)
    }
    out: dict[str, list[int]] = {}
    for p in files:
        crcs = [f.result() for (q, _), f in jobs.items() if q == p]
        out[re.sub(TMP_SUFFIX, "", str(p.relative_to(step_dir)))] = [p.stat().st_size, *crcs]
    return out


def write_checksums(step_dir: Path, pool: ThreadPoolExecutor) -> None:
    """Write `checksums.json` for the files of a checkpoint whose items are final (called as Orbax
    commits it, in its temporary directory, so that the checksums commit with it), atomically."""
    tmp = step_dir / f".{CHECKSUMS_FILE}.tmp"
    tmp.write_text(json.dumps(file_checksums(step_dir, pool)))
    os.replace(tmp, step_dir / CHECKSUMS_FILE)


def verify_checksums(step_dir: Path, pool: ThreadPoolExecutor) -> None:
    """Raise CheckpointError if a file of `step_dir` is missing or changed since its checksum was
    written. A checkpoint without `checksums.json` (saved by an older jaxzero, or by a process that
    stopped right after the save committed) is restored unverified, with a note."""
    path = step_dir / CHECKSUMS_FILE
    if not path.exists():
        log.warning(f"checkpoint {step_dir} has no {CHECKSUMS_FILE}; restoring it unverified.")
        return
    try:
        expected = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is unreadable: {e}") from e
    actual = file_checksums(step_dir, pool)
    bad = sorted(k for k in expected if actual.get(k) != expected[k])
    if bad:
        raise CheckpointError(
            f"the bytes of {len(bad)} file(s) of checkpoint {step_dir} changed since it was saved "
            f"(checksum mismatch or missing): {', '.join(bad[:4])}"
        )


def check_shapes(where: Path, meta: dict[str, Any], abstract_state: dict[str, Any], run: TrainConfig) -> None:
    """Raise CheckpointError naming the mismatch when the checkpoint's arrays do not have this run's
    shapes (a different model config), before any array is read."""
    saved = meta.get("shapes", {})
    expected = state_shapes(abstract_state)
    wrong = [k for k in expected if k in saved and tuple(saved[k]) != tuple(expected[k])]
    missing = [k for k in expected if k not in saved]
    if not wrong and not missing:
        return
    saved_model = meta.get("config", {}).get("model", {})
    fields = [
        f"model.{k}={v!r} (this run: {getattr(run.model, k)!r})"
        for k, v in saved_model.items()
        if hasattr(run.model, k) and getattr(run.model, k) != v
    ]
    arrays = [f"{k}: {tuple(saved[k])} saved, {tuple(expected[k])} expected" for k in wrong[:3]]
    arrays += [f"{k}: not in the checkpoint" for k in missing[:3]]
    raise CheckpointMismatch(
        f"checkpoint {where} does not match this run's model ({'; '.join(arrays)}). It was saved with "
        f"{', '.join(fields) or 'another optimizer or layout'}. Resume with the config it was saved with, "
        "or start a new run_dir."
    )


def state_shapes(tree: Any) -> dict[str, list[int]]:
    """{key path: shape} of every leaf, for the metadata and the pre-restore shape check."""
    flat = jax.tree_util.tree_flatten_with_path(abstract(tree))[0]
    return {jax.tree_util.keystr(path): list(leaf.shape) for path, leaf in flat}


def make_meta(
    step: int, data_state: dict[str, int], cfg: TrainConfig, layout: str, state: Any
) -> dict[str, Any]:
    """The JSON metadata saved with a checkpoint."""
    return {
        "step": step,
        "data_state": data_state,
        "config": cfg.to_dict(),
        "layout": layout,
        "shapes": state_shapes(state),
    }


def saved_steps(run_dir: str | Path) -> list[int]:
    """Steps of the committed checkpoints under `<run_dir>/checkpoints`, oldest first, read from the
    directory names without starting Orbax (a half-written save has no step-named directory)."""
    directory = Path(run_dir) / CHECKPOINT_DIR
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.is_dir() else []


def read_meta(directory: str | Path, step: int) -> dict[str, Any]:
    """The JSON metadata of checkpoint `step` in the checkpoints `directory` (no arrays are read)."""
    path = Path(directory) / str(step) / "meta" / "metadata"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {Path(directory) / str(step)} has unreadable metadata: {e}") from e


def export_orbax(
    params: ModelParams,
    out: str | Path,
    dtype: str,
    *,
    overwrite: bool = False,
    source: dict[str, Any] | None = None,
) -> Path:
    """Save `params` cast to `dtype` as an Orbax checkpoint at `out`, casting one unit at a time.
    `out` must be new, empty or an earlier jaxzero export (`jaxzero.export_dir`: `overwrite` replaces
    a finished one; anything else is refused with or without it). Orbax writes into a directory of
    its own inside `out`, whose entries then move up into `out`, beside the export's marker; `source`
    (e.g. run_dir and step) is recorded in the marker."""
    out = Path(out).absolute()
    np_dtype = np.dtype(jax.numpy.dtype(dtype))
    cast = lambda tree: jax.tree.map(lambda x: np.asarray(x).astype(np_dtype), tree)  # noqa: E731
    with export_dir.writing(
        out, format="orbax", dtype=dtype, files=[ORBAX_STAGE], overwrite=overwrite, source=source
    ) as export:  # refuses a directory holding anything but an earlier export, before writing
        blocks = list(params.blocks)
        for i in range(len(blocks)):  # replace each float32 block as it is cast (read now if deferred)
            blocks[i] = cast(resolved(blocks[i]))
        tree = ModelParams(cast(resolved(params.embed)), tuple(blocks), cast(resolved(params.head)))
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(out / ORBAX_STAGE, tree)
        checkpointer.wait_until_finished()  # host sync: committed before the process exits
        checkpointer.close()
        entries = sorted(p.name for p in (out / ORBAX_STAGE).iterdir())
        clash = [e for e in entries if (out / e).exists() or (out / e).is_symlink()]
        if clash:  # files put beside an earlier export by hand are never replaced
            raise export_dir.ExportRefused(
                f"{out} holds {clash}, which the export did not write and Orbax's checkpoint needs: remove "
                "them yourself, or choose a new directory (--out)."
            )
        for e in entries:
            os.replace(out / ORBAX_STAGE / e, out / e)
        (out / ORBAX_STAGE).rmdir()
        export.finish(entries)
    return out


def load_masters(run_dir: str | Path, step: int | None = None) -> tuple[TrainConfig, ModelParams, int]:
    """(config, float32 NumPy masters, step) of the newest (or given) checkpoint of `run_dir`, read
    one unit at a time (the optimizer state is not read)."""
    cfg, params, step = masters_by_unit(run_dir, step)
    return cfg, resolved(params), step


def masters_by_unit(run_dir: str | Path, step: int | None = None) -> tuple[TrainConfig, ModelParams, int]:
    """As `load_masters`, but each unit a `Deferred`, read (as float32 NumPy) when resolved: an export
    holds one unit in host RAM at a time. A checkpoint of the earlier one-PyTree layout is read whole."""
    ckpt_dir = Path(run_dir).absolute() / CHECKPOINT_DIR  # Orbax wants absolute paths
    steps = saved_steps(run_dir)
    if not steps:
        raise CheckpointError(f"{ckpt_dir} holds no checkpoint; train with checkpoint.enabled=true first.")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise CheckpointError(f"{ckpt_dir} has no checkpoint for step {step}; it has steps {steps}.")
    meta = read_meta(ckpt_dir, step)
    cfg = config_from_dict(meta["config"])
    shapes = jax.eval_shape(build_model(cfg.model).init, jax.random.key(0))
    state_dir = ckpt_dir / str(step) / "state"
    if (state_dir / PYTREE_METADATA).exists():  # the earlier layout: one PyTree
        return cfg, _read_numpy(state_dir, {"params": shapes})["params"], step
    units = [shapes.embed, *shapes.blocks, shapes.head]
    names = part_names(len(shapes.blocks))

    def unit(name: str, u: Any) -> Deferred:
        return Deferred(lambda: (_read_numpy(state_dir / name, {"params": u})["params"],), 0, u)

    read = [unit(name, u) for name, u in zip(names, units)]
    return cfg, ModelParams(read[0], tuple(read[1:-1]), read[-1]), step


def _read_numpy(path: Path, shapes: Any) -> Any:
    """The arrays of the Orbax PyTree checkpoint at `path` that `shapes` names (a subtree of what it
    holds, e.g. {"params": ...}), as NumPy arrays in the structure of `shapes`."""
    item = jax.tree.map(lambda s: np.zeros((), s.dtype), shapes)
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), shapes)
    restored = ocp.PyTreeCheckpointer().restore(
        path, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
    )
    return jax.tree.unflatten(jax.tree.structure(shapes), jax.tree.leaves(restored))


def read_saved_state(step_dir: str | Path) -> dict[str, Any]:
    """Every array of checkpoint `step_dir` (`<run_dir>/checkpoints/<step>`) as NumPy, whole, in the
    saved state's layout ({"step", "params", "opt_state"}, params and opt_state as `ModelParams`): for
    inspection and tests; a training process restores through `Checkpointer` instead."""
    state_dir = Path(step_dir).absolute() / "state"
    if (state_dir / PYTREE_METADATA).exists():
        return dict(ocp.PyTreeCheckpointer().restore(state_dir))
    names = [SCALARS, *part_names(len(list(state_dir.glob("block_*"))))]
    return join_parts([ocp.PyTreeCheckpointer().restore(state_dir / name) for name in names])
