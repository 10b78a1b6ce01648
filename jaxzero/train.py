"""`python -m jaxzero.train [--config=PATH] [--deepspeed=PATH] [--section.key=value ...]`: train a
model. `--deepspeed` reads a DeepSpeed config file (`jaxzero.deepspeed`).

With no arguments it trains the tiny Llama on the built-in byte-level corpus on whatever JAX backend is
present. `--help` lists every key with its type, default and meaning.

The run directory (`run_dir`, relative to the working directory; printed absolute; without it a new
`runs/<model.name>-<UTC time>`, printed with the `--run_dir=` that resumes it) receives the
resolved `config.json`, `metrics.jsonl` (one JSON object per logged step; its fields are listed in the
README, the offload engine's per-step breakdown in `jaxzero.state.BREAKDOWN`), the same records as
TensorBoard event files under `tensorboard/` (`logging.tensorboard`), a profiler trace of the steps
`profile.steps` names under `profile/`, Orbax checkpoints under `checkpoints/` and, when the run
completes, `summary.json`. What happens to a directory that already exists is `jaxzero.run_dir`'s
rule: a run with checkpoints resumes from the newest good one (only `steps`, `logging.*`,
`checkpoint.*`, `offload.*`, `parallel.*`, `machine.*`, `profile.*`, `optimizer.decay_steps` and
`data.check_tokens` may change; a refusal names the preset that set a key), a run that stopped
before its first checkpoint starts over, and anything else is refused. One trainer runs in a
directory at a time: it holds `trainer.lock` there (a POSIX lock, which NFS honours across hosts,
released by the kernel however the process ends), and a second is refused at once naming the holder's
host, pid and start time.

SIGTERM, or a first Ctrl-C, saves a checkpoint at the next step boundary and exits with status 3 (130
for Ctrl-C; with several processes, joined through `jax.distributed`, every process stops at the same
step). A second Ctrl-C stops at once. Exit status 1: training failed (a non-finite loss, a checkpoint
that cannot be written); 2: the config or the input is wrong, or the run directory is in use by another
trainer or cannot be written. Every error is one line on stderr, and a failed run ends within seconds
of it (`leave_within`), whatever threads a failed save leaves behind.

Several processes (`python -m jaxzero.launch`, SLURM's srun, mpirun, or JAX's variables: see
`jaxzero.distributed`) join before anything else and train one model on one global batch, each reading
its rows of it. Process 0 writes `config.json`, `metrics.jsonl` and `summary.json` and prints the
progress; every process writes its part of the checkpoints and prints its own errors.

The loop reads top to bottom: config -> run directory (held, then inspected) -> trainer -> data ->
state (init or restore) -> for each step: step, log (every `logging.log_every` steps), save, stop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxzero import deepspeed, distributed, objective
from jaxzero import run_dir as run_dir_lib
from jaxzero.checkpoint import (
    CHECKPOINT_DIR,
    Checkpointer,
    CheckpointWriteError,
    ensure_disk_room,
    largest_array_bytes,
    load_masters,
    make_meta,
    saved_steps,
    state_bytes,
    trim_host_heap,
)
from jaxzero.config import ConfigError, TrainConfig, resolve_batch, validate
from jaxzero.data import BatchIterator, Data, DataShard, DataState, build_data
from jaxzero.decode import Generator, Sampling
from jaxzero.interop import load_hf_by_unit
from jaxzero.metrics import (
    MetricsLog,
    ProgressBar,
    TensorBoardLog,
    Throughput,
    accelerator_peak_gib,
    host_rss_gib,
    peak_tflops,
)
from jaxzero.models.sizes import flops_per_token, param_count
from jaxzero.optim import warmup_warning
from jaxzero.overrides import Layered, help_text, layer, split_args
from jaxzero.profiling import StepTrace
from jaxzero.run_dir import CONFIG_FILE, METRICS_FILE, PROFILE_DIR, SUMMARY_FILE, TENSORBOARD_DIR, RunKind
from jaxzero.state import BREAKDOWN, StepMetrics, Trainer
from jaxzero.tokenizer import codec_for
from jaxzero.trainer import decide_and_build

EXIT_TRAINING, EXIT_CONFIG, EXIT_PREEMPTED, EXIT_INTERRUPTED = 1, 2, 3, 130


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. a non-finite loss); the message says why and what to try."""


