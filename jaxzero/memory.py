"""Memory planning: will this run fit, and how large must XLA's pinned host pool be?

Everything here is arithmetic on the config and its offload plan, so it runs before JAX starts a
backend and before any array is allocated: a run that cannot fit fails at once with the numbers,
never after minutes of initialisation. Byte counts per parameter, by where the state lives:

    state                          resident        offload.optimizer=cpu      + offload.params=cpu
    fp32 masters                   4  accelerator  4  host RAM                4  host RAM
    optimizer state (AdamW)        8  accelerator  8  host RAM                8  host RAM
    compute-dtype weights          -  (cast per    2  accelerator             2  pinned host (streamed)
                                       block)
    gradients (blocks)             2|4 accelerator 2|4 pinned host            2|4 pinned host
    gradients (embed, head)        2|4 accelerator 4  pinned host             4  pinned host
    weights staging                -               2  pinned host             2  pinned host (embed/head)

(gradients leave in the compute dtype with one micro-batch, as float32 sums with several; the host
update writes the new weights of units that live on the accelerator into pinned staging buffers, one
DMA away, and every unit may be in flight at once. Two-pass updates keep their units' gradients
into the next step: up to 2|4 more. The delayed update keeps two steps' gradients and two copies of
the compute weights. With `offload.activations=cpu` the blocks' saved inputs but the last's wait in
pinned host memory, and the accelerator holds three of them at most. Units whose state
`offload.device_state_units` keeps on the accelerator count as resident ones there: masters, state
and their gradients, and a compute-dtype cast of the largest of them while it computes. Units
whose state `offload.optimizer=disk` keeps on disk hold it there; host RAM holds `disk_slots`
buffers of the largest of them.)
With checkpoints on, a save or a restore, asynchronous or not, adds `checkpoint_bytes` to host RAM:
the checkpoint buffer (`checkpoint.buffer_gib`), one unit's masters and state (a part is copied
from the accelerator, or read from disk, whole; `jaxzero.checkpoint`), and `SAVE_WORKING_BYTES`.
The pinned bytes of an offloaded run live in XLA's pinned pool, which takes host RAM by regions of
powers of two (`pinned_pool_bytes`). Activations are the saved block inputs and the head's and a block's
backward transients (`transient_activations`): the larger of the two, or, where a block's do not fit
the hole the head's leave below the gradient the head returns, both (`backward_phases`); a resident
run's gradients, and
those of the units the accelerator updates, take the place of the block inputs as the backward pass
frees them. A GPU process holds about `GPU_PROCESS_RSS` more of its own.

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
from typing import Any, NamedTuple

from jaxzero.checkpoint import buffer_bytes
from jaxzero.config import ConfigError, ModelConfig, TrainConfig
from jaxzero.models.sizes import NAMED_SIZES, param_count, unit_param_counts
from jaxzero.objective import head_pieces
from jaxzero.plan import OffloadPlan, Tier, UnitKind, UpdateMode, resolve_plan

GiB = 2**30
PINNED_POOL_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
ACCELERATOR_FRACTION = "0.95"  # of each GPU's memory for XLA (`claim_accelerator_memory`)
PINNED_POOL_DEFAULT_GB = 64  # XLA's GPU client default cap on pinned_host allocations
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "lion": 4, "sgd": 4}
# XLA's pinned pool is a BFC allocator that grows by regions of 2 MiB doubled until one holds the
# request, each at most what its cap leaves; jaxzero's start-up reservation makes one such region.
POOL_FIRST_REGION = 2 * 2**20
# What a GPU process holds in host RAM besides its arrays and pools (the CUDA context, XLA, Python):
# the RSS of resident runs, whose state is all on the GPU (BENCHMARKS.md, issue 14).
GPU_PROCESS_RSS = 5 * GiB
# The start-up reservation asks for this much more than the pinned arrays, so that the region it makes
# holds them with the allocator's fragmentation; a region filled to the brim (99.4%: BENCHMARKS.md)
# grew a second one.
POOL_SLACK = Fraction(1, 50)
# A run whose pinned arrays fill more of the start-up region than this grows a second region as large
# (clipped by the cap): regions filled to 99.4% and to 96% by the plan's pinned bytes (the second:
# llama-20b on one H200) both grew one, the run's pinned peak being a few percent above the count.
POOL_FILL = Fraction(9, 10)
# On a CPU backend, where one RAM holds everything, XLA:CPU keeps buffers of its own beside the state.
CPU_HOST_ALLOWANCE = Fraction(3, 2)
# Orbax's and TensorStore's working memory during a save or a restore, beside the buffer and the unit
# it holds: up to 53 MB measured on the CPU (`tests/programs/checkpoint_rss.py`, BENCHMARKS.md).
SAVE_WORKING_BYTES = 128 * 2**20
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
    disk: int = 0  # local disk: masters and optimizer state of the units kept there (per process)
    devices: int = 1  # the mesh this plan is for: `host` and `pinned` are per process, the rest per device
    processes: int = 1

    def describe(self) -> str:
        disk = f", disk {self.disk / GiB:.1f} GiB" if self.disk else ""
        return (
            f"host {self.host / GiB:.1f} GiB (pinned {self.pinned / GiB:.1f} GiB), accelerator "
            f"{self.accelerator_state / GiB:.1f} GiB state + ~{self.activations / GiB:.1f} GiB "
            f"activations{disk}"
        )


def checkpoint_bytes(cfg: TrainConfig, largest_unit: int, state: int) -> int:
    """Host RAM a save or a restore adds (0 with checkpoints off): the checkpoint buffer
    (`checkpoint.buffer_gib`) and the largest unit's masters and state (`largest_unit` bytes in this
    process), each at most the whole `state`, and Orbax's and TensorStore's working memory."""
    if not cfg.checkpoint.enabled:
        return 0
    return min(state, buffer_bytes(cfg.checkpoint)) + min(state, largest_unit) + SAVE_WORKING_BYTES


def optimizer_state_bytes(cfg: TrainConfig) -> int:
    """Optimizer state bytes per parameter: AdamW's two moments 8 (4 in bfloat16), Lion's and SGD's
    momentum 4 (2), plain SGD none."""
    opt = OPTIMIZER_STATE_BYTES.get(cfg.optimizer.name, 8)
    if cfg.optimizer.name == "sgd" and cfg.optimizer.momentum == 0:
        return 0
    return opt // 2 if cfg.optimizer.state_dtype == "bfloat16" else opt


class Transient(NamedTuple):
    """Bytes one device holds for one micro-batch while a unit's backward runs, past its inputs."""

    block: int  # a block's rematerialised backward: recomputed intermediates and their gradients
    head: int  # the head's float32 logits and their gradient, and the gradient it returns
    head_out: int  # of `head`, the gradient it returns (the hidden state's), alive past the phase


