"""The machine the planner plans for: its memories and rates (`Machine`), found on this host or given
by `machine.*` (`detect_machine`), with the measured figures of a device kind where neither says
(`DeviceDefaults`); and the accelerators a process will train on, told before JAX starts
(`accelerators_before_backend`) or read from a running backend (`accelerators_of`).

    machine = detect_machine(cfg, device)       # or Machine(...) for a box you do not have
    machine.gpu_usable, machine.host_usable     # what a chosen placement may fill

Detecting starts JAX's backend only where neither `device` nor `machine.gpu_gib` is given; the host's
free RAM, this process's RSS and a device's memory are read through `jaxzero.planner.runtime`, the GPU's total
memory before JAX starts from `nvidia-smi`, the free disk from the filesystem.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import jax

from jaxzero.config import ConfigError, TrainConfig
from jaxzero.plan import available_cores
from jaxzero.planner import runtime
from jaxzero.planner.calibration import (
    CUDA_CONTEXT_BYTES,
    DISK_BPS,
    GB,
    GPU_HEADROOM,
    H100_ATTENTION_OF_H200,
    H100_OF_H200,
    H200_FLOPS,
    HOST_HEADROOM,
    HOST_UPDATE_BPS,
    LINK_BPS,
    MEASURED_CORES,
    GiB,
)


@dataclass(frozen=True)
class DeviceDefaults:
    """Figures of a device kind where nothing is given or measured here: link bytes/s each way,
    host update bytes/s on a 16-core host, dense bf16 FLOP/s a step reaches (8N accounting)."""

    kind: str
    link: float  # bytes/s per direction per device
    host_bw: float  # bytes/s of host memory traffic the fused update reaches
    flops: float  # FLOP/s per device
    source: str  # where the figures come from, for the table
    # Attention past the rates' calibration (`cost.ATTENTION_COST`) costs this many times what it does
    # on the kind the cost model was fitted on (an H200), relative to the kind's dense rate.
    attention_scale: float = 1.0


H200 = DeviceDefaults("H200", LINK_BPS, HOST_UPDATE_BPS, H200_FLOPS, "measured on H200 boxes (BENCHMARKS.md)")
H100 = DeviceDefaults(
    "H100",
    LINK_BPS,
    HOST_UPDATE_BPS,
    H100_OF_H200 * H200_FLOPS,
    f"H200's link and host; {H100_OF_H200:g}x its dense rate, {H100_ATTENTION_OF_H200:g}x its attention's",
    attention_scale=H100_OF_H200 / H100_ATTENTION_OF_H200,
)
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
    disk_bw: float = DISK_BPS  # bytes/s it reads and writes, together
    run_dir_bytes: int = 0  # free disk where the run directory (its checkpoints) would be
    attention_scale: float = 1.0  # `DeviceDefaults.attention_scale` of the device kind
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


def _kind_of(accel: Accelerators) -> DeviceDefaults:
    if accel.platform == "cpu":
        return CPU
    name = accel.device_kind.upper()
    return H200 if "H200" in name else H100 if "H100" in name else OTHER_GPU


def _kind_by_size(gpu_gib: float) -> DeviceDefaults:
    """The kind of a GPU known only by its memory: an H200 has about 139 GiB usable, an H100 about 79
    (BENCHMARKS.md, "Calibration: the cost model against measured steps")."""
    return H200 if gpu_gib >= 100 else H100 if gpu_gib >= 60 else OTHER_GPU


def detect_machine(
    cfg: TrainConfig,
    device: jax.Device | Accelerators | None = None,
    *,
    devices: int = 1,
    processes: int = 1,
    local_processes: int = 1,
    pool_fixed: bool = True,
) -> Machine:
    """The machine to plan `cfg` for: `device`'s memory and kind (a running backend's device, or the
    `Accelerators` told before JAX starts: `accelerators_before_backend`), this host's available RAM
    (`runtime.host_memory_available`) and cores, each overridden by a nonzero `machine.*` key; rates
    not given are the device kind's defaults.

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
    accel = accelerators_of([device]) if isinstance(device, jax.Device) else device
    by_size = mc.gpu_gib and (accel is None or accel.platform == "cpu")
    kind = _kind_by_size(mc.gpu_gib) if by_size else _kind_of(accel)
    sources: dict[str, str] = {}

    def pick(name: str, given: float, scale: float, fallback: float, how: str = "default") -> float:
        sources[name] = f"machine.{name}" if given else how
        return given * scale if given else fallback

    if kind is CPU:
        gpu_bytes = None
        sources["gpu_gib"] = "a CPU backend: its device memory is host RAM"
    else:
        capacity = accel.memory if accel is not None else None
        if not mc.gpu_gib and capacity is None:
            raise ConfigError(
                f"the accelerator {accel.device_kind} does not report its memory; "
                "pass --machine.gpu_gib=N (GiB per device) for the planner."
            )
        detected = f"detected: {accel.device_kind if accel is not None else 'nothing'}"
        gpu_bytes = int(pick("gpu_gib", mc.gpu_gib, GiB, capacity or 0, detected))
        if by_size:
            sources["gpu_gib"] += f"; {kind.kind} by its size"
    # Detected: what is free now, and what this host's processes of the run hold already (each about
    # what this one does), since the need counts the whole process.
    free = runtime.host_memory_available() + local_processes * runtime.process_rss()
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
    # the checkpoints' file system: the disk tier's where offload.disk_path does not move that elsewhere
    run_dir_bytes = disk_bytes if not cfg.offload.disk_path else _free_under(cfg.run_dir or ".")
    disk_bw = pick("disk_gbps", mc.disk_gbps, GB, DISK_BPS)
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
        pinned_limit_gb=_pinned_limit_gb(accel, pool_fixed),
        kind=kind.kind,
        disk_bytes=disk_bytes,
        disk_bw=disk_bw,
        run_dir_bytes=run_dir_bytes,
        attention_scale=kind.attention_scale,
        sources=sources,
    )


