"""What the run's reporting costs the training loop, side by side in one process:

- one record written to metrics.jsonl (json + write + flush, as `metrics.MetricsLog` does) against the
  same record queued as TensorBoard scalars (`metrics.TensorBoardLog.write`);
- one profiler span (`offload.timeline.span`) entered and left with no trace running, against an empty
  `contextlib.nullcontext`, and the same span inside a running trace.

    python scripts/bench_logging.py [--records=400] [--gap_s=0.02] [--spans=200000] [--out=DIR]

The record is an offloaded run's: every breakdown field of `jaxzero.state` with the scalars of a
train record (~25 numbers). Prints a table: medians, per record (records `--gap_s` apart) or per span.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax

from jaxzero.offload.timeline import span
from jaxzero.run.metrics import TensorBoardLog
from jaxzero.state import BREAKDOWN


def record(step: int) -> dict:
    rec = {"step": step, "loss": 2.5 + 1 / step, "lr": 3e-4, "grad_norm": 1.1, "loss_tokens": 32768}
    rec |= {"masked_tokens": 0, "tokens_per_s": 12345.6, "tflops": 400.1, "mfu": 0.4, "gpu_peak_gib": 60.2}
    rec |= {"host_rss_gib": 88.5, "step_s": 1.2}
    rec |= {k.key: 0.1 for k in BREAKDOWN}
    return rec


def spaced(fn, n: int, gap_s: float) -> float:
    """Median seconds of one call of `fn(i)`, calls `gap_s` apart: records come log_every steps apart,
    so a writer thread has drained its queue before the next (a burst would time the thread instead)."""
    times = []
    for i in range(n):
        start = time.perf_counter()
        fn(i + 1)
        times.append(time.perf_counter() - start)
        time.sleep(gap_s)
    return statistics.median(times)


def per_call(fn, n: int, repeats: int = 5) -> float:
    """Median over `repeats` of the seconds per call of `fn(i)` over n calls."""
    times = []
    for r in range(repeats):
        start = time.perf_counter()
        for i in range(n):
            fn(r * n + i + 1)
        times.append((time.perf_counter() - start) / n)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=400)
    ap.add_argument("--gap_s", type=float, default=0.02, help="seconds between two records")
    ap.add_argument("--spans", type=int, default=200_000)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-logging-"))
    out.mkdir(parents=True, exist_ok=True)
    rows = []

    with open(out / "metrics.jsonl", "w") as f:

        def jsonl(step: int) -> None:
            f.write(json.dumps(record(step)) + "\n")
            f.flush()

        t_jsonl = spaced(jsonl, args.records, args.gap_s)
    tb = TensorBoardLog(out / "tensorboard")
    t_tb = spaced(lambda step: tb.write(record(step)), args.records, args.gap_s)
    tb.close()
    scalars = len(record(1)) - 1
    rows += [("metrics.jsonl record", t_jsonl * 1e6), (f"TensorBoard record ({scalars} scalars)", t_tb * 1e6)]

    def empty(_: int) -> None:
        with contextlib.nullcontext():
            pass

    def marked(i: int) -> None:
        with span("host_update", i % 64):
            pass

    t_null = per_call(empty, args.spans)
    t_span = per_call(marked, args.spans)
    jax.profiler.start_trace(str(out / "trace"))
    t_traced = per_call(marked, args.spans // 10, repeats=3)
    jax.profiler.stop_trace()
    rows += [("nullcontext", t_null * 1e6), ("span, no trace", t_span * 1e6)]
    rows += [("span, tracing", t_traced * 1e6)]

    print(f"\njax {jax.__version__}, backend {jax.default_backend()}, logs in {out}")
    print(f"{'what':<36} {'us per call':>12}")
    for name, us in rows:
        print(f"{name:<36} {us:>12.2f}")
    print(f"TensorBoard / metrics.jsonl per record: {t_tb / t_jsonl:.1f}x")


if __name__ == "__main__":
    main()
