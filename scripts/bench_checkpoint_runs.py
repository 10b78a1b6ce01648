"""Runs `python -m jaxzero.train` as a user does, with and without checkpoints, and reports what the
saves cost: peak host RSS against the plan's figure, seconds per step, seconds training waited for
the writer. Each run is its own process, sampled every 0.2 s (`/proc/<pid>/status`).

    python scripts/bench_checkpoint_runs.py --out=DIR RUN [RUN ...]

A RUN is `name:override,override,...` applied to `--config` (default configs/llama-3.4b-offload.toml),
e.g. `bf16-saves:optimizer.state_dtype=bfloat16,checkpoint.enabled=true,checkpoint.every=10,steps=30`.
A name starting with `resume-` reuses the run directory of the name after it (`resume-fp32` resumes
`fp32`). Run directories go under /tmp/jaxzero-bench, removed after each run unless a later one
resumes it; each run's stdout and stderr under --out. Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

GiB = 2**30


def sample(proc: subprocess.Popen) -> tuple[int, float]:
    """(peak RSS bytes, seconds) of a running process, sampled until it exits."""
    peak, start = 0, time.perf_counter()
    status = Path(f"/proc/{proc.pid}/status")
    while proc.poll() is None:
        try:
            for line in status.read_text().splitlines():
                if line.startswith(("VmHWM:", "VmRSS:")):
                    peak = max(peak, int(line.split()[1]) * 1024)
        except OSError:
            break
        time.sleep(0.2)
    return peak, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default="configs/llama-3.4b-offload.toml")
    ap.add_argument("runs", nargs="+")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for run in args.runs:
        name, _, overrides = run.partition(":")
        run_dir = Path("/tmp/jaxzero-bench") / name.removeprefix("resume-")
        cmd = [sys.executable, "-m", "jaxzero.train", f"--config={args.config}", f"--run_dir={run_dir}"]
        cmd += [f"--{o}" for o in overrides.split(",") if o]
        with open(out / f"{name}.out", "w") as stdout, open(out / f"{name}.err", "w") as stderr:
            proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr)
            peak, wall = sample(proc)
        text = (out / f"{name}.out").read_text() + (out / f"{name}.err").read_text()
        plan = re.search(r"host RAM\s+([\d.]+) GiB of ([\d.]+) GiB", text)
        records = []
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists():
            records = [json.loads(line) for line in metrics.read_text().splitlines()]
        timed = [r for r in records if r.get("step_s") is not None]
        step_s = sorted(r["step_s"] for r in timed)[len(timed) // 2] if timed else float("nan")
        tokens = [r["tokens_per_s"] for r in records if r.get("tokens_per_s")]
        rows.append(
            {
                "run": name,
                "exit": proc.returncode,
                "wall_s": round(wall, 1),
                "peak_rss_gib": round(peak / GiB, 1),
                "plan_host_gib": float(plan.group(1)) if plan else None,
                "median_step_s": round(step_s, 3),
                # over the run: equal windows of steps, so the harmonic mean of their rates
                "tokens_per_s": round(len(tokens) / sum(1 / t for t in tokens)) if tokens else None,
                "checkpoint_wait_s": round(sum(r.get("checkpoint_wait_s", 0) for r in records), 1),
                "saved": sorted(int(p.name) for p in (run_dir / "checkpoints").glob("[0-9]*")),
                "last_loss": records[-1]["loss"] if records else None,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        resumed_next = any(r.partition(":")[0] == f"resume-{run_dir.name}" for r in args.runs)
        if not resumed_next:  # the disk holds few checkpoints of this size: the next run needs room
            shutil.rmtree(run_dir, ignore_errors=True)
    (out / "runs.json").write_text(json.dumps(rows, indent=1))
    keys = list(rows[0])
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r[k]) for k in keys))


if __name__ == "__main__":
    main()
