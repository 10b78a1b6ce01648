"""Step metrics: throughput and FLOP accounting, memory readings, where each record goes (`metrics.jsonl`,
TensorBoard event files, the console) and progress.

FLOP accounting (the `tflops` and `mfu` fields): model FLOPs of forward + backward, *without* the
rematerialised forward: `flops_per_token(model, seq_len)` = 6 x (parameters used in matmuls, LM head
included, embedding lookups excluded) + 12 x layers x hidden x seq_len for attention (PaLM appendix B,
not halved for causality). `mfu` divides achieved model FLOP/s by the accelerator's dense bf16 peak
(from the device kind, or `logging.peak_tflops`); it is null where no peak is known (CPUs).
Benchmarks additionally report the "8 x params x tokens" figure that counts the recomputed forward.
A run with a frozen part (LoRA, `finetune.freeze`) counts only the work it does
(`jaxzero.planner.partial.model_flops_per_token`: no gradient of a frozen weight).

TensorBoard sees the same records as `metrics.jsonl` (`TensorBoardLog`, through tensorboardX): every
scalar of a record under a tag of its group (`TAGS`), at the record's step, written when the record is,
so it adds no host sync.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxzero.config import ConfigError, TrainConfig
from jaxzero.planner.partial import model_flops_per_token
from jaxzero.run.outcome import TrainingError
from jaxzero.state import BREAKDOWN, BREAKDOWN_COUNTS, BREAKDOWN_DISK, BREAKDOWN_TIMES, StepMetrics, Trainer
from jaxzero.storage.run_dir import METRICS_FILE, TENSORBOARD_DIR

# Dense bf16 tensor-core peaks in TFLOP/s by device kind substring (vendor datasheets, SXM parts).
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "TPU v5p": 459.0,
    "TPU v5 lite": 197.0,
    "TPU v4": 275.0,
}


def peak_tflops(device: jax.Device, override: float = 0.0) -> float | None:
    """The accelerator's dense bf16 peak, `override` if > 0, else looked up; None if unknown."""
    if override > 0:
        return override
    device_kind = getattr(device, "device_kind", "")
    for key, value in PEAK_BF16_TFLOPS.items():
        if key.lower() in device_kind.lower():
            return value
    return None


def host_rss_gib() -> float:
    """Peak resident set size of this process (high-water mark), GiB."""
    # ru_maxrss is KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def accelerator_peak_gib(devices: list[jax.Device]) -> float | None:
    """Largest peak bytes in use over `devices`, GiB; None where the backend keeps no statistics."""
    peaks = []
    for d in devices:
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(stats["peak_bytes_in_use"])
    return max(peaks) / 2**30 if peaks else None


@dataclass
class Throughput:
    """Wall-clock throughput between two host syncs."""

    tokens_per_step: int
    flops_per_token: float
    peak: float | None
    _t0: float = field(default_factory=time.perf_counter)
    _steps: int = 0

    def restart(self) -> None:
        self._t0, self._steps = time.perf_counter(), 0

    def add_step(self) -> None:
        self._steps += 1

    def read(self) -> dict[str, float | None]:
        """tokens/s, model TFLOP/s and MFU since `restart`; call right after a host sync."""
        dt = time.perf_counter() - self._t0
        if self._steps == 0 or dt <= 0:
            return {"tokens_per_s": None, "tflops": None, "mfu": None}
        tps = self._steps * self.tokens_per_step / dt
        tflops = tps * self.flops_per_token / 1e12
        return {
            "tokens_per_s": tps,
            "tflops": tflops,
            "mfu": tflops / self.peak if self.peak else None,
        }


def _fmt(v: Any) -> Any:
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return None if math.isnan(v) else v
        return float(f"{v:.6g}")
    if isinstance(v, list):
        return [_fmt(x) for x in v]
    if isinstance(v, dict):
        return {k: _fmt(x) for k, x in v.items()}
    return v


class MetricsLog:
    """Appends one JSON object per logged step to `metrics.jsonl`, flushed as it goes, and echoes it;
    with `tensorboard`, the record's scalars go there too. `device` names the accelerator's platform in
    the console's breakdown (GPU, TPU, CPU)."""

    def __init__(
        self,
        path: Path,
        console: TextIO | None = sys.stdout,
        device: str = "GPU",
        tensorboard: TensorBoardLog | None = None,
    ):
        self.path = path
        self._file = open(path, "a", buffering=1)  # line-buffered: every record reaches disk at once
        self._console = console
        self._device = device
        self._tensorboard = tensorboard

    def write(self, record: dict[str, Any]) -> None:
        rec = {k: _fmt(v) for k, v in record.items()}
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        if self._tensorboard is not None:
            self._tensorboard.write(record)
        if self._console is not None:
            self._console.write(format_record(rec, self._device) + "\n")
            self._console.flush()

    def close(self) -> None:
        """Close the file and the event files; closing again does nothing."""
        try:
            if self._tensorboard is not None:
                self._tensorboard.close()
        finally:
            self._file.close()


