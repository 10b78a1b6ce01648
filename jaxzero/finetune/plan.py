"""Where a LoRA run's arrays live and how fast it is predicted to be: `decide_lora`.

What a LoRA run holds (`lora_memory`):

    accelerator  the adapters in float32 with their gradients and optimizer state (small); the frozen
                 embedding and head; the base blocks when resident; the saved block inputs, one block's
                 transients (its dequantised kernels for an int8 base), and with a streamed base the
                 block being used and the one being copied
    pinned host  the base blocks when streamed (`offload.params=cpu`): no masters, no optimizer state,
                 no gradients come back

`offload.params=auto` keeps the base on the accelerator where it fits beside the rest, else streams
its blocks. The step is predicted as the larger of the accelerator's work (6 x base parameters x
tokens: forward, recomputation, input gradients, at the machine's dense rate) and, when streamed, the
blocks' two crossings of the link per micro-batch.
"""

from __future__ import annotations

import dataclasses

from jaxzero import memory
from jaxzero.config import ConfigError, TrainConfig
from jaxzero.finetune.adapters import projection_shapes
from jaxzero.finetune.base import storage_dtype
from jaxzero.memory import MemoryPlan
from jaxzero.models.sizes import param_count, unit_param_counts
from jaxzero.plan import resolve_plan
from jaxzero.plan.calibration import CHECKPOINT_WRITE_BPS, GiB
from jaxzero.plan.cost import Prediction
from jaxzero.plan.machine import Machine
from jaxzero.plan.report import Decision


@dataclasses.dataclass(frozen=True)
class LoraBytes:
    """The parts of a LoRA run's memory (bytes, one device)."""

    base_blocks: int  # every base block in storage form
    base_edges: int  # the frozen embedding and head
    adapters: int  # adapter parameters (float32)
    adapter_state: int  # adapters, their gradients (and sums over micro-batches) and optimizer state
    activations: int  # saved block inputs and one block's transients


def lora_bytes(cfg: TrainConfig, streamed: bool) -> LoraBytes:
    """The byte counts of `cfg`'s LoRA run with its base streamed or not (from the config alone: no
    JAX, so that the plan is made before JAX starts and sizes its pinned pool)."""
    m, d, ft = cfg.model, cfg.data, cfg.finetune
    shapes = projection_shapes(m)
    n_embed, n_block, n_head = unit_param_counts(m)
    kernels = sum(i * o for i, o in shapes.values())
    outs = sum(o for _, o in shapes.values())
    narrow = storage_dtype(ft.base_dtype).itemsize
    if ft.base_dtype == "int8":  # a byte per kernel weight and a float32 scale per output channel
        block = kernels + 4 * outs + (n_block - kernels) * narrow
    else:
        block = n_block * narrow
    edges = (n_embed + n_head) * narrow
    adapters = sum(4 * ft.lora_rank * sum(shapes[t]) for t in ft.targets) * m.num_layers
    grads = adapters * (2 if d.grad_accum > 1 else 1)
    state = adapters + grads + adapters // 4 * memory.optimizer_state_bytes(cfg)
    micro_tokens = d.batch_size // d.grad_accum * d.seq_len
    compute = memory.dtype_bytes(m.compute_dtype)
    documents = not d.cross_document_attention and d.eot_id >= 0
    transient = memory.transient_activations(m, micro_tokens, d.seq_len, documents)
    saved = m.num_layers * micro_tokens * m.hidden_size * compute
    working = memory.backward_phases(transient)
    if ft.base_dtype == "int8":  # a block's kernels dequantised while it runs
        working += kernels * compute
    if streamed:  # the block in use, the one before it (still held) and the one being copied
        working += 3 * block
    return LoraBytes(m.num_layers * block, edges, adapters, state, saved + working)


def lora_memory(cfg: TrainConfig, streamed: bool) -> MemoryPlan:
    """`lora_bytes` as the planner's `MemoryPlan` (one device, one process)."""
    b = lora_bytes(cfg, streamed)
    on_device = b.base_edges + b.adapter_state + (0 if streamed else b.base_blocks)
    pinned = b.base_blocks if streamed else 0
    # XLA's pinned pool grows by doubling regions: the process holds the pool, not just the blocks.
    host = memory.pinned_pool_bytes(pinned) if pinned else 0
    return MemoryPlan(host=host, pinned=pinned, accelerator_state=on_device, activations=b.activations)


def predict_lora(cfg: TrainConfig, streamed: bool, machine: Machine) -> Prediction:
    """The predicted step: the accelerator's 6 x base parameters x tokens at the machine's rate,
    against the streamed blocks' crossings of the link (twice per micro-batch)."""
    d = cfg.data
    tokens = d.batch_size * d.seq_len
    gpu_s = 6 * param_count(cfg.model) * tokens / machine.gpu_flops
    link_s = 2 * d.grad_accum * lora_bytes(cfg, streamed).base_blocks / machine.h2d if streamed else 0.0
    bottleneck = "link" if link_s > gpu_s else "GPU compute"
    return Prediction(max(gpu_s, link_s), gpu_s, 0.0, link_s, 0.0, bottleneck)


