"""Benchmark one mixture-of-experts layer's forward + backward on one accelerator, per expert grouping.

    python scripts/bench_moe.py                 # Qwen3-MoE's layer: hidden 2048, 64 experts of 768, top-8
    python scripts/bench_moe.py --tiny          # a tiny shape that runs on CPU in seconds

The layer is `jaxzero.models.moe.moe_block` (router, dropless experts, combine) in bf16 on `--tokens`
random tokens; the gradient is taken of sum(y * cotangent) with respect to every parameter and the
input. Implementations timed:

    ragged_dot    the library's `experts_ragged_dot` (jax.lax.ragged_dot, XLA's own lowering)
    ragged_triton the same with `jax_ragged_dot_use_gpu_pallas_triton_lowering` on (GPU only; the
                  released wheels may lack the module it imports: the row then says so)
    mgpu          the library's Mosaic GPU grouping (`model.moe_impl=mosaic`, Hopper only):
                  `experts_ragged_dot` with `grouped_matmul.mosaic_matmul()` (ragged_dot_mgpu forward
                  and input gradient, transposed_ragged_dot_mgpu for the kernels', one custom VJP)
    padded-B      the library's `experts_padded` with block_rows=B (each `--block-rows` value)
    dense         reference: every expert on every token, weighted by the routing (E/k times the FLOPs)
    loop          reference: a scan over experts, each a fixed-capacity slice of the expert-sorted
                  rows (capacity = the largest group of this routing, measured beforehand on the host)

Each is first checked against ragged_dot (or, where that fails, the first that ran): relative error
max|a - b| / max|b| of the output and of every gradient (the worst leaf). Then `--warmup` untimed and
`--iters` timed runs, each waited for; the table printed last gives the median ms and TFLOP/s counting
only routed expert FLOPs: 18 * tokens * top_k * hidden * intermediate (forward 6, backward 12), neither
the router nor padding. jax.lax.ragged_dot outside TPUs expands to every row against every expert:
at the default shape its operands may not fit the GPU (its row then says so and the others go on).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxzero.models import grouped_matmul, moe  # noqa: E402

TRITON_FLAG = "jax_ragged_dot_use_gpu_pallas_triton_lowering"
IMPLS = "ragged_dot,ragged_triton,mgpu,padded,dense,loop"
def set_triton(on: bool) -> bool:
    """Set the Triton lowering flag; False where this JAX lacks the option and `on` asked for it."""
    try:
        jax.config.update(TRITON_FLAG, on)
    except AttributeError:
        return not on
    return True


def experts_dense(params, x, weights, experts, spec):
    """Every expert on every token; the routing weights scattered into (T, E), zero off the top-k."""
    T = x.shape[0]
    h = jnp.einsum("td,edf->etf", x, params["gate_up"]["kernel"])
    if "bias" in params["gate_up"]:
        h = h + params["gate_up"]["bias"][:, None, :]
    out = jnp.einsum("etf,efd->etd", moe.activation(h, spec), params["down"]["kernel"])
    if "bias" in params["down"]:
        out = out + params["down"]["bias"][:, None, :]
    dense_w = jnp.zeros((T, spec.num_experts), jnp.float32).at[jnp.arange(T)[:, None], experts].set(weights)
    return jnp.einsum("etd,te->td", out.astype(jnp.float32), dense_w).astype(x.dtype)


def experts_loop(params, x, weights, experts, spec, *, capacity: int):
    """A scan over experts: expert e computes `capacity` rows from its group's start in the sorted rows
    (rows past its group masked to zero) and adds them back in place; `capacity` >= the largest group."""
    T, k = experts.shape
    n, D = T * k, x.shape[1]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.zeros((spec.num_experts,), jnp.int32).at[flat].add(1)
    starts = jnp.cumsum(sizes) - sizes
    xs = jnp.concatenate([jnp.repeat(x, k, axis=0)[order], jnp.zeros((capacity, D), x.dtype)])

    def one_expert(ys, e):
        rows = jax.lax.dynamic_slice_in_dim(xs, starts[e], capacity)
        h = rows @ params["gate_up"]["kernel"][e]
        if "bias" in params["gate_up"]:
            h = h + params["gate_up"]["bias"][e][None, :]
        out = moe.activation(h, spec) @ params["down"]["kernel"][e]
        if "bias" in params["down"]:
            out = out + params["down"]["bias"][e][None, :]
        out = jnp.where((jnp.arange(capacity) < sizes[e])[:, None], out, jnp.zeros_like(out))
        here = jax.lax.dynamic_slice_in_dim(ys, starts[e], capacity)
        return jax.lax.dynamic_update_slice_in_dim(ys, here + out, starts[e], 0), None

    ys, _ = jax.lax.scan(one_expert, jnp.zeros((n + capacity, D), x.dtype), jnp.arange(spec.num_experts))
    inverse = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    y = ys[:n][inverse].reshape(T, k, D)
    return jnp.sum(y.astype(jnp.float32) * weights[:, :, None], axis=1).astype(x.dtype)


def rel_err(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))  # host sync


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--family", choices=["qwen3_moe", "mixtral", "gpt_oss"], default="qwen3_moe")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--block-rows", default="128,256,512", help="comma-separated block sizes for padded")
    ap.add_argument("--impls", default=IMPLS)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="64 tokens, hidden 32, 8 experts of 16, top-2")
    args = ap.parse_args()
    if args.tiny:
        args.tokens, args.hidden, args.experts, args.intermediate, args.top_k = 64, 32, 8, 16, 2
        args.block_rows = "4,16"
    T, D, E, F, k = args.tokens, args.hidden, args.experts, args.intermediate, args.top_k
    spec = {
        "qwen3_moe": lambda: moe.qwen3_moe_spec(E, k, norm_topk_prob=True),
        "mixtral": lambda: moe.mixtral_spec(E, k),
        "gpt_oss": lambda: moe.gpt_oss_spec(E, k),
    }[args.family]()
    dtype = jnp.dtype(args.dtype)
    kx, kc, kp = jax.random.split(jax.random.key(0), 3)
    params = jax.tree.map(lambda a: a.astype(dtype), moe.init_moe(kp, spec, D, F, std=0.02))
    x = jax.random.normal(kx, (T, D), jnp.float32).astype(dtype)
    cot = jax.random.normal(kc, (T, D), jnp.float32).astype(dtype)

    # The loop reference's capacity: this routing's largest group, rounded up to 128 rows.
    routing = jax.jit(functools.partial(moe.route, spec=spec))(params["router"], x)
    largest = int(jnp.max(jnp.zeros((E,), jnp.int32).at[routing.experts.reshape(-1)].add(1)))  # host sync
    capacity = -(-largest // 128) * 128

    impls: dict[str, moe.ExpertsFn] = {}
    for name in args.impls.split(","):
        if name in ("ragged_dot", "ragged_triton"):
            impls[name] = moe.experts_ragged_dot
        elif name == "mgpu":
            try:
                impls[name] = functools.partial(moe.experts_ragged_dot, matmul=grouped_matmul.mosaic_matmul())
            except ImportError as exc:
                print(json.dumps({"impl": name, "error": f"{type(exc).__name__}: {exc}"}))
        elif name == "padded":
            for b in args.block_rows.split(","):
                impls[f"padded-{b}"] = functools.partial(moe.experts_padded, block_rows=int(b))
        elif name == "dense":
            impls[name] = experts_dense
        elif name == "loop":
            impls[name] = functools.partial(experts_loop, capacity=capacity)
        else:
            raise SystemExit(f"--impls: unknown implementation {name!r}; choose from {IMPLS}")

    def step(fn):
        def loss(params, x):
            y, _ = moe.moe_block(params, x, spec, experts_fn=fn)
            return jnp.sum(y.astype(jnp.float32) * cot.astype(jnp.float32)), y

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

    routed_flops = 18 * T * k * D * F
    shape = f"tokens {T}, hidden {D}, {E} experts of {F}, top-{k}, {dtype}"
    print(f"device: {jax.devices()[0].device_kind}; {shape}")
    print(f"largest group {largest} rows (mean {T * k / E:.0f}); loop capacity {capacity}")
    ref = None
    rows = []
    for name, fn in impls.items():
        f = step(fn)
        # The Triton lowering is a trace-time flag: on for this implementation's compile and calls only.
        if not set_triton(name == "ragged_triton"):
            print(json.dumps({"impl": name, "error": f"this JAX has no {TRITON_FLAG} option"}))
            continue
        try:
            compiled = f.lower(params, x).compile()
            temp = getattr(compiled.memory_analysis(), "temp_size_in_bytes", 0) / 2**30
            (_, y), grads = jax.block_until_ready(f(params, x))
        except Exception as exc:  # noqa: BLE001 (an out-of-memory reference is reported, not fatal)
            print(json.dumps({"impl": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}))
            continue
        if ref is None:
            ref = (y, grads)
            print(f"reference for the errors below: {name}")
        err_y = rel_err(y, ref[0])
        err_g = max(rel_err(a, b) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref[1])))
        for _ in range(args.warmup):
            jax.block_until_ready(f(params, x))
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            jax.block_until_ready(f(params, x))  # host sync: each step timed alone
            times.append(time.perf_counter() - t0)
        ms = 1e3 * statistics.median(times)
        peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30
        set_triton(False)
        row = {"impl": name, "median_ms": round(ms, 3), "tflops": round(routed_flops / ms / 1e9, 1)}
        row |= {"rel_err_y": err_y, "rel_err_grad": err_g, "peak_gib_so_far": round(peak, 2)}
        row |= {"compiled_temp_gib": round(temp, 3)}
        print(json.dumps(row))
        rows.append(row)
    head = f"{'median ms':>10} {'TFLOP/s':>8} {'err y':>9} {'err grad':>9} {'temp GiB':>9}"
    print(f"\n{'implementation':<14} {head}")
    for r in rows:
        print(
            f"{r['impl']:<14} {r['median_ms']:>10.3f} {r['tflops']:>8.1f} "
            f"{r['rel_err_y']:>9.2e} {r['rel_err_grad']:>9.2e} {r['compiled_temp_gib']:>9.2f}"
        )


if __name__ == "__main__":
    main()
