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
Every element counts `dtype_bytes` of its dtype: float32 4, bfloat16 and float16 2.
With checkpoints on, a save or a restore, asynchronous or not, adds `checkpoint_bytes` to host RAM:
the checkpoint buffer (`checkpoint.buffer_gib`), one unit's masters and state (a part is copied
from the accelerator, or read from disk, whole; `jaxzero.storage.checkpoint`), and `SAVE_WORKING_BYTES`.
The pinned bytes of an offloaded run live in XLA's pinned pool, which takes host RAM by regions of
powers of two (`pinned_pool_bytes`). Activations are the saved block inputs and the head's and a
block's backward transients (`transient_activations`): the larger of the two, or, where a block's do
not fit the hole the head's leave below the gradient the head returns, both (`backward_phases`); a
resident run's gradients, and those of the units the accelerator updates, take the place of the
block inputs as the backward pass frees them. A GPU process holds about `GPU_PROCESS_RSS` more of its
own per GPU it drives, and an offloaded one `OFFLOAD_PROCESS_RSS` more (`process_allowance`,
`host_ram_need`).

Over a mesh of D devices in P processes (`devices`, `processes`), the figures are per process (host
RAM, pinned) and per device (accelerator): what the ZeRO stage shards divides by D on the
accelerator and by P on the host; activations divide by D. An array whose first axis does not
divide by D is whole everywhere (`whole`), counted so.

Where each unit's arrays live comes from the offload plan (`jaxzero.plan`); the measured constants
from `jaxzero.planner.calibration`. This module only counts, and checks counts against capacities it is
given: what the process's environment and the machine say is read by `jaxzero.planner.runtime`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from jaxzero.config import CheckpointConfig, ConfigError, ModelConfig, TrainConfig, buffer_bytes
from jaxzero.models.grouped_matmul import MOSAIC_ALIGN
from jaxzero.models.moe import BLOCK_ROWS
from jaxzero.models.sizes import NAMED_SIZES, param_count, unit_param_counts
from jaxzero.numerics.objective import head_pieces
from jaxzero.plan import OffloadPlan, Tier, UnitKind, UpdateMode, resolve_plan
from jaxzero.planner.calibration import (
    CPU_HOST_ALLOWANCE,
    CPU_STATE_ALLOWANCE,
    GPU_PROCESS_RSS,
    OFFLOAD_PROCESS_RSS,
    POOL_FILL,
    POOL_FIRST_REGION,
    POOL_SLACK,
    SAVE_WORKING_BYTES,
    GiB,
)

# Bytes per element of each dtype a config or a plan names (`dtype_bytes`).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Arrays of optimizer state per parameter, each of `optimizer.state_dtype` (`optimizer_state_bytes`).
OPTIMIZER_MOMENTS = {"adamw": 2, "adam": 2, "lion": 1, "sgd": 1}


@dataclass(frozen=True)
class MemoryPlan:
    """Estimated bytes by memory. `accelerator_state` is exact state; `activations` an estimate."""

    host: int  # host RAM: masters, optimizer state, pinned weights and gradients, write-back staging
    pinned: int  # the part of `host` inside the accelerator's pinned pool
    accelerator_state: int  # weights, masters, optimizer state and gradients kept on the accelerator
    activations: int  # saved block inputs plus one block's transient activations and the logits
    two_pass_grads: int = 0  # the part of `pinned` that two-pass updates keep into the next step
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


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of `dtype` ("float32", "bfloat16" or "float16", as `model.compute_dtype`,
    `optimizer.state_dtype` and a plan's `grad_dtype` name it): 4, 2, 2; every state byte count's rule."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(
            f"no byte count for dtype {dtype!r}: jaxzero counts {', '.join(DTYPE_BYTES)}; add it to "
            "memory.DTYPE_BYTES if it is to be stored"
        ) from None


def checkpoint_bytes(cfg: TrainConfig, largest_unit: int, state: int) -> int:
    """Host RAM a save or a restore adds (0 with checkpoints off): the checkpoint buffer
    (`checkpoint.buffer_gib`) and the largest unit's masters and state (`largest_unit` bytes in this
    process), each at most the whole `state`, and Orbax's and TensorStore's working memory."""
    if not cfg.checkpoint.enabled:
        return 0
    return min(state, buffer_bytes(cfg.checkpoint)) + min(state, largest_unit) + SAVE_WORKING_BYTES


def optimizer_moments(cfg: TrainConfig) -> int:
    """Arrays of optimizer state per parameter: AdamW's and Adam's two moments, Lion's and SGD's
    momentum one, plain SGD (momentum 0) none."""
    if cfg.optimizer.name == "sgd" and cfg.optimizer.momentum == 0:
        return 0
    return OPTIMIZER_MOMENTS.get(cfg.optimizer.name, 2)