class Preempted(RuntimeError):
    """SIGTERM or Ctrl-C arrived and the run stopped at a step boundary; `exit_code` is the status."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


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

    def write(self, text: str) -> None:
        try:
            with open(self.path, "a") as f:
                f.write(text.rstrip() + "\n")
        except OSError:  # no run directory yet, or no room: stderr after all
            print(text, file=sys.__stderr__)

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


class _LogToFile(logging.Handler):
    """Records of ERROR and above to the run's error log; lower ones dropped (they went nowhere visible
    before: the root logger shows WARNING and above, and these are the libraries' own chatter)."""

    def __init__(self, log: BackgroundErrorLog):
        super().__init__(level=logging.ERROR)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        self.log.write(self.format(record))


# -- stopping at a step boundary -------------------------------------------------------------------


class _StopRequest:
    """SIGTERM or a first Ctrl-C, set by the handlers `install_stop_handlers` installs and read at the
    next step boundary. A second Ctrl-C exits at once."""

    reason: str | None = None

    def on_sigterm(self, signum: int, frame: Any) -> None:
        self.reason = self.reason or "SIGTERM"

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
    """Catch SIGTERM and Ctrl-C for a one-process run; returns the function that puts the previous
    handlers back."""
    _STOP.reason = None
    previous = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, _STOP.on_sigterm),
        signal.SIGINT: signal.signal(signal.SIGINT, _STOP.on_sigint),
    }

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    return restore


def stop_requested(step: int) -> str | None:
    """Why this run should stop after `step` ("SIGTERM", "Ctrl-C"), or None. With several processes
    (jax.distributed running) JAX's preemption sync point answers, so that every process stops at the
    same step; one process reads its own handlers' flag (without handlers, never)."""
    if jax.distributed.is_initialized():
        return "SIGTERM" if multihost_utils.reached_preemption_sync_point(step) else None
    return _STOP.reason


def checkpoint_due(cfg: TrainConfig, step: int) -> bool:
    """Whether `step` saves a checkpoint: the last step, and every `checkpoint.every` steps."""
    every = cfg.checkpoint.every
    return step == cfg.steps or bool(every and step % every == 0)


# -- start, log, finish -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Start:
    """Where the loop starts: the state (in its final placement), the first step to run, the batches,
    and the checkpoint step restored (None for a fresh start)."""

    state: Any
    first: int
    batches: BatchIterator
    restored_step: int | None


def start(
    cfg: TrainConfig,
    trainer: Trainer,
    data: Data,
    ckpt: Checkpointer | None,
    console: TextIO,
    main_process: bool = True,
) -> Start:
    """Restore from `ckpt`'s newest good checkpoint when resuming (`ckpt` given), else initialise from
    the Hugging Face checkpoint `model.init_from` or from `seed`. The main process (process 0) drops
    the metrics records past the restored step."""
    restored = None
    if ckpt is not None:
        check_meta = lambda meta: DataState.from_dict(meta["data_state"])  # noqa: E731 - its loader state
        restored = ckpt.restore_latest(trainer.abstract_saved_state(), trainer.layout, cfg, check_meta)
    if restored is not None:
        state = trainer.from_saved_state(restored.state)
        trim_host_heap()  # the restore's read buffers, freed, go back to the kernel
        batches = data.train_iter(DataState.from_dict(restored.meta["data_state"]))
        if main_process:
            run_dir_lib.truncate_metrics(Path(cfg.run_dir) / METRICS_FILE, restored.step)
        print(f"jaxzero: resumed from {ckpt.directory / str(restored.step)}", file=console)
        return Start(state, restored.step + 1, batches, restored.step)
    if cfg.model.init_from:
        # each unit read from the files as it is placed: host RAM holds one at a time
        state = trainer.init_from_params(load_hf_by_unit(cfg.model, cfg.model.init_from))
        print(f"jaxzero: initialised from the Hugging Face checkpoint {cfg.model.init_from}", file=console)
        return Start(state, 1, data.train_iter(), None)
    return Start(trainer.init(jax.random.key(cfg.seed)), 1, data.train_iter(), None)


