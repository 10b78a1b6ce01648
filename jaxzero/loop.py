"""The training loop: config -> run directory (held, then inspected) -> trainer -> data -> state
(init or restore) -> for each step: step, log (every `logging.log_every` steps), save, stop.

`train(cfg)` is the library's whole run, as `python -m jaxzero.train` runs it: it writes only into
`cfg.run_dir`, holds that directory's lock (`jaxzero.run_lock`) while it runs, and raises the
exceptions of `jaxzero.outcome` (and `ConfigError`) for the program to turn into exit statuses.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

import jax
import numpy as np

from jaxzero import deepspeed, distributed, objective, runtime
from jaxzero import run_dir as run_dir_lib
from jaxzero.checkpoint import Checkpointer, trim_host_heap
from jaxzero.checkpoint_disk import CheckpointWriteError, ensure_disk_room
from jaxzero.checkpoint_layout import (
    CHECKPOINT_DIR,
    largest_array_bytes,
    make_meta,
    read_meta,
    saved_steps,
    state_bytes,
    unreadable_files,
)
from jaxzero.checkpoint_masters import load_masters
from jaxzero.config import CheckpointError, ConfigError, TrainConfig
from jaxzero.config_checks import resolve_batch, validate
from jaxzero.data.build import build_data
from jaxzero.data.eot import resolve_eot_id
from jaxzero.data.types import BatchIterator, Data, DataShard, DataState
from jaxzero.decode import Generator, Sampling
from jaxzero.finetune.provenance import check_base
from jaxzero.interop import load_hf_by_unit
from jaxzero.metrics import (
    LogWindow,
    ProgressBar,
)
from jaxzero.models.sizes import param_count
from jaxzero.optim import warmup_warning
from jaxzero.outcome import (
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    Preempted,
    TrainingError,
)
from jaxzero.plan.report import Decision
from jaxzero.profiling import StepTrace
from jaxzero.run_dir import CONFIG_FILE, METRICS_FILE, PROFILE_DIR, SUMMARY_FILE, RunKind
from jaxzero.state import StepMetrics, Trainer
from jaxzero.stopping import stop_requested
from jaxzero.tokenizer import codec_for
from jaxzero.trainer import decide_and_build


def checkpoint_due(cfg: TrainConfig, step: int) -> bool:
    """Whether `step` saves a checkpoint: the last step, and every `checkpoint.every` steps."""
    every = cfg.checkpoint.every
    return step == cfg.steps or bool(every and step % every == 0)


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
    if ckpt is not None and cfg.finetune.partial:  # the base it trained against, still the same files
        newest = max(saved_steps(ckpt.directory.parent), default=None)
        if newest is not None:
            check_base(read_meta(ckpt.directory, newest), f"checkpoint {ckpt.directory / str(newest)}")
    if ckpt is not None:
        check_meta = lambda meta: DataState.from_dict(meta["data_state"])  # noqa: E731 - its loader state
        restored = ckpt.restore_latest(trainer.abstract_saved_state(), trainer.layout, cfg, check_meta)
    if restored is not None:
        try:
            state = trainer.from_saved_state(restored.state)  # reads the arrays, unit by unit
        except Exception as e:  # noqa: BLE001 - Orbax and tensorstore raise many types for damaged files
            if cfg.checkpoint.verify or isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e):
                raise  # its checksums matched, or memory ran out: not its files
            raise CheckpointError(
                unreadable_files(ckpt.directory / str(restored.step), e, resuming=True)
            ) from e
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
    default) is printed with the `--run_dir=` that resumes it. `prepare`: how the program decides the
    placement of the run's config (checked against its run directory) before JAX starts
    (`jaxzero.preflight.prepare`); without it, the trainer decides on the running backend's devices.

    One trainer runs in a run directory at a time: it holds the directory's lock (`jaxzero.run_lock`)
    from before it decides what the directory is until it returns or raises. Nothing else is written
    until the config is validated, the run directory inspected, the data checked, the memory planned
    and the state initialised or restored; `config.json` is then written atomically."""
    path = run_dir_lib.locate(cfg.run_dir, cfg.model.name)
    defaulted = not cfg.run_dir or (sources is not None and "run_dir" not in sources)
    with run_dir_lib.hold(path, owner=distributed.index() == 0):  # released on every way out
        return _train_held(cfg, path, console, translation, sources or {}, defaulted, prepare)


def _resolved(
    cfg: TrainConfig, run: run_dir_lib.RunDir, path: Path, sources: Mapping[str, str]
) -> tuple[TrainConfig, list[str]]:
    """`cfg` with its input paths absolute, in `path`, and for a resume checked against the saved run
    (`run_dir.check_resume`: the keys that change what is computed stay); with the notes to print
    about what a resume changes."""
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
    return dataclasses.replace(cfg, run_dir=str(path)), notes


