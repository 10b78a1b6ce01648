"""Document-aware attention on the device: is its cuDNN path right, and what does it cost?

(a) Numerics: `jaxzero.models.layers.causal_attention` with segment ids, cuDNN against XLA (outputs and
    the gradients of q, k, v; random inputs and documents), within the bfloat16 tolerance of the model
    tests (relative error 2e-2), for rows of few documents (cuDNN's packed layout) and for rows of
    more than the largest of `packed_document_sizes` (the mask fallback); and XLA's against a float64 NumPy
    reference that attends inside each document separately. Without a CUDA GPU (or in float32) the
    cuDNN rows are skipped.
(b) Speed: attention forward + backward (the gradients of q, k, v) with and without segment ids, per
    implementation, as a table with each row's ratio to today's path (no segments, the first row).

    python scripts/check_packed_attention.py                 # GPU: the 3.37B model's attention
    python scripts/check_packed_attention.py --small         # CPU-sized shapes (the default without a GPU)

`--scale=X` multiplies the scores by X instead of 1/sqrt(H) (Granite's `attention_multiplier`, Gemma 3's
`query_pre_attn_scalar`), in every path and the reference.

`--window=W` checks and times Gemma 3's sliding window instead (no segments): a layer whose window is
W (`local_window=W`: the kernel's own window) and a global one (its causal mask), each against the dense
mask of the window (`local_window` unset) and the float64 reference, and their times beside the dense mask's.

Defaults on a GPU are llama-3.4b-bench's attention (24 heads, 24 key/value heads, head_dim 128) over a
micro-batch of 8 sequences of 2048 tokens in bfloat16, documents ~400 tokens long. Exits 1 if a
numerical check fails.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxzero.config import ModelConfig
from jaxzero.models.layers import (
    causal_attention,
    packed_document_sizes,
    packed_layout_applies,
    windowed_attention,
)

BF16_TOL = 2e-2  # tests/test_models.py: relative error of bfloat16 outputs against float64
F32_TOL = 1e-5


def documents(rng: np.random.Generator, batch: int, seq: int, mean_len: float) -> np.ndarray:
    """int32 (B, S) segment ids: each row cut into documents of geometric lengths (mean `mean_len`)."""
    ends = rng.random((batch, seq)) < 1.0 / mean_len
    ends[:, -1] = False
    return (np.cumsum(ends, axis=1) - ends).astype(np.int32)


def reference(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, segments: np.ndarray, scale: float, window: int = 2**30
) -> np.ndarray:
    """float64 attention of each document alone (causal, grouped-query heads, scores times
    `scale`, each query over the keys less than `window` behind it): (B, S, N, H)."""
    b, s, n, h = q.shape
    group = n // k.shape[2]
    out = np.zeros((b, s, n, h))
    for r in range(b):
        for d in np.unique(segments[r]):
            idx = np.flatnonzero(segments[r] == d)
            qd, kd, vd = q[r, idx], np.repeat(k[r, idx], group, 1), np.repeat(v[r, idx], group, 1)
            scores = np.einsum("tnh,snh->nts", qd, kd) * scale
            i, j = np.arange(len(idx))[:, None], np.arange(len(idx))[None, :]
            scores = np.where(((j <= i) & (i - j < window))[None], scores, -np.inf)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            out[r, idx] = np.einsum("nts,snh->tnh", p / p.sum(-1, keepdims=True), vd)
    return out


def rel(a: jax.Array | np.ndarray, b: jax.Array | np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def fwd_bwd(impl: str, with_segments: bool, scale: float) -> Callable[..., tuple[jax.Array, ...]]:
    """jit of (q, k, v, segments, cotangent) -> (output, dq, dk, dv) of the library's attention."""

    def run(q, k, v, segments, ct):
        seg = segments if with_segments else None
        out, vjp = jax.vjp(lambda q, k, v: causal_attention(q, k, v, impl, seg, scale=scale), q, k, v)
        return (out, *vjp(ct))

    return jax.jit(run)


