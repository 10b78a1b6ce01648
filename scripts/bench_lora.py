"""Benchmark a LoRA run (`finetune.method=lora`) on one accelerator, placed as the program places it.

    python scripts/bench_lora.py --model=llama-3.1-8b --batch=16 --seq=2048
    python scripts/bench_lora.py --model=llama-3.1-70b --batch=16 --seq=2048 --set finetune.base_dtype=int8

Synthetic tokens; `--warmup` steps (compilation) then `--steps` timed ones, each waited for. Prints
one JSON line and a short table: seconds per step (median), tokens/s, TFLOP/s counted as 6 x base
parameters x tokens (the frozen base's forward, recomputation and input gradients), the GPU's peak
memory and the process's RSS, beside what the plan predicted (`jaxzero.planner.partial`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()

    from jaxzero.config import TrainConfig
    from jaxzero.overrides import apply_overrides
    from jaxzero.planner.preflight import decide_before_jax

    over = {
        "model.name": args.model,
        "finetune.method": "lora",
        "data.batch_size": str(args.batch),
        "data.seq_len": str(args.seq),
        "data.eot_id": "-1",
        "checkpoint.enabled": "false",
        "optimizer.lr": "1e-4",
        **dict(kv.split("=", 1) for kv in args.set),
    }
    cfg = apply_overrides(TrainConfig(), over)
    decision = decide_before_jax(cfg)  # XLA's share of the GPU and its pinned pool, before JAX starts

    import jax
    import numpy as np

    from jaxzero.models.sizes import param_count
    from jaxzero.trainer import decide_and_build

    t0 = time.perf_counter()
    trainer, decision = decide_and_build(decision.config, decision=decision)
    state = trainer.init(jax.random.key(0))
    jax.block_until_ready(state)
    init_s = time.perf_counter() - t0
    d = trainer.config.data
    rng = np.random.default_rng(0)
    shape = (d.grad_accum, d.batch_size // d.grad_accum, d.seq_len + 1)
    times, losses = [], []
    for _ in range(args.warmup + args.steps):
        batch = trainer.put_batch(rng.integers(0, trainer.config.model.vocab_size, shape, dtype=np.int32))
        t = time.perf_counter()
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics.loss))  # host sync: the step is done
        times.append(time.perf_counter() - t)
    step_s = float(np.median(times[args.warmup :]))
    tokens = d.batch_size * d.seq_len
    n = param_count(trainer.config.model)
    stats = jax.devices()[0].memory_stats() or {}
    result = {
        "model": args.model,
        "params": n,
        "device": jax.devices()[0].device_kind,
        "placement": trainer.strategy,
        "init_s": init_s,
        "step_times": times,
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "tflops_6N": 6 * n * tokens / step_s / 1e12,
        "gpu_peak_gib": stats.get("peak_bytes_in_use", 0) / 2**30,
        "host_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "plan_step_s": decision.step_s,
        "plan_gpu_gib": (decision.memory.accelerator_state + decision.memory.activations) / 2**30,
        "plan_pinned_gib": decision.memory.pinned / 2**30,
        "losses": losses,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"bench_lora_{args.model}.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))
    print(f"\n{trainer.strategy}")
    print("model            s/step  tok/s   TFLOP/s(6N)  GPU GiB (plan)  pinned GiB  RSS GiB  predicted s")
    print(
        f"{args.model:15s} {step_s:7.3f} {tokens / step_s:7.0f} {result['tflops_6N']:10.1f} "
        f"{result['gpu_peak_gib']:7.1f} ({result['plan_gpu_gib']:.1f}) {result['plan_pinned_gib']:9.1f} "
        f"{result['host_rss_gib']:8.1f} {decision.step_s:9.2f}"
    )


if __name__ == "__main__":
    main()
