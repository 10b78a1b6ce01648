"""Is `--determinism=true` bitwise reproducible on this machine, and what does it cost? Runs
`python -m jaxzero.train` as a user does (each run its own process), with a config's settings:

    det-1, det-2   --determinism=true, --steps=N: two runs of one command
    det-resume     --determinism=true, --steps=K with a checkpoint at K, then resumed to N
    default        without --determinism, --steps=N: what determinism costs

each with `--optimizer.decay_steps=N` (the resumed run's first leg follows the others' learning-rate
schedule), and prints whether the per-step losses and gradient norms (metrics.jsonl, every step logged) of
det-2 and det-resume are bit for bit det-1's, each run's median s/step, and the cost ratio (the
determinism runs' median s/step over the default run's, this machine). With `--masters` the
determinism runs also save at step N, and the float32 masters of the three checkpoints are compared
bitwise (a digest each, read on the CPU in a process of its own; each run's checkpoints are removed
once read, but the resumed run holds two at once: mind the disk for a large model).

    python scripts/bench_determinism.py                                    # the 3.37B preset, on a GPU
    python scripts/bench_determinism.py --config=configs/tiny-offload.toml --steps=4 --resume_at=2 --masters

Any other `--key=value` goes to every run (e.g. `--offload.two_pass_units=0`). Run directories go
under `--work` (default: a new directory in /tmp, removed at the end unless `--keep`); each run's
stdout and stderr beside them. The exit status is 0 when everything compared is equal, 1 when
something differs, 2 when a run failed.
"""

from __future__ import annotations

# Nothing here imports JAX: the runs own the accelerator. The masters' digests are read by this
# script run again as `--digest=RUN_DIR` in a process on the CPU.
import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

DETERMINISM_FLAGS = ("xla_gpu_deterministic_ops", "xla_gpu_exclude_nondeterministic_ops")


def environment() -> dict[str, str]:
    """This process's environment, with this checkout on `PYTHONPATH`: jaxzero, installed or not."""
    repo = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def train(name: str, work: Path, config: str, extra: list[str], *flags: str) -> dict:
    """One `python -m jaxzero.train` in `work/<name>` (appended to for a resume); its exit code."""
    run_dir = work / name
    cmd = [
        sys.executable,
        "-m",
        "jaxzero.train",
        f"--config={config}",
        f"--run_dir={run_dir}",
        "--logging.log_every=1",  # every step's loss and gradient norm in metrics.jsonl
        "--logging.eval_every=0",
        *extra,
        *flags,
    ]
    with open(work / f"{name}.out", "a") as out, open(work / f"{name}.err", "a") as err:
        code = subprocess.run(cmd, stdout=out, stderr=err, env=environment()).returncode
    if code != 0:
        tail = (work / f"{name}.err").read_text().splitlines()[-15:]
        print(f"{name}: exit {code}; the end of {work / f'{name}.err'}:\n  " + "\n  ".join(tail), flush=True)
    return {"exit": code}


def records(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl's records by step (a resumed run's file: the first leg's up to its checkpoint,
    then the second's)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines()) if "step" in r}


def median_step_s(recs: dict[int, dict], first: int = 1) -> float | None:
    """Median seconds per step of the records from step `first` on (a run's first record, which
    compiles, has none)."""
    times = [r["step_s"] for s, r in recs.items() if s >= first and r.get("step_s") is not None]
    return statistics.median(times) if times else None


def compare(name: str, recs: dict[int, dict], ref: dict[int, dict], steps: range) -> dict:
    """Whether `recs`' losses and gradient norms are `ref`'s, bit for bit (JSON holds each float32
    exactly), at every step of `steps`; the first step where they are not."""
    out = {"steps": f"{steps.start}-{steps.stop - 1}", "equal": True}
    for s in steps:
        mine, theirs = recs.get(s, {}), ref.get(s, {})
        pair = [(k, mine.get(k), theirs.get(k)) for k in ("loss", "grad_norm")]
        if any(a is None or a != b for _, a, b in pair):
            out.update(equal=False, first_difference={"step": s, **{k: [a, b] for k, a, b in pair}})
            break
    print(
        f"{name}: losses and grad norms at steps {out['steps']} bitwise det-1's: {out['equal']}", flush=True
    )
    return out


def digest(run_dir: Path) -> str | None:
    """The masters' digest of `run_dir`'s newest checkpoint (this script as `--digest`, on the CPU),
    or None where it cannot be read."""
    env = {**environment(), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, __file__, f"--digest={run_dir}"], capture_output=True, text=True, env=env
    )
    if done.returncode != 0:
        print(f"{run_dir.name}: its masters could not be read:\n{done.stderr[-2000:]}", flush=True)
        return None
    return done.stdout.strip().splitlines()[-1]


