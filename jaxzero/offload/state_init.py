"""The offload trainer's state made: fresh from a key, from given masters, or from restored arrays.

Every path goes unit by unit in forward order (`StateInit.start`): a unit is made (or read) on the
host, then put where the plan keeps it, before the next is made, so host RAM never holds every
unit's masters at once. The pinned pool grows once, before the state's first pinned array
(`StateInit.reserve_pool`).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

import jax
import numpy as np

from jaxzero.models import ModelParams, init_keys
from jaxzero.numerics.loss_scale import init_loss_scale
from jaxzero.offload.context import EngineContext, put_everywhere, result
from jaxzero.offload.disk import OnDisk
from jaxzero.offload.futures import OffloadState
from jaxzero.offload.host_memory import release, reserve_pinned
from jaxzero.offload.host_optimizer import HostUnit
from jaxzero.plan import Tier, UnitPlan
from jaxzero.plan.placement import OffloadPlacement
from jaxzero.primitives.deferred import resolved


class StateInit:
    """Makes an `OffloadState` where `ctx.plan` keeps each unit.

    pinned_reserve: bytes (this process's) to allocate and free in the pinned pool before the first
    state's first pinned array, so that the pool grows at start-up, not inside a step
    (`jaxzero.planner.memory.pinned_pool_reservation`); 0 for none.
    """

    # The jitted functions made here close over the placement, never over `self`: a part holds no
    # reference cycle, so a dropped trainer is freed at once.
    def __init__(self, ctx: EngineContext, pinned_reserve: int = 0):
        self.ctx = ctx
        self._reserve = pinned_reserve
        where, model = ctx.where, ctx.model
        # Masters are created unit by unit on the host: one compiled block init serves every block,
        # and the transient memory is one unit, not a second copy of the model.
        self._keys = jax.jit(
            partial(init_keys, num_layers=ctx.cfg.model.num_layers), out_shardings=where.host
        )
        self._init_unit = ModelParams(
            *(
                jax.jit(lambda k, f=f: _local_block(where, f(k)), out_shardings=where.host)
                for f in (model.init_embed, model.init_block, model.init_head)
            )
        )
        self._new_loss_scale = jax.jit(partial(init_loss_scale, ctx.cfg.fp16), out_shardings=where.device)

    def reserve_pool(self) -> None:
        """Grow the pinned pool by the reserve, once: before the first state's pinned arrays."""
        if self._reserve:
            reserve_pinned(self._reserve, self.ctx.where.pool)
            self._reserve = 0

    def init(self, key: jax.Array) -> OffloadState:
        """A fresh state from a PRNG key: the masters made on the host, one unit at a time."""
        # Created on the host directly: the key moves to the CPU backend, never the state to the GPU.
        k_embed, k_blocks, k_head = self._keys(jax.device_put(key, self.ctx.where.host))
        init_unit = self._init_unit
        made = [(init_unit.embed, k_embed), *((init_unit.blocks, k) for k in k_blocks)]
        made.append((init_unit.head, k_head))
        return self.fresh(f(k) for f, k in made)

    def init_from_params(self, params: ModelParams) -> OffloadState:
        """A fresh state from float32 masters: NumPy (or fully addressable) arrays, or units
        `Deferred` until read. Each unit's source is dropped once placed (the caller passes its only
        reference): the load peaks at the masters plus one unit, not at two or three copies."""
        sources = params.units()
        del params

        def taken(i: int) -> Any:  # unit i's source, no longer held here
            source, sources[i] = sources[i], None
            return source

        return self.fresh(self._on_host(taken(u.position)) for u in self.ctx.plan.units)

    def _on_host(self, source: Any) -> Any:
        """One unit's masters (read now if deferred) as this process's block on the CPU backend."""
        where = self.ctx.where
        rows = jax.tree.map(
            lambda x: np.array(np.asarray(x)[where.local_rows(np.shape(x))]), resolved(source)
        )
        return jax.device_put(rows, where.host)

    def fresh(self, made: Iterator[Any]) -> OffloadState:
        """A fresh state (step 0, a new loss scale under float16) from each unit's masters, this
        process's blocks on the CPU backend, made one at a time in forward order (`start`)."""
        ctx = self.ctx
        if ctx.fp16:  # the step count advances on the accelerator
            step = put_everywhere(np.zeros((), np.int32), ctx.where.device)
        else:
            step = jax.device_put(np.int32(0), ctx.where.host)
        scale = self._new_loss_scale() if ctx.fp16 else None
        return OffloadState.of_units(step, self.start((m, None) for m in made), scale)

    def start(self, made: Iterator[tuple[Any, Any]]) -> ModelParams:
        """Every unit as a `HostUnit` (`start_unit`) from its (masters, optimizer state or None:
        fresh), made one at a time in forward order: a unit the accelerator or the disk keeps goes
        there as soon as it is made, so that host RAM never holds every unit's masters at once (the
        plan counts only the host units')."""
        self.reserve_pool()  # before the first copy to the accelerator, which may stage in the pool
        units = [self.start_unit(u, m, o) for u, (m, o) in zip(self.ctx.plan.units, made)]
        # Host units' weights are cast and placed in the background, all at once.
        return ModelParams.from_units([u._replace(weights=result(u.weights)) for u in units])

    def start_unit(self, u: UnitPlan, masters: Any, opt_state: Any = None) -> HostUnit:
        """One unit as a `HostUnit` where the plan keeps it, from this process's host blocks of its
        masters and optimizer state (None: fresh): host units stay where they are, the accelerator's
        are copied there, disk units are written to disk (and dropped from RAM). A host or disk
        unit's weights may still be a `Future` (cast in the background)."""
        ctx = self.ctx
        if u.state is Tier.DEVICE:
            return ctx.device.start(u, masters, opt_state)
        opt_state = ctx.host.init_unit(u, masters) if opt_state is None else opt_state
        weights = ctx.host.place_weights(u, masters)
        if u.state is Tier.HOST:
            return HostUnit(masters, opt_state, weights)
        weights = weights.result()  # cast before the masters leave RAM
        ctx.disk.create(u.position, (masters, opt_state))
        release((masters, opt_state))
        return HostUnit(OnDisk(u.position), OnDisk(u.position), weights)


def _local_block(where: OffloadPlacement, tree: Any) -> Any:
    """This process's rows of each array of `tree` (`OffloadPlacement.local_rows`); traced."""
    return jax.tree.map(lambda x: x[where.local_rows(x.shape)], tree)