def nonfinite_cause(
    cfg: TrainConfig, step: int, values: StepMetrics, start: Start, grad_norms: list[float]
) -> str:
    """What most likely made the loss of `step` non-finite, from the facts at hand, and what to do.

    The loss of step k is computed with the weights after k - 1 updates, so the first step a process
    runs has seen no update of its own: its weights come from the init or the restored checkpoint."""
    lr, norm = float(values.lr), float(values.grad_norm)
    if step == start.first and start.restored_step is not None:
        return (
            f"it is the first step after restoring checkpoint {start.restored_step}, before any update: "
            f"the checkpoint's state or the data at this point is bad. Resume from an earlier checkpoint "
            f"(move {cfg.run_dir}/checkpoints/{start.restored_step} aside) or start a new --run_dir."
        )
    if step == start.first:
        data = (
            " (data.check_tokens=false: only a sample of the token ids was checked against "
            "model.vocab_size; the full check may find the bad id)"
            if cfg.data.source == "tokens" and not cfg.data.check_tokens
            else ""
        )
        return (
            f"no update had changed the freshly initialised weights yet, so the learning rate is not the "
            f"cause: look at the data{data} and the model's numerics (model.compute_dtype="
            f"{cfg.model.compute_dtype}; float32 rules out overflow)."
        )
    growth = f"; recent gradient norms {', '.join(f'{g:.3g}' for g in grad_norms[-3:])}" if grad_norms else ""
    float32 = "" if cfg.model.compute_dtype == "float32" else ", or model.compute_dtype=float32"
    return (
        f"the loss diverged after {step - 1} updates at lr {lr:.3g} (gradient norm {norm:.4g}{growth}). "
        f"Try a lower optimizer.lr (now {cfg.optimizer.lr}), more optimizer.warmup_steps (now "
        f"{cfg.optimizer.warmup_steps}), clipping (optimizer.grad_clip, now {cfg.optimizer.grad_clip})"
        f"{float32}."
    )


