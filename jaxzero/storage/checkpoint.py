"""Saves and restores of the whole training state (`Checkpointer`), written from where it lives and
restored to where it belongs, in bounded host RAM; the layout on disk is
`jaxzero.storage.checkpoint_layout`'s.

Host RAM. A save writes one part at a time with Orbax's PyTree handler
(`jaxzero.storage.checkpoint_handler`), at most half of `checkpoint.buffer_gib` (1 GiB at most, or the
largest array, which Orbax writes whole) in flight to disk at once (`save_concurrent_gb`);
accelerator arrays are copied to host RAM one part at a time. A restore reads one part at a time, at
most the buffer (or the largest array) at once, and places each array where the target says. So a
save or a restore takes at most the buffer plus one unit of host RAM beyond the state, whatever the
model's size; nothing is copied whole first.

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

Integrity: a save commits with its files' checksums, which a restore checks first
(`jaxzero.storage.checkpoint_disk`). A checkpoint whose files changed, whose metadata cannot be read, or whose
data-loader state is invalid is set aside to `checkpoints-unreadable/` and the previous one is used;
one whose shapes do not match the run is an error. A save that fails (disk full, permission denied)
raises `CheckpointWriteError` as soon as it is known, and what it left half-written is removed.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import logging
import os
import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import flags
from jax.experimental import multihost_utils

from jaxzero.config import CheckpointConfig, CheckpointError, TrainConfig, buffer_bytes, in_flight_bytes
from jaxzero.finetune.provenance import check_base
from jaxzero.primitives.deferred import is_deferred, resolved
from jaxzero.primitives.write_fence import WriteFence
from jaxzero.storage.checkpoint_disk import (
    TMP_MARKER,
    CheckpointWriteError,
    bytes_under,
    describe_write_error,
    ensure_room,
    verify_checksums,
    write_checksums,
)
from jaxzero.storage.checkpoint_handler import ARRAY_MARGIN, PartsHandler, PartsRestore, PartsSave
from jaxzero.storage.checkpoint_layout import (
    CHECKPOINT_DIR,
    UNREADABLE_DIR,
    CheckpointMismatch,
    Part,
    check_shapes,
    read_meta,
    state_bytes,
    state_parts,
)

log = logging.getLogger(__name__)  # the library speaks through logging (`jaxzero.run.console`)

# Orbax's barriers are named with this prefix (set on the manager), so that the name of the barrier
# that ends Orbax's `Checkpointer.restore` is known: a process whose restore raised before it joins it.
ORBAX_BARRIER_PREFIX = "jaxzero"
ORBAX_RESTORE_BARRIER = ocp.multihost.unique_barrier_key("Checkpointer:restore", prefix=ORBAX_BARRIER_PREFIX)
BARRIER_MISMATCH = "sync_global_devices name mismatch"  # JAX's error when processes meet at other barriers
# Orbax's switch from barriers that are device collectives to the coordination service's: a save
# runs on a writer thread beside training, whose collectives it must not interleave with.
ORBAX_SERVICE_BARRIERS = "experimental_orbax_use_distributed_barrier"


def _service_barriers() -> None:
    """Orbax's barriers through the coordination service, not device collectives (several processes):
    a save's barriers then never interleave with the collectives training runs meanwhile."""
    if jax.process_count() == 1 or ORBAX_SERVICE_BARRIERS not in flags.FLAGS:
        return
    if not flags.FLAGS.is_parsed():  # absl flags read unparsed raise; jaxzero parses none of its own
        flags.FLAGS.mark_as_parsed()
    setattr(flags.FLAGS, ORBAX_SERVICE_BARRIERS, True)


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
        restore_batch = None if largest_array is None else max(self.buffer, largest_array + ARRAY_MARGIN)
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
        self.wait()  # one save at a time; raises the previous one's failure
        # The room is counted after the previous save: until it commits, it holds its bytes and the
        # checkpoint it supersedes both (a check before it counted keep + 2 checkpoints at once).
        size = state_bytes(state)
        self._make_room(step, size)
        parts = [p._replace(tree=_own_handles(p.tree)) for p in state_parts(state)]
        background = self.cfg.async_save and fence is not None
        fence = fence if fence is not None else WriteFence()
        sizes = {p.position: state_bytes(p.tree) for p in parts if p.position is not None}
        fence.begin(sizes, self.buffer - in_flight_bytes(self.cfg), partial(_copy_part, parts))
        self.last_saved = step
        self._writing = self._writer.submit(self._write, step, parts, meta, fence, size)
        if not background:
            self.wait()

    def _write(
        self, step: int, parts: list[Part], meta: dict[str, Any], fence: WriteFence, size: int
    ) -> None:
        """The writer thread's save of checkpoint `step` (its checksums written as it commits), of about
        `size` bytes; the fence is open after, whatever happened."""
        try:
            with self._failure(step):
                state = PartsSave(parts, fence.start, fence.written)
                args = ocp.args.Composite(state=state, meta=ocp.args.JsonSave(meta))
                self.manager.save(step, args=args, force=True)
            self._warn_if_the_next_will_not_fit(step, size)
        finally:
            fence.finish()
            trim_host_heap()

    def _superseded(self, step: int) -> list[int]:
        """The checkpoints a save of `step` makes the retention delete once it commits (the oldest
        beyond `checkpoint.keep`, none that `keep_every` keeps), oldest first, less the newest now on
        disk: what may go before it is written without leaving the run without a checkpoint."""
        steps = self.steps()
        kept = set(sorted([*steps, step])[-self.cfg.keep :])
        every = self.cfg.keep_every
        old = [s for s in steps if s not in kept and not (every and s % every == 0)]
        return [s for s in old if s != max(steps)]

    def _make_room(self, step: int, size: int) -> None:
        """Room for checkpoint `step` of about `size` bytes, or `CheckpointWriteError` before anything
        is written. Where the disk is short and the save supersedes checkpoints older than the newest
        (checkpoint.keep >= 2), those go first, oldest first: they would go once it commits. (One
        process: several would each decide on their own view of the disk.)"""
        early = self._superseded(step) if jax.process_count() == 1 else []
        for old in early:
            try:
                ensure_room(self.directory, size, f"checkpoint {step}")
                return
            except CheckpointWriteError as e:
                log.warning(f"{e} Deleting checkpoint {old} now, before checkpoint {step} is written (the "
                            "retention would delete it once that one is).")  # fmt: skip
                self.manager.delete(old)
        ensure_room(self.directory, size, f"checkpoint {step}")

    def _warn_if_the_next_will_not_fit(self, step: int, size: int) -> None:
        """After checkpoint `step` committed (and the retention ran): a warning, while there is time to
        free space, where the next save of about `size` bytes will not fit (it would stop the run)."""
        free = shutil.disk_usage(self.directory).free
        if jax.process_count() == 1:
            free += sum(bytes_under(self.directory / str(s)) for s in self._superseded(step + 1))
        if free < size:
            log.warning(
                f"warning: checkpoint {step} is written, but the next one will not fit: it needs about "
                f"{size / 2**30:.2f} GiB and {free / 2**30:.2f} GiB is free in {self.directory}. Free space "
                "there before the next save, or it will stop the run (this checkpoint is kept)."
            )

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
        collective): its metadata, the frozen base it trained over (`check_base`), its files'
        checksums, its shapes against `abstract_state`."""
        meta = self.read_meta(step)
        try:  # what trained fits the base it trained over: changed files are another run's
            check_base(meta, f"checkpoint {self.directory / str(step)}")
        except CheckpointError as e:
            raise CheckpointMismatch(str(e)) from e
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


def trim_host_heap() -> None:
    """Hand the heap memory freed by a save's or a restore's reads and writes back to the kernel
    (glibc's `malloc_trim`; elsewhere nothing). It returns only what glibc's heap keeps: most of what
    a restore leaves in the RSS is held elsewhere (BENCHMARKS.md, "Checkpoints in bounded host
    RAM")."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _own_handles(tree: Any) -> Any:
    """`tree` with each array as a new array object over the same buffers (no copy). Orbax copies an
    accelerator array to host RAM through NumPy, and JAX keeps that copy on the array object it was
    handed for as long as the object lives: given the trainer's own arrays, a save would hold a host
    copy of the whole accelerator state for as long as anything refers to them; given handles that
    die with their part once it is written, one part's copy at a time."""

    def own(x: Any) -> Any:
        if not isinstance(x, jax.Array) or x.is_deleted():
            return x
        return jax.make_array_from_single_device_arrays(
            x.shape, x.sharding, [s.data for s in x.addressable_shards]
        )

    return jax.tree.map(own, tree)


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