def backward_phases(transient: Transient, head_grad: int = 0) -> int:
    """Bytes past the saved block inputs while the backward's phases run: the head's (its transients
    and `head_grad`, a gradient it writes that leaves at once), then each block's.

    The head's outputs (the gradient it returns, `head_grad`) are allocated while its temporaries
    are, so XLA's allocator places them past those; the temporaries' space, freed, is then a hole
    below outputs that are still alive. A block's backward needs its temporaries in one piece: when
    they are larger than that hole they go past the head's outputs, so the GPU must hold the hole,
    the outputs and the block's temporaries at once (measured: llama-7b at 188,416 tokens on an H100
    ran out of memory with 28.6 GiB free in total, 15.8 GiB in one piece, for 25.7 GiB)."""
    head = transient.head + head_grad
    hole = transient.head - transient.head_out
    if transient.block <= hole:
        return max(transient.block, head)
    return head + transient.block


def transient_activations(m: ModelConfig, micro_tokens: int, seq_len: int | None = None) -> Transient:
    """The transient terms of the activation estimate for `micro_tokens` tokens of one micro-batch on
    one device, fitted to the temporaries XLA compiles for them on an H200 (within 6% for the
    3.4B-20B Llamas; `scripts/bench_activations.py` prints both): a block's backward holds its q, k, v
    and their gradients, two more of the width of the hidden state, and four of the MLP's; the
    head's, the float32 logits and their gradient (of one piece of each sequence where the loss
    runs in pieces: `objective.head_pieces`, for sequences of `seq_len`, with then the output
    projection in float32 and its float32 gradient sum), and the gradient it returns."""
    compute = 2 if m.compute_dtype == "bfloat16" else 4
    kv = m.hidden_size * m.num_kv_heads // m.num_heads
    widths = 2 * (m.hidden_size + 2 * kv) + 2 * m.hidden_size + 4 * m.intermediate_size
    block = micro_tokens * widths * compute
    seq_len = seq_len or micro_tokens
    pieces = head_pieces(max(1, micro_tokens // seq_len), seq_len, m.vocab_size)
    head_out = micro_tokens * m.hidden_size * compute
    head = micro_tokens // pieces * 2 * m.vocab_size * 4 + head_out
    if pieces > 1:  # the output projection's float32 copy and the float32 sum of its gradient
        head += 2 * m.vocab_size * m.hidden_size * 4
    return Transient(block=block, head=head, head_out=head_out)


def _beside_late_gradients(activations: int, grads: int, transient: Transient) -> int:
    """The activation estimate on top of state that counts `grads` in full, where those gradients
    are written as the backward pass frees the block inputs (a resident run's; the accelerator-updated
    units'): the peak is at its start (every block input, the head's phase) or at its end (those
    gradients and the last block's backward), whichever is larger."""
    return max(activations - grads, transient.block) if grads else activations


def plan_memory(
    cfg: TrainConfig,
    offload: OffloadPlan | None = None,
    devices: int = 1,
    processes: int = 1,
    whole: tuple[int, int, int] = (0, 0, 0),
    pool_cap: int | None = None,
) -> MemoryPlan:
    """Bytes each memory must hold for `cfg` placed by `offload` (default: `resolve_plan(cfg)`) over
    `devices` devices in `processes` processes: host figures per process, accelerator figures per
    device; see the module docstring for the accounting. `whole`: parameters of the (embedding, one
    block, head) that no stage splits, their arrays' first axes not dividing by `devices`
    (`placement.whole_params`): every device and every process holds those whole, and each
    process's pinned memory one copy per local device. `pool_cap`: XLA's pinned pool cap in bytes
    where it is fixed already (default: the one jaxzero sets for this plan when it starts JAX)."""
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

    opt = optimizer_state_bytes(cfg)
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
    # The saved block inputs, and the two phases that run over them (the head's loss and gradient,
    # then each block's backward), as the allocator places them (`backward_phases`).
    transient = transient_activations(m, micro_tokens, d.seq_len)
    activations = saved_inputs + backward_phases(transient)

    # A save or a restore: the checkpoint buffer and one unit's masters and state (`checkpoint_bytes`).
    units = {kind: per_process(params[kind], unsplit[kind], 4 + opt, offload.shards_state) for kind in params}
    state_bytes = per_process(n, n_whole, 4 + opt, offload.shards_state)
    saving = checkpoint_bytes(cfg, max(units.values()), state_bytes)

    update = offload.host_update
    if update is None:
        # One micro-batch's gradients stay in the compute dtype (XLA fuses their cast to float32 into
        # the norm and the update); several micro-batches sum into float32 beside the activations.
        grads = per_device(n, n_whole, compute if d.grad_accum == 1 else 4, offload.shards_grads)
        state = per_device(n, n_whole, 4, offload.shards_weights)
        state += per_device(n, n_whole, opt, offload.shards_state)
        activations = _beside_late_gradients(activations, grads if d.grad_accum == 1 else 0, transient)
        return MemoryPlan(
            host=saving,
            pinned=0,
            accelerator_state=state + grads,
            activations=activations,
            devices=D,
            processes=P,
        )
    # The head's float32 gradient is on the accelerator while the head's phase runs, and leaves.
    head_grad = per_device(n_head, unsplit[UnitKind.HEAD], 4, True)
    activations = saved_inputs + backward_phases(transient, head_grad)

    # The delayed update keeps two copies of the compute weights (the pass reads one while the host
    # writes the next) and two steps' gradients (the next pass's land while the host still updates
    # from the previous ones).
    copies = 2 if update.mode is UpdateMode.DELAYED else 1
    host = pinned = accelerator = two_pass = device_grads = device_cast = disk = disk_unit = 0
    # Two-pass updates take the first host units in forward order (after those on the accelerator).
    host_index = -1
    for u in offload.units:
        n_u, w_u = params[u.kind], unsplit[u.kind]
        grad_u = grad if u.kind is UnitKind.BLOCK else 4  # embedding and head gradients: float32 sums
        if u.state is Tier.DEVICE:
            # Updated on the accelerator: masters, state and the gradient (kept until the norm is
            # known), one shard per device; nothing of it in host RAM. The passes read the masters,
            # casting one unit at a time to the compute dtype, whole (below).
            accelerator += per_device(n_u, w_u, 4 + opt + grad_u, True)
            device_grads += per_device(n_u, w_u, grad_u, True)
            device_cast = max(device_cast, n_u * compute)
            continue
        host_index += 1
        if u.state is Tier.DISK:
            # Masters and state on disk; in RAM while read ahead, updated or written back (one of
            # the `disk_slots` buffers, each as large as the largest disk unit); a save or a restore
            # reads one unit at a time (`checkpoint_bytes`).
            state_u = per_process(n_u, w_u, 4 + opt, True)
            disk, disk_unit = disk + state_u, max(disk_unit, state_u)
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
        if u.state is Tier.HOST:
            host += per_process(n_u, w_u, 4 + opt, True)  # masters and optimizer state
    pinned += two_pass + away
    host += offload.disk_slots * disk_unit
    spares = update.speculative_units * per_process(max(params.values()), max(whole), 4 + opt, True)
    host += pinned_pool_bytes(pinned, L, pool_cap) + saving + spares
    streamed = offload.streamed_blocks
    in_flight = 3 if streamed else 0  # the block computing, the one prefetched, a gradient leaving
    accelerator += in_flight * n_block * max(compute, grad) + device_cast
    # The units the accelerator updates come first in the forward order: their gradients appear last
    # in the backward pass, as it frees the block inputs (not where those wait in pinned memory).
    late = device_grads if d.grad_accum == 1 and not offload.offloads_activations else 0
    activations = _beside_late_gradients(activations, late, transient)
    return MemoryPlan(
        host=host,
        pinned=pinned,
        accelerator_state=accelerator,
        activations=activations,
        two_pass_grads=two_pass,
        spares=spares,
        disk=disk,
        devices=D,
        processes=P,
    )


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
                f", or lower checkpoint.buffer_gib (now {cfg.checkpoint.buffer_gib})."
                if cfg.checkpoint.enabled
                else "."
            )
        )