class LogWindow:
    """The steps since the last log line. Their metrics stay on the device until a line is due (the
    first step, every `logging.log_every` steps, validation steps and the last step); then one host
    sync reads them all and one record goes to `metrics.jsonl`, the console and (`logging.tensorboard`)
    TensorBoard's event files."""

    def __init__(
        self,
        cfg: TrainConfig,
        trainer: Trainer,
        start: Start,
        val_batches: list[np.ndarray],
        console: TextIO,
        bar: ProgressBar,
        t_start: float,
        main_process: bool = True,
    ):
        self.cfg, self.trainer, self.start, self.val_batches = cfg, trainer, start, val_batches
        self.first = start.first
        self.bar = bar  # cleared before each record, so the line is not printed over it
        self.t_start = t_start  # before init or restore: the first record's compile_s counts from here
        device = trainer.mesh.devices.flat[0].platform.upper()  # the breakdown names the real device
        # Every process reads the metrics (and validates: collectives); the main process writes them.
        self.path = Path(cfg.run_dir) / METRICS_FILE
        events = None
        if main_process and cfg.logging.tensorboard:  # from the first step this run logs (a resume's)
            events = TensorBoardLog(Path(cfg.run_dir) / TENSORBOARD_DIR, first_step=start.first)
        self.file = MetricsLog(
            self.path if main_process else Path(os.devnull), console, device=device, tensorboard=events
        )
        self.last: dict[str, Any] = {}  # the newest record
        self.grad_norms: list[float] = []  # finite gradient norms of the steps read so far (the last few)
        self.throughput = Throughput(
            cfg.data.batch_size * cfg.data.seq_len,
            flops_per_token(cfg.model, cfg.data.seq_len),
            _job_peak(peak_tflops(trainer.mesh.devices.flat[0], cfg.logging.peak_tflops), trainer.mesh.size),
        )
        self.pending: list[tuple[int, StepMetrics]] = []
        self.counted: list[jax.Array] = []  # per pending step: targets its loss counted (device scalars)
        self.t_window = time.perf_counter()  # start of the steps the next record covers
        self.skipped_steps = 0  # float16: steps whose update was skipped for overflow, in this process

    def add(self, step: int, metrics: StepMetrics, counted: jax.Array) -> None:
        self.pending.append((step, metrics))
        self.counted.append(counted)
        self.throughput.add_step()

    def _is_eval(self, step: int) -> bool:
        every = self.cfg.logging.eval_every
        return step == self.cfg.steps or (every > 0 and step % every == 0)

    def due(self, step: int) -> bool:
        return step == self.first or step % self.cfg.logging.log_every == 0 or self._is_eval(step)

    def write(self, step: int, state: Any) -> None:
        """Read the window's metrics (a host sync), validate if due, and write the record. Raises
        TrainingError for a non-finite loss, or float16 overflowing at the minimum loss scale."""
        values, counted = jax.device_get(
            ([m for _, m in self.pending], self.counted)
        )  # host sync: scalars only
        later = step > self.first
        rates = self.throughput.read() if later else {"tokens_per_s": None, "tflops": None, "mfu": None}
        last = values[-1]
        record = {
            "step": step,
            # null for a step whose every target is masked: its mean over no targets is no loss
            "loss": float(last.loss) if int(counted[-1]) else None,
            "lr": float(last.lr),
            "grad_norm": float(last.grad_norm),
            # the last step's targets counted in its loss, and those marked not-a-target (prompts)
            "loss_tokens": int(counted[-1]),
            "masked_tokens": self.cfg.data.batch_size * self.cfg.data.seq_len - int(counted[-1]),
            **rates,
            "gpu_peak_gib": accelerator_peak_gib(list(self.trainer.mesh.local_devices)),  # this process's
            "host_rss_gib": host_rss_gib(),
            # seconds during which an update waited for a checkpoint being written from its arrays
            "checkpoint_wait_s": self.trainer.fence.take_blocked_seconds(),
        }
        if step == self.first:
            record["compile_s"] = time.perf_counter() - self.t_start  # init or restore, compile, first step
        now = time.perf_counter()
        if self.trainer.timings is not None:  # offload: where the steps' time went
            breakdown = self.trainer.timings(now - self.t_window, len(self.pending))
            if later:
                record["step_s"] = (now - self.t_window) / len(self.pending)
                record.update({k.key: breakdown[k.key] for k in BREAKDOWN})
        self.t_window = now
        if jax.process_count() > 1:
            self._across_processes(record)
        if last.loss_scale is not None:  # float16: overflowing steps are skipped, not failures
            self._float16(record, values)
        bad = [(s, v) for (s, _), v in zip(self.pending, values) if not math.isfinite(float(v.loss))]
        if self._is_eval(step) and not bad and len(self.val_batches):  # none: data.val_fraction=0
            record["val_loss"] = self.trainer.evaluate(state, self.val_batches)  # a host sync
        self.bar.clear()
        self.file.write(record)
        self.last = record
        if bad:  # the last good checkpoint stays; nothing non-finite is saved
            s, v = bad[0]
            norms = self.grad_norms + [float(w.grad_norm) for (t, _), w in zip(self.pending, values) if t < s]
            raise TrainingError(
                f"loss became {float(v.loss)} at step {s} (metrics so far in {self.path}, the last "
                "good checkpoint kept). Likely cause: "
                + nonfinite_cause(self.cfg, s, v, self.start, [g for g in norms if math.isfinite(g)])
            )
        self.grad_norms = (self.grad_norms + [float(v.grad_norm) for v in values])[-8:]
        self.pending.clear()
        self.counted.clear()
        self.throughput.restart()

    def _across_processes(self, record: dict[str, Any]) -> None:
        """Every process's figures into `record` (`per_process`: a list per key, by process index), and
        the step time and breakdown of the slowest process as the record's own (`slowest_process`).
        A collective (every process writes at the same steps) and a host sync."""
        keys = [
            k for k in ("step_s", *(b.key for b in BREAKDOWN), "host_rss_gib", "gpu_peak_gib") if k in record
        ]
        mine = np.array([np.nan if record[k] is None else record[k] for k in keys], np.float64)
        every = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), len(keys))
        record["per_process"] = {
            k: [None if math.isnan(v) else float(v) for v in every[:, j]] for j, k in enumerate(keys)
        }
        if "step_s" in keys:
            slowest = int(np.nanargmax(every[:, keys.index("step_s")]))
            record["slowest_process"] = slowest
            for j, k in enumerate(keys):
                if k not in ("host_rss_gib", "gpu_peak_gib"):
                    record[k] = float(every[slowest, j])

    def _float16(self, record: dict[str, Any], values: list[StepMetrics]) -> None:
        """Count the window's skipped steps into `record`; stop (as DeepSpeed does) if one overflowed
        with the loss scale already at its minimum."""
        min_scale = self.cfg.fp16.min_loss_scale
        self.skipped_steps += sum(bool(v.skipped) for v in values)
        record.update(loss_scale=float(values[-1].loss_scale), skipped_steps=self.skipped_steps)
        at_min = [
            s
            for (s, _), v in zip(self.pending, values)
            if bool(v.skipped) and float(v.loss_scale) <= min_scale
        ]
        if at_min:
            self.file.write(record)
            raise TrainingError(
                f"float16 gradients overflowed at step {at_min[0]} with the loss scale already at "
                f"fp16.min_loss_scale={min_scale} (DeepSpeed stops here too). Try "
                "model.compute_dtype=bfloat16, a lower optimizer.lr, or a lower fp16.min_loss_scale."
            )

    def close(self) -> None:
        self.file.close()