def masters_digest(run_dir: str) -> str:
    """SHA-256 over the float32 masters of the newest checkpoint, unit by unit, leaf by leaf (their
    dtypes, shapes and bytes), one unit in RAM at a time."""
    # Imported here: only the `--digest` process reads a checkpoint (and starts JAX, on the CPU).
    import jax
    import numpy as np

    from jaxzero.primitives.deferred import resolved
    from jaxzero.storage.checkpoint_masters import masters_by_unit

    _, params, step = masters_by_unit(run_dir)
    h = hashlib.sha256(f"step {step}".encode())
    for unit in params.units():
        for leaf in jax.tree.leaves(resolved(unit)):
            a = np.ascontiguousarray(leaf)
            h.update(f"{a.dtype} {a.shape}".encode())
            h.update(a.tobytes())
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/llama-3.4b-offload.toml")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--resume_at", type=int, default=24, help="the checkpoint the resumed run resumes from")
    ap.add_argument("--masters", action="store_true", help="also compare the final masters bitwise")
    ap.add_argument("--work", default="", help="where the run directories go (default: a new one in /tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    ap.add_argument("--digest", default="", help=argparse.SUPPRESS)
    args, extra = ap.parse_known_args()
    if args.digest:
        print(masters_digest(args.digest))
        return 0
    n, k = args.steps, args.resume_at
    if not 0 < k < n:
        ap.error(f"--resume_at must be within 1..{n - 1}")
    if any(f in os.environ.get("XLA_FLAGS", "") for f in DETERMINISM_FLAGS):
        print("warning: XLA_FLAGS sets determinism flags: the default run is deterministic too", flush=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="jaxzero-determinism-"))
    work.mkdir(parents=True, exist_ok=True)
    for name in ("det-1", "default", "det-2", "det-resume"):
        shutil.rmtree(work / name, ignore_errors=True)
        for suffix in (".out", ".err"):
            (work / f"{name}{suffix}").unlink(missing_ok=True)
    ckpt = f"--checkpoint.enabled={str(args.masters).lower()}"
    det, steps = "--determinism=true", f"--steps={n}"
    # Every run's learning-rate schedule spans N steps, the first leg of the resumed run's too.
    extra = [f"--optimizer.decay_steps={n}", *extra]
    report: dict = {"config": args.config, "steps": n, "resume_at": k, "extra": extra, "work": str(work)}
    runs, digests = {}, {}

    def digest_and_drop(name: str) -> None:
        if args.masters and runs[name]["exit"] == 0:
            digests[name] = digest(work / name)
            if not args.keep:  # a large model's checkpoints: one run's at a time on the disk
                shutil.rmtree(work / name / "checkpoints", ignore_errors=True)

    # Interleaved, so that a drift of the machine's speed weighs on both kinds of run alike.
    runs["det-1"] = train("det-1", work, args.config, extra, det, steps, ckpt)
    digest_and_drop("det-1")
    runs["default"] = train("default", work, args.config, extra, steps, "--checkpoint.enabled=false")
    runs["det-2"] = train("det-2", work, args.config, extra, det, steps, ckpt)
    digest_and_drop("det-2")
    first = train("det-resume", work, args.config, extra, det, f"--steps={k}", "--checkpoint.enabled=true")
    runs["det-resume"] = first
    if first["exit"] == 0:  # the same run directory: a resume from step k's checkpoint
        runs["det-resume"] = train(
            "det-resume", work, args.config, extra, det, steps, ckpt, "--checkpoint.keep=1"
        )
        digest_and_drop("det-resume")
    recs = {name: records(work / name) for name in runs}
    for name, run in runs.items():
        # The resumed run's own steps: those after its checkpoint (the second process's).
        run["median_step_s"] = median_step_s(recs[name], k + 1 if name == "det-resume" else 1)
    report["runs"] = runs
    failed = any(r["exit"] != 0 for r in runs.values())
    if not failed:
        report["det-2"] = compare("det-2", recs["det-2"], recs["det-1"], range(1, n + 1))
        report["det-resume"] = compare("det-resume", recs["det-resume"], recs["det-1"], range(k + 1, n + 1))
        same = [
            recs["default"][s]["loss"] == recs["det-1"][s]["loss"]
            for s in range(1, n + 1)
            if s in recs["default"]
        ]
        report["default_losses_equal_det_1"] = f"{sum(same)} of {len(same)} steps"  # for information
        det_s = [runs[x]["median_step_s"] for x in ("det-1", "det-2") if runs[x]["median_step_s"]]
        base = runs["default"]["median_step_s"]
        if det_s and base:
            report["cost_ratio"] = round(statistics.mean(det_s) / base, 3)
            print(
                f"cost: {statistics.mean(det_s):.3f} s/step with determinism, {base:.3f} without: "
                f"x{report['cost_ratio']}",
                flush=True,
            )
        if args.masters:
            found = list(digests.values())
            equal = len(found) == 3 and None not in found and len(set(found)) == 1
            report["masters"] = {"digests": digests, "equal": equal}
            print(
                f"masters at step {n} bitwise equal (det-1, det-2, det-resume): {report['masters']['equal']}",
                flush=True,
            )
    print(json.dumps(report, indent=2), flush=True)
    if failed:
        return 2  # the run directories and logs stay, to be read
    if not args.keep and not args.work:
        shutil.rmtree(work, ignore_errors=True)
    equal = report["det-2"]["equal"] and report["det-resume"]["equal"]
    return 0 if equal and report.get("masters", {}).get("equal", True) else 1


if __name__ == "__main__":
    sys.exit(main())
