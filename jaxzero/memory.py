"""Memory planning: will this run fit, and how large must XLA's pinned host pool be?

Everything here is arithmetic on the config and its offload plan, so it runs before JAX starts a
backend and before any array is allocated: a run that cannot fit fails at once with the numbers,
never after minutes of initialisation. Byte counts per parameter, by where the state lives:

    state                          resident        offload.optimizer=cpu      + offload.params=cpu
    fp32 masters                   4  accelerator  4  host RAM                4  host RAM
    optimizer state (AdamW)        8  accelerator  8  host RAM                8  host RAM
    compute-dtype weights          -  (cast per    2  accelerator             2  pinned host (streamed)
                                       block)
    gradients (blocks)             4  accelerator  2|4 pinned host            2|4 pinned host
    gradients (embed, head)        4  accelerator  4  pinned host             4  pinned host
    weights staging                -               2  pinned host             2  pinned host (embed/head)

(gradients leave in the compute dtype with one micro-batch, as float32 sums with several; the host
update writes the new weights of units that live on the accelerator into pinned staging buffers, one
DMA away, and every unit may be in flight at once. Two-pass updates keep their units' gradients
into the next step: up to 2|4 more. The delayed update keeps two steps' gradients and two copies of
the compute weights. With `offload.activations=cpu` the blocks' saved inputs but the last's wait in
pinned host memory, and the accelerator holds three of them at most. Units whose state
`offload.device_state_units` keeps on the accelerator count as resident ones there: masters, state,
weights and their gradients; on the host, with checkpoints on, their masters and state once more,
since a save copies them to host RAM and a restore reads them there first.)
An asynchronous checkpoint (`checkpoint.async_save`, the default) snapshots masters and optimizer
state into host RAM while it writes: 4 + 8 more bytes per parameter of host memory during a save.
Offloaded runs also get an allowance of 1.25x their pinned bytes (`PINNED_ALLOWANCE`).

Over a mesh of D devices in P processes (`devices`, `processes`), the figures are per process (host
RAM, pinned) and per device (accelerator): what the ZeRO stage shards divides by D on the
accelerator and by P on the host; activations divide by D. An array whose first axis does not
divide by D is whole everywhere (`whole`), counted so.

Where each unit's arrays live comes from the offload plan (`jaxzero.plan`); this module only counts.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from jaxzero.config import ConfigError, TrainConfig
from jaxzero.models.sizes import NAMED_SIZES, param_count, unit_param_counts
from jaxzero.plan import OffloadPlan, Tier, UnitKind, UpdateMode, resolve_plan

GiB = 2**30
PINNED_POOL_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
PINNED_POOL_DEFAULT_GB = 64  # XLA's GPU client default cap on pinned_host allocations
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "lion": 4, "sgd": 4}
# Host RAM past the arrays' sum, as a multiple of the pinned bytes: XLA's pinned pool grows by
# regions that double in size, and the runtime keeps buffers of its own (fitted in BENCHMARKS.md).
PINNED_ALLOWANCE = Fraction(5, 4)
# On a CPU backend, where one RAM holds everything: an asynchronous save holds the writer's buffers
# besides the snapshot, and XLA:CPU keeps buffers of its own beside the state.
CPU_SNAPSHOT_ALLOWANCE = Fraction(3, 2)
CPU_STATE_ALLOWANCE = Fraction(5, 4)


@dataclass(frozen=True)
class MemoryPlan:
    """Estimated bytes by memory. `accelerator_state` is exact state; `activations` an estimate."""

    host: int  # host RAM: masters, optimizer state, pinned weights and gradients, write-back staging
    pinned: int  # the part of `host` inside the accelerator's pinned pool
    accelerator_state: int  # weights, masters, optimizer state and gradients kept on the accelerator
    activations: int  # saved block inputs plus one block's transient activations and the logits
    two_pass_grads: int = 0  # the part of `pinned` that two-pass updates keep into the next step
    spares: int = 0  # the part of `host` that speculative updates keep as spare state
    devices: int = 1  # the mesh this plan is for: `host` and `pinned` are per process, the rest per device
    processes: int = 1

    def describe(self) -> str:
        return (
            f"host {self.host / GiB:.1f} GiB (pinned {self.pinned / GiB:.1f} GiB), accelerator "
            f"{self.accelerator_state / GiB:.1f} GiB state + ~{self.activations / GiB:.1f} GiB activations"
        )


def plan_memory(
    cfg: TrainConfig,
    offload: OffloadPlan | None = None,
    devices: int = 1,
    processes: int = 1,
    whole: tuple[int, int, int] = (0, 0, 0),
) -> MemoryPlan:
    """Bytes each memory must hold for `cfg` placed by `offload` (default: `resolve_plan(cfg)`) over
    `devices` devices in `processes` processes: host figures per process, accelerator figures per
    device; see the module docstring for the accounting. `whole`: parameters of the (embedding, one
    block, head) that no stage splits, their arrays' first axes not dividing by `devices`
    (`placement.whole_params`): every device and every process holds those whole, and each
    process's pinned memory one copy per local device."""
    offload = resolve_plan(cfg) if offload is None else offload
    D, P = devices, processes  # noqa: N806
    L = D // P  # noqa: N806 - devices per process

    m, d = cfg.model, cfg.data
    n_embed, n_block, n_head = unit_param_counts(m)
    params = {UnitKind.EMBED: n_embed, UnitKind.BLOCK: n_block, UnitKind.HEAD: n_head}
    unsplit = dict(zip((UnitKind.EMBED, UnitKind.BLOCK, UnitKind.HEAD), whole))
    n = n_embed + m.num_layers * n_block + n_head
    n_whole = whole[0] + m.num_layers * whole[1] + whole[2]

    def per_device(count: int, whole_count: int, nbytes: int, sharded: bool) -> int:
        """Bytes on one device of `count` elements (`whole_count` of them unsplittable) at `nbytes`."""
        return ((count - whole_count) // D + whole_count) * nbytes if sharded else count * nbytes

    def per_process(count: int, whole_count: int, nbytes: int, sharded: bool, copies: int = 1) -> int:
        """Bytes in one process: its devices' shards, and the unsplittable part once (host state) or
        once per local device (`copies=L`: pinned copies of each device's array)."""
        if not sharded:
            return count * nbytes
        return ((count - whole_count) // P + whole_count * copies) * nbytes

    opt = OPTIMIZER_STATE_BYTES.get(cfg.optimizer.name, 8)
    if cfg.optimizer.name == "sgd" and cfg.optimizer.momentum == 0:
        opt = 0
    if cfg.optimizer.state_dtype == "bfloat16":
        opt //= 2
    compute = 2 if m.compute_dtype == "bfloat16" else 4
    grad = 2 if offload.grad_dtype == "bfloat16" else 4

    tokens = d.batch_size * d.seq_len // D  # per step and device, all micro-batches
    micro_tokens = tokens // d.grad_accum
    block_input = tokens * m.hidden_size * compute
    saved_inputs = m.num_layers * block_input
    away = 0  # block inputs waiting in pinned host memory, this process's devices' (offload.activations)
    if offload.offloads_activations:
        # All but the last block's leave; at most one leaving and one coming back at a time.
        away, saved_inputs = (m.num_layers - 1) * block_input * L, min(m.num_layers, 3) * block_input
    # One block's live intermediates for one micro-batch (q/k/v/attn out, MLP up/gate/act, their
    # gradients) and the float32 logits with their gradient.
    block_transient = micro_tokens * (8 * m.hidden_size + 4 * m.intermediate_size) * compute * 2
    logits = 3 * micro_tokens * m.vocab_size * 4
    activations = saved_inputs + block_transient + logits

    saving = cfg.checkpoint.enabled and cfg.checkpoint.async_save
    snapshot = per_process(n, n_whole, 4 + opt, offload.shards_state) if saving else 0
    update = offload.host_update
    if update is None:
        state = (
            per_device(n, n_whole, 4, offload.shards_weights)
            + per_device(n, n_whole, opt, offload.shards_state)
            + per_device(n, n_whole, 4, offload.shards_grads)
        )
        return MemoryPlan(
            host=snapshot, pinned=0, accelerator_state=state, activations=activations, devices=D, processes=P
        )

    # The delayed update keeps two copies of the compute weights (the pass reads one while the host
    # writes the next) and two steps' gradients (the next pass's land while the host still updates
    # from the previous ones).
    copies = 2 if update.mode is UpdateMode.DELAYED else 1
    host = pinned = accelerator = two_pass = 0
    # Two-pass updates take the first host units in forward order (after those on the accelerator).
    host_index = -1
    for u in offload.units:
        n_u, w_u = params[u.kind], unsplit[u.kind]
        grad_u = grad if u.kind is UnitKind.BLOCK else 4  # embedding and head gradients: float32 sums
        if u.state is Tier.DEVICE:
            # Updated on the accelerator: masters, state, weights and the gradient (kept until the
            # norm is known), one shard per device; nothing of it in host RAM.
            accelerator += per_device(n_u, w_u, 4 + opt + compute + grad_u, True)
            # A checkpoint save copies its masters and state to host RAM, and a restore reads them
            # there first: the host holds them then.
            if cfg.checkpoint.enabled:
                host += per_process(n_u, w_u, 4 + opt, True)
            continue
        host_index += 1
        # One shard per device of everything the host keeps or writes: 1/P of it in each process
        # (of an unsplittable array, a whole copy per local device in pinned memory).
        if u.weights is Tier.PINNED_HOST:  # streamed
            pinned += copies * per_process(n_u, w_u, compute, True, copies=L)
        else:  # on the accelerator, and its new weights staged in pinned memory, one DMA away
            accelerator += copies * per_device(n_u, w_u, compute, True)  # one shard per device, any stage
            pinned += per_process(n_u, w_u, compute, True, copies=L)
        pinned += copies * per_process(n_u, w_u, grad_u, True, copies=L)
        if host_index < update.two_pass.max_units:  # gradients kept until the second pass, a step on
            two_pass += per_process(n_u, w_u, grad_u, True, copies=L)
        host += per_process(n_u, w_u, 4 + opt, True)  # masters and optimizer state
    pinned += two_pass + away
    spares = update.speculative_units * per_process(max(params.values()), max(whole), 4 + opt, True)
    host += pinned + snapshot + int(pinned * PINNED_ALLOWANCE) + spares
    streamed = offload.streamed_blocks
    in_flight = 3 if streamed else 0  # the block computing, the one prefetched, a gradient leaving
    accelerator += in_flight * n_block * max(compute, grad)
    return MemoryPlan(
        host=host,
        pinned=pinned,
        accelerator_state=accelerator,
        activations=activations,
        two_pass_grads=two_pass,
        spares=spares,
        devices=D,
        processes=P,
    )


def host_memory_available() -> int:
    """Bytes of host RAM available to this process now (MemAvailable), or total RAM if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def largest_fitting(
    cfg: TrainConfig, fits: Callable[[MemoryPlan], bool], devices: int = 1, processes: int = 1
) -> str | None:
    """The largest named model size that `fits` with `cfg`'s other settings (on `devices` devices in
    `processes` processes), or None."""
    best = None
    for name, model in sorted(NAMED_SIZES.items(), key=lambda kv: param_count(kv[1])):
        other = dataclasses.replace(
            cfg, model=dataclasses.replace(model, compute_dtype=cfg.model.compute_dtype)
        )
        if fits(plan_memory(other, devices=devices, processes=processes)):
            best = name
    return best


def _far_from(
    cfg: TrainConfig, plan: MemoryPlan, need: int, available: int, fits: Callable[[MemoryPlan], bool]
) -> str:
    """For a need far past what is available, what would fit: settings alone cannot close the gap."""
    if need <= 2 * available:
        return ""
    best = largest_fitting(cfg, fits, plan.devices, plan.processes)
    fitting = (
        f"the largest named model that fits with these settings is {best} "
        f"({param_count(NAMED_SIZES[best]) / 1e9:.2f}B parameters)"
        if best
        else "no named model fits with these settings"
    )
    return f" The gap is {need / max(available, 1):.0f}x, more than any setting below closes: {fitting}."


def check_host_fits(
    cfg: TrainConfig, need: MemoryPlan, available: int | None = None, sharing: int = 1
) -> None:
    """Raise ConfigError if the host state will not fit in host RAM, of which this process may count
    on 1/`sharing` (the processes of its run on this host each need as much). Nothing has been
    allocated yet."""
    available = (host_memory_available() if available is None else available) // sharing
    if need.host > available:
        far = _far_from(cfg, need, need.host, available, lambda p: p.host <= available)
        raise ConfigError(
            f"{cfg.model.name} with offload.optimizer={cfg.offload.optimizer}, offload.params="
            f"{cfg.offload.params} needs {need.host / GiB:.1f} GiB of host RAM ({need.describe()}), but "
            f"{available / GiB:.1f} GiB is available{_shared(sharing)}.{far} Free memory, choose a smaller "
            "model, run fewer processes per host, or use an "
            "optimizer with less state (optimizer.name=lion or sgd keep 4 bytes per parameter, AdamW 8)"
            + (
                f", lower offload.speculative_units (now {cfg.offload.speculative_units}; each keeps a "
                "spare copy of one unit's state)"
                if need.spares
                else ""
            )
            + (
                f", set offload.two_pass_units=0 or a small count (now {cfg.offload.two_pass_units}; "
                "two-pass units keep their gradients in pinned memory into the next step)"
                if need.two_pass_grads
                else ""
            )
            + (
                ", or set checkpoint.async_save=false (no snapshot copy)."
                if cfg.checkpoint.async_save
                else "."
            )
        )


def pinned_pool_minimum_gb(need: MemoryPlan) -> int:
    """The smallest pinned pool a run of `need` may have, in GB: its pinned bytes plus 10% and 2 GB."""
    return -(-need.pinned * 11 // (10 * 10**9)) + 2


def configure_pinned_pool(need: MemoryPlan) -> int | None:
    """Size XLA's pinned host pool for `need` before the GPU backend starts; return the cap in GB.

    XLA's GPU client caps `pinned_host` allocations at `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` (64 GB by
    default) and fails with RESOURCE_EXHAUSTED past it, mid-run. Below the cap the pool grows on
    demand by regions that double in size, so it can come to hold nearly twice what the run uses.
    When JAX has not started and the user has not set the variable, it is set here to this run's
    pool: the need's pinned bytes plus 25% and 2 GB (within the allowance `plan_memory` holds for
    it), so that host RAM holds what the need says. A user-set cap is kept if it is at least the
    run's minimum (10% and 2 GB over the need); a smaller one, or a running backend whose default
    cap is too small, is an error that says what to set. (XLA reads the variable in GiB, so each cap
    holds about 7% more than the GB figures here.)
    """
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
    if _backends_started():
        if need_gb <= PINNED_POOL_DEFAULT_GB:
            return PINNED_POOL_DEFAULT_GB
        raise ConfigError(
            f"this run needs {need_gb} GB of pinned host memory, over XLA's default "
            f"{PINNED_POOL_DEFAULT_GB} GB pool, and JAX has already started its backends. Set "
            f"{PINNED_POOL_ENV}={need_gb} in the environment before JAX starts (e.g. before the first "
            "jax.devices() call)."
        )
    pool_gb = max(need_gb, -(-need.pinned * 5 // (4 * 10**9)) + 2)
    os.environ[PINNED_POOL_ENV] = _pool_set_here[PINNED_POOL_ENV] = str(pool_gb)
    return pool_gb


_pool_set_here: dict[str, str] = {}  # what `configure_pinned_pool` set in this process's environment


def pinned_pool_reservation(need: MemoryPlan, platform: str) -> int:
    """Bytes an offloaded run allocates (and frees) in XLA's pinned host pool as it initialises: the
    need's pinned bytes on a GPU; 0 elsewhere (the CPU backend's `pinned_host` memory is plain host
    memory, with no pool).

    XLA's GPU client grows the pool on demand by regions that double in size, each page-locked as
    it is created, which stalls the step that creates it for seconds. One allocation of what the
    run will hold creates the region at start-up instead (a copy of that many bytes: seconds), and
    the steady state then allocates inside it. The region is capped by the pool's size
    (`configure_pinned_pool`)."""
    return need.pinned if platform == "gpu" else 0


def _backends_started() -> bool:
    """Whether JAX has started its backends (after which XLA's pinned pool cap is fixed)."""
    try:
        # Imported here: a private module, so that its move costs this fallback, not jaxzero's import.
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # private API moved: assume the worst and ask the user
        return True


def accelerator_capacity(device) -> int | None:
    """Bytes the allocator may use on `device` (a CPU "accelerator" has the host's free RAM), or None
    where the backend does not say."""
    if device.platform == "cpu":
        return host_memory_available()
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return stats.get("bytes_limit") if stats else None


def check_accelerator_fits(cfg: TrainConfig, need: MemoryPlan, capacity: int | None) -> str | None:
    """Raise ConfigError if the state the accelerator must hold exceeds `capacity` bytes; return a
    warning if state plus estimated activations does (the estimate is rough, so that only warns)."""
    if capacity is None:
        return None
    if cfg.offload.optimizer == "none":
        hint = "offload.optimizer=cpu keeps masters and optimizer state in host RAM"
    elif cfg.offload.params == "none":
        hint = "offload.params=cpu streams the weights from host RAM one block at a time"
    elif cfg.offload.resident_blocks:
        hint = "lower offload.resident_blocks"
    else:
        hint = "lower data.batch_size or data.seq_len, or raise data.grad_accum"
    if need.accelerator_state > capacity:
        far = _far_from(
            cfg, need, need.accelerator_state, capacity, lambda p: p.accelerator_state <= capacity
        )
        raise ConfigError(
            f"{cfg.model.name} with offload.optimizer={cfg.offload.optimizer}, "
            f"offload.params={cfg.offload.params} needs {need.accelerator_state / GiB:.1f} GiB of "
            f"accelerator memory for its state alone ({need.describe()}), but the device has "
            f"{capacity / GiB:.1f} GiB.{far} Otherwise: {hint}."
        )
    if need.accelerator_state + need.activations > capacity:
        return (
            f"warning: estimated accelerator use {(need.accelerator_state + need.activations) / GiB:.1f} GiB "
            f"exceeds the device's {capacity / GiB:.1f} GiB; if it runs out of memory: {hint}."
        )
    return None


def _shared(sharing: int) -> str:
    return f" to each of the {sharing} processes on this host" if sharing > 1 else ""


def check_fits(cfg: TrainConfig, need: MemoryPlan, device: Any, sharing: int = 1) -> str | None:
    """Raise ConfigError if `need` does not fit this machine, with the numbers and what to change;
    return a warning if only the activation estimate does not. `sharing`: the processes of this run
    on this host, each needing as much host RAM. On a CPU backend the "accelerator" is host RAM too,
    so the host's and the device's bytes must fit together."""
    if device.platform != "cpu":
        if need.host:
            check_host_fits(cfg, need, sharing=sharing)
        return check_accelerator_fits(cfg, need, accelerator_capacity(device))
    available = host_memory_available() // sharing

    def ram(p: MemoryPlan) -> int:  # this process's devices are its RAM too
        local = p.devices // p.processes
        return int(p.host * CPU_SNAPSHOT_ALLOWANCE + local * p.accelerator_state * CPU_STATE_ALLOWANCE)

    total = ram(need)
    if total > available:
        far = _far_from(cfg, need, total, available, lambda p: ram(p) <= available)
        raise ConfigError(
            f"{cfg.model.name} with offload.optimizer={cfg.offload.optimizer}, offload.params="
            f"{cfg.offload.params} needs about {total / GiB:.1f} GiB of RAM on this CPU-only machine (host "
            f"and device state, {need.describe()}, with XLA's and the checkpoint writer's buffers), but "
            f"{available / GiB:.1f} GiB is available{_shared(sharing)}.{far} "
            "Otherwise: choose a smaller model, an optimizer with less state (optimizer.name=lion or sgd), "
            "optimizer.state_dtype=bfloat16, or checkpoint.async_save=false (no snapshot copy)."
        )
    estimate = total + need.activations * need.devices // need.processes  # this process's devices
    if estimate > available:
        return (
            f"warning: estimated use {estimate / GiB:.1f} GiB exceeds the "
            f"{available / GiB:.1f} GiB available; if it runs out of memory, lower data.batch_size or "
            "data.seq_len, or raise data.grad_accum."
        )
    return None
