"""Benchmark jaxzero's resident trainer and offload engine side by side on one accelerator.

Each case runs in its own process (clean peak-memory and RSS readings); the parent prints one table.

    python scripts/bench_offload.py --cases=grad --model=llama-3.4b-bench --batch=8 --seq=2048
    python scripts/bench_offload.py --cases=step --model=llama-3.4b-bench --batch=8 --seq=2048

Cases
  grad   forward + rematerialised backward only, bf16 weights (the gradient computation offload must
         hide the link behind), at `--batch` and `--small_batch` sequences:
           resident-jit    one jit over weights resident on the accelerator (the ceiling)
           resident-units  jaxzero's per-block units, all weights resident (offload.params=none)
           stream-p1/-p2   offload.params=cpu, prefetch 1 / 2 blocks ahead
  step   whole optimizer steps through `build_trainer`, synthetic tokens:
           resident, zero-offload (offload.optimizer=cpu), zero3-offload (+ offload.params=cpu), each
           offloaded case with every unit's state on the host (offload.device_state_units=0), and
           zero-offload-spare / zero3-spare, the same modes with the units whose state the GPU keeps
           left to the planner (the default, -1)

FLOP accounting: "TFLOP/s (8N)" counts 8 x params x tokens (forward, recomputed forward, backward), the
figure BENCHMARKS.md's DeepSpeed comparisons use (a mixture of experts' N leaves out the experts outside
each token's top-k); "model TFLOP/s" is jaxzero's
metrics accounting (6 x matmul params + attention, no recompute). The link bound for streaming is
2 x (streamed bf16 bytes) / measured host-to-device bandwidth.
"""

from __future__ import annotations

# JAX and jaxzero are imported inside the case functions: the parent process only starts one child
# process per case and must not start a backend (or claim the GPU) itself.
import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

GRAD_CASES = ["resident-jit", "resident-units", "stream-p1", "stream-p2"]
STEP_CASES = [
    "resident",
    "zero-offload",
    "zero3-offload",
    "zero-offload-spare",
    "zero3-spare",
    "zero3-delayed",
    "zero3-optax",
    "zero3-noclip",
    "zero3-1pass",
    "zero3-2pass16",
    "zero3-2pass22",
    "zero3-2pass25",
    "zero3-2pass28",
    "zero-offload-1pass",
    "zero3-t15",
    "zero3-t14",
    "auto",
]
HOST_CASES = ["host-phases", "host-bandwidth"]


