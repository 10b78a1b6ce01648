"""Runs `python -m jaxzero.train` as a user does, with and without checkpoints, and reports what the
saves cost: peak host RSS against the plan's figure, seconds per step, seconds training waited for
the writer. Each run is its own process, sampled every 0.2 s (`/proc/<pid>/status`): its peak RSS,
the anonymous, file and shared parts at the peak, and its largest mappings (`<name>.smaps`); and the
peak bytes on disk under its run directory (every second) beside the plan's disk figure; the GPU's
peak (`gpu_peak_gib` of metrics.jsonl) beside the plan's GPU figure and its predicted step.

    python scripts/bench_checkpoint_runs.py --out=DIR RUN [RUN ...]

A RUN is `name:override,override,...` applied to `--config` (default configs/llama-3.4b-offload.toml;
`--config=` none), e.g.
`bf16-saves:optimizer.state_dtype=bfloat16,checkpoint.enabled=true,checkpoint.every=10,steps=30`; a
comma not followed by `key=` belongs to the value before it (`finetune.lora_targets=q,k,v,o`).
A name starting with `resume-` reuses the run directory of the name after it (`resume-fp32` resumes
`fp32`); `resume-fp32@10` first removes that run's checkpoints after step 10, so that it resumes from
10 (the disk may hold too few checkpoints to keep it with `checkpoint.keep`). `--nproc=N` starts each
run through `python -m jaxzero.launch --nproc=N`; the peak RSS is then each process's (its
`per_process` `host_rss_gib`, the kernel's high-water mark), and losses of the steps logged are printed
so that a resumed run's can be compared with the run it resumes.
Run directories go under `--runs_dir` (default /tmp/jaxzero-bench), removed after each run unless a later one
resumes it; each run's stdout and stderr under --out. Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

GiB = 2**30


def bytes_under(path: Path) -> int:
    """The bytes of the files under `path` (0 where it does not exist); files removed mid-walk skipped."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def sample(
    proc: subprocess.Popen, smaps: Path, run_dir: Path
) -> tuple[int, float, dict[str, float], int]:
    """(peak RSS bytes, seconds, the RSS's parts at its peak in GiB, peak bytes on disk under
    `run_dir`) of a running process, sampled until it exits (the disk every second); at each new
    RSS peak (1 GiB past the last one kept) its largest mappings go to `smaps`, so that what grew
    can be named."""
    peak, kept, parts, start = 0, 0, {}, time.perf_counter()
    disk, walked = 0, 0.0
    status = Path(f"/proc/{proc.pid}/status")
    while proc.poll() is None:
        if time.perf_counter() - walked >= 1.0:
            disk, walked = max(disk, bytes_under(run_dir)), time.perf_counter()
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except OSError:
            break
        rss = int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
        if rss > peak:
            peak = rss
            parts = {
                k: round(int(fields[k].split()[0]) / 2**20, 1)
                for k in ("RssAnon", "RssFile", "RssShmem")
                if k in fields
            }
            if rss > kept + GiB:
                kept = rss
                try:
                    smaps.write_text(largest_mappings(Path(f"/proc/{proc.pid}/smaps").read_text()))
                except OSError:
                    pass
        time.sleep(0.2)
    return peak, time.perf_counter() - start, parts, max(disk, bytes_under(run_dir))


def largest_mappings(text: str, count: int = 25) -> str:
    """The `count` mappings of a /proc/<pid>/smaps text with the most resident memory, one per line."""
    rows, head = [], ""
    for line in text.splitlines():
        first = line.split()[0] if line.split() else ""
        if not first.endswith(":"):
            head = line
        elif first == "Rss:":
            rows.append((int(line.split()[1]), head))
    rows.sort(reverse=True)
    return "\n".join(f"{kb / 2**20:8.2f} GiB  {h}" for kb, h in rows[:count]) + "\n"


def per_process_peak(records: list[dict]) -> list[float] | None:
    """Each process's peak RSS, GiB, from a several-process run's records; None for one process."""
    rss = [r["per_process"]["host_rss_gib"] for r in records if "per_process" in r]
    return [round(max(p[i] for p in rss), 1) for i in range(len(rss[0]))] if rss else None


