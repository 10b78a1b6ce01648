"""The offload plan: every offload setting resolved once, before anything is allocated.

Config keys say what the user asked for (`offload.two_pass_units=-1`, `offload.fused_update=true`,
...); the plan says what this run will do (two-pass updates for up to 30 units, adaptively; the fused
host kernels; blocks 0-1 resident, 2-27 streamed). The memory check (`jaxzero.planner.memory`), the placement
(`jaxzero.plan.placement`), the offload engine and the run's log all read the plan; nothing downstream
interprets an offload setting or a sentinel again (error messages still quote the user's settings).

A model is a sequence of units in forward order: the embedding (position 0), block i (position
1 + i), the head (position num_layers + 1). For each unit the plan says where its compute-dtype weights and
its fp32 masters and optimizer state live (`Tier`); the host update's policy (`HostUpdate`) says how
units whose state lives in host RAM are updated.

    plan = resolve_plan(cfg)
    plan.mode                      # "resident" | "ZeRO-Offload" | "ZeRO-3 offload"
    plan.units[1 + i].weights      # Tier.DEVICE or Tier.PINNED_HOST for block i
    plan.host_update.two_pass      # TwoPass(max_units=30, adaptive=True)
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

from jaxzero.config import ConfigError, TrainConfig

# Optimizers the fused host kernels implement (`jaxzero.offload.host_kernels`); others run as optax
# on XLA:CPU. The kernels compute in float32 and read and write float32 or bfloat16 arrays.
FUSED_OPTIMIZERS = ("adamw", "adam", "lion", "sgd")
FUSED_COMPUTE_DTYPES = ("float32", "bfloat16")
# Units with state on disk in host RAM at once: one read ahead while another is updated or written
# back. More overlap the disk with itself no better (one queue of large transfers) and cost RAM.
DISK_SLOTS = 2


class Tier(enum.Enum):
    """A memory that holds part of the training state."""

    DEVICE = "device"  # accelerator memory
    PINNED_HOST = "pinned_host"  # host RAM the accelerator copies from and to (XLA's pinned pool)
    HOST = "host"  # host RAM, as arrays of JAX's CPU backend (the host update computes there)
    DISK = "disk"  # local disk, read into host RAM for each host update and written back


class UnitKind(enum.Enum):
    """The three kinds of unit of `ModelParams`; the value is its field name there."""

    EMBED = "embed"
    BLOCK = "blocks"
    HEAD = "head"

    @staticmethod
    def keyed(values: tuple[int, int, int]) -> dict[UnitKind, int]:
        """(embedding, one block, head) values, as `jaxzero.models.sizes.unit_param_counts` gives
        them, keyed by kind."""
        return dict(zip(UnitKind, values, strict=True))


class UpdateMode(enum.Enum):
    """How the host update of step t meets the accelerator's work of step t+1."""

    # Exact: each unit is updated once its gradients landed (and the global norm is known, when
    # clipping or float16 needs it), in forward order; the next forward pass waits per unit.
    OVERLAPPED = "overlapped"
    # ZeRO-Offload's DPU: step t+1's forward and backward read the weights from before update t, so
    # update t overlaps all of step t+1; gradients are one update stale.
    DELAYED = "delayed"


@dataclass(frozen=True)
class UnitPlan:
    """One unit: what it is, where it is in the forward pass, and where its arrays live."""

    kind: UnitKind
    block: int | None  # the block index; None for the embedding and the head
    position: int  # in the forward pass: embedding 0, block i at 1 + i, head last
    weights: Tier  # compute-dtype weights
    state: Tier  # fp32 masters and optimizer state


@dataclass(frozen=True)
class TwoPass:
    """Two-pass host updates (with clipping): the first `max_units` units in forward order may have
    their compute weights written first and masters and moments a step later (same bits)."""

    max_units: int  # 0: off
    adaptive: bool  # the count per step follows the host's slack, up to `max_units`


