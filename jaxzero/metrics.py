"""Step metrics: throughput and FLOP accounting, memory readings, `metrics.jsonl`, console and progress.

FLOP accounting (the `tflops` and `mfu` fields): model FLOPs of forward + backward, *without* the
rematerialised forward: `flops_per_token(model, seq_len)` = 6 x (parameters used in matmuls, LM head
included, embedding lookups excluded) + 12 x layers x hidden x seq_len for attention (PaLM appendix B,
not halved for causality). `mfu` divides achieved model FLOP/s by the accelerator's dense bf16 peak
(from the device kind, or `logging.peak_tflops`); it is null where no peak is known (CPUs).
Benchmarks additionally report the "8 x params x tokens" figure that counts the recomputed forward.
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

from jaxzero.state import BREAKDOWN_COUNTS, BREAKDOWN_DISK, BREAKDOWN_TIMES

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
    """Appends one JSON object per logged step to `metrics.jsonl`, flushed as it goes, and echoes it.
    `device` names the accelerator's platform in the console's breakdown (GPU, TPU, CPU)."""

    def __init__(self, path: Path, console: TextIO | None = sys.stdout, device: str = "GPU"):
        self.path = path
        self._file = open(path, "a", buffering=1)  # line-buffered: every record reaches disk at once
        self._console = console
        self._device = device

    def write(self, record: dict[str, Any]) -> None:
        rec = {k: _fmt(v) for k, v in record.items()}
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        if self._console is not None:
            self._console.write(format_record(rec, self._device) + "\n")
            self._console.flush()

    def close(self) -> None:
        self._file.close()


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
