"""The fence between a checkpoint being written and the updates that change its arrays in place.

A save writes the training state unit by unit (embedding, each block, head: positions 0 .. L + 1,
the order in which the next step updates them) while training goes on. The optimizer updates masters
and moments in place, so a unit's next update must not start before the writer has written that
unit: the update calls `wait(position)` first. The writer calls `begin` with the positions it will
write, `written` for each once it is on disk, and `finish` at the end, whether the save succeeded or
failed (a failed save is reported by the checkpointer; the fence never keeps training waiting).

The fence knows nothing of Orbax or of the trainers: the checkpointer drives it, the trainers wait
at it. Training blocked by a save is the wall time during which anything waited
(`take_blocked_seconds`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable


class WriteFence:
    """Which units a save in progress has yet to write; see the module docstring. Thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: set[int] = set()
        self._waiting = 0  # threads in `wait` now
        self._since = 0.0  # when the first of them started waiting
        self._blocked = 0.0  # seconds during which some thread waited, since the last reading

    def begin(self, positions: Iterable[int]) -> None:
        """A save starts: the units at `positions` are not written yet."""
        with self._cond:
            self._pending = set(positions)

    def written(self, position: int) -> None:
        """The unit at `position` is written: its update may go ahead."""
        with self._cond:
            self._pending.discard(position)
            self._cond.notify_all()

    def finish(self) -> None:
        """The save is over (committed or failed): nothing waits any more."""
        with self._cond:
            self._pending.clear()
            self._cond.notify_all()

    def pending(self) -> frozenset[int]:
        """Positions the save in progress has yet to write (empty: none in progress)."""
        with self._cond:
            return frozenset(self._pending)

    def wait(self, position: int) -> None:
        """Block until the unit at `position` is written (at once when no save is in progress). A host
        sync with the checkpoint writer, only while a save is in progress."""
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

    def _enter(self) -> None:  # under the lock
        if self._waiting == 0:
            self._since = time.perf_counter()
        self._waiting += 1

    def _leave(self) -> None:  # under the lock
        self._waiting -= 1
        if self._waiting == 0:
            self._blocked += time.perf_counter() - self._since