@dataclass(frozen=True)
class HostUpdate:
    """How units whose state lives in host RAM are updated."""

    mode: UpdateMode
    fused: bool  # the fused host kernels (else the optax transformation on XLA:CPU)
    waits_for_norm: bool  # clipping or float16: no unit updates before the global norm is known
    skips_nonfinite: bool  # float16: a non-finite norm means overflow, and the step changes nothing
    two_pass: TwoPass
    threads: int  # threads of the host update's pool

    def __post_init__(self) -> None:
        # Two passes are fused-kernel work moved out of the wait for the norm.
        moves_work = self.waits_for_norm and self.fused and self.mode is UpdateMode.OVERLAPPED
        if self.two_pass.max_units and not moves_work:
            raise ValueError(
                f"two-pass updates ({self.two_pass.max_units} units) need units that wait for the norm, "
                "the fused kernels and the overlapped update: "
                f"got waits_for_norm={self.waits_for_norm}, fused={self.fused}, mode={self.mode.value}."
            )


@dataclass(frozen=True)
class OffloadPlan:
    """Where every unit's arrays live and how host-resident units are updated; see the module
    docstring. `host_update` is None when every unit's state lives on the accelerator."""

    units: tuple[UnitPlan, ...]  # in forward order
    host_update: HostUpdate | None
    compute_dtype: str  # model.compute_dtype
    grad_dtype: str  # block gradients leave the accelerator in this dtype (embed/head: float32)
    prefetch: int  # streamed blocks copied ahead of the one computing
    # Where each block's input waits for the backward pass: DEVICE, or PINNED_HOST (copied out during
    # the forward pass and back one block ahead of the backward pass).
    activations: Tier = Tier.DEVICE
    # Units with state on disk that may be in host RAM at once (read ahead of their update, or being
    # written back after it); 0 without disk units.
    disk_slots: int = 0
    # DeepSpeed's ZeRO stage over the data mesh (`parallel.zero_stage`, auto resolved): what is
    # sharded over the devices: 1 optimizer state, 2 also gradients, 3 also compute weights.
    zero_stage: int = 0

    @property
    def shards_state(self) -> bool:
        """Masters and optimizer state kept as one shard per device (ZeRO stage >= 1)."""
        return self.zero_stage >= 1

    @property
    def shards_grads(self) -> bool:
        """Gradients reduce-scattered to one shard per device (stage >= 2; always with host state:
        offloaded gradients leave each device as its shard, so stage 1 runs as stage 2 there)."""
        return self.zero_stage >= 2 or (self.host_update is not None and self.zero_stage >= 1)

    @property
    def shards_weights(self) -> bool:
        """Weights kept as one shard per device and all-gathered per use: stage 3 (with host state,
        compute weights are so at every stage; see `OffloadPlacement`)."""
        return self.zero_stage >= 3

    @property
    def num_layers(self) -> int:
        return len(self.units) - 2

    @property
    def blocks(self) -> tuple[UnitPlan, ...]:
        return self.units[1:-1]

    @property
    def host_units(self) -> tuple[UnitPlan, ...]:
        """Units updated on the CPU, their masters and optimizer state in host RAM or on disk, in
        forward order."""
        return tuple(u for u in self.units if u.state in (Tier.HOST, Tier.DISK))

    @property
    def disk_units(self) -> tuple[UnitPlan, ...]:
        """Units whose masters and optimizer state live on disk (the last host units in forward order)."""
        return tuple(u for u in self.units if u.state is Tier.DISK)

    @property
    def device_state_units(self) -> int:
        """Units whose masters and optimizer state live on the accelerator (the first ones in forward
        order when the host holds the others)."""
        return sum(u.state is Tier.DEVICE for u in self.units)

    @property
    def offloads_activations(self) -> bool:
        """Whether block inputs wait for the backward pass in pinned host memory."""
        return self.activations is Tier.PINNED_HOST

    def is_streamed(self, block: int) -> bool:
        """Whether block `block`'s weights live in pinned host memory and stream in per use."""
        return self.units[1 + block].weights is Tier.PINNED_HOST

    @property
    def streamed_blocks(self) -> int:
        return sum(u.weights is Tier.PINNED_HOST for u in self.blocks)

    @property
    def mode(self) -> str:
        """DeepSpeed's name for the placement: resident, ZeRO-Offload or ZeRO-3 offload."""
        if self.host_update is None:
            return "resident"
        return "ZeRO-3 offload" if self.streamed_blocks else "ZeRO-Offload"

    def describe(self, optimizer: str, devices: str) -> str:
        """One line for the run's log: where state lives and how it is updated. `optimizer` is the
        optimizer's name, `devices` what the accelerator state lives on."""
        h = self.host_update
        if h is None:
            return f"resident: params, grads and optimizer state in accelerator memory, {devices}"
        how = ["fused kernels" if h.fused else "optax on XLA:CPU", h.mode.value]
        if h.two_pass.max_units:
            up_to = "adaptive, up to" if h.two_pass.adaptive else "for"
            how.append(f"two-pass updates {up_to} {h.two_pass.max_units} units")
        on_device, on_disk = self.device_state_units, len(self.disk_units)
        in_ram = len(self.units) - on_device - on_disk
        where = f"of {in_ram}/{len(self.units)} units in host RAM, updated on the CPU"
        if on_disk:
            where += f" (the last {on_disk} on local disk, read and written back each update)"
        if on_device:
            where += f" (the first {on_device} on {devices}, updated there)"
        if not (on_device or on_disk):
            where = "in host RAM, updated on the CPU"
        activations = "; block inputs wait in pinned host memory" if self.offloads_activations else ""
        return (
            f"{self.mode}: fp32 masters and {optimizer} state {where} "
            f"({', '.join(how)}); {self.streamed_blocks}/{self.num_layers} blocks streamed from pinned "
            f"host memory, the rest of the {self.compute_dtype} weights on {devices}{activations}"
        )