@dataclass(frozen=True)
class Accelerators:
    """The accelerators one process trains on, as far as the planner needs them: the platform ("gpu"
    or "cpu"), how many this process drives, their kind as `jax.Device.device_kind` names it, and the
    bytes XLA's allocator gives each (None where that is not known)."""

    platform: str
    local: int
    device_kind: str = ""
    memory: int | None = None


def accelerators_of(devices: list[jax.Device]) -> Accelerators:
    """The `Accelerators` of a running backend's local `devices` (the smallest memory among them)."""
    sizes = [runtime.accelerator_capacity(d) for d in devices]
    known = [m for m in sizes if m is not None]
    first = devices[0]
    return Accelerators(
        first.platform, len(devices), getattr(first, "device_kind", ""), min(known) if known else None
    )


def accelerators_before_backend() -> Accelerators:
    """What JAX's backend will show this process, told before it starts: the GPUs `nvidia-smi` lists
    (those `CUDA_VISIBLE_DEVICES` names), each with the memory XLA's allocator will take (its total
    less the CUDA context, times the memory fraction the programs give XLA); without a GPU, or with
    `JAX_PLATFORMS` naming no GPU platform, the CPU with its device count
    (`--xla_force_host_platform_device_count` in `XLA_FLAGS`, or `jax_num_cpu_devices`) and the
    host's available RAM."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    gpus = None if platforms and not {"cuda", "gpu"} & set(platforms.lower().split(",")) else _visible_gpus()
    if gpus:
        try:  # the share `runtime.claim_accelerator_memory` gives XLA, unless the user set one
            fraction = float(os.environ.get(runtime.MEM_FRACTION_ENV, runtime.ACCELERATOR_FRACTION))
        except ValueError:
            fraction = float(runtime.ACCELERATOR_FRACTION)
        memory = min(int((total - CUDA_CONTEXT_BYTES) * fraction) for _, total in gpus)
        return Accelerators("gpu", len(gpus), gpus[0][0], memory)
    return Accelerators("cpu", _cpu_device_count(), "cpu", runtime.host_memory_available())


def _visible_gpus() -> list[tuple[str, int]] | None:
    """(name, total bytes) of each GPU this process will see, from `nvidia-smi`; None without it."""
    query = ["nvidia-smi", "--query-gpu=index,uuid,memory.total,name", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [[f.strip() for f in line.split(",", 3)] for line in out.splitlines() if line.count(",") >= 3]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        wanted = [v.strip() for v in visible.split(",") if v.strip()]
        rows = [r for r in rows if any(w == r[0] or (len(w) > 3 and r[1].startswith(w)) for w in wanted)]
    try:
        return [(r[3], int(float(r[2])) * 2**20) for r in rows]
    except ValueError:
        return None


def _cpu_device_count() -> int:
    """The CPU backend's device count its settings give before it starts."""
    found = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    configured = getattr(jax.config, "jax_num_cpu_devices", -1)
    if isinstance(configured, int) and configured > 0:
        return configured
    return int(found.group(1)) if found else 1


def _free_disk(cfg: TrainConfig) -> int:
    """Free bytes on the filesystem the disk tier would write to (`offload.disk_path`, else the run
    directory, else the working directory)."""
    return _free_under(cfg.offload.disk_path or cfg.run_dir or ".")


def _free_under(directory: str) -> int:
    """Free bytes on the filesystem of `directory`: of the nearest directory that exists."""
    path = Path(directory).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def _pinned_limit_gb(accel: Accelerators | None, pool_fixed: bool) -> float | None:
    """XLA's pinned pool cap, GB, where it binds the run: XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB where set
    (by the user, or by `jaxzero.planner.preflight` before JAX started), else XLA's default where the GPU
    backend runs already; None where jaxzero will size the pool, and on a CPU backend (no pool)."""
    if accel is not None and accel.platform == "cpu":
        return None
    value = os.environ.get(runtime.PINNED_POOL_ENV)
    if value is not None:
        return float(value)
    return float(runtime.PINNED_POOL_DEFAULT_GB) if accel is not None and pool_fixed else None
