"""The planner's cost model: the predicted seconds of one optimizer step of a placement on a machine.

Per step (tokens per device T, parameters N; `Machine`'s rates):
- gpu = 8 N T / gpu_flops: forward, rematerialised forward and backward; the forward is 1/4 of it,
  spread over units by their matmul work (blocks; the head's hidden x vocab; the embedding none).
  A mixture of experts counts each token's top-k experts only, divided by their grouped matmuls'
  share of the dense rate, which grows with each expert's matmul (`experts_share`, per
  `model.moe_impl`; padded where undecided).
  Sequences longer than the rates' calibration (`CALIBRATION_SEQ`) add their attention
  (`ATTENTION_COST`, times the device kind's `Machine.attention_scale`).
- link = streamed compute-dtype weights crossing twice (forward, backward) plus the new weights of
  host-updated units that live on the accelerator (once), over h2d; plus the gradients of host-updated
  units over d2h; with `offload.activations=cpu`, (L - 1) block inputs each way. Per device (each
  device moves its shard).
- host = the host update's memory traffic over host_bw: per parameter of a host-state unit, one pass
  reads masters, moments and gradient and writes masters, moments and the compute weights: 28 bytes
  for AdamW with fp32 moments and bf16 gradients. A two-pass unit moves 16 in its first pass (new
  weights only) and 26 in its second (masters and moments), 42 in all, the first at
  `WEIGHTS_PASS_SHARE` of the host's rate and the second at `STATE_PASS_SHARE` (as measured). The
  kernels' time follows their bytes; bf16 moments are timed as fp32 ones (the kernels reach the same rate
  per parameter with either), and optax on XLA:CPU (`offload.fused_update=false`, float16) takes
  `OPTAX_SLOWDOWN` times as long.
- disk = each disk unit's masters and state read once and written back once, over disk_bw.
- exposed = the host update the next forward pass waits for. With clipping (or float16) no host unit
  updates before the global norm is known, at the end of the backward pass; the host then runs each
  unit's first pass in forward order while the GPU's forward follows it unit by unit, so the wait is
  what the host's first passes exceed the forward by, unit by unit (units with state on the GPU are
  ready at once and remove their share from the front of that wait). Without clipping a unit's update
  starts when its gradients land during the backward pass. The delayed update exposes nothing.
- step = max(gpu + exposed, link, host, disk). The bottleneck is the largest term: "GPU compute" (or
  "host update before the forward" when the exposed wait is over 5% of the step), "link", "host
  update" or "disk".

A run with a frozen part (LoRA, `finetune.freeze`) has no host update: its step is the larger of the
accelerator's work (`partial.step_flops`, what trains and what the frozen part costs, at the
machine's dense rate) and, with its base streamed (`offload.params=cpu`), the base's crossings of the
link (`partial.link_bytes`).

The rates and constants are `jaxzero.planner.calibration`'s; where they come from, and the measured steps
`tests/test_planner.py` holds the model to within 20%: BENCHMARKS.md, "The planner's calibration
(where its constants come from)". These are predictions: measured steps vary from machine to machine
(BENCHMARKS.md, "Calibration: the cost model against measured steps").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jaxzero.config import ModelConfig, TrainConfig
from jaxzero.models.sizes import experts_at_rate, param_count, unit_param_counts
from jaxzero.plan import OffloadPlan, Tier, UnitKind, UpdateMode
from jaxzero.planner import memory, partial
from jaxzero.planner.calibration import (
    ATTENTION_COST,
    CALIBRATION_SEQ,
    EXPERTS_LEAST_INTENSITY,
    EXPERTS_SHARE_OF_DENSE,
    OPTAX_SLOWDOWN,
    STATE_PASS_SHARE,
    WEIGHTS_PASS_SHARE,
)
from jaxzero.planner.machine import Machine

# The forward pass's share of a rematerialised step's FLOPs: 2N of 8N (forward, recomputed forward,
# backward 4N).
FORWARD_SHARE = 0.25
# The exposed wait names the bottleneck when it is more than this share of the step.
EXPOSED_NAMES_IT = 0.05


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """Predicted seconds per step and their parts."""

    step_s: float  # max(gpu_s + exposed_s, link_s, host_s, disk_s)
    gpu_s: float  # the accelerator's forward, rematerialised forward and backward
    exposed_s: float  # the host update the next forward pass waits for
    link_s: float  # host-to-accelerator plus accelerator-to-host copies
    host_s: float  # the host update's memory traffic
    bottleneck: str  # "GPU compute", "host update before the forward", "link", "host update" or "disk"
    disk_s: float = 0.0  # the disk tier's reads and write-backs


def predict(cfg: TrainConfig, plan: OffloadPlan, machine: Machine) -> Prediction:
    """The predicted step of `cfg` placed by `plan` on `machine` (the module docstring's model), in
    seconds, with its parts and the term that bounds it."""
    if cfg.finetune.partial:
        return _predict_partial(cfg, machine)
    m, d = cfg.model, cfg.data
    n_embed, n_block, n_head = unit_param_counts(m)
    count = UnitKind.keyed((n_embed, n_block, n_head))
    tokens = d.batch_size * d.seq_len / machine.devices
    # Per token and block, attention's FLOPs past the calibration, in parameter-equivalents (8 each).
    attention = (
        ATTENTION_COST
        * m.num_heads
        * m.head_dim
        * max(d.seq_len - CALIBRATION_SEQ, 0)
        * machine.attention_scale
    )
    # A token multiplies by its top-k experts only, at their grouped matmuls' share of the rate.
    experts = experts_at_rate(m, _run_experts_share(cfg, machine))
    gpu_s = 8 * (param_count(m) + m.num_layers * (experts + attention)) * tokens / machine.gpu_flops
    work = {
        UnitKind.EMBED: 0,
        UnitKind.BLOCK: n_block + experts + attention,
        UnitKind.HEAD: m.hidden_size * m.vocab_size,
    }
    total_work = sum(work[u.kind] for u in plan.units)
    forward = [FORWARD_SHARE * gpu_s * work[u.kind] / total_work for u in plan.units]
    update = plan.host_update
    if update is None:
        return Prediction(
            step_s=gpu_s, gpu_s=gpu_s, exposed_s=0.0, link_s=0.0, host_s=0.0, bottleneck="GPU compute"
        )

    compute, opt = memory.dtype_bytes(plan.compute_dtype), memory.optimizer_state_bytes(cfg)
    # The host kernels run at the fp32-moment rate per parameter with bf16 moments too (they convert
    # as they go): time them by fp32 moments' bytes. The disk still moves the bf16 bytes.
    opt_time = memory.optimizer_moments(cfg) * memory.dtype_bytes("float32")
    slowdown = 1.0 if update.fused else OPTAX_SLOWDOWN
    bw = machine.host_bw / machine.local_processes  # this process's share of the host
    first = [0.0] * len(plan.units)  # seconds of each unit's first (or only) pass
    full = [0.0] * len(plan.units)  # seconds of each unit's whole update
    h2d = d2h = 0.0  # bytes per device
    host_units = [i for i, u in enumerate(plan.units) if u.state in (Tier.HOST, Tier.DISK)]
    disk_bytes = [0.0] * len(plan.units)  # of each disk unit's state, this process's
    for j, i in enumerate(host_units):
        u = plan.units[i]
        grad = memory.dtype_bytes(plan.grad_dtype) if u.kind is UnitKind.BLOCK else 4
        read = 4 + opt_time + grad  # masters, moments, gradient
        # The pipeline counts two-pass units from the first host unit (`UpdatePipeline`).
        per_process = count[u.kind] / machine.processes * slowdown / bw
        if j < update.two_pass.max_units:  # new weights first, masters and moments later
            first[i] = (read + compute) / WEIGHTS_PASS_SHARE * per_process
            full[i] = first[i] + (read + 4 + opt_time) / STATE_PASS_SHARE * per_process
        else:
            first[i] = full[i] = (read + 4 + opt_time + compute) * per_process
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
    return Prediction(
        step_s=step_s,
        gpu_s=gpu_s,
        exposed_s=exposed,
        link_s=link_s,
        host_s=host_s,
        bottleneck=bottleneck,
        disk_s=disk_s,
    )


def experts_share(m: ModelConfig, micro_tokens: float) -> float:
    """The experts' grouped matmuls' share of the dense rate for `m.moe_impl` (padded where not
    decided), over `micro_tokens` tokens per micro-batch and device: `EXPERTS_SHARE_OF_DENSE`'s
    curve at the intensity of one expert's matmul, no lower than the least measured
    (`EXPERTS_LEAST_INTENSITY`). 1 without experts (nothing counts it)."""
    if not m.num_experts:
        return 1.0
    most, half = EXPERTS_SHARE_OF_DENSE.get(m.moe_impl, EXPERTS_SHARE_OF_DENSE["padded"])
    rows = micro_tokens * m.num_experts_per_tok / m.num_experts
    intensity = 1 / (1 / max(rows, 1) + 1 / m.moe_intermediate_size + 1 / m.hidden_size)
    intensity = max(intensity, EXPERTS_LEAST_INTENSITY)
    return most * intensity / (intensity + half)


def _run_experts_share(cfg: TrainConfig, machine: Machine) -> float:
    """`experts_share` of the run's experts over its micro-batch's tokens on one device."""
    d = cfg.data
    return experts_share(cfg.model, d.batch_size * d.seq_len / machine.devices / d.grad_accum)


def _predict_partial(cfg: TrainConfig, machine: Machine) -> Prediction:
    """The step of a run with a frozen part: the accelerator's work (`partial.step_flops`) at the
    machine's rate, against a streamed base's crossings of the link (`partial.link_bytes`)."""
    gpu_s = partial.step_flops(cfg, expert_share=_run_experts_share(cfg, machine)) / machine.gpu_flops
    link_s = partial.link_bytes(cfg) / machine.h2d if cfg.offload.params == "cpu" else 0.0
    return Prediction(
        step_s=max(gpu_s, link_s),
        gpu_s=gpu_s,
        exposed_s=0.0,
        link_s=link_s,
        host_s=0.0,
        bottleneck="link" if link_s > gpu_s else "GPU compute",
    )


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
