"""The placements the planner may choose (`Option`: the offload keys one sets), applied to a config
(`place`), and each one's memory against a machine (`evaluate` -> `Candidate`: how far it is from
fitting).

A run with a frozen part (LoRA, `finetune.freeze`) is placed by the same options: what trains stays on
the accelerator with no host update (`offload.optimizer=none`), and its frozen base's blocks stay there
too (`offload.params=none`) or stream from pinned host memory (`cpu`); its bytes are its own
(`jaxzero.planner.partial`), held to the same fit rule.

The fit rule: the accelerator must hold its state plus the activation estimate per device within
`Machine.gpu_usable`; host RAM, what one process holds (`memory.host_ram_need`: the plan's host bytes,
XLA's pinned pool, what a checkpoint save adds and the process itself) within `Machine.host_usable`;
where XLA's pinned pool is already fixed, its cap must hold the pinned need
(`memory.pinned_pool_minimum_gb`); the disk tier's state, the free local disk. On a CPU-only backend
the "accelerator" is host RAM, counted as `runtime.check_fits` counts it there. A placement the
planner chooses must fit with its activations (`strict`); an explicit one with its state alone, as
the memory check refuses (activations only warn there).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from jaxzero.config import ConfigError, TrainConfig
from jaxzero.config.checks import validate_placement
from jaxzero.plan import OffloadPlan, resolve_plan
from jaxzero.planner import memory, partial
from jaxzero.planner.calibration import GB, GiB
from jaxzero.planner.machine import Machine
from jaxzero.planner.memory import MemoryPlan


@dataclass(frozen=True, kw_only=True)
class Option:
    """One placement the planner may choose: the offload keys it sets (of a run with a frozen part,
    `optimizer` and `params` alone)."""

    optimizer: str
    params: str
    device_state_units: int = 0
    resident_blocks: int = 0
    two_pass_units: int = -1
    activations: str = "none"  # offload.activations
    disk_units: int = 0  # the last units' state on disk (offload.optimizer=disk); -1: every host unit's

    @property
    def rank(self) -> tuple[int, int, bool, bool, int, int]:
        """Simpler first: no disk; resident, ZeRO-Offload, ZeRO-3 offload (a frozen base streamed
        with it); the user's two-pass setting; block inputs on the accelerator; fewer units with state
        on the accelerator; fewer resident blocks."""
        mode = 0 if self.optimizer == self.params == "none" else 1 if self.params == "none" else 2
        away = self.activations == "cpu"
        disk = self.disk_units if self.disk_units >= 0 else 10**6
        return (disk, mode, self.two_pass_units == 0, away, self.device_state_units, self.resident_blocks)


@dataclass(frozen=True)
class Candidate:
    """An option with its config, plan and memory, and how far it is from fitting the machine (bytes)."""

    option: Option
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
        else the state alone, as the memory check refuses (activations only warn there). `disk`:
        the local disk too."""
        short = self.disk_short if disk else 0
        if strict:
            return not (self.gpu_short or self.host_short or self.pool_short or short)
        return not (self.state_short or self.host_state_short or self.pool_short or short)

    @property
    def shortfall(self) -> int:
        """Bytes short in all (the pool's GB counted as bytes)."""
        return self.gpu_short + self.host_short + self.pool_short * GB + self.disk_short


def place(cfg: TrainConfig, option: Option) -> TrainConfig | None:
    """`cfg` placed as `option` says, or None where its other settings rule that out (`cfg` is
    validated: only the placement's rules, `validate_placement`, can break)."""
    if cfg.finetune.partial:  # only the base is placed; no unit's state leaves the accelerator
        offload = dataclasses.replace(cfg.offload, optimizer=option.optimizer, params=option.params)
        return dataclasses.replace(cfg, offload=offload)
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
        validate_placement(placed)
    except ConfigError:  # e.g. ZeRO-3 offload under parallel.zero_stage=2
        return None
    return placed


def evaluate(
    cfg: TrainConfig, option: Option, machine: Machine, whole: tuple[int, int, int] = (0, 0, 0)
) -> Candidate | None:
    """`cfg` placed as `option` says, its memory on `machine` (`whole`: as `memory.plan_memory`'s) and
    how far each memory is from holding it; None where `cfg`'s other settings rule it out."""
    placed = place(cfg, option)
    if placed is None:
        return None
    mc = machine
    if placed.finetune.partial:  # its own bytes: the base, what trains and its state
        plan = partial.partial_plan(placed)
        need = partial.partial_memory(placed, streamed=option.params == "cpu")
    else:
        plan = resolve_plan(placed)
        # XLA's pinned pool cap, which bounds the regions its pool grows by: fixed already, or, where
        # the run will size it for the placement decided (`jaxzero.trainer`), each option's own.
        pool_cap = None if mc.pinned_limit_gb is None else int(mc.pinned_limit_gb * GiB)
        need = memory.plan_memory(placed, plan, mc.devices, mc.processes, whole, pool_cap)
    cpu_backend = mc.gpu_bytes is None
    host_need = memory.host_ram_need(need, cpu_backend)
    host_state_need = memory.host_ram_need(need, cpu_backend, activations=False)
    if cpu_backend:  # one RAM holds everything
        gpu_need = gpu_short = state_short = 0
    else:
        gpu_need = need.accelerator_state + need.activations
        gpu_short = max(0, gpu_need - mc.gpu_usable)
        state_short = max(0, need.accelerator_state - mc.gpu_bytes)
    pool_short = 0
    if mc.pinned_limit_gb is not None and need.pinned:
        pool_short = max(0, math.ceil(memory.pinned_pool_minimum_gb(need) - mc.pinned_limit_gb))
    return Candidate(
        option=option,
        cfg=placed,
        plan=plan,
        need=need,
        gpu_need=gpu_need,
        host_need=host_need,
        gpu_short=gpu_short,
        state_short=state_short,
        host_short=max(0, host_need - mc.host_usable),
        host_state_short=max(0, host_state_need - mc.host_usable),
        pool_short=pool_short,
        disk_short=max(0, need.disk * mc.local_processes - mc.disk_bytes),
    )
