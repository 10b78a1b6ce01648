"""`python -m jaxzero.train [--config=PATH] [--deepspeed=PATH] [--section.key=value ...]`: train a
model. `--deepspeed` reads a DeepSpeed config file (`jaxzero.deepspeed`).

With no arguments it trains the tiny Llama on the built-in byte-level corpus on whatever JAX backend is
present. `--help` lists every key with its type, default and meaning.

The run directory (`run_dir`, relative to the working directory; printed absolute; without it a new
`runs/<model.name>-<UTC time>`, printed with the `--run_dir=` that resumes it) receives the
resolved `config.json`, `metrics.jsonl` (one JSON object per logged step; its fields are listed in
docs/watching.md, the offload engine's per-step breakdown in `jaxzero.state.BREAKDOWN`), the same records as
TensorBoard event files under `tensorboard/` (`logging.tensorboard`), a profiler trace of the steps
`profile.steps` names under `profile/`, Orbax checkpoints under `checkpoints/` and, when the run
completes, `summary.json`. What happens to a directory that already exists is `jaxzero.storage.run_dir`'s
rule: a run with checkpoints resumes from the newest good one (only `steps`, `logging.*`,
`checkpoint.*`, `offload.*`, `parallel.*`, `machine.*`, `profile.*`, `optimizer.decay_steps` and
`data.check_tokens` may change; a refusal names the preset that set a key), a run that stopped
before its first checkpoint starts over, and anything else is refused. One trainer runs in a
directory at a time: it holds `trainer.lock` there (a POSIX lock, which NFS honours across hosts,
released by the kernel however the process ends), and a second is refused at once naming the holder's
host, pid and start time.

SIGTERM, SIGHUP (a closed terminal, a dropped SSH session: the console then goes to /dev/null), or a first
Ctrl-C, saves a checkpoint at the next step boundary and exits with status 3 (130 for Ctrl-C; with several
processes, joined through `jax.distributed`, every process stops at the same step). A second Ctrl-C stops at
once. Exit status 1: training failed (a non-finite loss, a checkpoint that cannot be written); 2: the config
or the input is wrong, or the run directory is in use by another trainer or cannot be written. Every error is
one line on stderr, and a failed run ends within seconds of it (`leave_within`), whatever threads a failed
save leaves behind.

Several processes (`python -m jaxzero.launch`, SLURM's srun, mpirun, or JAX's variables: see
`jaxzero.run.distributed`) join before anything else and train one model on one global batch, each reading
its rows of it. Process 0 writes `config.json`, `metrics.jsonl` and `summary.json` and prints the
progress; every process writes its part of the checkpoints and prints its own errors.

This module is the program: arguments, signals (`jaxzero.run.stopping`), error hooks, exit statuses
(`jaxzero.run.outcome`). The training itself is `jaxzero.run.loop.train`, which reads top to bottom: config ->
run directory (held, then inspected) -> trainer -> data -> state (init or restore) -> for each step:
step, log (`jaxzero.run.metrics.LogWindow`), save, stop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import io
import logging
import os
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, TextIO

import jax

from jaxzero.config import ConfigError, TrainConfig
from jaxzero.config.checks import validate
from jaxzero.overrides import Layered, help_text, layer, split_args
from jaxzero.planner import preflight
from jaxzero.primitives.coordination import agree
from jaxzero.run import distributed
from jaxzero.run.console import HangupSafe, to_stderr
from jaxzero.run.loop import train
from jaxzero.run.metrics import require_tensorboard
from jaxzero.run.outcome import (
    EXIT_CONFIG,
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    EXIT_TRAINING,
    Preempted,
    TrainingError,
)
from jaxzero.run.stopping import install_hangup_as_sigterm, install_stop_handlers
from jaxzero.storage import run_dir as run_dir_lib
from jaxzero.storage.checkpoint_disk import CheckpointWriteError
from jaxzero.storage.run_dir import RunKind

# -- errors of background threads ---------------------------------------------------------------------


class BackgroundErrorLog:
    """While installed, errors that background threads and callbacks report on their own (Orbax's
    writer threads and TensorStore's callbacks after a failed save, which `Checkpointer` reports as
    one line) go to `<run_dir>/error.log` instead of flooding stderr, and so do the warnings about the
    coroutines a failed save never ran (Orbax's per-item saves). Process-wide hooks: the program
    installs them, never the library."""

    LOGGERS = ("absl", "asyncio", "orbax")

    def __init__(self, run_dir: Path):
        self.path = run_dir / run_dir_lib.ERROR_FILE
        self.saved: dict[str, Any] = {}
        # Reports the log could not take (no run directory yet, no room): how many, the first, and why.
        self.lost, self.lost_first, self.lost_why = 0, "", ""

    def write(self, text: str) -> None:
        try:
            run_dir_lib.write_error(self.path.parent, text)
        except OSError as e:  # kept, and summed up on stderr once (`uninstall`): a full disk makes dozens
            self.lost += 1
            self.lost_first, self.lost_why = self.lost_first or text, self.lost_why or str(e)

    def install(self) -> None:
        handler = _LogToFile(self)
        self.saved = {
            "excepthook": threading.excepthook,
            "unraisablehook": sys.unraisablehook,
            "loggers": [(logging.getLogger(n), logging.getLogger(n).propagate) for n in self.LOGGERS],
            "handler": handler,
            "showwarning": warnings.showwarning,
        }
        shown = warnings.showwarning

        def showwarning(
            message: Warning | str,
            category: type[Warning],
            filename: str,
            lineno: int,
            file: TextIO | None = None,
            line: str | None = None,
        ) -> None:
            if issubclass(category, RuntimeWarning) and "was never awaited" in str(message):
                self.write(warnings.formatwarning(message, category, filename, lineno, line))
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = showwarning
        threading.excepthook = lambda a: self.write(
            f"in thread {a.thread.name if a.thread else '?'}:\n"
            + "".join(traceback.format_exception(a.exc_type, a.exc_value, a.exc_traceback))
        )
        sys.unraisablehook = lambda u: self.write(
            f"{u.err_msg or 'exception ignored'} in {u.object!r}:\n"
            + "".join(traceback.format_exception(u.exc_type, u.exc_value, u.exc_traceback))
        )
        for logger, _ in self.saved["loggers"]:
            logger.addHandler(handler)
            logger.propagate = False  # not also to the root logger's stderr handler

    def uninstall(self) -> None:
        if not self.saved:
            return
        # What a failed save left unreferenced (its coroutines, its exceptions' frames) is finalised
        # now, while its warnings still go to the log, not at the interpreter's exit onto stderr.
        gc.collect()
        warnings.showwarning = self.saved["showwarning"]
        threading.excepthook = self.saved["excepthook"]
        sys.unraisablehook = self.saved["unraisablehook"]
        for logger, propagate in self.saved["loggers"]:
            logger.removeHandler(self.saved["handler"])
            logger.propagate = propagate
        self.saved = {}
        if self.lost:
            last = self.lost_first.rstrip().splitlines()[-1]
            print(
                f"jaxzero: {self.lost} error report(s) of background threads could not be written to "
                f"{self.path} ({self.lost_why}); the first: {last}",
                file=sys.__stderr__,
            )
            self.lost, self.lost_first, self.lost_why = 0, "", ""


class _LogToFile(logging.Handler):
    """Records of ERROR and above to the run's error log; lower ones dropped (they went nowhere visible
    before: the root logger shows WARNING and above, and these are the libraries' own chatter)."""

    def __init__(self, log: BackgroundErrorLog):
        super().__init__(level=logging.ERROR)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        self.log.write(self.format(record))


def configure(argv: list[str]) -> Layered:
    """The config `argv` asks for, and how its DeepSpeed config was read. For a run directory holding
    a checkpointed run, the preset's, the DeepSpeed file's and the command line's keys apply on top of
    the run's saved config (`train` then refuses any that would make it a different run); otherwise
    on top of the defaults."""
    args = split_args(argv)
    requested_dir = args.cli.get("run_dir", args.preset.get("run_dir", ""))
    base = TrainConfig()
    if requested_dir:
        run = run_dir_lib.inspect_run_dir(run_dir_lib.locate(requested_dir, ""))
        if run.kind is RunKind.RESUME:
            base = run.saved
    layered = layer(base, args)
    cfg = layered.config
    validate(cfg)
    if cfg.logging.tensorboard:
        require_tensorboard()
    cfg = dataclasses.replace(cfg, run_dir=str(run_dir_lib.locate(cfg.run_dir, cfg.model.name)))
    return dataclasses.replace(layered, config=cfg)


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxzero.train`: train as `argv` (default: the command line) says; returns the exit
    status. Without `argv` the process is the program's own, and after a failure it ends within
    `EXIT_GRACE_S` seconds whatever threads are left (`leave_within`); a caller's argv never ends it."""
    program = argv is None
    if program:  # the process is the program's: a terminal closing under it (SIGHUP) fails no write
        sys.stdout, sys.stderr = HangupSafe(sys.stdout), HangupSafe(sys.stderr)
    to_stderr()  # the library's messages as `jaxzero: ...` lines
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__ + help_text())
        return 0
    # Random init of a large model compiles far faster with the threefry kernel (identical values: XLA
    # otherwise unrolls every draw); process-wide, so it is set here by the program, not by the library.
    jax.config.update("jax_threefry_gpu_kernel_lowering", True)
    processes, restore_handlers, cfg, background, code = None, None, None, None, 0
    try:
        layered = configure(argv)
        cfg = layered.config
        # Several processes join before any backend starts; one process starts nothing.
        processes = distributed.start(cfg.parallel.timeout_s)
        if layered.deepspeed is not None and (processes is None or processes.index == 0):
            print(layered.deepspeed.report())
        if processes is not None:  # the default run_dir is named after each process's start time
            run_dir = agree("run_dir", cfg.run_dir, cfg.parallel.timeout_s)
            cfg = dataclasses.replace(cfg, run_dir=run_dir)
        background = BackgroundErrorLog(Path(cfg.run_dir))
        background.install()
        if not jax.distributed.is_initialized():  # one process: SIGTERM and Ctrl-C set a flag per step
            restore_handlers = install_stop_handlers()
        else:  # several: JAX's preemption sync point takes SIGTERM; SIGHUP becomes SIGTERM
            restore_handlers = install_hangup_as_sigterm()
        # Process 0 prints the run's progress and metrics; every process prints its errors (stderr).
        console = sys.stdout if processes is None or processes.index == 0 else _Discard()
        # The resolution pass decides the placement, and sizes XLA's pools for it, before JAX starts
        # (`jaxzero.planner.preflight`); `configure` validated the config already.
        decide = functools.partial(preflight.decide_before_jax, processes=processes, validated=True)
        train(cfg, console, layered.deepspeed, layered.sources, prepare=decide)
    except ConfigError as e:
        code = _fail("config error", e, EXIT_CONFIG)
    except TrainingError as e:
        code = _fail("training stopped", e, EXIT_TRAINING)
    except CheckpointWriteError as e:
        log = Path(cfg.run_dir) / run_dir_lib.ERROR_FILE if cfg is not None and cfg.run_dir else None
        if log is not None and log.parent.is_dir():  # the cause's traceback, beside the writers' own
            with contextlib.suppress(OSError):
                run_dir_lib.write_error(log.parent, "".join(traceback.format_exception(e)))
        details = f" (the writers' own errors: {log})" if log is not None and log.exists() else ""
        code = _fail("checkpoint error", f"{e}{details}", EXIT_TRAINING)
    except Preempted as e:
        code = _fail("preempted" if e.exit_code == EXIT_PREEMPTED else "interrupted", e, e.exit_code)
    except KeyboardInterrupt:  # Ctrl-C without jaxzero's handlers (several processes)
        code = _fail("interrupted", "stopped at once (Ctrl-C)", EXIT_INTERRUPTED)
    except Exception as e:  # noqa: BLE001 - the environment (memory, devices, files): one line, no trace
        code = _fail("error", _environment_error(e, cfg, processes), EXIT_TRAINING)
    finally:  # after the outcome is printed
        if background is not None:
            background.uninstall()
        if restore_handlers is not None:
            restore_handlers()
    if processes is not None:  # stops together (done, preempted, Ctrl-C) leave together; a failure at once
        together = code in (0, EXIT_PREEMPTED, EXIT_INTERRUPTED)
        # Only GPU clients watch the other tasks and report the coordination service's end on stderr.
        # Asked only after a run that got that far (its backend started), never starting one to ask.
        gpu = together and cfg is not None and cfg.run_dir and jax.default_backend() == "gpu"
        log = Path(cfg.run_dir) / run_dir_lib.ERROR_FILE if gpu else None
        distributed.stop(None if together else code, chatter=log)
    if program and code != 0:  # the outcome is printed and the run's files closed
        leave_within(code)
    return code


class _Discard(io.TextIOBase):
    """A console that prints nothing: the progress of processes other than 0."""

    def write(self, text: str) -> int:
        return len(text)


def _fail(what: str, error: BaseException | str, code: int) -> int:
    print(f"jaxzero: {what}: {error}", file=sys.stderr)
    return code


def _environment_error(
    error: Exception, cfg: TrainConfig | None, processes: distributed.Processes | None = None
) -> str:
    """One line for an error that input or the environment can cause (out of memory, a file that
    cannot be written, a device error); its traceback goes to `error.log` in the run directory (with
    several processes, appended there under the process's id)."""
    text = (str(error).strip().splitlines() or [""])[0][:400]
    hint = ""
    if "RESOURCE_EXHAUSTED" in str(error) or "Out of memory" in str(error) or isinstance(error, MemoryError):
        hint = (
            " The accelerator or host ran out of memory: lower data.batch_size or data.seq_len, raise "
            "data.grad_accum, or offload (offload.optimizer=cpu, offload.params=cpu)."
        )
    trace = "".join(traceback.format_exception(error))
    where = " (set JAXZERO_TRACEBACK=1 for the traceback)"
    run_dir = Path(cfg.run_dir) if cfg is not None and cfg.run_dir else None
    if os.environ.get("JAXZERO_TRACEBACK"):
        print(trace, file=sys.stderr)
        where = ""
    elif run_dir is not None and run_dir.is_dir():
        try:
            if processes is None:
                run_dir_lib.write_error(run_dir, trace, replace=True)
            else:  # one file for every process: each appends its own
                run_dir_lib.write_error(run_dir, f"process {processes.index} of {processes.count}:\n{trace}")
            where = f" (traceback in {run_dir / run_dir_lib.ERROR_FILE})"
        except OSError:
            pass
    return f"{type(error).__name__}: {text}{where}.{hint}"


# After a failure the interpreter's exit still joins every non-daemon thread, and one a library left
# waiting on work the failure cut short (Orbax's commit threads wait up to its 300 s coordination
# timeout for signals a failed save never sends) would hold the process long after its error line.
EXIT_GRACE_S = 5.0


def leave_within(code: int, grace_s: float = EXIT_GRACE_S) -> None:
    """Make sure the process ends with `code` at most `grace_s` seconds from now: if the interpreter's
    ordinary exit (threads joined, exit hooks run) takes longer, a watchdog ends it with `code`, output
    flushed (`os._exit`). The program's exit after a failure only, once the outcome is printed and the
    run's files are closed: a library never ends its caller's process."""

    def watchdog() -> None:
        time.sleep(grace_s)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    threading.Thread(target=watchdog, name="jaxzero-exit-watchdog", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
