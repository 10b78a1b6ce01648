"""What the programs call to configure this process and to read this machine, before and around JAX.

XLA reads two environment variables when JAX starts its GPU backend, and fixes them for the process:
the pinned host pool's cap (`PINNED_POOL_ENV`, sized here for the run: `configure_pinned_pool`) and
the share of each GPU its allocator takes (`MEM_FRACTION_ENV`: `claim_accelerator_memory`); it parses
`XLA_FLAGS` then too, where `--determinism=true` asks for deterministic GPU kernels
(`request_determinism`). This module writes those, asks JAX whether its backends run, reads host RAM
and this process's RSS from /proc, and a device's memory from its backend; `check_fits` checks a
memory plan against what it reads. The counting itself is `jaxzero.planner.memory`'s (pure functions over
configs and shapes).
"""

from __future__ import annotations

import os
import re
from typing import Any

from jaxzero.config import ConfigError, TrainConfig
from jaxzero.planner.calibration import GiB
from jaxzero.planner.memory import (
    MemoryPlan,
    check_accelerator_fits,
    check_cpu_fits,
    check_host_fits,
    pinned_pool_cap_gb,
    pinned_pool_minimum_gb,
)

PINNED_POOL_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
XLA_FLAGS_ENV = "XLA_FLAGS"
# XLA:GPU's switches for run-to-run determinism (`request_determinism`), each set to true.
# `xla_gpu_deterministic_ops`: scatters rewritten without atomics, reductions as trees, the first
# (not the fastest measured) kernel of every autotuned GEMM, fusion and convolution, deterministic
# cuDNN convolution algorithms, and cuDNN flash attention's backward pass in its deterministic mode.
# `xla_gpu_exclude_nondeterministic_ops`: the same, and compilation fails on an op with no
# deterministic form (select-and-scatter) instead of running it.
DETERMINISM_FLAGS = ("xla_gpu_deterministic_ops", "xla_gpu_exclude_nondeterministic_ops")
ACCELERATOR_FRACTION = "0.95"  # of each GPU's memory for XLA (`claim_accelerator_memory`)
PINNED_POOL_DEFAULT_GB = 64  # XLA's GPU client default cap on pinned_host allocations


def pinned_pool_cap() -> int | None:
    """XLA's pinned pool cap in bytes where the environment fixes it (set by the user, or by
    `configure_pinned_pool`), else None."""
    value = os.environ.get(PINNED_POOL_ENV)
    return int(float(value) * GiB) if value else None


def configure_pinned_pool(need: MemoryPlan) -> int:
    """Size XLA's pinned host pool for `need` before the GPU backend starts; return the cap in GB.

    XLA's GPU client caps `pinned_host` allocations at `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` (64 GB by
    default) and fails with RESOURCE_EXHAUSTED past it, mid-run. Below the cap the pool grows on demand
    by regions that double in size, so it can come to hold nearly twice what the run uses. When JAX has
    not started and the user has not set the variable, it is set here to this run's pool: the need's
    pinned bytes plus 25% and 2 GB (`memory.pinned_pool_cap_gb`), which also bounds the region the
    start-up reservation makes (`memory.pinned_pool_bytes`, what `plan_memory` counts). Otherwise the
    cap XLA has is checked (`check_pinned_pool`). (XLA reads the variable in GiB, so each cap holds
    about 7% more than the GB figures here.) For the programs
    (`jaxzero.planner.preflight.decide_before_jax`): a library that sizes nothing calls
    `check_pinned_pool`.
    """
    if os.environ.get(PINNED_POOL_ENV) is not None or backends_started():
        return check_pinned_pool(need)
    pool_gb = max(pinned_pool_minimum_gb(need), pinned_pool_cap_gb(need.pinned))
    os.environ[PINNED_POOL_ENV] = _pool_set_here[PINNED_POOL_ENV] = str(pool_gb)
    return pool_gb


def check_pinned_pool(need: MemoryPlan) -> int:
    """The cap in GB of the pinned pool XLA has (or will have) for this process: the one the
    environment sets, else XLA's default; raises ConfigError where it is below the run's minimum
    (10% and 2 GB over the need's pinned bytes), saying what to set. Sets nothing."""
    need_gb = pinned_pool_minimum_gb(need)
    current = os.environ.get(PINNED_POOL_ENV)
    if current is not None:
        if float(current) < need_gb:
            if current == _pool_set_here.get(PINNED_POOL_ENV):  # an earlier run in this process set it
                raise ConfigError(
                    f"this run needs {need_gb} GB of pinned host memory, but this process's pool was "
                    f"sized to {current} GB for an earlier run ({PINNED_POOL_ENV} was set by jaxzero "
                    f"then). Run it in a new process, or set {PINNED_POOL_ENV}={need_gb} before JAX starts."
                )
            raise ConfigError(
                f"{PINNED_POOL_ENV}={current} is below the {need_gb} GB of pinned host memory this run needs "
                f"({need.describe()}). Set {PINNED_POOL_ENV}={need_gb} or unset it."
            )
        return int(float(current))
    if need_gb > PINNED_POOL_DEFAULT_GB:
        raise ConfigError(
            f"this run needs {need_gb} GB of pinned host memory, over XLA's default "
            f"{PINNED_POOL_DEFAULT_GB} GB pool. Size the pool before JAX starts: call "
            "jaxzero.planner.preflight.decide_before_jax(cfg) before the first JAX call (as python -m "
            "jaxzero.train does), "
            f"or set {PINNED_POOL_ENV}={need_gb} in the environment."
        )
    return PINNED_POOL_DEFAULT_GB


