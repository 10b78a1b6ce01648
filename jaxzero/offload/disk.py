"""Masters and optimizer state of the units the plan keeps on local disk (ZeRO-Infinity's NVMe tier).

Each such unit is one file in a working directory the store creates (and removes when closed): the
unit's arrays (this process's block of each) one after another at 4 KiB-aligned offsets, read and
written with direct I/O where the filesystem allows it (the page cache would spend the RAM the tier
saves), in pieces of `PIECE` bytes over a thread pool.

Per step the update pipeline calls `schedule`, which queues a read of every disk unit in the order
the host update needs them (forward order). A read starts once one of the `slots` host buffers is
free and the unit's previous write-back is done. The update takes the unit (`take`: NumPy views of
the buffer), updates it in place, and `put` writes it back in the background; the buffer is free
again when that write is done. So at most `slots` units' state is in host RAM at once, and the next
unit's read overlaps this unit's update and write-back:

    disk    read a | read b | write a, read c | write b ...
    host           | update a        | update b       ...

The working directory holds working state only: checkpoints are Orbax's (the engine reads each disk
unit into host RAM to save it), and a run restored from a checkpoint writes its disk units afresh.
"""

from __future__ import annotations

import collections
import errno
import mmap
import os
import shutil
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxzero.config import ConfigError
from jaxzero.offload.timeline import span

ALIGN = 4096  # direct I/O: offsets, lengths and buffer addresses are multiples of the block size
PIECE = 64 << 20  # bytes per read or write call: large transfers keep the disk's queue full


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Leaf(NamedTuple):
    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int  # bytes into the file (and the buffer), a multiple of ALIGN


@dataclass(frozen=True)
class _Layout:
    """Where each array of one unit's (params, opt_state) tree lies in its file."""

    treedef: Any
    leaves: tuple[_Leaf, ...]
    nbytes: int  # the file's size, a multiple of ALIGN

    @classmethod
    def of(cls, tree: Any) -> _Layout:
        arrays, treedef = jax.tree.flatten(tree)
        leaves, offset = [], 0
        for x in arrays:
            dtype = np.dtype(x.dtype)
            leaves.append(_Leaf(tuple(np.shape(x)), dtype, offset))
            offset += _aligned(int(np.prod(np.shape(x), dtype=np.int64)) * dtype.itemsize)
        return cls(treedef, tuple(leaves), max(offset, ALIGN))

    def views(self, buffer: memoryview) -> Any:
        """The unit's tree as NumPy arrays over `buffer` (writable; no copy)."""
        arrays = [
            np.frombuffer(buffer, leaf.dtype, int(np.prod(leaf.shape, dtype=np.int64)), leaf.offset).reshape(
                leaf.shape
            )
            for leaf in self.leaves
        ]
        return jax.tree.unflatten(self.treedef, arrays)


@dataclass(frozen=True)
class OnDisk:
    """In a `HostUnit`, in place of the masters or optimizer state of a unit kept on disk."""

    position: int


class DiskStats(NamedTuple):
    """Disk traffic since the last reading."""

    read_bytes: int
    written_bytes: int
    read_s: float  # seconds the reads took, one unit after another
    write_s: float
    wait_s: float  # seconds updates waited for their unit's read


