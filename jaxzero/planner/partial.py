"""What a run with a frozen part (LoRA, `finetune.freeze`) weighs and costs, counted from its config:
the planner's search (`jaxzero.planner.search`) places its base through these counts, as one of its
candidates (`jaxzero.planner.candidates`), and the cost model (`jaxzero.planner.cost`) times it.

What such a run holds (`partial_memory`):

    accelerator  what trains (LoRA's adapters, or freeze's units) in float32 with its gradients and
                 optimizer state; the frozen embedding and head; the frozen blocks when resident; the
                 saved block inputs (from the lowest block that trains), one block's transients (its
                 dequantised kernels for an int8 base), and with a streamed base three blocks' copies
    pinned host  the frozen blocks when streamed (`offload.params=cpu`): no masters, no optimizer
                 state, no gradients come back; XLA's pinned pool around them

Its work per step (`step_flops`): LoRA's 6 x parameters x tokens (forward, recomputation, input
gradients); freeze's 8 x the trainable units' parameters and 6 x the frozen ones above the lowest
unit that trains, 2 x those below it (forward only); and, with a streamed base, the blocks' two
crossings of the link per micro-batch (`link_bytes`).
"""

from __future__ import annotations

import dataclasses

from jaxzero.config import ConfigError, TrainConfig
from jaxzero.models.lora import storage_dtype
from jaxzero.models.sizes import (
    attention_span,
    block_matmul_params,
    experts_at_rate,
    flops_per_token,
    param_count,
    projection_shapes,
    ties_output,
    unit_param_counts,
)
from jaxzero.plan import OffloadPlan, resolve_plan
from jaxzero.planner import memory
from jaxzero.planner.memory import MemoryPlan


@dataclasses.dataclass(frozen=True)
class PartialBytes:
    """The parts of the memory of a run with a frozen part (bytes, one device)."""

    base_blocks: int  # the frozen blocks in storage form
    base_edges: int  # the frozen embedding and head
    trainable: int  # what trains (float32)
    trainable_state: int  # it, its gradients (and sums over micro-batches) and optimizer state
    activations: int  # saved block inputs and one block's transients


def partial_bytes(cfg: TrainConfig, streamed: bool) -> PartialBytes:
    """The byte counts of `cfg`'s run with its base streamed or not (from the config alone: no JAX, so
    that the plan is made before JAX starts and sizes its pinned pool)."""
    m, d, ft = cfg.model, cfg.data, cfg.finetune
    n_embed, n_block, n_head = unit_param_counts(m)
    narrow = storage_dtype(ft.base_dtype).itemsize
    kernels = outs = 0
    if m.family in ("llama", "gemma3", "gpt_oss"):  # the projections LoRA and int8 apply to
        shapes = projection_shapes(m)
        kernels = sum(i * o for i, o in shapes.values())
        outs = sum(o for _, o in shapes.values())
        if m.num_experts:  # the sparse MLP's kernels instead: the router's, and each expert's with its scales
            h, e, f = m.hidden_size, m.num_experts, m.moe_intermediate_size
            attention = [shapes[t] for t in ("q", "k", "v", "o")]
            kernels = sum(i * o for i, o in attention) + h * e + e * 3 * h * f
            outs = sum(o for _, o in attention) + e + e * (2 * f + h)
    if ft.base_dtype == "int8":  # a byte per kernel weight and a float32 scale per output channel
        block = kernels + 4 * outs + (n_block - kernels) * narrow
    else:
        block = n_block * narrow
    kept = ft.base_positions(m.num_layers)
    last = m.num_layers + 1
    frozen_blocks = sum(1 for k in kept if 0 < k < last)
    edges = ((n_embed if 0 in kept else 0) + (n_head if last in kept else 0)) * narrow
    if ft.method == "lora":
        trainable = sum(4 * ft.lora_rank * sum(shapes[t]) for t in ft.targets) * m.num_layers
    else:
        counts = [n_embed, *[n_block] * m.num_layers, n_head]
        trainable = 4 * sum(c for k, c in enumerate(counts) if k not in kept)
    grads = trainable * (2 if d.grad_accum > 1 else 1)
    state = trainable + grads + trainable // 4 * memory.optimizer_state_bytes(cfg)
    micro_tokens = d.batch_size // d.grad_accum * d.seq_len
    compute = memory.dtype_bytes(m.compute_dtype)
    documents = not d.cross_document_attention and d.eot_id >= 0
    transient = memory.transient_activations(m, micro_tokens, d.seq_len, documents)
    lowest = ft.lowest_trainable_block(m.num_layers)
    saved = (m.num_layers - lowest) * micro_tokens * m.hidden_size * compute
    working = memory.backward_phases(transient)
    if ft.base_dtype == "int8":  # a block's kernels dequantised while it runs
        working += kernels * compute
    if streamed:  # the block in use, the one before it (still held) and the one being copied
        working += 3 * block
    return PartialBytes(frozen_blocks * block, edges, trainable, state, saved + working)


