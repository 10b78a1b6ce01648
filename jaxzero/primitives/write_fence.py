"""The fence between a checkpoint being written and the updates that change its arrays in place.

A save writes the training state unit by unit (embedding, each block, head: positions 0 .. L + 1,
the order in which the next step updates them) while training goes on. The optimizer updates masters
and moments in place, so before a unit's next update (`release(position)`) the save must be done
with that unit's arrays:

- written already: the update goes ahead;
- not started by the writer, and the save's copy budget has room for it: the unit is copied into
  that budget (the writer then writes the copy, and frees its bytes once written), and the update
  goes ahead at once;
- otherwise the update waits until the writer has written the unit, or until the budget has room.

The writer calls `begin` with the units, their sizes, the budget and the function that copies a
unit; `start(position)` before it reads a unit (a unit being copied is waited for), `written` once
it is on disk, and `finish` at the end, whether the save succeeded or failed (a failed save is
reported by the checkpointer; the fence never keeps training waiting).

The fence knows nothing of Orbax or of the trainers: the checkpointer drives it, the trainers wait
at it. Training blocked by a save is the wall time during which any update waited
(`take_blocked_seconds`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping


class WriteFence:
    """Which units a save in progress has yet to write; see the module docstring. Thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: dict[int, int] = {}  # position -> bytes, of the units the writer holds
        self._started: set[int] = set()  # being written: no copy now
        self._copying: set[int] = set()
        self._copied: dict[int, int] = {}  # position -> bytes of budget, until written
        self._budget = 0
        self._copy: Callable[[int], bool] | None = None
        self._waiting = 0  # threads waiting now
        self._since = 0.0  # when the first of them started waiting
        self._blocked = 0.0  # seconds during which some thread waited, since the last reading

    # -- the writer's side ---------------------------------------------------------------------------

    def begin(
        self, sizes: Mapping[int, int], budget: int = 0, copy: Callable[[int], bool] | None = None
    ) -> None:
        """A save starts: the units at `sizes`' positions (bytes each) are not written yet. `copy(p)`
        replaces the unit at p in the save with a copy of it, False where it cannot; the copies held
        at once take at most `budget` bytes."""
        with self._cond:
            self._pending, self._budget, self._copy = dict(sizes), budget, copy
            self._started.clear()
            self._copied.clear()

    def start(self, position: int) -> None:
        """The writer is about to read the unit at `position` (waits for a copy of it under way)."""
        with self._cond:
            self._cond.wait_for(lambda: position not in self._copying)
            self._started.add(position)

    def written(self, position: int) -> None:
        """The unit at `position` is written: its update may go ahead, its copy's bytes are free."""
        with self._cond:
            self._pending.pop(position, None)
            self._started.discard(position)
            self._copied.pop(position, None)
            self._cond.notify_all()

    def finish(self) -> None:
        """The save is over (committed or failed): nothing waits any more."""
        with self._cond:
            self._cond.wait_for(lambda: not self._copying)
            self._pending.clear()
            self._started.clear()
            self._copied.clear()
            self._copy = None
            self._cond.notify_all()

    # -- the trainers' side --------------------------------------------------------------------------

    def pending(self) -> frozenset[int]:
        """Positions whose update would wait now (empty: no save in progress)."""
        with self._cond:
            return frozenset(p for p in self._pending if p not in self._copied)

    def release(self, position: int) -> None:
        """Return once the unit at `position` may be updated in place: written, or copied for the
        writer (see the module docstring). At once when no save is in progress; otherwise a host sync
        with the checkpoint writer."""
        with self._cond:
            if self._free(position):
                return
            self._enter()
            try:
                while not self._free(position):
                    nbytes = self._pending[position]
                    copyable = self._copy is not None and not {position} & (self._started | self._copying)
                    if copyable and sum(self._copied.values()) + nbytes <= self._budget:
                        self._copying.add(position)
                        self._copied[position] = nbytes
                        break
                    self._cond.wait()
                else:
                    return
            finally:
                self._leave()
        copied = False
        try:
            copied = self._copy(position)  # outside the lock: a copy of up to a unit's bytes
        finally:
            with self._cond:
                self._copying.discard(position)
                if not copied:
                    self._copied.pop(position, None)
                self._cond.notify_all()
        if not copied:
            self.wait(position)

    def wait(self, position: int) -> None:
        """Block until the writer has written the unit at `position` (at once when no save is in
        progress). A host sync with the checkpoint writer, only while a save is in progress."""
        with self._cond:
            if position not in self._pending:
                return
            self._enter()
            try:
                self._cond.wait_for(lambda: position not in self._pending)
            finally:
                self._leave()

    def wait_all(self) -> None:
        """Block until the save in progress, if any, has written every unit (for trainers that
        update the whole state at once)."""
        with self._cond:
            if not self._pending:
                return
            self._enter()
            try:
                self._cond.wait_for(lambda: not self._pending)
            finally:
                self._leave()

    def take_blocked_seconds(self) -> float:
        """Seconds during which at least one update waited for the writer, since the last call."""
        with self._cond:
            now = time.perf_counter()
            if self._waiting:
                self._blocked += now - self._since
                self._since = now
            out, self._blocked = self._blocked, 0.0
            return out

    def _free(self, position: int) -> bool:  # under the lock: written, or copied for the writer
        return position not in self._pending or (position in self._copied and position not in self._copying)

    def _enter(self) -> None:  # under the lock
        if self._waiting == 0:
            self._since = time.perf_counter()
        self._waiting += 1

    def _leave(self) -> None:  # under the lock
        self._waiting -= 1
        if self._waiting == 0:
            self._blocked += time.perf_counter() - self._since