def _median_time(fn, reps: int) -> float:
    import jax
    import numpy as np

    jax.block_until_ready(fn())  # warm-up (compile)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())  # host sync
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def _h2d_bandwidth() -> float:
    """GB/s of one 2 GiB pinned_host -> device copy (median of 5)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    d = jax.devices()[0]
    host = SingleDeviceSharding(d, memory_kind="pinned_host")
    dev = SingleDeviceSharding(d, memory_kind="device")
    x = jax.device_put(jnp.ones((2**30,), jnp.bfloat16), host)
    t = _median_time(lambda: jax.device_put(x, dev), 5)
    return 2 * 2**30 / t / 1e9


def run_grad_case(case: str, args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxzero.config import TrainConfig
    from jaxzero.models import ModelParams, build_model
    from jaxzero.models.sizes import flops_per_token, inactive_expert_params, param_count, unit_param_counts
    from jaxzero.offload.streaming import StreamedModel
    from jaxzero.overrides import apply_overrides
    from jaxzero.plan import placement, resolve_plan
    from jaxzero.resident import averaged_grads

    params_mode = "cpu" if case.startswith("stream") else "none"
    over = {"model.name": args.model, "data.seq_len": str(args.seq), "data.grad_accum": "1"}
    cfg = apply_overrides(TrainConfig(), {**over, "offload.optimizer": "cpu", "offload.params": params_mode})
    model = build_model(cfg.model)
    n = param_count(cfg.model) - cfg.model.num_layers * inactive_expert_params(cfg.model)
    mesh = placement.make_mesh(jax.devices()[:1])
    plan = resolve_plan(cfg)
    where = placement.offload_placement(mesh, plan)
    # bf16 weights created on the accelerator, then placed (benchmark setup, not the trainer's path).
    init = jax.jit(lambda k: jax.tree.map(lambda x: x.astype(jnp.bfloat16), model.init(k)))
    units = init(jax.random.key(0))
    units = [jax.device_put(w, where.written(u, w)) for u, w in zip(plan.units, units.units())]
    weights = ModelParams.from_units(units)
    out = {"case": case, "params": n, "device": jax.devices()[0].device_kind}
    n_embed, n_block, n_head = unit_param_counts(cfg.model)
    link = _h2d_bandwidth()
    out["h2d_GBps"] = link
    for batch in (args.batch, args.small_batch):
        tokens = batch * args.seq
        window = jax.random.randint(jax.random.key(1), (1, batch, args.seq + 1), 0, cfg.model.vocab_size)
        if case == "resident-jit":
            run = partial(jax.jit(partial(averaged_grads, model)), weights, window)
        else:
            prefetch = 2 if case == "stream-p2" else 1
            loss_scale = jax.device_put(np.float32(1.0), where.device)  # none
            run = partial(
                StreamedModel(model, where, 1, prefetch=prefetch).grads, weights, window, loss_scale
            )
        try:
            t = _median_time(run, args.reps)
        except Exception as e:  # noqa: BLE001 - report and go on with the next size
            out[f"T{tokens}"] = {"error": repr(e)[:400]}
            continue
        r = {
            "s": t,
            "tokens_per_s": tokens / t,
            "tflops_8N": 8 * n * tokens / t / 1e12,
            "model_tflops": flops_per_token(cfg.model, args.seq) * tokens / t / 1e12,
        }
        if case.startswith("stream"):
            streamed_bytes = cfg.model.num_layers * n_block * 2
            r["link_bound_s"] = 2 * streamed_bytes / (link * 1e9)
            r["of_link_bound"] = r["link_bound_s"] / t
        peak = max((d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in jax.local_devices())
        r["gpu_peak_gib"] = peak / 2**30
        out[f"T{tokens}"] = r
        print(json.dumps({case: {f"T{tokens}": r}}), flush=True)
    return out


def run_step_case(case: str, args) -> dict:
    import jax
    import numpy as np

    from jaxzero.config import TrainConfig
    from jaxzero.data import DataShard, build_data
    from jaxzero.models.sizes import flops_per_token, inactive_expert_params, param_count
    from jaxzero.overrides import apply_overrides
    from jaxzero.planner import preflight
    from jaxzero.run import distributed
    from jaxzero.run.loop import settle_heap
    from jaxzero.run.metrics import host_rss_gib
    from jaxzero.trainer import build_trainer

    # Every case names its placement: the planner (offload.*=auto, the default) would choose its own;
    # offloaded cases keep every unit's state on the host unless named "-spare".
    host = {"offload.device_state_units": "0"}
    zero3 = {"offload.optimizer": "cpu", "offload.params": "cpu", **host}
    zero_offload = {"offload.optimizer": "cpu", "offload.params": "none", **host}
    offload = {
        "resident": {"offload.optimizer": "none", "offload.params": "none"},
        # The planner's choice for this machine (offload.*=auto; machine.* may describe a smaller card).
        "auto": {},
        "zero-offload": zero_offload,
        "zero3-offload": zero3,
        "zero-offload-spare": {"offload.optimizer": "cpu", "offload.params": "none"},
        "zero3-spare": {"offload.optimizer": "cpu", "offload.params": "cpu"},
        "zero3-delayed": {**zero3, "offload.update": "delayed"},
        "zero3-optax": {**zero3, "offload.fused_update": "false"},
        "zero3-noclip": {**zero3, "optimizer.grad_clip": "0"},
        # Two-pass updates (offload.two_pass_units; the default -1 is adaptive): none, fixed counts.
        "zero3-1pass": {**zero3, "offload.two_pass_units": "0"},
        "zero3-2pass16": {**zero3, "offload.two_pass_units": "16"},
        "zero3-2pass22": {**zero3, "offload.two_pass_units": "22"},
        "zero3-2pass25": {**zero3, "offload.two_pass_units": "25"},
        "zero3-2pass28": {**zero3, "offload.two_pass_units": "28"},
        "zero-offload-1pass": {**zero_offload, "offload.two_pass_units": "0"},
        # Fewer host update threads than cores (offload.host_threads; default one per core).
        "zero3-t15": {**zero3, "offload.host_threads": "15"},
        "zero3-t14": {**zero3, "offload.host_threads": "14"},
    }[case]
    over = {
        "model.name": args.model,
        "data.seq_len": str(args.seq),
        "data.batch_size": str(args.batch),
        "data.source": "synthetic",
        "steps": "1000",
        "optimizer.lr": "1e-5",
        "checkpoint.enabled": "false",  # nothing is saved; the memory plan need not hold a snapshot
        **dict(kv.split("=", 1) for kv in args.set),
        **offload,  # the case's own settings win over --set
    }
    cfg = apply_overrides(TrainConfig(), over)
    # As the program does: the placement decided before JAX's backend starts, which lets XLA's
    # allocator take 95% of each GPU and sizes the pinned pool for it (the library path decides on
    # a backend already running at XLA's default share).
    # bench_mesh.py's processes: its variables
    decision = preflight.decide_before_jax(cfg, distributed.detect())
    trainer = build_trainer(decision.config, decision=decision)
    data = build_data(
        cfg.data, cfg.model.vocab_size, cfg.seed, DataShard(jax.process_index(), jax.process_count())
    )
    batches = data.train_iter()
    t0 = time.perf_counter()
    state = trainer.init(jax.random.key(0))
    if args.start_count:  # every int32 scalar of the state: the optimizer's counts and the step
        state = jax.tree.map(
            lambda x: (
                jax.device_put(np.int32(args.start_count), x.sharding)
                if isinstance(x, jax.Array) and x.ndim == 0 and x.dtype == np.int32
                else x
            ),
            state,
        )
    jax.block_until_ready(state)
    init_s = time.perf_counter() - t0
    losses, ts, norms = [], [], []
    for k in range(args.warmup + args.steps):
        if k == 1 and args.settle_heap:  # as the program's loop does after its first step
            settle_heap()
        if k == args.warmup and trainer.timings is not None:
            trainer.timings(1.0, 1)  # drop the warm-up steps' events
            t_timed = time.perf_counter()
        t = time.perf_counter()
        state, m = trainer.step(state, trainer.put_batch(next(batches)))
        loss = float(jax.device_get(m.loss))  # host sync: time whole steps
        ts.append(time.perf_counter() - t)
        losses.append(loss)
        norms.append(float(jax.device_get(m.grad_norm)))
    step_s = float(np.median(ts[args.warmup :]))
    breakdown = {}
    if trainer.timings is not None:
        jax.block_until_ready(state)  # the last host update too (a host sync)
        breakdown = trainer.timings(time.perf_counter() - t_timed, args.steps)
    n = param_count(cfg.model) - cfg.model.num_layers * inactive_expert_params(cfg.model)
    tokens = args.batch * args.seq
    peak = max((d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in jax.local_devices())
    out = {
        "case": case,
        "params": n,
        "device": jax.devices()[0].device_kind,
        "init_s": init_s,
        "first_step_s": ts[0],
        "step_s": step_s,
        "mean_step_s": float(np.mean(ts[args.warmup :])),
        "step_times": ts,
        "tokens_per_s": tokens / step_s,
        "tflops_8N": 8 * n * tokens / step_s / 1e12,
        "model_tflops": flops_per_token(cfg.model, args.seq) * tokens / step_s / 1e12,
        "start_count": args.start_count,
        "settle_heap": args.settle_heap,
        "gpu_peak_gib": peak / 2**30,
        "host_rss_gib": host_rss_gib(),
        # What the memory plan predicted for this run (the planner's and the memory check's figures):
        # accelerator state + activations per device, host RAM per process.
        **_predicted(trainer),
        "devices": jax.device_count(),
        "losses": losses,
        "grad_norms": norms,
        "grad_clip": cfg.optimizer.grad_clip,
        "breakdown": breakdown,
    }
    print(json.dumps(out), flush=True)
    return out


def _predicted(trainer) -> dict:
    import jax

    from jaxzero.models import build_model
    from jaxzero.plan import placement
    from jaxzero.planner import memory, runtime
    from jaxzero.planner.cost import predict
    from jaxzero.planner.machine import detect_machine

    mesh = trainer.mesh
    machine = detect_machine(
        trainer.config,
        mesh.local_devices[0],
        devices=mesh.size,
        processes=placement.process_count(mesh),
        local_processes=placement.processes_on_this_host(mesh),
    )
    shapes = jax.eval_shape(build_model(trainer.config.model).init, jax.random.key(0))
    need = memory.plan_memory(
        trainer.config,
        trainer.plan,
        devices=mesh.size,
        processes=placement.process_count(mesh),
        whole=placement.whole_params(shapes, mesh.size),
        pool_cap=runtime.pinned_pool_cap(),
    )
    own = memory.process_allowance(need) if mesh.local_devices[0].platform == "gpu" else 0
    return {
        "plan_gpu_gib": (need.accelerator_state + need.activations) / 2**30,
        # the process's RSS: its arrays and pools, and what a GPU process holds of its own
        "plan_host_gib": (need.host + own) / 2**30,
        # The planner's cost model for the same placement on the machine it detects (or machine.*).
        "plan_step_s": predict(trainer.config, trainer.plan, machine).step_s,
        "plan": trainer.plan.describe(trainer.config.optimizer.name, f"{mesh.size} devices"),
    }


def run_host_case(case: str, args) -> dict:
    """The host update alone on real-size state: every block of `--model` updated through
    `HostOptimizer.update_unit` from 16 concurrent unit threads (as the pipeline runs it), with the
    fused kernels (float32 and bfloat16 moments) and with optax on XLA:CPU; then torch's fused CPU
    AdamW on the same number of parameters, in the same process, for reference."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxzero.config import TrainConfig
    from jaxzero.models import build_model
    from jaxzero.offload.host_optimizer import HostOptimizer, HostUnit, UnitUpdate
    from jaxzero.overrides import apply_overrides
    from jaxzero.plan import placement, resolve_plan

    over = {"model.name": args.model, "optimizer.warmup_steps": "0", "data.grad_accum": "1"}
    cfg = apply_overrides(TrainConfig(), {**over, "offload.optimizer": "cpu", "offload.params": "cpu"})
    model = build_model(cfg.model)
    mesh = placement.make_mesh(jax.devices()[:1])
    where = placement.offload_placement(mesh, resolve_plan(cfg))
    shape = jax.eval_shape(model.init, jax.random.key(0))
    init_block = jax.jit(model.init_block, out_shardings=where.host)
    num_layers = cfg.model.num_layers
    grads = jax.device_put(
        jax.tree.map(lambda s: np.full(s.shape, 1e-3, jnp.bfloat16), shape.blocks[0]), where.pinned
    )
    per_block = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shape.blocks[0]))
    n = num_layers * per_block
    out = {"case": case, "params": n, "device": jax.devices()[0].device_kind, "cpus": os.cpu_count()}
    variants = [("fused", "float32", True), ("fused", "bfloat16", True), ("optax", "float32", False)]
    pool = ThreadPoolExecutor(16)
    g_host = jax.tree.map(lambda g: [np.asarray(g)], grads)  # pinned_host views, as the pipeline reads them

    def timed(fn, units, reps=4):
        """Best of reps 2..: `fn` on every unit from 16 threads (unit i at priority i); new units."""
        ts = []
        for _rep in range(reps):
            t = time.perf_counter()
            units = [f.result() for f in [pool.submit(fn, i, u) for i, u in enumerate(units)]]
            ts.append(time.perf_counter() - t)
        return units, min(ts[1:]), ts

    def measure(name: str, state_dtype: str, fused: bool, threads: int = 0) -> None:
        vcfg = apply_overrides(
            cfg,
            {
                "optimizer.state_dtype": state_dtype,
                "offload.fused_update": str(fused),
                "offload.host_threads": str(threads),
            },
        )
        plan = resolve_plan(vcfg)
        host = HostOptimizer(vcfg.optimizer, 100, shape, placement.offload_placement(mesh, plan), 1)
        init_state = jax.jit(host.tx.blocks.init, out_shardings=where.host)
        units = []
        for i in range(num_layers):
            m = init_block(jax.random.key(i))
            units.append(HostUnit(m, init_state(m), None))
        gmul = host.grad_multiplier(np.float32(0.5), np.float32(1.0))

        def full(i, u):  # one pass, the new weights into the previous ones' pinned buffers
            return host.update_unit(UnitUpdate(plan.blocks[i], u, g_host, gmul), i, recycle=u.weights)

        def weights(i, u):  # a two-pass update's first pass
            new = host.update_weights(UnitUpdate(plan.blocks[i], u, g_host, gmul), i, recycle=u.weights)
            return u._replace(weights=new)

        def state(i, u):  # and its second
            return host.commit(UnitUpdate(plan.blocks[i], u, g_host, gmul), i, u.weights)

        key = f"{name}_{state_dtype}" + (f"_t{threads}" if threads else "")
        passes = [("", full)]
        if fused and state_dtype == "float32":  # the two passes timed apart
            passes += [("_weights_pass", weights), ("_state_pass", state)]
        for suffix, fn in passes:
            units, t, ts = timed(fn, units)
            out[f"{key}{suffix}_G_per_s"] = n / t / 1e9
            print(json.dumps({key + suffix: ts, "G_per_s": n / t / 1e9}), flush=True)

    for variant in variants:
        measure(*variant)
    for threads in args.host_threads:  # the fused float32 passes on fewer or more update threads
        measure("fused", "float32", True, threads)
    try:
        import torch

        nt = min(n, 1024**3)
        p = torch.ones(nt)
        p.grad = torch.full((nt,), 1e-3)
        opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
        opt.step()
        t = time.perf_counter()
        for _ in range(3):
            opt.step()
        out["torch_fused_adamw_G_per_s"] = 3 * nt / (time.perf_counter() - t) / 1e9
        out["torch_threads"] = torch.get_num_threads()
    except Exception as e:  # noqa: BLE001
        out["torch_err"] = repr(e)[:200]
    print(json.dumps(out), flush=True)
    return out