def train(
    cfg: TrainConfig,
    console: TextIO = sys.stdout,
    translation: deepspeed.Translation | None = None,
    sources: Mapping[str, str] | None = None,
) -> Path:
    """Run training as configured; returns the (absolute) run directory. Raises ConfigError (also for
    a run directory another trainer holds), TrainingError, CheckpointWriteError or Preempted.
    `translation`: the DeepSpeed file `cfg` was built with, whose batch keys are then refused in its
    own words for the devices found. `sources`: where each setting came from (`Layered.sources`): a
    refused resume names the preset that set a key, and a run_dir no argument named (the time-stamped
    default) is printed with the `--run_dir=` that resumes it.

    One trainer runs in a run directory at a time: it holds the directory's lock (`jaxzero.run_lock`)
    from before it decides what the directory is until it returns or raises. Nothing else is written
    until the config is validated, the run directory inspected, the data checked, the memory planned
    and the state initialised or restored; `config.json` is then written atomically."""
    path = run_dir_lib.locate(cfg.run_dir, cfg.model.name)
    defaulted = not cfg.run_dir or (sources is not None and "run_dir" not in sources)
    with run_dir_lib.hold(path, owner=distributed.index() == 0):  # released on every way out
        return _train_held(cfg, path, console, translation, sources or {}, defaulted)


