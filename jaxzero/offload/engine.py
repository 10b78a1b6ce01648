"""The offload trainer: a `Trainer` whose masters and optimizer state live in host RAM.

`build_offload_trainer` returns a `Trainer` with the same contract as the resident one; the state it
carries is an `OffloadState`. A step is

    loss, grads, norm = streamed.grads(read, batch, loss_scale)  # accelerator; grads land in pinned_host
    submitted = pipeline.submit(units, read, grads, norm, ...)   # host; one background update per unit

and returns as soon as the accelerator work is issued. The next step's forward pass waits for each
unit's update only when it reaches that unit (`jaxzero.offload.pipeline`).

Where each unit's arrays live and how the host update runs is the offload plan's (`jaxzero.plan`);
its shardings are `jaxzero.placement.OffloadPlacement`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxzero import placement as placement_lib
from jaxzero.config import ConfigError, TrainConfig
from jaxzero.deferred import Deferred, resolved
from jaxzero.loss_scale import init_loss_scale, update_loss_scale
from jaxzero.models import ModelParams, build_model, init_keys
from jaxzero.offload.device_update import DeviceOptimizer
from jaxzero.offload.disk import DISK_DIR, DiskStats, DiskStore, OnDisk
from jaxzero.offload.futures import OffloadState, done, weights_of
from jaxzero.offload.host_memory import global_from_local, release, reserve_pinned
from jaxzero.offload.host_optimizer import HostOptimizer, HostUnit
from jaxzero.offload.pipeline import Submitted, UpdatePipeline
from jaxzero.offload.streaming import StreamedModel
from jaxzero.offload.timeline import StepClock
from jaxzero.optim import build_optimizer
from jaxzero.plan import OffloadPlan, Tier, UnitPlan, UpdateMode, resolve_plan
from jaxzero.state import StepMetrics, Trainer, abstract_placed
from jaxzero.write_fence import WriteFence


def build_offload_trainer(
    cfg: TrainConfig, mesh: Mesh, *, plan: OffloadPlan | None = None, pinned_reserve: int = 0
) -> Trainer:
    """A `Trainer` for a plan whose units' state lives in host RAM (`offload.optimizer=cpu`, with
    `offload.params` none or cpu), over every device of `mesh` (ZeRO sharding: each process keeps and
    updates its devices' shards of the masters and optimizer state). `plan` defaults to
    `resolve_plan(cfg)`.

    `pinned_reserve`: bytes (this process's) to allocate and free in the pinned pool before the state's
    first pinned array, so that the pool grows at start-up, not inside a step
    (`jaxzero.memory.pinned_pool_reservation`)."""
    plan = resolve_plan(cfg) if plan is None else plan
    update = plan.host_update
    if update is None:
        raise ValueError(
            "build_offload_trainer needs a plan with host-resident state (offload.optimizer=cpu)"
        )
    model = build_model(cfg.model)
    where = placement_lib.offload_placement(mesh, plan)
    masters_shape = jax.eval_shape(model.init, jax.random.key(0))
    host = HostOptimizer(cfg.optimizer, cfg.schedule_steps, masters_shape, where, cfg.data.grad_accum)
    # Units whose masters and state the plan keeps on the accelerator are updated there.
    on_device = [u for u in plan.units if u.state is Tier.DEVICE]
    device = DeviceOptimizer(cfg.optimizer, cfg.schedule_steps, masters_shape, where, cfg.data.grad_accum)
    # Units whose masters and state the plan keeps on disk pass through host RAM for each update.
    disk = _disk_store(cfg, plan) if plan.disk_units else None
    streamed = StreamedModel(model, where, cfg.data.grad_accum, prefetch=plan.prefetch)
    fp16 = plan.compute_dtype == "float16"  # dynamic loss scaling
    clock = StepClock()
    fence = WriteFence()  # a checkpoint being written from the units' arrays (`jaxzero.write_fence`)
    pipeline = UpdatePipeline(host, plan, clock, disk, fence)
    # Masters are created unit by unit on the host: one compiled block init serves every block, and
    # the transient memory is one unit, not a second copy of the model.
    keys = jax.jit(partial(init_keys, num_layers=cfg.model.num_layers), out_shardings=where.host)

    def local_block(tree: Any) -> Any:  # this process's rows of each array (`local_rows`)
        return jax.tree.map(lambda x: x[where.local_rows(x.shape)], tree)

    init_unit = ModelParams(
        *(
            jax.jit(lambda k, f=f: local_block(f(k)), out_shardings=where.host)
            for f in (model.init_embed, model.init_block, model.init_head)
        )
    )
    increment = jax.jit(lambda step: step + 1)

    def put(value: Any, sharding: Any) -> jax.Array:  # the same NumPy value in every process
        return global_from_local(np.asarray(value), sharding, np.shape(value))

    one = put(np.float32(1.0), where.device)
    new_loss_scale = jax.jit(partial(init_loss_scale, cfg.fp16), out_shardings=where.device)
    # float16: whether the step overflowed is known on the accelerator (the norm is computed there),
    # so the step count and loss scale advance there too, with no host sync.
    advance_fp16 = jax.jit(
        lambda step, ls, norm: (
            step + jnp.isfinite(norm).astype(step.dtype),
            update_loss_scale(ls, ~jnp.isfinite(norm), cfg.fp16),
            ~jnp.isfinite(norm),
        )
    )

    def reserve_pool() -> None:  # before the first state's pinned arrays: the pool grows once
        nonlocal pinned_reserve
        if pinned_reserve:
            reserve_pinned(pinned_reserve, where.pool)
            pinned_reserve = 0

    def start_unit(u: UnitPlan, masters: Any, opt_state: Any = None) -> HostUnit:
        """One unit as a `HostUnit` where the plan keeps it, from this process's host blocks of its
        masters and optimizer state (None: fresh): host units stay where they are, the accelerator's
        are copied there, disk units are written to disk (and dropped from RAM)."""
        if u.state is Tier.DEVICE:
            return device.start(u, masters, opt_state)
        opt_state = host.init_unit(u, masters) if opt_state is None else opt_state
        weights = host.place_weights(u, masters)
        if u.state is Tier.HOST:
            return HostUnit(masters, opt_state, weights)
        weights = weights.result()  # cast before the masters leave RAM
        disk.create(u.position, (masters, opt_state))
        release((masters, opt_state))
        return HostUnit(OnDisk(u.position), OnDisk(u.position), weights)

    def start_as_made(made: Iterator[tuple[Any, Any]]) -> ModelParams:
        """Every unit as a `HostUnit` (`start_unit`) from its (masters, optimizer state or None:
        fresh), this process's blocks, made one at a time in forward order: a unit the accelerator or
        the disk keeps goes there as soon as it is made, so that host RAM never holds every unit's
        masters at once (the plan counts only the host units')."""
        reserve_pool()  # before the first copy to the accelerator, which may stage in the pool
        units = [start_unit(u, m, o) for u, (m, o) in zip(plan.units, made)]
        # Host units' weights are cast and placed in the background, all at once.
        return _unflat([u._replace(weights=_result(u.weights)) for u in units])

    def fresh_as_made(made: Iterator[Any]) -> OffloadState:
        """A fresh state from each unit's masters, made one at a time (`start_as_made`)."""
        step = put(np.zeros((), np.int32), where.device) if fp16 else jax.device_put(np.int32(0), where.host)
        scale = new_loss_scale() if fp16 else None
        return OffloadState.of_units(step, start_as_made((m, None) for m in made), scale)

    def init(key: jax.Array) -> OffloadState:
        # Created on the host directly: the key moves to the CPU backend, never the state to the GPU.
        k_embed, k_blocks, k_head = keys(jax.device_put(key, where.host))
        made = [(init_unit.embed, k_embed), *((init_unit.blocks, k) for k in k_blocks)]
        made.append((init_unit.head, k_head))
        return fresh_as_made(f(k) for f, k in made)

    def init_from_params(params: ModelParams) -> OffloadState:
        # NumPy (or fully addressable) float32 masters -> this process's block on the CPU backend,
        # unit by unit, each source dropped once placed (the caller passes its only reference): the
        # load peaks at the masters plus one unit, not at two or three copies of every master.
        sources = _flat(params)
        del params

        def taken(i: int) -> Any:  # unit i's source, no longer held here
            source, sources[i] = sources[i], None
            return source

        def on_host(source: Any) -> Any:  # a deferred unit is read now
            rows = jax.tree.map(
                lambda x: np.array(np.asarray(x)[where.local_rows(np.shape(x))]), resolved(source)
            )
            return jax.device_put(rows, where.host)

        return fresh_as_made(on_host(taken(u.position)) for u in plan.units)

    # The strategies are chosen here, once: float16 or not, overlapped or delayed.
    if fp16:

        def loss_scale_of(state: OffloadState) -> jax.Array:
            return state.loss_scale.scale

        def advance(state: OffloadState, loss, norm, lr) -> tuple[Any, Any, StepMetrics]:
            next_step, next_ls, skipped = advance_fp16(state.step, state.loss_scale, norm)
            return next_step, next_ls, StepMetrics(loss, norm, lr, state.loss_scale.scale, skipped)

    else:

        def loss_scale_of(state: OffloadState) -> jax.Array:
            return one  # no loss scale: the gradients are those of the loss itself

        def advance(state: OffloadState, loss, norm, lr) -> tuple[Any, Any, StepMetrics]:
            return increment(state.step), None, StepMetrics(loss, norm, lr)

    if update.mode is UpdateMode.DELAYED:  # the next pass reads the weights before this update

        def next_read(state: OffloadState, submitted) -> ModelParams:
            return jax.tree.map(weights_of, state.units)

    else:  # the next pass reads the new weights, waiting for each unit's

        def next_read(state: OffloadState, submitted) -> ModelParams:
            return submitted.weights

    def update_on_device(state: OffloadState, grads: ModelParams, norm, loss_scale) -> list[HostUnit | None]:
        """Issue the update of each unit whose state is on the accelerator (no host sync)."""
        units, g = _flat(state.units), _flat(grads)
        updated: list[HostUnit | None] = [None] * len(units)
        for u in on_device:
            k = u.position
            old = units[k].result()
            fence.release(k)  # host sync with a checkpoint writer, during a save: the update donates them
            updated[k] = device.update(u, old, g[k], norm, loss_scale)  # donates the old masters
        return updated

    def step(state: OffloadState, batch: jax.Array) -> tuple[OffloadState, StepMetrics]:
        loss_scale = loss_scale_of(state)
        loss, grads, norm = streamed.grads(state.read, batch, loss_scale, clock)
        on_accelerator = update_on_device(state, grads, norm, loss_scale)
        submitted = _merged(pipeline.submit(state.units, state.read, grads, norm, loss_scale), on_accelerator)
        next_step, next_ls, metrics = advance(state, loss, norm, host.lr(state.step))
        new_state = OffloadState(next_step, submitted.units, next_read(state, submitted), next_ls)
        state.consumed = True  # as the resident step's donation does: the old state is gone
        return new_state, metrics

    def saved_shapes() -> dict[str, Any]:
        shapes = {
            "step": jax.ShapeDtypeStruct((), np.int32),
            "params": masters_shape,
            "opt_state": host.state_shapes(),
        }
        if fp16:
            shapes["loss_scale"] = jax.eval_shape(partial(init_loss_scale, cfg.fp16))
        return shapes

    def saved_state(state: OffloadState) -> dict[str, Any]:
        """Waits for the pending host updates (a host sync). Host units are saved from host RAM, each
        process's blocks seen as global arrays over the processes (`OffloadPlacement.saved`); the
        accelerator's units as they are, global arrays that the checkpoint copies out one unit at a
        time; disk units as `Deferred` reads (`jaxzero.deferred.resolved` reads them)."""
        units = state.resolved()
        params, opt_state = units.params, units.opt_state
        shapes = saved_shapes()

        def as_global(x: Any, sharding: Any, shape: Any) -> jax.Array:  # this process's block
            return jax.make_array_from_single_device_arrays(shape.shape, sharding, [x])

        def on_disk(u: UnitPlan, s_params: Any, s_opt: Any) -> tuple[Deferred, Deferred]:
            """A disk unit's masters and state, read (together) when a checkpoint writes them."""
            read = disk.reader(u.position)  # as of now: its last update's write-back first

            def both() -> tuple[Any, Any]:
                p, o = jax.device_put(read(), where.host)
                return (
                    jax.tree.map(as_global, p, where.saved(s_params), s_params),
                    jax.tree.map(as_global, o, where.saved(s_opt), s_opt),
                )

            return Deferred(both, 0, s_params), Deferred(both, 1, s_opt)

        def units_saved(tree: ModelParams, shapes_tree: ModelParams) -> ModelParams:
            def one(u: UnitPlan, t: Any, s: Any) -> Any:
                if u.state is Tier.DEVICE or t is None:  # None: a disk unit, read below
                    return t
                return jax.tree.map(as_global, t, where.saved(s), s)

            return _map_units(plan, one, tree, shapes_tree)

        p_saved = units_saved(_map_units(plan, _no_disk, params), shapes["params"])
        o_saved = units_saved(_map_units(plan, _no_disk, opt_state), shapes["opt_state"])
        if disk is not None:  # read when written: host RAM holds one disk unit at a time
            p_flat, o_flat = _flat(p_saved), _flat(o_saved)
            for u, sp, so in zip(plan.units, _flat(shapes["params"]), _flat(shapes["opt_state"])):
                if u.state is Tier.DISK:
                    p_flat[u.position], o_flat[u.position] = on_disk(u, sp, so)
            p_saved, o_saved = _unflat(p_flat), _unflat(o_flat)

        saved = {
            "step": as_global(_on_host(state.step), where.saved(shapes["step"]), shapes["step"]),
            "params": p_saved,
            "opt_state": o_saved,
        }
        if state.loss_scale is not None:
            saved["loss_scale"] = jax.tree.map(
                lambda x, t, s: as_global(_on_host(x), t, s),
                state.loss_scale,
                where.saved(shapes["loss_scale"]),
                shapes["loss_scale"],
            )
        return saved

    def _on_host(x: jax.Array) -> jax.Array:  # a replicated scalar -> this process's host copy
        return jax.device_put(np.asarray(x.addressable_data(0)), where.host)

    def abstract_saved_state() -> dict[str, Any]:
        """Where a restore puts each array: host and disk units' in host RAM (this process's block),
        the accelerator's units' straight to their place there (`DeviceOptimizer.targets`)."""
        shapes = saved_shapes()
        placed = abstract_placed(shapes, where.saved(shapes))
        for key, target in (("params", 0), ("opt_state", 1)):

            def one(u: UnitPlan, p: Any, s: Any, target: int = target) -> Any:
                return abstract_placed(s, device.targets[u.kind][target]) if u.state is Tier.DEVICE else p

            placed[key] = _map_units(plan, one, placed[key], shapes[key])
        return placed

    def from_saved_state(saved: dict[str, Any]) -> OffloadState:
        reserve_pool()

        def local(tree: Any) -> Any:  # this process's blocks
            return jax.tree.map(lambda x: x.addressable_data(0), tree)

        step, scale = local(saved["step"]), local(saved.get("loss_scale"))
        if fp16:  # the step count and loss scale advance on the accelerator
            step = put(np.asarray(step), where.device)
            scale = jax.tree.map(lambda x: put(np.asarray(x), where.device), scale)
        params, opt_state = _flat(saved["params"]), _flat(saved["opt_state"])
        del saved

        def taken(u: UnitPlan) -> tuple[Any, Any]:  # read now if the restore deferred it; not held here
            p, o = resolved((params[u.position], opt_state[u.position]))
            params[u.position] = opt_state[u.position] = None
            return (p, o) if u.state is Tier.DEVICE else (local(p), local(o))  # the accelerator's placed

        units = start_as_made(taken(u) for u in plan.units)
        return OffloadState.of_units(step, units, scale)

    def eval_loss(state: OffloadState, window: jax.Array) -> jax.Array:
        # The newest weights, each waited for when the pass reaches it.
        return streamed.loss(jax.tree.map(weights_of, state.units), window[None])

    def timings(wall: float, steps: int) -> dict[str, float]:
        """Per-step breakdown (`jaxzero.state.BREAKDOWN`) of what finished since the last call."""
        n = max(steps, 1)
        times = {k: v / n for k, v in clock.summary(wall).items()}
        counts = pipeline.take_counts()
        io = disk.take_stats() if disk is not None else DiskStats(0, 0, 0.0, 0.0, 0.0)
        return {
            **times,
            "speculated": counts.speculated / n,
            "rolled_back": counts.rolled_back / n,
            "two_pass_units": counts.two_passed / n,
            "disk_read_s": io.read_s / n,
            "disk_write_s": io.write_s / n,
            "wait_disk_s": io.wait_s / n,
            "disk_gb": (io.read_bytes + io.written_bytes) / 1e9 / n,
        }

    return Trainer(
        config=cfg,
        plan=plan,
        model=model,
        mesh=mesh,
        optimizer=build_optimizer(cfg.optimizer, cfg.schedule_steps),
        init=init,
        init_from_params=init_from_params,
        step=step,
        eval_loss=eval_loss,
        put_batch=partial(placement_lib.put_train_batch, mesh=mesh),
        put_eval_batch=partial(placement_lib.put_eval_batch, mesh=mesh),
        layout="offload",
        saved_state=saved_state,
        abstract_saved_state=abstract_saved_state,
        from_saved_state=from_saved_state,
        timings=timings,
        close=disk.close if disk is not None else _nothing,
        fence=fence,
    )


def _flat(tree: ModelParams) -> list[Any]:
    """A `ModelParams`' units in forward order (embedding, blocks, head): index = `UnitPlan.position`."""
    return [tree.embed, *tree.blocks, tree.head]


def _unflat(units: list[Any]) -> ModelParams:
    return ModelParams(units[0], tuple(units[1:-1]), units[-1])


def _map_units(plan: OffloadPlan, f: Callable[..., Any], *trees: ModelParams) -> ModelParams:
    """`f(unit, *its subtrees)` for each unit of `plan`, over trees with a subtree per unit."""
    return _unflat([f(u, *ts) for u, *ts in zip(plan.units, *map(_flat, trees))])


def _merged(submitted: Submitted, on_accelerator: list[HostUnit | None]) -> Submitted:
    """The host's Futures with the accelerator's updates in the places the host left empty."""
    pairs = zip(_flat(submitted.units), _flat(submitted.weights), on_accelerator)
    units, weights = zip(*((h, w) if d is None else (done(d), done(d.weights)) for h, w, d in pairs))
    units, weights = list(units), list(weights)
    return Submitted(_unflat(units), _unflat(weights))


def _nothing() -> None:
    pass


def _result(x: Any) -> Any:
    return x.result() if isinstance(x, Future) else x


def _disk_store(cfg: TrainConfig, plan: OffloadPlan) -> DiskStore:
    """The disk tier's store: its working directory under `offload.disk_path`, else the run's."""
    if not (cfg.offload.disk_path or cfg.run_dir):
        raise ConfigError(
            "offload.optimizer=disk needs a directory for its working state: set offload.disk_path=DIR "
            "(a local disk) or run_dir."
        )
    base = Path(cfg.offload.disk_path or Path(cfg.run_dir) / DISK_DIR)
    if jax.process_count() > 1:  # each process keeps its own blocks
        base = base / f"process-{jax.process_index()}"
    return DiskStore(base, [u.position for u in plan.disk_units], plan.disk_slots)


def _no_disk(u: UnitPlan, tree: Any) -> Any:
    """A unit's subtree, or None for a disk unit (its `OnDisk` markers are not arrays)."""
    return None if u.state is Tier.DISK else tree
