"""How many units each step updates in two passes: fixed, or adapted to the host's slack.

A two-pass update writes a unit's new compute weights as soon as the global norm is known (the next
forward pass waits only for those) and its masters and moments during the next backward pass
(`jaxzero.offload.pipeline`). The units in two passes are the first `units(step)` in forward order.

Adaptive, the count follows the host's slack. A second pass still running when the next step's norm
arrives sits on that step's critical path: the count drops by one for each. With none running, the
count grows by one only if the slack since the last second pass ended would fit another (1.5 times
the mean interval between the previous step's second passes), so a count that just fits does not
step up to one that does not.

Pure bookkeeping: times are passed in (perf_counter seconds), so it is tested without threads. The
count follows timings, so it differs run to run; the results do not (two passes give one pass's
bits), so `--determinism` leaves it adaptive.
"""

from __future__ import annotations

import threading

from jaxzero.plan import TwoPass

_KEPT_STEPS = 3  # records of the last steps up to the newest; older ones are never read again


class TwoPassCounter:
    """The two-pass count per step, within [0, `policy.max_units`]; thread-safe.

    The pipeline calls `begin` when a unit's two-pass update starts and `end` when it is over (with
    the time its second pass ended, or None if it failed), and `units` once the norm of a step is
    known, from each unit task that gets that far (not those that skipped a float16 overflow);
    the first call decides the step's count.
    """

    def __init__(self, policy: TwoPass):
        self.policy = policy
        self._now = policy.max_units  # the count the next step starts from
        self._running = 0  # two-pass updates begun and not yet ended
        self._count_of: dict[int, int] = {}  # step -> its count
        self._ends: dict[int, list[float]] = {}  # step -> when each of its second passes ended
        self._lock = threading.Lock()

    def units(self, step: int, now: float) -> int:
        """How many units of `step` (counted from the embedding) update in two passes. Decided at the
        first call for `step`, at time `now`, when the two-pass updates still running are exactly
        those of earlier steps that are late for this one."""
        with self._lock:
            if step not in self._count_of:
                if self.policy.adaptive and step > 0:
                    late = self._running
                    k = self._now - late if late else self._now + self._room(step - 1, now)
                    self._now = max(0, min(self.policy.max_units, k))
                self._count_of = _recent(self._count_of, step)
                self._ends = _recent(self._ends, step)
                self._count_of[step] = self._now
            return self._count_of[step]

    def begin(self) -> None:
        """A unit's two-pass update started."""
        with self._lock:
            self._running += 1

    def end(self, step: int, at: float | None) -> None:
        """A two-pass update of `step` is over: its second pass ended at `at`, or it failed (None)."""
        with self._lock:
            if at is not None:
                self._ends.setdefault(step, []).append(at)
            self._running -= 1

    def _room(self, step: int, now: float) -> int:
        """1 if one more second pass, as long as `step`'s took on average, would have ended by `now`,
        else 0 (under the lock). With fewer than two of them to measure by, 1: the count is then
        low, and may swing by one unit where the host fits only one or two."""
        ends = self._ends.get(step, [])
        if len(ends) < 2:
            return 1
        interval = (max(ends) - min(ends)) / (len(ends) - 1)
        return int(now - max(ends) >= 1.5 * interval)


def _recent(by_step: dict, step: int) -> dict:
    """`by_step`'s entries of the last `_KEPT_STEPS` steps up to `step`."""
    return {s: v for s, v in by_step.items() if s > step - _KEPT_STEPS}