def run_bandwidth_case(case: str, args) -> dict:
    """The host's memory bandwidth as the update's threads reach it: a read, a copy and a triad over
    3 x 1 GiB float32 arrays, cut in 4M-element chunks run by numba kernels (no GIL) from T threads,
    as the fused update runs; best of 3 after a warm-up. Bytes counted are bytes read plus bytes
    written (a write's read-for-ownership not counted, as in STREAM). Also the CPU model and NUMA
    nodes, and this process's allowed cores."""
    import numba
    import numpy as np

    @numba.njit(nogil=True, cache=False, fastmath=True)  # a vectorised sum
    def read(a):
        s = np.float32(0.0)
        for j in range(a.shape[0]):
            s += a[j]
        return s

    @numba.njit(nogil=True, cache=False)
    def copy(a, b):
        for j in range(a.shape[0]):
            b[j] = a[j]

    @numba.njit(nogil=True, cache=False)
    def triad(a, b, c):
        for j in range(a.shape[0]):
            a[j] = b[j] + np.float32(0.5) * c[j]

    n, chunk = 1 << 28, 1 << 22
    a, b, c = (np.ones(n, np.float32) for _ in range(3))
    kernels = {
        "read": (lambda s: read(a[s]), 4),
        "copy": (lambda s: copy(a[s], b[s]), 8),
        "triad": (lambda s: triad(a[s], b[s], c[s]), 12),
    }
    slices = [slice(k, k + chunk) for k in range(0, n, chunk)]
    out: dict = {"case": case, "params": 0, "device": "host", "cpus": os.cpu_count()}
    try:
        out["cpu_model"] = next(
            ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")
        )
        nodes = sorted(os.listdir("/sys/devices/system/node"))
        out["numa_nodes"] = {
            d: open(f"/sys/devices/system/node/{d}/cpulist").read().strip()
            for d in nodes
            if d.startswith("node")
        }
    except OSError as e:
        out["topology_err"] = repr(e)
    out["affinity"] = len(os.sched_getaffinity(0))
    for threads in (1, 2, 4, 8, 12, 15, 16):
        pool = ThreadPoolExecutor(threads)
        for name, (fn, bytes_per) in kernels.items():
            list(pool.map(fn, slices[:threads]))  # compile and touch
            ts = []
            for _ in range(4):
                t = time.perf_counter()
                list(pool.map(fn, slices))
                ts.append(time.perf_counter() - t)
            out[f"{name}_t{threads}_GBps"] = bytes_per * n / min(ts[1:]) / 1e9
        pool.shutdown()
        print(json.dumps({k: v for k, v in out.items() if f"_t{threads}_" in k}), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="grad", help="grad, step, or a comma list of case names")
    ap.add_argument("--case", default="", help=argparse.SUPPRESS)  # child process: run one case
    ap.add_argument("--model", default="llama-3.4b-bench")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--small_batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument(
        "--host_threads",
        type=lambda s: [int(t) for t in s.split(",") if t],
        default=[],
        help="host cases: also time the fused passes with these offload.host_threads (comma list)",
    )
    ap.add_argument(
        "--settle_heap",
        type=int,
        default=1,
        help="step cases: 1 (the program's way): exempt the objects alive after the first step from "
        "Python's full garbage collections (`jaxzero.run.loop.settle_heap`); 0: leave the collector as it is",
    )
    ap.add_argument(
        "--start_count",
        type=int,
        default=0,
        help="step cases: start at this update number (the optimizer's step counts set after init): "
        "a long run's steady state, where Adam's bias corrections are exactly 1 (from 337 at the defaults)",
    )
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override (step cases)"
    )
    args = ap.parse_args()
    if args.case:
        import jax

        jax.config.update("jax_threefry_gpu_kernel_lowering", True)  # as `python -m jaxzero.train` does
        if os.environ.get("JAX_COORDINATOR_ADDRESS"):  # one of several processes (bench_mesh.py)
            jax.distributed.initialize(
                os.environ["JAX_COORDINATOR_ADDRESS"],
                int(os.environ["JAX_NUM_PROCESSES"]),
                int(os.environ["JAX_PROCESS_ID"]),
            )
        runner = {
            **dict.fromkeys(GRAD_CASES, run_grad_case),
            **dict.fromkeys(STEP_CASES, run_step_case),
            "host-phases": run_host_case,
            "host-bandwidth": run_bandwidth_case,
        }[args.case]
        result = runner(args.case, args)
        print("RESULT " + json.dumps(result), flush=True)
        return

    names = {"grad": GRAD_CASES, "step": STEP_CASES, "host": HOST_CASES}.get(
        args.cases, args.cases.split(",")
    )
    results = []
    for k, case in enumerate(names):
        cmd = [sys.executable, __file__, f"--case={case}"] + [
            a for a in sys.argv[1:] if not a.startswith("--cases")
        ]
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        repeat = f"-{k}" if names.count(case) > 1 else ""  # a case named twice keeps both logs
        log = os.path.join(args.out, f"bench_{case}{repeat}.log")
        with open(log, "w") as f:
            f.write(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(
                f"{case}: FAILED rc={proc.returncode} ({time.perf_counter() - t:.0f}s); "
                f"tail:\n{proc.stderr[-1500:]}"
            )
            continue
        results.append(json.loads(lines[-1][7:]))
        print(f"{case}: done in {time.perf_counter() - t:.0f}s", flush=True)
    with open(os.path.join(args.out, f"bench_{args.cases.replace(',', '_')}.json"), "w") as f:
        json.dump(results, f, indent=1)
    print_table(results, args)


def _pass_bytes(key: str) -> int:
    """Host memory bytes per parameter of a timed host pass (bf16 gradients and new bf16 weights):
    AdamW in one pass reads masters, moments and gradient and writes masters, moments and weights."""
    if key.startswith("torch"):
        return 28  # fp32 gradients, no compute-dtype copy: 16 read + 12 written
    moments = 4 if "float32" in key else 2
    read = 4 + 2 * moments + 2
    if "_weights_pass" in key:
        return read + 2
    if "_state_pass" in key:
        return read + 4 + 2 * moments
    return 0 if key.startswith("optax") else read + 4 + 2 * moments + 2


def print_table(results: list[dict], args) -> None:
    if not results:
        return
    print(f"\nmodel {args.model}, {results[0]['params'] / 1e9:.2f}B params, device {results[0]['device']}")
    if "step_s" in results[0]:
        base = next((r["step_s"] for r in results if r["case"] == "resident"), None)
        print(
            f"{'case':16} {'s/step':>7} {'mean':>7} {'tok/s':>8} {'TFLOP/s(8N)':>11} {'model TF/s':>10} "
            f"{'GPU GiB':>8} {'RSS GiB':>8} {'vs resident':>11}"
        )
        for r in results:
            ratio = f"{base / r['step_s']:.2f}x" if base else "-"
            print(
                f"{r['case']:16} {r['step_s']:7.3f} {r.get('mean_step_s', 0):7.3f} {r['tokens_per_s']:8.0f} "
                f"{r['tflops_8N']:11.1f} "
                f"{r['model_tflops']:10.1f} {r['gpu_peak_gib']:8.1f} {r['host_rss_gib']:8.1f} {ratio:>11}"
            )
        # The gradient norm's trace: how often clipping fires.
        for r in results:
            norms, clip = r.get("grad_norms", []), r.get("grad_clip", 0)
            if norms and clip:
                clipped = sum(x > clip for x in norms)
                q = sorted(norms)
                print(
                    f"{r['case']:16} grad norm: first {norms[0]:.3g}, median {q[len(q) // 2]:.3g}, last "
                    f"{norms[-1]:.3g}, min {q[0]:.3g}; clipped (norm > {clip:g}) in {clipped} of "
                    f"{len(norms)} steps"
                )
        for r in results:
            if r.get("breakdown"):
                print(
                    f"{r['case']:16} per step: "
                    + " | ".join(f"{k.removesuffix('_s')} {v:.3f}" for k, v in r["breakdown"].items())
                )
        return
    if results[0]["case"] in HOST_CASES:
        for r in results:
            if r["case"] == "host-bandwidth":
                print(
                    f"\nhost memory bandwidth, GB/s read + written ({r.get('cpu_model', '?')}, NUMA "
                    f"{r.get('numa_nodes', '?')}, {r['affinity']} cores allowed):"
                )
                threads = sorted({int(k.split("_t")[1].split("_")[0]) for k in r if k.endswith("_GBps")})
                print(f"  {'threads':8}" + "".join(f"{t:>8}" for t in threads))
                for name in ("read", "copy", "triad"):
                    print(f"  {name:8}" + "".join(f"{r[f'{name}_t{t}_GBps']:8.1f}" for t in threads))
                continue
            print(f"\nhost update of {r['params'] / 1e9:.2f}B block params, {r['cpus']} CPUs:")
            for k, v in r.items():
                if k.endswith("_G_per_s"):
                    gbps = f"{v * _pass_bytes(k):6.1f} GB/s" if _pass_bytes(k) else ""
                    print(f"  {k[:-8]:28} {v:6.2f} G params/s {gbps}")
        return
    for key in sorted({k for r in results for k in r if k.startswith("T")}, key=lambda k: -int(k[1:])):
        base = next(
            (r[key]["s"] for r in results if r["case"] == "resident-jit" and "s" in r.get(key, {})), None
        )
        print(f"\n{int(key[1:])} tokens/step: forward + rematerialised backward")
        print(
            f"{'case':16} {'s':>7} {'TFLOP/s(8N)':>11} {'vs resident-jit':>15} {'of link bound':>13} "
            f"{'GPU GiB':>8}"
        )
        for r in results:
            x = r.get(key, {})
            if "s" not in x:
                print(f"{r['case']:16} {x.get('error', 'missing')[:80]}")
                continue
            ratio = f"{base / x['s']:.2f}" if base else "-"
            lb = f"{x['of_link_bound']:.2f}" if "of_link_bound" in x else "-"
            print(
                f"{r['case']:16} {x['s']:7.3f} {x['tflops_8N']:11.1f} {ratio:>15} {lb:>13} "
                f"{x['gpu_peak_gib']:8.1f}"
            )


if __name__ == "__main__":
    main()