def split_overrides(overrides: str) -> list[str]:
    """A RUN's `key=value,key=value` overrides; a comma not followed by `key=` stays in the value."""
    return [o for o in re.split(r",(?=[\w.]+=)", overrides.strip(",")) if o]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default="configs/llama-3.4b-offload.toml")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--keep_run_dirs", action="store_true", help="for a resume in a later call")
    ap.add_argument("--runs_dir", default="/tmp/jaxzero-bench", help="where the run directories go")
    ap.add_argument("runs", nargs="+")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, run in enumerate(args.runs):
        name, _, overrides = run.partition(":")
        name, _, resume_step = name.partition("@")
        run_dir = Path(args.runs_dir) / name.removeprefix("resume-")
        if resume_step:  # this benchmark's own checkpoints, newer than the step to resume from
            for newer in (run_dir / "checkpoints").glob("[0-9]*"):
                if int(newer.name) > int(resume_step):
                    shutil.rmtree(newer)
        train = [sys.executable, "-m", "jaxzero.train"]
        if args.nproc > 1:
            train = [sys.executable, "-m", "jaxzero.launch", f"--nproc={args.nproc}", "--"]
        config = [f"--config={args.config}"] if args.config else []
        flags = [*config, *(f"--{o}" for o in split_overrides(overrides))]
        cmd = [*train, *flags, f"--run_dir={run_dir}", "--logging.plan=full"]
        metrics = run_dir / "metrics.jsonl"
        before = len(metrics.read_text().splitlines()) if metrics.exists() else 0  # a resumed run appends
        with open(out / f"{name}.out", "w") as stdout, open(out / f"{name}.err", "w") as stderr:
            proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr)
            peak, wall, parts, disk = sample(proc, out / f"{name}.smaps", run_dir)
        text = (out / f"{name}.out").read_text() + (out / f"{name}.err").read_text()
        if args.nproc == 1:  # the plan's table, for this machine (a run prints it only where it decided)
            planned = subprocess.run(
                [sys.executable, "-m", "jaxzero.plan", *flags], capture_output=True, text=True
            )
            text = planned.stdout + text
        plan = re.search(r"host RAM\s+([\d.]+) GiB of ([\d.]+) GiB", text)
        plan_disk = re.search(r"([\d.]+) GiB of disk under run_dir at most", text)
        plan_gpu = re.search(r"(?:GPU per device|device)\s+([\d.]+) GiB of", text)
        plan_step = re.search(r"predicted step: ([\d.]+) s \(([\d,]+) tokens/s", text)
        records = []
        if metrics.exists():
            records = [json.loads(line) for line in metrics.read_text().splitlines()]
            if resume_step:  # it dropped the records after the step it resumed from, then appended
                records = [r for r in records if r["step"] > int(resume_step)]
            else:
                records = records[before:]
        timed = [r for r in records if r.get("step_s") is not None]
        step_s = sorted(r["step_s"] for r in timed)[len(timed) // 2] if timed else float("nan")
        tokens = [r["tokens_per_s"] for r in records if r.get("tokens_per_s")]
        gpu = [r["gpu_peak_gib"] for r in records if r.get("gpu_peak_gib") is not None]
        rows.append(
            {
                "run": name,
                "exit": proc.returncode,
                "wall_s": round(wall, 1),
                "peak_rss_gib": per_process_peak(records) or round(peak / GiB, 1),
                "rss_parts_gib": parts,
                "plan_host_gib": float(plan.group(1)) if plan else None,
                "peak_disk_gib": round(disk / GiB, 1),
                "plan_disk_gib": float(plan_disk.group(1)) if plan_disk else None,
                "peak_gpu_gib": max(gpu, default=None),
                "plan_gpu_gib": float(plan_gpu.group(1)) if plan_gpu else None,
                "median_step_s": round(step_s, 3),
                "plan_step_s": float(plan_step.group(1)) if plan_step else None,
                # over the run: equal windows of steps, so the harmonic mean of their rates
                "tokens_per_s": round(len(tokens) / sum(1 / t for t in tokens)) if tokens else None,
                "plan_tokens_per_s": int(plan_step.group(2).replace(",", "")) if plan_step else None,
                "checkpoint_wait_s": round(sum(r.get("checkpoint_wait_s", 0) for r in records), 1),
                "saved": sorted(int(p.name) for p in (run_dir / "checkpoints").glob("[0-9]*")),
                "losses": {r["step"]: r["loss"] for r in records if r.get("loss") is not None},
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        resumed_next = any(
            r.partition(":")[0].partition("@")[0] == f"resume-{run_dir.name}" for r in args.runs[i + 1 :]
        )
        # The disk holds few checkpoints of this size: the next run needs room.
        if not (resumed_next or args.keep_run_dirs):
            shutil.rmtree(run_dir, ignore_errors=True)
    (out / "runs.json").write_text(json.dumps(rows, indent=1))
    keys = list(rows[0])
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r[k]) for k in keys))


if __name__ == "__main__":
    main()
