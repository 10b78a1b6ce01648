"""The training loop: config -> run directory (held, then inspected) -> trainer -> data -> state
(init or restore) -> for each step: step, log (every `logging.log_every` steps), save, stop.

`train(cfg)` is the library's whole run, as `python -m jaxzero.train` runs it: it writes only into
`cfg.run_dir`, holds that directory's lock (`jaxzero.storage.run_lock`) while it runs, and raises the
exceptions of `jaxzero.run.outcome` (and `ConfigError`) for the program to turn into exit statuses.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TextIO

import jax
import numpy as np

from jaxzero import deepspeed
from jaxzero.config import ConfigError, TrainConfig
from jaxzero.data.build import build_data
from jaxzero.data.types import DataShard
from jaxzero.models.sizes import param_count
from jaxzero.numerics import objective
from jaxzero.numerics.optim import warmup_warning
from jaxzero.planner.memory import checkpoint_saves
from jaxzero.planner.preflight import as_written
from jaxzero.planner.report import Decision
from jaxzero.run import distributed
from jaxzero.run.finish import close_quietly, finish, nothing_to_do, stop_exit_code, stopped_message
from jaxzero.run.metrics import LogWindow, ProgressBar
from jaxzero.run.nonfinite import nonfinite_cause
from jaxzero.run.outcome import Preempted, TrainingError
from jaxzero.run.profiling import StepTrace, trace_dir
from jaxzero.run.samples import print_samples
from jaxzero.run.start import Start, start
from jaxzero.run.stopping import stop_requested
from jaxzero.state import Trainer
from jaxzero.storage import run_dir as run_dir_lib
from jaxzero.storage.checkpoint import Checkpointer
from jaxzero.storage.checkpoint_disk import CheckpointWriteError, ensure_disk_room
from jaxzero.storage.checkpoint_layout import (
    CHECKPOINT_DIR,
    largest_array_bytes,
    make_meta,
    saved_steps,
    state_bytes,
)
from jaxzero.storage.run_dir import CONFIG_FILE, RunKind
from jaxzero.trainer import decide_and_build


def checkpoint_due(cfg: TrainConfig, step: int) -> bool:
    """Whether `step` saves a checkpoint: the last step, and every `checkpoint.every` steps."""
    every = cfg.checkpoint.every
    return step == cfg.steps or bool(every and step % every == 0)


def train(
    cfg: TrainConfig,
    console: TextIO = sys.stdout,
    translation: deepspeed.Translation | None = None,
    sources: Mapping[str, str] | None = None,
    prepare: Callable[[TrainConfig], Decision] | None = None,
) -> Path:
    """Run training as configured; returns the (absolute) run directory. Raises ConfigError (also for
    a run directory another trainer holds), TrainingError, CheckpointWriteError or Preempted.
    `translation`: the DeepSpeed file `cfg` was built with, whose batch keys are then refused in its
    own words for the devices found. `sources`: where each setting came from (`Layered.sources`): a
    refused resume names the preset that set a key, and a run_dir no argument named (the time-stamped
    default) is printed with the `--run_dir=` that resumes it. `prepare`: how the program runs the
    resolution pass on the run's config (checked against its run directory) before JAX starts
    (`jaxzero.planner.preflight.decide_before_jax`); without it, the trainer runs it once on the
    running backend's devices.

    One trainer runs in a run directory at a time: it holds the directory's lock (`jaxzero.storage.run_lock`)
    from before it decides what the directory is until it returns or raises. Nothing else is written
    until the config is validated, the run directory inspected, the data checked, the memory planned
    and the state initialised or restored; `config.json` is then written atomically."""
    path = run_dir_lib.locate(cfg.run_dir, cfg.model.name)
    defaulted = not cfg.run_dir or (sources is not None and "run_dir" not in sources)
    with run_dir_lib.hold(path, owner=distributed.index() == 0):  # released on every way out
        return _train_held(cfg, path, console, translation, sources or {}, defaulted, prepare)


def _train_held(
    cfg: TrainConfig,
    path: Path,
    console: TextIO,
    translation: deepspeed.Translation | None,
    sources: Mapping[str, str],
    defaulted: bool,
    prepare: Callable[[TrainConfig], Decision] | None,
) -> Path:
    """`train` in the run directory `path`, which this trainer holds: what the directory is, the config
    checked against it, the trainer built, the data checked, the state initialised or restored; then
    the steps (`_steps`)."""
    run = run_dir_lib.inspect_run_dir(path)  # what it is now that no other trainer can change it
    if defaulted:  # rerunning the same command would start another run: say how to come back to this one
        print(
            f"jaxzero: run_dir {run_dir_lib.shown(path)} ({_KINDS[run.kind]}); to resume it: add "
            f"--run_dir={run_dir_lib.pasteable(path)}",
            file=console,
        )
    cfg, notes = run_dir_lib.config_for_run_dir(cfg, run, path, sources)
    saved = saved_steps(path) if run.kind is RunKind.RESUME else []
    if saved and saved[0] >= cfg.steps:  # whichever checkpoint restores, it is past the end: read none
        print(nothing_to_do(saved[-1], cfg.steps), file=console)
        return path
    # The resolution pass, once (before JAX starts, where the program prepares it): validation, the
    # end-of-text id, the batch for the devices, the offload keys left on auto; then the mesh and
    # memory checked; allocates and compiles nothing. `cfg` stays as the user wrote it (config.json
    # keeps "auto" and data.eot_id=-1); `trainer.config` is the decision's.
    try:
        decision = prepare(cfg) if prepare is not None else None
        trainer, decision = decide_and_build(cfg, decision=decision)
    except ConfigError:
        if translation is not None:  # the DeepSpeed file's batch keys for these GPUs, in its words
            deepspeed.check(translation, cfg, jax.device_count())
        raise
    # Evaluated with JAX, so after the placement is decided and XLA's pools sized (JAX has started now).
    short_warmup = warmup_warning(cfg.optimizer, cfg.steps, cfg.schedule_steps)
    if short_warmup:
        notes.append(f"jaxzero: warning: {short_warmup}")
    cfg = as_written(cfg, decision)  # the batch sizes the pass resolved for the devices
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
    if decision.decided or cfg.logging.plan == "full":  # an explicit placement's table on request
        full = cfg.logging.plan == "full" or not decision.obvious()
        plan = decision.table() if full else f"{decision.line()} (--logging.plan=full: the planner's table)"
        print("\n".join(f"jaxzero: {line}" for line in plan.splitlines()), file=console)
    slow_saves = decision.save_warning()
    if slow_saves:
        notes.append(f"jaxzero: {slow_saves}")
    for note in notes:
        print(note, file=console)
    abstract = trainer.abstract_saved_state()  # what a checkpoint of this run holds
    if cfg.checkpoint.enabled:  # checkpoints that cannot fit the disk are refused before any training
        first = max(saved_steps(path), default=0) + 1  # a resume saves from the newest checkpoint on
        saves = checkpoint_saves(cfg, first)  # arithmetic: a huge --steps costs nothing to count
        ensure_disk_room(path / CHECKPOINT_DIR, state_bytes(abstract), cfg.checkpoint, saves)
    val_batches = data.val_batches(cfg.logging.eval_batches)
    t_start = time.perf_counter()
    largest = largest_array_bytes(abstract)  # bounds a restore's reads
    resuming = run.kind is RunKind.RESUME
    ckpt = Checkpointer(path, trainer.config.checkpoint, largest_array=largest) if resuming else None
    try:
        begin = start(cfg, trainer, data, ckpt, console, main_process)
    except BaseException:
        close_quietly(ckpt)
        raise
    if begin.first > cfg.steps:
        close_quietly(ckpt)
        print(nothing_to_do(begin.first - 1, cfg.steps), file=console)
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
    ready = ReadyRun(
        cfg=cfg,
        trainer=trainer,
        begin=begin,
        ckpt=ckpt,
        val_batches=val_batches,
        t_start=t_start,
        main_process=main_process,
        defaulted=defaulted,
    )
    _steps(ready, console)
    # The trainer's state goes before the samples read the checkpoint's weights whole: the run's
    # peak host RAM stays the plan's (the loop's `state` went with `_steps`).
    del ready, begin
    gc.collect()
    saved_one = ckpt is not None and ckpt.last_saved is not None
    if main_process and cfg.logging.samples and cfg.data.source == "builtin" and saved_one:
        _samples(cfg, console)
    return path


def _samples(cfg: TrainConfig, console: TextIO) -> None:
    """The end-of-run samples (`print_samples`); the run is complete and saved, so their failing is
    a warning that names the command that runs the same decoder, not a failed run."""
    try:
        print_samples(cfg, console)
    except Exception as exc:
        print(
            f"jaxzero: warning: the end-of-run samples failed ({type(exc).__name__}: {exc}); the run "
            f"is complete. python -m jaxzero.generate --run_dir={run_dir_lib.pasteable(cfg.run_dir)} "
            "--prompt=TEXT runs the same decoder.",
            file=console,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReadyRun:
    """A run set up to take its steps: the config (resolved), the trainer, where it starts, its
    checkpointer (None with checkpoints off), the validation batches, and when its set-up began."""

    cfg: TrainConfig
    trainer: Trainer
    begin: Start
    ckpt: Checkpointer | None
    val_batches: list[np.ndarray]
    t_start: float
    main_process: bool
    defaulted: bool  # a time-stamped run_dir no argument named: the stop message says how to resume it


def settle_heap() -> None:
    """Exempt every Python object alive now (modules, compiled steps, the state's handles: what lives
    for the whole run) from the garbage collector's full passes. Each such pass holds the GIL while it
    walks them, which stalls every host thread (the offload engine's update threads, the step's
    dispatch), up to 0.1 s and more every few seconds (BENCHMARKS.md, "Pauses of Python's garbage
    collector"); objects made later are collected as before. The loop undoes it when the run ends."""
    gc.collect()
    gc.freeze()


def _steps(run: ReadyRun, console: TextIO) -> None:
    """The loop: for each step, step, log, save, stop; then the summary."""
    cfg, trainer, begin, ckpt, main_process = run.cfg, run.trainer, run.begin, run.ckpt, run.main_process
    path = Path(cfg.run_dir)
    bar = ProgressBar(cfg.steps, cfg.logging.progress and main_process)
    diagnose = lambda s, v, norms: nonfinite_cause(cfg, s, v, begin, norms)  # noqa: E731
    log = LogWindow(
        cfg=cfg,
        trainer=trainer,
        first=begin.first,
        diagnose=diagnose,
        val_batches=run.val_batches,
        console=console,
        bar=bar,
        t_start=run.t_start,
        main_process=main_process,
    )
    trace = StepTrace(cfg.profile.window(), trace_dir(path), begin.first, console)
    state, batches = begin.state, begin.batches
    try:
        for step in range(begin.first, cfg.steps + 1):
            trace.before(step)
            batch = trainer.put_batch(next(batches))
            counted = _counted_targets(batch)  # before the step, which may donate the batch
            state, metrics = trainer.step(state, batch)
            if step == begin.first:
                settle_heap()
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
                raise Preempted(stopped_message(stop, step, ckpt, cfg, run.defaulted), stop_exit_code(stop))
            bar.update(step)
        if ckpt is not None:
            ckpt.wait()  # host sync: the last save may still read the trainer's arrays and disk files
    except (TrainingError, CheckpointWriteError):
        close_quietly(ckpt)  # the last good checkpoint is committed; nothing non-finite is saved
        raise
    except Preempted:
        if ckpt is not None:
            ckpt.close()  # host sync: the checkpoint is committed before the process exits
        raise
    finally:
        trace.stop()  # a trace still running (the step failed) is written too
        log.close()  # on every way out: metrics.jsonl and the TensorBoard events written and closed
        trainer.close()  # the disk tier's working files go; saves have read what they need
        gc.unfreeze()  # what `settle_heap` exempted is collected again (a notebook's next run)
    bar.close()
    if ckpt is not None:
        ckpt.close()  # host sync: wait for the last asynchronous save
    if main_process:
        finish(cfg, log.last, ckpt, time.perf_counter() - run.t_start, console, truncated=batches.truncated)


# int32 scalar: the targets a (global, placed) batch's loss counts; `objective.counted_targets`.
_counted_targets = jax.jit(objective.counted_targets)


# What the run directory is, in the line that says how to resume a time-stamped default one.
_KINDS = {RunKind.NEW: "new", RunKind.RESUME: "resuming", RunKind.RESTART: "starting over"}
