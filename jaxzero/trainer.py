"""`build_trainer`: a `Trainer` built once from a `TrainConfig`, and the resident trainer.

This is the library API. Offload keys left on `auto` are decided for the mesh's devices by the
planner (`jaxzero.plan.search`); the config is then resolved into an offload plan
(`jaxzero.plan`), checked against host and accelerator memory (`jaxzero.memory`), and the plan
picks the trainer: whether weights are resident or streamed from host memory is decided here, when
the step function is built, never inside it:

    trainer = build_trainer(cfg)
    state = trainer.init(jax.random.key(cfg.seed))
    for batch in batches:                       # int32 numpy (grad_accum, micro_batch, seq_len + 1)
        state, metrics = trainer.step(state, trainer.put_batch(batch))

The resident trainer (`offload.optimizer=none`) keeps everything in accelerator memory: fp32 masters,
optimizer state, and the bf16 casts made inside each block. It is the oracle the offload engine is
tested against.
"""

from __future__ import annotations

import dataclasses
import logging
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from jaxzero import memory, placement, runtime
from jaxzero.config import ConfigError, TrainConfig, resolve_batch, validate
from jaxzero.deferred import resolved
from jaxzero.loss_scale import all_finite, init_loss_scale, update_loss_scale
from jaxzero.models import Model, ModelParams, build_model
from jaxzero.models.sizes import param_count
from jaxzero.objective import loss_fn, step_weight
from jaxzero.offload import build_offload_trainer
from jaxzero.optim import (
    build_optimizer,
    global_norm,
    join_opt_state,
    learning_rate_schedule,
    split_opt_state,
)
from jaxzero.overrides import apply_overrides
from jaxzero.plan import OffloadPlan, resolve_plan, search
from jaxzero.plan.machine import Machine, detect_machine, gpu_bytes_before_backend
from jaxzero.plan.report import Decision
from jaxzero.state import StepMetrics, Trainer, TrainState, abstract_placed, with_checks
from jaxzero.write_fence import WriteFence

log = logging.getLogger(__name__)  # the library speaks through logging (`jaxzero.console`)


def averaged_grads(
    model: Model, params: ModelParams, batch: jax.Array, scale: jax.Array | None = None
) -> tuple[jax.Array, ModelParams]:
    """Mean loss and float32 gradients over `grad_accum` micro-batches of int32 (A, mb, S+1).

    The loss is the mean over the step's counted targets (`objective.step_weight` weighs each
    micro-batch's sum; without not-a-target marks, the mean of the micro-batches' means). One
    micro-batch is differentiated directly; more are summed in a `lax.scan` (one float32 gradient
    buffer, not A of them). With a loss `scale` (float16) the gradients are those of `scale * loss`
    (the caller unscales them); the loss returned is unscaled.
    """
    weight = step_weight(batch)
    if scale is None:
        value_and_grad = jax.value_and_grad(lambda p, window: loss_fn(model, p, window, weight))
    else:

        def scaled(p, window):
            loss = loss_fn(model, p, window, weight)
            return loss * scale, loss

        def value_and_grad(p, window):
            (_, loss), grads = jax.value_and_grad(scaled, has_aux=True)(p, window)
            return loss, grads

    if batch.shape[0] == 1:
        return value_and_grad(params, batch[0])

    def micro(carry, window):
        loss, grads = value_and_grad(params, window)
        return jax.tree.map(jnp.add, carry, (loss, grads)), None

    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    (loss, grads), _ = jax.lax.scan(micro, zeros, batch)
    return jax.tree.map(lambda x: x / batch.shape[0], (loss, grads))


