"""`python -m jaxzero.train [--config=PATH] [--section.key=value ...]`: train a model.

With no arguments it trains the tiny Llama on the built-in byte-level corpus on whatever JAX backend is
present. The run directory receives the resolved `config.json` and `metrics.jsonl` (one JSON object
per logged step: step, loss, lr, grad_norm, tokens_per_s, tflops, mfu, gpu_peak_gib, host_rss_gib,
and val_loss on validation steps).

The loop reads top to bottom: config -> data -> trainer -> state -> steps (log, validate).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import sys
import time
from pathlib import Path

import jax
import numpy as np

from jaxzero.config import ConfigError, TrainConfig, parse_args
from jaxzero.data import build_data
from jaxzero.metrics import (
    MetricsLog,
    ProgressBar,
    Throughput,
    accelerator_peak_gib,
    host_rss_gib,
    peak_tflops,
)
from jaxzero.models.sizes import flops_per_token, param_count
from jaxzero.trainer import StepMetrics, build_trainer


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. a non-finite loss); the message says why and what to try."""


def resolve_run_dir(cfg: TrainConfig) -> Path:
    """The run directory, created empty. An existing run is never overwritten."""
    if cfg.run_dir:
        run_dir = Path(cfg.run_dir)
    else:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
        run_dir = Path("runs") / f"{cfg.model.name}-{stamp}"
    if (run_dir / "metrics.jsonl").exists() or (run_dir / "config.json").exists():
        raise ConfigError(
            f"run_dir {str(run_dir)!r} already holds a run (config.json / metrics.jsonl); "
            "pass a new --run_dir=PATH (or delete the old run) so its results are not overwritten."
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def evaluate(trainer, state, batches: list[np.ndarray]) -> float:
    """Mean validation loss over fixed batches. Host sync."""
    losses = [trainer.eval_loss(state, trainer.put_eval_batch(b)) for b in batches]
    return float(np.mean(jax.device_get(losses)))  # host sync


def train(cfg: TrainConfig, console=sys.stdout) -> Path:
    """Run training as configured; returns the run directory. Raises ConfigError / TrainingError."""
    data = build_data(cfg.data, cfg.model.vocab_size, cfg.seed)  # checks files before anything is allocated
    trainer = build_trainer(cfg)  # checks the mesh; allocates and compiles nothing
    run_dir = resolve_run_dir(cfg)
    cfg = dataclasses.replace(cfg, run_dir=str(run_dir))
    (run_dir / "config.json").write_text(cfg.to_json() + "\n")

    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    throughput = Throughput(
        tokens_per_step,
        flops_per_token(cfg.model, cfg.data.seq_len),
        peak_tflops(trainer.mesh.devices.flat[0], cfg.logging.peak_tflops),
    )
    devices = list(trainer.mesh.devices.flat)
    print(
        f"jaxzero: {cfg.model.name} ({param_count(cfg.model) / 1e6:.2f}M params), {data.describe()}\n"
        f"jaxzero: {trainer.strategy}; {jax.default_backend()} x{len(devices)}; run_dir {run_dir}",
        file=console,
    )
    val_batches = data.val_batches(cfg.logging.eval_batches)
    log = MetricsLog(run_dir / "metrics.jsonl", console)
    bar = ProgressBar(cfg.steps, cfg.logging.progress)

    t_start = time.perf_counter()
    state = trainer.init(jax.random.key(cfg.seed))
    batches = data.train_iter()
    pending: list[tuple[int, StepMetrics]] = []
    for step in range(1, cfg.steps + 1):
        state, metrics = trainer.step(state, trainer.put_batch(next(batches)))
        pending.append((step, metrics))
        throughput.add_step()
        is_eval = cfg.logging.eval_every > 0 and step % cfg.logging.eval_every == 0
        if step == 1 or step % cfg.logging.log_every == 0 or step == cfg.steps or is_eval:
            values = jax.device_get([m for _, m in pending])  # host sync: scalars only, every log_every steps
            rates = throughput.read() if step > 1 else {"tokens_per_s": None, "tflops": None, "mfu": None}
            last = values[-1]
            record = {
                "step": step,
                "loss": float(last.loss),
                "lr": float(last.lr),
                "grad_norm": float(last.grad_norm),
                **rates,
                "gpu_peak_gib": accelerator_peak_gib(devices),
                "host_rss_gib": host_rss_gib(),
            }
            if step == 1:
                record["compile_s"] = time.perf_counter() - t_start  # init + compile + first step
            bad = [(s, v) for (s, _), v in zip(pending, values) if not math.isfinite(float(v.loss))]
            if is_eval or step == cfg.steps:
                record["val_loss"] = evaluate(trainer, state, val_batches)
            bar.clear()
            log.write(record)
            if bad:
                log.close()
                raise TrainingError(
                    f"loss became {float(bad[0][1].loss)} at step {bad[0][0]} "
                    f"(grad_norm {float(bad[0][1].grad_norm):.4g}). "
                    f"Training stopped; metrics so far are in {run_dir / 'metrics.jsonl'}. Try a lower "
                    f"optimizer.lr (now {cfg.optimizer.lr}), more optimizer.warmup_steps, or "
                    "model.compute_dtype=float32."
                )
            pending.clear()
            throughput.restart()
        bar.update(step)
    bar.close()
    log.close()
    return run_dir


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        from jaxzero.config import all_keys

        print("Keys:", " ".join(all_keys()))
        return 0
    # Random init of a large model compiles in seconds instead of minutes with the threefry kernel
    # (identical values); process-wide, so it is set here by the program, not by the library.
    jax.config.update("jax_threefry_gpu_kernel_lowering", True)
    try:
        cfg = parse_args(argv)
        train(cfg)
    except ConfigError as e:
        print(f"jaxzero: config error: {e}", file=sys.stderr)
        return 2
    except TrainingError as e:
        print(f"jaxzero: training stopped: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