def partial_memory(cfg: TrainConfig, streamed: bool) -> MemoryPlan:
    """`partial_bytes` as the planner's `MemoryPlan` (one device, one process)."""
    b = partial_bytes(cfg, streamed)
    on_device = b.base_edges + b.trainable_state + (0 if streamed else b.base_blocks)
    pinned = b.base_blocks if streamed else 0
    # XLA's pinned pool grows by doubling regions: the process holds the pool, not just the blocks.
    host = memory.pinned_pool_bytes(pinned) if pinned else 0
    return MemoryPlan(host=host, pinned=pinned, accelerator_state=on_device, activations=b.activations)


def step_flops(cfg: TrainConfig, expert_share: float = 1.0) -> float:
    """The accelerator's FLOPs per step (the module docstring's count; matmuls only). With
    `expert_share` below 1, the dense-rate equivalent: the routed experts' FLOPs divided by it (their
    grouped matmuls' share of the dense rate)."""
    m, d, ft = cfg.model, cfg.data, cfg.finetune
    tokens = d.batch_size * d.seq_len
    # a token multiplies by its top-k experts only, at their grouped matmuls' rate
    experts = experts_at_rate(m, expert_share)
    if ft.method == "lora":
        return 6 * (param_count(m) + m.num_layers * experts) * tokens
    _, n_block, _ = unit_param_counts(m)
    n_block += experts
    kept, lowest = ft.base_positions(m.num_layers), ft.lowest_trainable_block(m.num_layers)
    flops = 0.0
    for i in range(m.num_layers):  # blocks: forward 2, recomputation and input gradients 4, weights 2
        frozen = 1 + i in kept
        flops += n_block * (2 if i < lowest else 6 if frozen else 8)
    # The output projection (D x V, the embedding's when tied): forward, input gradients, and its
    # weights' gradient where it trains; no recomputation. An embedding lookup is no matmul.
    tied = ties_output(m)
    projection_trains = (0 if tied else m.num_layers + 1) not in kept
    flops += m.hidden_size * m.vocab_size * (6 if projection_trains else 4)
    return flops * tokens


def model_flops_per_token(cfg: TrainConfig) -> float:
    """Model FLOPs per token of a run, in the accounting of the program's `tflops` and `mfu`
    (`jaxzero.models.sizes.flops_per_token`: no recomputation, PaLM's attention term), where a run
    that trains every parameter counts `flops_per_token`. With a frozen part: per matmul weight 2 for
    the forward pass, 2 more for the input gradient where a gradient flows through it, 2 more for its
    own gradient where it trains; attention 4 x heads x head_dim x seq_len per layer forward (over a
    Gemma 3 local layer's window where shorter), 12 where a gradient flows through it. LoRA's
    adapters themselves are left out (under 1%)."""
    m, ft, seq = cfg.model, cfg.finetune, cfg.data.seq_len
    if not ft.partial:
        return flops_per_token(m, seq)
    per_block, width = block_matmul_params(m), m.num_heads * m.head_dim
    lowest = ft.lowest_trainable_block(m.num_layers)
    kept = ft.base_positions(m.num_layers) if ft.method == "full" else frozenset(range(m.num_layers + 2))
    flops = 0.0
    for i in range(m.num_layers):
        attention = width * attention_span(m, i, seq)
        if i < lowest:
            flops += 2 * per_block + 4 * attention
        else:
            flops += (4 if 1 + i in kept else 6) * per_block + 12 * attention
    tied = ties_output(m)
    projection_trains = ft.method == "full" and (0 if tied else m.num_layers + 1) not in kept
    return flops + (6 if projection_trains else 4) * m.hidden_size * m.vocab_size


def link_bytes(cfg: TrainConfig) -> int:
    """Bytes a streamed base sends to the accelerator per step: every frozen block for the forward
    pass, and again for the backward pass from the lowest block that matters, per micro-batch."""
    m, ft = cfg.model, cfg.finetune
    b = partial_bytes(cfg, True)
    frozen = [i for i in range(m.num_layers) if 1 + i in ft.base_positions(m.num_layers)]
    if not frozen:
        return 0
    per_block = b.base_blocks // len(frozen)
    lowest = ft.lowest_trainable_block(m.num_layers)
    crossings = len(frozen) + sum(1 for i in frozen if i >= lowest)
    return cfg.data.grad_accum * crossings * per_block


def checkpoint_bytes(cfg: TrainConfig) -> int:
    """Bytes of a checkpoint: what trains and its optimizer state (the base is rebuilt from the
    config)."""
    trainable = partial_bytes(cfg, False).trainable
    return trainable + trainable // 4 * memory.optimizer_state_bytes(cfg)


def partial_plan(cfg: TrainConfig) -> OffloadPlan:
    """The offload plan of `cfg`'s placed run: every unit's state on the accelerator (what trains
    lives there), no host update. Where the base's blocks live is `offload.params` (`cpu`: streamed
    from `pinned_host`), which the streamed schedule reads with it."""
    return resolve_plan(dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, params="none")))


def check_one_device(devices: int) -> None:
    """A run with a frozen part trains on one device: ConfigError for `devices` other than 1."""
    if devices != 1:
        raise ConfigError(
            f"finetune.method=lora and finetune.freeze train on one device; this run has {devices}. "
            "Run it on one GPU (CUDA_VISIBLE_DEVICES=0), or train every unit on several."
        )
