"""Stopping at a step boundary: SIGTERM, SIGHUP (a closed terminal, a dropped SSH session) or a first
Ctrl-C asks the run to stop after its current step with a checkpoint; a second Ctrl-C stops at once. With
several processes JAX's preemption sync point makes every process stop at the same step. The handlers are
process-wide: the program installs them (`install_stop_handlers`), the loop asks (`stop_requested`)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import jax
from jax.experimental import multihost_utils

from jaxzero.run.console import detach_hung_up_terminal
from jaxzero.run.outcome import EXIT_INTERRUPTED


class _StopRequest:
    """SIGTERM or a first Ctrl-C, set by the handlers `install_stop_handlers` installs and read at the
    next step boundary. A second Ctrl-C exits at once."""

    reason: str | None = None

    def on_sigterm(self, signum: int, frame: Any) -> None:
        self.reason = self.reason or "SIGTERM"

    def on_sighup(self, signum: int, frame: Any) -> None:
        # As SIGTERM: the default action would kill the run with nothing saved. The terminal is
        # gone, so the console goes to /dev/null first (metrics.jsonl keeps every record).
        detach_hung_up_terminal()
        self.reason = self.reason or "SIGHUP"

    def on_sigint(self, signum: int, frame: Any) -> None:
        if self.reason is not None:
            # At once means now, from wherever the main thread is, not after the saves and host
            # updates in flight: committed checkpoints are complete, and a half-written save is
            # removed when the run is resumed.
            print(
                "\njaxzero: interrupted: stopped at once (a second Ctrl-C); the checkpoints already "
                "committed are complete.",
                file=sys.stderr,
                flush=True,
            )
            os._exit(EXIT_INTERRUPTED)
        self.reason = "Ctrl-C"
        print(
            "\njaxzero: Ctrl-C: stopping after this step with a checkpoint (Ctrl-C again: at once).",
            file=sys.stderr,
        )


_STOP = _StopRequest()


def install_stop_handlers() -> Callable[[], None]:
    """Catch SIGTERM, SIGHUP and Ctrl-C for a one-process run; returns the function that puts the
    previous handlers back."""
    _STOP.reason = None
    previous = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, _STOP.on_sigterm),
        signal.SIGHUP: signal.signal(signal.SIGHUP, _STOP.on_sighup),
        signal.SIGINT: signal.signal(signal.SIGINT, _STOP.on_sigint),
    }

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    return restore


def install_hangup_as_sigterm() -> Callable[[], None]:
    """For a run of several processes, whose SIGTERM JAX's preemption sync point handles: SIGHUP
    detaches a hung-up terminal and is passed on to this process as SIGTERM, so that every process
    stops at one step with a checkpoint. Returns the function that puts the previous handler back."""

    def on_sighup(signum: int, frame: Any) -> None:
        detach_hung_up_terminal()
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGHUP, on_sighup)
    return lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL if previous is None else previous)


def stop_requested(step: int) -> str | None:
    """Why this run should stop after `step` ("SIGTERM", "SIGHUP", "Ctrl-C"), or None. With several processes
    (jax.distributed running) JAX's preemption sync point answers, so that every process stops at the
    same step; one process reads its own handlers' flag (without handlers, never)."""
    if jax.distributed.is_initialized():
        return "SIGTERM" if multihost_utils.reached_preemption_sync_point(step) else None
    return _STOP.reason
