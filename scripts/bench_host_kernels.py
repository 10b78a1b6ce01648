"""The fused host AdamW kernels alone, pass by pass: what bounds them on this host.

For float32 and bfloat16 moments and each pass a step runs (`full`: the one-pass update; `weights`
and `state`: the two halves of a two-pass update), at an early update number (Adam's bias
corrections divide) and a late one (they are exactly 1 and the kernels skip those divisions):

- in cache: one thread updating 32K parameters over and over (what the arithmetic costs a core);
- streaming: `--params` parameters in chunks of `host_kernels.CHUNK` from T threads (what a step's
  host update reaches; T from `--threads`);
- each with the kernels' layouts (`host_kernels.LAYOUTS`: the tile, elements widened into a thread's
  scratch at a time, and the prefetch block, elements updated between requests for the next tile's
  lines, 0 for none): by default the kernels' own for each moment dtype, what a run uses; with
  `--tiles` and `--prefetch`, every combination of those (compiled for this script);
- `--passes`, `--moments` and `--counts` narrow the table; `--llvm_options` compiles the kernels
  with LLVM options (e.g. `--force-vector-width=16`: 512-bit vectors where LLVM prefers 256) into a
  fresh cache, to compare against a run without them.

Prints the host's CPU (lscpu's summary) first and a table last; `--out=DIR` also writes the rows as
JSON. CPU only: run it on the GPU box to measure that box's host.

    python scripts/bench_host_kernels.py --params=536870912 --threads=8,15,16 --tiles=65536,16384 \
        --prefetch=0,128 --out=$OUT
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxzero.config import OptimizerConfig  # noqa: E402
from jaxzero.offload import host_kernels as hk  # noqa: E402

PASS_BYTES = {  # bytes moved per parameter (fp32 moments, bf16 moments), bf16 gradient and weights
    "full": (28, 20),
    "weights": (16, 12),
    "state": (26, 18),
}
EARLY, LATE = 3, 1000  # update numbers: bias corrections divide / are exactly 1 (b1 0.9, b2 0.95)


def cpu_summary() -> dict:
    """lscpu's fields that bound the kernels (model, sockets, cores, threads per core, NUMA)."""
    keep = ("Model name", "Socket(s)", "Core(s) per socket", "Thread(s) per core", "NUMA node(s)", "CPU(s)")
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    rows = (line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {k.strip(): v.strip() for k, v in rows if k.strip() in keep}


def state(n: int, m16: bool, seed: int = 0) -> tuple[np.ndarray, ...]:
    """Masters, moments, a bf16 gradient and bf16 weights of n parameters, at training-like scales
    (a 16M-element random block tiled: drawing n normals would take longer than the runs)."""
    r = np.random.default_rng(seed)
    base = min(n, 1 << 24)

    def tiled(x: np.ndarray) -> np.ndarray:
        return np.resize(x, n)

    def bf16(x: np.ndarray) -> np.ndarray:
        return (x.view(np.uint32) >> 16).astype(np.uint16)

    p = tiled(r.standard_normal(base, dtype=np.float32) * np.float32(0.02))
    m = tiled(r.standard_normal(base, dtype=np.float32) * np.float32(1e-3))
    v = tiled(r.random(base, dtype=np.float32) * np.float32(1e-6))
    g = tiled(bf16(r.standard_normal(base, dtype=np.float32) * np.float32(1e-3)))
    g.flags.writeable = False
    if m16:
        m, v = bf16(m), bf16(v)
    return p, m, v, g, np.zeros(n, np.uint16)


def run_pass(rule: hk.FusedRule, arrays, pass_: str, count: int, pool, n: int, reps: int) -> float:
    """Seconds of the best of `reps` (after one warm-up) of one pass over all n parameters."""
    p, m, v, g, w = arrays
    kernel = rule.kernel(count, 1e-4, 0.5, pass_)
    out = None if pass_ == "state" else w
    pieces = hk.chunks(n)

    def one(s: slice) -> None:
        kernel(p[s], m[s], v[s], g[s], None if out is None else out[s], 0.1)

    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        if pool is None:
            one(slice(0, n))
        else:
            list(pool.map(one, pieces))
        times.append(time.perf_counter() - t)
    return min(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=1 << 29, help="parameters of the streaming runs")
    ap.add_argument("--threads", default="8,15,16", help="thread counts of the streaming runs")
    ap.add_argument(
        "--tiles", default="", help="kernel tiles to compare, elements (default: the kernels' own)"
    )
    ap.add_argument(
        "--prefetch",
        default="",
        help="prefetch blocks to compare, elements; 0: none (default: the kernels' own)",
    )
    ap.add_argument("--counts", default=f"{EARLY},{LATE}", help="update numbers to time")
    ap.add_argument("--passes", default="weights,state,full", help="passes to time")
    ap.add_argument("--moments", default="fp32,bf16", help="moment dtypes to time")
    ap.add_argument(
        "--llvm_options",
        default="",
        help="LLVM options for the kernels' compilation, e.g. --force-vector-width=16",
    )
    ap.add_argument("--out", default="", help="directory for host_kernels.json")
    args = ap.parse_args()
    if args.llvm_options:  # compiled afresh, not loaded from a cache compiled without them
        import llvmlite.binding

        for option in args.llvm_options.split():
            llvmlite.binding.set_option("", option)
        os.environ["JAXZERO_CACHE_DIR"] = tempfile.mkdtemp()
    threads = [int(t) for t in args.threads.split(",")]
    tiles = [int(t) for t in args.tiles.split(",") if t]
    fetches = [int(f) for f in args.prefetch.split(",") if f]
    counts = [int(c) for c in args.counts.split(",")]
    assert max(tiles, default=0) * 4 <= hk.SCRATCH, "a thread's scratch holds host_kernels.SCRATCH elements"
    cpu = cpu_summary()
    print(json.dumps({"cpu": cpu, "os_cpus": os.cpu_count()}), flush=True)
    rule = hk.FusedRule.of(OptimizerConfig())
    assert rule.exact_ones(EARLY) == frozenset() and rule.exact_ones(LATE) == {"bc1", "bc2"}
    rows = []
    for m16 in [m == "bf16" for m in args.moments.split(",")]:
        small = state(1 << 15, m16)
        big = state(args.params, m16, seed=1)
        passes = args.passes.split(",")
        own_tile, own_fetch = hk.LAYOUTS[m16]
        layouts = list(itertools.product(tiles or [own_tile], fetches or [own_fetch]))
        for (tile, fetch), pass_, count in itertools.product(layouts, passes, counts):
            hk.LAYOUTS = {**hk.LAYOUTS, m16: (tile, fetch)}  # the generator reads it
            nbytes = PASS_BYTES[pass_][m16]
            row = {"moments": "bf16" if m16 else "fp32", "pass": pass_, "count": count, "tile": tile}
            row["prefetch"] = fetch
            row["llvm_options"] = args.llvm_options
            row["in_cache_1t"] = (1 << 15) / run_pass(rule, small, pass_, count, None, 1 << 15, 200) / 1e9
            for t in threads:
                with ThreadPoolExecutor(t) as pool:
                    sec = run_pass(rule, big, pass_, count, pool, args.params, 3)
                row[f"t{t}"] = args.params / sec / 1e9
                row[f"t{t}_GBps"] = row[f"t{t}"] * nbytes
            rows.append(row)
            print(json.dumps(row), flush=True)
        del small, big
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "host_kernels.json").write_text(json.dumps({"cpu": cpu, "rows": rows}, indent=1))
    cols = ["in_cache_1t", *(f"t{t}" for t in threads)]
    print(
        "\nG params/s (GB/s at the largest thread count); count 3: bias corrections divide, 1000: they are 1"
    )
    head = f"{'moments':8s}{'pass':9s}{'count':>6s}{'tile':>7s}{'pf':>5s}"
    print(head + "".join(f"{c:>13s}" for c in cols) + f"{'GB/s':>8s}")
    for r in rows:
        gbps = r[f"t{threads[-1]}_GBps"]
        vals = "".join(f"{r[c]:13.2f}" for c in cols)
        key = f"{r['moments']:8s}{r['pass']:9s}{r['count']:6d}{r['tile']:7d}{r['prefetch']:5d}"
        print(key + vals + f"{gbps:8.1f}")


if __name__ == "__main__":
    main()
