"""Where the offload trainer's steps spent their time, per step (`StepTimings`): the trainer's
`timings`, keyed by `jaxzero.state.BREAKDOWN`.

Three sources, each read and reset by a call: the step's clock (accelerator compute, copies, host
updates, waits: `jaxzero.offload.timeline`), the host update's events (two-pass units:
`UpdatePipeline.take_counts`), and the disk tier's traffic (`DiskStore.take_stats`; zeros without
disk units).
"""

from __future__ import annotations

from jaxzero.offload.disk import DiskStats, DiskStore
from jaxzero.offload.pipeline import UpdatePipeline
from jaxzero.offload.timeline import StepClock

_NO_DISK = DiskStats(0, 0, 0.0, 0.0, 0.0)


class StepTimings:
    """`timings(wall, steps)`: the per-step breakdown of what finished since the last call, over
    `wall` seconds of `steps` steps (every value divided by `steps`, at least 1)."""

    def __init__(self, clock: StepClock, pipeline: UpdatePipeline, disk: DiskStore | None = None):
        self.clock = clock
        self.pipeline = pipeline
        self.disk = disk

    def __call__(self, wall: float, steps: int) -> dict[str, float]:
        n = max(steps, 1)
        times = {k: v / n for k, v in self.clock.summary(wall).items()}
        counts = self.pipeline.take_counts()
        io = self.disk.take_stats() if self.disk is not None else _NO_DISK
        return {
            **times,
            "two_pass_units": counts.two_passed / n,
            "disk_read_s": io.read_s / n,
            "disk_write_s": io.write_s / n,
            "wait_disk_s": io.wait_s / n,
            "disk_gb": (io.read_bytes + io.written_bytes) / 1e9 / n,
        }
