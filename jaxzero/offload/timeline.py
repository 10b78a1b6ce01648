"""Where an offloaded step's time goes, measured while it runs.

Three watcher threads wait, in issue order, for each host-to-accelerator weight copy, each
accelerator computation (one per unit and direction) and each accelerator-to-host gradient copy, and
note when it finished. Copies on one engine and kernels on one stream run in issue order, so each
item's busy time is its finish minus the later of its issue and the previous item's finish. With
the host update's own intervals and the time the dispatching thread sat waiting for updated
weights, a window of steps gives the times of `jaxzero.state.BREAKDOWN_TIMES`:

    gpu_compute_s   accelerator computations, summed (from their completion times)
    h2d_s / d2h_s   busy time of the weight copies in / the gradient copies out (they overlap compute)
    host_update_s   wall time during which at least one unit was being updated on the host
    wait_weights_s  time the next forward pass was held back waiting for the host update
    gpu_idle_s / host_idle_s   the window's wall time minus gpu_compute_s / host_update_s

The times are host-observed completion times (a thread wakes when the work is done), so they
are slightly late, by roughly the thread wake-up latency (tens of microseconds per item).

In a profiler trace (`profile.steps`, `jaxzero.run.profiling`) the same work shows as spans named by
`span`: each unit's host update, the waits for its gradients, the norm and its new weights, the copies
issued and the disk tier's reads and writes.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jax

STREAMS = ("h2d", "compute", "d2h")  # what the watchers follow: copies in, computations, copies out


class _Watcher:
    """A thread that waits for arrays in the order given and records (issued, finished) times."""

    def __init__(self, name: str):
        self._queue: queue.Queue = queue.Queue()
        self.done: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name=f"jaxzero-watch-{name}", daemon=True).start()

    def put(self, x: Any) -> None:
        self._queue.put((time.perf_counter(), x))

    def _run(self) -> None:
        while True:
            issued, x = self._queue.get()
            try:
                jax.block_until_ready(x)  # host sync (this thread only)
            except Exception:  # a deleted or failed array: its time is unknown, skip it
                continue
            finished = time.perf_counter()
            del x
            with self._lock:
                self.done.append((issued, finished))

    def take(self) -> list[tuple[float, float]]:
        with self._lock:
            out, self.done = self.done, []
        return out


def span(what: str, unit: int, detail: str = "") -> jax.profiler.TraceAnnotation:
    """A span of host work in a profiler trace, named `jaxzero/<what> unit=<unit>[ <detail>]` (`unit`:
    the position in the forward pass). A context manager; about a microsecond when no trace runs, so
    the engine always marks its work."""
    return jax.profiler.TraceAnnotation(f"jaxzero/{what} unit={unit}{' ' + detail if detail else ''}")


def busy(items: list[tuple[float, float]]) -> float:
    """Busy time of in-order work: each item runs from max(its issue, the previous finish) to its finish."""
    total, prev = 0.0, float("-inf")
    for issued, finished in sorted(items, key=lambda t: t[1]):
        start = max(issued, prev)
        total += max(0.0, finished - start)
        prev = max(prev, finished)
    return total


def union(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


class StepClock:
    """Collects one step's events; `summary` turns a window of them into the breakdown (seconds)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._watch = {k: _Watcher(k) for k in STREAMS} if enabled else {}
        self._updates: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        self._wait = 0.0

    @staticmethod
    def off() -> StepClock:
        return _OFF

    def copied(self, x: Any) -> Any:
        if self.enabled:
            self._watch["h2d"].put(x)
        return x

    def computed(self, x: Any) -> Any:
        if self.enabled:
            self._watch["compute"].put(x)
        return x

    def sent(self, x: Any) -> Any:
        if self.enabled:
            self._watch["d2h"].put(x)
        return x

    @contextmanager
    def waiting(self) -> Iterator[None]:
        t = time.perf_counter()
        yield
        self._wait += time.perf_counter() - t

    def updated(self, start: float, end: float) -> None:
        """A unit's host update ran from `start` to `end` (perf_counter seconds; any thread)."""
        if self.enabled:
            with self._lock:
                self._updates.append((start, end))

    def summary(self, wall: float) -> dict[str, float]:
        """The times of everything finished since the last call, over `wall` seconds of steps, keyed
        as `jaxzero.state.BREAKDOWN_TIMES` (seconds in all, not per step)."""
        events = {k: w.take() for k, w in self._watch.items()}
        with self._lock:
            updates, self._updates = self._updates, []
        wait, self._wait = self._wait, 0.0
        start = time.perf_counter() - wall  # work begun before the window counts from its start
        clip = lambda xs: [(max(a, start), b) for a, b in xs if b > start]  # noqa: E731
        out = {
            "gpu_compute_s": busy(clip(events.get("compute", []))),
            "h2d_s": busy(clip(events.get("h2d", []))),
            "d2h_s": busy(clip(events.get("d2h", []))),
            "host_update_s": union(clip(updates)),
            "wait_weights_s": wait,
        }
        out["gpu_idle_s"] = max(0.0, wall - out["gpu_compute_s"])
        out["host_idle_s"] = max(0.0, wall - out["host_update_s"])
        return out


_OFF = StepClock(enabled=False)
