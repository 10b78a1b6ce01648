"""`python -m jaxzero.train [--config=PATH] [--section.key=value ...]`: train a model.

With no arguments it trains the tiny Llama on the built-in byte-level corpus on whatever JAX backend is
present. The run directory receives the resolved `config.json`, `metrics.jsonl` (one JSON object per
logged step; its fields are listed in the README, the offload engine's per-step breakdown in
`jaxzero.state.BREAKDOWN`) and Orbax checkpoints under `checkpoints/`.

Pointed at a run directory that holds a checkpoint, it resumes from the newest complete one with the
config saved there; `--steps`, `--logging.*`, `--checkpoint.*` and `--offload.*` (resume a resident
run offloaded, or the reverse) may be changed on resume.
SIGTERM saves a checkpoint at the next step boundary and exits with status 3 (with several processes,
joined through `jax.distributed`, every process at the same step).

The loop reads top to bottom: config -> data -> trainer -> state (init or restore) -> for each step:
step, log (every `logging.log_every` steps), save, preempt.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxzero.checkpoint import Checkpointer, make_meta, saved_steps
from jaxzero.config import ConfigError, TrainConfig, validate
from jaxzero.data import BatchIterator, Data, DataState, build_data
from jaxzero.interop import load_hf_into
from jaxzero.metrics import (
    MetricsLog,
    ProgressBar,
    Throughput,
    accelerator_peak_gib,
    host_rss_gib,
    peak_tflops,
)
from jaxzero.models.sizes import flops_per_token, param_count
from jaxzero.overrides import all_keys, apply_overrides, config_from_dict, parse_args
from jaxzero.state import BREAKDOWN, StepMetrics, Trainer
from jaxzero.trainer import build_trainer

EXIT_CONFIG, EXIT_TRAINING, EXIT_PREEMPTED = 2, 1, 3
# Keys a resumed run may change; anything else would make the resumed run a different run.
RESUMABLE_CHANGES = ("steps", "logging.", "checkpoint.", "offload.")


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. a non-finite loss); the message says why and what to try."""


class Preempted(RuntimeError):
    """SIGTERM arrived; a checkpoint was saved at `step`."""


def has_checkpoint(run_dir: Path) -> bool:
    return bool(saved_steps(run_dir))


