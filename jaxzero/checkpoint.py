"""Orbax checkpoints of the whole training state, saved from where it lives and restored to where it
belongs.

A checkpoint is one step directory under `<run_dir>/checkpoints/` holding two items:

    state  {"step", "params", "opt_state"}, and float16's "loss_scale": int32 step, float32 masters,
           optimizer state one optax state per unit (embedding, each block, head), whichever
           trainer saved it
    meta   JSON: the data iterator's position, the resolved config, the trainer's layout, the step

The compute-dtype weights of the offload engine are not saved: they are a cast of the masters and
are rebuilt on restore. Saves are asynchronous and atomic (Orbax writes into a temporary directory
and renames it when complete; a save killed half-way leaves no step directory behind). Training is
blocked only while the state is snapshotted into host memory: the arrays it keeps updating in place
(donated masters and optimizer state) must not change under the writer.

Restores always target the abstract state *with its placement* (`Trainer.abstract_saved_state`):
Orbax does not record memory kinds, and a restore without a target would put host-resident state
into accelerator memory. Saves and restores pass through host RAM `TRANSFER_BYTES` at a time: a
blocking save (`checkpoint.async_save=false`) copies the arrays out in batches of that size, each
written before the next is copied (Orbax's memory-limited save; Orbax copies host arrays too as it
writes them), and a restore reads at most that much at once before placing it. An asynchronous
save copies everything first (`_snapshot`).

Integrity: as a save commits, the CRC-32 of every file of its items (in 64 MiB pieces) goes to
`<step>/checksums.json`; a restore checks them first (`checkpoint.verify`). A checkpoint whose files
changed, whose metadata cannot be read, or whose data-loader state is invalid is set aside to
`checkpoints-unreadable/` and the previous one is used; one whose shapes do not match the run is an
error. A save that fails (disk full, permission denied) raises `CheckpointWriteError` as soon as it is
known, and what it left half-written is removed.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import sys
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

# Orbax's memory-limited save is configured through these (orbax-checkpoint 0.12: not re-exported).
from orbax.checkpoint._src.metadata.array_metadata_store import Store as _ArrayMetadataStore
from orbax.checkpoint._src.serialization.types import SerializationStatusCallback, TransferPriority

from jaxzero.config import CheckpointConfig, CheckpointError, TrainConfig
from jaxzero.models import ModelParams, build_model
from jaxzero.overrides import config_from_dict

CHECKPOINT_DIR = "checkpoints"
UNREADABLE_DIR = f"{CHECKPOINT_DIR}-unreadable"  # checkpoints that failed to restore, set aside
CHECKSUMS_FILE = "checksums.json"
CHECKSUM_PIECE = 64 << 20  # bytes per CRC-32: pieces of one file are summed in parallel
TMP_MARKER = ".orbax-checkpoint-tmp"  # in the names of Orbax's half-written step directories
ORBAX_METADATA = "_CHECKPOINT_METADATA"  # in every directory Orbax's checkpointers commit
# Orbax's barriers are named with this prefix (set on the manager), so that the name of the barrier
# that ends Orbax's `Checkpointer.restore` is known: a process whose restore raised before it joins it.
ORBAX_BARRIER_PREFIX = "jaxzero"
ORBAX_RESTORE_BARRIER = ocp.multihost.unique_barrier_key("Checkpointer:restore", prefix=ORBAX_BARRIER_PREFIX)
BARRIER_MISMATCH = "sync_global_devices name mismatch"  # JAX's error when processes meet at other barriers
# A blocking save copies the arrays it writes to host RAM, and a restore reads them there, at most this
# many bytes at a time (each array whole, one at least): neither holds a second copy of the state.
TRANSFER_BYTES = 2 * 10**9


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


def _snapshot(tree: Any, pool: ThreadPoolExecutor) -> Any:
    """Host copies of every leaf, so an asynchronous write never sees later in-place updates.

    Host-resident leaves are copied in host memory, shard by shard (each process copies its own;
    the copy keeps the leaf's sharding over the processes); accelerator leaves are fetched to host,
    or, spanning other processes' devices, handed to Orbax, which copies them to host before `save`
    returns. Leaves are copied concurrently (NumPy copies release the GIL): one thread moves a
    fraction of the host's memory bandwidth.
    """

    def copy(x):
        with jax.transfer_guard_device_to_host("allow"):  # a deliberate copy for the checkpoint
            if not isinstance(x, jax.Array) or (x.is_fully_addressable and len(x.sharding.device_set) == 1):
                return np.array(x, copy=True)
            if next(iter(x.sharding.device_set)).platform != "cpu":
                return x if not x.is_fully_addressable else np.array(x, copy=True)
            shards = [
                jax.device_put(np.array(s.data, copy=True), s.data.sharding) for s in x.addressable_shards
            ]
            return jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)

    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, list(pool.map(copy, leaves)))


class Checkpointer:
    """Saves and restores training state under `<run_dir>/checkpoints` with an Orbax CheckpointManager.

    Keeps the newest `keep` checkpoints, plus every `keep_every`-th step if set. `save` returns once
    the state is snapshotted; `check` raises what a background write has failed with since; `close`
    waits for pending writes. Every write failure is a `CheckpointWriteError`.
    """

    def __init__(self, run_dir: str | Path, cfg: CheckpointConfig, *, largest_array: int | None = None):
        """`largest_array`: the bytes of the state's largest array (`largest_array_bytes` of the
        abstract state); given, a restore reads at most `TRANSFER_BYTES` (or that array) at a time,
        else as much as Orbax's default allows."""
        self.directory = Path(run_dir).absolute() / CHECKPOINT_DIR
        self.cfg = cfg
        # (Orbax refuses an array that fills its limit exactly: a MiB over the largest admits it.)
        self._restore_batch = None if largest_array is None else max(TRANSFER_BYTES, largest_array + 2**20)
        self._pool = ThreadPoolExecutor(
            max(1, min(16, os.cpu_count() or 1)), thread_name_prefix="jaxzero-ckpt"
        )
        self._lock = threading.Lock()
        self._unsummed: list[int] = []  # committed steps whose checksums are not written yet
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep,
            keep_period=cfg.keep_every or None,
            enable_async_checkpointing=cfg.async_save,
            create=True,
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                barrier_sync_key_prefix=ORBAX_BARRIER_PREFIX
            ),
            cleanup_tmp_directories=True,  # remove what a killed save left half-written
            # Checksums once a save is committed (Orbax calls back only for asynchronous saves).
            async_options=(
                ocp.AsyncOptions(post_finalization_callback=self._write_checksums) if cfg.async_save else None
            ),
        )
        self._streamed: frozenset[str] = frozenset()  # keys of the leaves the current save streams
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        state_handler = self._state_handler(options.multiprocessing_options)
        registry.add("state", ocp.args.PyTreeSave, state_handler)
        registry.add("state", ocp.args.PyTreeRestore, state_handler)
        self.manager = ocp.CheckpointManager(self.directory, options=options, handler_registry=registry)
        self.last_saved: int | None = None  # the newest step whose save was issued

    def _state_handler(self, multiprocessing: Any) -> ocp.PyTreeCheckpointHandler:
        """Orbax's handler of the state item. A blocking save streams the leaves `save` names in
        `_streamed` (after the others): copied to host `TRANSFER_BYTES` at a time, each batch written
        before the next is copied. An asynchronous save may not: its copies must all be taken before
        `save` returns, since training then updates the arrays in place."""
        streaming: dict[str, Any] = {}
        if not self.cfg.async_save:
            arrays = ocp.type_handlers.ArrayHandler(
                callback=_StreamedKeys(self), array_metadata_store=_ArrayMetadataStore()
            )
            kinds = (int, float, bytes, np.number, np.ndarray, str)
            registry = ocp.type_handlers.create_type_handler_registry(
                *((t, ocp.type_handlers.get_type_handler(t)) for t in kinds), (jax.Array, arrays)
            )
            gb = TRANSFER_BYTES / 10**9  # Orbax's unit
            streaming = {"save_device_host_concurrent_gb": gb, "type_handler_registry": registry}
        return ocp.PyTreeCheckpointHandler(
            restore_concurrent_gb=None if self._restore_batch is None else self._restore_batch / 10**9,
            multiprocessing_options=multiprocessing,
            # Copies to plain host RAM: XLA's pinned pool is sized for the training state alone, and a
            # save's copies there fail once it is full (measured: RESOURCE_EXHAUSTED on an H100).
            enable_pinned_host_transfer=False,
            **streaming,
        )

    # -- saving --------------------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Save `state` ({"step", "params", "opt_state"}) and JSON `meta` as checkpoint `step`. Raises
        `CheckpointWriteError` before writing anything if the disk lacks the room for it."""
        ensure_room(self.directory, state_bytes(state), f"checkpoint {step}")
        with self._failure(step):
            arrays = _snapshot(state, self._pool) if self.cfg.async_save else state
        self._streamed = frozenset() if self.cfg.async_save else streamed_keys(arrays)
        self.wait()  # Orbax waits for the previous save anyway; waiting here names it if it failed
        with self._failure(step):
            if jax.process_index() == 0:  # one process writes the checksums (Orbax calls back there only)
                with self._lock:
                    self._unsummed.append(step)
            self.manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.PyTreeSave(arrays), meta=ocp.args.JsonSave(meta)),
                force=True,
            )
            if not self.cfg.async_save:  # committed already: no finalization callback comes
                self._write_checksums()
        self.last_saved = step

    def check(self) -> None:
        """Raise `CheckpointWriteError` if a background write failed since the last call (cheap)."""
        with self._failure(self.last_saved):
            self.manager.check_for_errors()
            if self.last_saved is not None and not self.manager.is_saving_in_progress():
                self.manager.wait_until_finished()  # at once: raises what a finished save failed with

    def wait(self) -> None:
        """Block until every pending save is committed to disk."""
        with self._failure(self.last_saved):
            self.manager.wait_until_finished()

    def close(self) -> None:
        """Wait for pending saves, then release the manager and threads (also after a failure)."""
        try:
            self.wait()
        finally:
            self.manager.close()
            self._pool.shutdown()

    def _failure(self, step: int | None):
        return _WriteFailure(self, step)

    def _remove_partial_saves(self) -> None:
        """Remove the half-written step directories a failed save left (ours; never a committed one)."""
        for p in self.directory.glob(f"*{TMP_MARKER}*"):
            shutil.rmtree(p, ignore_errors=True)

    def _write_checksums(self) -> None:
        """Write `checksums.json` for the oldest save not summed yet. Orbax calls this once per
        asynchronous save, in order, when the save's items are final but before it renames the step's
        temporary directory, so the checksums become part of the same atomic commit; a blocking save
        calls it right after committing."""
        with self._lock:
            if not self._unsummed:
                return
            step = self._unsummed.pop(0)
        pending = sorted(self.directory.glob(f"{step}{TMP_MARKER}*"))
        step_dir = pending[0] if pending else self.directory / str(step)
        if step_dir.is_dir():
            write_checksums(step_dir, self._pool)

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
                    print(
                        f"jaxzero: checkpoint {where} is unreadable ({failed[0].text}); trying the previous "
                        "one.",
                        file=sys.stderr,
                    )
                else:
                    causes = "; ".join(f"on process {f.process} ({f.text})" for f in failed)
                    print(
                        f"jaxzero: checkpoint {where} is unreadable {causes}; every process tries the "
                        "previous one.",
                        file=sys.stderr,
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
            print(
                "jaxzero: the processes list different checkpoints ("
                + "; ".join(f"process {i}: {s}" for i, s in enumerate(listed))
                + "); using process 0's.",
                file=sys.stderr,
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
                print(f"jaxzero: moved unreadable checkpoint {bad} to {target}", file=sys.stderr)
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
            print(
                f"jaxzero: checkpoint {step} was saved by the {meta.get('layout')} trainer; resuming under "
                f"the {layout} trainer.",
                file=sys.stderr,
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
            # each array to the sharding (and memory kind) of its target
            targets = ocp.checkpoint_utils.construct_restore_args(abstract_state)
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(abstract_state, restore_args=targets),
                    meta=ocp.args.JsonRestore(),
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


def streamed_keys(tree: Any) -> frozenset[str]:
    """Key paths (`jax.tree_util.keystr`) of the leaves of `tree` that a blocking save streams: every
    array whose devices Orbax's memory-limited save can account for (by their ids among the default
    backend's devices; host arrays of the CPU backend included where their ids are, as in one
    process). Orbax copies even host arrays while it writes them, so these go in batches too."""
    known = {d.id for d in jax.devices()}
    return frozenset(
        jax.tree_util.keystr(path)
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
        if isinstance(x, jax.Array) and {d.id for d in x.sharding.device_set} <= known
    )


class _StreamedKeys(SerializationStatusCallback):
    """Orbax's per-array transfer priority for a blocking save: the leaves the save streams go after
    the others, `TRANSFER_BYTES` at a time; the others at once (as Orbax does by default)."""

    def __init__(self, ckpt: Checkpointer):
        self.ckpt = ckpt

    def key_priority(self, keypath: Any) -> TransferPriority:
        if jax.tree_util.keystr(tuple(keypath)) in self.ckpt._streamed:
            return TransferPriority.ASYNCHRONOUS_DEPRIORITIZED
        return TransferPriority.SYNCHRONOUS


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
        self.ckpt._remove_partial_saves()
        what = f"checkpoint {self.step}" if self.step is not None else "a checkpoint"
        raise CheckpointWriteError(
            f"could not write {what} to {self.ckpt.directory}: {describe_write_error(error)}. "
            "Nothing half-written is left; the checkpoints listed there are complete, and a run resumes "
            "from the newest of them once the cause is fixed."
        ) from error


def _leaf_bytes(tree: Any) -> list[int]:
    """Bytes of each array (or ShapeDtypeStruct) of `tree`, whole."""
    return [int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)]


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
    for errno_name, message in (
        ("ENOSPC", "No space left on device"),
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
    """{file path relative to `step_dir`: [size, CRC-32 of each 64 MiB piece...]}, pieces in parallel."""
    files = _files(step_dir)
    jobs = {
        (p, off): pool.submit(_piece_crc, p, off)
        for p in files
        for off in range(0, max(p.stat().st_size, 1), CHECKSUM_PIECE)
    }
    out: dict[str, list[int]] = {}
    for p in files:
        crcs = [f.result() for (q, _), f in jobs.items() if q == p]
        out[str(p.relative_to(step_dir))] = [p.stat().st_size, *crcs]
    return out


def write_checksums(step_dir: Path, pool: ThreadPoolExecutor) -> None:
    """Write `checksums.json` for the files of a committed checkpoint, atomically."""
    tmp = step_dir / f".{CHECKSUMS_FILE}.tmp"
    tmp.write_text(json.dumps(file_checksums(step_dir, pool)))
    os.replace(tmp, step_dir / CHECKSUMS_FILE)


def verify_checksums(step_dir: Path, pool: ThreadPoolExecutor) -> None:
    """Raise CheckpointError if a file of `step_dir` is missing or changed since its checksum was
    written. A checkpoint without `checksums.json` (saved by an older jaxzero, or by a process that
    stopped right after the save committed) is restored unverified, with a note."""
    path = step_dir / CHECKSUMS_FILE
    if not path.exists():
        print(
            f"jaxzero: checkpoint {step_dir} has no {CHECKSUMS_FILE}; restoring it unverified.",
            file=sys.stderr,
        )
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
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
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


def export_orbax(params: ModelParams, out: str | Path, dtype: str, *, overwrite: bool = False) -> Path:
    """Save `params` cast to `dtype` as an Orbax checkpoint at `out`, casting one unit at a time.
    `overwrite` replaces an existing Orbax checkpoint there; any other existing path is an error."""
    out = Path(out).absolute()
    if out.exists():
        if not overwrite:
            raise FileExistsError(
                f"{out} exists; choose a new directory, or pass overwrite=True (--overwrite) to replace it."
            )
        if not (out / ORBAX_METADATA).is_file():
            raise FileExistsError(
                f"{out} is not an Orbax checkpoint (no {ORBAX_METADATA}), so it is not replaced; choose "
                "a new directory."
            )
    np_dtype = np.dtype(jax.numpy.dtype(dtype))
    cast = lambda tree: jax.tree.map(lambda x: np.asarray(x).astype(np_dtype), tree)  # noqa: E731
    blocks = list(params.blocks)
    for i in range(len(blocks)):  # replace each float32 block as it is cast: one copy of the model
        blocks[i] = cast(blocks[i])
    tree = ModelParams(cast(params.embed), tuple(blocks), cast(params.head))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(out, tree, force=overwrite)
    checkpointer.wait_until_finished()  # host sync: committed before the process exits
    checkpointer.close()
    return out


def load_masters(run_dir: str | Path, step: int | None = None) -> tuple[TrainConfig, ModelParams, int]:
    """(config, float32 NumPy masters, step) of the newest (or given) checkpoint of `run_dir`."""
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
    item = {"params": jax.tree.map(lambda s: np.zeros((), s.dtype), shapes)}
    restore_args = {"params": jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), shapes)}
    restored = ocp.PyTreeCheckpointer().restore(
        ckpt_dir / str(step) / "state",
        args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True),
    )
    p = restored["params"]
    if isinstance(p, dict):  # restored without the NamedTuple type
        p = ModelParams(p["embed"], tuple(p["blocks"]), p["head"])
    return cfg, p, step