def resolve_plan(cfg: TrainConfig) -> OffloadPlan:
    """The plan of `cfg`, whose fields each hold a valid value (`validate` checks the combinations;
    this reads the config and the host's core count, nothing else). `auto` settings must have been
    decided first (`jaxzero.planner.search.choose`; `build_trainer` does)."""
    o, m = cfg.offload, cfg.model
    if "auto" in (o.params, o.optimizer):
        raise ValueError(
            f"resolve_plan needs decided offload settings (offload.params={o.params}, offload.optimizer="
            f"{o.optimizer}): decide them with jaxzero.planner.search.choose(cfg, machine) first "
            "(build_trainer does), or set both explicitly."
        )
    num_layers = m.num_layers
    on_host = o.optimizer in ("cpu", "disk")
    resident_blocks = num_layers if o.params == "none" else o.resident_blocks
    state = Tier.HOST if on_host else Tier.DEVICE

    def unit(kind: UnitKind, block: int | None, position: int) -> UnitPlan:
        streamed = on_host and block is not None and block >= resident_blocks
        return UnitPlan(kind, block, position, Tier.PINNED_HOST if streamed else Tier.DEVICE, state)

    units = [
        unit(UnitKind.EMBED, None, 0),
        *(unit(UnitKind.BLOCK, i, 1 + i) for i in range(num_layers)),
        unit(UnitKind.HEAD, None, num_layers + 1),
    ]
    # The first `device_state_units` units keep masters and state on the accelerator, and so their
    # weights too (they are updated there). Left to the planner (-1) and not decided: none.
    on_device = max(o.device_state_units, 0) if on_host else 0
    for k in range(on_device):
        units[k] = UnitPlan(units[k].kind, units[k].block, k, Tier.DEVICE, Tier.DEVICE)
    # The last `disk_units` of the others keep it on disk: their update comes last before the next
    # forward pass reaches them, and their reads run ahead of it from the start of the backward pass.
    host_count = len(units) - on_device
    on_disk = 0
    if o.optimizer == "disk":
        on_disk = host_count if o.disk_units < 0 else min(o.disk_units, host_count)
    for k in range(len(units) - on_disk, len(units)):
        units[k] = UnitPlan(units[k].kind, units[k].block, k, units[k].weights, Tier.DISK)
    # One micro-batch: block gradients leave in the compute dtype (exact); several: float32 sums.
    grad_dtype = m.compute_dtype if cfg.data.grad_accum == 1 else "float32"
    return OffloadPlan(
        units=tuple(units),
        host_update=_host_update(cfg, host_count - on_disk) if on_host else None,
        compute_dtype=m.compute_dtype,
        grad_dtype=grad_dtype,
        prefetch=1,
        activations=Tier.PINNED_HOST if o.activations == "cpu" else Tier.DEVICE,
        disk_slots=min(DISK_SLOTS, on_disk),
        zero_stage=_zero_stage(cfg),
    )


