"""Step metrics: throughput and FLOP accounting, memory readings, where each record goes (`metrics.jsonl`,
TensorBoard event files, the console) and progress.

FLOP accounting (the `tflops` and `mfu` fields): model FLOPs of forward + backward, *without* the
rematerialised forward: `flops_per_token(model, seq_len)` = 6 x (parameters used in matmuls, LM head
included, embedding lookups excluded) + 12 x layers x hidden x seq_len for attention (PaLM appendix B,
not halved for causality). `mfu` divides achieved model FLOP/s by the accelerator's dense bf16 peak
(from the device kind, or `logging.peak_tflops`); it is null where no peak is known (CPUs).
Benchmarks additionally report the "8 x params x tokens" figure that counts the recomputed forward.

TensorBoard sees the same records as `metrics.jsonl` (`TensorBoardLog`, through tensorboardX): every
scalar of a record under a tag of its group (`TAGS`), at the record's step, written when the record is,
so it adds no host sync.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import jax

from jaxzero.state import BREAKDOWN, BREAKDOWN_COUNTS, BREAKDOWN_DISK, BREAKDOWN_TIMES

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
    training loop never waits for the disk: `SummaryWriter.flush` from it would fsync (milliseconds)
    without waiting for the thread's queue, so it would cost the loop and promise nothing more."""

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


def _summary_writer_class() -> type:
    """`tensorboardX.SummaryWriter`, imported without PyTorch: tensorboardX imports torch when it is
    installed, only to accept its tensors (we write floats), which would cost a training process ~2.5 s
    and ~190 MiB of RSS."""
    blocked = "torch" not in sys.modules
    if blocked:
        sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` raises ImportError
    try:
        # Here, not at the top: only the process that writes event files pays for the import (0.3 s).
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
    """A one-line progress bar on a terminal; silent when `stream` is not a TTY (logs stay clean)."""

    def __init__(self, total: int, enabled: bool = True, stream: TextIO = sys.stderr, width: int = 30):
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
