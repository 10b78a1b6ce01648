"""Benchmark the offload engine over several GPUs: one GPU, all GPUs from one process, one process per GPU.

Each variant runs whole optimizer steps through `build_trainer` (via `bench_offload.py`'s step case, in
fresh processes) at the same tokens per GPU per step, so the global batch grows with the GPU count. The
parent prints one table: seconds per step (the slowest process), job throughput, its ratio to one GPU,
TFLOP/s (8N) for the job and per GPU, peak GPU memory and host RSS per process.

    python scripts/bench_mesh.py --case=zero3-offload --model=llama-3.4b-bench --batch_per_gpu=8 --seq=2048
    python scripts/bench_mesh.py --variants=1gpu,2gpu-2proc --set optimizer.state_dtype=bfloat16
    python scripts/bench_mesh.py --variants=1gpu@resident,1gpu@auto --mem_fraction=0.3 \
        --set machine.gpu_gib=40

Variants: `1gpu` (CUDA_VISIBLE_DEVICES=0), `Ngpu-1proc` (one process over N GPUs), `Ngpu-Nproc` (one
process per GPU, joined through jax.distributed on localhost, each on its own equal share of the cores
as `python -m jaxzero.launch` gives them; `--bind_cores=false`: every process on every core). A variant
may name its own step case after `@` and its own settings after `+` (`2gpu-2proc@zero3-1pass`,
`1gpu+offload.host_threads=32`); the others run `--case` and `--set` alone.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from functools import partial

from jaxzero.cli.launch import split_cores

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_variant(name: str, args, index: int) -> dict:
    variant, *extra = name.split("+")
    setup, _, case = variant.partition("@")
    gpus, procs = setup.split("-")[0], setup.split("-")[1] if "-" in setup else "1proc"
    n_gpu, n_proc = int(gpus.removesuffix("gpu")), int(procs.removesuffix("proc"))
    batch = args.batch_per_gpu * n_gpu
    base = [
        sys.executable,
        os.path.join(HERE, "bench_offload.py"),
        f"--case={case or args.case}",
        f"--model={args.model}",
        f"--batch={batch}",
        f"--seq={args.seq}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        *[f"--set={kv}" for kv in [*args.set, *extra]],
    ]
    port = _free_port()
    bind = args.bind_cores == "true" and n_proc > 1 and sys.platform.startswith("linux")
    cores = split_cores(os.sched_getaffinity(0), n_proc) if bind else [[]] * n_proc
    children = []
    for pid in range(n_proc):
        env = dict(os.environ)
        per = n_gpu // n_proc
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in range(pid * per, (pid + 1) * per))
        if args.mem_fraction:
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(args.mem_fraction)
        if n_proc > 1:
            env.update(
                JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                JAX_NUM_PROCESSES=str(n_proc),
                JAX_PROCESS_ID=str(pid),
            )
        children.append(
            subprocess.Popen(
                base,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                preexec_fn=partial(os.sched_setaffinity, 0, cores[pid]) if cores[pid] else None,
            )
        )
    results, t = [], time.perf_counter()
    # numbered, so repeats keep their own logs; letters, digits and ._- only, as the device tool wants
    stem = f"{index}_" + re.sub(r"[^A-Za-z0-9._-]", "_", name)
    for pid, child in enumerate(children):
        out, err = child.communicate()
        with open(os.path.join(args.out, f"mesh_{stem}_p{pid}.log"), "w") as f:
            f.write(out + "\n--- stderr ---\n" + err)
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if child.returncode or not lines:
            return {"variant": name, "error": f"process {pid} rc={child.returncode}: {err[-1200:]}"}
        results.append(json.loads(lines[-1][7:]))
    print(f"{name}: done in {time.perf_counter() - t:.0f}s", flush=True)
    slowest = max(r["step_s"] for r in results)
    tokens = batch * args.seq
    n = results[0]["params"]
    return {
        "variant": name,
        "cores_per_process": len(cores[0]) or os.cpu_count(),
        "gpus": n_gpu,
        "processes": n_proc,
        "params": n,
        "device": results[0]["device"],
        "step_s": slowest,
        "tokens_per_s": tokens / slowest,
        "tflops_8N": 8 * n * tokens / slowest / 1e12,
        "gpu_peak_gib": max(r["gpu_peak_gib"] for r in results),
        "host_rss_gib": [r["host_rss_gib"] for r in results],
        "plan_gpu_gib": results[0].get("plan_gpu_gib"),
        "plan_host_gib": results[0].get("plan_host_gib"),
        "plan_step_s": results[0].get("plan_step_s"),
        "plan": results[0].get("plan"),
        "losses": results[0]["losses"],
        "breakdown": results[0].get("breakdown", {}),
        "per_process_step_s": [r["step_s"] for r in results],
    }


def _off(measured: float, planned: float) -> str:
    """How far a measurement is from the plan's figure, as a signed percentage."""
    return f"{measured / planned - 1:+.0%}" if planned else "no plan"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="1gpu,2gpu-1proc,2gpu-2proc")
    ap.add_argument("--case", default="zero3-offload", help="a step case of bench_offload.py")
    ap.add_argument("--model", default="llama-3.4b-bench")
    ap.add_argument("--batch_per_gpu", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--bind_cores", default="true", choices=["true", "false"])
    ap.add_argument(
        "--mem_fraction",
        type=float,
        default=0.0,
        help="XLA_PYTHON_CLIENT_MEM_FRACTION for every process: a smaller card, with --set machine.gpu_gib "
        "telling the planner the same size (0: XLA's default)",
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    results = [run_variant(v, args, i) for i, v in enumerate(args.variants.split(","))]
    with open(os.path.join(args.out, "bench_mesh.json"), "w") as f:
        json.dump(results, f, indent=1)
    ok = [r for r in results if "error" not in r]
    for r in results:
        if "error" in r:
            print(f"{r['variant']}: FAILED {r['error']}")
    if not ok:
        return
    one = next((r for r in ok if r["gpus"] == 1), None)
    print(
        f"\n--case={args.case} (a variant's @case replaces it), model {args.model} "
        f"({ok[0]['params'] / 1e9:.2f}B), {args.batch_per_gpu}x{args.seq} "
        f"tokens per GPU per step, {ok[0]['device']}"
    )
    print(
        f"{'variant':12} {'s/step':>7} {'tok/s':>8} {'vs 1 GPU':>8} {'TF/s 8N':>8} {'per GPU':>8} "
        f"{'GPU GiB':>8} {'RSS GiB per process':>20}"
    )
    for r in ok:
        ratio = f"{r['tokens_per_s'] / one['tokens_per_s']:.2f}x" if one else "-"
        rss = ", ".join(f"{x:.1f}" for x in r["host_rss_gib"])
        print(
            f"{r['variant']:12} {r['step_s']:7.3f} {r['tokens_per_s']:8.0f} {ratio:>8} {r['tflops_8N']:8.1f} "
            f"{r['tflops_8N'] / r['gpus']:8.1f} {r['gpu_peak_gib']:8.1f} {rss:>20}"
        )
    print("\nThe memory plan against the measurement (peak GPU memory per device; host RSS of process 0):")
    for r in ok:
        if r.get("plan_gpu_gib") is not None:
            gpu, host = r["plan_gpu_gib"], r["plan_host_gib"]
            step, rss = r["plan_step_s"], r["host_rss_gib"][0]
            print(
                f"{r['variant']:12} step predicted {step:6.3f} measured {r['step_s']:6.3f} s "
                f"({_off(r['step_s'], step)}) | GPU plan {gpu:6.1f} measured {r['gpu_peak_gib']:6.1f} GiB "
                f"({_off(r['gpu_peak_gib'], gpu)}) | host plan {host:6.1f} measured {rss:6.1f} GiB "
                f"({_off(rss, host)}) | {r['plan']}"
            )
    for r in ok:
        if r["breakdown"]:
            print(
                f"{r['variant']:12} process 0 per step: "
                + " | ".join(f"{k.removesuffix('_s')} {v:.3f}" for k, v in r["breakdown"].items())
            )


if __name__ == "__main__":
    main()