def optimizer_state_bytes(cfg: TrainConfig) -> int:
    """Optimizer state bytes per parameter: `optimizer_moments` in `optimizer.state_dtype` (AdamW 8,
    4 in bfloat16; Lion and SGD 4, 2; plain SGD none)."""
    return optimizer_moments(cfg) * dtype_bytes(cfg.optimizer.state_dtype)


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
    the outputs and the block's temporaries at once (BENCHMARKS.md, "the longest llama-7b sequence on
    one H100, with and without the activation tier")."""
    head = transient.head + head_grad
    hole = transient.head - transient.head_out
    if transient.block <= hole:
        return max(transient.block, head)
    return head + transient.block


# fmt: off
def padded_experts_bytes(
    tokens: int, top_k: int, experts: int, hidden: int, intermediate: int, compute_bytes: int,
    block_rows: int = BLOCK_ROWS,
) -> int:
    # fmt: on
    """Bytes one MoE layer's rematerialised backward holds at its peak for `tokens` tokens on one
    GPU, as `moe.experts_padded` (the default grouping) materialises them. With N = tokens x top_k
    rows, blocks = ceil(N / block_rows) + experts and R = blocks x block_rows padded rows, in the
    compute dtype (`compute_bytes`):
      each block's gathered kernels, (blocks, D, 2F) and (blocks, F, D):   blocks x 3DF
      the padded rows (R, D) in, (R, 2F) [gate | up], (R, F) activated,
        (R, D) out:                                                         R x (2D + 3F)
      the N sorted rows:                                                    N x D
    Their gradients and the experts' float32 kernel-gradient sums reuse what the forward's free: the
    GPU compiler's temporaries for one layer's gradient were within a few percent of this
    (BENCHMARKS.md, "What the padded expert grouping holds on the GPU"). The CPU backend reuses less
    and compiles about twice it (tests/test_moe_memory.py)."""
    n = tokens * top_k
    blocks = -(-n // block_rows) + experts
    kernels = blocks * 3 * hidden * intermediate
    rows = blocks * block_rows * (2 * hidden + 3 * intermediate)
    return (kernels + rows + n * hidden) * compute_bytes


def grouped_experts_bytes(
    tokens: int, top_k: int, experts: int, hidden: int, intermediate: int, compute_bytes: int
) -> int:
    """Bytes one MoE layer's rematerialised backward holds at its peak for `tokens` tokens through
    the grouped matmul (`grouped_matmul.mosaic_matmul`, reading each expert's kernels in place): the
    N = tokens x top_k sorted rows (N, D) in and their gradient, (N, 2F) [gate | up], (N, F)
    activated, (N, D) out, in the compute dtype (-5% and -7% of the H100 compiles of Qwen3-30B-A3B's
    and Mixtral's layers: BENCHMARKS.md, "Issue 45 on one H100"); widths that are no multiple of the
    kernels' tile add the padded copy of the `experts` kernels and its gradient (`dims_padded`)."""
    rows = tokens * top_k * (3 * hidden + 3 * intermediate)
    wide, deep = (-(-n // MOSAIC_ALIGN) * MOSAIC_ALIGN for n in (hidden, intermediate))
    padded = 0 if (wide, deep) == (hidden, intermediate) else 2 * experts * 3 * wide * deep
    return (rows + padded) * compute_bytes


def transient_activations(
    m: ModelConfig, micro_tokens: int, seq_len: int | None = None, documents: bool = False
) -> Transient:
    """The transient terms of the activation estimate for `micro_tokens` tokens of one micro-batch on
    one device, fitted to the temporaries XLA compiles for them (BENCHMARKS.md, "What a step's
    transients take on the GPU"; `scripts/bench_activations.py` prints both): a block's backward
    holds its q, k, v and their gradients, two more of the width of the hidden state, and four of the
    MLP's (a mixture of experts' MLP: `padded_experts_bytes`, or `grouped_experts_bytes` for the
    Mosaic grouped matmul); the head's, the
    float32 logits and their gradient (of one piece of each sequence where the loss runs in pieces:
    `objective.head_pieces`, for sequences of `seq_len`, with then the output projection in float32
    and its float32 gradient sum), and the gradient it returns. With `documents` (attention kept
    inside each document), a block's backward also holds two float32 (rows, heads, seq_len, seq_len)
    arrays: what document-aware attention compiled to on the GPU (BENCHMARKS.md, "on one H200:
    determinism, and document-aware attention's cost"); Gemma 3's windowed attention, a mask as
    well, and gpt-oss's in XLA count as that; its local layers on cuDNN's path (not attention_impl=xla),
    two float32 (rows, heads, seq_len, 2 * window) arrays ("Issue 45 on one H100, fifth session")."""
    compute = dtype_bytes(m.compute_dtype)
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    widths = 2 * (q + 2 * kv) + 2 * m.hidden_size + 4 * m.intermediate_size
    experts = 0
    if m.num_experts:
        widths = 2 * (q + 2 * kv) + 2 * m.hidden_size
        e, k, f = m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size
        if m.moe_impl == "mosaic":
            experts = grouped_experts_bytes(micro_tokens, k, e, m.hidden_size, f, compute)
        else:  # padded, or auto not yet decided for a machine: the larger count
            experts = padded_experts_bytes(micro_tokens, k, e, m.hidden_size, f, compute)
    block = micro_tokens * widths * compute + experts
    seq_len = seq_len or micro_tokens
    rows = micro_tokens // seq_len  # gpt-oss's local layers on cuDNN's path: blocks of two windows
    cudnn = m.attention_impl != "xla" and m.compute_dtype != "float32"  # as a GPU's `auto` resolves
    if m.family == "gpt_oss" and not documents and cudnn and m.sliding_window:
        block += 2 * rows * m.num_heads * seq_len * min(seq_len, 2 * m.sliding_window) * 4
    elif documents or m.family in ("gemma3", "gpt_oss"):
        block += 2 * rows * m.num_heads * seq_len * seq_len * 4
    pieces = head_pieces(max(1, rows), seq_len, m.vocab_size)
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
    params, unsplit = UnitKind.keyed((n_embed, n_block, n_head)), UnitKind.keyed(whole)
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
    compute, grad = dtype_bytes(m.compute_dtype), dtype_bytes(offload.grad_dtype)

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
    documents = not d.cross_document_attention and d.eot_id >= 0  # attention within each document
    transient = transient_activations(m, micro_tokens, d.seq_len, documents)
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
    host += pinned_pool_bytes(pinned, L, pool_cap) + saving
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
        disk=disk,
        devices=D,
        processes=P,
    )


def largest_fitting(
    cfg: TrainConfig, fits: Callable[[MemoryPlan], bool], devices: int = 1, processes: int = 1
) -> str | None:
    """The largest named model size that `fits` with `cfg`'s other settings (on `devices` devices in
    `processes` processes), or None."""
    best = None
    for name, model in sorted(NAMED_SIZES.items(), key=lambda kv: param_count(kv[1])):
        # The units on the accelerator, as many as the other model has (it may have fewer).
        units = min(cfg.offload.device_state_units, model.num_layers + 1)
        other = dataclasses.replace(
            cfg,
            model=dataclasses.replace(model, compute_dtype=cfg.model.compute_dtype),
            offload=dataclasses.replace(cfg.offload, device_state_units=units),
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


def process_allowance(need: MemoryPlan) -> int:
    """Host RAM a GPU process of the run holds besides the plan's arrays and pools: `GPU_PROCESS_RSS`
    per GPU it drives, and `OFFLOAD_PROCESS_RSS` where it updates state on the host."""
    local = need.devices // need.processes
    return local * GPU_PROCESS_RSS + (OFFLOAD_PROCESS_RSS if need.pinned else 0)


def host_ram_need(need: MemoryPlan, cpu_backend: bool, activations: bool = True) -> int:
    """Bytes of host RAM one process of the run holds: the rule the planner and the CPU check both
    fit against host RAM. On a GPU, the plan's host bytes and the process itself (`process_allowance`).
    On a CPU backend, where one RAM holds everything, the host state and this process's devices'
    state with XLA:CPU's and the checkpoint writer's buffers (`CPU_HOST_ALLOWANCE`,
    `CPU_STATE_ALLOWANCE`), and with `activations` those devices' activations too."""
    if not cpu_backend:
        return need.host + process_allowance(need)
    local = need.devices // need.processes
    state = int(need.host * CPU_HOST_ALLOWANCE + local * need.accelerator_state * CPU_STATE_ALLOWANCE)
    return state + (local * need.activations if activations else 0)


def check_host_fits(cfg: TrainConfig, need: MemoryPlan, available: int, sharing: int = 1) -> None:
    """Raise ConfigError if the host state will not fit the `available` bytes of host RAM, of which
    this process may count on 1/`sharing` (the processes of its run on this host each need as much).
    Nothing has been allocated yet."""
    available //= sharing
    if need.host > available:
        far = _far_from(cfg, need, need.host, available, lambda p: p.host <= available)
        raise ConfigError(
            f"{cfg.model.name} with offload.optimizer={cfg.offload.optimizer}, offload.params="
            f"{cfg.offload.params} needs {need.host / GiB:.1f} GiB of host RAM ({need.describe()}), but "
            f"{available / GiB:.1f} GiB is available{_shared(sharing)}.{far} Free memory, choose a smaller "
            "model, run fewer processes per host, or use an "
            "optimizer with less state (optimizer.name=lion or sgd keep 4 bytes per parameter, AdamW 8)"
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


def check_cpu_fits(cfg: TrainConfig, need: MemoryPlan, available: int, sharing: int = 1) -> str | None:
    """On a CPU backend, where the "accelerator" is host RAM too: raise ConfigError if the host's and
    this process's devices' state (`host_ram_need`) will not fit the `available` bytes of RAM, of
    which this process may count on 1/`sharing`; return a warning if only the activation estimate
    does not."""
    available //= sharing

    def state(p: MemoryPlan) -> int:  # this process's devices are its RAM too
        return host_ram_need(p, cpu_backend=True, activations=False)

    total = state(need)
    if total > available:
        far = _far_from(cfg, need, total, available, lambda p: state(p) <= available)
        raise ConfigError(
            f"{cfg.model.name} with offload.optimizer={cfg.offload.optimizer}, offload.params="
            f"{cfg.offload.params} needs about {total / GiB:.1f} GiB of RAM on this CPU-only machine (host "
            f"and device state, {need.describe()}, with XLA's and the checkpoint writer's buffers), but "
            f"{available / GiB:.1f} GiB is available{_shared(sharing)}.{far} "
            "Otherwise: choose a smaller model, an optimizer with less state (optimizer.name=lion or sgd), "
            "or optimizer.state_dtype=bfloat16."
        )
    estimate = host_ram_need(need, cpu_backend=True)  # with this process's devices' activations
    if estimate > available:
        return (
            f"warning: estimated use {estimate / GiB:.1f} GiB exceeds the "
            f"{available / GiB:.1f} GiB available; if it runs out of memory, lower data.batch_size or "
            "data.seq_len, or raise data.grad_accum."
        )
    return None


def _shared(sharing: int) -> str:
    return f" to each of the {sharing} processes on this host" if sharing > 1 else ""


def pinned_pool_cap_gb(pinned: int) -> int:
    """The pool jaxzero gives a run of `pinned` bytes when it starts JAX: 25% and 2 GB more, in the
    GB figure XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB takes (which XLA reads as GiB)."""
    return -(-pinned * 5 // (4 * 10**9)) + 2


def pinned_pool_bytes(pinned: int, local_devices: int = 1, cap: int | None = None) -> int:
    """Host RAM that XLA's pinned pool takes once `pinned` bytes are reserved in it at start-up, split
    over `local_devices` (`host_memory.reserve_pinned`): each device's share grows the pool by one
    region, a power of two from `POOL_FIRST_REGION` up, clipped by what the cap leaves (`cap`, bytes:
    by default the one `runtime.configure_pinned_pool` sets for this `pinned`). The run's pinned
    arrays then live inside those regions, unless they fill more than `POOL_FILL` of one: then the
    pool grows a second region as large, as far as the cap lets it."""
    if not pinned:
        return 0
    cap = pinned_pool_cap_gb(pinned) * GiB if cap is None else cap
    share = -(-pinned_pool_reservation_bytes(pinned) // local_devices)
    region = POOL_FIRST_REGION
    while region < share:
        region *= 2
    regions = 2 if -(-pinned // local_devices) > POOL_FILL * region else 1
    return min(local_devices * regions * region, cap)


def pinned_pool_minimum_gb(need: MemoryPlan) -> int:
    """The smallest pinned pool a run of `need` may have, in GB: its pinned bytes plus 10% and 2 GB."""
    return -(-need.pinned * 11 // (10 * 10**9)) + 2


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
    (`runtime.configure_pinned_pool`), and made a little larger than the need (`POOL_SLACK`)."""
    return pinned_pool_reservation_bytes(need.pinned) if platform == "gpu" else 0


def checkpoint_saves(cfg: TrainConfig, first: int = 1) -> int:
    """How many checkpoints steps `first` .. `cfg.steps` save: every `checkpoint.every`-th step and the
    last. Arithmetic, so that a huge `steps` costs nothing to count."""
    if not cfg.checkpoint.enabled or first > cfg.steps:
        return 0
    every = cfg.checkpoint.every
    periodic = cfg.steps // every - (first - 1) // every if every else 0
    return periodic + (0 if every and cfg.steps % every == 0 else 1)


def checkpoints_on_disk(cfg: CheckpointConfig, existing: int, saves: int) -> int:
    """How many checkpoints are on disk at once at most while a run with `existing` checkpoints makes
    `saves` more: the `checkpoint.keep` newest, and the one being written before the oldest of them is
    deleted."""
    return min(cfg.keep + 1, existing + saves) if saves else existing