def build_trainer(cfg: TrainConfig | None = None, mesh: Mesh | None = None, **overrides: Any) -> Trainer:
    """Validate `cfg` against the mesh and memory, and build the trainer its offload plan asks for.

    `cfg` defaults to the built-in default run; keyword `overrides` change single keys, with `__` for
    the dot: `build_trainer(model__name="gpt2-tiny", offload__optimizer="cpu")`. Offload keys left on
    `auto` (the default) are decided here by the planner (`jaxzero.plan.search`) for the mesh's
    devices, and `trainer.config` is the decided config. Nothing is allocated or compiled here;
    `trainer.init` and the first `trainer.step` do that. A run that cannot fit in host or accelerator
    memory fails here with the numbers (`jaxzero.memory`, or the planner's refusal). The trainer's
    `put_batch` and `put_eval_batch` check a batch's shape, dtype and token ids.
    """
    cfg = TrainConfig() if cfg is None else cfg
    if overrides:
        cfg = apply_overrides(cfg, {k.replace("__", "."): v for k, v in overrides.items()})
    return decide_and_build(cfg, mesh)[0]


def decide_and_build(cfg: TrainConfig, mesh: Mesh | None = None) -> tuple[Trainer, Decision | None]:
    """`build_trainer` of `cfg`, with the planner's decision for its `auto` offload keys (None when
    `cfg` names its placement itself): `python -m jaxzero.train` prints the decision's table."""
    validate(cfg)
    if mesh is None:  # before the first backend call, if this is it: XLA fixes its pools then
        runtime.claim_accelerator_memory()
        _size_pinned_pool(_one_device_batch(cfg))
    mesh = mesh if mesh is not None else placement.make_mesh()
    cfg = resolve_batch(cfg, mesh.size)
    validate(cfg, num_devices=mesh.size)
    processes = placement.process_count(mesh)
    sharing = placement.processes_on_this_host(mesh)  # a collective: every process calls it, here
    device = mesh.local_devices[0]  # memory stats exist only for this process's devices
    shapes = jax.eval_shape(build_model(cfg.model).init, jax.random.key(0))
    whole = placement.whole_params(shapes, mesh.size)
    decision = None
    if not search.concrete(cfg):
        machine = detect_machine(cfg, device, devices=mesh.size, processes=processes, local_processes=sharing)
        decision = search.decide(cfg, _agreed(machine), whole)
        cfg = decision.config
    plan = resolve_plan(cfg)
    need = memory.plan_memory(
        cfg, plan, devices=mesh.size, processes=processes, whole=whole, pool_cap=runtime.pinned_pool_cap()
    )
    unsplit = whole[0] + cfg.model.num_layers * whole[1] + whole[2]
    if mesh.size > 1 and (plan.zero_stage or plan.host_update) and unsplit > 0.1 * param_count(cfg.model):
        log.warning(
            f"warning: on {mesh.size} devices {unsplit / param_count(cfg.model):.0%} of the "
            "parameters are in arrays whose first axis does not divide by the device count, so every "
            "device (and process) keeps them whole; a device count dividing model.hidden_size, "
            "model.intermediate_size and model.vocab_size splits them."
        )
    if plan.host_update is not None:  # this process's share (a no-op if the pool was sized above)
        runtime.configure_pinned_pool(need)
    warning = runtime.check_fits(cfg, need, device, sharing=sharing)
    if warning:
        log.warning(warning)
    if plan.host_update is not None:
        reserve = memory.pinned_pool_reservation(need, device.platform)
        trainer = build_offload_trainer(cfg, mesh, plan=plan, pinned_reserve=reserve)
    else:
        trainer = build_resident_trainer(cfg, mesh, plan)
    return with_checks(trainer), decision


def _agreed(machine: Machine) -> Machine:
    """`machine` with each figure a process may see differently (free memory, cores) at its least
    over the run's processes, per process: every process then decides the same placement. (A
    collective with several processes: every process calls it.)"""
    if machine.processes == 1:
        return machine
    mine = [
        machine.gpu_bytes or 0,
        machine.host_share,
        machine.host_bw / machine.local_processes,
        machine.cores,
    ]
    # float32 in MiB and MB/s: exact enough, and what the collective carries without x64
    scale = np.array([2**20, 2**20, 10**6, 1], np.float64)
    every = multihost_utils.process_allgather((np.array(mine) / scale).astype(np.float32))  # (P, 4)
    gpu, share, bw, cores = np.asarray(every, np.float64).min(axis=0) * scale
    return dataclasses.replace(
        machine,
        gpu_bytes=None if machine.gpu_bytes is None else int(gpu),
        host_bytes=int(share) * machine.local_processes,
        host_bw=bw * machine.local_processes,
        cores=int(cores),
    )