# The TensorBoard tag of each key of a record, by group; a key not named here is a `train/` scalar.
TAGS: dict[str, str] = {
    "loss": "train/loss",
    "aux_loss": "train/aux_loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "loss_tokens": "train/loss_tokens",
    "masked_tokens": "train/masked_tokens",
    "loss_scale": "train/loss_scale",
    "skipped_steps": "train/skipped_steps",
    "val_loss": "eval/loss",
    "tokens_per_s": "throughput/tokens_per_s",
    "tflops": "throughput/tflops",
    "mfu": "throughput/mfu",
    "step_s": "throughput/step_s",
    "compile_s": "throughput/compile_s",
    "slowest_process": "throughput/slowest_process",
    "gpu_peak_gib": "memory/gpu_peak_gib",
    "host_rss_gib": "memory/host_rss_gib",
    **{k.key: f"breakdown/{k.key}" for k in BREAKDOWN},
}


def tensorboard_scalars(record: dict[str, Any]) -> dict[str, float]:
    """{tag: value} of every number in a record (`step` is the x axis, not a scalar; None, a value not
    measured, is left out): `TAGS`' tag per key, and `per_process/<key>/process_<i>` for each
    process's figure of a run of several processes."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "per_process":
            for k, values in value.items():
                out.update({f"per_process/{k}/process_{i}": v for i, v in enumerate(values) if v is not None})
        elif key != "step" and isinstance(value, int | float):
            out[TAGS.get(key, f"train/{key}")] = float(value)
    return out


class TensorBoardLog:
    """The scalars of each record as TensorBoard event files in `directory`, through tensorboardX's
    `SummaryWriter`, at the record's step.

    `first_step` is the first step this run logs: an event there tells TensorBoard to drop what an
    earlier run into the same directory logged from that step on (the resumed run recomputes those
    steps, as `metrics.jsonl` drops their records); each run adds its own event file, none is deleted.

    The writer hands each event to a thread of its own, which writes it and flushes the file (an
    fsync) at most `FLUSH_S` seconds later: a crash loses at most the last second's events (their
    records are in `metrics.jsonl`), and `close`, on every way out of `train`, writes them all. The
    training loop never waits for the disk: `SummaryWriter.flush` from it would fsync (a wait on the
    disk) without waiting for the thread's queue, so it would cost the loop and promise nothing more."""

    FLUSH_S = 1
    # Events queued for the writer thread before `add_scalar` blocks: several records' worth (a record
    # of a run of 8 processes holds ~170 scalars), so that writing a record never waits for the thread.
    QUEUE = 4096

    def __init__(self, directory: Path, first_step: int = 1):
        self.directory = directory
        writer = _summary_writer_class()
        self._writer = writer(
            str(directory), purge_step=first_step, max_queue=self.QUEUE, flush_secs=self.FLUSH_S
        )

    def write(self, record: dict[str, Any]) -> None:
        """Queue every scalar of `record` (`tensorboard_scalars`) at `record["step"]`."""
        step = int(record["step"])
        for tag, value in tensorboard_scalars(record).items():
            self._writer.add_scalar(tag, value, global_step=step)

    def close(self) -> None:
        """Write and flush every queued event and close the event file; closing again does nothing."""
        self._writer.close()


def require_tensorboard() -> None:
    """ConfigError, before anything is built, where `logging.tensorboard` is on and tensorboardX (a
    dependency of jaxzero, absent where it runs from a source tree) cannot be imported: a run found
    out only when its loop opened the event files, after building a large model."""
    try:
        _summary_writer_class()
    except ImportError as e:
        raise ConfigError(
            f"logging.tensorboard=true writes TensorBoard event files through tensorboardX, which this "
            f"Python cannot import ({type(e).__name__}: {e}): install it (pip install 'tensorboardX>=2.6', "
            "a dependency of jaxzero) or pass --logging.tensorboard=false."
        ) from e