def _nothing_to_do(at: int, steps: int) -> str:
    """What a run already at step `at` says when asked for `steps` <= `at`."""
    return (
        f"jaxzero: nothing to do: the run is at step {at} and steps={steps}; pass --steps=N (N > {at}) "
        "to train further."
    )


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
            f"--run_dir={run_dir_lib.shown(path)}",
            file=console,
        )
    cfg, notes = _resolved(cfg, run, path, sources)
    validate(cfg)
    saved = saved_steps(path) if run.kind is RunKind.RESUME else []
    if saved and saved[0] >= cfg.steps:  # whichever checkpoint restores, it is past the end: read none
        print(_nothing_to_do(saved[-1], cfg.steps), file=console)
        return path
    # Decides the offload keys left on auto (before JAX starts, where the program prepares it), checks
    # the mesh and memory; allocates and compiles nothing. `cfg` stays as the user wrote it
    # (config.json keeps "auto"); `trainer.config` is decided.
    try:
        # The trainer attends within documents: it is built with the data's end-of-text id resolved
        # (config.json keeps what the user wrote, as it keeps "auto").
        built = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eot_id=resolve_eot_id(cfg)))
        decision = prepare(built) if prepare is not None else None
        trainer, decision = decide_and_build(built, decision=decision)
    except ConfigError:
        if translation is not None:  # the DeepSpeed file's batch keys for these GPUs, in its words
            deepspeed.check(translation, cfg, jax.device_count())
        raise
    # Evaluated with JAX, so after the placement is decided and XLA's pools sized (JAX has started now).
    short_warmup = warmup_warning(cfg.optimizer, cfg.steps, cfg.schedule_steps)
    if short_warmup:
        notes.append(f"jaxzero: warning: {short_warmup}")
    cfg = resolve_batch(cfg, trainer.mesh.size)  # DeepSpeed's batch rule, now that the devices are known
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
        print(_nothing_to_do(begin.first - 1, cfg.steps), file=console)
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
    return _steps(ready, console)


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


def _steps(run: ReadyRun, console: TextIO) -> Path:
    """The loop: for each step, step, log, save, stop; then the summary. Returns the run directory."""
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
    trace = StepTrace(cfg.profile.window(), _profile_dir(path), begin.first, console)
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
                raise Preempted(_stopped_message(stop, step, ckpt, cfg, run.defaulted), _exit_code(stop))
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
        gc.unfreeze()  # what `settle_heap` exempted is collected again (a notebook's next run)
    bar.close()
    if ckpt is not None:
        ckpt.close()  # host sync: wait for the last asynchronous save
    if main_process:
        if batches.truncated:  # fine-tuning examples longer than a row were cut to it
            print(
                f"jaxzero: {batches.truncated:,} fine-tuning examples of this run's batches were longer than "
                f"a row (data.seq_len + 1 = {cfg.data.seq_len + 1} tokens) and were truncated to it",
                file=console,
            )
        finish(cfg, log.last, ckpt, time.perf_counter() - run.t_start, console)
        if cfg.logging.samples and cfg.data.source == "builtin" and ckpt is not None and ckpt.last_saved:
            print_samples(cfg, console)
    return path


# The end-of-run samples read the model's float32 weights whole: at most this share of the free RAM.
SAMPLES_RAM_SHARE = 0.5
# Prompts of the end-of-run samples on the built-in corpus (Python's standard library).
SAMPLE_PROMPTS = ("def ", "import ", "class ", "    return ", "# ")


def print_samples(cfg: TrainConfig, console: TextIO) -> None:
    """`logging.samples` continuations of Python-source prompts by the run's last checkpoint, sampled
    at temperature 0.8 and top_p 0.95, with the command that makes more."""
    if jax.process_count() > 1:  # the checkpoint is read whole by one process
        return
    whole = 4 * param_count(cfg.model)  # the float32 weights the sampler reads into host RAM
    if whole > SAMPLES_RAM_SHARE * runtime.host_memory_available():
        print(
            f"jaxzero: samples skipped: the model's float32 weights ({whole / 2**30:.1f} GiB) would not fit "
            f"this host's free RAM beside the run; python -m jaxzero.generate --run_dir={cfg.run_dir} "
            "--prompt=TEXT samples on a machine that holds them.",
            file=console,
        )
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


def _profile_dir(run_dir: Path) -> Path:
    """Where this process's profiler traces go: `<run_dir>/profile`, with several processes a folder
    each (the trace files are named after the host, which processes of one machine share)."""
    if jax.process_count() == 1:
        return run_dir / PROFILE_DIR
    return run_dir / PROFILE_DIR / f"process-{jax.process_index()}"
