"""The offload trainer's state to and from its saved form (`CheckpointAdapter`).

The saved form is every trainer's ({"step", "params", "opt_state"} and, under float16, "loss_scale";
the optimizer state one per unit), whatever the plan keeps where: a run saved by one placement
resumes under another. Host units are saved from host RAM, each process's blocks seen as global
arrays over one CPU device per process (`OffloadPlacement.saved`); the accelerator's units as they
are; disk units as `Deferred` reads, one unit in RAM at a time. This module does no I/O of its own:
`jaxzero.storage.checkpoint` writes and reads the saved form.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

from jaxzero.models import ModelParams
from jaxzero.numerics.loss_scale import init_loss_scale
from jaxzero.offload.context import EngineContext, map_units, no_disk, put_everywhere
from jaxzero.offload.futures import OffloadState
from jaxzero.offload.state_init import StateInit
from jaxzero.plan import OffloadPlan, Tier, UnitPlan
from jaxzero.plan.placement import OffloadPlacement
from jaxzero.primitives.deferred import Deferred, resolved
from jaxzero.state import abstract_placed


class CheckpointAdapter:
    """`saved_state`, `abstract_saved_state` and `from_saved_state` of the offload trainer over
    `ctx`; a restored state is placed unit by unit by `start`."""

    def __init__(self, ctx: EngineContext, start: StateInit):
        self.ctx = ctx
        self._start = start

    def saved_shapes(self) -> dict[str, Any]:
        """The saved form's global shapes (`ShapeDtypeStruct`s): int32 step, float32 masters, the
        per-unit optimizer state, and the float16 loss scale where there is one."""
        ctx = self.ctx
        shapes = {
            "step": jax.ShapeDtypeStruct((), np.int32),
            "params": ctx.masters_shape,
            "opt_state": ctx.host.state_shapes(),
        }
        if ctx.fp16:
            shapes["loss_scale"] = jax.eval_shape(partial(init_loss_scale, ctx.cfg.fp16))
        return shapes

    def saved_state(self, state: OffloadState) -> dict[str, Any]:
        """`state` in its saved form; the state is not consumed. Waits for the pending host updates
        (a host sync). Host units are global arrays over the processes' CPU devices, the
        accelerator's units global arrays that the checkpoint copies out one unit at a time, disk
        units `Deferred` reads (`jaxzero.primitives.deferred.resolved` reads them)."""
        ctx, plan, where = self.ctx, self.ctx.plan, self.ctx.where
        units = state.resolved()
        params, opt_state = units.params, units.opt_state
        shapes = self.saved_shapes()
        p_saved = self._units_saved(map_units(plan, no_disk, params), shapes["params"])
        o_saved = self._units_saved(map_units(plan, no_disk, opt_state), shapes["opt_state"])
        if ctx.disk is not None:  # read when written: host RAM holds one disk unit at a time
            p_flat, o_flat = p_saved.units(), o_saved.units()
            for u, sp, so in zip(plan.units, shapes["params"].units(), shapes["opt_state"].units()):
                if u.state is Tier.DISK:
                    p_flat[u.position], o_flat[u.position] = self._on_disk(u, sp, so)
            p_saved, o_saved = ModelParams.from_units(p_flat), ModelParams.from_units(o_flat)

        saved = {
            "step": _as_global(self._on_host(state.step), where.saved(shapes["step"]), shapes["step"]),
            "params": p_saved,
            "opt_state": o_saved,
        }
        if state.loss_scale is not None:
            saved["loss_scale"] = jax.tree.map(
                lambda x, t, s: _as_global(self._on_host(x), t, s),
                state.loss_scale,
                where.saved(shapes["loss_scale"]),
                shapes["loss_scale"],
            )
        return saved

    def abstract_saved_state(self) -> dict[str, Any]:
        """The restore target: where a restore puts each array. Host and disk units' in host RAM
        (this process's block), the accelerator's units' straight to their place there
        (`DeviceOptimizer.targets`)."""
        ctx = self.ctx
        shapes = self.saved_shapes()
        placed = abstract_placed(shapes, ctx.where.saved(shapes))
        for key, target in (("params", 0), ("opt_state", 1)):
            placed[key] = map_units(ctx.plan, partial(self._placed_unit, target), placed[key], shapes[key])
        return placed

    def from_saved_state(self, saved: dict[str, Any]) -> OffloadState:
        """A state from a restored saved form (`abstract_saved_state`'s placement; units may be
        `Deferred`). Each unit's arrays are dropped from `saved` once placed: the caller passes its
        only reference."""
        ctx, where = self.ctx, self.ctx.where
        self._start.reserve_pool()
        step, scale = _local(saved["step"]), _local(saved.get("loss_scale"))
        if ctx.fp16:  # the step count and loss scale advance on the accelerator
            step = put_everywhere(np.asarray(step), where.device)
            scale = jax.tree.map(lambda x: put_everywhere(np.asarray(x), where.device), scale)
        params, opt_state = saved["params"].units(), saved["opt_state"].units()
        del saved
        units = self._start.start(_restored_units(ctx.plan, params, opt_state))
        return OffloadState.of_units(step, units, scale)

    def _units_saved(self, tree: ModelParams, shapes: ModelParams) -> ModelParams:
        """Each host unit's arrays as global arrays; the accelerator's as they are; None (a disk
        unit) left for `_on_disk`."""
        return map_units(self.ctx.plan, self._unit_saved, tree, shapes)

    def _unit_saved(self, u: UnitPlan, tree: Any, shapes: Any) -> Any:
        if u.state is Tier.DEVICE or tree is None:
            return tree
        return jax.tree.map(_as_global, tree, self.ctx.where.saved(shapes), shapes)

    def _on_disk(self, u: UnitPlan, s_params: Any, s_opt: Any) -> tuple[Deferred, Deferred]:
        """A disk unit's masters and state, read (together: one read serves both halves) when a
        checkpoint writes them."""
        read = self.ctx.disk.reader(u.position)  # as of now: its last update's write-back first
        both = partial(_read_disk_unit, self.ctx.where, read, s_params, s_opt)
        return Deferred(both, 0, s_params), Deferred(both, 1, s_opt)

    def _placed_unit(self, target: int, u: UnitPlan, placed: Any, shapes: Any) -> Any:
        """A unit's restore target: the accelerator's placement (`target` 0: masters, 1: optimizer
        state) for a unit the accelerator keeps, else `placed`."""
        if u.state is Tier.DEVICE:
            return abstract_placed(shapes, self.ctx.device.targets[u.kind][target])
        return placed

    def _on_host(self, x: jax.Array) -> jax.Array:
        """A replicated scalar as this process's copy on the CPU backend."""
        return jax.device_put(np.asarray(x.addressable_data(0)), self.ctx.where.host)


def _as_global(x: jax.Array, sharding: Sharding, shape: jax.ShapeDtypeStruct) -> jax.Array:
    """This process's block `x` as the global array of `shape` over the processes' `sharding`."""
    return jax.make_array_from_single_device_arrays(shape.shape, sharding, [x])


def _local(tree: Any) -> Any:
    """This process's block of each (restored) array of `tree`."""
    return jax.tree.map(lambda x: x.addressable_data(0), tree)


def _read_disk_unit(
    where: OffloadPlacement, read: Callable[[], Any], s_params: Any, s_opt: Any
) -> tuple[Any, Any]:
    """A disk unit's (masters, optimizer state), read now, as global arrays over the processes."""
    p, o = jax.device_put(read(), where.host)
    return (
        jax.tree.map(_as_global, p, where.saved(s_params), s_params),
        jax.tree.map(_as_global, o, where.saved(s_opt), s_opt),
    )


def _restored_units(plan: OffloadPlan, params: list[Any], opt_state: list[Any]) -> Iterator[tuple[Any, Any]]:
    """Each unit's restored (masters, optimizer state) in forward order, read now if the restore
    deferred it, and no longer held by the lists: the accelerator's as placed, the others as this
    process's blocks."""
    for u in plan.units:
        yield _take(u, params, opt_state)


def _take(u: UnitPlan, params: list[Any], opt_state: list[Any]) -> tuple[Any, Any]:
    p, o = resolved((params[u.position], opt_state[u.position]))
    params[u.position] = opt_state[u.position] = None
    return (p, o) if u.state is Tier.DEVICE else (_local(p), _local(o))