def windowed(impl: str, local_window: int | None, scale: float) -> Callable[..., tuple[jax.Array, ...]]:
    """jit of (q, k, v, window, cotangent) -> (output, dq, dk, dv), no segments, `window` traced:
    with `local_window`, `windowed_attention` (what `causal_attention` runs for cuDNN; called here
    for XLA too, to time its switch), else the dense mask."""

    def run(q, k, v, window, ct):
        def attend(q, k, v):
            if local_window is None:
                return causal_attention(q, k, v, impl, window=window, scale=scale)
            return windowed_attention(q, k, v, impl, window, local_window, scale)

        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(ct))

    return jax.jit(run)


def check_window(
    args: tuple, width: int, scale: float, tol: float, cudnn: bool, a: argparse.Namespace
) -> bool:
    """(c) a local layer of window `width` and a global one: numerics and times. True if one failed."""
    q, k, v, ct = args
    failed = False
    variants = []
    for name, window in ((f"window {width}", width), ("global", 2**30)):
        w = jnp.int32(window)
        dense = windowed("xla", None, scale)(q, k, v, w, ct)
        rows = min(a.check_rows, q.shape[0])
        qkv = [np.asarray(t[:rows], np.float64) for t in (q, k, v)]
        err = rel(dense[0][:rows], reference(*qkv, np.zeros((rows, q.shape[1]), np.int32), scale, window))
        errs = [rel(g, x) for g, x in zip(windowed("xla", width, scale)(q, k, v, w, ct), dense, strict=True)]
        if cudnn:
            errs += [
                rel(g, x) for g, x in zip(windowed("cudnn", width, scale)(q, k, v, w, ct), dense, strict=True)
            ]
        bad = err >= tol or max(errs) >= tol
        failed |= bad
        impls = "xla and cudnn" if cudnn else "xla"
        print(f"{name}: xla dense vs float64 {err:.2e}; kernel's window vs dense mask (worst of out, dq, "
              f"dk, dv; {impls}) {max(errs):.2e} {'FAILED' if bad else 'ok'}")  # fmt: skip
        for impl in ("cudnn", "xla") if cudnn else ("xla",):
            variants.append((f"{impl}, {name}, kernel's", windowed(impl, width, scale), (q, k, v, w, ct)))
            variants.append((f"{impl}, {name}, dense mask", windowed(impl, None, scale), (q, k, v, w, ct)))
    print(f"\nattention forward + backward, median of {a.iters}")
    for name, fn, fargs in variants:
        try:
            print(f"{name:<36} {timed(fn, fargs, a.iters) * 1e3:9.3f} ms")
        except Exception as e:  # XLA's (B, N, S, S) float32 scores may not fit: reported, not fatal
            print(f"{name:<36} n/a ({type(e).__name__}: {str(e).splitlines()[0][:100]})")
    return failed