def pinned_pool_cap_gb(pinned: int) -> int:
    """The pool jaxzero gives a run of `pinned` bytes when it starts JAX: 25% and 2 GB more, in the
    GB figure XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB takes (which XLA reads as GiB)."""
    return -(-pinned * 5 // (4 * 10**9)) + 2


def pinned_pool_bytes(pinned: int, local_devices: int = 1, cap: int | None = None) -> int:
    """Host RAM that XLA's pinned pool takes once `pinned` bytes are reserved in it at start-up, split
    over `local_devices` (`host_memory.reserve_pinned`): each device's share grows the pool by one
    region, a power of two from `POOL_FIRST_REGION` up, clipped by what the cap leaves (`cap`, bytes:
    by default the one `configure_pinned_pool` sets for this `pinned`). The run's pinned arrays then
    live inside those regions, unless they fill more than `POOL_FILL` of one: then the pool grows a
    second region as large, as far as the cap lets it."""
    if not pinned:
        return 0
    cap = pinned_pool_cap_gb(pinned) * GiB if cap is None else cap
    share = -(-pinned_pool_reservation_bytes(pinned) // local_devices)
    region = POOL_FIRST_REGION
    while region < share:
        region *= 2
    regions = 2 if -(-pinned // local_devices) > POOL_FILL * region else 1
    return min(local_devices * regions * region, cap)


def pinned_pool_cap() -> int | None:
    """XLA's pinned pool cap in bytes where the environment fixes it (set by the user, or by
    `configure_pinned_pool`), else None."""
    value = os.environ.get(PINNED_POOL_ENV)
    return int(float(value) * GiB) if value else None


def pinned_pool_minimum_gb(need: MemoryPlan) -> int:
    """The smallest pinned pool a run of `need` may have, in GB: its pinned bytes plus 10% and 2 GB."""
    return -(-need.pinned * 11 // (10 * 10**9)) + 2


def configure_pinned_pool(need: MemoryPlan) -> int | None:
    """Size XLA's pinned host pool for `need` before the GPU backend starts; return the cap in GB.

    XLA's GPU client caps `pinned_host` allocations at `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` (64 GB by
    default) and fails with RESOURCE_EXHAUSTED past it, mid-run. Below the cap the pool grows on demand
    by regions that double in size, so it can come to hold nearly twice what the run uses. When JAX has
    not started and the user has not set the variable, it is set here to this run's pool: the need's
    pinned bytes plus 25% and 2 GB (`pinned_pool_cap_gb`), which also bounds the region the start-up
    reservation makes (`pinned_pool_bytes`, what `plan_memory` counts). A user-set cap is kept if it is
    at least the run's minimum (10% and 2 GB over the need); a smaller one, or a running backend whose
    default cap is too small, is an error that says what to set. (XLA reads the variable in GiB, so each
    cap holds about 7% more than the GB figures here.)
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
    pool_gb = max(need_gb, pinned_pool_cap_gb(need.pinned))
    os.environ[PINNED_POOL_ENV] = _pool_set_here[PINNED_POOL_ENV] = str(pool_gb)
    return pool_gb


_pool_set_here: dict[str, str] = {}  # what `configure_pinned_pool` set in this process's environment


def pinned_pool_reservation_bytes(pinned: int) -> int:
    """What the start-up reservation asks of the pool for `pinned` bytes of arrays: `POOL_SLACK` more."""
    return int(pinned * (1 + POOL_SLACK))


def pinned_pool_reservation(need: MemoryPlan, platform: str) -> int:
    """Bytes an offloaded run allocates (and frees) in XLA's pinned host pool as it initialises: the
    need's pinned bytes on a GPU; 0 elsewhere (the CPU backend's `pinned_host` memory is plain host
    memory, with no pool).

    XLA's GPU client grows the pool on demand by regions that double in size, each page-locked as
    it is created, which stalls the step that creates it for seconds. One allocation of what the
    run will hold creates the region at start-up instead (a copy of that many bytes: seconds), and
    the steady state then allocates inside it. The region is capped by the pool's size
    (`configure_pinned_pool`), and made a little larger than the need (`POOL_SLACK`)."""
    return pinned_pool_reservation_bytes(need.pinned) if platform == "gpu" else 0


def claim_accelerator_memory() -> None:
    """Before JAX starts its backend: let XLA's GPU allocator take 95% of each GPU's memory instead of
    its default 75% (35 GiB of an H200 left idle), so that the planner and the run see the card; the
    rest holds the CUDA context and cuDNN's and NCCL's workspaces. A fraction the user set is kept."""
    if not _backends_started():
        os.environ.setdefault(MEM_FRACTION_ENV, ACCELERATOR_FRACTION)


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
        return int(p.host * CPU_HOST_ALLOWANCE + local * p.accelerator_state * CPU_STATE_ALLOWANCE)

    total = ram(need)
    if total > available:
        far = _far_from(cfg, need, total, available, lambda p: ram(p) <= available)
        raise ConfigError(
            f"{cfg.model.name} with offload.optimizer={cfg.offload.optimizer}, offload.params="
            f"{cfg.offload.params} needs about {total / GiB:.1f} GiB of RAM on this CPU-only machine (host "
            f"and device state, {need.describe()}, with XLA's and the checkpoint writer's buffers), but "
            f"{available / GiB:.1f} GiB is available{_shared(sharing)}.{far} "
            "Otherwise: choose a smaller model, an optimizer with less state (optimizer.name=lion or sgd), "
            "or optimizer.state_dtype=bfloat16."
        )
    estimate = total + need.activations * need.devices // need.processes  # this process's devices
    if estimate > available:
        return (
            f"warning: estimated use {estimate / GiB:.1f} GiB exceeds the "
            f"{available / GiB:.1f} GiB available; if it runs out of memory, lower data.batch_size or "
            "data.seq_len, or raise data.grad_accum."
        )
    return None