def _one_device_batch(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with its batch resolved for one device, before the devices are known: each device's
    share of a micro-batch given per device (data.micro_batch_size) is exact, and with grad_accum
    derived, one device's accumulation bounds the real one from above. Unchanged when it cannot be."""
    if not cfg.data.micro_batch_size:
        return cfg
    try:
        return resolve_batch(cfg, 1)
    except ConfigError:  # consistent only for the real device count: checked once that is known
        d = cfg.data
        accum = d.grad_accum or d.batch_size // d.micro_batch_size
        one = dataclasses.replace(
            d, batch_size=d.micro_batch_size * accum, grad_accum=accum, micro_batch_size=0
        )
        return dataclasses.replace(cfg, data=one) if accum else cfg


def _size_pinned_pool(cfg: TrainConfig) -> None:
    """Size XLA's pinned host pool before JAX starts (`runtime.configure_pinned_pool`): for the
    offload plan `cfg` names, its whole need (which bounds any process's share); for one the
    planner will decide once it sees the devices, the need of the placement it decides for the GPU
    it will see, where that can be told before JAX starts (`machine.gpu_gib`, or one GPU that
    `nvidia-smi` reports), else the largest pinned need among the placements it may choose. (A pool
    sized for the largest may grow far past what the decided placement pins: the plan counts it.)"""
    if search.concrete(cfg):
        plan = resolve_plan(cfg)
        if plan.host_update is not None:
            runtime.configure_pinned_pool(memory.plan_memory(cfg, plan))
        return
    largest = _decided_before_backend(cfg) or search.largest_pinned_need(cfg)
    if largest is None or not largest.pinned:
        return
    try:
        runtime.configure_pinned_pool(largest)
    except ConfigError:
        # A pool fixed already (by the user, or a running backend) may still hold the placement
        # decided: the planner counts its cap, and the decided need is checked against it below.
        pass


def _decided_before_backend(cfg: TrainConfig) -> memory.MemoryPlan | None:
    """The memory plan of the placement the planner decides for `cfg` on the GPU `machine.gpu_gib`
    names or `machine.gpu_bytes_before_backend` finds, without starting JAX; None where neither tells
    the GPU, nothing is offloaded, or the planner refuses (the run's own decision then says why)."""
    gib = cfg.machine.gpu_gib
    if not gib:
        found = gpu_bytes_before_backend()
        if found is None:
            return None
        gib = found / memory.GiB
    sized = dataclasses.replace(cfg, machine=dataclasses.replace(cfg.machine, gpu_gib=gib))
    try:
        decision = search.decide(sized, detect_machine(sized, pool_fixed=False))
    except ConfigError:
        return None
    return decision.memory if decision.memory.pinned else None


def build_resident_trainer(cfg: TrainConfig, mesh: Mesh, plan: OffloadPlan | None = None) -> Trainer:
    """Everything in accelerator memory; one jitted step per optimizer update. The ZeRO stage of
    `plan` (default `resolve_plan(cfg)`, which must keep every unit's state on the accelerator) says
    what is split over the `data` mesh axis: 0 nothing (data parallel), 1 the optimizer state, 2
    also the gradients (reduce-scattered), 3 also the parameters (FSDP: all-gathered per use)."""
    plan = resolve_plan(cfg) if plan is None else plan
    if plan.host_update is not None:
        raise ValueError("build_resident_trainer needs a plan with accelerator-resident state")
    model = build_model(cfg.model)
    tx = build_optimizer(cfg.optimizer, cfg.schedule_steps)
    schedule = learning_rate_schedule(cfg.optimizer, cfg.schedule_steps)

    fp16 = cfg.model.compute_dtype == "float16"

    def fresh(params: ModelParams) -> TrainState:
        scale = init_loss_scale(cfg.fp16) if fp16 else None
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), scale)

    def init_state(key: jax.Array) -> TrainState:
        return fresh(model.init(key))

    shapes = jax.eval_shape(init_state, jax.random.key(0))
    state_sharding = TrainState(
        step=placement.replicated(mesh),
        params=placement.zero_shardings(mesh, shapes.params, plan.shards_weights),
        opt_state=placement.zero_shardings(mesh, shapes.opt_state, plan.shards_state),
        loss_scale=jax.tree.map(lambda _: placement.replicated(mesh), shapes.loss_scale),
    )
    grad_sharding = placement.zero_shardings(mesh, shapes.params, plan.shards_grads)
    batch_sharding = placement.train_batch_sharding(mesh)
    # Checkpoints hold the optimizer state per unit (the offload engine's layout), so a run saved by
    # either trainer resumes under the other.
    clipped = cfg.optimizer.grad_clip > 0

    def to_saved(state: TrainState) -> dict[str, Any]:
        saved = {
            "step": state.step,
            "params": state.params,
            "opt_state": split_opt_state(state.opt_state, clipped),
        }
        return saved if state.loss_scale is None else {**saved, "loss_scale": state.loss_scale}

    def from_saved(saved: dict[str, Any]) -> TrainState:
        saved = resolved(saved)  # every unit straight to its place on the accelerator
        opt_state = join_opt_state(saved["opt_state"], shapes.opt_state, clipped)
        return TrainState(saved["step"], saved["params"], opt_state, saved.get("loss_scale"))

    start_from = jax.jit(fresh, out_shardings=state_sharding)

    def split(grads: ModelParams) -> ModelParams:  # stage >= 2: a reduce-scatter, not an all-reduce
        return jax.lax.with_sharding_constraint(grads, grad_sharding)

    def train_step(state: TrainState, batch: jax.Array) -> tuple[TrainState, StepMetrics]:
        loss, grads = averaged_grads(model, state.params, batch)
        grads = split(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = StepMetrics(loss, global_norm(grads), jnp.asarray(schedule(state.step), jnp.float32))
        return TrainState(state.step + 1, params, opt_state), metrics

    def train_step_fp16(state: TrainState, batch: jax.Array) -> tuple[TrainState, StepMetrics]:
        """float16: a scaled loss; a step that overflows keeps params, optimizer state and step count."""
        ls = state.loss_scale
        loss, grads = averaged_grads(model, state.params, batch, ls.scale)
        grads = jax.tree.map(lambda g: g / ls.scale, split(grads))
        ok = all_finite(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731
        lr = jnp.asarray(schedule(state.step), jnp.float32)
        new = TrainState(
            state.step + ok.astype(jnp.int32),
            keep(params, state.params),
            keep(opt_state, state.opt_state),
            update_loss_scale(ls, ~ok, cfg.fp16),
        )
        return new, StepMetrics(loss, global_norm(grads), lr, ls.scale, ~ok)

    jitted_step = jax.jit(
        train_step_fp16 if fp16 else train_step,
        in_shardings=(state_sharding, batch_sharding),
        out_shardings=(state_sharding, placement.replicated(mesh)),
        donate_argnums=(0,),
    )
    fence = WriteFence()

    def step(state: TrainState, batch: jax.Array) -> tuple[TrainState, StepMetrics]:
        fence.wait_all()  # the step donates every array a checkpoint being written may still read
        return jitted_step(state, batch)

    eval_loss = jax.jit(
        lambda state, window: loss_fn(model, state.params, window),
        in_shardings=(state_sharding, placement.eval_batch_sharding(mesh)),
        out_shardings=placement.replicated(mesh),
    )
    return Trainer(
        config=cfg,
        plan=plan,
        model=model,
        mesh=mesh,
        optimizer=tx,
        init=jax.jit(init_state, out_shardings=state_sharding),
        init_from_params=lambda params: start_from(jax.device_put(resolved(params), state_sharding.params)),
        step=step,
        eval_loss=eval_loss,
        put_batch=partial(placement.put_train_batch, mesh=mesh),
        put_eval_batch=partial(placement.put_eval_batch, mesh=mesh),
        layout="resident",
        saved_state=lambda state: to_saved(state),
        abstract_saved_state=lambda: to_saved(abstract_placed(shapes, state_sharding)),
        from_saved_state=from_saved,
        fence=fence,
    )