def _zero_stage(cfg: TrainConfig) -> int:
    """`parallel.zero_stage`, with -1 (auto) as the least replication the offload mode allows."""
    stage = cfg.parallel.zero_stage
    if stage >= 0:
        return stage
    return 3 if cfg.offload.params == "cpu" else 2 if cfg.offload.optimizer in ("cpu", "disk") else 0


def available_cores() -> int:
    """Cores this process may run on (its affinity: a launcher or scheduler may give each process of a
    machine its own share), else every core."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _host_update(cfg: TrainConfig, num_units: int) -> HostUpdate:
    """`num_units`: the units the host updates in RAM (two-pass updates may take them all; units on
    disk are updated in one pass, since a second would read them from disk again)."""
    o = cfg.offload
    fp16 = cfg.model.compute_dtype == "float16"
    fused = (
        o.fused_update
        and cfg.optimizer.name in FUSED_OPTIMIZERS
        and cfg.model.compute_dtype in FUSED_COMPUTE_DTYPES
    )
    if o.optimizer == "disk" and not fused:
        raise ConfigError(
            "offload.optimizer=disk needs the fused host kernels, which update the state read from disk "
            f"in place: optimizer.name in {FUSED_OPTIMIZERS} (got {cfg.optimizer.name}), model.compute_dtype "
            f"in {FUSED_COMPUTE_DTYPES} (got {cfg.model.compute_dtype}) and offload.fused_update=true "
            f"(got {o.fused_update}); or use offload.optimizer=cpu."
        )
    mode = UpdateMode(o.update)
    clipped = cfg.optimizer.grad_clip > 0
    # Two-pass updates move fused-kernel work out of the wait for the norm; they apply only where
    # units wait for it to clip (float16's wait skips overflowing steps, and its update is optax's)
    # and off the delayed update, whose host work is off the critical path anyway.
    moves_work = clipped and fused and mode is UpdateMode.OVERLAPPED
    two_pass = o.two_pass_units  # config: -1 adaptive (up to every unit), 0 off, K at most K units
    max_units = (num_units if two_pass < 0 else min(two_pass, num_units)) if moves_work else 0
    return HostUpdate(
        mode=mode,
        fused=fused,
        waits_for_norm=clipped or fp16,
        skips_nonfinite=fp16,
        two_pass=TwoPass(max_units=max_units, adaptive=two_pass < 0 and max_units > 0),
        # One core stays free for the thread that issues the accelerator's work and the runtime's
        # copy threads, which otherwise queue behind the update (BENCHMARKS.md, "2026-11-23, later:
        # what the GPU compiles, core binding, and a core for the driving thread").
        threads=o.host_threads or max(1, available_cores() - 1),
    )