def _summary_writer_class() -> type:
    """`tensorboardX.SummaryWriter`, imported without PyTorch: tensorboardX imports torch when it is
    installed, only to accept its tensors (we write floats), which would cost a training process the
    start-up time and the RSS of importing PyTorch."""
    blocked = "torch" not in sys.modules
    if blocked:
        sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` raises ImportError
    try:
        # Here, not at the top: only the process that writes event files pays for the import.
        from tensorboardX import SummaryWriter
    finally:
        if blocked:
            del sys.modules["torch"]
    return SummaryWriter


def format_record(rec: dict[str, Any], device: str = "GPU") -> str:
    """A compact console line for one metrics record; `device` names the accelerator in the breakdown."""
    parts = [f"step {rec['step']}"]
    names = [
        ("loss", "loss", "{:.4f}"),
        ("aux_loss", "aux", "{:.4f}"),
        ("val_loss", "val", "{:.4f}"),
        ("lr", "lr", "{:.2e}"),
        ("grad_norm", "gnorm", "{:.3f}"),
        ("tokens_per_s", "tok/s", "{:,.0f}"),
        ("tflops", "TFLOP/s", "{:.3g}"),
        ("mfu", "MFU", "{:.1%}"),
        ("loss_scale", "scale", "{:.0f}"),
        ("skipped_steps", "skipped", "{}"),
        ("gpu_peak_gib", "GPU GiB", "{:.2f}"),
        ("host_rss_gib", "RSS GiB", "{:.2f}"),
    ]
    for key, label, f in names:
        v = rec.get(key)
        if v is not None:
            parts.append(f"{label} {f.format(v)}")
        elif key == "loss" and rec.get("loss_tokens") == 0:
            parts.append("loss - (every target masked)")
    line = " | ".join(parts)
    if rec.get("step_s") is not None:  # the offload engine's breakdown, per step
        line += f"\n    step {rec['step_s']:.3f}s: " + " | ".join(
            [
                f"{k.label.format(device=device)} {rec[k.key]:.3f}"
                for k in BREAKDOWN_TIMES
                if rec.get(k.key) is not None
            ]
            + [f"{k.label} {rec[k.key]:.1f}" for k in BREAKDOWN_COUNTS if rec.get(k.key)]
            + [
                f"{k.label} {rec[k.key]:.3f}"
                for k in BREAKDOWN_DISK
                if rec.get("disk_gb") and rec.get(k.key) is not None
            ]
        )
    return line


class ProgressBar:
    """A one-line progress bar on a terminal; silent when `stream` (default: the `sys.stderr` of the
    moment, which the program may have wrapped) is not a TTY (logs stay clean)."""

    def __init__(self, total: int, enabled: bool = True, stream: TextIO | None = None, width: int = 30):
        stream = sys.stderr if stream is None else stream
        self.total, self.stream, self.width = total, stream, width
        self.enabled = enabled and stream.isatty()
        self._t0 = time.perf_counter()
        self._last = ""

    def update(self, step: int) -> None:
        if not self.enabled:
            return
        frac = step / self.total
        filled = int(self.width * frac)
        elapsed = time.perf_counter() - self._t0
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        line = f"\r[{'#' * filled}{'.' * (self.width - filled)}] {step}/{self.total} eta {eta:5.0f}s"
        if line != self._last:
            self.stream.write(line)
            self.stream.flush()
            self._last = line

    def clear(self) -> None:
        """Erase the bar so that a log line can be printed over it."""
        if self.enabled and self._last:
            self.stream.write("\r" + " " * len(self._last) + "\r")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def job_peak(per_device: float | None, devices: int) -> float | None:
    """The whole job's peak TFLOP/s (MFU is the job's model FLOP/s over it), from one device's."""
    return None if per_device is None else per_device * devices


class LogWindow:
    """The steps since the last log line. Their metrics stay on the device until a line is due (the
    first step, every `logging.log_every` steps, validation steps and the last step); then one host
    sync reads them all and one record goes to `metrics.jsonl`, the console and (`logging.tensorboard`)
    TensorBoard's event files."""

    def __init__(
        self,
        *,
        cfg: TrainConfig,
        trainer: Trainer,
        first: int,
        diagnose: Callable[[int, StepMetrics, list[float]], str],
        val_batches: list[np.ndarray],
        console: TextIO,
        bar: ProgressBar,
        t_start: float,
        main_process: bool = True,
    ):
        self.cfg, self.trainer, self.val_batches = cfg, trainer, val_batches
        self.first = first
        self.diagnose = diagnose  # (step, its metrics, recent finite gradient norms) -> the likely cause
        self.bar = bar  # cleared before each record, so the line is not printed over it
        self.t_start = t_start  # before init or restore: the first record's compile_s counts from here
        device = trainer.mesh.devices.flat[0].platform.upper()  # the breakdown names the real device
        # Every process reads the metrics (and validates: collectives); the main process writes them.
        self.path = Path(cfg.run_dir) / METRICS_FILE
        events = None
        if main_process and cfg.logging.tensorboard:  # from the first step this run logs (a resume's)
            events = TensorBoardLog(Path(cfg.run_dir) / TENSORBOARD_DIR, first_step=first)
        self.file = MetricsLog(
            self.path if main_process else Path(os.devnull), console, device=device, tensorboard=events
        )
        self.last: dict[str, Any] = {}  # the newest record
        self.grad_norms: list[float] = []  # finite gradient norms of the steps read so far (the last few)
        self.throughput = Throughput(
            cfg.data.batch_size * cfg.data.seq_len,
            model_flops_per_token(cfg),  # a frozen weight forms no gradient: the run's own count
            job_peak(peak_tflops(trainer.mesh.devices.flat[0], cfg.logging.peak_tflops), trainer.mesh.size),
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
            # experts' models: the router's load-balancing loss, unweighted, averaged over micro-batches
            **({} if last.aux_loss is None else {"aux_loss": float(last.aux_loss)}),
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
                + self.diagnose(s, v, [g for g in norms if math.isfinite(g)])
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