_pool_set_here: dict[str, str] = {}  # what `configure_pinned_pool` set in this process's environment


def claim_accelerator_memory() -> None:
    """Before JAX starts its backend: let XLA's GPU allocator take 95% of each GPU's memory instead of
    its default 75% (a quarter of the card left idle), so that the planner and the run see the card;
    the rest holds the CUDA context and cuDNN's and NCCL's workspaces. A fraction the user set is
    kept."""
    if not backends_started():
        os.environ.setdefault(MEM_FRACTION_ENV, ACCELERATOR_FRACTION)


def request_determinism() -> None:
    """Before JAX starts its backend: add XLA:GPU's determinism switches (`DETERMINISM_FLAGS`, each
    `=true`) to `XLA_FLAGS`, after the user's flags, each once. XLA parses `XLA_FLAGS` once, when the
    backend starts: once an accelerator's backend runs without them they cannot take effect, and this
    raises ConfigError saying to call `jaxzero.planner.preflight.decide_before_jax` before the first
    JAX call (as the programs do) or to set them in the environment; as it does where the user's
    `XLA_FLAGS` turns one off. Where they are set already, or only XLA:CPU runs (whose kernels
    involve no atomics and no timing: deterministic as they are), it sets nothing."""
    current = os.environ.get(XLA_FLAGS_ENV, "")
    values = {name: _flag_value(current, name) for name in DETERMINISM_FLAGS}
    off = [f"--{name}={v}" for name, v in values.items() if v is not None and v.lower() not in _TRUE]
    if off:
        raise ConfigError(
            f"determinism=true needs XLA's deterministic GPU kernels, but {XLA_FLAGS_ENV} sets "
            f"{' '.join(off)}: remove it, or run without --determinism."
        )
    missing = [f"--{name}=true" for name, v in values.items() if v is None]
    if not missing:
        return
    started = started_platforms()
    if started is None or started - {"cpu"}:
        raise ConfigError(
            f"determinism=true needs XLA's deterministic GPU kernels, which {XLA_FLAGS_ENV} switches on "
            "when JAX starts, and JAX has started already. Call "
            "jaxzero.planner.preflight.decide_before_jax(cfg) before "
            f"the first JAX call (as python -m jaxzero.train does), or set "
            f"{XLA_FLAGS_ENV}='{' '.join([current.strip(), *missing]).strip()}' in the environment."
        )
    if not started:
        os.environ[XLA_FLAGS_ENV] = " ".join([current.strip(), *missing]).strip()


_TRUE = ("true", "1")  # the values XLA reads as true for a boolean flag


def _flag_value(flags: str, name: str) -> str | None:
    """The value `flags` (an `XLA_FLAGS` string) gives `--name` (the last one, as XLA reads them;
    "true" for a bare `--name`), or None where it does not set it."""
    found = re.findall(rf"(?:^|\s)--{name}(=\S*)?(?=\s|$)", flags)
    return None if not found else (found[-1].removeprefix("=") if found[-1] else "true")


def started_platforms() -> set[str] | None:
    """The platforms whose JAX backends run ("cpu", "cuda", ...; empty before JAX starts), or None
    where JAX's private API to ask has moved."""
    try:
        # Imported here: a private module, so that its move costs this fallback, not jaxzero's import.
        from jax._src import xla_bridge

        if not xla_bridge.backends_are_initialized():
            return set()
        return set(xla_bridge.backends())  # started already: this starts nothing
    except (ImportError, AttributeError):
        return None


def backends_started() -> bool:
    """Whether JAX has started its backends (after which XLA's pinned pool cap is fixed)."""
    try:
        # Imported here: a private module, so that its move costs this fallback, not jaxzero's import.
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # private API moved: assume the worst and ask the user
        return True


def accelerator_capacity(device: Any) -> int | None:
    """Bytes the allocator may use on `device` (a CPU "accelerator" has the host's free RAM), or None
    where the backend does not say."""
    if device.platform == "cpu":
        return host_memory_available()
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return stats.get("bytes_limit") if stats else None


def _proc_bytes(path: str, key: str) -> int | None:
    """The `key:` line of a /proc file in kB, as bytes; None where there is none."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def host_memory_available() -> int:
    """Bytes of host RAM available to this process now (MemAvailable), or total RAM if unknown."""
    available = _proc_bytes("/proc/meminfo", "MemAvailable")
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if available is None else available


def process_rss() -> int:
    """Bytes this process holds in RAM now (VmRSS), or 0 if unknown."""
    return _proc_bytes("/proc/self/status", "VmRSS") or 0


def check_fits(cfg: TrainConfig, need: MemoryPlan, device: Any, sharing: int = 1) -> str | None:
    """Raise ConfigError if `need` does not fit this machine, with the numbers and what to change;
    return a warning if only the activation estimate does not. `sharing`: the processes of this run
    on this host, each needing as much host RAM. Reads the host's available RAM and `device`'s
    memory now; on a CPU backend the "accelerator" is host RAM too, so the host's and the device's
    bytes must fit together (`memory.check_cpu_fits`)."""
    if device.platform == "cpu":
        return check_cpu_fits(cfg, need, host_memory_available(), sharing)
    if need.host:
        check_host_fits(cfg, need, host_memory_available(), sharing)
    return check_accelerator_fits(cfg, need, accelerator_capacity(device))