class DiskStore:
    """The disk units' state files and the host buffers they pass through; see the module docstring.

    directory: where to create the working directory (created if missing).
    positions: the units (by forward position) kept here, in the order each step updates them.
    slots:     host buffers, each as large as the largest unit's file: the units in RAM at once.
    threads:   concurrent read and write calls.
    """

    def __init__(self, directory: str | Path, positions: list[int], slots: int, threads: int = 8):
        if slots < 1:
            raise ValueError(f"a disk store needs at least one buffer (slots={slots})")
        parent = Path(directory).absolute()
        # The directories this store creates above its own, deepest first: removed with it if empty.
        made = [d for d in (parent, *parent.parents) if not d.exists()]
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self.directory = parent / f"jaxzero-working-state-{uuid.uuid4().hex[:12]}"
            self.directory.mkdir()
        except OSError as e:  # the setting names a place that cannot take it: bad input (exit 2)
            raise ConfigError(
                f"cannot create the disk tier's working directory under {parent}: {e}. Set offload.disk_path "
                "to a writable directory on a local disk."
            ) from e
        self.positions = list(positions)
        self.slots = slots
        self._layouts: dict[int, _Layout] = {}
        self._buffers: list[mmap.mmap] = []  # made once the units' sizes are known
        self._free: collections.deque[mmap.mmap] = collections.deque()
        self._freed = threading.Condition()
        # Per unit: the write-back of the newest scheduled read's state (done when the file is current
        # for the next read); the scheduled reads not taken yet, each with its write-back; the taken
        # one's buffer and write-back.
        self._current: dict[int, Future] = {}
        self._reads: dict[int, collections.deque[tuple[Future, Future]]] = {
            p: collections.deque() for p in positions
        }
        self._in_use: dict[int, tuple[mmap.mmap, Future]] = {}
        self._unsettled: list[Future] = []  # every scheduled read and write-back not done yet (`close`)
        self._io = ThreadPoolExecutor(threads, thread_name_prefix="jaxzero-disk-io")
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="jaxzero-disk-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="jaxzero-disk-write")
        self._lock = threading.Lock()
        self._stats = DiskStats(0, 0, 0.0, 0.0, 0.0)
        self.direct = True  # direct I/O; turned off where the filesystem refuses it
        self._closed = False
        # Removed at exit too, where nobody called `close` (the store created it; only it writes there).
        self._finalizer = weakref.finalize(self, _remove, self.directory, made)

    # -- files ---------------------------------------------------------------------------------------

    def _path(self, position: int) -> Path:
        return self.directory / f"unit-{position:05d}.bin"

    def _open(self, position: int, write: bool) -> int:
        flags = (os.O_RDWR | os.O_CREAT) if write else os.O_RDONLY
        if self.direct and hasattr(os, "O_DIRECT"):
            try:
                return os.open(self._path(position), flags | os.O_DIRECT, 0o600)
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: this filesystem has no direct I/O (e.g. tmpfs)
                    raise
                self.direct = False
        return os.open(self._path(position), flags, 0o600)

    def _transfer(self, position: int, buffer: mmap.mmap, nbytes: int, write: bool) -> None:
        """The first `nbytes` of `buffer` to or from the unit's file, piece by piece over the pool."""
        fd = self._open(position, write)
        try:
            view = memoryview(buffer)

            def piece(lo: int) -> None:
                hi = min(lo + PIECE, nbytes)
                done = 0
                while lo + done < hi:  # short transfers continue where they stopped
                    part = view[lo + done : hi]
                    n = os.pwritev(fd, [part], lo + done) if write else os.preadv(fd, [part], lo + done)
                    if n <= 0:
                        raise OSError(
                            errno.EIO,
                            f"{'write' if write else 'read'} of {self._path(position)} stopped at "
                            f"byte {lo + done}",
                        )
                    done += n

            for f in [self._io.submit(piece, lo) for lo in range(0, nbytes, PIECE)]:
                f.result()
        finally:
            os.close(fd)

    def _buffer(self) -> mmap.mmap:
        """A free host buffer (waits for one)."""
        with self._freed:
            while not self._free:
                if self._closed:
                    raise self._closed_error()
                self._freed.wait()
            return self._free.popleft()

    def _release(self, buffer: mmap.mmap) -> None:
        with self._freed:
            self._free.append(buffer)
            self._freed.notify()

    def _count(self, **more: float) -> None:
        with self._lock:
            self._stats = self._stats._replace(**{k: getattr(self._stats, k) + v for k, v in more.items()})

    # -- the units -----------------------------------------------------------------------------------

    def create(self, position: int, tree: Any) -> None:
        """Write unit `position`'s state (a tree of this process's host blocks: CPU-backend arrays or
        NumPy) as its file, replacing what it held, and wait until written. Every unit is created
        before the first `schedule`: the first creation of each sizes the host buffers."""
        self._settled(position)
        layout = self._layouts.get(position)
        if layout is None:
            layout = self._layouts[position] = _Layout.of(tree)
            self._size_buffers(layout.nbytes)
        buffer = self._buffer()
        try:
            with jax.transfer_guard_device_to_host("allow"):  # host arrays, read in place
                for dst, src in zip(jax.tree.leaves(layout.views(memoryview(buffer))), jax.tree.leaves(tree)):
                    np.copyto(dst, np.asarray(src))
            self._write(position, buffer)
        finally:
            self._release(buffer)

    def _size_buffers(self, nbytes: int) -> None:
        """Buffers as large as the largest unit so far (page-aligned anonymous memory)."""
        if self._buffers and len(self._buffers[0]) >= nbytes:
            return
        with self._freed:
            if len(self._free) != len(self._buffers):
                raise RuntimeError("disk units must all be created before the first read is scheduled")
            for b in self._buffers:
                b.close()
            self._buffers = [mmap.mmap(-1, nbytes) for _ in range(self.slots)]
            self._free = collections.deque(self._buffers)

    def _write(self, position: int, buffer: mmap.mmap) -> None:
        start = time.perf_counter()
        nbytes = self._layouts[position].nbytes
        with span("disk_write", position):
            self._transfer(position, buffer, nbytes, write=True)
        self._count(written_bytes=nbytes, write_s=time.perf_counter() - start)

    def _settled(self, position: int) -> None:
        """Wait until unit `position`'s file is current (its newest scheduled read written back)."""
        current = self._current.get(position)
        if current is not None:
            current.result()

    def schedule(self) -> None:
        """Queue one step's reads of every disk unit, in update order (returns at once). Each read
        waits for the write-back of the one before (taken, updated and `put`, or given back)."""
        with self._lock:
            self._unsettled = [f for f in self._unsettled if not f.done()]
        for p in self.positions:
            read, written = Future(), Future()
            before, self._current[p] = self._current.get(p), written
            with self._lock:
                self._reads[p].append((read, written))
                self._unsettled += [read, written]
            self._loader.submit(self._read, p, before, read)

    def _read(self, position: int, before: Future | None, out: Future) -> None:
        try:
            buffer = self._buffer()
            try:
                if before is not None:
                    before.result()  # the newest state is on disk
                start = time.perf_counter()
                nbytes = self._layouts[position].nbytes
                with span("disk_read", position):
                    self._transfer(position, buffer, nbytes, write=False)
                self._count(read_bytes=nbytes, read_s=time.perf_counter() - start)
            except BaseException:
                self._release(buffer)
                raise
            out.set_result(buffer)
        except BaseException as e:
            out.set_exception(e)

    def take(self, position: int) -> Any:
        """Unit `position`'s (params, opt_state) as NumPy arrays in a host buffer, from the oldest
        scheduled read (waits for it). Hand it back with `put` or `give_back`."""
        start = time.perf_counter()
        read, written = self._reads[position].popleft()
        try:
            with span("wait_disk", position):
                buffer = read.result()
        except BaseException as e:
            _settle(written, e)  # the reads after it fail too, rather than wait
            raise
        self._count(wait_s=time.perf_counter() - start)
        with self._lock:
            self._in_use[position] = (buffer, written)
        return self._layouts[position].views(memoryview(buffer))

    def put(self, position: int) -> None:
        """Write back unit `position`, taken with `take` and updated in place in its buffer; returns at
        once, the buffer free once the write is done."""
        with self._lock:
            buffer, written = self._in_use.pop(position)
        if self._closed:  # nothing writes it back any more (`close` failed its write-back)
            self._release(buffer)
            raise self._closed_error()

        def write() -> None:
            try:
                self._write(position, buffer)
                written.set_result(None)
            except BaseException as e:
                written.set_exception(e)
                raise
            finally:
                self._release(buffer)

        self._writer.submit(write)

    def give_back(self, position: int) -> None:
        """Return unit `position`'s buffer unchanged (nothing to write: the file is current)."""
        with self._lock:
            buffer, written = self._in_use.pop(position)
        self._release(buffer)
        _settle(written)

    def reader(self, position: int) -> Callable[[], Any]:
        """A function that reads unit `position`'s (params, opt_state) as they are now, once the
        pending write-back of the last update is done, into NumPy arrays of a buffer of their own (not
        one of the slots the next step's reads take): for a checkpoint, written while training goes
        on. The unit's next update must not start before it has been read."""
        settled = self._current.get(position)
        layout = self._layouts[position]

        def read() -> Any:
            if settled is not None:
                settled.result()
            buffer = mmap.mmap(-1, _aligned(layout.nbytes))  # page-aligned, as direct I/O needs
            self._transfer(position, buffer, layout.nbytes, write=False)
            return layout.views(memoryview(buffer))

        return read

    def read(self, position: int) -> Any:
        """A copy of unit `position`'s (params, opt_state), as NumPy arrays of their own (waits for its
        pending write-back). Between steps."""
        return self.reader(position)()

    def take_stats(self) -> DiskStats:
        """Disk traffic since the last call."""
        with self._lock:
            out, self._stats = self._stats, DiskStats(0, 0, 0.0, 0.0, 0.0)
        return out

    def close(self) -> None:
        """Stop, and remove the working directory (the store created it; nothing else is in it).
        Reads and write-backs not done by then fail (`RuntimeError`), so that an update waiting in
        `take` for a read the close cancelled raises instead of waiting forever."""
        if self._closed:
            return
        with self._freed:
            self._closed = True
            self._freed.notify_all()
        for pool in (self._loader, self._writer, self._io):
            pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            pending, self._unsettled = self._unsettled, []
        for f in pending:
            _settle(f, self._closed_error())
        self._finalizer()  # removes the directory

    def _closed_error(self) -> RuntimeError:
        return RuntimeError(f"the disk store in {self.directory} is closed")

    @property
    def nbytes(self) -> int:
        """Bytes of the units' files."""
        return sum(layout.nbytes for layout in self._layouts.values())


def _settle(f: Future, error: BaseException | None = None) -> None:
    """Resolve `f` (with `error`, or None) unless it is resolved already (`DiskStore.close` fails
    what is still pending)."""
    try:
        f.set_result(None) if error is None else f.set_exception(error)
    except InvalidStateError:
        pass


def _remove(directory: Path, made: list[Path]) -> None:
    """Remove the store's working `directory`, then the directories it created above it (`made`,
    deepest first) while they are empty: a user's files there stay."""
    shutil.rmtree(directory, True)
    for d in made:
        try:
            d.rmdir()
        except OSError:  # not empty (or gone): what is above it stays too
            break