@dataclasses.dataclass(frozen=True)
class LoraDecision(Decision):
    """A LoRA run's placement: the base resident or streamed; the rest on the accelerator."""

    streamed: bool = False

    def save_seconds(self) -> float:
        return _tree_bytes_saved(self.config) / CHECKPOINT_WRITE_BPS

    def obvious(self) -> bool:
        return not self.streamed and super().obvious()

    def line(self) -> str:
        chosen = f"decided {', '.join(self.decided)}" if self.decided else "as configured"
        need = self.memory.accelerator_state + self.memory.activations
        return (
            f"plan: {self.mode_words()} ({chosen}); {_gib(need)} "
            f"of {_gib(self.machine.gpu_usable or self.machine.host_usable)} device memory; predicted "
            f"{self.step_s:.3g} s per step, bound by {self.bottleneck}"
        )

    def mode_words(self) -> str:
        ft = self.config.finetune
        where = "streamed from pinned host memory" if self.streamed else "on the accelerator"
        return f"LoRA rank {ft.lora_rank}, the frozen {ft.base_dtype} base {where}"

    def table(self) -> str:
        cfg, mc, need, p = self.config, self.machine, self.memory, self.prediction
        b = lora_bytes(cfg, self.streamed)
        d = cfg.data
        tokens = d.batch_size * d.seq_len
        chosen = f"decided {', '.join(self.decided)}" if self.decided else "as configured"
        flops = 6 * param_count(cfg.model) * tokens / p.step_s / 1e12
        capacity = mc.gpu_usable if mc.gpu_usable is not None else mc.host_usable
        lines = [
            f"plan for {cfg.model.name}: {param_count(cfg.model) / 1e9:.2f}B base parameters, "
            f"{d.batch_size} x {d.seq_len} = {tokens:,} tokens per step, LoRA on "
            f"{', '.join(cfg.finetune.targets)} ({b.adapters // 4 / 1e6:.2f}M adapter parameters)",
            f"placement: {self.mode_words()} ({chosen})",
            "memory, needed of available:",
            f"  device     {_gib(need.accelerator_state + need.activations)} of {_gib(capacity)} (base "
            f"{_gib(0 if self.streamed else b.base_blocks)} + embedding and head {_gib(b.base_edges)}, "
            f"adapters with gradients and {cfg.optimizer.name} state {_gib(b.adapter_state)}, "
            f"activations ~{_gib(need.activations)})",
        ]
        if need.pinned:
            lines.append(f"  pinned     {_gib(need.pinned)} of host RAM (the base's blocks)")
        if mc.gpu_bytes is not None:
            lines.append(
                f"  host RAM   {_gib(self._ram_needed())} of {_gib(mc.host_usable)} (XLA's pinned pool and "
                f"{_gib(memory.process_allowance(need))} for the process itself)"
            )
        if cfg.checkpoint.enabled:
            lines.append(
                f"  checkpoints {_gib(_tree_bytes_saved(cfg))} each (adapters, their optimizer state, the "
                "step; the base is rebuilt from the config)"
            )
        lines += [
            f"predicted step: {p.step_s:.3g} s ({tokens / p.step_s:,.0f} tokens/s, {flops:.3g} TFLOP/s "
            f"(6 x base params x tokens)); bottleneck: {p.bottleneck}",
            "These are predictions, not measurements.",
        ]
        return "\n".join(lines)


def _tree_bytes_saved(cfg: TrainConfig) -> int:
    """Bytes of a LoRA checkpoint: the adapters and their optimizer state."""
    adapters = lora_bytes(cfg, False).adapters
    return adapters + adapters // 4 * memory.optimizer_state_bytes(cfg)


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def decide_lora(cfg: TrainConfig, machine: Machine) -> LoraDecision:
    """Where `cfg`'s LoRA run keeps its base (`offload.params`: none, cpu, or auto: resident where it
    fits), checked against the machine's memory; ConfigError with the numbers where nothing fits."""
    if machine.devices != 1:
        raise ConfigError(
            f"finetune.method=lora trains on one device; this run has {machine.devices}. Run it on one "
            "GPU (CUDA_VISIBLE_DEVICES=0), or use finetune.method=full on several."
        )
    capacity = machine.gpu_usable if machine.gpu_usable is not None else machine.host_usable
    options = {"none": [False], "cpu": [True], "auto": [False, True]}[cfg.offload.params]
    tried = []
    for streamed in options:
        need = lora_memory(cfg, streamed)
        device = need.accelerator_state + need.activations
        host = need.host + (memory.process_allowance(need) if machine.gpu_bytes is not None else device)
        tried.append((streamed, device, host))
        if device <= capacity and host <= machine.host_usable:
            decided_cfg = dataclasses.replace(
                cfg,
                offload=dataclasses.replace(
                    cfg.offload, params="cpu" if streamed else "none", optimizer="none"
                ),
            )
            decided = tuple(
                f"offload.{k}={getattr(decided_cfg.offload, k)}"
                for k in ("params", "optimizer")
                if getattr(cfg.offload, k) == "auto"
            )
            plan = resolve_plan(
                dataclasses.replace(
                    decided_cfg, offload=dataclasses.replace(decided_cfg.offload, params="none")
                )
            )
            return LoraDecision(
                decided_cfg,
                plan,
                need,
                predict_lora(cfg, streamed, machine),
                machine,
                decided,
                streamed=streamed,
            )
    rows = "; ".join(
        f"base {'streamed' if s else 'on the device'}: {_gib(dev)} of {_gib(capacity)} device memory, "
        f"{_gib(h)} of {_gib(machine.host_usable)} host RAM"
        for s, dev, h in tried
    )
    hint = " finetune.base_dtype=int8 halves the base;" if cfg.finetune.base_dtype != "int8" else ""
    raise ConfigError(
        f"{cfg.model.name} with LoRA at {cfg.data.batch_size} x {cfg.data.seq_len} tokens per step does not "
        f"fit this machine: {rows}.{hint} a smaller data.batch_size (or more data.grad_accum: a streamed "
        "base crosses the link once per micro-batch) shrinks the activations"
        + ("; offload.params=cpu streams the base from host memory." if cfg.offload.params == "none" else ".")
    )
