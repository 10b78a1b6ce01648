"""The placement planner: for this config on this machine, where every unit's weights and state live.

`offload.params=auto` and `offload.optimizer=auto` (the defaults) leave the placement to `decide`,
which runs before anything is allocated. It enumerates the placements the config leaves open, keeps
those that fit the accelerator's memory and host RAM (`jaxzero.memory`'s byte counts and capacity
rules), predicts each one's step time, and picks the fastest: among placements predicted within 1% of
the fastest, the simplest (resident, then ZeRO-Offload, then ZeRO-3 offload; adaptive two-pass
updates; the fewest units with state on the accelerator; the fewest resident blocks).

    machine = detect_machine(cfg, device)       # or Machine(...) for a box you do not have
    decision = decide(cfg, machine)             # ConfigError, with what would fit, if nothing does
    decision.config                             # cfg with every auto key decided
    print(decision.table())

The candidates (only keys the user left open are decided; explicit ones are honoured):
- resident: `offload.optimizer=none`, `offload.params=none`;
- ZeRO-Offload: `offload.optimizer=cpu`, `offload.params=none`, with `offload.device_state_units`
  K = 0 .. num_layers + 1 (the first K units in forward order keep masters and state on the GPU);
- ZeRO-3 offload: `offload.optimizer=cpu`, `offload.params=cpu`, with `offload.resident_blocks` R and K.
`offload.two_pass_units` left at -1 (adaptive) becomes 0 for a placement that fits only so: two-pass
updates keep gradients in pinned memory a step longer. `offload.activations` left at none becomes cpu
(block inputs wait in pinned host memory) for an offloaded placement that fits only so: the copies
cost link time, (L - 1) block inputs each way per step, which the cost model's link term counts.
K, R, the two-pass count and the activations' place are decided only while the mode is
(`offload.params` or `offload.optimizer` auto, `resident_blocks` / `device_state_units` left at 0).

Fit: the accelerator must hold its state plus the activation estimate per device; the host, the plan's
host bytes per process (XLA's pinned pool, what a checkpoint save adds and the process's own
`memory.GPU_PROCESS_RSS` included) within 95% of its share of the host's RAM (`HOST_HEADROOM`); where
XLA's pinned pool is already fixed, its cap must hold the pinned need (`memory.configure_pinned_pool`'s
rule). On a CPU-only backend the "accelerator" is host RAM, counted as `memory.check_fits` does there.

The cost model, per step (tokens per device T, parameters N; `Machine`'s rates):
- gpu = 8 N T / gpu_flops: forward, rematerialised forward and backward; the forward is 1/4 of it,
  spread over units by their matmul work (blocks; the head's hidden x vocab; the embedding none).
  Sequences longer than the calibration's 2,048 tokens add their attention (`ATTENTION_COST`).
- link = streamed compute-dtype weights crossing twice (forward, backward) plus the new weights of
  host-updated units that live on the accelerator (once), over h2d; plus the gradients of host-updated
  units over d2h. Per device (each device moves its shard).
- host = the host update's memory traffic over host_bw: per parameter of a host-state unit, one pass
  reads masters, moments and gradient and writes masters, moments and the compute weights: 28 bytes
  for AdamW with fp32 moments and bf16 gradients. A two-pass unit moves 16 in its first pass (new
  weights only) and 26 in its second (masters and moments), 42 in all (BENCHMARKS.md, issue 4, "the
  host kernels are memory-bound"). With bf16 moments the kernels measured about the fp32-moment rate
  per parameter, not their 20 bytes' (6.7B at 16K tokens, 8B at 8K), so they are timed as fp32.
  optax on XLA:CPU (`offload.fused_update=false`, float16) is 1.75x slower (2.56 against 4.48 G
  params/s, issue 4).
- exposed = the host update the next forward pass waits for. With clipping (or float16) no host unit
  updates before the global norm is known, at the end of the backward pass; the host then runs each
  unit's first pass in forward order while the GPU's forward follows it unit by unit, so the wait is
  what the host's first passes exceed the forward by, unit by unit (units with state on the GPU are
  ready at once and remove their share from the front of that wait). Without clipping a unit's update
  starts when its gradients land during the backward pass. The delayed update exposes nothing.
- step = max(gpu + exposed, link, host). The bottleneck is the largest term: "GPU compute" (or "host
  update before the forward" when the exposed wait is over 5% of the step), "link" or "host update".

Calibration (one H200, PCIe 54 GB/s each way, 16 cores; the defaults below), measured against
predicted s/step: the 3.37B Llama (`llama-3.4b-bench`) at 16K tokens per step resident 0.774 / 0.75;
ZeRO-Offload and ZeRO-3 offload 1.15-1.25 / 1.19 (one-pass updates 1.28-1.39 / 1.36; the delayed
update 0.815-0.863 / 0.79; no clipping 1.03 / 0.99); at 32K tokens resident 1.455 / 1.50, ZeRO-3
offload 1.762 / 1.59, ZeRO-Offload 1.723 / 1.59; the 6.7B Llama (`llama-7b`) resident at 32K 2.89 /
2.99, under full offload with bf16 moments and one-pass updates 3.55 / 3.84 at 32K tokens and 2.77
/ 2.71 at 16K; on one H100 (0.7x the H200's step rate), Llama-3.1-8B's shape at 8K tokens under full
offload, bf16 moments, one-pass updates 2.97 / 2.87. `tests/test_planner.py` holds the model to
these within 20%. These are predictions; measured steps vary 5-10% from machine to machine.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import jax

from jaxzero import memory
from jaxzero.config import ConfigError, TrainConfig, validate
from jaxzero.memory import GiB, MemoryPlan
from jaxzero.models.sizes import NAMED_SIZES, param_count, unit_param_counts
from jaxzero.plan import OffloadPlan, Tier, UnitKind, UnitPlan, UpdateMode, available_cores, resolve_plan

GB = 10**9
# The fraction of the host RAM it sees that a chosen placement leaves free: the kernel and the page
# cache need room beside the run, and the memory plan is within 6% of the measured RSS (BENCHMARKS.md).
# A 13B plan at 123.9 of 124 GiB was killed by the kernel's OOM killer on a 125 GiB box.
HOST_HEADROOM = 0.05
# Likewise of the accelerator's memory (what XLA's allocator may use) for a placement the planner
# chooses: its estimate was 0-9% under the measured peak (BENCHMARKS.md), and fragmentation needs room.
GPU_HEADROOM = 0.05
# The forward pass's share of a rematerialised step's FLOPs: 2N of 8N (forward, recomputed forward,
# backward 4N).
FORWARD_SHARE = 0.25
# Attention past the calibration's sequences: the step rates above were fitted at 2,048 tokens per
# sequence, where attention is a few % of 8N. Beyond that each token adds 8 x layers x heads x
# head_dim x (seq_len - 2,048) FLOPs (causal: half of the S^2 products; forward, recomputed forward,
# backward twice), which run at 1 / ATTENTION_COST of the dense rate: fitted to llama-7b on one H100
# at one sequence of 65,536 and 131,072 tokens (14.66 and 48.61 s per step; 8N alone: 8.6, 17.2 s).
CALIBRATION_SEQ = 2048
ATTENTION_COST = 0.68
# optax's update on XLA:CPU against the fused kernels, per parameter (2.56 against 4.48 G params/s on
# one H200 box, BENCHMARKS.md, issue 4).
OPTAX_SLOWDOWN = 4.48 / 2.56
# A placement must be predicted this much faster than a simpler one to be chosen over it: the model
# is good to ~20%, so smaller gains are not worth more memory or more moving parts.
PREFER_SIMPLER = 0.01
# The exposed wait names the bottleneck when it is more than this share of the step.
EXPOSED_NAMES_IT = 0.05
# Host memory bandwidth the update reaches scales as sqrt(cores / 16) below 16 cores: 8 threads
# reached 0.69-0.72x of 16 threads' rate on the H200 box (BENCHMARKS.md, issue 4, runs E and the
# host_split probe).
MEASURED_CORES = 16


# The local disk of the lent H100/H200 boxes, reads and writes together: the disk tier's store moved
# 2.54 GB/s alone and 1.97 GB/s inside the llama-20b step (BENCHMARKS.md, issue 14).
DISK_BW = 2.0 * GB


@dataclass(frozen=True)
class DeviceDefaults:
    """Figures of a device kind where nothing is given or measured here: link bytes/s each way,
    host update bytes/s on a 16-core host, dense bf16 FLOP/s a step reaches (8N accounting)."""

    kind: str
    link: float  # bytes/s per direction per device
    host_bw: float  # bytes/s of host memory traffic the fused update reaches
    flops: float  # FLOP/s per device
    source: str  # where the figures come from, for the table


# H100/H200 boxes: PCIe Gen5 at 54 GB/s each way (measurements.md, "The ceilings"); the fused AdamW
# at 4.4 G params/s x 28 bytes ~ 120 GB/s of host memory traffic on their 16 cores (BENCHMARKS.md,
# issue 4); the H200's resident step at 590 TFLOP/s (8N) on the 3.37B model at 16K tokens (0.774 s,
# BENCHMARKS.md, issue 2; 570-611 across runs). No H100 step was measured: 0.7x the H200's.
H200 = DeviceDefaults("H200", 54 * GB, 120 * GB, 590e12, "measured on H200 boxes (BENCHMARKS.md)")
H100 = DeviceDefaults("H100", 54 * GB, 120 * GB, 0.7 * 590e12, "H200's link and host; 0.7x its step rate")
# Another GPU: conservative guesses (PCIe Gen4, a smaller host), not measurements: pass machine.*.
OTHER_GPU = DeviceDefaults("GPU", 25 * GB, 60 * GB, 100e12, "conservative guesses for an unmeasured GPU")
# A CPU "accelerator": copies between its memory kinds are host memory copies; compute is rough.
CPU = DeviceDefaults("CPU", 10 * GB, 120 * GB, 0.1e12, "rough figures for a CPU backend")


@dataclass(frozen=True)
class Machine:
    """What the planner plans for. Memories in bytes, rates in bytes/s and FLOP/s, per device where
    it says so; `sources` says where each figure came from (given, detected or a default)."""

    gpu_bytes: int | None  # accelerator memory per device; None: a CPU backend (its memory is host RAM)
    host_bytes: int  # host RAM available on this host, shared by `local_processes`
    h2d: float  # host-to-accelerator bytes/s per device
    d2h: float  # accelerator-to-host bytes/s per device
    host_bw: float  # host memory bytes/s the host update reaches, shared by `local_processes`
    gpu_flops: float  # FLOP/s per device a step reaches (8N accounting)
    devices: int = 1  # of the run
    processes: int = 1  # of the run
    local_processes: int = 1  # processes of the run on this host: they share its RAM and bandwidth
    cores: int = MEASURED_CORES  # of the host update (`host_bw` is what they reach)
    # XLA's pinned host pool cap once it is fixed (GB, as XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB reads);
    # None where jaxzero sizes it to the run (before the backend starts) or there is none (CPU).
    pinned_limit_gb: float | None = None
    kind: str = "H200"  # the device kind whose defaults were used
    disk_bytes: int = 0  # free local disk for the disk tier's working state (per host)
    disk_bw: float = DISK_BW  # bytes/s it reads and writes, together
    # machine.* key -> where its figure came from: "machine.<key>" (given), "detected...", "default..."
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def host_share(self) -> int:
        """Bytes of host RAM available to one process of the run."""
        return self.host_bytes // self.local_processes

    @property
    def gpu_usable(self) -> int | None:
        """Bytes of `gpu_bytes` a chosen placement may plan to fill: `GPU_HEADROOM` stays free."""
        return None if self.gpu_bytes is None else int(self.gpu_bytes * (1 - GPU_HEADROOM))

    @property
    def host_usable(self) -> int:
        """Bytes of `host_share` a placement may plan to fill: `HOST_HEADROOM` stays free."""
        return int(self.host_share * (1 - HOST_HEADROOM))


def concrete(cfg: TrainConfig) -> bool:
    """Whether `cfg` names its placement itself (no `auto` offload key): `resolve_plan` reads it as
    is, and `build_trainer` does not call the planner."""
    return "auto" not in (cfg.offload.params, cfg.offload.optimizer)


def _kind_of(device: jax.Device) -> DeviceDefaults:
    if device.platform == "cpu":
        return CPU
    name = getattr(device, "device_kind", "").upper()
    return H200 if "H200" in name else H100 if "H100" in name else OTHER_GPU


def _kind_by_size(gpu_gib: float) -> DeviceDefaults:
    """The kind of a GPU known only by its memory: an H200 has ~139 GiB usable, an H100 ~80."""
    return H200 if gpu_gib >= 100 else H100 if gpu_gib >= 60 else OTHER_GPU


def detect_machine(
    cfg: TrainConfig,
    device: jax.Device | None = None,
    *,
    devices: int = 1,
    processes: int = 1,
    local_processes: int = 1,
    pool_fixed: bool = True,
) -> Machine:
    """The machine to plan `cfg` for: `device`'s memory (`memory.accelerator_capacity`) and kind,
    this host's available RAM (`memory.host_memory_available`) and cores, each overridden by a
    nonzero `machine.*` key; rates not given are the device kind's defaults.

    Without `device`: with `machine.gpu_gib` given, a GPU of that size is planned for without
    starting any backend, its kind (for the default rates) taken from its size (>= 100 GiB an H200,
    >= 60 an H100, else an unmeasured GPU), as it is on a CPU-only backend; otherwise the first local
    device (this starts JAX's backend). `devices`, `processes`: the run's mesh; `local_processes`:
    its processes on this host. `pool_fixed`: whether XLA's pinned pool is fixed already for the run
    (its backend is this process's, running); `python -m jaxzero.plan` passes False, as the run sizes
    the pool when it starts."""
    mc = cfg.machine
    if device is None and not mc.gpu_gib:
        device = jax.local_devices()[0]  # starts the backend: the plan is for the device it finds
    by_size = mc.gpu_gib and (device is None or device.platform == "cpu")
    kind = _kind_by_size(mc.gpu_gib) if by_size else _kind_of(device)
    sources: dict[str, str] = {}

    def pick(name: str, given: float, scale: float, fallback: float, how: str = "default") -> float:
        sources[name] = f"machine.{name}" if given else how
        return given * scale if given else fallback

    if kind is CPU:
        gpu_bytes = None
        sources["gpu_gib"] = "a CPU backend: its device memory is host RAM"
    else:
        capacity = memory.accelerator_capacity(device) if device is not None else None
        if not mc.gpu_gib and capacity is None:
            raise ConfigError(
                f"the accelerator {getattr(device, 'device_kind', device)} does not report its memory; "
                "pass --machine.gpu_gib=N (GiB per device) for the planner."
            )
        detected = f"detected: {getattr(device, 'device_kind', device)}"
        gpu_bytes = int(pick("gpu_gib", mc.gpu_gib, GiB, capacity or 0, detected))
        if by_size:
            sources["gpu_gib"] += f"; {kind.kind} by its size"
    # Detected: what is free now, and what this host's processes of the run hold already (each about
    # what this one does), since the need counts the whole process.
    free = memory.host_memory_available() + local_processes * memory.process_rss()
    host_bytes = int(pick("host_gib", mc.host_gib, GiB, free, "detected"))
    cores = int(pick("cores", mc.cores, 1, available_cores(), "detected"))
    # The defaults hold for the 16-core boxes they were measured on; fewer cores reach less.
    scaled = kind.host_bw * min(1.0, cores / MEASURED_CORES) ** 0.5
    host_bw = pick("host_gbps", mc.host_gbps, GB, scaled, f"default for {cores} cores")
    link = kind.link if kind is not CPU else host_bw / 4  # a CPU backend's "link" copies host memory
    h2d = pick("h2d_gbps", mc.h2d_gbps, GB, link)
    d2h = pick("d2h_gbps", mc.d2h_gbps, GB, link)
    gpu_flops = pick("gpu_tflops", mc.gpu_tflops, 1e12, kind.flops)
    disk_bytes = int(pick("disk_gib", mc.disk_gib, GiB, _free_disk(cfg), "detected"))
    disk_bw = pick("disk_gbps", mc.disk_gbps, GB, DISK_BW)
    if any(v.startswith("default") for v in sources.values()):
        sources["defaults"] = f"{kind.kind}, {kind.source}"
    return Machine(
        gpu_bytes=gpu_bytes,
        host_bytes=host_bytes,
        h2d=h2d,
        d2h=d2h,
        host_bw=host_bw,
        gpu_flops=gpu_flops,
        devices=devices,
        processes=processes,
        local_processes=local_processes,
        cores=cores,
        pinned_limit_gb=_pinned_limit_gb(device, pool_fixed),
        kind=kind.kind,
        disk_bytes=disk_bytes,
        disk_bw=disk_bw,
        sources=sources,
    )


# What XLA's GPU allocator leaves out of a GPU's memory before taking its fraction: the CUDA context
# (an H200's 143,771 MiB gave a 132.8 GiB limit at the 0.95 fraction: 627 MiB less than the total).
CUDA_CONTEXT_BYTES = 640 * 2**20


def gpu_bytes_before_backend() -> int | None:
    """What XLA's allocator will give the one GPU this process sees, told before JAX starts (from
    `nvidia-smi`: the GPU's total memory less the CUDA context, times XLA's memory fraction), so that
    the run's pinned pool can be sized for the placement the planner will choose; None where it
    cannot be told: no `nvidia-smi`, no GPU, or not exactly one GPU visible (`CUDA_VISIBLE_DEVICES`)."""
    query = ["nvidia-smi", "--query-gpu=index,uuid,memory.total", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.count(",") == 2]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        wanted = [v.strip() for v in visible.split(",") if v.strip()]
        rows = [r for r in rows if any(w == r[0] or (len(w) > 3 and r[1].startswith(w)) for w in wanted)]
    if len(rows) != 1:
        return None
    try:
        total = int(float(rows[0][2])) * 2**20
        fraction = float(os.environ.get(memory.MEM_FRACTION_ENV, "0.75"))
    except ValueError:
        return None
    return int((total - CUDA_CONTEXT_BYTES) * fraction)


def _free_disk(cfg: TrainConfig) -> int:
    """Free bytes on the filesystem the disk tier would write to (`offload.disk_path`, else the run
    directory, else the working directory): of the nearest directory that exists."""
    path = Path(cfg.offload.disk_path or cfg.run_dir or ".").absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def _pinned_limit_gb(device: jax.Device | None, pool_fixed: bool) -> float | None:
    """XLA's pinned pool cap, GB, where it binds the run: XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB where set
    (by the user, or by `build_trainer` before JAX started), else XLA's default where the GPU backend
    runs already; None where jaxzero will size the pool, and on a CPU backend (no pool)."""
    if device is not None and device.platform == "cpu":
        return None
    value = os.environ.get(memory.PINNED_POOL_ENV)
    if value is not None:
        return float(value)
    return float(memory.PINNED_POOL_DEFAULT_GB) if device is not None and pool_fixed else None


# ---------------------------------------------------------------------------------------------------
# The cost model (see the module docstring)
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    """Predicted seconds per step and their parts."""

    step_s: float  # max(gpu_s + exposed_s, link_s, host_s)
    gpu_s: float  # the accelerator's forward, rematerialised forward and backward
    exposed_s: float  # the host update the next forward pass waits for
    link_s: float  # host-to-accelerator plus accelerator-to-host copies
    host_s: float  # the host update's memory traffic
    bottleneck: str  # "GPU compute", "host update before the forward", "link", "host update" or "disk"
    disk_s: float = 0.0  # the disk tier's reads and write-backs


def _dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def predict(cfg: TrainConfig, plan: OffloadPlan, machine: Machine) -> Prediction:
    """The predicted step of `cfg` placed by `plan` on `machine` (the module docstring's model)."""
    m, d = cfg.model, cfg.data
    n_embed, n_block, n_head = unit_param_counts(m)
    count = {UnitKind.EMBED: n_embed, UnitKind.BLOCK: n_block, UnitKind.HEAD: n_head}
    tokens = d.batch_size * d.seq_len / machine.devices
    # Per token and block, attention's FLOPs past the calibration, in parameter-equivalents (8 each).
    attention = ATTENTION_COST * m.num_heads * m.head_dim * max(d.seq_len - CALIBRATION_SEQ, 0)
    gpu_s = 8 * (param_count(m) + m.num_layers * attention) * tokens / machine.gpu_flops
    work = {
        UnitKind.EMBED: 0,
        UnitKind.BLOCK: n_block + attention,
        UnitKind.HEAD: m.hidden_size * m.vocab_size,
    }
    total_work = sum(work[u.kind] for u in plan.units)
    forward = [FORWARD_SHARE * gpu_s * work[u.kind] / total_work for u in plan.units]
    update = plan.host_update
    if update is None:
        return Prediction(gpu_s, gpu_s, 0.0, 0.0, 0.0, "GPU compute")

    compute, opt = _dtype_bytes(plan.compute_dtype), memory.optimizer_state_bytes(cfg)
    # The host kernels run at the fp32-moment rate per parameter with bf16 moments too (they convert
    # as they go): time them by fp32 moments' bytes. The disk still moves the bf16 bytes.
    opt_time = memory.optimizer_state_bytes(_variant(cfg, optimizer={"state_dtype": "float32"}))
    slowdown = 1.0 if update.fused else OPTAX_SLOWDOWN
    bw = machine.host_bw / machine.local_processes  # this process's share of the host
    first = [0.0] * len(plan.units)  # seconds of each unit's first (or only) pass
    full = [0.0] * len(plan.units)  # seconds of each unit's whole update
    h2d = d2h = 0.0  # bytes per device
    host_units = [i for i, u in enumerate(plan.units) if u.state in (Tier.HOST, Tier.DISK)]
    disk_bytes = [0.0] * len(plan.units)  # of each disk unit's state, this process's
    for j, i in enumerate(host_units):
        u = plan.units[i]
        grad = _dtype_bytes(plan.grad_dtype) if u.kind is UnitKind.BLOCK else 4
        read = 4 + opt_time + grad  # masters, moments, gradient
        # The pipeline counts two-pass units from the first host unit (`UpdatePipeline`).
        if j < update.two_pass.max_units:  # new weights first, masters and moments later
            first_bytes, all_bytes = read + compute, 2 * read + compute + 4 + opt_time
        else:
            first_bytes = all_bytes = read + 4 + opt_time + compute
        per_process = count[u.kind] / machine.processes * slowdown / bw
        first[i], full[i] = first_bytes * per_process, all_bytes * per_process
        if u.state is Tier.DISK:
            disk_bytes[i] = (4 + opt) * count[u.kind] / machine.processes
        per_device = count[u.kind] / machine.devices
        h2d += (2 if u.weights is Tier.PINNED_HOST else 1) * compute * per_device
        d2h += grad * per_device
    if plan.offloads_activations:  # every block input but the last leaves and comes back
        away = (m.num_layers - 1) * tokens * m.hidden_size * compute
        h2d, d2h = h2d + away, d2h + away
    host_s = sum(full)
    link_s = h2d / machine.h2d + d2h / machine.d2h
    # Each disk unit's state is read once and written back once per step; this host's processes
    # share the disk.
    disk_bw = machine.disk_bw / machine.local_processes
    disk_s = 2 * sum(disk_bytes) / disk_bw
    exposed = 0.0  # the delayed update overlaps the whole next step
    if update.mode is UpdateMode.OVERLAPPED:
        reads = [b / disk_bw for b in disk_bytes]
        exposed = _exposed(plan, update.waits_for_norm, gpu_s, forward, first, full, reads)
    terms = {"GPU compute": gpu_s + exposed, "link": link_s, "host update": host_s, "disk": disk_s}
    bottleneck = max(terms, key=lambda k: terms[k])
    step_s = terms[bottleneck]
    if bottleneck == "GPU compute" and exposed > EXPOSED_NAMES_IT * step_s:
        bottleneck = "host update before the forward"
    return Prediction(step_s, gpu_s, exposed, link_s, host_s, bottleneck, disk_s)


def _exposed(
    plan: OffloadPlan,
    waits_for_norm: bool,
    gpu_s: float,
    forward: list[float],
    first: list[float],
    full: list[float],
    reads: list[float],
) -> float:
    """Seconds the next forward pass waits for host updates, from the end of the backward pass:
    the forward runs unit by unit, each unit once the host has its (first-pass) update ready. A disk
    unit's update also waits for its read (`reads`: seconds of each unit's read, as of its write)."""
    ready = [0.0] * len(plan.units)  # seconds after the backward pass ends
    host_units = [i for i, u in enumerate(plan.units) if u.state in (Tier.HOST, Tier.DISK)]
    backward = (1 - FORWARD_SHARE) * gpu_s
    if waits_for_norm:  # nothing before the norm; then first passes in forward order
        t = 0.0
        read_done = _disk_reads(plan, reads, full, -backward, lambda: t)
        for i in host_units:
            t = max(t, read_done(i)) + first[i]
            ready[i] = t
    else:  # each unit as its gradients land, in the backward pass's (reverse) order, one pass
        scale = backward / max(sum(forward), 1e-30)  # a unit's backward: its share of the pass
        landed, t = 0.0, 0.0
        ends = {}
        for i in reversed(range(len(plan.units))):
            landed += forward[i] * scale
            ends[i] = landed
        disk = [i for i in host_units if plan.units[i].state is Tier.DISK]
        read_end = {i: -backward + sum(reads[j] for j in disk[: k + 1]) for k, i in enumerate(disk)}
        for i in reversed(host_units):
            t = max(t, ends[i], read_end.get(i, -backward) + backward) + full[i]
            ready[i] = t - backward
    t = 0.0
    for i in range(len(plan.units)):
        t = max(t, ready[i]) + forward[i]
    return max(0.0, t - sum(forward))


def _disk_reads(
    plan: OffloadPlan, reads: list[float], full: list[float], start: float, host_clock: Callable[[], float]
) -> Callable[[int], float]:
    """When each disk unit's read is done, as the store does it: reads in update order from `start`
    (the backward pass begins), one disk, each read waiting for a free buffer (`plan.disk_slots`),
    which the write-back of the unit `disk_slots` before frees; a write-back (as long as its read)
    follows its unit's update, which ends `full` after the host reached it (`host_clock()` when the
    read is asked for: the pipeline's update order). Returns position -> seconds (0 for others)."""
    disk = [i for i, u in enumerate(plan.units) if u.state is Tier.DISK]
    done: dict[int, float] = {}
    freed: list[float] = []  # when each disk unit's write-back is done, in order
    state = {"disk": start}  # when the disk is next free

    def read_done(i: int) -> float:
        if i not in disk:
            return 0.0
        k = disk.index(i)
        slot = freed[k - plan.disk_slots] if k >= plan.disk_slots else start
        begin = max(state["disk"], slot)
        done[i] = begin + reads[i]
        # Its update starts when both the host and the read are there; its write-back follows.
        write_begin = max(done[i], host_clock()) + full[i]
        state["disk"] = max(done[i], write_begin) + reads[i]
        freed.append(state["disk"])
        return done[i]

    return read_done


# ---------------------------------------------------------------------------------------------------
# Candidates and the search
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Option:
    """One placement the planner may choose: the offload keys it sets."""

    optimizer: str
    params: str
    device_state_units: int = 0
    resident_blocks: int = 0
    two_pass_units: int = -1
    activations: str = "none"  # offload.activations
    disk_units: int = 0  # the last units' state on disk (offload.optimizer=disk); -1: every host unit's

    @property
    def rank(self) -> tuple[int, int, bool, bool, int, int]:
        """Simpler first: no disk; resident, ZeRO-Offload, ZeRO-3 offload; the user's two-pass
        setting; block inputs on the accelerator; fewer units with state on the accelerator; fewer
        resident blocks."""
        mode = 0 if self.optimizer == "none" else 1 if self.params == "none" else 2
        away = self.activations == "cpu"
        disk = self.disk_units if self.disk_units >= 0 else 10**6
        return (disk, mode, self.two_pass_units == 0, away, self.device_state_units, self.resident_blocks)


@dataclass(frozen=True)
class _Evaluated:
    """An option with its config, plan and memory, and how far it is from fitting the machine."""

    option: _Option
    cfg: TrainConfig
    plan: OffloadPlan
    need: MemoryPlan
    gpu_need: int  # accelerator bytes per device, state and activations (0 on a CPU backend)
    host_need: int  # host bytes per process (CPU backend: all this process's RAM, activations too)
    gpu_short: int  # bytes of `gpu_need` over the accelerator's capacity
    state_short: int  # bytes of the accelerator's state alone over its capacity
    host_short: int  # bytes of `host_need` over this process's share of host RAM
    host_state_short: int  # the same without activations (differs on a CPU backend only)
    pool_short: int  # GB over XLA's pinned pool cap, where it is already fixed
    disk_short: int = 0  # bytes of the disk tier's state over the free disk

    def fits(self, strict: bool, disk: bool = True) -> bool:
        """Whether it fits: `strict`, activations included (the planner's rule for what it chooses);
        else the state alone, as `memory.check_fits` refuses (activations only warn there). `disk`:
        the local disk too."""
        short = self.disk_short if disk else 0
        if strict:
            return not (self.gpu_short or self.host_short or self.pool_short or short)
        return not (self.state_short or self.host_state_short or self.pool_short or short)

    @property
    def shortfall(self) -> int:
        """Bytes short in all (the pool's GB counted as bytes)."""
        return self.gpu_short + self.host_short + self.pool_short * GB + self.disk_short


def _apply(cfg: TrainConfig, option: _Option) -> TrainConfig | None:
    """`cfg` placed as `option` says, or None where its other settings rule that out (`validate`)."""
    offload = dataclasses.replace(
        cfg.offload,
        optimizer="disk" if option.disk_units else option.optimizer,
        disk_units=option.disk_units or -1,
        # A disk path given for the planner to use, where it places nothing on disk, goes unused.
        disk_path=cfg.offload.disk_path if option.disk_units else "",
        params=option.params,
        device_state_units=option.device_state_units,
        resident_blocks=option.resident_blocks,
        two_pass_units=option.two_pass_units,
        activations=option.activations,
    )
    placed = dataclasses.replace(cfg, offload=offload)
    try:
        validate(placed)
    except ConfigError:  # e.g. ZeRO-3 offload under parallel.zero_stage=2
        return None
    return placed


class _Search:
    """The options one config leaves open on one machine, each evaluated once."""

    def __init__(self, cfg: TrainConfig, machine: Machine, whole: tuple[int, int, int] = (0, 0, 0)):
        self.cfg, self.machine, self.whole = cfg, machine, whole
        self.strict = not concrete(cfg)  # a placement the planner chooses must hold its activations
        self._evaluated: dict[_Option, _Evaluated | None] = {}
        self._predicted: dict[_Option, Prediction] = {}
        o, layers = cfg.offload, cfg.model.num_layers
        # Keys are decided only while the mode is: an explicit mode keeps its explicit meaning.
        self.two_pass = (-1, 0) if self.strict and o.two_pass_units == -1 else (o.two_pass_units,)
        # Block inputs move to pinned memory only where the accelerator cannot hold them (they cost
        # link time), and only while the mode is decided (the key left at its default, none).
        self.activations = ("none", "cpu") if self.strict and o.activations == "none" else (o.activations,)
        k = o.device_state_units
        decide_k = o.optimizer == "auto" and not k and o.update == "overlapped"
        self.k_range = range(layers + 2) if decide_k else range(k, k + 1)
        # XLA's pinned pool cap, which bounds the regions its pool grows by: fixed already, or, where
        # the run will size it for the placement decided (`jaxzero.trainer`), each option's own.
        self.pool_cap = None if machine.pinned_limit_gb is None else int(machine.pinned_limit_gb * GiB)
        r = o.resident_blocks
        self.r_range = range(layers) if o.params == "auto" and not r else range(r, r + 1)
        # Units on disk: as given with offload.optimizer=disk; with auto, the fewest that make a
        # placement fit, searched only when none fits without (the disk is the slowest tier).
        self.disk_fixed = o.disk_units if o.optimizer == "disk" else 0
        self.disk_search = o.optimizer == "auto" and self.strict and o.update == "overlapped"
        self.modes: list[tuple[str, str]] = []  # (offload.optimizer, offload.params)
        if o.optimizer in ("auto", "none") and o.params != "cpu" and not (k or r):
            self.modes.append(("none", "none"))
        if o.optimizer != "none" and o.params != "cpu" and not r:
            self.modes.append(("cpu", "none"))
        if o.optimizer != "none" and o.params != "none":
            self.modes.append(("cpu", "cpu"))

    def evaluate(self, option: _Option) -> _Evaluated | None:
        """`option` evaluated, or None where the config's other settings rule it out (`validate`)."""
        if option not in self._evaluated:
            self._evaluated[option] = self._evaluate(option)
        return self._evaluated[option]

    def _evaluate(self, option: _Option) -> _Evaluated | None:
        cfg = _apply(self.cfg, option)
        if cfg is None:
            return None
        plan = resolve_plan(cfg)
        mc = self.machine
        need = memory.plan_memory(cfg, plan, mc.devices, mc.processes, self.whole, self.pool_cap)
        local = mc.devices // mc.processes
        if mc.gpu_bytes is None:  # one RAM holds everything, counted as `memory.check_fits` does
            state = int(
                need.host * memory.CPU_HOST_ALLOWANCE
                + local * need.accelerator_state * memory.CPU_STATE_ALLOWANCE
            )
            gpu_need = gpu_short = state_short = 0
            host_need = state + local * need.activations
            host_state_short = max(0, state - mc.host_usable)
        else:
            # the process's RSS: its arrays and pools, and what a GPU process holds of its own
            gpu_need = need.accelerator_state + need.activations
            host_need = need.host + memory.GPU_PROCESS_RSS
            gpu_short = max(0, gpu_need - mc.gpu_usable)
            state_short = max(0, need.accelerator_state - mc.gpu_bytes)
            host_state_short = max(0, host_need - mc.host_usable)
        pool_short = 0
        if mc.pinned_limit_gb is not None and need.pinned:
            pool_short = max(0, math.ceil(memory.pinned_pool_minimum_gb(need) - mc.pinned_limit_gb))
        host_short = max(0, host_need - mc.host_usable)
        disk_short = max(0, need.disk * mc.local_processes - mc.disk_bytes)
        return _Evaluated(
            option, cfg, plan, need, gpu_need, host_need, gpu_short, state_short, host_short,
            host_state_short, pool_short, disk_short,
        )  # fmt: skip

    def predict(self, e: _Evaluated) -> Prediction:
        if e.option not in self._predicted:
            self._predicted[e.option] = predict(e.cfg, e.plan, self.machine)
        return self._predicted[e.option]

    def at(
        self, optimizer: str, params: str, k: int, r: int, disk: int | None = None, *, disk_fits: bool = True
    ) -> list[_Evaluated]:
        """The options of one (mode, K, R, units on disk) that fit: with the user's two-pass setting,
        or, with it left adaptive, with 0 where adaptive does not fit. `disk_fits=False`: whether
        they fit but for the local disk."""
        disk = self.disk_fixed if disk is None or optimizer != "cpu" else disk
        for act in self.activations if optimizer == "cpu" else ("none",):
            for tp in self.two_pass:
                e = self.evaluate(
                    _Option(optimizer, params, k, r, tp, act, disk if optimizer == "cpu" else 0)
                )
                if e is not None and e.fits(self.strict, disk_fits):
                    return [e]
        return []

    def _overflows(self, optimizer: str, params: str, k: int, r: int) -> bool:
        """Whether (mode, K, R) overflows the accelerator under every two-pass setting."""
        acts = self.activations if optimizer == "cpu" else ("none",)
        disk = self.disk_fixed if optimizer == "cpu" else 0
        options = [
            self.evaluate(_Option(optimizer, params, k, r, tp, a, disk)) for tp in self.two_pass for a in acts
        ]
        shorts = [e.gpu_short if self.strict else e.state_short for e in options if e is not None]
        return bool(shorts) and all(shorts)

    def fitting(self) -> list[_Evaluated]:
        """The options that fit worth comparing: per mode and K, the most resident blocks that fit
        and the fewest predicted as fast. (Accelerator memory grows with K and R, host memory falls
        with K, and the predicted step falls with both: binary searches, not every pair.) Where
        none fits and the planner may use the disk: per mode and K, the fewest units on disk that
        fit (host memory falls with them; the accelerator's does not change)."""
        out: list[_Evaluated] = []
        for optimizer, params in self.modes:
            ks = self.k_range if optimizer == "cpu" else range(1)
            for k in ks:
                found = self._fitting_at(optimizer, params, k, None)
                if found is None:
                    break  # more units with state on the accelerator overflow it more
                out += found
        if out or not self.disk_search:
            return out
        for optimizer, params in self.modes:
            if optimizer != "cpu":
                continue
            rs = self.r_range if params == "cpu" else range(1)
            for k in self.k_range:
                units = self.cfg.model.num_layers + 2 - k
                if not self.at(optimizer, params, k, rs[0], units, disk_fits=False):
                    continue  # not even with every host unit on disk (host RAM falls with them)
                fewest = _first(
                    range(1, units + 1),
                    lambda d: bool(self.at(optimizer, params, k, rs[0], d, disk_fits=False)),  # noqa: B023
                )
                out += self._fitting_at(optimizer, params, k, fewest) or []
        return out

    def _fitting_at(self, optimizer: str, params: str, k: int, disk: int | None) -> list[_Evaluated] | None:
        """`fitting`'s options for one mode, K and number of disk units; None where the accelerator
        overflows at the fewest resident blocks."""
        rs = self.r_range if params == "cpu" else range(1)
        rmax = _last(rs, lambda r: bool(self.at(optimizer, params, k, r, disk)))
        if rmax is None:
            return None if self._overflows(optimizer, params, k, rs[0]) else []
        best = self.at(optimizer, params, k, rmax, disk)
        limit = self.predict(best[0]).step_s * (1 + PREFER_SIMPLER)

        def as_fast(r: int) -> bool:
            return any(self.predict(e).step_s <= limit for e in self.at(optimizer, params, k, r, disk))

        return best + self.at(optimizer, params, k, _first(range(rs[0], rmax + 1), as_fast), disk)

    def frontier(self) -> list[_Evaluated]:
        """Every mode, K and two-pass setting at the fewest resident blocks (for that K, the least
        accelerator memory; host memory does not depend on R): what a refusal reasons from."""
        out = []
        for optimizer, params in self.modes:
            r = self.r_range[0] if params == "cpu" else 0
            for k in self.k_range if optimizer == "cpu" else range(1):
                disks = {self.disk_fixed if optimizer == "cpu" else 0}
                if optimizer == "cpu" and self.disk_search:
                    disks.add(-1)  # every host unit's state on disk: the least host RAM
                for tp in self.two_pass:
                    for act in self.activations if optimizer == "cpu" else ("none",):
                        for disk in sorted(disks):
                            e = self.evaluate(_Option(optimizer, params, k, r, tp, act, disk))
                            if e is not None:
                                out.append(e)
        return out

    def fits_somehow(self) -> bool:
        return any(e.fits(self.strict) for e in self.frontier())


def _last(values: range, ok: Callable[[int], bool]) -> int | None:
    """The largest of `values` for which `ok` holds, `ok` holding on a prefix of them; None if on none."""
    if not len(values) or not ok(values[0]):
        return None
    lo, hi = 0, len(values) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(values[mid]) else (lo, mid - 1)
    return values[lo]


def _first(values: range, ok: Callable[[int], bool]) -> int:
    """The smallest of `values` for which `ok` holds, `ok` holding on a suffix of them that ends with
    the last."""
    lo, hi = 0, len(values) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(values[mid]) else (mid + 1, hi)
    return values[lo]


# ---------------------------------------------------------------------------------------------------
# The decision
# ---------------------------------------------------------------------------------------------------

DECIDED_KEYS = (
    "params",
    "optimizer",
    "resident_blocks",
    "device_state_units",
    "two_pass_units",
    "activations",
    "disk_units",
)


@dataclass(frozen=True)
class Decision:
    """Where this run's state lives, why, and how fast it is predicted to be."""

    config: TrainConfig  # the user's config with every auto key decided
    plan: OffloadPlan  # `resolve_plan(config)`
    memory: MemoryPlan  # `memory.plan_memory` of it on `machine`
    prediction: Prediction  # the step predicted, with its parts
    machine: Machine  # what was planned for
    decided: tuple[str, ...]  # "offload.key=value" of each key the planner set
    warning: str | None = None  # an explicit placement whose activations may not fit

    @property
    def step_s(self) -> float:
        """Predicted seconds per optimizer step."""
        return self.prediction.step_s

    @property
    def bottleneck(self) -> str:
        return self.prediction.bottleneck

    # A placement is obvious (a one-line plan at start) when everything stays on the devices and
    # fills at most this share of each memory: a person reading it has nothing to decide.
    OBVIOUS_FILL = 0.5

    def obvious(self) -> bool:
        """Whether one line says it all: resident state, no warning, every memory at most half full."""
        if self.plan.host_update is not None or self.warning or self.memory.disk:
            return False
        fills = [self._ram_needed() / self.machine.host_usable]
        if self.machine.gpu_bytes is not None:
            fills.append((self.memory.accelerator_state + self.memory.activations) / self.machine.gpu_usable)
        return max(fills) <= self.OBVIOUS_FILL

    def _ram_needed(self) -> int:
        """Host RAM of one process: on a GPU, the host state and the process; on a CPU backend, the
        host and device state with their allowances and the activations."""
        mc, need = self.machine, self.memory
        if mc.gpu_bytes is not None:
            return need.host + memory.GPU_PROCESS_RSS
        local = mc.devices // mc.processes
        return int(
            need.host * memory.CPU_HOST_ALLOWANCE
            + local * (need.accelerator_state * memory.CPU_STATE_ALLOWANCE + need.activations)
        )

    def line(self) -> str:
        """The plan in one line: placement, the fullest memory, the predicted step."""
        word = _device_word(self.machine)
        chosen = f"decided {', '.join(self.decided)}" if self.decided else "as configured"
        memories = [f"{_gib(self._ram_needed())} of {_gib(self.machine.host_usable)} RAM"]
        if self.machine.gpu_bytes is not None:
            gpu = self.memory.accelerator_state + self.memory.activations
            memories.insert(0, f"{_gib(gpu)} of {_gib(self.machine.gpu_usable)} {word} memory")
        return (
            f"plan: {self.plan.mode} ({chosen}); {', '.join(memories)}; predicted "
            f"{self.step_s:.3g} s per step, bound by {_in_words(self.bottleneck, word)}"
        )

    def table(self) -> str:
        """What the planner chose and why, for a person: the units by tier, memory against capacity,
        the predicted step and its bottleneck, and the machine's figures with their sources."""
        cfg, mc, need, p = self.config, self.machine, self.memory, self.prediction
        m, d = cfg.model, cfg.data
        tokens = d.batch_size * d.seq_len
        accel = "GPU" if mc.gpu_bytes is not None else "CPU device"
        word = _device_word(mc)
        where = f"{mc.devices} device{'s' * (mc.devices > 1)} in {mc.processes} process"
        where += "es" * (mc.processes > 1)
        chosen = f"decided {', '.join(self.decided)}" if self.decided else "as configured"
        lines = [
            f"plan for {m.name}: {_count(param_count(m))} parameters, {d.batch_size} x {d.seq_len} = "
            f"{tokens:,} tokens per step, {cfg.optimizer.name} ({cfg.optimizer.state_dtype} moments), "
            f"{where}",
            f"placement: {self.plan.mode} ({chosen})",
        ]
        lines += [f"  {label}: {text}" for label, text in _unit_runs(self.plan, accel)]
        if self.plan.offloads_activations:
            lines.append(
                "  block inputs: wait for the backward pass in pinned host memory (all but the last)"
            )
        lines.append("memory, needed of available:")
        if mc.gpu_bytes is not None:
            gpu = need.accelerator_state + need.activations
            lines.append(
                f"  GPU per device  {_gib(gpu)} of {_gib(mc.gpu_usable)} (state "
                f"{_gib(need.accelerator_state)}, activations ~{_gib(need.activations)})"
            )
            pool = (
                "XLA's pool sized to it when jaxzero starts JAX"
                if mc.pinned_limit_gb is None
                else (
                    f"of XLA's {mc.pinned_limit_gb:g} GB pool, which needs "
                    f"{memory.pinned_pool_minimum_gb(need)} GB"
                )
            )
            if need.pinned:
                lines.append(f"  pinned host     {_gib(need.pinned)} (part of host RAM; {pool})")
            lines.append(
                f"  host RAM        {_gib(need.host + memory.GPU_PROCESS_RSS)} of {_gib(mc.host_usable)} "
                "(per process: masters and optimizer state, XLA's pinned pool, a checkpoint's buffer, and "
                f"{_gib(memory.GPU_PROCESS_RSS)} for the process itself; {HOST_HEADROOM:.0%} of the RAM "
                "left free)"
            )
        else:
            lines.append(
                f"  RAM             {_gib(self._ram_needed())} of {_gib(mc.host_usable)} (CPU backend: host "
                "and device state with XLA's and the checkpoint writer's buffers, and activations)"
            )
        if need.disk:
            lines.append(
                f"  local disk      {_gib(need.disk * mc.local_processes)} of {_gib(mc.disk_bytes)} free "
                f"(masters and optimizer state of {len(self.plan.disk_units)} "
                f"unit{'s' if len(self.plan.disk_units) != 1 else ''}, "
                f"{cfg.offload.disk_path or 'under the run directory'})"
            )
        if cfg.checkpoint.enabled:
            size = param_count(m) * (4 + memory.optimizer_state_bytes(cfg))
            count = cfg.checkpoint.keep + 1
            lines.append(
                f"  checkpoints     {_gib(size)} each, {_gib(count * size)} of disk under run_dir at most "
                f"(checkpoint.keep={cfg.checkpoint.keep} and the next); a save or a restore adds "
                f"{_gib(memory.checkpoint_bytes(cfg, _largest_unit_bytes(cfg), size))} of host RAM"
            )
        flops = 8 * param_count(m) * tokens / p.step_s / mc.devices / 1e12
        lines += [
            f"predicted step: {p.step_s:.3g} s ({tokens / p.step_s:,.0f} tokens/s, {flops:.3g} TFLOP/s (8N) "
            f"per device); bottleneck: {_in_words(p.bottleneck, word)}",
            f"  {word} compute {p.gpu_s:.3g} s + host update before the forward {p.exposed_s:.3g} s, link "
            f"{p.link_s:.3g} s, host update {p.host_s:.3g} s"
            + (f", disk {p.disk_s:.3g} s" if self.plan.disk_units else "")
            if self.plan.host_update is not None
            else f"  {word} compute {p.gpu_s:.3g} s; nothing crosses the link or waits for the host",
        ]
        if self.warning:
            lines.append(f"  {self.warning}")
        defaults = f" (defaults: {mc.sources['defaults']})" if "defaults" in mc.sources else ""
        lines += [f"machine{defaults}:"] + [f"  {row}" for row in _machine_rows(mc)]
        lines.append(
            "These are predictions (the cost model of jaxzero/plan/planner.py, within 20% of the steps "
            "measured in BENCHMARKS.md), not measurements."
        )
        return "\n".join(lines)


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f} GiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 10**9 else f"{n / 1e6:.2f}M"


def _unit_runs(plan: OffloadPlan, accel: str) -> list[tuple[str, str]]:
    """(units, where they live) for each run of consecutive units that live alike, in forward order:
    ("embed, blocks 0-3", "weights GPU, state GPU (updated on GPU)")."""
    runs: list[list[UnitPlan]] = []
    for u in plan.units:
        if runs and (runs[-1][0].weights, runs[-1][0].state) == (u.weights, u.state):
            runs[-1].append(u)
        else:
            runs.append([u])
    out = []
    for run in runs:
        names = ["embed"] if run[0].kind is UnitKind.EMBED else []
        blocks = [u.block for u in run if u.kind is UnitKind.BLOCK]
        if blocks:
            names.append(f"block {blocks[0]}" if len(blocks) == 1 else f"blocks {blocks[0]}-{blocks[-1]}")
        if run[-1].kind is UnitKind.HEAD:
            names.append("head")
        u = run[0]
        weights = accel if u.weights is Tier.DEVICE else "streamed from pinned host"
        state = {
            Tier.DEVICE: f"{accel} (updated on {accel})",
            Tier.HOST: "host RAM (updated on CPU)",
            Tier.DISK: "local disk (read, updated on CPU, written back)",
        }[u.state]
        out.append((", ".join(names), f"weights {weights}, state {state}"))
    return out


def _device_word(mc: Machine) -> str:
    """What the plan calls the accelerator: a GPU, or a CPU backend's devices."""
    return "GPU" if mc.gpu_bytes is not None else "CPU"


def _in_words(bottleneck: str, word: str) -> str:
    """The cost model's bottleneck name ("GPU compute", ...) for the device that runs."""
    return bottleneck.replace("GPU", word)


def _machine_rows(mc: Machine) -> list[str]:
    s = mc.sources
    if mc.gpu_bytes is None:  # no GPU words for a CPU backend
        cpu = f"{mc.h2d / GB:.0f} GB/s between host and device memory, a copy in RAM"
        return [
            "devices      a CPU backend's: their arrays are in host RAM",
            f"host RAM     {_gib(mc.host_bytes)} ({s.get('host_gib', '-')})",
            f"CPU cores    {mc.cores} ({s.get('cores', '-')})",
            f"copies       {cpu} ({s.get('h2d_gbps', '-')})",
            f"host update  {mc.host_bw / GB:.0f} GB/s of host memory traffic ({s.get('host_gbps', '-')})",
            f"compute      {mc.gpu_flops / 1e12:.3g} TFLOP/s (8N) per device ({s.get('gpu_tflops', '-')})",
            f"local disk   {_gib(mc.disk_bytes)} free ({s.get('disk_gib', '-')}), "
            f"{mc.disk_bw / GB:.1f} GB/s read and written together ({s.get('disk_gbps', '-')})",
        ]
    first = f"GPU memory   {_gib(mc.gpu_bytes)} per device"
    link = f"({s.get('h2d_gbps', '-')})"
    if s.get("h2d_gbps") != s.get("d2h_gbps"):
        link = f"({s.get('h2d_gbps', '-')}, back: {s.get('d2h_gbps', '-')})"
    share = f", {_gib(mc.host_share)} per process" if mc.local_processes > 1 else ""
    return [
        f"{first} ({s.get('gpu_gib', '-')})",
        f"host RAM     {_gib(mc.host_bytes)}{share} ({s.get('host_gib', '-')})",
        f"CPU cores    {mc.cores} ({s.get('cores', '-')})",
        f"link         {mc.h2d / GB:.0f} GB/s to the device, {mc.d2h / GB:.0f} GB/s back {link}",
        f"host update  {mc.host_bw / GB:.0f} GB/s of host memory traffic ({s.get('host_gbps', '-')})",
        f"compute      {mc.gpu_flops / 1e12:.3g} TFLOP/s (8N) per device ({s.get('gpu_tflops', '-')})",
        f"local disk   {_gib(mc.disk_bytes)} free ({s.get('disk_gib', '-')}), "
        f"{mc.disk_bw / GB:.1f} GB/s read "
        f"and written together ({s.get('disk_gbps', '-')})",
    ]


def decide(cfg: TrainConfig, machine: Machine, whole: tuple[int, int, int] = (0, 0, 0)) -> Decision:
    """The placement of `cfg` on `machine`: every key `cfg` leaves open decided (see the module
    docstring), the fastest predicted placement that fits. `whole`: as `memory.plan_memory`'s, the
    parameters no ZeRO stage splits over the machine's devices. Raises ConfigError, before anything
    is allocated, if nothing fits: what the closest placement needs against what is available, and
    what would fit (a batch size, a named model size, more host RAM or a larger GPU, settings)."""
    search = _Search(cfg, machine, whole)
    fitting = search.fitting()
    if not fitting:
        raise ConfigError(_refusal(search))
    fastest = min(search.predict(e).step_s for e in fitting)
    as_fast = [e for e in fitting if search.predict(e).step_s <= fastest * (1 + PREFER_SIMPLER)]
    chosen = min(as_fast, key=lambda e: e.option.rank)
    warning = None
    # Only an explicit placement is chosen with its state fitting and its activations not.
    if chosen.gpu_short or chosen.host_short:
        warning = (
            "warning: the activation estimate does not fit beside the state; if the run runs out of "
            "memory, lower data.batch_size or data.seq_len, or raise data.grad_accum."
        )
    given, placed = cfg.offload, chosen.cfg.offload
    decided = tuple(  # what the planner set: the auto keys, and any other it changed
        f"offload.{k}={getattr(placed, k)}"
        for k in DECIDED_KEYS
        if getattr(given, k) == "auto" or getattr(given, k) != getattr(placed, k)
    )
    return Decision(chosen.cfg, chosen.plan, chosen.need, search.predict(chosen), machine, decided, warning)


def largest_pinned_need(cfg: TrainConfig) -> MemoryPlan | None:
    """Of the placements `decide` may choose for `cfg`, the memory plan with the most pinned host
    memory (one process's whole need), or None if none offloads: what XLA's pinned pool must be able
    to hold when it is sized before JAX starts, which is before the planner can see the devices. (The
    least state on the accelerator and the most streamed: every other option pins no more.)"""
    o = cfg.offload
    if o.optimizer == "none":
        return None
    for params in ("cpu", "none"):  # ZeRO-3 pins at least what ZeRO-Offload does, where it is allowed
        if o.params not in ("auto", params) or (params == "none" and o.resident_blocks):
            continue
        # Block inputs in pinned memory, where the planner may put them, pin the most.
        act = "cpu" if o.activations == "none" and not concrete(cfg) else o.activations
        option = _Option("cpu", params, o.device_state_units, o.resident_blocks, o.two_pass_units, act)
        placed = _apply(cfg, option)
        if placed is not None:
            return memory.plan_memory(placed, resolve_plan(placed))
    return None


# ---------------------------------------------------------------------------------------------------
# Refusals: what would fit instead
# ---------------------------------------------------------------------------------------------------


def _label(e: _Evaluated) -> str:
    o = e.cfg.offload
    keys = f"offload.optimizer={o.optimizer}, offload.params={o.params}"
    if o.optimizer == "disk":
        keys += f", offload.disk_units={o.disk_units}"
    if o.optimizer in ("cpu", "disk"):
        keys += f", offload.device_state_units={o.device_state_units}"
        keys += f", offload.two_pass_units={o.two_pass_units}"
    if o.params == "cpu":
        keys += f", offload.resident_blocks={o.resident_blocks}"
    if o.activations == "cpu":
        keys += ", offload.activations=cpu"
    return f"{e.plan.mode} ({keys})"


def _variant(cfg: TrainConfig, **sections: dict[str, object]) -> TrainConfig:
    """`cfg` with fields of some sections replaced: `_variant(cfg, data={"batch_size": 8})`."""
    return dataclasses.replace(
        cfg, **{name: dataclasses.replace(getattr(cfg, name), **fields) for name, fields in sections.items()}
    )


def _fits(cfg: TrainConfig, machine: Machine, whole: tuple[int, int, int] = (0, 0, 0)) -> bool:
    """Whether `decide` would find a placement for `cfg`."""
    try:
        validate(cfg)
    except ConfigError:
        return False
    return _Search(cfg, machine, whole).fits_somehow()


def _refusal(search: _Search) -> str:
    """Why nothing fits, in numbers, and what would."""
    cfg, mc = search.cfg, search.machine
    m, d = cfg.model, cfg.data
    frontier = search.frontier()
    head = (
        f"{m.name} ({_count(param_count(m))} parameters) at {d.batch_size} x {d.seq_len} tokens per "
        f"step does not fit this machine"
    )
    head += " in any placement the planner may choose" if search.strict else " as configured"
    if not frontier:
        return head + "."
    # The closest placement that the GPU holds (where one does): a placement that needs more GPU
    # memory than the machine has is no advice.
    on_this_gpu = [e for e in frontier if mc.gpu_bytes is None or e.gpu_need <= mc.gpu_usable]
    closest = min(on_this_gpu or frontier, key=lambda e: e.shortfall)
    need = closest.need
    if mc.gpu_bytes is not None:
        needs = (
            f"{_gib(closest.gpu_need)} of GPU memory per device (state {_gib(need.accelerator_state)}, "
            f"activations ~{_gib(need.activations)}; {_gib(mc.gpu_usable)} usable of "
            f"{_gib(mc.gpu_bytes)}) and "
            f"{_gib(closest.host_need)} of host RAM per process ({_gib(mc.host_usable)} usable of "
            f"{_gib(mc.host_share)})"
        )
        if closest.pool_short:
            pool_gb = memory.pinned_pool_minimum_gb(need)
            needs += f" and {pool_gb} GB of XLA's pinned pool ({mc.pinned_limit_gb:g} GB)"
    else:
        needs = (
            f"about {_gib(closest.host_need)} of RAM on this CPU-only machine (host and device state with "
            f"XLA's and the checkpoint writer's buffers, and activations; {_gib(mc.host_usable)} usable "
            f"of {_gib(mc.host_share)})"
        )
    which = f"the closest placement, {_label(closest)}," if len(frontier) > 1 else _label(closest)
    # The fewest changes first, in the order a user would rather make them: settings of this run
    # (bf16 moments, one-pass updates), a smaller batch, then disk room or more memory.
    text = [f"{head}."]
    text.append(_settings_that_fit(search))
    text.append(_smaller(search))
    text.append(_tiers(search, frontier))
    if on_this_gpu or mc.gpu_bytes is None:
        text.append(f"For the record, {which} needs {needs}.")
    return " ".join(t for t in text if t)


def _with_headroom(need: int) -> int:
    """The host RAM whose usable part (`Machine.host_usable`) holds `need` bytes."""
    return math.ceil(need / (1 - HOST_HEADROOM))


def _tiers(search: _Search, frontier: list[_Evaluated]) -> str:
    """What memory to add, each alone: host RAM for a placement the accelerator holds, a larger
    accelerator for one host RAM holds."""
    mc, strict = search.machine, search.strict
    local = mc.local_processes
    if mc.gpu_bytes is None:
        ram = _with_headroom(min(e.host_need for e in frontier) * local)
        return f"To fit it, add memory: {_gib(ram - mc.host_bytes)} more RAM ({_gib(ram)} in all)."
    options = []
    gpu_ok = [
        e
        for e in frontier
        if not (e.gpu_short if strict else e.state_short) and not (e.pool_short or e.disk_short)
    ]
    if gpu_ok:
        ram = _with_headroom(min(e.host_need for e in gpu_ok) * local)
        options.append(f"more host RAM: {_gib(ram - mc.host_bytes)} more ({_gib(ram)} in all)")
    host_ok = [
        e
        for e in frontier
        if not (e.host_short if strict else e.host_state_short) and not (e.pool_short or e.disk_short)
    ]
    if host_ok:
        gpu = min(
            math.ceil(e.gpu_need / (1 - GPU_HEADROOM)) if strict else e.need.accelerator_state
            for e in host_ok
        )
        options.append(f"a GPU with {_gib(gpu)} of memory")
    disk_only = [e for e in frontier if e.disk_short and not (e.gpu_short or e.host_short or e.pool_short)]
    if disk_only:
        need = min(e.need.disk * local for e in disk_only)
        options.append(
            f"more free local disk: {_gib(need)} at offload.disk_path ({_gib(mc.disk_bytes)} free)"
        )
    pool_only = [e for e in frontier if e.pool_short and not (e.gpu_short or e.host_short)]
    if pool_only:
        gb = min(memory.pinned_pool_minimum_gb(e.need) for e in pool_only)
        options.append(f"a larger pinned pool: {memory.PINNED_POOL_ENV}={gb} (set before JAX starts)")
    if not options:
        return (
            "Neither more host RAM alone nor a larger GPU alone makes any placement fit: both are needed, "
            "or a smaller model."
        )
    return f"To fit it, add {' or '.join(options)}."


def _smaller(search: _Search) -> str:
    """The largest data.batch_size that fits with this model, and the largest named model size of
    its family that fits with these settings."""
    cfg, mc = search.cfg, search.machine
    d = cfg.data
    unit = d.grad_accum * mc.devices  # batch sizes validate accepts on this many devices
    batch = _last(range(unit, d.batch_size, unit), lambda b: _fits(_variant(cfg, data={"batch_size": b}), mc))
    text = (
        f"With this model data.batch_size={batch} fits ({batch * d.seq_len:,} tokens per step)"
        if batch
        else f"With this model no data.batch_size fits, not even {unit}"
    )
    best = None
    for name, model in sorted(NAMED_SIZES.items(), key=lambda kv: param_count(kv[1])):
        if model.family != cfg.model.family or d.seq_len > model.max_seq_len:
            continue
        other = dataclasses.replace(model, compute_dtype=cfg.model.compute_dtype)
        if _fits(dataclasses.replace(cfg, model=other), mc):
            best = name
    if best:
        return (
            f"{text}; the largest named model that fits with these settings is {best} "
            f"({_count(param_count(NAMED_SIZES[best]))} parameters)."
        )
    return f"{text}; no named {cfg.model.family} model fits with these settings at data.seq_len={d.seq_len}."


def _settings_that_fit(search: _Search) -> str:
    """The fewest settings that make this model fit at this batch size, of: bf16 moments, and (for
    an explicit placement, which the planner does not adapt) one-pass updates."""
    cfg, mc, whole = search.cfg, search.machine, search.whole
    changes: list[tuple[str, dict[str, dict[str, object]]]] = []
    if cfg.optimizer.state_dtype == "float32" and memory.optimizer_state_bytes(cfg):
        bf16 = {"optimizer": {"state_dtype": "bfloat16"}}
        changes.append(("optimizer.state_dtype=bfloat16 (half the moments' bytes)", bf16))
    if not search.strict and cfg.offload.optimizer in ("cpu", "disk") and cfg.offload.two_pass_units == -1:
        one_pass = {"offload": {"two_pass_units": 0}}
        text = "offload.two_pass_units=0 (one-pass updates: no gradients kept pinned for a second pass)"
        changes.append((text, one_pass))
    for size in range(1, len(changes) + 1):
        for chosen in itertools.combinations(changes, size):
            sections: dict[str, dict[str, object]] = {}
            for _, change in chosen:
                for name, fields in change.items():
                    sections[name] = {**sections.get(name, {}), **fields}
            if _fits(_variant(cfg, **sections), mc, whole):
                texts = [text for text, _ in chosen]
                joined = texts[0] if size == 1 else ", ".join(texts[:-1]) + " and " + texts[-1]
                return f"It fits with {joined}."
    return ""


def _largest_unit_bytes(cfg: TrainConfig) -> int:
    """Masters and optimizer state of the model's largest unit (embedding, a block or the head)."""
    return max(unit_param_counts(cfg.model)) * (4 + memory.optimizer_state_bytes(cfg))
