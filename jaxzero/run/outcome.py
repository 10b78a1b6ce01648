"""How a training run ends: the exceptions that stop it and the exit status of each, shared by the
loop (`jaxzero.run.loop`), its reporting (`jaxzero.run.metrics`), its stop requests (`jaxzero.run.stopping`)
and the program (`python -m jaxzero.train`)."""

from __future__ import annotations

# Exit statuses of `python -m jaxzero.train`: training failed, the config or input is wrong, stopped
# at a step boundary by SIGTERM (a checkpoint saved), stopped by Ctrl-C.
EXIT_TRAINING, EXIT_CONFIG, EXIT_PREEMPTED, EXIT_INTERRUPTED = 1, 2, 3, 130


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. a non-finite loss); the message says why and what to try."""


class Preempted(RuntimeError):
    """SIGTERM or Ctrl-C arrived and the run stopped at a step boundary; `exit_code` is the status."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code
