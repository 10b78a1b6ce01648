"""A JAX profiler trace of a window of steps (`profile.steps=A:B`: steps A to B - 1), for Perfetto and
TensorBoard's profile plugin.

The trace starts right before step A is issued and stops once step B - 1's work is done, its host
update included (waiting for it is a host sync, at that step only; the steps traced are otherwise
untouched). Besides JAX's own events (compilations, transfers, computations) it holds the offload
engine's host work as spans named `jaxzero/...`, each with its unit (`unit=3`: the position in the
forward pass, embedding 0, block i at 1 + i, head last):

    jaxzero/host_update      a unit's optimizer update on the host (`pass=weights` / `pass=state`:
                             the two passes of a two-pass update)
    jaxzero/wait_grads       a unit's update waiting for its gradients to land in host memory
    jaxzero/wait_norm        ... for the global gradient norm (clipping, float16)
    jaxzero/wait_update      the forward pass waiting for a unit's updated weights
    jaxzero/h2d weights      a streamed block's weights copied to the accelerator (issued)
    jaxzero/d2h grad         a unit's gradient copied to host memory (issued)
    jaxzero/h2d staged       new weights of an accelerator-resident unit copied from pinned staging
    jaxzero/disk_read, jaxzero/disk_write, jaxzero/wait_disk   the disk tier's reads, write-backs, and
                             an update waiting for its unit's read

The spans are `jax.profiler.TraceAnnotation`s: with no trace running each costs about a microsecond,
so they are always in place. The profiler is process-wide: one trace at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TextIO

import jax

from jaxzero.storage.run_dir import PROFILE_DIR


def trace_dir(run_dir: Path) -> Path:
    """Where this process's profiler traces go: `<run_dir>/profile`, with several processes a folder
    each (the trace files are named after the host, which processes of one machine share)."""
    if jax.process_count() == 1:
        return run_dir / PROFILE_DIR
    return run_dir / PROFILE_DIR / f"process-{jax.process_index()}"


class StepTrace:
    """Traces the steps of `window` (None: none) into `directory`. Call `before(step)` before each step
    is issued, `after(step, state)` once it returns, and `stop()` on every way out of the loop.

    A run that starts inside the window (a resume) traces from its first step; one that starts after
    it traces nothing and says so."""

    def __init__(self, window: range | None, directory: Path, first: int, console: TextIO):
        self.window, self.directory, self.console = window, directory, console
        self._started: int | None = None  # the first step traced, while the trace runs
        self._last = window.stop - 1 if window is not None else 0  # the step the trace stops after
        if window is not None and window.stop <= first:
            print(
                f"jaxzero: profile.steps={window.start}:{window.stop}: this run starts at step {first}, "
                "after the window, so nothing is traced.",
                file=console,
            )
            self.window = None

    def before(self, step: int) -> None:
        """Start the trace if `step` is the first step of the window this run reaches."""
        if self.window is None or self._started is not None or step not in self.window:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        # perfetto_trace.json.gz too: what ui.perfetto.dev opens (the .xplane.pb is TensorBoard's).
        jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
        self._started = step

    def after(self, step: int, state: Any) -> None:
        """Stop the trace after the window's last step, once that step's work is done: waits for
        `state` (a host sync; the offload engine's state waits for its host update)."""
        if self._started is not None and step == self._last:
            jax.block_until_ready(state)
            self.stop(step)

    def stop(self, step: int | None = None) -> None:
        """Stop the trace if one runs, write it and say where it is and how to view it. `step`: the
        last step traced, None on the way out of a failure (the trace then ends where it stopped).
        A trace that cannot be written is reported, not raised: the run's own outcome stays the one
        the user reads."""
        if self._started is None:
            return
        first, self._started, self.window = self._started, None, None  # one trace per run
        steps = f"steps {first} to {step}" if step is not None else f"steps from {first} (stopped early)"
        try:
            jax.profiler.stop_trace()
        except Exception as e:  # noqa: BLE001 - a trace is an aid: its failure never stops the run
            print(f"jaxzero: the profiler trace of {steps} could not be written: {e}", file=self.console)
            return
        sessions = sorted((self.directory / "plugins" / "profile").glob("*"), key=lambda p: p.stat().st_mtime)
        where = sessions[-1] if sessions else self.directory
        print(
            f"jaxzero: profiler trace of {steps} in {where}: open its perfetto_trace.json.gz at "
            f"https://ui.perfetto.dev, or run `tensorboard --logdir={self.directory}` with the profile "
            "plugin (pip install xprof): its Profile tab. The offload engine's host work is in "
            "spans named jaxzero/...",
            file=self.console,
        )