def _train_held(
    cfg: TrainConfig,
    path: Path,
    console: TextIO,
    translation: deepspeed.Translation | None,
    sources: Mapping[str, str],
    defaulted: bool,
) -> Path:
    """`train` in the run directory `path`, which this trainer holds."""
    run = run_dir_lib.inspect_run_dir(path)  # what it is now that no other trainer can change it
    if defaulted:  # rerunning the same command would start another run: say how to come back to this one
        print(
            f"jaxzero: run_dir {run_dir_lib.shown(path)} ({_KINDS[run.kind]}); to resume it: add "
            f"--run_dir={run_dir_lib.shown(path)}",
            file=console,
        )
    notes = []
    cfg = run_dir_lib.resolve_paths(cfg)
    if run.kind is RunKind.RESUME:
        resumed = run_dir_lib.check_resume(cfg, run.saved, path, sources)  # the guard, whatever set the keys
        if resumed.optimizer.decay_steps != cfg.optimizer.decay_steps:
            notes.append(
                f"jaxzero: steps {run.saved.steps} -> {cfg.steps}: the learning-rate schedule keeps the "
                f"{resumed.optimizer.decay_steps} steps it started with and holds lr x min_lr_ratio after "
                "them; pass --optimizer.decay_steps=N to give it N steps instead."
            )
        elif resumed.schedule_steps != run.saved.schedule_steps:
            notes.append(
                f"jaxzero: the learning-rate schedule changes length from {run.saved.schedule_steps} to "
                f"{resumed.schedule_steps} steps (optimizer.decay_steps): the learning rate of the next "
                "steps follows the new schedule, not the old one."
            )
        cfg = resumed
    cfg = dataclasses.replace(cfg, run_dir=str(path))
    validate(cfg)
    short_warmup = warmup_warning(cfg.optimizer, cfg.steps, cfg.schedule_steps)
    if short_warmup:
        notes.append(f"jaxzero: warning: {short_warmup}")
    # Checks the mesh and memory, and decides the offload keys left on auto; allocates and compiles
    # nothing. `cfg` stays as the user wrote it (config.json keeps "auto"); `trainer.config` is decided.
    try:
        trainer, decision = decide_and_build(cfg)
    except ConfigError:
        if translation is not None:  # the DeepSpeed file's batch keys for these GPUs, in its words
            deepspeed.check(translation, cfg, jax.device_count())
        raise
    cfg = resolve_batch(cfg, jax.device_count())  # DeepSpeed's batch rule, now that the devices are known
    if run.kind is RunKind.RESUME:
        run_dir_lib.check_resume(cfg, run.saved, path, sources)  # the batch sizes, resolved
    # Every process has looked at the run directory before process 0 writes anything into it.
    distributed.barrier("run directory inspected", cfg.parallel.timeout_s)
    main_process = jax.process_index() == 0  # writes the run's files; every process checkpoints
    # This process's rows of every global batch: the rows its devices hold of the data axis.
    shard = DataShard(jax.process_index(), jax.process_count())
    data = build_data(cfg.data, cfg.model.vocab_size, cfg.seed, shard)  # checks files before allocating
    what = {
        RunKind.NEW: "a new run",
        RunKind.RESUME: "resuming",
        RunKind.RESTART: "starting over (the run there stopped before its first checkpoint)",
    }[run.kind]
    print(
        f"jaxzero: {cfg.model.name} ({param_count(cfg.model) / 1e6:.2f}M params), {data.describe()}\n"
        f"jaxzero: {trainer.strategy}; {jax.default_backend()} x{trainer.mesh.size}\n"
        f"jaxzero: run_dir {path}: {what}",
        file=console,
    )
    if decision is not None:
        full = cfg.logging.plan == "full" or not decision.obvious()
        plan = decision.table() if full else f"{decision.line()} (--logging.plan=full: the planner's table)"
        print("\n".join(f"jaxzero: {line}" for line in plan.splitlines()), file=console)
    for note in notes:
        print(note, file=console)
    abstract = trainer.abstract_saved_state()  # what a checkpoint of this run holds
    if cfg.checkpoint.enabled:  # checkpoints that cannot fit the disk are refused before any training
        first = max(saved_steps(path), default=0) + 1  # a resume saves from the newest checkpoint on
        saves = sum(checkpoint_due(cfg, step) for step in range(first, cfg.steps + 1))
        ensure_disk_room(path / CHECKPOINT_DIR, state_bytes(abstract), cfg.checkpoint, saves)
    val_batches = data.val_batches(cfg.logging.eval_batches)
    t_start = time.perf_counter()
    largest = largest_array_bytes(abstract)  # bounds a restore's reads
    resuming = run.kind is RunKind.RESUME
    ckpt = Checkpointer(path, trainer.config.checkpoint, largest_array=largest) if resuming else None
    try:
        begin = start(cfg, trainer, data, ckpt, console, main_process)
    except BaseException:
        _close_quietly(ckpt)
        raise
    if begin.first > cfg.steps:
        _close_quietly(ckpt)
        print(
            f"jaxzero: nothing to do: the run is at step {begin.first - 1} and steps={cfg.steps}; pass "
            f"--steps=N (N > {begin.first - 1}) to train further.",
            file=console,
        )
        return path
    if run.kind is RunKind.RESTART and main_process:
        kept = run_dir_lib.set_aside_attempt(path)
        print(
            f"jaxzero: the stopped attempt's config.json and metrics.jsonl are kept in {kept}", file=console
        )
    path.mkdir(parents=True, exist_ok=True)
    if main_process:
        run_dir_lib.write_atomic(path / CONFIG_FILE, cfg.to_json() + "\n")
    if ckpt is None and cfg.checkpoint.enabled:
        ckpt = Checkpointer(path, trainer.config.checkpoint, largest_array=largest)
    bar = ProgressBar(cfg.steps, cfg.logging.progress and main_process)
    log = LogWindow(cfg, trainer, begin, val_batches, console, bar, t_start, main_process)
    trace = StepTrace(cfg.profile.window(), _profile_dir(path), begin.first, console)
    state, batches = begin.state, begin.batches
    try:
        for step in range(begin.first, cfg.steps + 1):
            trace.before(step)
            batch = trainer.put_batch(next(batches))
            counted = _counted_targets(batch)  # before the step, which may donate the batch
            state, metrics = trainer.step(state, batch)
            log.add(step, metrics, counted)
            if log.due(step):
                log.write(step, state)  # raises TrainingError on a non-finite loss
            trace.after(step, state)  # at the window's last step: waits for its work (a host sync)
            if ckpt is not None:
                ckpt.check()  # a background save that failed stops the run now, not at the next save
            stop = stop_requested(step)
            if ckpt is not None and cfg.checkpoint.enabled and (stop or checkpoint_due(cfg, step)):
                saved = trainer.saved_state(state)
                meta = make_meta(step, batches.state.to_dict(), cfg, trainer.layout, saved)
                ckpt.save(step, saved, meta, trainer.fence)  # written while the next steps run
            if stop:
                bar.clear()
                raise Preempted(_stopped_message(stop, step, ckpt, cfg, defaulted), _exit_code(stop))
            bar.update(step)
        if ckpt is not None:
            ckpt.wait()  # host sync: the last save may still read the trainer's arrays and disk files
    except (TrainingError, CheckpointWriteError):
        _close_quietly(ckpt)  # the last good checkpoint is committed; nothing non-finite is saved
        raise
    except Preempted:
        if ckpt is not None:
            ckpt.close()  # host sync: the checkpoint is committed before the process exits
        raise
    finally:
        trace.stop()  # a trace still running (the step failed) is written too
        log.close()  # on every way out: metrics.jsonl and the TensorBoard events written and closed
        trainer.close()  # the disk tier's working files go; saves have read what they need
    bar.close()
    if ckpt is not None:
        ckpt.close()  # host sync: wait for the last asynchronous save
    if main_process:
        finish(cfg, log.last, ckpt, time.perf_counter() - t_start, console)
        if cfg.logging.samples and cfg.data.source == "builtin" and ckpt is not None and ckpt.last_saved:
            print_samples(cfg, console)
    return path


