"""What every part of the offload trainer shares, built once per trainer: `EngineContext`.

The trainer is four parts, each its own module, each reading the context and nothing else shared:

    jaxzero.offload.state_init      fresh, loaded or restored state, unit by unit (`StateInit`)
    jaxzero.offload.step            the training step and the evaluation loss (`OffloadStep`)
    jaxzero.offload.checkpointing   the state to and from its saved form (`CheckpointAdapter`)
    jaxzero.offload.breakdown       where the steps' time went (`StepTimings`)

`jaxzero.offload.engine` builds the context (`build_engine_context`) and wires the parts into a `Trainer`.
Units are addressed in forward order (embedding, blocks, head): `ModelParams.units()` and
`ModelParams.from_units` turn a `ModelParams` into that list and back, `map_units` maps over it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, Sharding

from jaxzero.config import OFFLOAD_STATE_DIR, ConfigError, TrainConfig
from jaxzero.custom import check_optimizer, model_of
from jaxzero.models import Model, ModelParams
from jaxzero.offload.device_update import DeviceOptimizer
from jaxzero.offload.disk import DiskStore
from jaxzero.offload.host_memory import global_from_local
from jaxzero.offload.host_optimizer import HostOptimizer
from jaxzero.offload.pipeline import UpdatePipeline
from jaxzero.offload.timeline import StepClock
from jaxzero.plan import OffloadPlan, Tier, TwoPass, UnitPlan
from jaxzero.plan import placement as placement_lib
from jaxzero.plan.placement import OffloadPlacement
from jaxzero.primitives.write_fence import WriteFence


@dataclass(frozen=True, kw_only=True)
class EngineContext:
    """The offload trainer's shared pieces, made once by `build_engine_context`.

    plan:          the trainer's plan: the one given, with the host update on optax's path for a
                   researcher's own optimizer (`optax_host_update`).
    masters_shape: the model's float32 masters as global `ShapeDtypeStruct`s.
    host:          the optimizer of the units whose state lives in host RAM (or passes through it).
    device:        the optimizer of the units whose state the plan keeps on the accelerator.
    disk:          the store of the units whose state the plan keeps on disk; None without any.
    clock:         the step's event recorder (`jaxzero.offload.timeline`).
    fence:         where an update waits for a checkpoint being written from its unit.
    pipeline:      the per-unit host update in the background.
    fp16:          float16 compute: dynamic loss scaling, the step count advanced on the accelerator.
    """

    cfg: TrainConfig
    plan: OffloadPlan
    model: Model
    mesh: Mesh
    where: OffloadPlacement
    masters_shape: ModelParams
    host: HostOptimizer
    device: DeviceOptimizer
    disk: DiskStore | None
    clock: StepClock
    fence: WriteFence
    pipeline: UpdatePipeline
    fp16: bool


def build_engine_context(
    cfg: TrainConfig,
    mesh: Mesh,
    plan: OffloadPlan,
    *,
    model: Model | None = None,
    optimizer: optax.GradientTransformation | None = None,
) -> EngineContext:
    """The context of an offload trainer for `plan` (with host-resident state) over every device of
    `mesh`: `cfg.model`'s model and `cfg.optimizer`'s transformation, or the researcher's own `model`
    (described by `cfg.model`) and `optimizer`, applied to each unit alone (`jaxzero.custom`). Creates
    the disk tier's working directory when the plan has disk units; allocates no array and compiles
    nothing."""
    if plan.host_update is None:
        raise ValueError(
            "build_offload_trainer needs a plan with host-resident state (offload.optimizer=cpu)"
        )
    model = model_of(cfg.model, model)
    masters_shape = jax.eval_shape(model.init, jax.random.key(0))
    if optimizer is not None:
        check_optimizer(cfg, optimizer, masters_shape)
        plan = optax_host_update(plan)
    where = placement_lib.offload_placement(mesh, plan)
    accum = cfg.data.grad_accum
    steps = cfg.schedule_steps
    host = HostOptimizer(
        cfg.optimizer, steps, masters_shape, where, accum, custom=optimizer, updates=cfg.steps
    )
    device = DeviceOptimizer(cfg.optimizer, steps, masters_shape, where, accum, custom=optimizer)
    disk = disk_store(cfg, plan) if plan.disk_units else None
    clock = StepClock()
    fence = WriteFence()  # a checkpoint being written from the units' arrays (`primitives.write_fence`)
    pipeline = UpdatePipeline(host, plan, clock, disk, fence)
    return EngineContext(
        cfg=cfg,
        plan=plan,
        model=model,
        mesh=mesh,
        where=where,
        masters_shape=masters_shape,
        host=host,
        device=device,
        disk=disk,
        clock=clock,
        fence=fence,
        pipeline=pipeline,
        fp16=plan.compute_dtype == "float16",
    )


def optax_host_update(plan: OffloadPlan) -> OffloadPlan:
    """`plan` with its host update as the optax transformation on XLA:CPU (what
    `offload.fused_update=false` plans), for a researcher's own optimizer: the fused kernels implement
    only jaxzero's named ones. Two-pass updates are fused-kernel work, so they go too; the disk
    tier, whose update is the fused kernels' in place, is refused."""
    update = plan.host_update
    if update is None or not update.fused:
        return plan
    if plan.disk_units:
        raise ConfigError(
            "offload.optimizer=disk needs the fused host kernels, which implement only jaxzero's named "
            "optimizers (optimizer.name), not an optax transformation passed to build_trainer: use "
            "offload.optimizer=cpu, or a named optimizer."
        )
    optax_path = dataclasses.replace(update, fused=False, two_pass=TwoPass(0, False))
    return dataclasses.replace(plan, host_update=optax_path)


def disk_store(cfg: TrainConfig, plan: OffloadPlan) -> DiskStore:
    """The disk tier's store: its working directory under `offload.disk_path`, else the run's."""
    if not (cfg.offload.disk_path or cfg.run_dir):
        raise ConfigError(
            "offload.optimizer=disk needs a directory for its working state: set offload.disk_path=DIR "
            "(a local disk) or run_dir."
        )
    base = Path(cfg.offload.disk_path or Path(cfg.run_dir) / OFFLOAD_STATE_DIR)
    if jax.process_count() > 1:  # each process keeps its own blocks
        base = base / f"process-{jax.process_index()}"
    return DiskStore(base, [u.position for u in plan.disk_units], plan.disk_slots)


def put_everywhere(value: Any, sharding: Sharding) -> jax.Array:
    """A NumPy value (the same in every process) as a global array placed by `sharding`."""
    return global_from_local(np.asarray(value), sharding, np.shape(value))


def map_units(plan: OffloadPlan, f: Callable[..., Any], *trees: ModelParams) -> ModelParams:
    """`f(unit, *its subtrees)` for each unit of `plan`, over trees with a subtree per unit."""
    return ModelParams.from_units([f(u, *ts) for u, *ts in zip(plan.units, *(t.units() for t in trees))])


def no_disk(u: UnitPlan, tree: Any) -> Any:
    """A unit's subtree, or None for a disk unit (its `OnDisk` markers are not arrays)."""
    return None if u.state is Tier.DISK else tree


def result(x: Any) -> Any:
    """The value of a `Future`, waited for; anything else as it is."""
    return x.result() if isinstance(x, Future) else x