def resolve_run_dir(cfg: TrainConfig) -> tuple[Path, bool]:
    """(run directory, whether it resumes a checkpointed run). A run without checkpoints is never
    overwritten."""
    if cfg.run_dir:
        run_dir = Path(cfg.run_dir)
    else:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
        run_dir = Path("runs") / f"{cfg.model.name}-{stamp}"
    if has_checkpoint(run_dir):
        return run_dir, True
    if (run_dir / "metrics.jsonl").exists() or (run_dir / "config.json").exists():
        raise ConfigError(
            f"run_dir {str(run_dir)!r} already holds a run (config.json / metrics.jsonl) with no checkpoint "
            "to resume from; pass a new --run_dir=PATH (or delete the old run) so its results are not "
            "overwritten."
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir, False


def resume_config(run_dir: Path, overrides: dict[str, str]) -> TrainConfig:
    """The saved config of a run being resumed, with the allowed `overrides` applied."""
    saved = config_from_dict(json.loads((run_dir / "config.json").read_text()))
    changed = {k: v for k, v in overrides.items() if k != "run_dir"}
    cfg = apply_overrides(saved, changed)
    different = [k for k in changed if not k.startswith(RESUMABLE_CHANGES) and _get(cfg, k) != _get(saved, k)]
    if different:
        raise ConfigError(
            f"run_dir {str(run_dir)!r} holds a checkpointed run; resuming it cannot change "
            f"{', '.join(f'{k} ({_get(saved, k)!r} -> {_get(cfg, k)!r})' for k in different)}. Only steps, "
            "logging.*, checkpoint.* and offload.* may change; start a new --run_dir for a different run."
        )
    validate(cfg)
    return cfg


def _get(cfg: TrainConfig, key: str):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def evaluate(trainer: Trainer, state: Any, batches: list[np.ndarray]) -> float:
    """Mean validation loss over fixed batches. Host sync."""
    losses = [trainer.eval_loss(state, trainer.put_eval_batch(b)) for b in batches]
    return float(np.mean(jax.device_get(losses)))  # host sync


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop records past `last_step`: the resumed run recomputes them (identically), so the file keeps
    one record per step. Rewritten atomically."""
    if not path.exists():
        return
    keep = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= last_step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(ln + "\n" for ln in keep))
    tmp.replace(path)


_SIGTERM = threading.Event()  # set by the handler `main` installs for a one-process run


def preemption_requested(step: int) -> bool:
    """Whether a SIGTERM asks this run to stop after `step`. With several processes (jax.distributed
    running) JAX's preemption sync point answers, so that every process stops at the same step; one
    process reads the flag its own SIGTERM handler sets (without a handler, never)."""
    if jax.distributed.is_initialized():
        return multihost_utils.reached_preemption_sync_point(step)
    return _SIGTERM.is_set()


def checkpoint_due(cfg: TrainConfig, step: int) -> bool:
    """Whether `step` saves a checkpoint: the last step, and every `checkpoint.every` steps."""
    every = cfg.checkpoint.every
    return step == cfg.steps or bool(every and step % every == 0)


def start(
    cfg: TrainConfig, trainer: Trainer, data: Data, ckpt: Checkpointer | None, console: TextIO
) -> tuple[Any, int, BatchIterator]:
    """(state, first step, batches) of the run: restored from `ckpt`'s newest readable checkpoint when
    resuming (`ckpt` given), else initialised from the Hugging Face checkpoint `model.init_from` or
    from `seed`. The state is created in its final placement."""
    restored = ckpt.restore_latest(trainer.abstract_saved_state(), trainer.layout, cfg) if ckpt else None
    if restored is not None:
        state = trainer.from_saved_state(restored.state)
        batches = data.train_iter(DataState.from_dict(restored.meta["data_state"]))
        truncate_metrics(Path(cfg.run_dir) / "metrics.jsonl", restored.step)
        print(f"jaxzero: resumed from {ckpt.directory / str(restored.step)}", file=console)
        return state, restored.step + 1, batches
    if cfg.model.init_from:
        state = trainer.init_from_params(load_hf_into(cfg.model, cfg.model.init_from))
        print(f"jaxzero: initialised from the Hugging Face checkpoint {cfg.model.init_from}", file=console)
        return state, 1, data.train_iter()
    return trainer.init(jax.random.key(cfg.seed)), 1, data.train_iter()


class LogWindow:
    """The steps since the last log line. Their metrics stay on the device until a line is due (the
    first step, every `logging.log_every` steps, validation steps and the last step); then one host
    sync reads them all and one record goes to `metrics.jsonl` and the console."""

    def __init__(
        self,
        cfg: TrainConfig,
        trainer: Trainer,
        first: int,
        val_batches: list[np.ndarray],
        run_dir: Path,
        console: TextIO,
        bar: ProgressBar,
        t_start: float,
    ):
        self.cfg, self.trainer, self.first, self.val_batches = cfg, trainer, first, val_batches
        self.bar = bar  # cleared before each record, so the line is not printed over it
        self.t_start = t_start  # before init or restore: the first record's compile_s counts from here
        self.file = MetricsLog(run_dir / "metrics.jsonl", console)
        self.throughput = Throughput(
            cfg.data.batch_size * cfg.data.seq_len,
            flops_per_token(cfg.model, cfg.data.seq_len),
            peak_tflops(trainer.mesh.devices.flat[0], cfg.logging.peak_tflops),
        )
        self.pending: list[tuple[int, StepMetrics]] = []
        self.t_window = time.perf_counter()  # start of the steps the next record covers
        self.skipped_steps = 0  # float16: steps whose update was skipped for overflow, in this process

    def add(self, step: int, metrics: StepMetrics) -> None:
        self.pending.append((step, metrics))
        self.throughput.add_step()

    def _is_eval(self, step: int) -> bool:
        every = self.cfg.logging.eval_every
        return step == self.cfg.steps or (every > 0 and step % every == 0)

    def due(self, step: int) -> bool:
        return step == self.first or step % self.cfg.logging.log_every == 0 or self._is_eval(step)

    def write(self, step: int, state: Any) -> None:
        """Read the window's metrics (a host sync), validate if due, and write the record. Raises
        TrainingError for a non-finite loss, or float16 overflowing at the minimum loss scale."""
        values = jax.device_get([m for _, m in self.pending])  # host sync: scalars only
        later = step > self.first
        rates = self.throughput.read() if later else {"tokens_per_s": None, "tflops": None, "mfu": None}
        last = values[-1]
        record = {
            "step": step,
            "loss": float(last.loss),
            "lr": float(last.lr),
            "grad_norm": float(last.grad_norm),
            **rates,
            "gpu_peak_gib": accelerator_peak_gib(list(self.trainer.mesh.devices.flat)),
            "host_rss_gib": host_rss_gib(),
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
        if last.loss_scale is not None:  # float16: overflowing steps are skipped, not failures
            self._float16(record, values)
        bad = [(s, v) for (s, _), v in zip(self.pending, values) if not math.isfinite(float(v.loss))]
        if self._is_eval(step) and not bad:
            record["val_loss"] = evaluate(self.trainer, state, self.val_batches)
        self.bar.clear()
        self.file.write(record)
        if bad:  # the last good checkpoint stays; nothing non-finite is saved
            raise TrainingError(
                f"loss became {float(bad[0][1].loss)} at step {bad[0][0]} "
                f"(grad_norm {float(bad[0][1].grad_norm):.4g}). "
                f"Training stopped; metrics so far are in {self.file.path}. Try a lower "
                f"optimizer.lr (now {self.cfg.optimizer.lr}), more optimizer.warmup_steps, or "
                "model.compute_dtype=float32."
            )
        self.pending.clear()
        self.throughput.restart()

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


def train(cfg: TrainConfig, console: TextIO = sys.stdout) -> Path:
    """Run training as configured; returns the run directory. Raises ConfigError / TrainingError /
    Preempted."""
    data = build_data(cfg.data, cfg.model.vocab_size, cfg.seed)  # checks files before anything is allocated
    run_dir, resuming = resolve_run_dir(cfg)
    trainer = build_trainer(cfg)  # checks the mesh and memory; allocates and compiles nothing
    cfg = dataclasses.replace(cfg, run_dir=str(run_dir))
    (run_dir / "config.json").write_text(cfg.to_json() + "\n")
    ckpt = Checkpointer(run_dir, cfg.checkpoint) if cfg.checkpoint.enabled or resuming else None
    print(
        f"jaxzero: {cfg.model.name} ({param_count(cfg.model) / 1e6:.2f}M params), {data.describe()}\n"
        f"jaxzero: {trainer.strategy}; {jax.default_backend()} x{trainer.mesh.size}; run_dir {run_dir}",
        file=console,
    )
    val_batches = data.val_batches(cfg.logging.eval_batches)
    t_start = time.perf_counter()
    state, first, batches = start(cfg, trainer, data, ckpt if resuming else None, console)
    bar = ProgressBar(cfg.steps, cfg.logging.progress)
    log = LogWindow(cfg, trainer, first, val_batches, run_dir, console, bar, t_start)
    try:
        for step in range(first, cfg.steps + 1):
            state, metrics = trainer.step(state, trainer.put_batch(next(batches)))
            log.add(step, metrics)
            if log.due(step):
                log.write(step, state)  # raises TrainingError on a non-finite loss
            preempted = preemption_requested(step)
            if ckpt is not None and cfg.checkpoint.enabled and (preempted or checkpoint_due(cfg, step)):
                saved = trainer.saved_state(state)
                ckpt.save(step, saved, make_meta(step, batches.state.to_dict(), cfg, trainer.layout, saved))
            if preempted:
                bar.clear()
                if ckpt is None or not cfg.checkpoint.enabled:
                    raise Preempted(
                        f"SIGTERM at step {step}; checkpoint.enabled=false, so nothing was saved."
                    )
                raise Preempted(
                    f"SIGTERM: saved a checkpoint at step {step} in {ckpt.directory}; rerun with "
                    f"--run_dir={run_dir} to resume."
                )
            bar.update(step)
    except TrainingError:
        log.close()
        if ckpt is not None:
            ckpt.close()  # host sync: the last good checkpoint is committed; nothing non-finite is saved
        raise
    except Preempted:
        log.close()
        if ckpt is not None and cfg.checkpoint.enabled:
            ckpt.close()  # host sync: the checkpoint is committed before the process exits
        raise
    bar.close()
    log.close()
    if ckpt is not None:
        ckpt.close()  # host sync: wait for the last asynchronous save
    return run_dir


def start_distributed() -> bool:
    """Join a multi-process run through JAX's distributed runtime when one is configured
    (`JAX_COORDINATOR_ADDRESS`, with JAX's process count and id variables), before any backend starts.
    Returns whether this call started it. One process needs no runtime, and starts none: its
    coordination service would outlive nothing but print a GRPC error at exit."""
    if jax.distributed.is_initialized() or not os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return False
    jax.distributed.initialize()
    return True


def stop_distributed() -> None:
    """Shut down the distributed runtime `start_distributed` started, before the interpreter exits.
    The run's outcome is decided by now, so a failure here only warns."""
    try:
        jax.distributed.shutdown()
    except Exception as e:  # noqa: BLE001 - whatever the runtime raises, the exit status stands
        print(f"jaxzero: warning: jax.distributed did not shut down cleanly: {e}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        print("Keys:", " ".join(all_keys()))
        return 0
    # Random init of a large model compiles in seconds instead of minutes with the threefry kernel
    # (identical values); process-wide, so it is set here by the program, not by the library.
    jax.config.update("jax_threefry_gpu_kernel_lowering", True)
    started, previous_sigterm = False, None
    try:
        run_dir = next((a.split("=", 1)[1] for a in argv if a.startswith("--run_dir=")), "")
        if run_dir and has_checkpoint(Path(run_dir)):
            overrides = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
            if "config" in overrides:
                raise ConfigError(
                    "--config cannot be combined with resuming a run; the run's own config is used."
                )
            cfg = resume_config(Path(run_dir), overrides)
        else:
            cfg = parse_args(argv)
        started = start_distributed()
        if not jax.distributed.is_initialized():  # one process: SIGTERM sets a flag read per step
            _SIGTERM.clear()
            previous_sigterm = signal.signal(signal.SIGTERM, lambda signum, frame: _SIGTERM.set())
            previous_sigterm = signal.SIG_DFL if previous_sigterm is None else previous_sigterm
        train(cfg)
    except ConfigError as e:
        print(f"jaxzero: config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except TrainingError as e:
        print(f"jaxzero: training stopped: {e}", file=sys.stderr)
        return EXIT_TRAINING
    except Preempted as e:
        print(f"jaxzero: preempted: {e}", file=sys.stderr)
        return EXIT_PREEMPTED
    finally:  # after the outcome is printed
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)
        if started:
            stop_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