# Prompts of the end-of-run samples on the built-in corpus (Python's standard library).
SAMPLE_PROMPTS = ("def ", "import ", "class ", "    return ", "# ")


def print_samples(cfg: TrainConfig, console: TextIO) -> None:
    """`logging.samples` continuations of Python-source prompts by the run's last checkpoint, sampled
    at temperature 0.8 and top_p 0.95, with the command that makes more."""
    if jax.process_count() > 1:  # the checkpoint is read whole by one process
        return
    cfg_saved, params, step = load_masters(cfg.run_dir)
    codec = codec_for(cfg_saved)
    prompts = [SAMPLE_PROMPTS[i % len(SAMPLE_PROMPTS)] for i in range(cfg.logging.samples)]
    sampling = Sampling(max_new_tokens=120, temperature=0.8, top_p=0.95, seed=cfg.seed)
    gen = Generator(cfg_saved.model, params, max(map(len, prompts)) + sampling.max_new_tokens)
    print(
        f"jaxzero: samples of step {step} (temperature 0.8, top_p 0.95; more: python -m jaxzero.generate "
        f"--run_dir={cfg.run_dir} --prompt=TEXT):",
        file=console,
    )
    for k, prompt in enumerate(prompts):
        ids = gen.generate(
            codec.encode(prompt), dataclasses.replace(sampling, seed=cfg.seed + k), codec.stop_id
        )
        print(f"--- {prompt!r}\n{prompt}{codec.decode(ids)}", file=console)


# int32 scalar: the targets a (global, placed) batch's loss counts; `objective.counted_targets`.
_counted_targets = jax.jit(objective.counted_targets)


# What the run directory is, in the line that says how to resume a time-stamped default one.
_KINDS = {RunKind.NEW: "new", RunKind.RESUME: "resuming", RunKind.RESTART: "starting over"}


def _stopped_message(
    reason: str, step: int, ckpt: Checkpointer | None, cfg: TrainConfig, defaulted: bool = False
) -> str:
    """The line a stopped run ends with; for a `defaulted` (time-stamped) run_dir the argument to add,
    as the start said: rerunning the same command would start another run."""
    if ckpt is None or not cfg.checkpoint.enabled:
        return f"{reason} at step {step}; checkpoint.enabled=false, so nothing was saved."
    if defaulted:
        return (
            f"{reason}: saved a checkpoint at step {step} in {ckpt.directory}; to resume it: add "
            f"--run_dir={run_dir_lib.shown(Path(cfg.run_dir))} to the command."
        )
    return (
        f"{reason}: saved a checkpoint at step {step} in {ckpt.directory}; rerun with "
        f"--run_dir={cfg.run_dir} to resume."
    )


def _exit_code(reason: str) -> int:
    return EXIT_INTERRUPTED if reason == "Ctrl-C" else EXIT_PREEMPTED


def _close_quietly(ckpt: Checkpointer | None) -> None:
    """Close `ckpt` on the way out of a failure: a save that failed too is reported, not raised, so
    that the failure that stopped the run stays the one the user reads."""
    if ckpt is None:
        return
    try:
        ckpt.close()
    except CheckpointWriteError as e:
        print(f"jaxzero: also: {e}", file=sys.stderr)