def timed(fn: Callable[..., tuple[jax.Array, ...]], args: tuple, iters: int) -> float:
    """Median seconds of one call, after two warm-up calls (the first compiles)."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    on_gpu = jax.default_backend() == "gpu"
    bench = ModelConfig.named("llama-3.4b-bench")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="B=2, S=128, N=4, K=2, H=32, documents ~20")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=bench.num_heads)
    p.add_argument("--kv_heads", type=int, default=bench.num_kv_heads)
    p.add_argument("--head_dim", type=int, default=bench.head_dim)
    p.add_argument("--doc_len", type=float, default=400, help="mean document length in tokens")
    p.add_argument("--dtype", default="bfloat16" if on_gpu else "float32", choices=["bfloat16", "float32"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--check_rows", type=int, default=2, help="rows checked against the float64 reference")
    p.add_argument("--scale", type=float, default=0.0, help="the scores' factor (0: 1/sqrt(head_dim))")
    p.add_argument(
        "--window", type=int, default=0, help="check a sliding window of this many keys (0: documents)"
    )
    a = p.parse_args(argv)
    if a.small or not on_gpu:  # XLA's (B, N, S, S) float32 scores of the GPU shape would not suit a CPU
        a.batch, a.seq, a.heads, a.kv_heads, a.head_dim, a.doc_len = 2, 128, 4, 2, 32, 20
        a.iters = min(a.iters, 5)
        a.window = min(a.window, 40)
    dtype = jnp.dtype(a.dtype)
    scale = a.scale or 1.0 / math.sqrt(a.head_dim)
    tol = BF16_TOL if dtype == jnp.bfloat16 else F32_TOL
    rng = np.random.default_rng(0)
    b, s, n, kh, h = a.batch, a.seq, a.heads, a.kv_heads, a.head_dim
    q, ct = (jnp.asarray(rng.standard_normal((b, s, n, h)), dtype) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((b, s, kh, h)), dtype) for _ in range(2))
    cudnn = on_gpu and dtype != jnp.float32
    if a.window:
        shape = f"B={b} S={s} N={n} K={kh} H={h} {dtype.name}"
        print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}; {shape}")
        return 1 if check_window((q, k, v, ct), a.window, scale, tol, cudnn, a) else 0
    sizes = packed_document_sizes(s, n)
    bound = sizes[-1]
    few = documents(rng, b, s, a.doc_len)
    many = documents(rng, b, s, max(1.0, s / (2 * bound + 8)))  # every row past the bound
    print(
        f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}; "
        f"B={b} S={s} N={n} K={kh} H={h} {dtype.name}; packed layout: "
        f"{'documents per row ' + str(sizes) if cudnn and packed_layout_applies(n, kh) else 'no'}"
    )
    cases = []
    for name, seg in (("few", few), ("many", many)):
        docs = seg.max(axis=1) + 1
        print(f"{name} documents: {docs.min()}-{docs.max()} per row")
        cases.append((name, (q, k, v, jnp.asarray(seg), ct)))
    failed = False

    # (a) numerics
    for name, args in cases:
        xla = fwd_bwd("xla", True, scale)(*args)
        rows = min(a.check_rows, b)
        qkv = (np.asarray(t[:rows], np.float64) for t in args[:3])
        ref = reference(*qkv, np.asarray(args[3][:rows]), scale)
        err = rel(xla[0][:rows], ref)
        failed |= err >= tol
        verdict = "ok" if err < tol else "FAILED"
        print(f"{name} documents, xla vs float64 per-document reference ({rows} rows): {err:.2e} {verdict}")
        if cudnn:
            errs = [rel(g, x) for g, x in zip(fwd_bwd("cudnn", True, scale)(*args), xla, strict=True)]
            failed |= max(errs) >= tol
            verdict = "ok" if max(errs) < tol else "FAILED"
            print(f"{name} documents, cudnn vs xla: out {errs[0]:.2e}, dq {errs[1]:.2e}, dk {errs[2]:.2e}, "
                  f"dv {errs[3]:.2e} {verdict}")  # fmt: skip

    # (b) speed
    variants = []
    for impl in ("cudnn", "xla") if cudnn else ("xla",):
        variants.append((f"{impl}, no segments", fwd_bwd(impl, False, scale), cases[0][1]))
        variants += [
            (f"{impl}, segments, {name} documents", fwd_bwd(impl, True, scale), args) for name, args in cases
        ]
    print(f"\nattention forward + backward, median of {a.iters}")
    print(f"{'variant':<36} {'ms':>9} {'ratio':>7}")
    base = None
    for name, fn, args in variants:
        try:
            sec = timed(fn, args, a.iters)
        except Exception as e:  # e.g. XLA's (B, N, S, S) float32 scores not fitting: reported, not fatal
            print(f"{name:<36} {'n/a':>9}  ({type(e).__name__}: {str(e).splitlines()[0][:100]})")
            continue
        base = base or sec
        print(f"{name:<36} {sec * 1e3:9.3f} {sec / base:7.2f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