def finish(
    cfg: TrainConfig, last: dict[str, Any], ckpt: Checkpointer | None, wall: float, console: TextIO
) -> None:
    """Print the run's summary and write it to `summary.json` (which marks the run complete)."""
    checkpoint = None
    if ckpt is not None and ckpt.last_saved is not None:
        checkpoint = str(ckpt.directory / str(ckpt.last_saved))
    summary = {
        "status": "complete",
        "steps": cfg.steps,
        "loss": last.get("loss"),
        "val_loss": last.get("val_loss"),
        "wall_s": round(wall, 3),
        "checkpoint": checkpoint,
    }
    run_dir_lib.write_atomic(Path(cfg.run_dir) / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
    losses = ", ".join(f"{k} {last[k]:.4f}" for k in ("loss", "val_loss") if last.get(k) is not None)
    print(f"jaxzero: done: step {cfg.steps} in {wall:.0f} s; {losses}", file=console)
    if checkpoint:
        print(
            f"jaxzero: checkpoint {checkpoint}\n"
            f"jaxzero: train further: python -m jaxzero.train --run_dir={cfg.run_dir} --steps=N\n"
            f"jaxzero: export: python -m jaxzero.export --run_dir={cfg.run_dir} --out=DIR",
            file=console,
        )


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
    cfg = dataclasses.replace(cfg, run_dir=str(run_dir_lib.locate(cfg.run_dir, cfg.model.name)))
    return dataclasses.replace(layered, config=cfg)


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxzero.train`: train as `argv` (default: the command line) says; returns the exit
    status. Without `argv` the process is the program's own, and after a failure it ends within
    `EXIT_GRACE_S` seconds whatever threads are left (`leave_within`); a caller's argv never ends it."""
    program = argv is None
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__ + help_text())
        return 0
    # Random init of a large model compiles in seconds instead of minutes with the threefry kernel
    # (identical values); process-wide, so it is set here by the program, not by the library.
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
            run_dir = distributed.agree("run_dir", cfg.run_dir, cfg.parallel.timeout_s)
            cfg = dataclasses.replace(cfg, run_dir=run_dir)
        background = BackgroundErrorLog(Path(cfg.run_dir))
        background.install()
        if not jax.distributed.is_initialized():  # one process: SIGTERM and Ctrl-C set a flag per step
            restore_handlers = install_stop_handlers()
        # Process 0 prints the run's progress and metrics; every process prints its errors (stderr).
        console = sys.stdout if processes is None or processes.index == 0 else _Discard()
        train(cfg, console, layered.deepspeed, layered.sources)
    except ConfigError as e:
        code = _fail("config error", e, EXIT_CONFIG)
    except TrainingError as e:
        code = _fail("training stopped", e, EXIT_TRAINING)
    except CheckpointWriteError as e:
        log = Path(cfg.run_dir) / run_dir_lib.ERROR_FILE if cfg is not None and cfg.run_dir else None
        if log is not None and log.parent.is_dir():  # the cause's traceback, beside the writers' own
            with contextlib.suppress(OSError), open(log, "a") as f:
                f.write("".join(traceback.format_exception(e)) + "\n")
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
        # Only GPU clients watch the other tasks and report the coordination service's end on stderr.
        gpu = jax.default_backend() == "gpu"
        log = Path(cfg.run_dir) / run_dir_lib.ERROR_FILE if gpu and cfg is not None and cfg.run_dir else None
        distributed.stop(None if code in (0, EXIT_PREEMPTED, EXIT_INTERRUPTED) else code, chatter=log)
    if program and code != 0:  # the outcome is printed and the run's files closed
        leave_within(code)
    return code


class _Discard(io.TextIOBase):
    """A console that prints nothing: the progress of processes other than 0."""

    def write(self, text: str) -> int:
        return len(text)


def _profile_dir(run_dir: Path) -> Path:
    """Where this process's profiler traces go: `<run_dir>/profile`, with several processes a folder
    each (the trace files are named after the host, which processes of one machine share)."""
    if jax.process_count() == 1:
        return run_dir / PROFILE_DIR
    return run_dir / PROFILE_DIR / f"process-{jax.process_index()}"


def _job_peak(per_device: float | None, devices: int) -> float | None:
    """The whole job's peak TFLOP/s (MFU is the job's model FLOP/s over it), from one device's."""
    return None if per_device is None else per_device * devices


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
                run_dir_lib.write_atomic(run_dir / run_dir_lib.ERROR_FILE, trace)
            else:  # one file for every process: each appends its own
                with open(run_dir / run_dir_lib.ERROR_FILE, "a") as f:
                    f.write(f"process {processes.index} of {processes.count}:\n{trace}\n")
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
